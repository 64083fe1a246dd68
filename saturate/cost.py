"""The cost model: per-iteration training time, communication and memory of a PCG node.

Conventions (docs/plan-schema.md repeats them):

* Time of a training step = forward + backward + optimizer update, summed
  over nodes (no overlap of compute and communication is assumed).
* Compute runs on local pieces (SPMD). FLOPs and bytes follow from the
  operator's index semantics (`work`); the local share divides the global
  work by the degrees spread inference (`dsl.spread.infer_compute`) gives
  every index variable. Time is the roofline max(FLOPs/peak, bytes/bandwidth).
  Backward = 2 x forward (the usual convention: two products per product).
* Parallel operators, as in DESIGN section 2: partition fwd local slice / bwd
  all-gather of the gradient; combine fwd all-gather / bwd slice; replicate
  fwd none / bwd all-reduce of the gradient; reduce fwd all-reduce / bwd none.
  Graph inputs have no gradient. A weight read through `partition` is stored
  sharded (no communication at all); a weight read through `replicate`
  needs its gradient all-reduced every step: the gradient synchronisation.
* Collectives are ring collectives, alpha-beta: all-reduce of n elements over
  p devices takes 2(p-1) alpha + 2(p-1)/p n bytes/bw; all-gather
  (p-1) alpha + (p-1)/p n bytes/bw, on the intra-node link when the group fits
  in a node, else the inter-node link.
* Communication volume (`comm_elements`) is the number of elements SENT per
  step, summed over all devices (a tensor with fewer pieces than devices is
  held redundantly, and each replica set runs its own collective): a ring all-reduce of n elements over p
  devices sends 2(p-1)/p n per device, 2(p-1) n in all; an all-gather of a
  tensor of n elements sends (p-1)/p n per device, (p-1) n in all. With this
  convention data parallelism of the 2-layer MLP on 2 devices sends
  2 * (784*512 + 512*10) = 813,056 gradient elements per step.
* Memory per device (an upper bound: every node's piece is counted as if it
  lived on every device): activations kept for backward (each node's output
  piece), and for weights 16 bytes per local element with fp32 Adam
  (parameter, gradient, two moments), charged to the node that reads the
  weight leaf in the layout it reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import to_poly
from parsat.dsl.instantiate import OpInstance, index_bounds
from parsat.dsl.spread import infer_compute
from parsat.ir.machine import Machine
from parsat.ir.pcg import Layout

BACKWARD_FACTOR = 2.0        # backward FLOPs = 2 x forward
ADAM_STATE_BYTES = 16        # fp32 param + grad + 2 moments, per element
ADAM_TRAFFIC_BYTES = 28      # read p, g, m, v; write p, m, v (fp32)


@dataclass(frozen=True)
class NodeCost:
    """What one node costs per training step (times in seconds)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    comm_s: float = 0.0
    comm_elements: int = 0
    grad_sync_elements: int = 0
    memory_bytes: int = 0
    flops: float = 0.0
    collectives: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=(), compare=False)

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s + self.comm_s

    def to_dict(self, dtype_bytes: int) -> dict:
        return {"time_s": self.time_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "optimizer_s": self.optimizer_s, "comm_s": self.comm_s, "comm_elements": self.comm_elements,
                "comm_bytes": self.comm_elements * dtype_bytes, "grad_sync_elements": self.grad_sync_elements,
                "memory_bytes": self.memory_bytes, "flops": self.flops, "collectives": list(self.collectives)}


# ---------------------------------------------------------------- index semantics


def work(instance: OpInstance) -> tuple[int, int]:
    """Global (FLOPs, elements touched) of one forward application, from the semantics.

    Every distinct subexpression of the body is evaluated once per value of
    the index variables it depends on (loop-invariant code is hoisted, as a
    compiler would): its cost is its own arithmetic times the product of the
    ranges of its free index variables. A `sum` adds `bound` values per
    evaluation. Elements touched = all inputs + the output.
    """
    bounds = {k: int(v.evaluate({})) for k, v in index_bounds(instance).items()}
    env = instance.size_env()
    seen: dict[ast.Expr, frozenset[str]] = {}

    def free(expr: ast.Expr) -> frozenset[str]:
        if expr in seen:
            return seen[expr]
        if isinstance(expr, ast.Name):
            out = frozenset({expr.id}) & frozenset(bounds)
        elif isinstance(expr, ast.Sum):
            out = free(expr.body) - {expr.var}
        else:
            out = frozenset()
            for child in ast.children(expr):
                out |= free(child)
        seen[expr] = out
        return out

    flops = 0
    counted: set[ast.Expr] = set()

    def visit(expr: ast.Expr) -> None:
        nonlocal flops
        if expr in counted:
            return
        counted.add(expr)
        vars_ = free(expr)
        reps = prod(bounds[v] for v in vars_)
        if isinstance(expr, ast.Sum):
            flops += reps * int(to_poly(expr.bound, env).evaluate({}))
            visit(expr.body)
            return
        if isinstance(expr, (ast.BinOp, ast.Neg, ast.Call, ast.Compare, ast.BoolOp, ast.Not, ast.IfThenElse)):
            flops += reps
        if isinstance(expr, ast.Access):
            return  # index arithmetic is addressing, not FLOPs
        for child in ast.children(expr):
            visit(child)

    visit(instance.body)
    elements = sum(prod(int(d.evaluate({})) for d in s) for s in instance.input_shapes)
    elements += prod(int(d.evaluate({})) for d in instance.output_shape)
    return flops, elements


# ----------------------------------------------------------------- collectives


def _all_reduce(machine: Machine, p: int, n: int) -> tuple[float, int]:
    bw, alpha = machine.link(p)
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * machine.dtype_bytes / bw, 2 * (p - 1) * n


def _all_gather(machine: Machine, p: int, n: int) -> tuple[float, int]:
    """n: elements of the gathered (output) piece."""
    bw, alpha = machine.link(p)
    return (p - 1) * alpha + (p - 1) / p * n * machine.dtype_bytes / bw, (p - 1) * n


# -------------------------------------------------------------------- node cost


def compute_cost(instance: OpInstance, inputs: Sequence[Layout], output: Layout, machine: Machine,
                 weight_inputs: Sequence[bool]) -> NodeCost:
    """A compute operator on local pieces; weights read directly are stored whole."""
    inferred = infer_compute(instance, [l.to_spread() for l in inputs])
    problems = list(inferred.problems)
    got = Layout(tuple(int(d.evaluate({})) for d in inferred.spread.shard), int(inferred.spread.copy.evaluate({})),
                 int(inferred.spread.sum.evaluate({})))
    if not problems and got != output:
        problems.append(f"{instance.name}: spread inference gives {got}, the e-graph says {output}")
    flops, _ = work(instance)
    split = prod(int(d.evaluate({})) for d in inferred.var_degrees.values()) or 1
    local_flops = flops / split
    shapes = [tuple(int(d.evaluate({})) for d in s) for s in instance.input_shapes]
    out_shape = tuple(int(d.evaluate({})) for d in instance.output_shape)
    local_elems = sum(l.piece_elements(s) for l, s in zip(inputs, shapes)) + output.piece_elements(out_shape)
    fwd = max(local_flops / machine.peak_flops, local_elems * machine.dtype_bytes / machine.memory_bandwidth)
    memory = output.piece_elements(out_shape) * machine.dtype_bytes
    opt = 0.0
    for is_weight, layout, shape in zip(weight_inputs, inputs, shapes):
        if is_weight:
            memory += layout.piece_elements(shape) * ADAM_STATE_BYTES
            opt += layout.piece_elements(shape) * ADAM_TRAFFIC_BYTES / machine.memory_bandwidth
    return NodeCost(fwd, BACKWARD_FACTOR * fwd, opt, memory_bytes=memory, flops=local_flops,
                    problems=tuple(problems))


def parallel_cost(op: str, degree: int, shape: Sequence[int], source: Layout, output: Layout, machine: Machine,
                  source_role: str, devices: int | None = None) -> NodeCost:
    """One of the four parallel operators; `source_role` is "input", "weight" or "" (an activation).

    A tensor with fewer pieces than `devices` is held redundantly (SPMD): each
    of the `devices / pieces` replica sets runs the collective, so the elements
    sent are multiplied accordingly (time is not: the sets run in parallel).
    """
    p = degree
    shape = tuple(shape)
    if p <= 1:
        return NodeCost()
    in_piece, out_piece = source.piece_elements(shape), output.piece_elements(shape)
    time, elements, grad_sync, collectives = 0.0, 0, 0, []
    memory = 0 if source_role else out_piece * machine.dtype_bytes
    opt = 0.0
    if source_role == "weight":  # the weight is stored in this layout
        memory = out_piece * ADAM_STATE_BYTES
        opt = out_piece * ADAM_TRAFFIC_BYTES / machine.memory_bandwidth
    if op == "partition":
        if not source_role:
            t, e = _all_gather(machine, p, in_piece)
            time, elements = t, e * source.pieces
            collectives.append(f"bwd all-gather x{source.pieces} ({p} devices, {in_piece} elements)")
    elif op == "combine":
        t, e = _all_gather(machine, p, out_piece)
        time, elements = t, e * output.pieces
        collectives.append(f"fwd all-gather x{output.pieces} ({p} devices, {out_piece} elements)")
    elif op == "replicate":
        if source_role != "input":
            t, e = _all_reduce(machine, p, in_piece)
            time, elements = t, e * source.pieces
            if source_role == "weight":
                grad_sync = elements
            collectives.append(f"bwd all-reduce x{source.pieces} ({p} devices, {in_piece} elements)"
                               + (" [gradient sync]" if source_role == "weight" else ""))
    elif op == "reduce":
        t, e = _all_reduce(machine, p, out_piece)
        time, elements = t, e * output.pieces
        collectives.append(f"fwd all-reduce x{output.pieces} ({p} devices, {out_piece} elements)")
    else:
        raise KeyError(op)
    spread_over = max(source.pieces, output.pieces)
    if devices and devices > spread_over and devices % spread_over == 0:
        elements *= devices // spread_over
        grad_sync *= devices // spread_over
    return NodeCost(optimizer_s=opt, comm_s=time, comm_elements=elements, grad_sync_elements=grad_sync,
                    memory_bytes=memory, collectives=tuple(collectives))


def gather_cost(machine: Machine, layout: Layout, shape: Sequence[int], devices: int | None = None) -> NodeCost:
    """Bringing a tensor that arrives in `layout` to every device whole (a pinned input used whole)."""
    p = layout.pieces
    if p <= 1:
        return NodeCost()
    n = 1
    for d in shape:
        n *= d
    t, e = _all_gather(machine, p, n)
    sets = max(1, (devices or p) // p)
    return NodeCost(comm_s=t, comm_elements=e * sets,
                    collectives=(f"fwd all-gather of the pinned input ({p} devices, {n} elements)",))


@dataclass(frozen=True)
class Totals:
    """A plan's totals: the `totals` / `baselines` objects of the plan JSON."""

    time_s: float
    comm_elements: int
    comm_bytes: int
    peak_memory_bytes: int
    grad_sync_elements: int
    compute_s: float
    comm_s: float

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "comm_elements": self.comm_elements, "comm_bytes": self.comm_bytes,
                "peak_memory_bytes": self.peak_memory_bytes, "grad_sync_elements": self.grad_sync_elements,
                "compute_s": self.compute_s, "comm_s": self.comm_s}


def totals(costs: Mapping[int, NodeCost] | Sequence[NodeCost], machine: Machine) -> Totals:
    values = list(costs.values()) if isinstance(costs, Mapping) else list(costs)
    comm = sum(c.comm_elements for c in values)
    return Totals(sum(c.time_s for c in values), comm, comm * machine.dtype_bytes,
                  sum(c.memory_bytes for c in values), sum(c.grad_sync_elements for c in values),
                  sum(c.forward_s + c.backward_s + c.optimizer_s for c in values),
                  sum(c.comm_s for c in values))
