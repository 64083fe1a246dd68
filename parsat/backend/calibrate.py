"""`parsat calibrate --machine NAME -o machine.json`: measure this machine for the cost model.

Everything is measured the way `parsat run` executes, on `nproc` ranks at
once (gloo on CPU, nccl on CUDA), each rank timing the same thing at the
same time, so that ranks sharing cores, memory or a link are measured as
they share them in a run (on a 2-core box, 4 ranks get half a core each);
a figure is told by the statistic `parsat run` tells its step by
(`step_statistic`): rounds started by a barrier, each the slowest rank's,
their median (`_in_rounds`). Compute is timed on each rank's CPU time where
a rank computes on one thread on a CPU core of its own, so that the box's
other jobs do not lengthen it (`compute_clock`; ranks sharing cores, in wall
time: their turns are the job's own); collectives, stragglers and turns, which are
waiting, in wall time. Each rank runs on its own share
of the cores, pinned as `parsat run` pins it (`launch.share_cores`). In
the run's dtype (float64 by default, as `parsat run`; `--dtype float32`
for fp32 training):

* dispatch: a chain of tiny operators with autograd recording, forward
  and backward, per operator (`OpEfficiency.dispatch_s`,
  `backward_dispatch_s`: Python, torch dispatch and autograd bookkeeping);
* GEMMs over a grid of shapes, fitted to Hockney's model per dimension,
  t = dispatch + FLOPs / (peak x 1/((1 + m_half/m)(1 + n_half/n)(1 + k_half/k)))
  (`peak_flops`, `gemm_half_*`), and the tensor grid of mid-size products
  (`gemm_grid_nodes`) kept as measured, each layout's fractions of peak
  (`gemm_grids`: the price inside the grid, the fit only beyond it); the largest square product is also timed
  in the other dtype for `peaks`; every product (these, and the backward
  ones below) in passes spread over the whole calibration, a figure the
  median of its passes (`GemmPasses`: the products' rate moves for seconds
  at a time on a shared VM);
* the same grid's backward products, as autograd runs them in a step
  (right after the forward; `g @ w^T` for the first operand's gradient,
  `x^T @ g` for the second's: one operand transposed, the output new
  memory), each fitted the same way in its own (m, n, k) (`gemm_nt_*`,
  `gemm_tn_*`: its rate as a multiple of `peak_flops` and its half
  lengths), so that the cost model prices a backward product at its own
  shape and layout (`cost.op_time.BACKWARD_PRODUCTS`), not as the forward
  product again;
* `parsat run`'s optimizer (`backend.executor.Optimizer`, SGD and Adam)
  updating one weight right after a backward made its gradient, as a step
  runs it (the gradient in freshly allocated memory, the weight last read
  by the forward), for weights of 1 Ki to 1 Mi elements, kept as measured
  points (`update_points`, read between them on a line); on a CPU this
  update ran 2.3x what the memory-bound operators' rates gave for it
  (benchmarks/demo_step.md);
* the loss as `parsat run` computes it (`training_data.loss_terms`) and its
  backward, right after a product as a step runs them, on output pieces of
  256 to 64 Ki elements, fitted to a fixed cost and one per element
  (`OpEfficiency.loss_*`, `_loss`);
* the calls of a step as `parsat run` makes them: the dispatch chain's calls
  forward and backward, the interpreter's loop (`RankProgram.forward` on a
  plan that is that chain) and its work around an output's loss, a parallel
  node's path (`parallel_op`) and the optimizer's update per tensor, each
  timed cold, as the first calls after a product's forward, its backward
  and a barrier (`OpEfficiency.step_dispatch_s`, `step_backward_dispatch_s`,
  `step_node_s`, `step_loss_path_s`, `step_parallel_s`, `step_update_sgd_s`,
  `step_update_adam_s`; `StepCalls`);
* with `dtensor` (`--dtensor`): a chain of tiny layers (a linear product
  and an RMS norm each) on a `Replicate()` DTensor over all ranks, less
  the same chain plain, per ATen call (`OpEfficiency.dtensor_dispatch_s`,
  `dtensor_backward_dispatch_s`: what torch's tensor-parallel styles add
  to every operator of a module they style);
* with `dtensor` also FSDP2's hooks: stacks of tiny linear layers under
  `fully_shard` on a one-rank axis (one group of all layers; a group per
  layer, resharded after forward) against the same stack plain, solved
  for a cost per group and one per parameter, at a gather and after a
  backward (`fsdp_forward_param_s`, `fsdp_backward_param_s`,
  `fsdp_forward_group_s`, `fsdp_backward_group_s`): the host time the
  torch-native runtime's data parallelism and ZeRO-3 add beyond their
  collectives and copies (on 2 CPU ranks about 3 ms of a 24 ms BERT step
  before forward alone, which the profile missed:
  benchmarks/costmodel_fidelity.md, run T3; a group per layer cost ~0.35-0.5
  ms at each gather on this box, 2026-12-04);
* with `dtensor` also the host time DTensor's `redistribute` adds to a collective
  beyond the same collective on plain tensors, per call, for an all-reduce
  (Partial -> Replicate), an all-gather (Shard -> Replicate) and a
  reduce-scatter (Partial -> Shard) (`OpEfficiency.dtensor_all_reduce_s`, ...:
  the tensor-parallel collectives the torch-native runtime issues);
* with `dtensor` also the host time FSDP2's collectives add over every rank
  beyond the same module's on a one-rank axis, the plain collective and
  the copies (`OpEfficiency.fsdp_all_gather_s`, `fsdp_reduce_scatter_s`,
  `fsdp_all_reduce_s`: ZeRO-3's and data parallelism's);
* with `dtensor` also a Python bytecode instruction of module code: a
  stack of Python-only modules timed over the instructions it executes
  (`OpEfficiency.python_instruction_s`; a user's module's own Python
  between its ATen calls, `ir.module_calls.python_forward`);
* with `dtensor` also how much slower an operator runs in a step than
  timed alone as every figure here is (`OpEfficiency.sequence_factor`):
  two transformer blocks' forward and backward ATen calls replayed in
  order against each call repeated alone;
* the DSL's scalar functions (tanh, exp, erf, ...) as torch's elementwise
  kernels, forward and backward, per element (`function_times`: the
  slope between two sizes), which the cost model adds to an operator
  evaluating them (on a CPU core tanh ran 26x a relu);
* fused causal attention (`scaled_dot_product_attention(is_causal=True)`)
  forward and backward over a few shapes, fitted to the cost model's
  FlashAttention pricing (`attention_efficiency`, `attention_half_flops`;
  before, a calibrated machine priced it at the GEMMs' peak);
* elementwise arithmetic as a step runs it (`x * 0.5`, `x + y`, `x + bias`:
  a chain of calls, each on the previous output, the outputs kept), per
  output element (`elementwise_unary_s`, `elementwise_binary_s`,
  `elementwise_broadcast_s`: the slope over three sizes), which the cost
  model prices an elementwise operator at where it is above the roofline
  (a step's outputs are new memory; the figures below are warm);
* memory-bound operators (copies, adds, relus) from kilobytes to tens of
  megabytes, fitted to t = dispatch + (bytes + half) / bandwidth
  (`memory_bandwidth`, `memory_half_bytes`);
* collectives as the backend calls them (all-reduce of a clone, all-gather
  then concatenation; reduce-scatter, all-to-all and send/recv as
  torch.distributed runs them), on every group size that divides `nproc`,
  all groups at once, several sizes each, each call right after a product
  on every rank as a step issues it, in passes spread over the calibration
  (`StepCollectives`; ranks sharing cores: back to back, `_collectives`), fitted to
  t = latency + bus factor x bytes / bus bandwidth per group size: the
  machine's measured table (`CommProfile.points`), with the largest
  group's all-reduce as the per-link bandwidth and per-step latency.

The result is a version-2 `ir.machine.Machine` written by its own `save`,
so `parsat optimize --machine machine.json` loads it. One node is
measured: the inter-node link is set to the intra-node one.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from parsat.backend.collectives import CommCounter, MeshGroups, parallel_op
from parsat.backend.executor import Optimizer, RankProgram, operator_library
from parsat.backend.launch import LaunchConfig, RankContext, launch
from parsat.backend.step_statistic import spread
from parsat.backend.training_data import TrainConfig, loss_terms
from parsat.importer.torch_ops import apply_op
from parsat.dsl.bounds import check_all
from parsat.dsl.parallel_ops import REPLICATE
from parsat.ir.mesh import Mesh
from parsat.ir.pcg import PCG, Degrees, PNode
from parsat.ir.placement import FREE, Placement
from parsat.ir.units import fmt_bytes
from parsat.ir.gemm_grid import grid_fractions
from parsat.ir.machine import Machine
from parsat.ir.machine_profile import (ATTENTION_BACKWARD_FACTOR, COMM_ELEMENTS, FSDP_COLLECTIVE_FIELDS,
                                      REDISTRIBUTE_FIELDS, CollectivePoint, CommProfile, OpEfficiency, Oversubscribed,
                                      bus_factor)

DTYPES = {"float64": ("fp64", torch.float64, torch.float32), "float32": ("fp32", torch.float32, torch.float64),
          "bfloat16": ("bf16", torch.bfloat16, torch.float32)}
"""--dtype -> (precision, the dtype measured, the other dtype whose peak is measured too): bfloat16 for GPUs."""
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DISPATCH_CHAIN = 64          # tiny operators per timed chain


@dataclass(frozen=True)
class OpTiming:
    """One timed call: what it was, its shape, the slowest rank's median seconds, its FLOPs and bytes."""

    op: str
    shape: tuple[int, ...]
    seconds: float
    flops: float
    nbytes: float

    def predicted(self, machine: Machine) -> float:
        """The time `machine`'s compute model gives this call (parsat/cost/op_time.py's formula), timed alone as it
        was (no `sequence_factor`: that is what a step adds to these figures)."""
        eff = replace(machine.efficiency, sequence_factor=1.0, step_dispatch_s=0.0, step_backward_dispatch_s=0.0,
                      step_update_sgd_s=0.0, step_update_adam_s=0.0)
        if self.op == "randn":
            return eff.op_time(self.nbytes / eff.random_bandwidth) if eff.random_bandwidth else float("nan")
        if self.op in ("loss", "loss_backward"):   # as measured in a step's place: no dispatch added
            measured = eff.loss_time(self.shape[0], self.op == "loss_backward")
            return float("nan") if measured is None else measured
        if self.op.startswith("update_"):
            return eff.update_time(self.op[7:], self.shape[0]) or float("nan")
        if self.op.startswith("attention_causal"):   # forward, or its backward alone (FlashAttention's factor)
            kernel = self.flops / (machine.peak_flops * eff.attention_rate(self.flops))
            backward = self.op.endswith("_backward")
            return eff.op_time(kernel * (ATTENTION_BACKWARD_FACTOR if backward else 1.0), backward)
        if self.op.startswith("elementwise_"):   # the longer of its bytes' roofline and its measured elements
            roof = self.nbytes / eff.bandwidth(self.nbytes, machine.memory_bandwidth)
            return eff.op_time(max(roof, eff.elementwise_time(self.op[12:], self.shape[0])))
        if self.op.startswith("function_"):   # its measured per-element time: the dispatch is the intercept
            name, backward = self.op[9:].removesuffix("_backward"), self.op.endswith("_backward")
            return eff.op_time(eff.function_time({name: self.shape[0]}, backward), backward)
        if self.op in ("matmul", "matmul_nt", "matmul_tn"):
            fraction = eff.layout_efficiency(self.op[7:] or "nn", *self.shape)
            return eff.op_time(self.flops / (machine.peak_flops * fraction)) if fraction else float("nan")
        return eff.op_time(self.nbytes / eff.bandwidth(self.nbytes, machine.memory_bandwidth))


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective over groups of `ranks` ranks of a buffer of `nbytes` bytes (the gathered one, for all-gather)."""

    kind: str
    ranks: int
    nbytes: float
    seconds: float

    def predicted(self, machine: Machine) -> float:
        point = machine.comm.point(self.kind, "intra", self.ranks)
        if point is None:
            return float("nan")
        return point.seconds(self.nbytes)


@dataclass(frozen=True)
class Calibration:
    machine: Machine
    dispatch: tuple[float, float]
    ops: tuple[OpTiming, ...]
    collectives: tuple[CollectiveTiming, ...]
    device: str
    oversubscribed: str = ""   # why the figures are of ranks sharing cores or GPUs ('' when each had its own)
    turns: tuple[tuple[float, float, float], ...] = ()   # `_turns`' (compute, excess, excess on ranks with a
    #                                                          core each) per burst, as measured
    turn_s: float = 0.0        # `fit_turn` of them (the machine keeps it only where ranks share cores)
    compute_clock: str = "wall time"   # what the compute figures were timed on (`compute_clock`)
    square_passes: tuple[float, ...] = ()   # the largest square product's seconds in each of `GemmPasses`' passes
    #                                          (the slowest rank's), minutes apart: how much the moment moves it
    reduce_passes: tuple[float, ...] = ()   # the smallest all-reduce over all ranks in each of `StepCollectives`'
    #                                          passes (none where ranks share cores)

    def to_dict(self) -> dict:
        return {"machine": self.machine.to_dict(), "device": self.device, "oversubscribed": self.oversubscribed,
                "compute_clock": self.compute_clock, "square_passes_s": list(self.square_passes),
                "reduce_passes_s": list(self.reduce_passes),
                "turns": {"fitted_s": self.turn_s, "bursts": [{"compute_s": c, "excess_s": e, "excess_own_cores_s": o}
                                                                for c, e, o in self.turns]},
                "dispatch_s": {"forward": self.dispatch[0], "backward": self.dispatch[1]},
                "ops": [{"op": t.op, "shape": list(t.shape), "seconds": t.seconds, "flops": t.flops,
                         "bytes": t.nbytes, "predicted_s": t.predicted(self.machine)} for t in self.ops],
                "collectives": [{"kind": c.kind, "ranks": c.ranks, "bytes": c.nbytes, "seconds": c.seconds,
                                 "predicted_s": c.predicted(self.machine)} for c in self.collectives]}


# ------------------------------------------------------------------ timing


WINDOW_S = 0.03   # each figure is measured over at least this much wall time, in `Budget.repeats` rounds


def _average_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None], window_s: float) -> float:
    """Wall time per call, averaged over at least `repeats` calls and `window_s` seconds (after two warm-ups)."""
    fn()
    fn()
    sync()
    count, start = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        if count >= repeats:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= window_s:
                return elapsed / count


def _slowest(ctx: RankContext, value: float, group=None) -> float:
    return _slowest_each(ctx, [value], group)[0]


def _slowest_each(ctx: RankContext, values: Sequence[float], group=None) -> list[float]:
    """Each of `values` (one per round) the slowest rank's."""
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


@dataclass(frozen=True)
class Budget:
    """How each figure is measured: `repeats` rounds, together at least `window_s` seconds (a call at least once
    a round), on `clock` (`compute_clock`: a rank's CPU time for compute on a CPU, wall time otherwise)."""

    repeats: int = 5
    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.perf_counter


def compute_clock(cuda: bool, threads: int, shared_cores: bool = False) -> Callable[[], float]:
    """The clock compute figures are timed on: on a CPU rank computing on one thread, with a core of its own,
    that thread's CPU time; on a GPU, a rank whose operators run on several threads (whose time the calling
    thread's CPU time does not hold), or ranks that share cores (`--oversubscribe`), wall time.

    Ranks sharing cores: the job's own ranks take turns on a core, so the turn is part of the machine the job
    runs on, as the run meets it; a rank's CPU time would leave it out. Measured (2026-12-06, fidelity run 28
    with every compute figure on CPU time, benchmarks/costmodel_fidelity.md): the 2-rank plans 0.90 measured over
    predicted, the 4-rank plans on 2 cores 1.24, the data-parallel ones 1.54 and 2.05.

    Why: a compute figure describes the machine, not what else ran on it while it was measured. In wall time
    every job sharing the box's cores lengthens a figure by its share, and the run's steps, whose ranks sleep
    in every collective and wake ahead of the box's other jobs, lose less. A rank's CPU time counts the work,
    not the wait for a core; what it still takes up of the load is what the other jobs do to the caches and
    the memory bus, which a step meets too. Three alternated calibrations each way of one 2-core box at load
    4-10 (2026-12-06, benchmarks/demo_step.md): the memory bandwidth 0.94-3.42 GB/s in wall-clock rounds,
    3.20-5.16 on CPU time (11.4 at load 2); the GEMM peak 30-41 and 41-51 GFLOP/s (53 at load 2). On a quiet
    box the two clocks agree for compute. The collectives, the stragglers and a peer's turn are waiting, and
    stay in wall time; `parsat run` prints each rank's CPU a step beside the wall-clock step, so what the
    box's other jobs added to a run is seen apart."""
    return time.perf_counter if cuda or threads > 1 or shared_cores else time.thread_time


def _in_rounds(ctx: RankContext, round_s: Callable[[], float], budget: Budget, group=None) -> float:
    """`parsat run`'s statistic of a step (`step_statistic`), for a figure: `budget.repeats` rounds, each started
    by a barrier as a step is (`RankContext.step_start`), each round's seconds the slowest rank's, their median.

    Not a mean over one window: on a box shared with other jobs a window that another job's burst falls in
    comes out long, and a mean carries it into the figure while the run's median of steps leaves the steps it
    fell in out; one such window made a 2 KB all-reduce 1.60 ms where the same calibration's 32 KB one took
    0.68 ms. A round is about as long as the demo's step (the window over the rounds: 6 ms by default), so
    what the box's other jobs take from a typical round is what they take from a typical step."""
    rounds = []
    for _ in range(budget.repeats):
        dist.barrier(group=group)
        rounds.append(round_s())
    return spread(_slowest_each(ctx, rounds, group)).median_s


def _timed(ctx: RankContext, fn: Callable[[], object], budget: Budget, sync, group=None) -> float:
    """All ranks (of `group`) time `fn` at once, each making the same number of calls a round (`_in_rounds`):
    seconds a call, the median over the rounds of the slowest rank's average."""
    dist.barrier(group=group)
    one = _slowest(ctx, _average_time(fn, 1, sync, 0.0), group)   # after two warm-ups; the same on every rank
    return _in_rounds(ctx, _round_of(fn, _calls_a_round(one, budget), budget, sync), budget, group)


def _calls_a_round(one_s: float, budget: Budget) -> int:
    """Calls of a `one_s` call that fill a round's share of `budget.window_s` (at least one, at most 100,000)."""
    return max(1, min(int(budget.window_s / budget.repeats / max(one_s, 1e-9)), 100_000))


def _round_of(fn: Callable[[], object], count: int, budget: Budget, sync) -> Callable[[], float]:
    """One round: `count` calls of `fn` back to back on `budget.clock`, seconds a call."""
    def round_s() -> float:
        sync()
        start = budget.clock()
        for _ in range(count):
            fn()
        sync()
        return (budget.clock() - start) / count

    return round_s


def _timed_after(ctx: RankContext, prepare: Callable[[], object], fn: Callable[[], object], budget: Budget,
                 sync) -> float:
    """`_timed` of `fn` with `prepare()` (not timed) before each call: `average_after` in each round."""
    for _ in range(2):
        prepare()
        fn()
    one = replace(budget, repeats=1, window_s=budget.window_s / budget.repeats)
    return _in_rounds(ctx, lambda: average_after(prepare, fn, one, sync, budget.clock, warmups=0), budget)


GRID_DIVISORS = (4, 2, 1)
"""The grid of products (`gemm_grid_nodes`): m, n and k each take `--size` over each of these (128, 256 and 512 by
default), every combination timed in each layout, so that a calibrated machine prices the products a step runs
(a layer's [batch, in] @ [in, out]: 128 x 784 x 256 on the demo) from measurements around them
(`ir.gemm_grid.GemmGrid`), not from the Hockney fit alone, which priced the demo's first product 1.24x apart over
calibrations whose measured products agreed within 1.08x (benchmarks/demo_step.md, session 67 helper C).
Powers of two, as batch sizes and most widths are: on this box a product with power-of-two sizes ran 7-29%
slower than one of sizes three times a power of two (96, 192, 384: its operands' rows at strides that map to
fewer cache sets), so the grid's sizes decide which of the two it prices right (a grid of 96, 192, 384 priced
the power-of-two products 7-18% low, this one prices those 10-29% high; same benchmark)."""


GRID_ROUND_SHARE = 1 / 3
"""A grid product's round in `GemmPasses` is this share of the others' (2 ms of calls back to back, at least one
call, instead of 6): in full rounds the grid's 72 products added 16% to `parsat calibrate`'s CPU on this 2-core
box (user + sys 56.1 s twice against 46.8-50.2 s), in a third of the round 9-13% (52.7-54.4 s; session 67
helper C, benchmarks/demo_step.md); each figure stays the median over the passes of the slowest rank's round."""


def gemm_grid_nodes(size: int) -> tuple[int, ...]:
    """The sizes each of m, n and k takes on the grid of products (`size` over each of `GRID_DIVISORS`)."""
    return tuple(sorted({max(1, size // d) for d in GRID_DIVISORS}))


def gemm_shapes(size: int) -> list[tuple[int, int, int]]:
    """(m, n, k) timed: squares from 8 to `size`, skinny products with one small dimension (what the Hockney fit
    reads the small sizes from), and the grid of products (`gemm_grid_nodes`: every combination of its sizes)."""
    squares = []
    s = 8
    while s <= size:
        squares.append(s)
        s *= 2
    shapes = [(s, s, s) for s in squares]
    for small in (8, 32):
        if small < size:
            shapes += [(small, size, size), (size, small, size), (size, size, small)]
    return shapes + [s for s in itertools.product(gemm_grid_nodes(size), repeat=3) if s not in shapes]


def memory_sizes(size: int) -> list[int]:
    """Elements of the memory-bound operators: 1 Ki to 16 x size^2 by factors of 4 (32 MB in float64 at 512)."""
    top = max(1 << 12, 16 * size * size)
    out, n = [], 1 << 10
    while n <= top:
        out.append(n)
        n *= 4
    return out


def _rank_measure(ctx: RankContext, dtype_name: str, size: int, budget: Budget, comm_sizes: Sequence[int],
                  dtensor: bool = False, shared_cores: bool = False) -> dict:
    """Run on every rank: dispatch, GEMMs, memory-bound operators, collectives (all ranks together); compute on
    `compute_clock`, the collectives, stragglers and turns (waiting) in wall time."""
    _precision, dtype, other = DTYPES[dtype_name]
    cuda = ctx.device.type == "cuda"
    wall, budget = budget, replace(budget, clock=compute_clock(cuda, torch.get_num_threads(), shared_cores))
    sync = (lambda: torch.cuda.synchronize(ctx.device)) if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(ctx.rank)

    def rand(*shape, kind=dtype):
        return torch.randn(*shape, generator=gen, dtype=kind).to(ctx.device)

    # dispatch: a chain of tiny operators, forward with autograd recording, then backward
    leaf = rand(2, 2).requires_grad_()
    dispatch = _chain_dispatch(ctx, leaf, budget, sync)
    extra = _dtensor_dispatch(ctx, dtype, budget, sync) if dtensor else (0.0, 0.0)
    hooks = _fsdp_hooks(ctx, dtype, sync) if dtensor else (0.0, 0.0, 0.0, 0.0)
    python = _python_instruction(ctx, budget, sync) if dtensor else 0.0
    sequence = _sequence_factor(ctx, dtype, size, budget, sync) if dtensor else 1.0
    redistribute = _redistribute(ctx, dtype, comm_sizes, sync) if dtensor else (0.0, 0.0, 0.0)
    fsdp_collectives = _fsdp_collectives(ctx, dtype, comm_sizes, sync) if dtensor else (0.0, 0.0, 0.0)

    products = GemmPasses(ctx, budget, sync)
    grid = set(gemm_grid_nodes(size))
    for m, n, k in gemm_shapes(size):
        a, b = rand(m, k), rand(k, n)
        nbytes = float((m * k + k * n + m * n) * a.element_size())
        share = GRID_ROUND_SHARE if {m, n, k} <= grid else 1.0
        products.add(["matmul", [m, n, k], 2.0 * m * n * k, nbytes], lambda a=a, b=b: apply_op("matmul", [a, b], {}),
                     round_share=share)
        _backward_products(products, a, b, rand(m, n), share)
    s = max(m for m, n, k in gemm_shapes(size) if m == n == k)  # the largest square, in the other dtype
    a, b = rand(s, s, kind=other), rand(s, s, kind=other)
    products.add(["matmul_other", [s, s, s], 2.0 * s ** 3, float(3 * s * s * a.element_size())],
                 lambda: torch.matmul(a, b))
    products.run_pass()   # the passes are spread over the calibration: `GemmPasses`
    ops = []
    for elements in memory_sizes(size):
        x, y = rand(elements), rand(elements)
        item = x.element_size()
        for op, args, nbytes in (("relu", [x], 2 * elements * item), ("add", [x, y], 3 * elements * item)):
            ops.append([op, [elements], _timed(ctx, lambda: apply_op(op, args, {}), budget, sync), 0.0,
                        float(nbytes)])
        ops.append(["copy", [elements], _timed(ctx, lambda: x.clone(), budget, sync), 0.0, float(2 * elements * item)])
        ops.append(["randn", [elements], _timed(ctx, lambda: torch.randn(elements, generator=gen, dtype=dtype)
                                                .to(ctx.device), budget, sync), 0.0, float(elements * item)])
    products.run_pass(spread=True)
    ops += _updates(ctx, dtype, budget, sync)
    step_calls = StepCalls(ctx, dtype, size, budget, sync)   # in passes spread over the calibration, as the products
    in_a_step = [] if shared_cores else [StepCollectives(ctx, dtype, wall, comm_sizes, sync, size)]   # beside them
    for passes in (step_calls, *in_a_step):
        passes.run_pass()
    ops += _functions(ctx, dtype, budget, sync)
    products.run_pass(spread=True)
    ops += _elementwise(ctx, dtype, budget, sync)
    ops += _attention(ctx, dtype, budget, sync)
    ops += _loss(ctx, dtype, size, budget, sync)
    for passes in (step_calls, *in_a_step):
        passes.run_pass()
    products.run_pass(spread=True)
    collectives = _collectives(ctx, dtype, wall, comm_sizes, sync) if shared_cores else []   # back to back
    skew, turns = _skew(ctx, dtype, size, wall, budget, sync), _turns(ctx, dtype, wall, sync)
    while products.passes < budget.repeats:
        products.run_pass()
    while len(step_calls.passes) < STEP_ROUNDS_FACTOR:
        for passes in (step_calls, *in_a_step):
            passes.run_pass()
    return {"dispatch": dispatch, "step_calls": step_calls.figures(), "dtensor": extra, "fsdp": hooks, "python": python,
            "sequence": sequence, "redistribute": redistribute, "fsdp_collectives": fsdp_collectives,
            "ops": products.rows() + ops, "square_passes": products.passes_of("matmul", [s, s, s]),
            "collectives": collectives + [row for c in in_a_step for row in c.rows()],
            "reduce_passes": [t for c in in_a_step for t in c.passes_of("all_reduce", ctx.world)],
            "skew": skew, "turns": turns,
            "threads": torch.get_num_threads()}


UPDATE_ROWS = (4, 16, 64, 256, 1024, 4096)   # rows of the [rows, 256] weights whose update is timed: 1 Ki to 1 Mi
UPDATE_WIDTH = 256


def _backward_products(products: "GemmPasses", a: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
                       round_share: float = 1.0) -> None:
    """The backward of `a @ b` as a step runs it, once for each operand needing a gradient, added to `products`:
    [matmul_nt, the backward product's own (m, n, k), FLOPs, bytes] for a's (g @ b^T) and [matmul_tn, ...] for
    b's (a^T @ g), each the slowest rank's `backward()` right after its forward (not timed). So the product runs
    where a step runs it: its output new memory, its operands last touched by the forward, with autograd's
    engine around it (a fixed cost per call, which the fit's intercept takes). On a CPU this ran 1.2-1.6x the
    same product timed on its own, again and again (benchmarks/demo_step.md). `round_share`: `GemmPasses.add`'s."""
    (m, k), n = a.shape, b.shape[1]
    nbytes = float((m * k + k * n + m * n) * a.element_size())
    for layout, shape in (("nt", [m, k, n]), ("tn", [k, n, m])):
        x, w = a.detach().requires_grad_(layout == "nt"), b.detach().requires_grad_(layout == "tn")
        held: dict = {}

        def forward(x=x, w=w, held=held):
            x.grad = w.grad = None
            held["y"] = apply_op("matmul", [x, w], {})

        products.add([f"matmul_{layout}", shape, 2.0 * m * n * k, nbytes],
                     lambda held=held: held["y"].backward(g), prepare=forward, round_share=round_share)


class GemmPasses:
    """The products (forward, backward layouts, the other dtype's square) timed in `Budget.repeats` passes spread
    over the whole calibration (`_rank_measure` runs a pass between its other measurements), each pass one round
    of every product on every rank at once (a barrier, then calls back to back on `budget.clock` for about
    `window_s / repeats`), each product's figure the median over the passes of the slowest rank's round: the
    statistic of `_in_rounds`, its rounds minutes apart instead of back to back.

    Why: on this 2-core VM the products' rate moves for seconds at a time with nothing in the guest to see (no
    steal time, each rank's thread CPU clock): three calibrations minutes apart fitted peaks of 41.1, 51.3 and
    24.8 GFLOP/s, the last with every product of 128 or more rows at half speed while its dispatch and small
    products were not (benchmarks/demo_step.md, 2026-12-06 session 65, the lead); the products had been timed
    back to back in a few seconds, so a slow moment took the whole grid. Two ranks multiplying at once ran
    at the rate one did alone (40-43 against 42-45 GFLOP/s on thread CPU, session 66), so the ranks compute
    together, as a step's do."""

    def __init__(self, ctx: RankContext, budget: Budget, sync) -> None:
        self.ctx, self.budget, self.sync = ctx, budget, sync
        self.cases: list[tuple[list, Callable[[], float]]] = []
        self.seconds: list[list[float]] = []
        self.passes = 0

    def add(self, head: list, fn: Callable[[], object], prepare: Callable[[], object] | None = None,
            round_share: float = 1.0) -> None:
        """A product to time: `head` = [op, shape, FLOPs, bytes]; `fn` called `count` times a round (set here,
        after two warm-ups, from one call: the same on every rank; a round `round_share` of the usual length),
        each after `prepare()` (not timed) if given."""
        budget, sync, clock = self.budget, self.sync, self.budget.clock
        for _ in range(3):   # two warm-ups, then the one call timed
            if prepare is not None:
                prepare()
            sync()
            start = clock()
            fn()
        sync()
        count = _calls_a_round(_slowest(self.ctx, clock() - start), replace(budget, window_s=budget.window_s
                                                                                  * round_share))
        after = replace(budget, repeats=count, window_s=0.0)

        def prepared_round_s() -> float:
            return average_after(prepare, fn, after, sync, clock, 0)

        self.cases.append((head, _round_of(fn, count, budget, sync) if prepare is None else prepared_round_s))
        self.seconds.append([])

    def run_pass(self, spread: bool = False) -> None:
        """One round of every product, each started by a barrier (every rank computing at once); `spread`: one
        of the passes spread over the calibration, run only while fewer than `budget.repeats` have run (the
        rest run at its end)."""
        if spread and self.passes >= self.budget.repeats:
            return
        for (_head, round_s), seconds in zip(self.cases, self.seconds):
            dist.barrier()
            seconds.append(round_s())
        self.passes += 1

    def passes_of(self, op: str, shape: list[int]) -> list[float]:
        """The product's seconds a call in each pass, the slowest rank's (what its figure is the median of)."""
        seconds = next(sec for (head, _round), sec in zip(self.cases, self.seconds) if head[:2] == [op, shape])
        return _slowest_each(self.ctx, seconds)

    def rows(self) -> list[list]:
        """[op, shape, seconds, FLOPs, bytes] per product: the median over the passes of the slowest rank's."""
        out = []
        for (head, _round), seconds in zip(self.cases, self.seconds):
            op, shape, flops, nbytes = head
            out.append([op, shape, spread(_slowest_each(self.ctx, seconds)).median_s, flops, nbytes])
        return out


def _updates(ctx: RankContext, dtype, budget: Budget, sync) -> list[list]:
    """[f"update_{optimizer}", [elements], seconds, 0, 0] per optimizer and weight size: the slowest rank's
    average `Optimizer.step` on one weight, each step right after a backward (untimed) made the weight's
    gradient, as a training step runs it: the gradient is new memory, the weight was read by the forward. An
    update timed again and again on the same gradient would run from cache and skip the allocator."""
    rows_out = []
    for kind in ("sgd", "adam"):
        for rows in UPDATE_ROWS:
            w = torch.randn(rows, UPDATE_WIDTH, dtype=dtype).to(ctx.device).requires_grad_()
            x = torch.randn(4, rows, dtype=dtype).to(ctx.device)
            optimizer = Optimizer([w], TrainConfig(optimizer=kind))

            def backward():
                optimizer.zero_grad()
                (x @ w).sum().backward()

            seconds = _timed_after(ctx, backward, optimizer.step, budget, sync)
            rows_out.append([f"update_{kind}", [rows * UPDATE_WIDTH], seconds, 0.0, 0.0])
    return rows_out


LOSS_ROWS = (16, 256, 4096)   # rows of the [rows, LOSS_WIDTH] output pieces whose objective is timed
LOSS_WIDTH = 16
STEP_ROUNDS_FACTOR = 3   # the loss, timed in a step's place, one call a round (a step's sample), in this many
#                         times `Budget.repeats` rounds: more rounds than a figure that averages many calls a
#                         round, for a median as steady; `StepCalls` and `StepCollectives`: this many passes
STEP_PRODUCT_ROWS = 128  # the product a figure timed in a step's place follows (`_step_product`)


def _step_product(ctx: RankContext, dtype, size: int) -> Callable[[], torch.Tensor]:
    """A product of `STEP_PRODUCT_ROWS` x `size` by `size` x `size` (about a ms on a CPU core at size 512): the
    compute that `_loss` and `StepCollectives` run (not timed) right before what they time, as a step runs its
    loss and its collectives right after an operator's compute."""
    a = torch.randn(STEP_PRODUCT_ROWS, size, dtype=dtype).to(ctx.device)
    w = torch.randn(size, size, dtype=dtype).to(ctx.device)
    return lambda: a @ w


def _loss(ctx: RankContext, dtype, size: int, budget: Budget, sync) -> list[list]:
    """[loss, [elements], seconds, 0, bytes] and [loss_backward, ...] per output piece of `LOSS_ROWS` x
    `LOSS_WIDTH` elements: `training_data.loss_terms` of the piece against a target (what `parsat run` runs
    after a forward), and its backward, each right after `_step_product` (not timed), as a step runs its loss
    right after the forward's last product; one call a round, in `STEP_ROUNDS_FACTOR` x `budget.repeats` rounds
    (`_timed_after`). Why: the objective is a dozen tiny calls whose time is
    dispatch, and dispatch run after a product that left the dispatcher's code and data out of cache costs
    more than in the warm chain `dispatch_s` is timed in: on this 2-core box (thread CPU time, float64, a
    [128, 10] piece) 31 us alone, 83-86 us right after a [128, 784] @ [784, 256] product, 118 us after its
    forward and backward; the demo's loss ran 0.14-0.22 ms in its step where six memory-bound operators priced
    it at 0.03 (benchmarks/demo_step.md, 2026-12-06)."""
    step_product = _step_product(ctx, dtype, size)
    rounds = replace(budget, repeats=STEP_ROUNDS_FACTOR * budget.repeats, window_s=0.0)
    out = []
    for rows in LOSS_ROWS:
        elements = rows * LOSS_WIDTH
        piece = torch.randn(rows, LOSS_WIDTH, dtype=dtype).to(ctx.device)
        target = torch.randn(rows, LOSS_WIDTH, dtype=dtype).to(ctx.device)
        held: dict = {}

        def product():
            step_product()
            held["piece"] = piece.detach().requires_grad_()

        def loss():
            held["loss"] = loss_terms([(held["piece"], target, elements, 1, 1)])[0]

        def product_and_loss():
            product()
            loss()

        forward = _timed_after(ctx, product, loss, rounds, sync)
        backward = _timed_after(ctx, product_and_loss, lambda: held["loss"].backward(), rounds, sync)
        nbytes = float(2 * elements * piece.element_size())
        out += [["loss", [elements], forward, 0.0, nbytes], ["loss_backward", [elements], backward, 0.0, nbytes]]
    return out


def fit_loss(timings: Sequence[OpTiming]) -> dict[str, float]:
    """`OpEfficiency.loss_*`: the line through the loss's timings (forward and backward apart) against the piece's
    elements, by `fit_line` (a negative slope, noise at these sizes, is read as none)."""
    out = {}
    for op, prefix in (("loss", "loss_"), ("loss_backward", "loss_backward_")):
        timed = sorted((t for t in timings if t.op == op), key=lambda t: t.shape[0])
        if not timed:
            continue
        fixed, slope = fit_line([float(t.shape[0]) for t in timed], [t.seconds for t in timed])
        if slope < 0 or fixed <= 0:
            slope = max(0.0, slope)
            fixed = min(t.seconds for t in timed)
        out[f"{prefix}s"], out[f"{prefix}element_s"] = fixed, slope
    return out


FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "tanh": torch.tanh, "erf": torch.erf, "sin": torch.sin,
    "cos": torch.cos}
"""The DSL's scalar functions (`dsl.instantiate.SCALAR_FUNCTIONS`) that are more than a comparison, each as
torch's elementwise kernel for it: what `_functions` times (its input in [0.5, 1.5), where every one is defined)."""
FUNCTION_ELEMENTS = (1 << 12, 1 << 16)   # the sizes each function is timed at: 16 KB and 256 KB in fp32 (a
#                                         small model's activations; at 1 MB the slope ran 2x on a loaded box)


def _functions(ctx: RankContext, dtype, budget: Budget, sync) -> list[list]:
    """[f"function_{name}", [elements], seconds, 0, bytes] per scalar function (`FUNCTIONS`) and size
    (`FUNCTION_ELEMENTS`): the slowest rank's average forward, and [f"function_{name}_backward", ...] its
    autograd backward right after a forward (not timed), as a step runs it. `fit_functions` takes the slope
    between the sizes: the per-element time, dispatch aside."""
    rows = []
    for name, fn in FUNCTIONS.items():
        for elements in FUNCTION_ELEMENTS:
            x = (torch.rand(elements, dtype=dtype) + 0.5).to(ctx.device)
            leaf, grad = x.clone().requires_grad_(), torch.ones_like(x)
            nbytes = float(2 * elements * x.element_size())
            rows.append([f"function_{name}", [elements], _timed(ctx, lambda: fn(x), budget, sync), 0.0, nbytes])
            seconds = _backward_seconds(ctx, (leaf,), lambda: fn(leaf), grad, budget, sync)
            rows.append([f"function_{name}_backward", [elements], seconds, 0.0, 1.5 * nbytes])
    return rows


ELEMENTWISE: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "unary": lambda x, y, bias: x * 0.5, "binary": lambda x, y, bias: x + y, "broadcast": lambda x, y, bias: x + bias}
"""Each kind of elementwise arithmetic (`ir.validate.ELEMENTWISE_KINDS`) as torch runs one of the graphs' operators
of that kind (`scale`, `add`, `add_bcast`: x [rows, ELEMENTWISE_WIDTH], y like x, bias [ELEMENTWISE_WIDTH])."""
ELEMENTWISE_ELEMENTS = (1 << 12, 1 << 14, 1 << 16)   # output elements timed: 16 KB to 256 KB in fp32 (a small
#                                                   model's activations)
ELEMENTWISE_WIDTH = 256
ELEMENTWISE_CHAIN = 32   # calls in a row, each on the previous one's output, the outputs kept


def _elementwise(ctx: RankContext, dtype, budget: Budget, sync) -> list[list]:
    """[f"elementwise_{kind}", [elements], seconds, 0, bytes] per kind (`ELEMENTWISE`) and size
    (`ELEMENTWISE_ELEMENTS`): the slowest rank's average call in a chain of `ELEMENTWISE_CHAIN` calls, each on the
    previous call's output, every output kept until the chain ends, as a forward runs its arithmetic and keeps
    the activations for backward (each output new memory, not in cache). The memory-bound figures (`relu`,
    `add`, `copy`) are of one call repeated on warm buffers, its output the memory the last call freed: on this
    2-core box a chain's call took 1.6-3.5x that at 64-256 Ki elements, with or without page faults
    (benchmarks/elementwise_chain_probe.py). `fit_elementwise` takes the slope over the sizes: the per-element time, dispatch
    aside."""
    rows = []
    for kind, fn in ELEMENTWISE.items():
        for elements in ELEMENTWISE_ELEMENTS:
            x, y = (torch.randn(elements // ELEMENTWISE_WIDTH, ELEMENTWISE_WIDTH, dtype=dtype).to(ctx.device)
                    for _ in range(2))
            bias = torch.randn(ELEMENTWISE_WIDTH, dtype=dtype).to(ctx.device)

            def chain(fn=fn, x=x, y=y, bias=bias):
                kept, out = [], x
                for _ in range(ELEMENTWISE_CHAIN):
                    out = fn(out, y, bias)
                    kept.append(out)
                return kept

            operands = {"unary": 2, "binary": 3, "broadcast": 2}[kind]
            seconds = _timed(ctx, chain, budget, sync) / ELEMENTWISE_CHAIN
            rows.append([f"elementwise_{kind}", [elements], seconds, 0.0, float(operands * elements * x.element_size())])
    return rows


ATTENTION_SHAPES = ((4, 4, 32, 32), (4, 4, 64, 32), (4, 4, 128, 64), (4, 8, 256, 64))
"""[batch, heads, sequence, head size] of the fused causal attention calls `_attention` times."""


def _attention(ctx: RankContext, dtype, budget: Budget, sync) -> list[list]:
    """[attention_causal, [b, h, s, d], seconds, causal forward FLOPs, bytes] per shape (`ATTENTION_SHAPES`):
    the slowest rank's average `scaled_dot_product_attention(q, k, v, is_causal=True)` (the kernel the importer's
    `attention_causal` runs as), and [attention_causal_backward, ...] its autograd backward right after a forward.
    `fit_attention` fits `OpEfficiency.attention_efficiency` and `attention_half_flops` to them, which were the
    GPU's measured figures or 1 and 0 (fused attention at the GEMMs' peak) before: on a CPU core the two small
    attention calls of GPT-2 and LLaMA ran 2x their share of the priced forward (benchmarks/costmodel_fidelity.md,
    session 61 helper C)."""
    import torch.nn.functional as F

    rows = []
    for b, h, s, d in ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype).to(ctx.device) for _ in range(3))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grad = torch.randn(b, h, s, d, dtype=dtype).to(ctx.device)
        flops = 2.0 * b * h * s * s * d       # causal: half of q k^T and of the weighted sum of v
        nbytes = float(4 * b * h * s * d * q.element_size())
        seconds = _timed(ctx, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), budget, sync)
        rows.append(["attention_causal", [b, h, s, d], seconds, flops, nbytes])
        seconds = _backward_seconds(ctx, leaves, lambda: F.scaled_dot_product_attention(*leaves, is_causal=True),
                                    grad, budget, sync)
        rows.append(["attention_causal_backward", [b, h, s, d], seconds, flops, 2 * nbytes])
    return rows


def _backward_seconds(ctx: RankContext, leaves: Sequence[torch.Tensor], run: Callable[[], torch.Tensor],
                      grad: torch.Tensor, budget: Budget, sync) -> float:
    """The slowest rank's average `backward(grad)` of `run()`'s output right after its forward (not timed), the
    `leaves`' gradients cleared before each forward: where a step runs a backward, its operands last touched by
    the forward, autograd's engine around it (the products' layouts, the scalar functions, fused attention)."""
    held: dict = {}

    def forward():
        for leaf in leaves:
            leaf.grad = None
        held["y"] = run()

    return _timed_after(ctx, forward, lambda: held["y"].backward(grad), budget, sync)


def average_after(prepare: Callable[[], object], fn: Callable[[], object], budget: Budget, sync: Callable[[], object],
                  clock: Callable[[], float] = time.perf_counter, warmups: int = 2) -> float:
    """Seconds per `fn()`, each right after `prepare()` (not timed), averaged over at least `budget.repeats`
    calls and `budget.window_s` seconds of `fn` (after `warmups` untimed pairs): what `fn` takes where a step
    runs it. `clock`: wall time for the calibration; benchmarks/demo_step_cpu.py passes thread CPU time."""
    for _ in range(warmups):
        prepare()
        fn()
    total, count = 0.0, 0
    while count < budget.repeats or total < budget.window_s:
        prepare()
        sync()
        start = clock()
        fn()
        sync()
        total += clock() - start
        count += 1
    return total / count


DTENSOR_LAYERS = 8   # tiny layers (a linear product and an RMS norm each) of the chain `_dtensor_dispatch` times


def _dtensor_dispatch(ctx: RankContext, dtype, budget: Budget, sync) -> tuple[float, float]:
    """What an ATen call on DTensors adds to a plain one, (forward, backward), per call of the kind a module
    holding parameters makes: a chain of DTENSOR_LAYERS tiny layers, each a linear product (`F.linear`: t, mm)
    and an RMS norm (pow, mean, add, rsqrt, mul, mul), run on a `Replicate()` DTensor over every rank with
    `Replicate()` weights, and again plain; the difference divided by the ATen calls the DTensor chain makes,
    counted by a `TorchDispatchMode` on one untimed run (forward, and `torch.autograd.grad`'s backward), as
    `importer.call_count` counts a module's (`ir.module_calls`: no communication, an operator on replicated
    operands runs locally). The dispatch chain's alternation of a scalar multiply and a relu (`_chain_dispatch`),
    timed here before, cost about twice a module's typical call on DTensors (one rank, autograd recording: a
    scalar multiply 40 us more than plain, a relu 30, t, view, add and sum 11-13, mm 18), and priced the
    tensor-parallel plans of benchmarks/costmodel_fidelity.py 1.1-1.4x too slow once every call was counted."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counting(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    def layers(x, weights, gains):
        for w, g in zip(weights, gains):
            x = F.linear(x, w)
            x = x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * g
        return x

    mesh = init_device_mesh(ctx.device.type, (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(ctx.rank)
    tensors = [torch.randn(2, 2, generator=gen, dtype=dtype).to(ctx.device) for _ in range(1 + DTENSOR_LAYERS)]
    gains = [torch.ones(2, dtype=dtype, device=ctx.device) for _ in range(DTENSOR_LAYERS)]
    seconds, calls = {}, {}
    for kind in ("plain", "dtensor"):
        wrap = (lambda t: distribute_tensor(t, mesh, [Replicate()])) if kind == "dtensor" else (lambda t: t)
        x, *weights = [wrap(t).requires_grad_() for t in tensors]
        norms = [wrap(g).requires_grad_() for g in gains]
        leaves = [x, *weights, *norms]
        out = layers(x, weights, norms).sum()
        backward = lambda: torch.autograd.grad(out, leaves, retain_graph=True)
        backward()
        forward_calls, backward_calls = _Counting(), _Counting()
        with forward_calls:
            layers(x, weights, norms)
        with backward_calls:
            backward()
        calls[kind] = (forward_calls.calls, backward_calls.calls)
        seconds[kind] = (_timed(ctx, lambda: layers(x, weights, norms), budget, sync),
                         _timed(ctx, backward, budget, sync))
    return tuple(max(0.0, (seconds["dtensor"][i] - seconds["plain"][i]) / max(calls["dtensor"][i], 1))
                 for i in range(2))


REDISTRIBUTE_CALLS = 20   # calls of each collective, DTensor's and plain, timed one by one at each size
REDISTRIBUTE_WIDTH = 64   # the buffers' last dim: [n / width, width], an activation's [tokens, hidden] in miniature


def _rows_and_width(n: int, ranks: int) -> tuple[int, int]:
    """The [rows, width] buffer of about `n` elements the host-work probes time: a whole number of columns and of
    rows on each of `ranks` ranks (REDISTRIBUTE_WIDTH wide, at least one row per rank)."""
    width = ranks * max(1, REDISTRIBUTE_WIDTH // ranks)
    return max(ranks, n // width - (n // width) % ranks), width


def _redistribute(ctx: RankContext, dtype, sizes: Sequence[int], sync) -> tuple[float, float, float]:
    """Host seconds DTensor's `redistribute` adds to one collective beyond the table's plain one, (all-reduce,
    all-gather, reduce-scatter): at each of the table's sizes `sizes` (the collective's whole tensor, as
    `collectives.price` counts it) on a 1-D DeviceMesh of every rank, a `Partial()` DTensor redistributed to
    `Replicate()` against `collective_cases`' all-reduce, a `Shard(1)` one (split along its last dim, as the
    sequence-parallel and column-parallel outputs are) to `Replicate()` against its all-gather, and a `Partial()`
    one to `Shard(0)` against its all-reduce (gloo runs `reduce_scatter_tensor` as an all-reduce of the whole
    buffer, which is how `TORCH_NATIVE` prices a reduce-scatter). Each call after a barrier, as a step issues
    them one at a time; each figure the main thread's CPU time (`time.thread_time`: the host work is on the
    rank's own core, and its CPU time does not count the wait for the peer, which the table prices), the median
    of REDISTRIBUTE_CALLS calls, the slowest rank's; the difference's median over the sizes (on 2 gloo CPU
    ranks it was the same from 1 KB to 1 MB, 0.25-0.6 ms a call: benchmarks/costmodel_fidelity.md, session 60
    helper E)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    g = ctx.world
    mesh = init_device_mesh(ctx.device.type, (g,))
    differences: dict[str, list[float]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for n in sizes:
        rows, width = _rows_and_width(n, g)
        plain = dict(collective_cases(ctx, dtype, rows * width, g, None))
        partial = DTensor.from_local(torch.ones(rows, width, dtype=dtype, device=ctx.device), mesh, [Partial()],
                                     run_check=False)
        piece = DTensor.from_local(torch.ones(rows, width // g, dtype=dtype, device=ctx.device), mesh, [Shard(1)],
                                   run_check=False)

        def redistribute(source, placement):
            def run():
                out = source.redistribute(mesh, [placement]).to_local()
                if hasattr(out, "wait"):   # an AsyncCollectiveTensor: the next operator on it waits
                    out.wait()
            return run

        cases = {("all_reduce", "plain"): plain["all_reduce"], ("all_gather", "plain"): plain["all_gather"],
                 ("all_reduce", "dtensor"): redistribute(partial, Replicate()),
                 ("all_gather", "dtensor"): redistribute(piece, Replicate()),
                 ("reduce_scatter", "dtensor"): redistribute(partial, Shard(0))}
        medians = _host_times(ctx, cases, sync)
        for kind, base in (("all_reduce", "all_reduce"), ("all_gather", "all_gather"),
                           ("reduce_scatter", "all_reduce")):
            differences[kind].append(medians[(kind, "dtensor")] - medians[(base, "plain")])
    return tuple(max(0.0, statistics.median(differences[kind])) for kind in differences)


def _host_times(ctx: RankContext, cases: dict, sync) -> dict:
    """Each case's main-thread CPU seconds per call, the slowest rank's median of REDISTRIBUTE_CALLS: every case
    run once untimed (DTensor's sharding propagation and FSDP2's lazy initialisation cache their plans), then the
    cases interleaved one call at a time, each after a barrier, so a burst of load elsewhere touches them alike."""
    cpu: dict = {key: [] for key in cases}
    for run in cases.values():
        run()
        sync()
    for _ in range(REDISTRIBUTE_CALLS):
        for key, run in cases.items():
            dist.barrier()
            start = time.thread_time()
            run()
            sync()
            cpu[key].append(time.thread_time() - start)
    return {key: _slowest(ctx, statistics.median(times)) for key, times in cpu.items()}


def _fsdp_collectives(ctx: RankContext, dtype, sizes: Sequence[int], sync) -> tuple[float, float, float]:
    """Host seconds FSDP2's collectives add over every rank beyond the one-rank gather and reduction whose host
    time `_fsdp_hooks` measures and the table's plain collective, (all-gather, reduce-scatter, all-reduce): at
    each of the table's sizes `sizes` (one parameter of that many elements), a module under `fully_shard` and
    one under `replicate` (the runtime's ZeRO-3 and data parallelism) on a mesh of every rank against the same
    on a one-rank axis (where FSDP2 moves nothing), in main-thread CPU time (`_host_times`): the forward's
    difference (the gather) less `collective_cases`' all-gather, the backward's (a forward and backward less
    the forward: the gradient's reduce-scatter, the replicated one's all-reduce) less its all-reduce (gloo runs
    `reduce_scatter_tensor` as one, and `TORCH_NATIVE` prices it so); the gather also less a copy of the shard
    and one of the whole (FSDP2's copy-in and copy-out, which the simulator prices as copies). The median of each over the sizes, at
    least 0 (on 2 gloo CPU ranks the gather's was 0.35-0.55 ms up to 1 MB: benchmarks/costmodel_fidelity.md,
    session 60 helper E)."""
    from torch import nn
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world, 1), mesh_dim_names=("ranks", "alone"))
    differences: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
    for n in sizes:
        rows, width = _rows_and_width(n, ctx.world)
        x = torch.ones(2, width, dtype=dtype, device=ctx.device)
        plain = dict(collective_cases(ctx, dtype, rows * width, ctx.world, None))
        piece, whole = (torch.ones(k, dtype=dtype, device=ctx.device) for k in (rows * width // ctx.world, rows * width))
        cases = {("plain", "all_gather"): plain["all_gather"], ("plain", "all_reduce"): plain["all_reduce"],
                 ("copy", "in"): piece.clone, ("copy", "out"): whole.clone}
        for wrap, name in ((fully_shard, "sharded"), (replicate, "replicated")):
            for axis in ("ranks", "alone"):
                module = wrap(nn.Linear(width, rows, bias=False).to(ctx.device, dtype), mesh=mesh[axis])
                cases[(name, axis, "forward")] = lambda m=module: m(x)
                cases[(name, axis, "step")] = lambda m=module: m(x).sum().backward()
        t = _host_times(ctx, cases, sync)

        def over(name: str, phase: str) -> float:   # the world's less the one-rank axis's, forward or backward
            if phase == "forward":
                return t[(name, "ranks", "forward")] - t[(name, "alone", "forward")]
            return ((t[(name, "ranks", "step")] - t[(name, "ranks", "forward")])
                    - (t[(name, "alone", "step")] - t[(name, "alone", "forward")]))

        copies = t[("copy", "in")] + t[("copy", "out")]   # the copy-in and copy-out `_copy_s` prices
        differences["all_gather"].append(over("sharded", "forward") - t[("plain", "all_gather")] - copies)
        differences["reduce_scatter"].append(over("sharded", "backward") - t[("plain", "all_reduce")])
        differences["all_reduce"].append(over("replicated", "backward") - t[("plain", "all_reduce")])
    return tuple(max(0.0, statistics.median(differences[kind])) for kind in differences)


FSDP_LAYERS = 16   # tiny linear layers (a weight and a bias each) of the stack whose FSDP2 hooks are timed
FSDP_CALLS = 60    # calls of each stack timed one by one; the lower quartile is kept, as load only ever adds time


def _fsdp_hooks(ctx: RankContext, dtype, sync) -> tuple[float, float, float, float]:
    """Host seconds FSDP2's hooks add, (forward per parameter, backward per parameter, forward per group,
    backward per group): stacks of FSDP_LAYERS tiny linear layers (too small for their kernels to count) under
    `fully_shard` on a one-rank axis of each rank's own, so that its all-gathers and reduce-scatters have no
    other rank to wait for (the collectives' fit prices that), against the same stack plain:
    * `flat`, one group of all P parameters (the root: gathered before forward and kept for backward, its
      gradients reduced once): forward g_f + P p_f more than plain, backward g_b + P p_b;
    * `nested`, each layer its own group (as the torch-native runtime shards each block), L groups resharded
      after forward and gathered again before backward: forward L g_f + P p_f, backward the L gathers again
      (L g_f + P p_f) and L reductions (L g_b + P p_b).
    Solved for the four (each at least 0). The runtime's `replicate` is FSDP2 with one replica per rank: the
    same hooks. Each figure is a difference of timings (hundreds of microseconds each on a CPU), so each timing
    is the lower quartile of FSDP_CALLS calls timed one by one: a call the scheduler interrupted is slower,
    never faster, and does not move it."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def stack() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(2, 2) for _ in range(FSDP_LAYERS)]).to(ctx.device, dtype)

    mesh = init_device_mesh(ctx.device.type, (dist.get_world_size(), 1), mesh_dim_names=("ranks", "alone"))
    plain, flat, nested = stack(), stack(), stack()
    fully_shard(flat, mesh=mesh["alone"])
    for layer in nested:
        fully_shard(layer, mesh=mesh["alone"])
    fully_shard(nested, mesh=mesh["alone"])
    x = torch.ones(2, 2, dtype=dtype, device=ctx.device)
    stacks = {"plain": plain, "flat": flat, "nested": nested}
    runs = {**{name: (lambda m=m: m(x)) for name, m in stacks.items()},
            **{f"{name}_step": (lambda m=m: m(x).sum().backward()) for name, m in stacks.items()}}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(FSDP_CALLS):   # interleaved, one call at a time: a burst of load elsewhere inflates a few calls
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            sync()
            seconds[name].append(time.perf_counter() - start)
    least = {name: _slowest(ctx, sorted(times)[len(times) // 4]) for name, times in seconds.items()}
    forward = {name: least[name] - least["plain"] for name in ("flat", "nested")}
    backward = {name: (least[f"{name}_step"] - least[name]) - (least["plain_step"] - least["plain"])
                for name in ("flat", "nested")}
    layers, params = FSDP_LAYERS, sum(1 for _ in plain.parameters())
    group_f = max(0.0, (forward["nested"] - forward["flat"]) / (layers - 1))
    param_f = max(0.0, (forward["flat"] - group_f) / params)
    reductions = backward["nested"] - layers * group_f - params * param_f   # L g_b + P p_b
    group_b = max(0.0, (reductions - backward["flat"]) / (layers - 1))
    param_b = max(0.0, (backward["flat"] - group_b) / params)
    return param_f, param_b, group_f, group_b


PYTHON_DEPTH, PYTHON_WIDTH = 8, 4   # the stack of Python-only modules `_python_instruction` times: 4 chains of 8


class _Config:
    """A model configuration's flags, read on every call as a Hugging Face module reads its config."""

    use_cache, output_attentions, heads = False, False, 4


def _python_stack() -> "torch.nn.Module":
    """PYTHON_WIDTH chains of PYTHON_DEPTH modules whose forward is only Python (a config read, a keyword
    argument, a shape tuple, an identity submodule, a tuple returned and unpacked), passing a tensor through
    without an ATen call: the kind of code a module runs between its ATen calls."""
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, config: _Config, child: nn.Module | None) -> None:
            super().__init__()
            self.config, self.child, self.norm = config, child, nn.Identity()

        def forward(self, x, mask=None, position=None, **kwargs):
            config = self.config
            if config.use_cache and kwargs.get("past") is not None:
                x = kwargs["past"]
            h = self.norm(x)
            _shape = (*h.shape[:-1], config.heads, -1)
            if self.child is not None:
                h = self.child(h, mask=mask, position=position, **kwargs)[0]
            return (h, None) if config.output_attentions else (h,)

    chains = []
    for _ in range(PYTHON_WIDTH):
        child = None
        for _ in range(PYTHON_DEPTH):
            child = Layer(_Config(), child)
        chains.append(child)
    return nn.ModuleList(chains)


def _python_instruction(ctx: RankContext, budget: Budget, sync) -> float:
    """Seconds per Python bytecode instruction of module code (`OpEfficiency.python_instruction_s`): the stack of
    `_python_stack` called, timed as every figure here, over the instructions `count_python_instructions` counts
    in one call, as `importer.call_count` counts a user's module's forward. On this 2-core box, one thread, the
    stack ran ~15 ns an instruction; three Hugging Face forwards (benchmarks/costmodel_fidelity_torch.py) ran
    0.3 ms beyond a replay of their ATen calls, 20-40 ns over their 12-17 thousand instructions."""
    from parsat.importer.call_count import count_python_instructions

    stack, x = _python_stack(), torch.zeros(2, 2, device=ctx.device)

    def run():
        for chain in stack:
            chain(x, mask=None)

    run()
    return _timed(ctx, run, budget, sync) / count_python_instructions(run)


SEQUENCE_BLOCKS, SEQUENCE_HEADS, SEQUENCE_REPEATS = 2, 4, 10   # `_sequence_factor`'s reference; each call alone


def sequence_calls(tokens: int, features: int, dtype, device) -> list[tuple[object, tuple, dict]]:
    """The ATen calls (operator, arguments, keyword arguments) of SEQUENCE_BLOCKS pre-norm transformer blocks on
    [tokens, features] (an RMS norm, SEQUENCE_HEADS heads' attention written out in products and a softmax, a
    layer norm, a tanh MLP four times as wide, two residual adds), forward and then backward (`torch.autograd.grad`
    of the sum), in the order a step runs them, recorded by a `TorchDispatchMode`: the reference
    `_sequence_factor` runs in sequence and alone. Not any benchmark's model: a generic block whose calls are the
    kinds a transformer's step makes (products, norms, softmax, views, elementwise), in the calibration's sizes."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    gen = torch.Generator().manual_seed(0)

    def weight(*shape):
        return (torch.randn(*shape, generator=gen, dtype=dtype) * shape[0] ** -0.5).to(device).requires_grad_()

    d, h = features, SEQUENCE_HEADS
    blocks = [[weight(d, d) for _ in range(4)] + [weight(d, 4 * d), weight(4 * d, d)] for _ in range(SEQUENCE_BLOCKS)]
    gains = [torch.ones(d, dtype=dtype, device=device).requires_grad_() for _ in range(2 * SEQUENCE_BLOCKS)]

    def heads(t):
        return t.view(tokens, h, d // h).transpose(0, 1)

    def forward(x):
        for (wq, wk, wv, wo, w1, w2), g1, g2 in zip(blocks, gains[::2], gains[1::2]):
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g1
            scores = torch.softmax(heads(n @ wq) @ heads(n @ wk).transpose(1, 2) * (d // h) ** -0.5, -1)
            x = x + (scores @ heads(n @ wv)).transpose(0, 1).reshape(tokens, d) @ wo
            x = x + torch.tanh(F.layer_norm(x, (d,), g2) @ w1) @ w2
        return x

    calls: list = []

    class _Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    x = torch.randn(tokens, d, generator=gen, dtype=dtype).to(device)
    with _Recording():
        out = forward(x).sum()
        torch.autograd.grad(out, [w for b in blocks for w in b] + gains)
    return calls


def _sequence_factor(ctx: RankContext, dtype, size: int, budget: Budget, sync) -> float:
    """How much slower an operator runs in a step than timed alone (`OpEfficiency.sequence_factor`): the
    reference's calls (`sequence_calls` on [t, t / 2] for t = size / 2 and size, the GEMM grid's largest) run in
    order, again and again over the window, over the sum of each call timed alone right after one untimed call of
    itself (SEQUENCE_REPEATS in a row, as the GEMMs, memory-bound operators and dispatch chain above are timed:
    warm, its code and operands in cache); all ranks at once, each side the slowest rank's; the geometric mean over
    the two sizes (it moves with the size: 1.48 and 1.26 for 128 and 256 tokens). Replayed below autograd
    (`no_grad`): the calls' own time. On a CPU both sides are the thread's CPU time, so the factor is the code's
    and does not take up the box's load a second time (the wall-time figures it multiplies already hold it: on a
    box at load 5-9 the same ratio in wall time came out 1.33-2.06). A Hugging Face LLaMA's own forward calls ran
    1.53-1.57x in order what they ran alone, GPT-2's 1.49-1.54x (benchmarks/costmodel_fidelity.md, 2026-12-05
    helper B). At least 1."""
    clock = time.perf_counter if ctx.device.type == "cuda" else time.thread_time
    factors = []
    for tokens in (max(size // 2, 2 * SEQUENCE_HEADS), max(size, 2 * SEQUENCE_HEADS)):
        features = max(SEQUENCE_HEADS, tokens // (2 * SEQUENCE_HEADS) * SEQUENCE_HEADS)   # heads divide it
        calls = sequence_calls(tokens, features, dtype, ctx.device)

        def in_sequence():
            for op, args, kwargs in calls:
                op(*args, **kwargs)

        def alone() -> float:
            total = 0.0
            for op, args, kwargs in calls:
                op(*args, **kwargs)
                sync()
                start = clock()
                for _ in range(SEQUENCE_REPEATS):
                    op(*args, **kwargs)
                sync()
                total += (clock() - start) / SEQUENCE_REPEATS
            return total

        with torch.no_grad():
            dist.barrier()
            sequence = _timed_after(ctx, lambda: None, in_sequence, replace(budget, clock=clock), sync)
            dist.barrier()
            factors.append(sequence / _slowest(ctx, statistics.median(alone() for _ in range(3))))
    return max(1.0, statistics.geometric_mean(factors))


def _chain_dispatch(ctx: RankContext, start: torch.Tensor, budget: Budget, sync) -> tuple[float, float]:
    """Seconds per operator of a chain of tiny operators from `start` (which needs a gradient): forward with
    autograd recording, then the same recorded chain's backward again and again. The operators are too small
    for their kernels to count: what is left is dispatch."""
    def chain():
        y = start
        for i in range(DISPATCH_CHAIN):
            y = apply_op("relu" if i % 2 else "scale", [y], {} if i % 2 else {"c": 1.0})
        return y

    forward = _timed(ctx, chain, budget, sync) / DISPATCH_CHAIN
    graph = chain().sum()
    backward = _timed(ctx, lambda: graph.backward(retain_graph=True), budget, sync) / DISPATCH_CHAIN
    return forward, backward


STEP_CALL_CHAIN = 8   # tiny operators in the chains `StepCalls` times: about a small model's forward


def _interpreted_chain(ctx: RankContext, dtype) -> RankProgram:
    """`parsat run`'s rank program (`executor.RankProgram`) of a plan that is `StepCalls`' chain: a data input x
    ([2, 2]), then `STEP_CALL_CHAIN` operators, scale and relu in turn, each on the previous one's output, whole on
    every rank (a mesh of one axis over all ranks, every value free on it: no parallel node, no collective)."""
    whole, degrees = Placement.whole(1), Degrees.whole(2)
    nodes = [PNode(0, "leaf", "x", (), (), (2, 2), degrees, "input", "", whole)]
    for i in range(1, STEP_CALL_CHAIN + 1):
        op, attrs = ("scale", (("c", 1.0),)) if i % 2 else ("relu", ())
        nodes.append(PNode(i, "op", op, (i - 1,), attrs, (2, 2), degrees, "", "", whole))
    pcg = PCG(tuple(nodes), (STEP_CALL_CHAIN,), ("out",), Mesh.of((ctx.world,)))
    name = next(name for name, (_precision, kind, _other) in DTYPES.items() if kind == dtype)
    return RankProgram(pcg, ctx, TrainConfig(dtype=name), operator_library())


STEP_UPDATE_TENSORS = 4   # tiny parameter tensors whose update `StepCalls` times: a small model's few weights


class StepCalls:
    """The calls `parsat run`'s step makes around its operators' kernels, each as the step makes it, in passes
    spread over the calibration (`run_pass`; `_rank_measure` runs `STEP_ROUNDS_FACTOR`, each figure the median of
    its passes, as `GemmPasses` does the products'): each timed as the first calls after a barrier that follows
    `_step_product`'s forward and backward (not timed), one call (or chain) a round in `budget.repeats` rounds a
    pass (`_timed_after`), on the compute clock (a rank's thread CPU on a CPU core of its own), each round the
    slowest rank's, their median; seconds of:

    * "dispatch" (`OpEfficiency.step_dispatch_s`): `_chain_dispatch`'s chain of tiny operators with autograd
      recording (`STEP_CALL_CHAIN` long, through `apply_op` as the interpreter calls a node), per call;
    * "backward" (`step_backward_dispatch_s`): the same chain's backward, its graph recorded before the product
      (autograd runs a node's backward after the products' backward kernels), per node;
    * "node" (`step_node_s`): `parsat run`'s interpreter running the same chain as a plan (`_interpreted_chain`),
      less the chain's own calls, per node it runs: its loop between the nodes' calls;
    * "parallel" (`step_parallel_s`): one `parallel_op` replicate of a tiny tensor needing a gradient over all
      ranks a round (the runtime's own path of a parallel node: `apply_parallel`, the `Comm`, the autograd
      Function, its identity body; no collective runs in a replicate's forward): in a step each parallel node
      follows other work, not another parallel node;
    * "loss_path" (`step_loss_path_s`): `RankProgram.loss` on that plan's output, less `loss_terms` on the same
      piece (what `_loss` times): the interpreter's own work around the objective (the target's piece cut and
      moved, the output's holders), per output;
    * "update_sgd", "update_adam" (`step_update_sgd_s`, `step_update_adam_s`): `parsat run`'s `Optimizer.step` over
      `STEP_UPDATE_TENSORS` tiny tensors whose gradients the backward before the barrier left, per tensor.

    Why: `dispatch_s`, `backward_dispatch_s` and `update_points`' smallest update are calls run again and again,
    warm; in a step a node's call follows a product, a backward, an optimizer and a wait in a collective or
    barrier, which left the dispatcher's code and data out of the core's caches. In `make demo`'s step every small
    call ran 3-20x its warm figure on the ranks' thread CPU (a replicate, no kernel, 0.09-0.10 ms against 4.6 us; a
    relu 3x), +0.30-0.40 ms over a 1.8 ms forward with its loss (benchmarks/demo_step.md, 2026-12-06 session 65,
    helper F); a probe in one process ran the replicate at 5.7 us warm, 12 us after a product, 27 us as a step's
    first call; the step's optimizer (two SGD updates) 0.25-0.36 ms where the warm points priced 0.136 (session 67,
    helper B)."""

    def __init__(self, ctx: RankContext, dtype, size: int, budget: Budget, sync) -> None:
        self.ctx, self.sync, self.rounds = ctx, sync, replace(budget, window_s=0.0)
        self.passes: list[dict[str, float]] = []
        self.step_product = _step_product(ctx, dtype, size)
        self.weight = torch.randn(size, size, dtype=dtype).to(ctx.device).requires_grad_()
        self.leaf = torch.randn(2, 2, dtype=dtype).to(ctx.device).requires_grad_()
        self.held: dict = {}
        self.groups = MeshGroups(Mesh.of([ctx.world]), ctx.rank, ctx.device, ctx.collective_timeout_s)
        self.free, self.counter = Placement((FREE,)), CommCounter()
        self.program = _interpreted_chain(ctx, dtype)
        self.target = torch.randn(2, 2, dtype=dtype).to(ctx.device)
        self.holders = ctx.world   # the chain's output: whole on every rank, 1 replica (`executor.output_holders`)
        self.tensors = [torch.randn(2, 2, dtype=dtype).to(ctx.device).requires_grad_()
                        for _ in range(STEP_UPDATE_TENSORS)]
        self.optimizers = {kind: Optimizer(self.tensors, TrainConfig(optimizer=kind)) for kind in ("sgd", "adam")}

    def product_and_backward(self) -> None:
        self.weight.grad = None
        (self.step_product() @ self.weight).sum().backward()
        dist.barrier()

    def chain(self) -> torch.Tensor:
        y = self.leaf
        for i in range(STEP_CALL_CHAIN):
            y = apply_op("relu" if i % 2 else "scale", [y], {} if i % 2 else {"c": 1.0})
        return y

    def recorded_then_product(self) -> None:
        self.held["chain"] = self.chain().sum()
        self.product_and_backward()

    def interpreted(self) -> None:
        self.counter.clear()
        self.program.forward(0, self.counter, {"x": self.leaf})

    def forward_then_product(self) -> None:
        self.held["env"] = self.program.forward(0, self.counter, {"x": self.leaf})
        self.product_and_backward()

    def replicate(self) -> None:
        self.counter.clear()
        parallel_op(REPLICATE, self.leaf, self.free, 0, None, self.groups, self.counter)

    def gradients_then_product(self) -> None:
        for t in self.tensors:
            t.grad = torch.ones_like(t)
        self.product_and_backward()

    def _timed(self, prepare: Callable[[], object], fn: Callable[[], object]) -> float:
        return _timed_after(self.ctx, prepare, fn, self.rounds, self.sync)

    def run_pass(self) -> None:
        """One round of every figure's rounds (their order as the docstring's)."""
        calls = self._timed(self.product_and_backward, self.chain)
        out = {"dispatch": calls / STEP_CALL_CHAIN,
               # the interpreter's forward of the same chain, less the chain's own calls: its loop, per node it runs
               "node": max(0.0, self._timed(self.product_and_backward, self.interpreted) - calls)
               / (STEP_CALL_CHAIN + 1),
               "backward": self._timed(self.recorded_then_product, lambda: self.held.pop("chain").backward())
               / (STEP_CALL_CHAIN + 1),   # the chain's nodes and its sum's
               # one node a round: in a step each parallel node follows other work (a product, the step's barrier)
               "parallel": self._timed(self.product_and_backward, self.replicate)}
        own = self._timed(self.forward_then_product, lambda: self.program.loss(self.held["env"], {"out": self.target}))
        bare = self._timed(self.forward_then_product, lambda: loss_terms(
            [(self.held["env"][STEP_CALL_CHAIN][0], self.target, 4, 1, self.holders)]))
        out["loss_path"] = max(0.0, own - bare)   # `RankProgram.loss` beyond `loss_terms`: the target's piece
        for kind, optimizer in self.optimizers.items():
            out[f"update_{kind}"] = self._timed(self.gradients_then_product, optimizer.step) / STEP_UPDATE_TENSORS
        self.passes.append(out)

    def figures(self) -> dict[str, float]:
        """Each figure the median of its passes."""
        return median_of_passes(self.passes)


def median_of_passes(passes: Sequence[dict]) -> dict:
    """Each figure (a key of any pass) the median of the passes that measured it, in the order first measured."""
    keys = list(dict.fromkeys(key for p in passes for key in p))
    return {key: statistics.median(p[key] for p in passes if key in p) for key in keys}


SKEW_BURSTS = (0, 2, 8, 16)


def _skew(ctx: RankContext, dtype, size: int, budget: Budget, compute: Budget, sync) -> list[list[float]]:
    """[the burst's compute as calibrated, the cycle's time beyond the burst] per burst length, on every rank.

    Ranks that do the same work between two collectives still arrive apart
    (cores shared with each other and other processes, OS noise), and the
    collective waits for the last one. Timed as a step runs: a burst of
    products, then a small all-reduce, repeated; a burst's cycle is the
    median of its cycles, as a run's step is the median of its steps
    (`step_statistic`), beyond the same burst timed alone in wall time by
    the same rounds (`_timed`, every rank computing at once), so that what
    is fitted is the collective's wait and not how a long burst shares a
    core with the box's other jobs, which a step's short compute between
    collectives does not (with the burst priced as the calibrated product
    times its length, calibrations at load 5-8 fitted 0.50-1.11, pricing the
    demo's 4-9 ms step at 8.8-19.8 ms; 2026-12-06). The compute it is fitted
    against is the burst as calibrated (`compute`'s clock), which is what the
    cost model multiplies the term by.
    """
    s = max(m for m, n, k in gemm_shapes(size) if m == n == k)
    a = torch.randn(s, s, dtype=dtype, device=ctx.device)
    x = torch.ones(1024, dtype=dtype, device=ctx.device)
    one = _timed(ctx, lambda: a @ a, compute, sync)
    rows = []
    for burst in SKEW_BURSTS:
        def products(burst=burst):
            for _ in range(burst):
                a @ a

        alone = _timed(ctx, products, budget, sync) if burst else 0.0
        cycles = []
        dist.barrier()
        for i in range(max(30, 6 * budget.repeats) + 2):
            start = time.perf_counter()
            for _ in range(burst):
                a @ a
            y = x.clone()
            dist.all_reduce(y)
            sync()
            if i >= 2:
                cycles.append(time.perf_counter() - start)
        rows.append([burst * one, spread(cycles).median_s - alone])   # the run's statistic (`_in_rounds`)
    return rows


TURN_BURSTS_S = (0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3)   # compute between two collectives, as calibrated (`_turns`)
TURN_ROUNDS = 3       # the bursts measured this many times, interleaved; the median of each is kept
TURN_ELEMENTS = 256   # the all-reduce: small enough that its own time is latency
TURN_SIDE = 64        # the products of a burst: 64 x 64, a few microseconds each, so bursts come in fine steps


def _turns(ctx: RankContext, dtype, budget: Budget, sync) -> list[list[float]]:
    """[the burst's compute as calibrated, the excess on all ranks, the excess on ranks with a core each] per
    burst of `TURN_BURSTS_S`. The excess: every rank computing a burst of small products and then all-reducing
    `TURN_ELEMENTS` elements, again and again, beyond the burst alone (all ranks computing at once, as every
    compute figure is calibrated) and the all-reduce alone, back to back (as the collectives' table is where ranks share cores). Each
    figure is the slowest rank's average (`_timed`), each excess the median of `TURN_ROUNDS` interleaved
    rounds. Where ranks outnumber the cores, the same again on as many ranks as cores (the others blocked in a
    barrier, using no core): what load elsewhere on the box does to the method (a rank that sleeps in
    collectives is scheduled ahead of the box's other jobs, so its bursts can run faster than the same burst
    calibrated alone), which `fit_turn` takes off; with a core each, the two are the same measurement.

    Why: a rank whose peer shares its core meets a collective while that peer is still computing; the
    collective cannot finish before the scheduler gives the peer's core back to it (a time slice, at most the
    compute the peer had left), and every rank waits. Back-to-back collectives never meet it (every rank is
    blocked in the collective, none holds a core), so the collectives' table does not have it; it does not
    grow with the compute as stragglers do (`_skew`)."""
    a = torch.randn(TURN_SIDE, TURN_SIDE, dtype=dtype, device=ctx.device)
    x = torch.ones(TURN_ELEMENTS, dtype=dtype, device=ctx.device)
    one = _timed(ctx, lambda: a @ a, budget, sync)   # the slowest rank's: the same on every rank
    counts = [max(1, round(target / max(one, 1e-9))) for target in TURN_BURSTS_S]
    slow = Budget(max(budget.repeats, 10), max(budget.window_s, 0.1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    alone = min(ctx.world, cores)   # ranks < world here are not pinned (`launch.share_cores`): all cores
    control = dist.new_group(list(range(alone))) if 2 <= alone < ctx.world else None

    def excesses(group) -> dict[int, tuple[float, float]]:
        """count -> (compute, excess) on `group`'s ranks (None: all)."""
        def reduce():
            dist.all_reduce(x.clone(), group=group)

        alone_s = _timed(ctx, reduce, slow, sync, group)
        out = {}
        for count in counts:
            def burst(count=count):
                for _ in range(count):
                    a @ a

            def cycle(count=count):
                burst(count)
                reduce()

            took = _timed(ctx, burst, slow, sync, group)
            out[count] = (took, _timed(ctx, cycle, slow, sync, group) - took - alone_s)
        return out

    rounds: list[tuple[dict, dict]] = []
    for _round in range(TURN_ROUNDS):
        shared = excesses(None)
        own = {}
        if control is not None:
            if ctx.rank < alone:
                own = excesses(control)
            dist.barrier()
        rounds.append((shared, own))
    rows, own_rows = [], all(o for _r, o in rounds)
    for count in counts:
        rows.append([statistics.median(r[count][0] for r, _o in rounds),
                     statistics.median(r[count][1] for r, _o in rounds),
                     statistics.median(o[count][1] for _r, o in rounds) if own_rows else 0.0])
    return rows   # the figures are the slowest rank's; a rank outside the control group has 0.0 for its excess


def fit_turn(rows: Sequence[Sequence[float]]) -> float:
    """The longest a collective after compute waits for a peer's turn on a shared core (>= 0): the q of
    wait = min(q, compute since the previous collective) closest, by least squares, to `_turns`' rows
    (compute, excess on all ranks, excess on ranks with a core each), the excess being the difference of the
    two. A peer holding the core can hold it for no longer than the compute it has left, and a scheduler
    gives the core back within a time slice: so the wait grows with short bursts and stops growing at about
    one slice (measured: benchmarks/costmodel_fidelity.md, run T6)."""
    points = sorted((max(0.0, float(row[0])), float(row[1]) - (float(row[2]) if len(row) > 2 else 0.0))
                    for row in rows)
    if not points:
        return 0.0
    candidates = []
    for k in range(len(points)):   # q between the k-th shortest burst and the one before: the capped ones' mean
        lower = points[k - 1][0] if k else 0.0
        capped = [e for _c, e in points[k:]]
        candidates.append(min(max(sum(capped) / len(capped), lower), points[k][0]))

    def error(q: float) -> float:
        return sum((min(q, c) - e) ** 2 for c, e in points)

    return min(candidates, key=lambda q: (error(q), q))


def fit_skew(rows_by_rank: Sequence[Sequence[Sequence[float]]], turn_s: float = 0.0) -> float:
    """The fraction of the compute between two collectives that a step adds waiting for stragglers (>= 0):
    the least-squares slope of (cycle - calibrated compute) against calibrated compute over every rank's
    bursts (absolute errors: the long bursts, where the excess is mostly stragglers, weigh most), less the
    wait for a peer's turn where ranks share cores (`turn_s`, `fit_turn`: priced on its own, not twice)."""
    xs = [c for rows in rows_by_rank for c, _w in rows]
    ys = [w - min(turn_s, c) for rows in rows_by_rank for c, w in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return 0.0
    return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)


def _groups(ctx: RankContext) -> dict[int, object]:
    """For every group size g >= 2 dividing the world: this rank's group of g consecutive ranks."""
    out = {}
    for g in range(2, ctx.world + 1):
        if ctx.world % g:
            continue
        enumeration = [list(range(s, s + g)) for s in range(0, ctx.world, g)]
        if g == ctx.world:
            out[g] = None  # the default group
        else:
            out[g], _ = dist.new_subgroups_by_enumeration(enumeration)
    return out


def collective_cases(ctx: RankContext, dtype, n: int, g: int, group) -> list[tuple[str, Callable[[], None]]]:
    """The collectives calibration times on one group of `g` ranks, on `n` elements each: (kind, run once).

    Public so that a benchmark times exactly what calibration times (benchmarks/demo_collective.py)."""
    position = ctx.rank % g
    full = torch.ones(n, dtype=dtype, device=ctx.device)
    piece = torch.ones(n // g, dtype=dtype, device=ctx.device)
    parts = [torch.empty_like(piece) for _ in range(g)]
    out_piece = torch.empty_like(piece)

    def all_reduce():
        out = full.clone()
        dist.all_reduce(out, group=group)

    def all_gather():
        dist.all_gather(parts, piece, group=group)
        torch.cat(parts)

    def reduce_scatter():
        dist.reduce_scatter(out_piece, list(full.chunk(g)), group=group)

    def all_to_all():
        dist.all_to_all(list(torch.empty_like(full).chunk(g)), list(full.chunk(g)), group=group)

    def send_recv():
        peer = ctx.rank + 1 if position % 2 == 0 else ctx.rank - 1
        if position % 2 == 0:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)

    cases = [("all_reduce", all_reduce), ("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
             ("all_to_all", all_to_all)]
    if g == 2:
        cases.append(("send_recv", send_recv))
    return cases


def _collective_calls(ctx: RankContext, dtype, sizes: Sequence[int]) -> list[tuple[tuple[str, int, float], Callable]]:
    """Each collective kind, group size (`_groups`) and buffer size: ((kind, group, bytes), run once)."""
    item = torch.empty((), dtype=dtype).element_size()
    calls = []
    for g, group in _groups(ctx).items():
        for n in sizes:
            n = max(g, n - n % g)
            calls += [((kind, g, float(n * item)), fn) for kind, fn in collective_cases(ctx, dtype, n, g, group)]
    return calls


def _collective_seconds(kind: str, timed: Callable[[], float]) -> float | None:
    """`timed()`'s seconds a message (a send/recv round trip is two), None for a collective this backend lacks."""
    try:
        seconds = timed()
    except (RuntimeError, ValueError):
        return None
    return seconds / 2 if kind == "send_recv" else seconds


def _collectives(ctx: RankContext, dtype, budget: Budget, sizes: Sequence[int], sync) -> list[list]:
    """Ranks sharing cores: each collective kind, group size and buffer size timed again and again (`_timed`),
    [kind, group, bytes, seconds], the slowest rank's; there a collective after compute also waits for a peer's
    turn on the core, which `_turns` measures against this back-to-back figure and the cost model prices on its
    own. Ranks with a core or GPU each: `StepCollectives`."""
    rows = []
    for head, fn in _collective_calls(ctx, dtype, sizes):
        seconds = _collective_seconds(head[0], lambda: _timed(ctx, fn, budget, sync))
        if seconds is not None:
            rows.append([*head, seconds])
    return rows


class StepCollectives:
    """Ranks with a core or GPU each: each collective kind, group size and buffer size as a step issues it, right
    after a product (not timed) on every rank, one call a round started by a barrier, the slowest rank's
    (`_timed_after`, as `_loss`), in `STEP_ROUNDS_FACTOR` passes spread over the calibration (`_rank_measure` runs
    one beside each of `StepCalls`' passes) of `budget.repeats` rounds each; a figure the median of its passes'
    medians (`median_of_passes`), as `StepCalls` and `GemmPasses` keep theirs: what `parsat run`'s step meets, a
    collective of ranks that were computing, told by the step's statistic.

    Why passes: on this 2-core VM the same work runs at half speed for seconds at a time (`GemmPasses`); timed
    in one block of 15 rounds, one calibration's 2 KB all-reduce came out 1.218 ms where two others gave 0.438
    and 0.606, and its plan's exposed communication was priced 1.545 ms against ~0.74 (benchmarks/demo_step.md,
    the lead's check at 6ee438b). The median of the passes' medians, not of all rounds together: a pass in a slow
    stretch is one vote of three either way, but a stretch covering half of one pass's rounds would still tilt
    the median of all rounds, and its pass's median is one figure among the others.

    Why not back to back: on the 2-core VM, timed back to back (many calls a round, their mean), the 2 KB
    all-reduce came out 1.33, 1.79 and 3.52 ms in three calibrations of one quiet half hour, where the demo's
    step, its one all-reduce of 10 KB right after the forward's product, took 0.2-0.3 ms (benchmarks/
    demo_step.md, 2026-12-06, session 65): a figure of calls the step never makes."""

    def __init__(self, ctx: RankContext, dtype, budget: Budget, sizes: Sequence[int], sync, size: int = 512) -> None:
        self.ctx, self.sync, self.rounds = ctx, sync, replace(budget, window_s=0.0)
        self.product = _step_product(ctx, dtype, size)
        self.calls = _collective_calls(ctx, dtype, sizes)
        self.passes: list[dict[tuple[str, int, float], float]] = []

    def run_pass(self) -> None:
        """`budget.repeats` rounds of every collective, one after the other."""
        out = {}
        for head, fn in self.calls:
            seconds = _collective_seconds(head[0], lambda: _timed_after(self.ctx, self.product, fn, self.rounds,
                                                                        self.sync))
            if seconds is not None:
                out[head] = seconds
        self.passes.append(out)

    def passes_of(self, kind: str, group: int) -> list[float]:
        """The smallest buffer's seconds in each pass of `kind` on `group` ranks (what its figure is the median of)."""
        head = min((h for h, _fn in self.calls if h[:2] == (kind, group)), key=lambda h: h[2], default=None)
        return [p[head] for p in self.passes if head in p]

    def rows(self) -> list[list]:
        """[kind, group, bytes, seconds] per collective: the median of its passes."""
        return [[*head, seconds] for head, seconds in median_of_passes(self.passes).items()]


# ------------------------------------------------------------------ fitting


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x by least squares on relative errors (every point weighs alike)."""
    w = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    if det <= 0:
        return 0.0, ys[0] / xs[0] if xs and xs[0] else 0.0
    slope = (sw * sxy - sx * sy) / det
    return (sy - slope * sx) / sw, slope


def fit_link(timings: Sequence[CollectiveTiming]) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of latency + bus factor x bytes / bandwidth through the timings."""
    p = timings[0].ranks
    xs = [bus_factor(t.kind, p) * t.nbytes for t in timings]
    latency, slope = fit_line(xs, [t.seconds for t in timings])
    if slope <= 0 or latency < 0:  # noise hides one of the two: the largest buffer's rate, the smallest's time
        big = max(timings, key=lambda t: t.nbytes)
        small = min(timings, key=lambda t: t.nbytes)
        slope = big.seconds / max(bus_factor(big.kind, p) * big.nbytes, 1.0)
        latency = max(0.0, small.seconds - slope * bus_factor(small.kind, p) * small.nbytes)
    return 1.0 / slope, latency


HALF_GRID = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _weighted_error(xs: Sequence[float], ys: Sequence[float], a: float, b: float) -> float:
    return sum(((a + b * x) / y - 1) ** 2 for x, y in zip(xs, ys))


def fit_gemm(timings: Sequence[OpTiming]) -> tuple[float, tuple[float, float, float]]:
    """(peak FLOP/s, (m_half, n_half, k_half)): t = c + FLOPs (1 + m_half/m)(1 + n_half/n)(1 + k_half/k) / peak.

    For each half-length triple of a grid, the intercept c (the call's own
    fixed cost) and 1/peak are a weighted least-squares line; the triple
    with the smallest relative error wins.
    """
    ys = [t.seconds for t in timings]
    best = None
    for hm, hn, hk in itertools.product(HALF_GRID, repeat=3):
        xs = [t.flops * (1 + hm / t.shape[0]) * (1 + hn / t.shape[1]) * (1 + hk / t.shape[2]) for t in timings]
        c, slope = fit_line(xs, ys)
        if slope <= 0:
            continue
        error = _weighted_error(xs, ys, c, slope)
        if best is None or error < best[0] - 1e-12:
            best = (error, 1.0 / slope, (float(hm), float(hn), float(hk)))
    if best is None:
        raise ValueError("the GEMM timings do not grow with their FLOPs: nothing to fit (too noisy?)")
    return best[1], best[2]


def fit_layouts(timings: Sequence[OpTiming], peak: float) -> dict[str, float]:
    """`OpEfficiency`'s `gemm_nt_*` and `gemm_tn_*` fields from the products timed with a transposed operand
    (`fit_gemm` on each layout's timings: its peak over the forward products' `peak`, and its half lengths);
    none for a layout not timed (an older calibration's timings)."""
    fields: dict[str, float] = {}
    for layout in ("nt", "tn"):
        rows = [t for t in timings if t.op == f"matmul_{layout}"]
        if not rows:
            continue
        rate, halves = fit_gemm(rows)
        fields[f"gemm_{layout}_rate"] = rate / peak
        fields.update({f"gemm_{layout}_half_{d}": h for d, h in zip("mnk", halves)})
    return fields


def fit_grids(timings: Sequence[OpTiming], nodes: Sequence[int], peak: float, dispatch_s: float) -> dict:
    """`OpEfficiency.gemm_grids` from the products timed on the grid `nodes` (`gemm_grid_nodes`), one per layout
    timed there ("nn": `matmul`, "nt", "tn": the backward products), each point's fraction of `peak` after the
    fixed cost `dispatch_s` the cost model adds to each call; none for a layout not timed on the whole grid (an
    older calibration's timings)."""
    grids = []
    for layout in ("nn", "nt", "tn"):
        op = "matmul" if layout == "nn" else f"matmul_{layout}"
        measured = {tuple(t.shape): t.seconds for t in timings if t.op == op}
        grid = grid_fractions(layout, measured, nodes, peak, dispatch_s)
        if grid is not None:
            grids.append(grid)
    return {"gemm_grids": tuple(grids)} if grids else {}


def fit_updates(timings: Sequence[OpTiming]) -> dict[str, tuple]:
    """`OpEfficiency.update_points` from the optimizer's timed updates (`_updates`): per optimizer timed, its
    (elements, seconds) in growing size, as measured. Not a line: an update's time per element changes with
    the size (a weight and its gradient in cache or not, a gradient's memory reused or new from the OS)."""
    points = tuple((kind, _growing(sorted((float(t.shape[0]), t.seconds) for t in timings
                                          if t.op == f"update_{kind}"))) for kind in ("adam", "sgd"))
    return {"update_points": tuple(p for p in points if p[1])} if any(p[1] for p in points) else {}


def fit_functions(timings: Sequence[OpTiming]) -> dict[str, tuple]:
    """`OpEfficiency.function_times` from `_functions`' timings: per function, the seconds per element of its
    forward and of its backward, each the slope between the smallest and the largest size (a negative slope, a
    noisy pair, reads 0); {} where none was timed."""
    def slope(op: str) -> float:
        points = sorted((t.shape[0], t.seconds) for t in timings if t.op == op)
        (n0, t0), (n1, t1) = points[0], points[-1]
        return max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0

    names = sorted({t.op[len("function_"):] for t in timings if t.op.startswith("function_")
                    and not t.op.endswith("_backward")})
    times = tuple((name, slope(f"function_{name}"), slope(f"function_{name}_backward")) for name in names)
    return {"function_times": times} if times else {}


def fit_elementwise(timings: Sequence[OpTiming]) -> dict[str, float]:
    """`OpEfficiency.elementwise_{kind}_s` from `_elementwise`'s timings: per kind, the seconds per output element,
    the slope of a line through its sizes (the intercept is the call's dispatch, priced on its own; a negative
    slope, noise, reads 0: not measured); {} where none was timed."""
    out = {}
    for kind in ELEMENTWISE:
        points = [(float(t.shape[0]), t.seconds) for t in timings if t.op == f"elementwise_{kind}"]
        if len(points) >= 2:
            _intercept, slope = fit_line([n for n, _ in points], [s for _, s in points])
            out[f"elementwise_{kind}_s"] = max(0.0, slope)
    return out


def fit_attention(timings: Sequence[OpTiming], peak: float, dispatch: tuple[float, float]) -> dict[str, float]:
    """`OpEfficiency.attention_efficiency` and `attention_half_flops` from `_attention`'s timings: the cost model
    prices a call of F forward FLOPs at F / (peak x e / (1 + h / F)) forward and `ATTENTION_BACKWARD_FACTOR`
    times that backward, so forward + backward less the two dispatches is a line in F, (1 + factor) (F + h) /
    (peak e), fitted through every shape (the whole step's attention time, not the forward's share of it); e at
    most 1, h at least 0. {} where nothing was timed."""
    forward = {t.shape: t for t in timings if t.op == "attention_causal"}
    pairs = [(t.flops, t.seconds + b.seconds - sum(dispatch)) for shape, t in forward.items()
             for b in timings if b.op == "attention_causal_backward" and b.shape == shape]
    if not pairs:
        return {}
    intercept, slope = fit_line([f for f, _ in pairs], [max(s, 1e-9) for _, s in pairs])
    if slope <= 0:   # noise: every shape at its mean rate
        slope, intercept = sum(s for _, s in pairs) / sum(f for f, _ in pairs), 0.0
    factor = 1.0 + ATTENTION_BACKWARD_FACTOR
    return {"attention_efficiency": min(1.0, factor / (peak * slope)),
            "attention_half_flops": max(0.0, intercept / slope)}


def _growing(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """`points` with each time at least the one before (an update of more elements, a collective of more bytes,
    does not take less: where a noisy measurement says so, the smaller one's time stands)."""
    out: list[tuple[float, float]] = []
    for x, y in points:
        out.append((x, max(y, out[-1][1]) if out else y))
    return tuple(out)


def fit_memory(timings: Sequence[OpTiming]) -> tuple[float, float, float, float]:
    """(memory bandwidth, half-bandwidth bytes, cache bytes, cache bandwidth) of the memory-bound timings.

    Time = c + bytes / bandwidth, with one line for working sets that fit in
    cache and one for those that stream from memory: the split between
    sizes that fits both lines best is the cache size (none when one line
    fits best). The half-bandwidth length is the intercept beyond the
    smallest call's time, in bytes at the memory line's bandwidth.
    """
    rows = sorted(timings, key=lambda t: t.nbytes)
    xs, ys = [t.nbytes for t in rows], [t.seconds for t in rows]

    def line(lo: int, hi: int) -> tuple[float, float, float]:
        c, slope = fit_line(xs[lo:hi], ys[lo:hi])
        if slope <= 0:
            slope = ys[hi - 1] / xs[hi - 1]
        return c, slope, _weighted_error(xs[lo:hi], ys[lo:hi], c, slope)

    c, slope, error = line(0, len(xs))
    best = (error, c, slope, 0.0, 0.0)
    sizes = sorted(set(xs))
    for cut in sizes[1:-1]:
        k = sum(1 for x in xs if x <= cut)
        if k < 2 or len(xs) - k < 2:
            continue
        cc, cs, ce = line(0, k)
        mc, ms, me = line(k, len(xs))
        if ce + me < best[0] and cs < ms:  # the cache must be the faster tier
            best = (ce + me, cc, ms, float(cut), 1.0 / cs)
    _e, intercept, slope, cache_bytes, cache_bw = best
    bandwidth = 1.0 / slope
    smallest = min(ys)
    return bandwidth, max(0.0, (intercept - smallest) * bandwidth), cache_bytes, cache_bw


def calibrate(name: str, nproc: int = 2, size: int = 512, repeats: int = 5, backend: str | None = None,
              collective_sizes: Sequence[int] = COMM_ELEMENTS, dtype: str = "float64",
              timeout_s: float = 600.0, window_s: float = WINDOW_S, oversubscribe: bool = False,
              dtensor: bool = False) -> Calibration:
    """Measure this machine on `nproc` ranks at once: operators, dispatch and collectives; the fitted Machine.

    Refused before any rank starts (ValueError): numbers outside their bounds (`dsl.bounds`), work that needs
    more memory than the machine has, and more ranks than cores or GPUs unless `oversubscribe` (then the
    result says so in `oversubscribed`)."""
    check_all("calibrate", {"--nproc": nproc, "--size": size, "--repeats": repeats,
                            "--comm-elements": list(collective_sizes), "--window": window_s, "--timeout": timeout_s})
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}")
    config = LaunchConfig(nproc=nproc, backend=backend, timeout_s=timeout_s)
    cuda = config.resolved_backend() == "nccl"
    crowded = oversubscription(nproc, cuda)
    if crowded and not oversubscribe:
        raise ValueError(f"{crowded}; calibrate with fewer ranks, or pass --oversubscribe to measure them sharing")
    check_memory(nproc, size, dtype, collective_sizes, cuda)
    results = launch(_rank_measure, (dtype, size, Budget(repeats, window_s), list(collective_sizes), dtensor,
                                     bool(crowded)), config)
    result = results[0]
    turn = fit_turn(result["turns"])   # every rank's rows are the slowest rank's figures
    skew = fit_skew([r["skew"] for r in results], turn if crowded else 0.0)
    dispatch = tuple(result["dispatch"])
    ops = tuple(OpTiming(op, tuple(shape), seconds, flops, nbytes) for op, shape, seconds, flops, nbytes
                in result["ops"])
    collectives = tuple(CollectiveTiming(kind, g, nbytes, seconds) for kind, g, nbytes, seconds
                        in result["collectives"])
    gemms = [t for t in ops if t.op == "matmul"]
    peak, halves = fit_gemm(gemms)
    layouts = fit_layouts(ops, peak) | fit_updates(ops) | fit_functions(ops) | fit_attention(ops, peak, dispatch)
    layouts |= fit_elementwise(ops) | fit_loss(ops) | fit_grids(ops, gemm_grid_nodes(size), peak, dispatch[0])
    bandwidth, half_bytes, cache_bytes, cache_bw = fit_memory([t for t in ops if t.op in ("relu", "add", "copy")])
    randn = [t for t in ops if t.op == "randn"]
    _c, random_slope = fit_line([t.nbytes for t in randn], [t.seconds for t in randn])
    random_bw = 1.0 / random_slope if random_slope > 0 else max(t.nbytes / t.seconds for t in randn)
    points = []
    for (kind, g), group in itertools.groupby(sorted(collectives, key=lambda c: (c.kind, c.ranks, c.nbytes)),
                                              key=lambda c: (c.kind, c.ranks)):
        timed = list(group)
        bw, latency = fit_link(timed)
        points.append(CollectivePoint(kind, "intra", g, latency, bw, _growing([(t.nbytes, t.seconds) for t in timed])))
    largest = max((p for p in points if p.collective == "all_reduce"), key=lambda p: p.group)
    step_latency = largest.latency_s / (2 * (largest.group - 1))
    precision, _dtype, other_dtype = DTYPES[dtype]
    other_name = next(name for name, kind, _o in DTYPES.values() if kind == other_dtype)
    other = next(t for t in ops if t.op == "matmul_other")
    same = max((t for t in gemms if t.shape == other.shape), key=lambda t: t.seconds, default=None)
    other_peak = peak * (same.seconds / other.seconds) if same is not None else other.flops / other.seconds
    if cuda:
        capacity = float(torch.cuda.get_device_properties(0).total_memory)
        label = torch.cuda.get_device_name(0)
    else:
        capacity = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / nproc
        label = f"cpu ({os.cpu_count()} cores, {nproc} ranks, {result['threads']} thread(s) each)"
    extra, hooks = tuple(result["dtensor"]), tuple(result["fsdp"])
    efficiency = OpEfficiency(dispatch_s=dispatch[0], backward_dispatch_s=dispatch[1],
                              **_step_call_fields(result["step_calls"]),
                              dtensor_dispatch_s=extra[0], dtensor_backward_dispatch_s=extra[1],
                              **dict(zip(REDISTRIBUTE_FIELDS, result["redistribute"])),
                              **dict(zip(FSDP_COLLECTIVE_FIELDS, result["fsdp_collectives"])),
                              fsdp_forward_param_s=hooks[0], fsdp_backward_param_s=hooks[1],
                              fsdp_forward_group_s=hooks[2], fsdp_backward_group_s=hooks[3],
                              python_instruction_s=result["python"], sequence_factor=result["sequence"],
                              gemm_half_m=halves[0], gemm_half_n=halves[1], gemm_half_k=halves[2],
                              memory_half_bytes=half_bytes, cache_bytes=cache_bytes, cache_bandwidth=cache_bw,
                              random_bandwidth=random_bw, async_dispatch=cuda, **layouts)
    machine = Machine(name, nproc, 1, peak_flops=peak, memory_bandwidth=bandwidth, memory_capacity=capacity,
                      intra_bandwidth=largest.bus_bandwidth, intra_latency=step_latency,
                      inter_bandwidth=largest.bus_bandwidth, inter_latency=step_latency, precision=precision,
                      peaks=((precision, peak), (other_name, other_peak)), efficiency=efficiency,
                      comm=CommProfile(points=tuple(points), sync_skew=skew, turn_s=turn if crowded else 0.0),
                      oversubscribed=crowding(nproc, cuda))   # the file says so; `optimize` warns
    return Calibration(machine, dispatch, ops, collectives, label,
                       f"{crowded}: each figure is of ranks waiting for each other" if crowded else "",
                       tuple((float(c), float(e), float(o)) for c, e, o in result["turns"]), turn,
                       "each rank's CPU time"
                       if compute_clock(cuda, result["threads"], bool(crowded)) is time.thread_time else "wall time",
                       tuple(result["square_passes"]), tuple(result["reduce_passes"]))


STEP_CALL_FIELDS = (("dispatch", "step_dispatch_s"), ("backward", "step_backward_dispatch_s"),
                    ("parallel", "step_parallel_s"), ("node", "step_node_s"), ("loss_path", "step_loss_path_s"),
                    ("update_sgd", "step_update_sgd_s"), ("update_adam", "step_update_adam_s"))
"""`StepCalls`' figures (a rank's `step_calls` keys) and the `OpEfficiency` field each prices."""


def _step_call_fields(calls: dict[str, float]) -> dict[str, float]:
    """A rank's `step_calls` figures as the `OpEfficiency` fields they fill (`STEP_CALL_FIELDS`)."""
    return {field: calls[key] for key, field in STEP_CALL_FIELDS}


def crowding(nproc: int, cuda: bool) -> Oversubscribed | None:
    """The cores (CPU) or GPUs (CUDA) `nproc` ranks would share, or None when each has its own.

    Ranks that share a core take turns on it, so a rank's GEMM, timed between the turns of the others, is
    measured as if it had the core alone: 8 ranks on 2 cores recorded a peak of 2,504 GFLOP/s."""
    if cuda:
        have, unit = torch.cuda.device_count(), "gpus"
    else:
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        unit = "cores"
    return Oversubscribed(nproc, have, unit) if nproc > have else None


def oversubscription(nproc: int, cuda: bool) -> str:
    """Why `nproc` ranks would share this machine's cores or GPUs (`crowding`), or '' when each has its own."""
    crowded = crowding(nproc, cuda)
    return f"--nproc {nproc} is more ranks than the {crowded.what} this process may use" if crowded else ""


def calibration_bytes(nproc: int, size: int, dtype: str, collective_sizes: Sequence[int]) -> int:
    """The memory one rank's measurements hold at their largest, in bytes (an upper estimate): the memory-bound
    operators' inputs and outputs (`memory_sizes`), the GEMMs in both dtypes, a collective's buffers for the
    largest group, the largest timed update (Adam: weight, gradient, two moments, temporaries), and torch
    itself."""
    item = max(torch.finfo(kind).bits // 8 for kind in DTYPES[dtype][1:])
    top = max(max(memory_sizes(size)), 2 * UPDATE_ROWS[-1] * UPDATE_WIDTH)
    elements = 4 * top + 6 * size * size + max(collective_sizes) * (nproc + 2)
    return elements * item + TORCH_BYTES


TORCH_BYTES = 400 * 2 ** 20   # a rank's resident size before it measures anything (torch, gloo, Python)


def check_memory(nproc: int, size: int, dtype: str, collective_sizes: Sequence[int], cuda: bool) -> None:
    """ValueError when the ranks' measurements need more memory than there is: the memory available (CPU: all
    ranks together) or a GPU's free memory (CUDA: one rank's), and each process's address-space limit
    (`ulimit -v`)."""
    import resource

    need = calibration_bytes(nproc, size, dtype, collective_sizes)
    limits = []
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((need, soft, "per rank, over the address-space limit (ulimit -v) of"))
    if cuda:
        limits.append((need - TORCH_BYTES, torch.cuda.mem_get_info(0)[0], "per rank, more than the GPU's free"))
    else:
        limits.append((need * nproc, _available_bytes(), f"for {nproc} ranks, more than the available"))
    for needed, have, words in limits:
        if needed > have:
            raise ValueError(f"calibrating --size {size} in {dtype} needs about {fmt_bytes(needed)} {words} "
                             f"{fmt_bytes(have)}: use a smaller --size, smaller --comm-elements or fewer ranks")


def _available_bytes() -> int:
    """Memory this machine can still give (MemAvailable), or its free pages where /proc/meminfo is missing."""
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def report(cal: Calibration) -> str:
    """The measurements next to what the calibrated machine predicts for them."""
    m = cal.machine
    e = m.efficiency
    lines = [f"machine '{m.name}' on {cal.device}, {m.precision}: peak {m.peak_flops / 1e9:.2f} GFLOP/s "
             f"(GEMM half lengths m {e.gemm_half_m:g}, n {e.gemm_half_n:g}, k {e.gemm_half_k:g}), memory "
             f"{m.memory_bandwidth / 1e9:.2f} GB/s (half at {e.memory_half_bytes / 1e3:.1f} kB; "
             f"{e.cache_bandwidth / 1e9:.1f} GB/s up to {e.cache_bytes / 1e6:.2f} MB), dispatch "
             f"{e.dispatch_s * 1e6:.1f} us forward + {e.backward_dispatch_s * 1e6:.1f} us backward per operator"
             + (f", {e.step_dispatch_s * 1e6:.1f} us forward + {e.step_backward_dispatch_s * 1e6:.1f} us backward "
                f"as a step makes its calls; the interpreter's loop {e.step_node_s * 1e6:.1f} us a node and "
                f"{e.step_loss_path_s * 1e6:.1f} us around an output's loss, a parallel "
                f"node's path {e.step_parallel_s * 1e6:.1f} us, an update "
                f"{e.step_update_sgd_s * 1e6:.1f} (sgd) / {e.step_update_adam_s * 1e6:.1f} (adam) us a tensor, "
                "in a step"
                if e.step_dispatch_s else "")
             + (f" (on a DTensor {e.dtensor_dispatch_s * 1e6:.1f} + {e.dtensor_backward_dispatch_s * 1e6:.1f} us more)"
                if e.dtensor_dispatch_s or e.dtensor_backward_dispatch_s else ""),
             f"  each figure timed as `parsat run` times a step: rounds started by a barrier, the slowest rank's, "
             f"their median; compute on {cal.compute_clock}, collectives in wall time",
             *([f"  the products in {len(cal.square_passes)} passes spread over the calibration, each figure their "
                f"median; the largest square's in each pass: "
                + ", ".join(f"{t * 1e3:.3f}" for t in cal.square_passes) + " ms"] if cal.square_passes else []),
             *([f"  the collectives in {len(cal.reduce_passes)} passes, each figure their median; the smallest "
                "all-reduce's in each pass: " + ", ".join(f"{t * 1e3:.3f}" for t in cal.reduce_passes) + " ms"]
               if cal.reduce_passes else []),
             *([f"  FSDP2's hooks: {e.fsdp_forward_group_s * 1e6:.1f} us + {e.fsdp_forward_param_s * 1e6:.1f} us "
                f"per parameter at a group's gather, {e.fsdp_backward_group_s * 1e6:.1f} us + "
                f"{e.fsdp_backward_param_s * 1e6:.1f} us per parameter after its backward"]
               if e.fsdp_hooks_time(1) or e.fsdp_hooks_time(1, backward=True) else []),
             *([f"  DTensor's redistribute: {e.dtensor_all_reduce_s * 1e6:.0f} us (all-reduce), "
                f"{e.dtensor_all_gather_s * 1e6:.0f} us (all-gather), {e.dtensor_reduce_scatter_s * 1e6:.0f} us "
                f"(reduce-scatter) of host time more than the collective on plain tensors"]
               if any(getattr(e, k) for k in REDISTRIBUTE_FIELDS) else []),
             *([f"  FSDP2's collectives over the ranks: {e.fsdp_all_gather_s * 1e6:.0f} us (all-gather), "
                f"{e.fsdp_reduce_scatter_s * 1e6:.0f} us (reduce-scatter), {e.fsdp_all_reduce_s * 1e6:.0f} us "
                f"(all-reduce) of host time more than on one rank and the collective on plain tensors"]
               if any(getattr(e, k) for k in FSDP_COLLECTIVE_FIELDS) else []),
             *([f"  a module's own Python: {e.python_instruction_s * 1e9:.1f} ns per bytecode instruction"]
               if e.python_instruction_s else []),
             *([f"  an operator in a step (a transformer block's calls in sequence): {e.sequence_factor:.2f} x "
                f"the same call timed alone"] if e.sequence_factor != 1.0 else []),
             *([f"  the products' grid: m, n, k each " + ", ".join(f"{x:g}" for x in e.gemm_grids[0].ms)
                + f" ({', '.join(g.layout for g in e.gemm_grids)}), priced from its points in between, by the half "
                  f"lengths only beyond"] if e.gemm_grids else []),
             *(f"  backward products ({name}): {getattr(e, f'gemm_{lay}_rate'):.2f} x peak, half lengths m "
               f"{getattr(e, f'gemm_{lay}_half_m'):g}, n {getattr(e, f'gemm_{lay}_half_n'):g}, k "
               f"{getattr(e, f'gemm_{lay}_half_k'):g}" for lay, name in (("nt", "g @ w^T"), ("tn", "x^T @ g"))
               if getattr(e, f"gemm_{lay}_rate") > 0),
             *([f"  fused causal attention (scaled_dot_product_attention): {e.attention_efficiency:.3f} x peak, half "
                f"that at {e.attention_half_flops / 1e6:.2f} MFLOP a call"] if e.attention_efficiency != 1.0 else []),
             *([f"  scalar functions, ns per element forward / backward: " + ", ".join(
                 f"{name} {f * 1e9:.2f} / {b * 1e9:.2f}" for name, f, b in e.function_times)] if e.function_times
               else []),
             f"  {'operator':<14} {'shape':<22} {'measured':>11} {'model':>11}"]
    for t in cal.ops:
        if t.op == "matmul_other":
            continue
        shape = "x".join(str(d) for d in t.shape)
        lines.append(f"  {t.op:<14} {shape:<22} {t.seconds * 1e3:>8.4f} ms {t.predicted(m) * 1e3:>8.4f} ms")
    lines.append(f"  stragglers: a collective waits {m.comm.sync_skew:.2f} x the compute since the previous one")
    if cal.turns:
        bursts = ", ".join(f"{c * 1e3:.2f}: {e * 1e3:+.2f}" + (f" ({o * 1e3:+.2f})" if cal.oversubscribed else "")
                           for c, e, o in cal.turns)
        priced = "priced: ranks share cores" if m.comm.turn_s else "not priced: each rank has its own core"
        lines.append(f"  a peer's turn: a collective after compute waits min({cal.turn_s * 1e3:.2f} ms, the compute "
                     f"since the previous one) ({priced}; compute ms: excess ms"
                     + (" (on a core each)" if cal.oversubscribed else "") + f" {bursts})")
    for p in m.comm.points:
        lines.append(f"  {p.collective:<14} {f'{p.group} ranks':<22} latency {p.latency_s * 1e6:8.1f} us, bus "
                     f"bandwidth {p.bus_bandwidth / 1e9:.3f} GB/s")
    for c in cal.collectives:
        lines.append(f"  {c.kind:<14} {f'{c.ranks} ranks, {c.nbytes:,.0f} B':<22} {c.seconds * 1e3:>8.4f} ms "
                     f"{c.predicted(m) * 1e3:>8.4f} ms")
    return "\n".join(lines)


__all__ = ["Budget", "Calibration", "CollectiveTiming", "OpTiming", "average_after", "calibrate", "fit_gemm",
           "fit_attention", "fit_functions", "fit_grids", "fit_layouts", "fit_line", "fit_link", "fit_loss", "fit_memory", "fit_turn", "fit_updates", "gemm_grid_nodes", "gemm_shapes", "memory_sizes", "report"]
