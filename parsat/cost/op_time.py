"""How long one compute operator takes on its local pieces: roofline with efficiency and dispatch cost.

The one place an operator's time is computed. The work is the operator's
own (`dsl.work`: FLOPs and elements from its index semantics), divided
among devices by the degree spread inference gives every index variable.
Then, with `machine.efficiency` (`ir.machine_profile.OpEfficiency`,
measured by `parsat calibrate`):

    kernel = max(FLOPs / (peak x gemm_efficiency(m, n, k)),
                 bytes / bandwidth(bytes))

where (m, n, k) is the local shape of the operator's matrix product
(`dsl.work.contraction`; batch dims count as rows) and an operator without
one runs at peak FLOP/s (it is memory-bound anyway), unless its semantics
evaluate scalar functions (tanh, exp, erf, ...: `function_evaluations`)
and the machine measured them (`OpEfficiency.function_times`, `parsat
calibrate`): then its compute is the functions' evaluations at their
measured per-element rates, forward and, for its backward kernel, their
autograd backward's (`function_kernel`; on a CPU core torch's tanh ran 26x
a relu: GPT-2's two tanh calls took 13% of its forward, priced at 1%).
Backward does one
product per operand needing a gradient: on a machine that measured
products on transposed operands (`OpEfficiency.layout_efficiency`, `parsat
calibrate`), each as autograd runs it (`BACKWARD_PRODUCTS`: its own shape,
its transposed operand), else each as large as the forward kernel (2 x the
forward kernel for both). Each call adds the fixed
dispatch cost (`OpEfficiency.op_time`: in sequence on CPU, hidden behind
longer kernels on a GPU). A product run in chunks (`chunk_time`: fed or
drained by a pipelined collective) is priced at the thinner product's
efficiency.

Fused kernels (`FUSED`) are the exception, in one table: an operator that
runs as one kernel whose work the generic count of its semantics does not
give. Fused bidirectional attention (`attention`: BERT's, ViT's) is priced as
FlashAttention runs it: every score of q k^T and of the weighted sum of v
(`attention_flops`), nothing stored but its output and one fp32 logsumexp
per query row, the rate and backward of the causal one below. Fused causal
attention (`attention_causal`, FlashAttention) counts every score although
a causal kernel computes only half of them, and its semantics, evaluated as
written, would keep nothing for backward that the kernel does not; so it
is priced as FlashAttention runs: causal FLOPs (half of the QK^T and PV
products), at the machine's attention rate
(`OpEfficiency.attention_rate`, not a GEMM's), backward 2.5 x the forward
(FlashAttention's count: the two products again, the scores recomputed and
their gradient), and for backward it keeps its output and one fp32
logsumexp per query row (`OpTime.saved_bytes`), never an [s, s] matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from functools import lru_cache
from math import prod
from typing import Callable, Collection, Mapping

from parsat.dsl import ast
from parsat.dsl.instantiate import OpInstance, index_bounds
from parsat.dsl.work import contraction, work
from parsat.ir.machine import Machine
from parsat.ir.machine_profile import ATTENTION_BACKWARD_FACTOR, OpEfficiency

BACKWARD_FACTOR = 2.0        # backward FLOPs and bytes = 2 x forward (two products per product)
PRODUCT_OPERANDS = 2         # a product's operands that its backward products read; any after them is a bias
OPTIMIZER_PASSES = {"sgd": (2, 5), "adam": (11, 26)}
"""Optimizer: (operators per parameter tensor, element reads + writes per parameter) as the backend runs it."""


@dataclass(frozen=True)
class OpTime:
    """One operator on one device's pieces: times (seconds) and the local work they come from."""

    forward_s: float
    backward_s: float
    kernel_s: float          # the forward kernel alone (no dispatch cost)
    flops: float             # local forward FLOPs
    nbytes: float            # local forward bytes touched
    gemm: tuple[float, float, float] | None = None   # local (m, n, k) of its product, if any
    backward_factor: float | None = None   # a fused kernel's backward kernel / its forward kernel (also an operator
    #                                        evaluating measured scalar functions: `function_kernel`)
    saved_bytes: float = 0.0                # bytes kept for backward beside the output (a fused kernel's)
    grad_kernels: tuple[float, ...] = ()    # a product's backward kernel per operand, as measured (`BACKWARD_PRODUCTS`;
                                            # empty: each priced as the forward kernel)
    product: str = ""                       # the operator, for `chunk_time` to price a chunk's backward products
    batch: float = 1.0                      # the local batch of a batched product, folded into gemm's m
    bias_kernel_s: float = 0.0              # a product's operand beyond its two (a bias): its gradient's kernel
    #                                         (`bias_gradient_kernel`), not a product
    biases: int = 0                         # how many such operands the product has (`linear`: one)

    def backward_kernel_s(self, gradients: Collection[int]) -> float:
        """The backward kernels' time when the inputs at positions `gradients` need a gradient, as autograd runs
        them: a fused kernel's one backward kernel; a product's one product per such operand of its two (the
        measured backward product of that operand, `grad_kernels`, else as large as the forward) and, for an
        operand beyond them (a bias), the sum of the output's gradient over m (`bias_kernel_s`); anything else
        one kernel of the forward's size. Until 2026-12-04 a bias's gradient was priced as a whole forward
        product: a third GEMM in every biased product's backward, which the per-node model (`_backward_s`)
        never charged (benchmarks/published_runs.md, "2026-12-04 (morning)")."""
        if self.backward_factor is not None:
            return self.backward_factor * self.kernel_s
        if self.gemm is None:
            return self.kernel_s
        if not gradients:
            return self.kernel_s
        return sum((self.grad_kernels[i] if self.grad_kernels else self.kernel_s) if i < PRODUCT_OPERANDS
                   else self.bias_kernel_s for i in gradients)


@dataclass(frozen=True)
class FusedKernel:
    """How one fused operator runs where its semantics' generic count does not say (the module docstring)."""

    flops: Callable[[OpInstance], float]           # global forward FLOPs
    rate: Callable[[OpEfficiency, float], float]   # fraction of peak FLOP/s at these local forward FLOPs
    backward_factor: float                         # backward kernel = this x the forward kernel
    row_bytes: int = 0                             # bytes kept for backward per row of the output, beside it
    keeps_output: bool = False                     # its backward reads its own output (kept whoever reads it)


def _sizes(shape) -> list[int]:
    return [int(d.evaluate({})) for d in shape]


def attention_flops(instance: OpInstance) -> float:
    """FlashAttention's count of bidirectional `attention(q [*a, s, d], k [*a, n, d], v [*a, n, e])`: every one
    of the s x n scores, 2 FLOPs a multiply-add, for q k^T (d) and for the weighted sum of v (e): 2 b s n (d + e)
    with b the product of the leading dims (the softmax is not counted, as FlashAttention counts)."""
    q, k, v = (_sizes(s) for s in instance.input_shapes[:3])   # `attention_masked`'s mask beside them
    s, n, d, e = q[-2], k[-2], q[-1], v[-1]
    return 2.0 * prod(q[:-2]) * s * n * (d + e)


def causal_attention_flops(instance: OpInstance) -> float:
    """FlashAttention's causal count of `attention_causal(q [*a, s, d], k, v [*a, s, e])`: half of the s x s
    scores that `attention_flops` counts (the causal kernel skips the masked blocks; the [s, s] masking is not
    counted either)."""
    return attention_flops(instance) / 2


FUSED: Mapping[str, FusedKernel] = {
    "attention_causal": FusedKernel(causal_attention_flops, OpEfficiency.attention_rate, ATTENTION_BACKWARD_FACTOR,
                                    row_bytes=4, keeps_output=True),
    "attention": FusedKernel(attention_flops, OpEfficiency.attention_rate, ATTENTION_BACKWARD_FACTOR,
                             row_bytes=4, keeps_output=True),
    # under a mask tensor the kernel computes every score (`attention_masked`: the causal ring's query blocks;
    # the ring's diagonal block alone runs causally, `cost.pcg_tasks._Builder._ring`)
    "attention_masked": FusedKernel(attention_flops, OpEfficiency.attention_rate, ATTENTION_BACKWARD_FACTOR,
                                    row_bytes=4, keeps_output=True),
}
"""Operators priced as one fused kernel (the module docstring): their own FLOPs, rate, backward and saved bytes."""

BACKWARD_PRODUCTS: Mapping[str, tuple[tuple[str, str], ...]] = {
    **{op: (("nt", "mkn"), ("tn", "knm")) for op in ("matmul", "bmm", "linear", "linear_nobias")},
    **{op: (("nn", "mkn"), ("tn", "nkm")) for op in ("linear_t", "linear_nobias_t")},
}
"""The product autograd runs for the gradient of a product's first and second operand, as torch's mm, bmm and
addmm backward call it (`torch.matmul`: g @ b^T and a^T @ g; `F.linear`, weight [n, k]: g @ w and g^T @ x): its
operands' layout (`OpEfficiency.layout_efficiency`) and its (m, n, k) in the forward's letters, the batch with
the first. Operators not here keep the forward kernel per gradient; an "nn" backward product (`F.linear`'s input
gradient) is priced as a forward product of its shape."""


def function_evaluations(instance: OpInstance) -> dict[str, int]:
    """Global evaluations of each scalar function in one forward application (`_evaluations`)."""
    return dict(_evaluations(instance))


@lru_cache(maxsize=4096)
def _evaluations(instance: OpInstance) -> tuple[tuple[str, int], ...]:
    """Global evaluations of each scalar function (`tanh`, `exp`, `erf`, ...) in one forward application: a call
    once per value of the index variables free in it (hoisted, as `dsl.work` counts FLOPs), and calls that differ
    only in the names of their index variables once (softmax's `exp(x[i, j])` and the `exp(x[i, l])` its sum
    adds up read the same elements: torch's kernel computes each exponential once). `dsl.work` counts a call as
    one FLOP; on a CPU core torch's elementwise tanh ran 2.6 ns an element, a relu 0.1 (benchmarks/
    costmodel_fidelity.md, session 61 helper C), so these are priced at their measured rates
    (`OpEfficiency.function_time`)."""
    bounds = {k: int(v.evaluate({})) for k, v in index_bounds(instance).items()}
    counts: dict[tuple, int] = {}

    def free(expr: ast.Expr) -> frozenset[str]:
        if isinstance(expr, ast.Name):
            return frozenset({expr.id}) & frozenset(bounds)
        inner = frozenset().union(*(free(c) for c in ast.children(expr)))
        return inner - {expr.var} if isinstance(expr, ast.RANGE_BINDERS) else inner

    def renamed(value, order: dict[str, int]):
        """`value` with its index variables numbered by first appearance (the same call, whatever its names)."""
        if isinstance(value, str) and value in bounds:
            return order.setdefault(value, len(order))
        if isinstance(value, tuple):
            return tuple(renamed(v, order) for v in value)
        if is_dataclass(value):
            return (type(value).__name__, *(renamed(getattr(value, f.name), order) for f in fields(value)
                                             if f.compare))
        return value

    for expr in ast.walk(instance.body):
        if isinstance(expr, ast.Call):
            key = (expr.func, renamed(expr.args, {}))
            counts[key] = max(counts.get(key, 0), prod(bounds[v] for v in free(expr)))
    out: dict[str, int] = {}
    for (name, _args), n in counts.items():
        out[name] = out.get(name, 0) + n
    return tuple(sorted(out.items()))   # kept per instance: a search prices the same operators again and again


@lru_cache(maxsize=4096)
def elementwise_kind(instance: OpInstance) -> str | None:
    """Which kind of elementwise arithmetic (`ir.validate.ELEMENTWISE_KINDS`) the operator is, from its semantics,
    or None: one pass computing each output element by arithmetic (`+ - * /`, a negation, a scalar function or
    comparison) from its operands' elements at the same index, read plainly. "broadcast" where an operand is read
    along fewer of the output's indices (`add_bcast`), "binary" where two or more are read along all of them
    (`add`, `mul`), "unary" where one is (`scale`, `add_scalar`, `relu`). Not elementwise: a reduction or a product
    (`sum`, `max` over a range), a selection (`if`: concatenation, padding), a bare read (a view, a copy, a
    transpose: eager torch makes most of them without a pass), an index computed (`x[i + 1]`, a gather)."""
    nodes = list(ast.walk(instance.body))
    if any(isinstance(n, (*ast.RANGE_BINDERS, ast.IfThenElse)) for n in nodes):
        return None
    if not any(isinstance(n, (ast.BinOp, ast.Neg, ast.Call)) for n in nodes):
        return None
    outs = frozenset(instance.out_vars)
    full, fewer = set(), set()
    for n in nodes:
        if isinstance(n, ast.Access):
            names = [i.id for i in n.indices if isinstance(i, ast.Name)]
            if len(names) != len(n.indices) or not set(names) <= outs:
                return None
            (full if set(names) == outs else fewer).add(n.tensor)
    if not full:
        return None
    return "broadcast" if fewer else "binary" if len(full) > 1 else "unary"


def _degree(value) -> int:
    return int(value.evaluate({})) if hasattr(value, "evaluate") else int(value)


def _local_sizes(instance: OpInstance, var_degrees: Mapping[str, object], names, memo: dict | None = None) -> float:
    """The local size of the index ranges `names`: each range divided by its degree. `memo`: `op_time`'s."""
    bounds = _kept(memo, instance, "bounds", _int_bounds)
    return float(prod(bounds[v] / max(1, _degree(var_degrees.get(v, 1))) for v in names))


def _int_bounds(instance: OpInstance) -> dict[str, int]:
    """Every index variable's range as an integer (`index_bounds`). Shared where kept: read, never change it."""
    return {k: int(v.evaluate({})) for k, v in index_bounds(instance).items()}


def _kept(memo: dict | None, instance: OpInstance, what: str, make: Callable[[OpInstance], object]):
    """`make(instance)`, kept in `memo` (a dict the caller keeps for one library: `cost.model.compute_time`'s) by
    the instance's identity, beside the instance so the identity is not reused. `make` reads the instance alone,
    and an `OpInstance` is frozen, so it is the same value computed afresh: a search asks for the same instance
    at many spreads (llama-70b:64: 5,422 operator times of 1,166 instances), and its FLOPs, product and index
    ranges were most of each."""
    if memo is None:
        return make(instance)
    key = (what, id(instance))
    found = memo.get(key)
    if found is None or found[0] is not instance:
        found = memo[key] = (instance, make(instance))
    return found[1]


def local_contraction(instance: OpInstance, var_degrees: Mapping[str, object],
                      memo: dict | None = None) -> tuple[float, ...] | None:
    """The local (batch, m, n, k) of the operator's product: each index range divided by its degree. `memo`:
    `op_time`'s."""
    dims = _kept(memo, instance, "contraction", contraction)
    if dims is None:
        return None
    return tuple(_local_sizes(instance, var_degrees, names, memo) for names in dims)


def local_gemm(instance: OpInstance, var_degrees: Mapping[str, object]) -> tuple[float, float, float] | None:
    """The local (m, n, k) of the operator's product: each index range divided by its degree; batch into m."""
    dims = local_contraction(instance, var_degrees)
    return None if dims is None else (dims[0] * dims[1], dims[2], dims[3])


def grad_kernels(product: str, gemm: tuple[float, float, float], batch: float, flops: float, nbytes: float,
                 machine: Machine) -> tuple[float, ...]:
    """The backward products' kernels of a product, one per operand (`BACKWARD_PRODUCTS`), each at the measured
    efficiency of its own shape and layout; () where the operator or a layout is not measured."""
    sizes = {"m": gemm[0] / batch, "n": gemm[1], "k": gemm[2]}
    kernels = []
    for layout, letters in BACKWARD_PRODUCTS.get(product, ()):
        m, n, k = (sizes[c] for c in letters)
        fraction = machine.efficiency.layout_efficiency(layout, batch * m, n, k)
        if fraction is None:
            return ()
        kernels.append(roofline(flops, nbytes, fraction, machine))
    return tuple(kernels)


def _backward_s(kernel: float, grads: tuple[float, ...], eff: OpEfficiency, bias_s: float = 0.0) -> float:
    """The per-node model's backward of a product: every operand's gradient (2 x the forward unmeasured), and
    its biases' (`bias_s`, `bias_gradient_kernel` for each), as `OpTime.backward_kernel_s` adds them up."""
    return eff.op_time((sum(grads) if grads else BACKWARD_FACTOR * kernel) + bias_s, backward=True)


def bias_gradient_kernel(gemm: tuple[float, float, float], machine: Machine) -> float:
    """The gradient of a product's bias: the output's gradient (m x n, in the compute dtype) summed over m, one
    memory-bound pass over it (Megatron-LM's `grad_output.sum(dim=0)` in
    `LinearWithGradAccumulationAndAsyncCommunication.backward`, megatron/core/tensor_parallel/layers.py; torch's
    addmm backward likewise reduces the output gradient), not a product."""
    return kernel_time(0.0, gemm[0] * gemm[1] * machine.dtype_bytes, None, machine)


def roofline(flops: float, nbytes: float, fraction: float, machine: Machine) -> float:
    """One kernel: its FLOPs at `fraction` of peak, or its bytes at the machine's bandwidth, whichever is longer."""
    eff = machine.efficiency
    return max(flops / (machine.peak_flops * fraction), nbytes / eff.bandwidth(nbytes, machine.memory_bandwidth))


def function_kernel(flops: float, nbytes: float, evaluations: Mapping[str, float], machine: Machine,
                    backward: bool = False) -> float:
    """An operator without a product whose semantics evaluate scalar functions (`function_evaluations`, local):
    its FLOPs at peak plus the functions' measured per-element time (`OpEfficiency.function_time`, forward or
    its autograd backward), or its bytes at the machine's bandwidth, whichever is longer."""
    eff = machine.efficiency
    compute = flops / machine.peak_flops + eff.function_time(evaluations, backward)
    return max(compute, nbytes / eff.bandwidth(nbytes, machine.memory_bandwidth))


def elementwise_kernel(instance: OpInstance, var_degrees: Mapping[str, object], machine: Machine,
                       memo: dict | None = None) -> float:
    """Elementwise arithmetic (`elementwise_kind`) as a step runs it: its local output elements at the machine's
    measured per-element time of its kind (`OpEfficiency.elementwise_time`); 0 for another operator or where not
    measured. `op_time` takes the longer of this and the roofline: `parsat calibrate`'s memory-bound figures are
    of calls repeated on warm buffers, a step's arithmetic writes new memory kept for backward (GPT-2's adds and
    multiplies, 256 KB-1 MB each, ran 1.5-2x their roofline price relative to the GEMMs' scale,
    benchmarks/costmodel_fidelity.md, session 61 helper C). `memo`: `op_time`'s."""
    kind = _kept(memo, instance, "elementwise", elementwise_kind)
    if kind is None or not machine.efficiency.elementwise_time(kind, 1.0):   # not measured (every preset): no sizes
        return 0.0
    return machine.efficiency.elementwise_time(kind, _local_sizes(instance, var_degrees, instance.out_vars, memo))


def kernel_time(flops: float, nbytes: float, gemm: tuple[float, float, float] | None, machine: Machine) -> float:
    """The roofline of one kernel with the machine's GEMM and bandwidth efficiency."""
    return roofline(flops, nbytes, machine.efficiency.gemm_efficiency(*gemm) if gemm is not None else 1.0, machine)


def op_time(instance: OpInstance, var_degrees: Mapping[str, object], local_elements: int, machine: Machine,
            memo: dict | None = None) -> OpTime:
    """Forward and backward time of `instance` on local pieces of `local_elements` elements in all. `memo`: what
    reads the instance alone (FLOPs, product, index ranges) kept by its identity (`_kept`), the same times."""
    fused = FUSED.get(instance.name)
    flops = _kept(memo, instance, "flops", _flops)
    split = prod(_degree(d) for d in var_degrees.values()) or 1
    local_flops = flops / split
    nbytes = float(local_elements * machine.dtype_bytes)
    eff = machine.efficiency
    if fused is not None:
        kernel = roofline(local_flops, nbytes, fused.rate(eff, local_flops), machine)
        rows = _local_sizes(instance, var_degrees, instance.out_vars[:-1], memo)
        return OpTime(eff.op_time(kernel), eff.op_time(fused.backward_factor * kernel, backward=True), kernel,
                      local_flops, nbytes, None, fused.backward_factor, fused.row_bytes * rows)
    dims = local_contraction(instance, var_degrees, memo)
    gemm = None if dims is None else (dims[0] * dims[1], dims[2], dims[3])
    if gemm is None and eff.function_times:
        calls = {f: n / split for f, n in _kept(memo, instance, "functions", function_evaluations).items()}
        kernel, back = (function_kernel(local_flops, nbytes, calls, machine, b) for b in (False, True))
        if eff.function_time(calls) > 0:   # measured functions: a backward kernel of its own
            return OpTime(eff.op_time(kernel), eff.op_time(back, backward=True), kernel, local_flops, nbytes,
                          backward_factor=back / kernel)
    kernel = kernel_time(local_flops, nbytes, gemm, machine)
    if gemm is None:
        kernel = max(kernel, elementwise_kernel(instance, var_degrees, machine, memo))
        return OpTime(eff.op_time(kernel), _backward_s(kernel, (), eff), kernel, local_flops, nbytes)
    grads = grad_kernels(instance.name, gemm, dims[0], local_flops, nbytes, machine)
    bias = bias_gradient_kernel(gemm, machine)
    biases = max(0, len(instance.input_shapes) - PRODUCT_OPERANDS)
    return OpTime(eff.op_time(kernel), _backward_s(kernel, grads, eff, biases * bias), kernel, local_flops, nbytes,
                  gemm, grad_kernels=grads, product=instance.name, batch=dims[0], bias_kernel_s=bias,
                  biases=biases)


def _flops(instance: OpInstance) -> float:
    """The operator's global FLOPs: a fused kernel's own count (`FUSED`), else its semantics' (`dsl.work`)."""
    fused = FUSED.get(instance.name)
    return fused.flops(instance) if fused is not None else work(instance)[0]


def chunk_time(timed: OpTime, parts: int, axis: int, machine: Machine) -> OpTime:
    """One of `parts` equal slices of a product cut along its m, n or k (`axis` 0, 1, 2): 1 / parts of its
    FLOPs, bytes and saved bytes, at the GEMM efficiency of the thinner product (a slice of 512 rows runs
    below one of 4096). A collective pipelined with the product feeds or drains it a slice at a time
    (`cost.pcg_tasks.Pipeline`); an operator without a product is cut evenly."""
    eff = machine.efficiency
    grads: tuple[float, ...] = ()
    if timed.gemm is None:
        kernel, gemm = timed.kernel_s / parts, None
    else:
        gemm = tuple(d / parts if i == axis else d for i, d in enumerate(timed.gemm))
        kernel = kernel_time(timed.flops / parts, timed.nbytes / parts, gemm, machine)
        if timed.grad_kernels:
            grads = grad_kernels(timed.product, gemm, timed.batch, timed.flops / parts, timed.nbytes / parts, machine)
    bias = bias_gradient_kernel(gemm, machine) if gemm is not None else 0.0
    backward = (eff.op_time(timed.backward_factor * kernel, backward=True) if timed.backward_factor
                else _backward_s(kernel, grads, eff, timed.biases * bias))
    return replace(timed, forward_s=eff.op_time(kernel), backward_s=backward, kernel_s=kernel,
                   flops=timed.flops / parts, nbytes=timed.nbytes / parts, gemm=gemm,
                   saved_bytes=timed.saved_bytes / parts, grad_kernels=grads, bias_kernel_s=bias)


def update_time(optimizer: str, elements: float, item: float, machine: Machine) -> float:
    """A per-tensor optimizer's update of one weight piece of `elements` elements of `item` bytes: as `parsat
    calibrate` measured `parsat run`'s optimizer (`OpEfficiency.update_time`), else its operators
    (`OPTIMIZER_PASSES`: so many calls moving so many reads and writes per element), each memory-bound."""
    measured = machine.efficiency.update_time(optimizer, elements)
    if measured is not None:
        return measured
    calls, passes = OPTIMIZER_PASSES[optimizer]
    return calls * memory_op_time(passes * elements * item / calls, machine)


def memory_op_time(nbytes: float, machine: Machine, backward: bool = False) -> float:
    """A memory-bound copy (a slice made contiguous, a concatenation, an optimizer update) of `nbytes`."""
    eff = machine.efficiency
    return eff.op_time(nbytes / eff.bandwidth(nbytes, machine.memory_bandwidth), backward)


__all__ = ["BACKWARD_FACTOR", "BACKWARD_PRODUCTS", "FUSED", "FusedKernel", "OPTIMIZER_PASSES", "OpTime",
           "attention_flops", "causal_attention_flops", "chunk_time", "elementwise_kernel", "elementwise_kind",
           "function_evaluations", "function_kernel", "grad_kernels",
           "kernel_time", "local_contraction", "local_gemm",
           "memory_op_time", "op_time", "roofline", "update_time"]
