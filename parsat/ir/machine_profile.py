"""What a machine file says beyond peak rates: operator efficiency and measured collectives.

Two records, both part of `ir.machine.Machine` (machine file version 2,
docs/COSTMODEL.md):

* `OpEfficiency`: what keeps an operator below the roofline. A fixed cost
  per operator call (kernel launch on a GPU, Python dispatch and autograd
  bookkeeping in `parsat run`), paid in forward and again in backward;
  and Hockney's half-performance lengths: a rate r(n) = r_peak / (1 + n_half / n)
  reaches half of its peak at n = n_half. A GEMM has one per dimension
  (m, n, k: small or skinny products do not fill the machine), a
  memory-bound operator one in bytes (small copies do not reach the
  achievable bandwidth). A fused attention kernel (FlashAttention,
  `cost.op_time.FUSED`) has a rate of its own: a fraction of peak on
  long sequences and a half-performance length in FLOPs per call
  (a short sequence or few heads do not fill the machine).
* `CommProfile`: the collective model's parameters beyond the per-link
  bandwidth and per-step latency the machine already has: a fixed cost per
  collective call, how much of a ring's bandwidth NCCL's tree reaches, the
  DDP bucket sizes, how long a collective waits for stragglers, and a table of measured collectives (`CollectivePoint`:
  a collective, a link kind and a group size -> latency and bus bandwidth)
  that `parsat calibrate` fills; where the table has the case, it is used
  as measured, otherwise the algorithmic model (`cost.collectives`).

* `Oversubscribed`: that `parsat calibrate --oversubscribe` measured more
  ranks than the cores (or GPUs) they ran on, so its figures are of ranks
  taking turns, not of the machine; `optimize` warns when it prices with
  such a file.

Defaults are neutral (no overhead, no efficiency loss, an empty table), so
a version-1 machine file reads as it always priced.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any, Mapping

from parsat.ir.errors import MachineError
from parsat.ir.gemm_grid import GemmGrid
from parsat.ir.validate import COLLECTIVE_KINDS as COLLECTIVES
from parsat.ir.validate import ELEMENTWISE_KINDS
from parsat.ir.validate import LINK_KINDS as LINKS
from parsat.ir.validate import COMM_INTEGERS, validate_comm_dict, validate_efficiency_dict, validate_oversubscribed_dict
MIB = 1 << 20


def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' bus bandwidth factor: bytes over the busiest link per byte of the buffer (`CollectivePoint`)."""
    if collective not in COLLECTIVES:
        raise MachineError(f"unknown collective '{collective}' ({', '.join(COLLECTIVES)})")
    if p <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2 * (p - 1) / p
    if collective in ("send_recv", "broadcast"):
        return 1.0
    return (p - 1) / p


REDISTRIBUTE_FIELDS = ("dtensor_all_reduce_s", "dtensor_all_gather_s", "dtensor_reduce_scatter_s")
"""`OpEfficiency`'s per-collective host times of DTensor's `redistribute` (`redistribute_time`)."""
ATTENTION_BACKWARD_FACTOR = 2.5
"""Fused causal attention's backward kernel / its forward (FlashAttention's count: the two products again, the
scores recomputed and their gradient): how `cost.op_time` prices it and `parsat calibrate` fits its rate."""
FSDP_COLLECTIVE_FIELDS = ("fsdp_all_gather_s", "fsdp_reduce_scatter_s", "fsdp_all_reduce_s")
"""`OpEfficiency`'s per-collective host times of FSDP2 over the ranks (`fsdp_collective_time`)."""


@dataclass(frozen=True)
class OpEfficiency:
    """Per-operator overheads and the half-performance lengths of the compute model (seconds, elements, bytes)."""

    dispatch_s: float = 0.0            # fixed cost of one operator call in forward
    backward_dispatch_s: float = 0.0   # fixed cost of one operator in backward (autograd's node)
    step_dispatch_s: float = 0.0       # fixed cost of one operator call in a step's forward: the dispatch chain
                                       # timed as the first calls after a product's forward, backward and a
                                       # barrier (`parsat calibrate`; 0: not measured, `dispatch_s` alone)
    step_backward_dispatch_s: float = 0.0   # the same in a step's backward: the chain's backward, its graph recorded
                                       # before a product's forward and backward and a barrier (0: not measured)
    step_parallel_s: float = 0.0       # a parallel node's forward as `parsat run` makes its call in a step: its
                                       # host path (`backend.collectives.parallel_op`: the placement's change, the
                                       # `Comm`, the autograd Function and its identity body), timed as the first
                                       # calls after a product's forward, backward and a barrier (0: not measured)
    step_node_s: float = 0.0           # `parsat run`'s interpreter (`RankProgram.forward`) per node it runs in a step,
                                       # beyond the node's own call: its loop, timed on a chain plan after a
                                       # product's forward, backward and a barrier (0: not measured)
    step_loss_path_s: float = 0.0      # `parsat run`'s interpreter's own work around an output's objective in a step
                                       # (`RankProgram.loss` less `loss_terms`: the target's piece), per output
                                       # (0: not measured)
    step_update_sgd_s: float = 0.0     # `parsat run`'s optimizer's fixed cost per parameter tensor in a step: its
    step_update_adam_s: float = 0.0    # `step` over tiny tensors right after a product's backward and a barrier,
                                       # per tensor, SGD / Adam (0: not measured, the warm `update_points` alone)
    gemm_half_m: float = 0.0           # rows of the product at which a GEMM runs at half its peak rate
    gemm_half_n: float = 0.0           # columns
    gemm_half_k: float = 0.0           # contraction length
    gemm_peak_fraction: float = 1.0    # fraction of peak FLOP/s the largest GEMMs reach (clocks under load, tiles'
                                       # waves, epilogues: 0.80 measured on an H200; `parsat calibrate` folds it
                                       # into the peak it measures)
    memory_half_bytes: float = 0.0     # bytes moved at which a memory-bound operator reaches half the bandwidth
    cache_bytes: float = 0.0           # operators moving at most this many bytes run from cache ...
    cache_bandwidth: float = 0.0       # ... at this bandwidth (bytes/s; 0: no cache tier)
    random_bandwidth: float = 0.0      # bytes/s of normal random numbers made (seeded data; 0: not measured)
    attention_efficiency: float = 1.0  # fraction of peak FLOP/s fused causal attention reaches, forward and
                                       # backward, on long sequences (FlashAttention runs below the GEMM rate)
    attention_half_flops: float = 0.0  # forward FLOPs of one attention call at which it runs at half that rate
    dtensor_dispatch_s: float = 0.0    # extra fixed cost of an operator on a DTensor (sharding propagation, wrapping)
    dtensor_backward_dispatch_s: float = 0.0   # the same in backward; both 0 unless `parsat calibrate --dtensor`
    dtensor_all_reduce_s: float = 0.0   # host time DTensor's `redistribute` adds to one collective on the rank's own
                                        # core beyond the same collective on plain tensors (the table's): Partial ->
                                        # Replicate (an all-reduce), ...
    dtensor_all_gather_s: float = 0.0   # ... Shard -> Replicate (an all-gather), ...
    dtensor_reduce_scatter_s: float = 0.0   # ... Partial -> Shard (a reduce-scatter, which gloo runs as an
                                        # all-reduce); all three 0 unless `parsat calibrate --dtensor`
    fsdp_all_gather_s: float = 0.0      # host time FSDP2's collective over the ranks adds beyond the same group on
                                        # one rank (`fsdp_hooks_time`), the plain collective and the copies
                                        # (`parsat calibrate --dtensor`): a sharded group's gather, ...
    fsdp_reduce_scatter_s: float = 0.0  # ... its gradients' reduce-scatter, ...
    fsdp_all_reduce_s: float = 0.0      # ... a replicated group's gradients' all-reduce; all three 0 otherwise
    fsdp_forward_param_s: float = 0.0   # host time FSDP2's hooks (`replicate`, `fully_shard`) take per parameter of
                                        # a group as they gather it (before its forward, again before its
                                        # backward where it was resharded), beyond the collectives and copies priced
    fsdp_backward_param_s: float = 0.0  # the same after its backward (the gradients' reduction)
    fsdp_forward_group_s: float = 0.0   # and per group, whatever its size, at each gather ...
    fsdp_backward_group_s: float = 0.0  # ... and after its backward; all four 0 unless `parsat calibrate --dtensor`
    python_instruction_s: float = 0.0   # one Python bytecode instruction of a module's own code (the user's module
                                        # the torch-native runtime runs, `ir.module_calls.python_forward`): measured
                                        # by `parsat calibrate --dtensor` on a stack of Python-only modules, else 0
    gemm_nt_rate: float = 0.0          # a backward product whose second operand is transposed (g @ w^T: autograd's
                                       # gradient of a product's first operand), as a step runs it, reaches this x
                                       # peak FLOP/s at its largest; 0: not measured (priced as the forward kernel)
    gemm_nt_half_m: float = 0.0        # its half-performance lengths, in its own (m, n, k)
    gemm_nt_half_n: float = 0.0
    gemm_nt_half_k: float = 0.0
    gemm_tn_rate: float = 0.0          # the same with the first operand transposed (x^T @ g: the second operand's
                                       # gradient); both measured by `parsat calibrate`
    gemm_tn_half_m: float = 0.0
    gemm_tn_half_n: float = 0.0
    gemm_tn_half_k: float = 0.0
    gemm_grids: tuple[GemmGrid, ...] = ()
                                       # products' measured fractions of peak on a grid of shapes, per layout
                                       # ("nn", "nt", "tn"), read between its points (`ir.gemm_grid`): a
                                       # product is priced from them inside the grid's box, by the half
                                       # lengths above only beyond it; () not measured (presets, older files)
    update_points: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
                                       # `parsat run`'s own optimizer (`backend.executor.Optimizer`) updating one
                                       # weight after a backward made its gradient: per optimizer, (elements,
                                       # seconds) as `parsat calibrate` measured them; () not measured (priced as
                                       # memory-bound operators)
    function_times: tuple[tuple[str, float, float], ...] = ()
                                       # per scalar function of the DSL (`dsl.instantiate.SCALAR_FUNCTIONS`: tanh,
                                       # exp, erf, ...), seconds per element of torch's elementwise kernel for it,
                                       # forward and its autograd backward, as `parsat calibrate` measured them
                                       # (the slope over sizes: no dispatch); () not measured (an operator
                                       # evaluating them priced as memory-bound: on a CPU core tanh ran 26x a relu)
    elementwise_unary_s: float = 0.0   # seconds per output element of one pass of elementwise arithmetic as a step
                                       # runs it (its operand the previous operator's output, its own output new
                                       # memory kept for backward): one operand (`scale`, `add_scalar`, `relu`), ...
    elementwise_binary_s: float = 0.0  # ... two of the output's size (`add`, `mul`), ...
    elementwise_broadcast_s: float = 0.0   # ... one broadcast along the other's leading dims (`add_bcast`); all three
                                       # measured by `parsat calibrate` (`elementwise_time`), 0: not measured
                                       # (priced by bytes at the bandwidth, as the warm, repeated calls ran)
    loss_s: float = 0.0                # one output's objective against its target as a step runs it (`parsat run`'s
                                       # `training_data.loss_terms`, right after the forward's last product, which
                                       # leaves the dispatcher's code and data out of cache): its fixed seconds, ...
    loss_element_s: float = 0.0        # ... and its seconds per element of the output's piece; ...
    loss_backward_s: float = 0.0       # ... the same for its backward, right after it; all four measured by
    loss_backward_element_s: float = 0.0   # `parsat calibrate` (`loss_time`), 0: not measured (priced as
                                       # memory-bound operators: on this 2-core box 0.03 ms for a loss that ran 0.14)
    async_dispatch: bool = False       # True on GPUs: the host launches ahead, an operator takes max(dispatch,
                                       # kernel); False on CPU: the dispatching thread computes, dispatch + kernel
    sequence_factor: float = 1.0       # an operator call run once among a step's other calls over the same call
                                       # timed alone again and again, as every figure above is timed: measured by
                                       # `parsat calibrate --dtensor` on a reference of transformer blocks'
                                       # forward and backward calls; 1: not measured (presets, older files)

    def op_time(self, kernel_s: float, backward: bool = False) -> float:
        """An operator call's time in a step: its kernel and its fixed dispatch cost (the call as a step makes it,
        `step_dispatch_s` / `step_backward_dispatch_s`, where measured), overlapped or in sequence,
        times `sequence_factor` (the calibrated figures are of calls repeated alone, warm; a step runs each
        call once between different ones: on this 2-core box 1.4-1.6x, benchmarks/costmodel_fidelity.md,
        2026-12-05 helper B)."""
        # `sequence_factor`, where measured (--dtensor), already holds what a step adds to a call (its reference
        # replays a step's calls in order), the cold calls `step_dispatch_s` measures among it: one, not both
        in_step = (self.step_backward_dispatch_s if backward else self.step_dispatch_s) \
            if self.sequence_factor == 1.0 else 0.0
        dispatch = max(self.backward_dispatch_s if backward else self.dispatch_s, in_step)
        return (max(dispatch, kernel_s) if self.async_dispatch else dispatch + kernel_s) * self.sequence_factor

    def parallel_path_time(self) -> float:
        """Seconds a parallel node's host path (`step_parallel_s`: `parsat run`'s `parallel_op`, the autograd
        Function around the node's body) adds in a step beyond the one call its body is priced as (`op_time(0.0)`);
        0 where not measured.

        Why: on `make demo`'s plan the replicate of x (no data moved) took 0.09-0.10 ms of the rank's CPU in the
        step where one dispatch priced it at 5-15 us, most of it the path around its `view_as` (`apply_parallel`,
        `Comm`, `_Parallel.apply`: 5.7 us warm, 5-10x that as a step's calls; benchmarks/demo_step.md, session 65
        helper F); a collective's node runs the same path around its collective, which the collectives' table
        times as the bare call."""
        return max(0.0, self.step_parallel_s - self.op_time(0.0))

    def function_time(self, evaluations: Mapping[str, float], backward: bool = False) -> float:
        """Seconds of the kernels' scalar-function work in `evaluations` (function -> evaluations on this
        device), forward or, `backward`, in their autograd backward, at the measured per-element times
        (`function_times`); a function not measured adds nothing."""
        times = {name: (forward, back) for name, forward, back in self.function_times}
        return sum(count * times[name][backward] for name, count in evaluations.items() if name in times)

    def elementwise_time(self, kind: str, elements: float) -> float:
        """Seconds one pass of elementwise arithmetic of `kind` (`ELEMENTWISE_KINDS`: "unary", "binary",
        "broadcast") takes to make `elements` output elements as a step runs it, at the measured per-element time
        (`parsat calibrate`: a chain of calls, each on the previous one's output, the outputs kept, as a forward
        keeps activations: on this 2-core box 1.6-3.5x the same call repeated on warm buffers, its output new
        memory, not in cache); 0 where not measured."""
        return elements * getattr(self, f"elementwise_{kind}_s")

    def loss_time(self, elements: float, backward: bool = False) -> float | None:
        """Seconds of one output's objective (or its backward) over a piece of `elements` elements, as `parsat
        calibrate` measured it in a step's place; None where not measured."""
        if self.loss_s <= 0:
            return None
        if backward:
            return self.loss_backward_s + elements * self.loss_backward_element_s
        return self.loss_s + elements * self.loss_element_s

    def fsdp_hooks_time(self, params: int, backward: bool = False) -> float:
        """Host time FSDP2's hooks take on a group of `params` parameters as they gather it (before its forward;
        before its backward, where it was resharded) or, `backward`, after its backward: a cost per group and
        one per parameter, measured by `parsat calibrate --dtensor`, 0 otherwise."""
        if backward:
            return self.fsdp_backward_group_s + params * self.fsdp_backward_param_s
        return self.fsdp_forward_group_s + params * self.fsdp_forward_param_s

    def dtensor_time(self, backward: bool = False) -> float:
        """What an operator on DTensors costs beyond a plain one (torch's tensor-parallel styles run the
        modules they style on DTensors), in a step (`sequence_factor`, as `op_time`): measured by `parsat
        calibrate --dtensor`, 0 otherwise."""
        return (self.dtensor_backward_dispatch_s if backward else self.dtensor_dispatch_s) * self.sequence_factor

    def redistribute_time(self, kind: str) -> float:
        """Host seconds DTensor's `redistribute` adds to one `kind` collective (`collectives.ALL_REDUCE`,
        `ALL_GATHER`, `REDUCE_SCATTER`) beyond the same collective on plain tensors, as torch's tensor-parallel
        styles issue it: its placements' plan, the functional collective's wrapping and wait, the gathered
        pieces' concatenation. Measured by `parsat calibrate --dtensor` as the main thread's CPU time, the same
        for every buffer size timed; 0 for another kind and otherwise."""
        return getattr(self, f"dtensor_{kind}_s", 0.0)

    def fsdp_collective_time(self, kind: str) -> float:
        """Host seconds FSDP2 adds to one `kind` collective of a group over more than one rank (`ALL_GATHER`,
        `REDUCE_SCATTER`, `ALL_REDUCE`) beyond what its one-rank hooks (`fsdp_hooks_time`), the plain collective
        and the copies are priced: measured by `parsat calibrate --dtensor` as the main thread's CPU time, the
        same for every buffer size timed; 0 for another kind and otherwise."""
        return getattr(self, f"fsdp_{kind}_s", 0.0)

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """Fraction of peak FLOP/s a (batched) m x k by k x n product reaches: as measured on the machine's grid
        of products (`gemm_grids`, read between its points) where it has one, else, and beyond the grid's box,
        the largest GEMMs' fraction less by Hockney's half-performance lengths in each dimension."""
        return self._layout_fraction("nn", self.gemm_peak_fraction, (self.gemm_half_m, self.gemm_half_n,
                                                                      self.gemm_half_k), (m, n, k))

    def _layout_fraction(self, layout: str, rate: float, halves: tuple[float, ...],
                         shape: tuple[float, float, float]) -> float:
        """`layout`'s fraction of peak at `shape`: its grid (`gemm_grids`) read with the Hockney curve of `rate`
        and `halves` beyond the grid's box, or that curve alone where the layout has no grid."""
        def curve(*dims: float) -> float:
            return rate / prod(1 + h / max(x, 1.0) for h, x in zip(halves, dims))

        grid = next((g for g in self.gemm_grids if g.layout == layout), None)
        return curve(*shape) if grid is None else grid.fraction(*shape, curve)

    def layout_efficiency(self, layout: str, m: float, n: float, k: float) -> float | None:
        """Fraction of peak FLOP/s an m x k by k x n product reaches with its operands laid out as `layout`
        ("nn": both row-major, as a forward product; "nt": the second transposed; "tn": the first), or None
        where the machine has no measurement for that layout. `parsat calibrate` times the "nt" and "tn"
        products as autograd runs them in a step, right after the forward (their output new memory, their
        operands last touched by the forward): on a CPU the MLP's x^T @ g ran 1.2-1.4x the same product timed
        alone (benchmarks/demo_step.md), which a fit of forward products does not see."""
        if layout == "nn":
            return self.gemm_efficiency(m, n, k)
        rate = getattr(self, f"gemm_{layout}_rate")
        if rate <= 0:
            return None
        return self._layout_fraction(layout, rate, tuple(getattr(self, f"gemm_{layout}_half_{d}") for d in "mnk"),
                                     (m, n, k))

    def update_time(self, optimizer: str, elements: float) -> float | None:
        """Seconds `parsat run`'s optimizer takes to update one weight piece of `elements` elements, as measured
        by `parsat calibrate` (its update right after a backward made the gradient: fresh gradient memory, the
        weight last read by the forward), or None where this optimizer was not measured. Its fixed cost (the
        smallest weight's update) is the one a step pays per tensor (`step_update_sgd_s`, `step_update_adam_s`),
        where measured and larger: on `make demo`'s step the two SGD updates took 0.25-0.36 ms of the rank's CPU
        where the warm points priced them at 0.136 (benchmarks/demo_step.md, session 67 helper B)."""
        points = dict(self.update_points).get(optimizer)
        if not points:
            return None
        # the fixed part (the smallest weight's update, about all call) as a step pays it, where measured
        cold = getattr(self, f"step_update_{optimizer}_s", 0.0)
        return interpolate(points, elements) + max(0.0, cold - points[0][1])

    def attention_rate(self, flops: float) -> float:
        """Fraction of peak FLOP/s one fused attention call of `flops` forward FLOPs reaches (its backward too):
        Hockney's model in the work of the call, r = attention_efficiency / (1 + attention_half_flops / flops)."""
        return self.attention_efficiency / (1 + self.attention_half_flops / max(flops, 1.0))

    def memory_efficiency(self, nbytes: float) -> float:
        """Fraction of the achievable bandwidth a memory-bound operator moving `nbytes` reaches."""
        return 1.0 / (1 + self.memory_half_bytes / max(nbytes, 1.0))

    def bandwidth(self, nbytes: float, memory_bandwidth: float) -> float:
        """The bandwidth an operator moving `nbytes` sees: the cache's when it fits there, else memory's,
        times the small-transfer efficiency. (A CPU's last-level cache serves an 8 MB working set at
        several times DRAM bandwidth; beyond it every pass streams from DRAM.)"""
        fits = self.cache_bandwidth > 0 and nbytes <= self.cache_bytes
        return (self.cache_bandwidth if fits else memory_bandwidth) * self.memory_efficiency(nbytes)

    def to_dict(self) -> dict:
        """Every field, less a layout's, an optimizer's, FSDP2's hooks', a Python instruction's or the sequence
        factor that was not measured (files and plans of presets read as before)."""
        unmeasured = [f"gemm_{layout}_" for layout in ("nt", "tn") if getattr(self, f"gemm_{layout}_rate") <= 0]
        unmeasured += [k for k in ("fsdp_forward_param_s", "fsdp_backward_param_s", "fsdp_forward_group_s",
                                   "fsdp_backward_group_s", "python_instruction_s", "step_dispatch_s",
                                   "step_backward_dispatch_s", "step_parallel_s", "step_node_s", "step_loss_path_s",
                                   "step_update_sgd_s",
                                   "step_update_adam_s",
                                   *REDISTRIBUTE_FIELDS,
                                   *FSDP_COLLECTIVE_FIELDS)
                       if not getattr(self, k)]
        unmeasured += ["sequence_factor"] if self.sequence_factor == 1.0 else []
        unmeasured += [f"elementwise_{kind}_s" for kind in ELEMENTWISE_KINDS if not self.elementwise_time(kind, 1.0)]
        unmeasured += ["loss_"] if self.loss_s <= 0 else []
        out = {k: v for k, v in asdict(self).items() if not k.startswith(tuple(unmeasured))
               and k not in ("update_points", "function_times", "gemm_grids")}
        if self.gemm_grids:
            out["gemm_grids"] = {grid.layout: grid.to_dict() for grid in self.gemm_grids}
        if self.function_times:
            out["function_times"] = {name: [forward, back] for name, forward, back in self.function_times}
        if self.update_points:
            out["update_points"] = {kind: [list(p) for p in points] for kind, points in self.update_points}
        return out

    @staticmethod
    def from_dict(data: Any) -> "OpEfficiency":
        """An `efficiency` object, checked against `ir.validate.EFFICIENCY_RANGES` (MachineError otherwise)."""
        data = dict(validate_efficiency_dict(data))
        points = tuple((kind, tuple((float(e), float(s)) for e, s in rows))
                       for kind, rows in sorted(data.pop("update_points", {}).items()))
        functions = tuple((name, float(f), float(b)) for name, (f, b) in sorted(data.pop("function_times", {}).items()))
        grids = tuple(GemmGrid.from_dict(layout, grid) for layout, grid in sorted(data.pop("gemm_grids", {}).items()))
        return OpEfficiency(**{k: (v if isinstance(v, bool) else float(v)) for k, v in data.items()},
                            update_points=points, function_times=functions, gemm_grids=grids)


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at `x` on the line through measured (x, y) `points` (sorted by x): between two points on their segment,
    beyond the largest on the last segment's slope, below the smallest the smallest's y (a fixed cost it cannot
    go under)."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1] if x <= points[0][0] else points[0][1] * x / points[0][0]
    (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if x <= b[0]), points[-2:])
    return max(points[0][1], y0 + (y1 - y0) * (x - x0) / (x1 - x0))


# Collective buffer sizes `parsat calibrate` times (elements): a step's collectives are priced between two
# neighbours (`CollectivePoint.samples`), so the middle decades have points too (a 1.4 MB gradient all-reduce).
COMM_ELEMENTS = (256, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)


@dataclass(frozen=True)
class CollectivePoint:
    """One measured collective: `collective` among `group` devices over `link`, as latency + bytes / bus bandwidth.

    Bus bandwidth as nccl-tests defines it: the algorithm bandwidth (bytes
    of the buffer / time) times 2(p-1)/p for an all-reduce, (p-1)/p for
    all-gather, reduce-scatter and all-to-all, 1 for send/recv and
    broadcast; so one figure describes the link whatever the group size.

    `samples`: the measured (buffer bytes, seconds) the line was fitted to, bytes increasing, seconds not
    decreasing (`parsat calibrate` writes them). Why kept: a collective's time is no line over four decades of
    sizes (2 gloo CPU ranks: 0.58 ms at 1 KB, 1.85 ms at 256 KB, 6.2 ms at 4 MB), so the line fitted on
    relative errors priced a 1.4 MB all-reduce 2.8 ms that took 3.4 ms timed the same way. Between two samples
    a buffer is priced on the straight segment joining them; beyond the largest, the last one plus the line's
    rate; below the smallest, the smallest's time.
    """

    collective: str
    link: str
    group: int
    latency_s: float
    bus_bandwidth: float
    samples: tuple[tuple[float, float], ...] = ()

    def seconds(self, nbytes: float) -> float:
        """One collective of a buffer of `nbytes` bytes (as `parsat.cost.collectives.price` counts them)."""
        if not self.samples:
            return self.latency_s + bus_factor(self.collective, self.group) * nbytes / self.bus_bandwidth
        (low, low_s), (high, high_s) = self.samples[0], self.samples[-1]
        if nbytes <= low:
            return low_s
        if nbytes >= high:
            return high_s + bus_factor(self.collective, self.group) * (nbytes - high) / self.bus_bandwidth
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(self.samples, self.samples[1:]) if nbytes <= b[0])
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)

    def to_dict(self) -> dict:
        out = {"collective": self.collective, "link": self.link, "group": self.group, "latency_s": self.latency_s,
               "bus_bandwidth": self.bus_bandwidth}
        return out | ({"samples": [list(s) for s in self.samples]} if self.samples else {})

    @staticmethod
    def from_dict(data: Any) -> "CollectivePoint":
        """A checked point (`ir.validate.validate_comm_dict` checks the points of a `comm` object)."""
        return CollectivePoint(str(data["collective"]), str(data["link"]), int(data["group"]), float(data["latency_s"]),
                               float(data["bus_bandwidth"]),
                               tuple((float(x), float(y)) for x, y in data.get("samples", ())))


@dataclass(frozen=True)
class CommProfile:
    """The collective model's parameters beyond the machine's per-link bandwidth and per-step latency."""

    launch_s: float = 0.0                 # fixed cost of one collective call (kernel launch, enqueue)
    tree_bandwidth_factor: float = 1.0    # a tree all-reduce's bus bandwidth over a ring's (NCCL: a bit below 1)
    bucket_bytes: int = 25 * MIB          # DDP's bucket_cap_mb (25 MiB by default)
    first_bucket_bytes: int = 1 * MIB     # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
    bucket_elements: int = 0              # a bucket holds at least this many elements (0: bytes only, as DDP)
    bucket_elements_per_rank: int = 0     # ... and at least this many per rank of its group (`bucket_caps`)
    sync_skew: float = 0.0                # stragglers: a synchronising collective also waits this fraction of the
                                          # compute since the previous one (ranks sharing cores; ~0 on dedicated GPUs)
    turn_s: float = 0.0                   # ranks sharing cores (`oversubscribed`): a collective after compute also
                                          # waits for a peer's turn on its core, at most this long and at most the
                                          # compute since the previous collective (`parsat calibrate`'s turns)
    points: tuple[CollectivePoint, ...] = field(default=())
    # Whether the data-parallel gradient reduction runs while backward produces the gradients (DDP's buckets,
    # Megatron-Core's --overlap-grad-reduce: the default), or only once backward is done, as Megatron-LM's
    # `--DDP-impl local` of 2021 ran it (`train_step` calls `allreduce_gradients()` after the forward-backward
    # function returns; docs/COSTMODEL.md). A property of the program that runs the step, priced by
    # `cost.pcg_tasks.profile_for` and `cost.pipeline`.
    overlap_grad_reduce: bool = True

    def bucket_caps(self, group_size: int, item_bytes: int) -> tuple[int, int]:
        """(a bucket's cap, the first bucket's cap) in bytes for gradients of `item_bytes` an element reduced over
        `group_size` ranks. PyTorch DDP caps buckets by bytes, the first one smaller (`bucket_bytes`,
        `first_bucket_bytes`). Megatron-Core caps them by elements, max(40M, 1M x the data-parallel size) by default
        ("larger DP sizes need larger buckets to ensure collectives do not become latency-bound":
        `DistributedDataParallelConfig.bucket_size`), with no smaller first bucket: where `bucket_elements` or
        `bucket_elements_per_rank` is set, both caps are the larger of `bucket_bytes` and that many elements."""
        elements = max(self.bucket_elements, self.bucket_elements_per_rank * group_size)
        if elements <= 0:
            return self.bucket_bytes, self.first_bucket_bytes
        cap = max(self.bucket_bytes, elements * item_bytes)
        return cap, cap

    def point(self, collective: str, link: str, group: int) -> CollectivePoint | None:
        """The measured point for exactly this case, if the table has it."""
        for p in self.points:
            if p.collective == collective and p.link == link and p.group == group:
                return p
        return None

    def to_dict(self) -> dict:
        """The `comm` object of a machine file; `overlap_grad_reduce` only where it is off (files written before it
        existed read, and are written, as they were)."""
        out = {"launch_s": self.launch_s, "tree_bandwidth_factor": self.tree_bandwidth_factor,
               "bucket_bytes": self.bucket_bytes, "first_bucket_bytes": self.first_bucket_bytes,
               "bucket_elements": self.bucket_elements, "bucket_elements_per_rank": self.bucket_elements_per_rank,
               "sync_skew": self.sync_skew}
        if self.turn_s:   # written where measured on ranks sharing cores: other files read and write as before
            out["turn_s"] = self.turn_s
        if not self.overlap_grad_reduce:
            out["overlap_grad_reduce"] = False
        return {**out, "points": [p.to_dict() for p in self.points]}

    @staticmethod
    def from_dict(data: Any) -> "CommProfile":
        """A `comm` object, checked against `ir.validate.COMM_RANGES` and `POINT_RANGES` (MachineError otherwise)."""
        data = dict(validate_comm_dict(data))
        points = tuple(CollectivePoint.from_dict(p) for p in data.pop("points", []))
        numbers = {k: (v if isinstance(v, bool) else int(v) if k in COMM_INTEGERS else float(v))
                   for k, v in data.items()}
        return CommProfile(**numbers, points=points)


__all__ = ["COLLECTIVES", "FSDP_COLLECTIVE_FIELDS", "LINKS", "REDISTRIBUTE_FIELDS", "CollectivePoint", "CommProfile",
           "OpEfficiency", "bus_factor", "interpolate"]


@dataclass(frozen=True)
class Oversubscribed:
    """A calibration of `ranks` ranks that shared `shared` `unit` ("cores" or "gpus"): each figure was timed
    between the other ranks' turns (8 ranks on 2 cores recorded a peak of 2,504 GFLOP/s), so a plan priced with
    it is priced for a machine that does not exist. Recorded in the machine file, said when it is used."""

    ranks: int
    shared: int
    unit: str = "cores"

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, self.unit: self.shared}

    @staticmethod
    def from_dict(data: Any) -> "Oversubscribed":
        """An `oversubscribed` object, checked (`ir.validate.validate_oversubscribed_dict`: MachineError)."""
        data = validate_oversubscribed_dict(data)
        unit = next(key for key in data if key != "ranks")
        return Oversubscribed(data["ranks"], data[unit], unit)

    @property
    def what(self) -> str:
        """What the ranks shared, as said: '2 cores', '1 GPU'."""
        return f"{self.shared} {'core' if self.unit == 'cores' else 'GPU'}{'s' if self.shared != 1 else ''}"

    def describe(self) -> str:
        """'measured oversubscribed: 8 ranks on 2 cores', for a warning."""
        return f"measured oversubscribed: {self.ranks} ranks on {self.what}"
