"""A plan's training step as simulator tasks, on the plan's device mesh.

This is the task builder the step simulator (`cost.simulator`) needs
to price a whole plan. Every parallel operator of a PCG acts on one mesh
axis (docs/MESH.md); its collective runs among that axis's group, priced by
the group's topology (`GroupTopology.of_axis`: NVLink inside a node, the
network across nodes, hierarchical when both). Every device does the same
work (SPMD: every group of an axis has the same shape), so one device is
simulated.

How the program that runs the plan issues work is an `ExecutionProfile`:

* `PARSAT_RUN`: the torch backend as `parsat run` executes today: one
  host thread walks the PCG, every operator is one synchronous call
  (dispatch + kernel), collectives block inside autograd (no overlap),
  each weight's gradient is all-reduced alone when backward reaches it,
  every node's output stays alive until the step ends (the executor's
  environment), inputs and targets drawn from a seed before each step's
  clock starts (held full-shape on every rank, not timed:
  `training_data.StepData.loaded`, as a data loader hands a step its
  batch), SGD.
* `DDP`: a GPU framework: communication on its own stream, gradients in
  DDP buckets overlapping backward (one bucket sequence per mesh axis the
  weights are replicated on), activations freed by backward, fused Adam,
  and an in-node all-gather or reduce-scatter next to a GEMM pipelined
  with it in chunks, as Megatron-Core's `--tp-comm-overlap` and PyTorch's
  async tensor parallelism run them (`Pipeline`; docs/COSTMODEL.md); the
  data read as integer ids (`integer_ids`) and fused attention in its own
  layouts (`attention_layouts`): no one-hot slice, no expanded k / v.
* `TORCH_NATIVE`: `parsat.parallelize(..., runtime="torch")` on CPU gloo:
  inline collectives as `PARSAT_RUN`, but FSDP2's parameter groups
  (`cost.fsdp_groups`), torch's tensor-parallel styles (an all-reduce per
  column-parallel reader, DTensor dispatch), the loss each rank's own;
  `TORCH_NATIVE.running(calls)` also prices the calls the user's module
  makes beyond its imported graph (views, casts, mask building: one
  dispatch each, `ir.module_calls`) and its own Python between them
  (bytecode instructions counted, a calibrated time each).

ZeRO-3 (a weight stored as a shard, read through `all_gather`) runs as the
backend runs it (parsat/backend/executor.py): the weight is gathered once per step
in forward, the gathered copy is kept until its backward (nothing is
gathered again), and its gradient is reduce-scattered back onto the shard
(the gradient synchronisation; on its own stream under `DDP`, so it
overlaps the rest of backward as FSDP's does).

Per node (forward; backward walks the nodes in reverse, and only for
tensors that need a gradient: ones computed from a weight):

| node | forward | backward |
|---|---|---|
| input leaf | its full shape held, drawn before the step (`PARSAT_RUN`: memory, no time) | none |
| compute | dispatch + kernel (`op_time`) | dispatch + one kernel per input needing a gradient (products), else one (a fused kernel: its own, `OpTime.backward_kernel_s`) |
| partition | a slice (a copy, unless a view); a weight's is folded into storage | all-gather + concatenation |
| combine | all-gather + concatenation | slice (copy) |
| replicate | a view | all-reduce (+ copy); a weight's: the gradient sync |
| reduce | copy + all-reduce | a view |
| reduce_scatter | slices (copies) + reduce-scatter | all-gather + concatenation |
| all_gather | all-gather + concatenation (a weight's: kept to its backward) | slices + reduce-scatter; a weight's: the gradient sync |

Ring attention (`ir.ring_attention`: fused attention on a query block, its k and v all-gathered for it alone)
runs, where the profile overlaps communication, as p chunks of the kernel with the k, v blocks sent round the
ring under them, its gathers issuing nothing and holding one block (`_ring`; docs/COSTMODEL.md, "Ring attention");
the causal ring as its slowest rank runs it (the diagonal block causal, then p - 1 full blocks), its mask made in
the kernel (`generated`: nothing run or held).

A gathered activation only products' backward reads (`regathered`) is, under a profile with `regather` (`DDP`),
freed after forward and gathered again before its readers' weight gradients (`_Builder._regather`,
`_split_backward`); with `keep_activations` off a value no backward reads is freed after its forward readers
(`unkept`, `cost.saved`).

Then the loss (per output: difference from its target, square, sum:
memory-bound operators on the output's piece) and the optimizer (per stored
weight piece: as `parsat calibrate` measured `parsat run`'s optimizer, else
SGD two operators, Adam eleven, each memory-bound: `op_time.update_time`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Mapping, Sequence

from parsat.dsl.library import Library
from parsat.dsl.gradient import gradient_free
from parsat.dsl import parallel_ops
from parsat.dsl.parallel_ops import COMBINE, PARTITION, REDUCE, REPLICATE
from parsat.ir.data_forms import onehot_values
from parsat.ir.graph import instance_for
from parsat.ir.machine import Machine
from parsat.ir.microbatch import is_loss
from parsat.ir.module_calls import ModuleCalls
from parsat.ir.parallelism import FUSED_ATTENTION
from parsat.ir.pcg import PCG, PNode, pcg_roles, state_shardings, weight_chains, weight_storage
from parsat.ir.recompute import Checkpoint, checkpoints
from parsat.ir.ring_attention import RingAttention
from parsat.cost.fsdp_groups import ParamGroup, group_elements, param_groups, tensor_axes
from parsat.cost.collectives import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, SEND_RECV, GroupTopology,
                                     price)
from parsat.cost.model import compute_time
from parsat.cost.ring_time import ring_chunks_s, ring_work, rings_run
from parsat.cost.saved import PRODUCTS, kept_values, regathered_values
from parsat.cost.op_time import OpTime, chunk_time, memory_op_time, update_time
from parsat.cost.schedules import Gradient, GradientBuckets, ParamGathers, assign_buckets
from parsat.cost.simulator import COMM, COMPUTE, StepBuilder, StepResult
from parsat.cost.stage_sync import SHARDING_STAGES

DEVICE = 0
# Operators torch runs as views of their input (no new storage): parsat/importer/torch_ops.py. `flatten` is a view
# only of a contiguous tensor (after a transpose it copies).
VIEW_OPS = frozenset({"transpose", "unflatten", "split", "dropout", "broadcast"})
# Fused attention kernels (FlashAttention, `scaled_dot_product_attention`), `ir.parallelism`'s: `attention_views`.
TRANSPOSED_B = frozenset({"linear_t", "linear_nobias_t"})
LOSS_OPS = 6           # per output: sub, pow, sum, div, div, detach-div (parsat/backend/executor.py `objective`)
LOSS_BACKWARD_OPS = 4
SCALAR_LOSS_OPS, SCALAR_LOSS_BACKWARD_OPS = 3, 2   # a loss output: sum, div, detach-div


class TaskBuildError(ValueError):
    """A PCG the builder cannot turn into tasks (an operator that does not instantiate)."""


@dataclass(frozen=True)
class ExecutionProfile:
    """How the program that runs a plan issues its work (see the module docstring)."""

    name: str
    overlap: bool            # collectives on their own stream (else inline, blocking the host thread)
    ddp_buckets: bool        # weight gradients all-reduced in DDP buckets (else one all-reduce each, inline)
    keep_activations: bool   # every node's output alive to the end of the step (else freed by its backward)
    seeded_inputs: bool      # inputs and targets drawn from a seed before each step, held whole on every rank
    eager_gradients: bool    # a weight's gradient is handed on as soon as it is complete (DDP's hooks)
    fused_optimizer: bool    # one multi-tensor update (foreach/fused Adam) instead of operators per tensor
    optimizer: str = "sgd"
    tp_comm_overlap: bool = False   # an in-node all-gather / reduce-scatter pipelined with its GEMM (`Pipeline`)
    fsdp_groups: bool = False       # weights gathered and synchronised per FSDP2 group (`cost.fsdp_groups`)
    style_collectives: bool = False  # a replicated activation's gradient all-reduced once per module reading it
    #                                 (torch's ColwiseParallel styles each convert their own input), not once
    dtensor_modules: bool = False   # with a tensor axis, operators reading a weight run on DTensors
    #                                 (`OpEfficiency.dtensor_time` more each, forward and backward)
    transient_gradients: bool = False   # gradients exist from backward to the update (`zero_grad(set_to_none)`),
    #                                 not for the whole step
    local_loss: bool = False        # a reduce giving an output (the loss over the data ranks) is not run: each rank
    #                                 returns its local batch's loss, the gradient sync averages
    overlap_param_gather: bool = False   # ZeRO-1/2's gathers of updated shards run during the next forward
    regather: bool = False          # a gathered activation only products' backward reads: freed after forward, shard
    #                                 kept and gathered again for that backward (`cost.saved.regathers`:
    #                                 Megatron-LM's sequence-parallel linear); with `tp_comm_overlap` that
    #                                 all-gather runs beside the product's input-gradient GEMM (`_regather`)
    overlap_grad_reduce: bool = True   # DDP's buckets launched as backward fills them; else all of them once the
    #                                 last micro-batch's backward is done (`CommProfile.overlap_grad_reduce`)
    reduce_scatter_as_all_reduce: bool = False   # a reduce-scatter runs as an all-reduce of its whole input, each
    #                                 rank keeping its piece (gloo's `reduce_scatter_tensor`, which FSDP2 and
    #                                 DTensor call): priced as that all-reduce, not as the reduce-scatter timed
    module_calls: ModuleCalls | None = None   # the user's module runs, not the graph: its calls beyond the graph's
    #                                 nodes, one dispatch each (`ir.module_calls`; `running`)
    integer_ids: bool = False       # one-hot data (embedding ids, cross-entropy targets) held as integer ids: no
    #                                 [*s, vocab] value of them is ever made (`onehot_ids`)
    attention_layouts: bool = False   # fused attention reads grouped k / v heads unexpanded and writes its output
    #                                 as [b, s, heads, d]: the flattens around it are views (`attention_views`)
    interpreted: bool = False       # the plan's nodes run one by one through `parsat run`'s interpreter
    #                                 (`RankProgram.forward`: its loop, `OpEfficiency.step_node_s`, on every node
    #                                 it runs; `RankProgram.loss`: `step_loss_path_s` on each output's loss), a
    #                                 parallel node through `parallel_op` (an autograd Function per node:
    #                                 `OpEfficiency.parallel_path_time` more); 0 where not measured

    def running(self, calls: ModuleCalls | None) -> "ExecutionProfile":
        """This profile running the user's module whose eager calls `calls` counted
        (`importer.call_count.count_module_calls`): the calls its graph folded away priced too."""
        return replace(self, module_calls=calls)


PARSAT_RUN = ExecutionProfile("parsat run", overlap=False, ddp_buckets=False, keep_activations=True,
                              seeded_inputs=True, eager_gradients=False, fused_optimizer=False, optimizer="sgd",
                              tp_comm_overlap=False, interpreted=True)
TORCH_NATIVE = ExecutionProfile("parsat.parallelize(runtime='torch')", overlap=False, ddp_buckets=False,
                                keep_activations=False, seeded_inputs=False, eager_gradients=False,
                                fused_optimizer=False, optimizer="sgd", tp_comm_overlap=False, fsdp_groups=True,
                                dtensor_modules=True, transient_gradients=True,
                                local_loss=True, reduce_scatter_as_all_reduce=True)
"""The torch-native runtime on CPU gloo (docs/TORCH_NATIVE.md): the user's module on integer ids, activations
freed by backward, collectives blocking the one host thread (gloo's work runs while the rank waits for it),
FSDP2's groups (`cost.fsdp_groups`), tensor parallelism as torch's styles run it (a replicated activation's gradient
all-reduced once, not `style_collectives`: the lowering converts the input of a parent's column-parallel projections
once, `lowering.gathered_inputs`; counted on 2 ranks, LLaMA's tp 2 step runs the plan's 5, 2026-12-04 helper C),
SGD per tensor, reduce-scatters
as gloo runs `reduce_scatter_tensor` (an all-reduce of the whole buffer: torch's profiler shows one
`gloo:all_reduce` per FSDP2 reduce-scatter; on 2 and 4 ranks it took 0.6-1.5x the all-reduce, the list
`reduce_scatter` that `parsat calibrate` times 1.4-3.0x: benchmarks/costmodel_fidelity.md, run T6)."""
DDP = ExecutionProfile("ddp", overlap=True, ddp_buckets=True, keep_activations=False, seeded_inputs=False,
                       eager_gradients=True, fused_optimizer=True, optimizer="adam", tp_comm_overlap=True,
                       overlap_param_gather=True, regather=True, integer_ids=True, attention_layouts=True)

Topology = Callable[[PNode], GroupTopology]


@dataclass(frozen=True)
class Pipeline:
    """A collective pipelined with the GEMM it feeds or drains, as Megatron-Core's `--tp-comm-overlap`
    (Transformer Engine's userbuffers) and PyTorch's async tensor parallelism run them: both cut into `parts`
    chunks, chunk i of the side that runs second waiting for chunk i of the side that runs first, so the
    collective's chunks run while the GEMM computes the others (`collective_pipelines` finds them).

    The chunks of an all-gather land in the buffer the GEMM reads and a reduce-scatter's chunks are sent from
    the buffer the GEMM writes, so the concatenation (or slicing) copy of the unpipelined collective is not
    issued."""

    collective: int     # the parallel node
    product: int        # the GEMM-kind compute node (`PRODUCTS`)
    parts: int          # chunks: the group's size (one step of the ring exchange each)
    axis: int           # the product's dim the chunks cut: 0 m (rows, batch dims included), 1 n, 2 k
    gathers: bool       # forward: the collective's all-gather feeds the product (backward: the product's gradient
    #                     feeds the reduce-scatter); else the product feeds the collective's reduce-scatter
    #                     (backward: the all-gather of the gradient feeds the product's backward)
    forward: bool       # the forward collective is pipelined (a partition has none: only its backward all-gather)
    backward: bool      # the backward collective is pipelined (a combine's backward is a slice: none)
    siblings: tuple[int, ...] = ()   # other products reading the gathered value as `product` does: in forward
    #                     the gather feeds them with it, chunk by chunk, as one product (Megatron-Core's fused QKV
    #                     GEMM; the several B of PyTorch's fused_all_gather_matmul); their backward runs whole

    def ring(self, kind: str, step_s: float) -> list[float]:
        """The collective's chunks as a ring exchange runs them (Transformer Engine's `ring_exchange`, PyTorch's
        async tensor parallelism): `parts - 1` steps, each a send/recv of one chunk to the next rank (`step_s`),
        and one chunk that moves nothing: an all-gather's first (the rank's own piece, computed on at once), a
        reduce-scatter's last (the rank's own block, added to what arrived). The bytes sent are the ring
        collective's, (p - 1) / p of the tensor; the latency is p - 1 launches and link latencies."""
        moves = [step_s] * (self.parts - 1)
        return [0.0] + moves if kind == ALL_GATHER else moves + [0.0]

    def product_first(self, backward: bool) -> bool:
        """Whether the product's chunks run first in this direction (their results feed the collective's)."""
        return self.gathers == backward


def product_axis(operand: int | None, rank: int, dim: int, transposed_b: bool = False) -> int | None:
    """Which of a product's (m, n, k) the dim `dim` of a tensor of `rank` dims belongs to: its operand 0 or 1,
    or its output (`operand` None), in `PRODUCTS`' layout (leading dims are batch, counted in m); None for
    any other operand (a bias). `transposed_b`: operand 1 is [n, k] (`TRANSPOSED_B`)."""
    last = rank - 1
    if operand == 1 and transposed_b:
        return 2 if dim == last else 1 if dim == last - 1 else 0
    if operand is None:
        return 1 if dim == last else 0
    if operand == 0:
        return 2 if dim == last else 0
    if operand == 1:
        return 1 if dim == last else 2 if dim == last - 1 else 0
    return None


@dataclass(frozen=True)
class StepPrediction:
    """A simulated step: the result, and the memory it was given as resident (weights, gradients, state)."""

    result: StepResult
    resident_bytes: int
    end_of_forward: int | None = None    # the last task of forward and loss
    end_of_backward: int | None = None   # the last task before the optimizer
    # whether a collective ran pipelined with its product (`collective_pipelines`, the one reader of the profile's
    # `tp_comm_overlap`): where none did, the same PCG under the profile without it builds the same tasks
    pipelined: bool = False

    @property
    def step_s(self) -> float:
        return self.result.step_s

    @property
    def peak_memory_bytes(self) -> int:
        """The largest memory at any instant of the step, transient buffers included (what an allocator's
        peak statistic, such as torch.cuda.max_memory_allocated, reports)."""
        return self.result.peak_memory_bytes.get(DEVICE, 0)

    @property
    def sampled_memory_bytes(self) -> int:
        """The larger of the memory at the end of forward and at the end of backward: what `parsat run`
        measures on CPU (`executor.TensorMemory`, which sees live tensors between calls, not transients)."""
        points = [t for t in (self.end_of_forward, self.end_of_backward) if t is not None]
        return max((self.result.memory_after(t, self.resident_bytes) for t in points), default=self.resident_bytes)


def profile_for(machine: Machine) -> ExecutionProfile:
    """The execution a plan for `machine` is priced as: `DDP` where the host launches kernels asynchronously
    (a GPU: the presets and `parsat calibrate` on CUDA), `PARSAT_RUN` where one host thread computes
    (a CPU box: what `parsat run` does there, and what benchmarks/costmodel_fidelity.py measures). Under `DDP`
    the gradient buckets overlap backward unless the machine's `comm.overlap_grad_reduce` is off (Megatron-LM
    of 2021, `--DDP-impl local`: the reduction after backward)."""
    if not machine.efficiency.async_dispatch:
        return PARSAT_RUN
    return DDP if machine.comm.overlap_grad_reduce else replace(DDP, overlap_grad_reduce=False)


def mesh_groups(pcg: PCG) -> Topology:
    """Each parallel operator's group: one group of the mesh axis it acts on (`PNode.axis`)."""
    mesh = pcg.mesh
    groups = [GroupTopology.of_axis(mesh, a) for a in range(len(mesh))]
    known: dict[int, GroupTopology] = {}   # node id -> its group: asked for each collective of every pass

    def group(node: PNode) -> GroupTopology:
        found = known.get(node.id)
        if found is None:
            found = known[node.id] = groups[node.axis(mesh)]
        return found
    return group


def _elements(node: PNode) -> int:
    return node.piece_size


def _full(node: PNode) -> int:
    n = 1
    for d in node.shape:
        n *= d
    return n


def needs_gradient(pcg: PCG, library: Library | None = None) -> dict[int, bool]:
    """Node id -> whether backward computes a gradient for it: a weight, or a value computed from one through an
    operand that passes a gradient (with `library`: not one its operator's semantics reads only through `step` or
    a comparison, `dsl.gradient.gradient_free`, such as the input of a mixture's routing one-hot). Worked out
    once per PCG and library (`PCG.structural`): shared, read only."""
    return pcg.derive("needs_gradient", library, lambda: _needs_gradient(pcg, library), structural=True)


def _needs_gradient(pcg: PCG, library: Library | None) -> dict[int, bool]:
    """`needs_gradient` worked out."""
    out: dict[int, bool] = {}
    # operator name -> its operands' names and the gradient-free ones: `gradient_free`'s cache is keyed by the
    # operator's whole declaration, whose hash walks its semantics' tree; asked once per node of every PCG the
    # simulator and its floor build, that hashing was most of this function
    # (the positions of its operands that pass no gradient: most operators have none, and a node of one passes a
    # gradient where any input takes one, read without enumerating them)
    operands: dict[str, frozenset[int]] = {}
    for node in pcg.nodes:
        if node.kind == "leaf":
            out[node.id] = node.role == "weight"
            continue
        key = node.op if library is not None and node.kind == "op" else ""
        blocked = operands.get(key)
        if blocked is None:
            op = library.ops.get(node.op) if key else None
            free = gradient_free(op) if op is not None else frozenset()
            blocked = operands[key] = frozenset(k for k, p in enumerate(op.tensor_params) if p.name in free) \
                if op is not None else frozenset()
        if blocked:
            out[node.id] = any(out[i] for k, i in enumerate(node.inputs) if k not in blocked)
        else:
            out[node.id] = any(map(out.__getitem__, node.inputs))
    return out


def reader_counts(pcg: PCG) -> Mapping[int, int]:
    """Node id -> how many nodes read it (`PCG.readers_of`), every node listed: what each simulated pass's backward
    counts down (`_Builder.backward`), worked out once per PCG (`PCG.structural`: readers are structure). Shared,
    read only."""
    return pcg.derive("reader counts", None,
                      lambda: {n.id: len(pcg.readers_of.get(n.id, ())) for n in pcg.nodes}, structural=True)


def regathered(pcg: PCG, library: Library) -> frozenset[int]:
    """The gathers of an activation whose value a backward reads and a gradient reaches (`cost.saved.regathers`,
    as `cost.model.parallel_cost` charges them): training keeps their shard and gathers them again in backward,
    as Megatron-LM's sequence-parallel linear layers do. Worked out once per PCG and library (`PCG.structural`)."""
    return pcg.derive("regathered", library, lambda: _regathered(pcg, library), structural=True)


def _regathered(pcg: PCG, library: Library) -> frozenset[int]:
    """`regathered` worked out."""
    flows = needs_gradient(pcg, library)
    return frozenset(i for i in regathered_values(pcg, library) if flows[pcg.node(i).inputs[0]])


def unkept(pcg: PCG, library: Library) -> frozenset[int]:
    """The values no backward reads (not `cost.saved.kept_values`), which a framework frees once forward has read
    them: not leaves, weights' chains or outputs (the loss reads them), nor the storage of a value the simulator
    runs as a view of it (`VIEW_OPS`, flatten, a partition or replicate) that is kept. Once per PCG and library."""
    return pcg.derive("unkept", library, lambda: _unkept(pcg, library), structural=True)


def _unkept(pcg: PCG, library: Library) -> frozenset[int]:
    """`unkept` worked out."""
    held = set(kept_values(pcg, library)) | set(pcg.outputs) | set(weight_chains(pcg))
    for node in reversed(pcg.nodes):
        viewed = node.kind == "op" and (node.op in VIEW_OPS or node.op == "flatten") \
            or node.kind == "parallel" and node.op in (PARTITION, REPLICATE)
        if node.id in held and viewed and node.inputs:
            held.add(node.inputs[0])
    return frozenset(n.id for n in pcg.nodes if n.kind != "leaf" and n.id not in held)


def onehot_ids(pcg: PCG) -> frozenset[int]:
    """The values of one-hot data (`ir.data_forms.onehot_values`: the embedding's ids, the cross-entropy's
    targets, and their slices), which a GPU framework holds as integer ids [*s] (`ExecutionProfile.integer_ids`):
    `nn.Embedding` and Megatron's vocabulary-parallel embedding look ids up (a gather; the vocabulary split is a
    mask of the ids outside the rank's rows), and cross-entropy reads target ids, so no [*s, vocab] tensor of
    them exists and slicing one makes none. Once per PCG (`PCG.structural`)."""
    def make() -> frozenset[int]:
        names = onehot_values([(str(n.id), n.op, [str(i) for i in n.inputs]) for n in pcg.nodes])
        return frozenset(int(name) for name in names)
    return pcg.derive("one-hot ids", None, make, structural=True)


def attention_views(pcg: PCG) -> frozenset[int]:
    """The `flatten`s a fused attention kernel (`FUSED_ATTENTION`) leaves as views where eager PyTorch copies
    (`ExecutionProfile.attention_layouts`): one of a `broadcast` that fused attention alone reads, as its k or
    v (grouped-query attention's kv heads expanded, torch's expand + reshape: `scaled_dot_product_attention`
    with `enable_gqa`, FlashAttention and Megatron-Core's TE attention read the kv heads unexpanded); and one
    of the `transpose` of fused attention's output (FlashAttention writes it [b, s, heads, d], so the transpose
    back to that order is its storage order and the flatten merges heads in place: Megatron-Core's core
    attention returns it as a view, [s, b, h]). Once per PCG."""
    readers = pcg.readers_of

    def expanded_kv(flat: PNode, source: PNode) -> bool:
        users = readers.get(flat.id, ())
        return source.op == "broadcast" and bool(users) and all(
            u.kind == "op" and u.op in FUSED_ATTENTION and flat.id not in u.inputs[:1] for u in users)

    def attention_output(source: PNode) -> bool:
        return source.op == "transpose" and pcg.node(source.inputs[0]).kind == "op" \
            and pcg.node(source.inputs[0]).op in FUSED_ATTENTION

    def make() -> frozenset[int]:
        found = set()
        for node in pcg.nodes:
            if node.kind == "op" and node.op == "flatten":
                source = pcg.node(node.inputs[0])
                if source.kind == "op" and (expanded_kv(node, source) or attention_output(source)):
                    found.add(node.id)
        return frozenset(found)
    return pcg.derive("attention views", None, make, structural=True)


class OpTimes:
    """Compute nodes' times by (operator, attributes, shapes, spreads), for one machine: a model of repeated
    blocks prices each kind of node once, and extraction can share one across the candidate plans it prices."""

    def __init__(self, library: Library, machine: Machine):
        self.library, self.machine = library, machine
        self._known: dict = {}
        self._collectives: dict = {}
        self._chunks: dict = {}
        self._inferred: dict = {}   # `compute_time`'s memo of spread inference

    def collective(self, kind: str, group: GroupTopology, nbytes: float) -> float:
        """Seconds of one collective (`collectives.price` on this machine), kept by its inputs: the layouts of
        a grid and the micro-batches of a step issue the same few hundred collectives thousands of times."""
        key = (kind, group, nbytes, type(nbytes))
        found = self._collectives.get(key)
        if found is None:
            found = self._collectives[key] = price(kind, group, nbytes, self.machine).seconds
        return found

    def chunk(self, timed: OpTime, parts: int, axis: int) -> OpTime:
        """`op_time.chunk_time` of a pipelined product (`Pipeline`) on this machine, kept by its inputs: each
        micro-batch's forward and backward, and the floor, ask for the same chunks again."""
        key = (timed, parts, axis)
        found = self._chunks.get(key)
        if found is None:
            found = self._chunks[key] = chunk_time(timed, parts, axis, self.machine)
        return found

    def __call__(self, node: PNode, inputs: list[PNode]) -> OpTime:
        key = (node.op, node.attrs, tuple(i.shape for i in inputs), tuple(i.degrees for i in inputs), node.degrees)
        found = self._known.get(key)
        if found is None:
            found = self._known[key] = compute_time(self._instance(node, inputs), [i.degrees for i in inputs],
                                                    node.degrees, self.machine, self._inferred)[0]
        return found

    def _instance(self, node: PNode, inputs: list[PNode]):
        op = self.library.ops.get(node.op)
        if op is None:
            raise TaskBuildError(f"operator '{node.op}' is not in the library")
        try:
            return instance_for(op, [i.shape for i in inputs], dict(node.attrs))
        except Exception as err:  # noqa: BLE001 - any instantiation failure is a plan the builder cannot price
            raise TaskBuildError(f"node #{node.id} ({node.label}) does not instantiate: {err}") from None


@dataclass(frozen=True)
class _Template:
    """A middle micro-batch's tasks, `start` to `end` (excluded), which every later middle one repeats
    (`_Builder.template`); `collectives`: whether it issued any (else the lag it carries grows)."""

    start: int
    end: int
    collectives: bool


def collective_pipelines(pcg: PCG, profile: ExecutionProfile, topology: Topology | None = None
                         ) -> dict[int, Pipeline]:
    """Collective node and product node -> their `Pipeline`, where `profile` overlaps tensor-parallel
    communication (`tp_comm_overlap`; the one reader of that flag), each collective on its group (`topology`,
    `mesh_groups` by default). A product is pipelined with one collective: the one feeding it where one feeds
    it and another drains it (the first found, in the PCG's order). What the task builder runs pipelined
    (`_Builder.pipes`); empty, the PCG under `profile` builds the tasks it builds without `tp_comm_overlap`
    (`cost.pipeline.tp_overlap` then simulates nothing). On the mesh's groups (`topology` None) worked out once
    per PCG (`PCG.derive`: it reads the nodes, their readers, the weights' storage and the mesh, never the ZeRO
    stage or recomputation, so a layout's forms share it, `ir.pcg.restated`); the profile only says whether it
    applies. Shared: read it, never change it."""
    if not (profile.tp_comm_overlap and profile.overlap):
        return {}
    if topology is None:
        return pcg.derive(("collective pipelines", pcg.mesh), None, lambda: _pipelines(pcg, mesh_groups(pcg)))
    return _pipelines(pcg, topology)


def _pipelines(pcg: PCG, topology: Topology) -> dict[int, Pipeline]:
    """`collective_pipelines` worked out, each collective on its group (`topology`)."""
    params = weight_chains(pcg)
    folded = {i for chain in pcg.storage_chains.values() for i in chain[1:]}   # `_Builder._stored_weights`'
    out: dict[int, Pipeline] = {}
    taken: set[int] = set()
    for node in pcg.nodes:
        if node.kind != "parallel" or node.id in params or node.id in folded:
            continue
        pipe = _pipeline_of(pcg, node, topology)
        if pipe is not None and pipe.product not in taken:
            pipe = replace(pipe, siblings=tuple(i for i in pipe.siblings if i not in taken))
            out[node.id] = out[pipe.product] = pipe
            taken.update((pipe.product, *pipe.siblings))
    return out


def _pipeline_of(pcg: PCG, node: PNode, topology: Topology) -> Pipeline | None:
    """The pipeline of a collective (`node`, a parallel node outside the weights' chains and their storage) on a
    group inside one node (NVLink: what Transformer Engine's userbuffers and symmetric memory reach) with its
    product, if it has one: an all-gather (combine, all_gather) of an activation whose first reader is a product
    (backward: that product's gradient reduce-scattered), or a reduce_scatter (forward and backward) or a
    partition (backward: its all-gather) of a product's output. A weight's chain (a ZeRO-3 gather: FSDP's
    prefetch already overlaps it) and all-reduces (`reduce`, which these frameworks do not pipeline) are not."""
    group = topology(node)
    if group.size < 2 or group.link != "intra":
        return None
    siblings: tuple[int, ...] = ()
    if node.op in (COMBINE, parallel_ops.ALL_GATHER):
        users = pcg.readers_of.get(node.id, [])
        product, operand = (users[0], users[0].inputs.index(node.id)) if users else (None, None)
        gathers, forward, backward = True, True, node.op == parallel_ops.ALL_GATHER
        siblings = tuple(u.id for u in users[1:] if u.kind == "op" and u.op in PRODUCTS
                         and u.inputs.index(node.id) == operand and u.id != users[0].id)
    elif node.op in (PARTITION, parallel_ops.REDUCE_SCATTER):
        product, operand = pcg.node(node.inputs[0]), None
        gathers, forward, backward = False, node.op == parallel_ops.REDUCE_SCATTER, True
    else:
        return None
    if product is None or product.kind != "op" or product.op not in PRODUCTS:
        return None
    axis = product_axis(operand, len(node.shape), int(node.attr("dim")), product.op in TRANSPOSED_B)
    if axis is None:
        return None
    return Pipeline(node.id, product.id, group.size, axis, gathers, forward, backward, siblings)


def task_facts(pcg: PCG, machine: Machine, profile: ExecutionProfile, times: OpTimes
               ) -> tuple[dict[int, tuple], dict[tuple[int, bool], tuple], dict[int, str]]:
    """The task builder's facts of `pcg`'s nodes that every micro-batch repeats (`_Builder.forward_known`,
    `backward_known`, `backward_labels`), one table per machine, profile and cache of compute times, kept with the
    PCG (`PCG.derive`) and filled as nodes are first built. Each entry is worked out from its node, the compute
    times, the machine's efficiencies and the profile's flags, and its inputs' entries; not from pipelines:
    an entry is made only where its node runs unpipelined, and read only there (`_compute_forward`,
    `_compute_backward`). So the profile is keyed without `tp_comm_overlap` (which only `collective_pipelines`
    reads): a stage plan's overlap simulates it with and without pipelines (`cost.pipeline.tp_overlap`), and the
    second run reads the first run's facts of the nodes both run whole."""
    key = ("task facts", machine, replace(profile, tp_comm_overlap=False))
    return pcg.derive(key, times, lambda: ({}, {}, {}))


class _Builder:
    def __init__(self, pcg: PCG, machine: Machine, profile: ExecutionProfile, topology: Topology | None, times: OpTimes):
        self.pcg, self.machine, self.profile, self.times = pcg, machine, profile, times
        self.topology = topology or mesh_groups(pcg)   # None: each collective on a group of its mesh axis
        self.shared_times = times.machine is machine or times.machine == machine   # its chunks are this machine's
        self.item, self.eff = machine.dtype_bytes, machine.efficiency
        # `parsat run`'s interpreter's loop, on each node it runs (`OpEfficiency.step_node_s`; 0 not measured)
        self._interpreter_s = self.eff.step_node_s if profile.interpreted else 0.0
        self.steps = StepBuilder()
        self.compute = self.steps.stream(DEVICE, COMPUTE)
        self.by_id = {n.id: n for n in pcg.nodes}
        self.users = pcg.readers_of   # shared with the PCG's other readers: only read here
        self.needs_grad = needs_gradient(pcg, times.library)
        self.folded: set[int] = set()
        self.stored = self._stored_weights()
        self.params = weight_chains(pcg)
        # ring attention (`ir.ring_attention`), where the profile overlaps communication: the attention node and
        # its k and v gathers -> the ring
        self.rings = rings_run(pcg, profile.overlap)
        # the causal ring's mask nodes, which its kernel makes from the rank's offset: nothing run, nothing held
        self.generated = frozenset(i for r in self.rings.values() for i in r.generated)
        self.pipes = collective_pipelines(pcg, profile, topology)   # collective and product -> their `Pipeline`
        self.piped: dict[tuple[bool, int], list[int]] = {}   # (backward, collective) -> the first side's chunks
        self.early: set[int] = set()                  # products computed with a pipeline's product (its siblings)
        # ZeRO stage 1/2 (`PCG.zero`): stored-at node -> the replicate over whose devices its state is sharded
        self.sharded = {at: self.by_id[r] for at, r in state_shardings(pcg).items()} if pcg.zero else {}
        self.bucket_of: dict[int, tuple[int, GradientBuckets]] = {}   # stored-at node -> (its axis, buckets)
        self.gathers = self._param_gathers()          # ZeRO-1/2's gathers overlapped with forward, per axis
        self.weights_of = self._weights_of() if self.gathers else {}   # chain node -> the stored weights it reads
        # compute node -> its time (`OpTimes`), kept with the PCG for this cache of compute times: the simulation
        # and the floors of a layout's forms (`ir.pcg.restated`: the same nodes) read the same times
        self.timed: dict[int, OpTime] = pcg.derive(("compute times",), times, dict)
        # compute node -> its unpipelined forward task and `_prepare`'s records (name, seconds, bytes, contiguous,
        # saved, view): the same every micro-batch and recomputation, since what they read is (the node, its
        # time, and its inputs' contiguity, which are such records too or the weights' chains', kept all step);
        # (compute node, whether it ran as a view) -> its unpipelined backward's facts (`_compute_backward`); and
        # node -> its backward tasks' name. Kept with the PCG (`task_facts`) for every simulation of it on this
        # machine, cache of compute times and profile, tensor-parallel overlap aside: `cost.pipeline.tp_overlap`
        # simulates a stage plan with and without it, whose unpipelined nodes are these facts alike
        self.forward_known, self.backward_known, self.backward_labels = task_facts(pcg, machine, profile, times)
        self.ready: dict[int, int | None] = {}        # node -> the task after which its forward value exists
        self.grad_ready: dict[int, list[int]] = {}    # node -> tasks producing its gradient
        self.allocated: dict[int, int] = {}           # node -> bytes its forward output allocated
        self.contiguous: dict[int, bool] = {}
        self.since_sync = 0.0                         # compute seconds since the last collective (stragglers)
        self.collectives = 0                          # collectives issued so far (`_sync`)
        self.loss_bytes = 0                           # what this micro-batch's loss allocated
        self.first = True                             # this pass makes the weights' chains (the first micro-batch)
        self.syncing = True                           # this pass synchronises gradients (the last micro-batch)
        self.accumulating = False                     # gradients accumulate over several micro-batches
        self.checkpoints = {c.block: c for c in checkpoints(pcg)}   # activation recomputation (`ir.recompute`)
        self.block_of_run = {i: c.block for c in self.checkpoints.values() for i in c.runs}
        self.dropped = {i for c in self.checkpoints.values() for i in c.dropped}
        self.last_run = {c.runs[-1]: c for c in self.checkpoints.values()}
        self.recomputed: set[int] = set()             # blocks recomputed in this pass's backward
        self.recomputing: PNode | None = None         # the node whose forward runs again (`_recompute`)
        self.groups = param_groups(pcg) if profile.fsdp_groups else {}   # stored-at node -> its FSDP2 group
        self.group_gathered: dict[int, int] = {}      # group key -> the task after which it is gathered
        self.group_grads: dict[int, list[int]] = {}   # group key -> the tasks producing its members' gradients
        self.weight_fed: set[int] | None = None       # values computed from weights alone (`_weight_fed`)
        self.tensor_axes = tensor_axes(pcg) if profile.dtensor_modules else set()
        self.gathered_values = {n.id for n in pcg.nodes if n.kind == "parallel" and n.op == parallel_ops.ALL_GATHER}
        self.regathered = regathered(pcg, times.library) if profile.regather else frozenset()
        self.regathers: dict[int, int] = {}           # regathered node -> its backward all-gather in this pass
        # regathered node -> its readers whose backward is split (`_split_backward`): their input gradients all
        # run beside its second all-gather before any of their weight gradients (`_defer_weight_gradient`)
        self.split_readers = {r: len({u.id for u in self.users.get(r, []) if u.kind == "op" and u.op in PRODUCTS})
                              for r in self.regathered} if profile.overlap else {}
        self.split_left: dict[int, int] = {}          # regathered node -> its split readers not yet run, this pass
        self.held_back: dict[int, list[tuple]] = {}   # regathered node -> weight gradients waiting for the others
        self.deferred: set[int] = set()               # inputs whose gradient is among those weight gradients
        self.flushed: list[int] = []                  # inputs whose gradient was just issued (`backward` visits)
        # values freed once their forward readers are done: regathered ones, and, where backward frees values,
        # those no backward reads (`cost.saved`, as the per-node model counts them)
        self.released = self.regathered if profile.keep_activations else \
            self.regathered | unkept(pcg, times.library)
        self.forward_readers: dict[int, int] = {}     # released node -> its readers whose forward is pending
        self.extra: dict[int, int] = {}               # compute node -> what it saves beside its output
        self.views: dict[int, bool] = {}              # compute node -> whether it ran as a view (no kernel)
        self.ids = onehot_ids(pcg) if profile.integer_ids else frozenset()   # one-hot data held as integer ids
        self.attention_views = attention_views(pcg) if profile.attention_layouts else frozenset()

    def new_pass(self, first: bool, syncing: bool, accumulating: bool = False) -> None:
        """Start a micro-batch: values, gradients and buffers are the pass's own; compute times are kept.
        A weight's chain (`weight_chains`) runs once per step, as the backend runs it: its forward in the
        first micro-batch, its values kept for the others, its backward (the gradient synchronisation) in
        the last, on the gradient accumulated over all of them (DDP's `no_sync`)."""
        keep = self.params
        self.ready = {k: v for k, v in self.ready.items() if k in keep}
        self.allocated = {k: v for k, v in self.allocated.items() if k in keep}
        self.contiguous = {k: v for k, v in self.contiguous.items() if k in keep}
        self.grad_ready = {}
        self.regathers = {}
        self.split_left, self.held_back, self.deferred, self.flushed = dict(self.split_readers), {}, set(), []
        self.forward_readers = {i: len({u.id for u in self.users.get(i, [])}) for i in self.released}
        self.piped = {}
        self.early = set()
        self.bucket_of = {}
        self.recomputed = set()
        self.first, self.syncing, self.accumulating = first, syncing, accumulating

    def template(self, start: int, lag: float, collectives: int) -> "_Template | None":
        """The middle micro-batch just built (its tasks from `start` on; begun with `lag` as `since_sync` and
        `collectives` issued) as the template every later middle one repeats (`repeat`), or None when the next
        one may differ.

        Why the next one repeats it exactly, task for task one micro-batch later: a middle micro-batch reads no
        state of the one before but the lag carried (`since_sync`): its values, gradients and buffers are its
        own (`new_pass`), the weights' chains were made by the first micro-batch and are left alone until the
        last, compute times are cached, and its dependencies on earlier micro-batches are on those chains
        only. The lag is read only by a collective's wait for the slowest rank (`_sync`). So the next one
        repeats this one when it starts with the same lag (with collectives, one ends with the compute since
        its last one: this holds from the second middle micro-batch on, and is checked), or when no duration
        read the lag (no collective), the lag then growing by the compute durations, added in the same order
        (`repeat`)."""
        made = self.collectives > collectives
        if made and self.since_sync != lag:
            return None
        return _Template(start, len(self.steps), made)

    def repeat(self, template: "_Template") -> None:
        """A middle micro-batch, as `template` says the one it was made from ran (`template`)."""
        self.steps.repeat(template.start, template.end)
        if not template.collectives:
            durations, stream_of = self.steps.durations, self.steps.stream_of
            for i in range(template.start, template.end):
                if stream_of[i] == self.compute:   # every compute task of it was added by `_add`
                    self.since_sync += durations[i]

    # ---------------------------------------------------------------- facts
    def _stored_weights(self) -> dict[int, PNode]:
        """Node id where each weight is stored -> that node (`ir.pcg.weight_storage`, as the backend stores it);
        the partitions on a storage chain are folded into it: nothing runs."""
        out = {}
        for chain in weight_storage(self.pcg).values():
            self.folded.update(chain[1:])
            out[chain[-1]] = self.by_id[chain[-1]]
        return out

    # ---------------------------------------------------------------- helpers
    def _copy_s(self, elements: int, backward: bool = False) -> float:
        return memory_op_time(2.0 * elements * self.item, self.machine, backward)

    def _chunk(self, timed: OpTime, pipe: Pipeline) -> OpTime:
        """One of `pipe.parts` slices of a pipelined product (`op_time.chunk_time`), through the shared cache
        where it was made for this machine (`step_floor` may be handed another's)."""
        if self.shared_times:
            return self.times.chunk(timed, pipe.parts, pipe.axis)
        return chunk_time(timed, pipe.parts, pipe.axis, self.machine)

    def _collective(self, kind: str, node: PNode, nbytes: float) -> float:
        """Seconds of one collective of `nbytes` (`collectives.price`'s convention) on `node`'s group, as this
        profile's runtime issues it (`ExecutionProfile.reduce_scatter_as_all_reduce`)."""
        if kind == REDUCE_SCATTER and self.profile.reduce_scatter_as_all_reduce:
            kind = ALL_REDUCE   # the reduce-scatter's input is the all-reduced buffer
        return self.times.collective(kind, self.topology(node), nbytes)

    def _deps(self, node: PNode) -> list[int]:
        deps = [t for t in map(self.ready.get, node.inputs) if t is not None]
        if self.gathers and self.first and node.id not in self.params:
            deps += self._await_parameters(node)
        return deps

    def _add(self, name: str, stream: int, seconds: float, deps, alloc: int = 0, free: int = 0,
             phase: str = "forward") -> int:
        if stream == self.compute:
            self.since_sync += seconds
        if self.recomputing is not None:   # a forward run again in backward (`_recompute`)
            name, phase = f"recompute {name}", {"forward": "backward", "forward_comm": "backward_comm"}[phase]
            if self.recomputing.id not in self.dropped:   # a kept value: it is still there, its copy is dropped
                alloc = free = 0
        return self.steps.add(name, stream, seconds, deps, alloc, free, phase)

    def _sync(self, name: str, kind: str, node: PNode, nbytes: float, deps, alloc: int = 0, free: int = 0,
              phase: str = "forward_comm", pipe: Pipeline | None = None, backward: bool = False,
              fsdp: bool = False) -> int:
        """A collective: it first waits for the slowest rank (`comm.sync_skew` x the compute since the last one)
        and, on ranks sharing cores, for a peer's turn (`_turn`). With `pipe`, in chunks pipelined with its
        product (`Pipeline.ring`). One the runtime issues through DTensor's `redistribute` (`_redistribute_s`) or,
        `fsdp`, one of FSDP2's group collectives (`_fsdp_s`) first takes the host work that adds beyond the
        table's plain collective, on the compute stream; not compute a peer lags behind on, so not in the
        stragglers'."""
        host = self._fsdp_s(kind, node) if fsdp else self._redistribute_s(kind, node)
        if host:
            host_phase = "forward" if phase == "forward_comm" else "backward"
            what = "FSDP2's host work" if fsdp else "DTensor's redistribute"
            deps = [self._add(f"{name}: {what}", self.compute, host, deps, phase=host_phase)]
            self.since_sync -= host
        wait = self.machine.comm.sync_skew * self.since_sync + self._turn(node)
        self.since_sync = 0.0
        stream = self._comm(self.topology(node))
        self.collectives += 1
        if wait > 0:
            deps = [self.steps.add(f"{name}: waiting for the slowest rank", stream, wait, deps, phase="stragglers")]
        whole = self._collective(kind, node, nbytes)
        if pipe is None:
            return self._add(name, stream, whole, deps, alloc=alloc, free=free, phase=phase)
        step = self._collective(SEND_RECV, node, nbytes / pipe.parts)
        return self._piped(pipe, backward, False, name, stream, pipe.ring(kind, step), whole, list(deps), alloc, free,
                           phase)

    def _redistribute_s(self, kind: str, node: PNode) -> float:
        """Host seconds DTensor's `redistribute` adds to `node`'s collective (`OpEfficiency.redistribute_time`)
        where the profile runs torch's tensor-parallel styles (`dtensor_modules`) and `node` acts on a tensor
        axis: there the runtime's activations are DTensors and each collective is a change of placements
        (Partial -> Replicate, Shard -> Replicate, Partial -> Shard). 0 elsewhere: a plain collective, a data
        axis (FSDP2's), a preset or a machine calibrated without `--dtensor`."""
        if not self.tensor_axes or node.kind != "parallel" or node.axis(self.pcg.mesh) not in self.tensor_axes:
            return 0.0
        return self.eff.redistribute_time(kind)

    def _fsdp_s(self, kind: str, node: PNode) -> float:
        """Host seconds FSDP2 adds to a group's collective over more than one rank (`OpEfficiency.
        fsdp_collective_time`) beyond its one-rank hooks (`fsdp_hooks_time`), the plain collective and the copies;
        0 on a machine calibrated without `--dtensor`."""
        return self.eff.fsdp_collective_time(kind) if self.topology(node).size > 1 else 0.0

    def _turn(self, node: PNode) -> float:
        """What a collective waits for a peer's turn on a core, where the machine was calibrated with ranks sharing
        cores (`machine.oversubscribed`; else 0): a peer still computing holds its core until the scheduler takes
        it back, at most `comm.turn_s` (a time slice, `parsat calibrate`'s `fit_turn`) and at most the compute
        since the previous collective (a peer holds the core no longer than its own compute). None after a
        collective with no compute between them, as the collectives' table times them back to back."""
        turn = self.machine.comm.turn_s
        if not turn or self.machine.oversubscribed is None or self.topology(node).size < 2:
            return 0.0
        return min(turn, self.since_sync)

    # ---------------------------------------------------------------- tensor-parallel communication overlap
    def _pipe(self, node: PNode, backward: bool) -> Pipeline | None:
        """The pipeline `node` (a collective or a product) runs in, in this direction, if any."""
        pipe = self.pipes.get(node.id)
        return pipe if pipe is not None and (pipe.backward if backward else pipe.forward) else None

    def _piped(self, pipe: Pipeline, backward: bool, product: bool, name: str, stream: int, chunks: Sequence[float],
               whole: float, deps: list[int], alloc: int, free: int, phase: str) -> int:
        """One side of `pipe` (the product's if `product`, else the collective's) as `pipe.parts` tasks of
        `chunks` seconds, the first allocating what the whole allocates and the last freeing what it frees;
        returns the last. The side that runs second waits, chunk by chunk, for the first side's chunks; where it
        does not wait for them (a product recomputed without its collective), it runs whole (`whole` seconds)."""
        first = pipe.product_first(backward) == product
        key = (backward, pipe.collective)
        feed: list[int] = []
        if not first:
            earlier = self.piped.pop(key, None)
            if earlier is None or earlier[-1] not in deps:
                return self._add(name, stream, whole, deps, alloc=alloc, free=free, phase=phase)
            deps, feed = [d for d in deps if d != earlier[-1]], earlier
        last = pipe.parts - 1
        tasks = [self._add(f"{name} [{i + 1}/{pipe.parts}]", stream, chunks[i], deps + feed[i:i + 1],
                           alloc=0 if i else alloc, free=free if i == last else 0, phase=phase)
                 for i in range(pipe.parts)]
        if first:
            self.piped[key] = tasks
        return tasks[-1]

    def _ring(self, node: PNode, kernel_s: float, backward: bool, deps: list[int], alloc: int = 0,
              free: int = 0) -> int:
        """Ring attention's pass (`ir.ring_attention`): `parts` chunks of the kernel on the compute stream,
        chunk i after the send/recv that brings block i (a k and a v block; backward also their dk and dv, and
        one last step bringing them home); returns the last task."""
        ring: RingAttention = self.rings[node.id]
        gather = self.by_id[ring.gathers[0]]
        block = sum(_elements(self.by_id[self.by_id[g].inputs[0]]) for g in ring.gathers) * self.item
        moved = 2 * block if backward else block
        phase = "backward" if backward else "forward"
        name = f"{node.label} #{node.id}{' backward' if backward else ''} ({'causal ' if ring.causal else ''}ring " \
               "attention)"
        # the slowest rank's share of the dense block row at each step (`cost.ring_time.ring_work`): the causal
        # ring's last rank starts on its diagonal block (half its scores), then meets the p - 1 blocks before it
        chunks = ring_chunks_s(kernel_s, ring_work(ring.parts, ring.causal, ring.balanced),
                               lambda s: self.eff.op_time(s, backward=backward))
        task = self._add(f"{name} [1/{ring.parts}]", self.compute, chunks[0], deps, alloc=alloc, phase=phase)
        sent = None
        for i in range(1, ring.parts):
            sent = self._sync(f"{name} block {i} send/recv", SEND_RECV, gather, moved, deps + ([sent] if sent else []),
                              phase=f"{phase}_comm")
            task = self._add(f"{name} [{i + 1}/{ring.parts}]", self.compute, chunks[i], [task, sent],
                             free=free if i == ring.parts - 1 and not backward else 0, phase=phase)
        if backward:   # each block's dk and dv one step from home
            task = self._sync(f"{name} dk, dv home", SEND_RECV, gather, block, [task], free=free,
                              phase="backward_comm")
        return task

    @cached_property
    def _comm_streams(self) -> dict[str, int]:
        """Link -> its communication stream (`_comm`), each made once: a collective of every pass asks."""
        return {}

    def _comm(self, group: GroupTopology) -> int:
        """The stream a collective of `group` runs on: inline on the compute stream where the profile does not
        overlap; else one communication stream per link the group crosses (`GroupTopology.link`): a
        collective inside a node (NVLink) and one across nodes (the network) use different hardware and, as
        NCCL runs them on different communicators' streams, run at once (Megatron-LM overlaps a data-parallel
        reduce-scatter with the tensor-parallel collectives of backward); two on one link queue."""
        if not self.profile.overlap:
            return self.compute
        found = self._comm_streams.get(group.link)
        if found is None:
            found = self._comm_streams[group.link] = self.steps.stream(DEVICE, COMM, group.link)
        return found

    def finish(self) -> None:
        """The step ends when the slowest rank ends: its lag since the last collective."""
        wait = self.machine.comm.sync_skew * self.since_sync
        if wait > 0:
            self._add("the slowest rank finishing", self.compute, wait, [len(self.steps) - 1], phase="stragglers")

    # ---------------------------------------------------------------- forward
    def forward(self) -> None:
        self._replicated_hooks()
        self._module_calls()
        for node in self.pcg.nodes:
            if node.id in self.params and (not self.first or node.id in self.ready):
                continue  # a weight's chain: made by the first micro-batch (or issued early, `_issue_chains`)
            self._forward_node(node)
            self._release(node)
            if node.id in self.last_run:
                self._drop(self.last_run[node.id])
        if self.first:
            for gathers in self.gathers:
                gathers.finish()

    def _release(self, node: PNode) -> None:
        """A released value (`released`) read by the last of its forward readers (`node`) is freed, what it saves
        for its own backward aside (`_saved_extra`): no backward reads it, or it is gathered again for the one
        that does (`_regather`). Not one recomputation keeps (a value read outside its block, which `_recompute`
        makes again without allocating)."""
        readers = self.forward_readers
        for i in dict.fromkeys(node.inputs) if len(node.inputs) > 1 else node.inputs:
            if i not in readers:
                continue
            self.forward_readers[i] -= 1
            held = self.allocated.get(i, 0) - self.extra.get(i, 0)
            if self.forward_readers[i] or held <= 0 or (i in self.block_of_run and i not in self.dropped):
                continue
            self.allocated[i] -= held
            why = "gathered again in backward" if i in self.regathered else "no backward reads it"
            self._add(f"freed after forward: {self.by_id[i].label} #{i} ({why})", self.compute, 0.0,
                      [t for t in (self.ready.get(node.id),) if t is not None], free=held)

    def _forward_node(self, node: PNode) -> None:
        if node.id in self.generated:   # the causal ring's mask, made inside its kernel (`ir.ring_attention`)
            self.ready[node.id] = None
        elif node.kind == "leaf":
            self._leaf(node)
        elif node.kind == "parallel":
            self._parallel_forward(node)
        else:
            self._compute_forward(node)

    def _drop(self, checkpoint: Checkpoint) -> None:
        """A recomputed block's forward is done: the values only it reads are freed (`ir.recompute`)."""
        held = sum(self.allocated.get(i, 0) for i in checkpoint.dropped)
        for i in checkpoint.dropped:
            self.allocated[i] = 0
        if held:
            self._add(f"block {checkpoint.block}'s activations dropped", self.compute, 0.0,
                      [self.ready[checkpoint.runs[-1]]], free=held)

    def _recompute(self, block: int) -> None:
        """Before a recomputed block's first backward task: its forward again, from the values it kept."""
        self.recomputed.add(block)
        for ident in self.checkpoints[block].runs:
            node = self.by_id[ident]
            self.recomputing = node
            try:
                if node.id in self.generated:
                    continue
                if node.kind == "parallel":
                    self._parallel_forward(node)
                else:
                    self._compute_forward(node)
            finally:
                self.recomputing = None

    def _leaf(self, node: PNode) -> None:
        self.contiguous[node.id] = True
        if node.role == "weight" or not self.profile.seeded_inputs:
            self.ready[node.id] = None
            return
        nbytes = _full(node) * self.item   # drawn before the step's clock (`StepData.loaded`): held, not timed
        self.allocated[node.id] = nbytes
        self.ready[node.id] = self._add(f"data {node.op}", self.compute, self._interpreter_s, (), alloc=nbytes)

    def _parallel_forward(self, node: PNode) -> None:
        deps = self._deps(node)
        piece = _elements(node)
        source = self.by_id[node.inputs[0]]
        self.contiguous[node.id] = True
        if node.id in self.folded:
            self.ready[node.id] = None  # stored as this piece: nothing runs
            return
        label = f"{node.label} #{node.id}"
        path = self.eff.parallel_path_time() + self._interpreter_s if self.profile.interpreted else 0.0
        if path > 0:   # the runtime's path around the node's body (its copies, its collective: priced below)
            deps = [self._add(f"{label} (parsat run's parallel path)", self.compute, path, deps)]
        if node.op == PARTITION:
            if self._slice_is_view(node, source) or node.id in self.ids:   # narrow() along the outer dims, or ids
                self.contiguous[node.id] = True
                self.ready[node.id] = self._add(label, self.compute, self.eff.op_time(0.0), deps)
                return
            nbytes = piece * self.item
            self.allocated[node.id] = nbytes
            self.ready[node.id] = self._add(label, self.compute, self._copy_s(piece), deps, alloc=nbytes)
        elif node.op in (COMBINE, parallel_ops.ALL_GATHER):   # a weight's gathered copy lives to its backward
            self._gather_forward(node, label, deps)
        elif node.op == parallel_ops.REDUCE_SCATTER:
            whole = _elements(source) * self.item   # the partial sum's piece, cut into one block per group member
            self.allocated[node.id] = piece * self.item
            pipe = self._pipe(node, backward=False)
            if pipe is not None:   # each chunk sent from the product's output as the product writes it
                self.ready[node.id] = self._sync(f"{label} reduce-scatter", REDUCE_SCATTER, node, whole, deps,
                                                 alloc=piece * self.item, pipe=pipe)
                return
            cut = self._add(f"{label} slices", self.compute, self._copy_s(_elements(source)), deps, alloc=whole)
            self.ready[node.id] = self._sync(f"{label} reduce-scatter", REDUCE_SCATTER, node, whole, [cut],
                                             alloc=piece * self.item, free=whole)
        elif node.op == REPLICATE:
            self.contiguous[node.id] = self.contiguous.get(source.id, True)
            self.ready[node.id] = self._add(label, self.compute, self.eff.op_time(0.0), deps)
        elif node.op == REDUCE and self.profile.local_loss and node.id in self.pcg.outputs:
            self.ready[node.id] = self._add(f"{label} (the rank's own loss)", self.compute, self.eff.op_time(0.0), deps)
        elif node.op == REDUCE:
            nbytes = piece * self.item
            copy = self._add(f"{label} copy", self.compute, self._copy_s(piece), deps, alloc=nbytes)
            self.allocated[node.id] = nbytes
            self.ready[node.id] = self._sync(f"{label} all-reduce", ALL_REDUCE, node, nbytes, [copy])
        elif node.op == parallel_ops.ALL_TO_ALL:   # the blocks packed, exchanged, and laid out along the new dim
            nbytes = piece * self.item
            self.allocated[node.id] = nbytes   # the output, until its backward
            pack = self._add(f"{label} pack", self.compute, self._copy_s(piece), deps, alloc=nbytes)
            moved = self._sync(f"{label} all-to-all", ALL_TO_ALL, node, nbytes, [pack], alloc=nbytes)
            self.ready[node.id] = self._add(f"{label} unpack", self.compute, self._copy_s(piece), [moved],
                                            alloc=nbytes, free=2 * nbytes)   # the send and receive buffers go
        else:
            raise TaskBuildError(f"unknown parallel operator '{node.op}'")

    def _gather_forward(self, node: PNode, label: str, deps: list[int]) -> None:
        """An all-gather and the concatenation of its pieces; pipelined with its product, the chunks land in the
        buffer the product reads, and nothing is concatenated (`Pipeline`)."""
        if node.id in self.params and node.inputs[0] in self.groups:   # FSDP2: the whole group at once
            group = self.groups[node.inputs[0]]
            if group.key not in self.group_gathered:
                self.group_gathered[group.key] = self._group_gather(group, node, deps, "forward")
            self.ready[node.id] = self.group_gathered[group.key]
            return
        if node.id in self.rings:   # the ring passes its blocks during the attention: one block held, nothing issued
            block = _elements(self.by_id[node.inputs[0]]) * self.item
            self.allocated[node.id] = block
            self.ready[node.id] = self._add(f"{label} (ring attention's blocks)", self.compute, 0.0, deps, alloc=block)
            return
        nbytes = _elements(node) * self.item
        self.allocated[node.id] = nbytes  # the concatenation; the gathered pieces are freed with it
        pipe = self._pipe(node, backward=False)
        if pipe is not None:
            self.ready[node.id] = self._sync(f"{label} all-gather", ALL_GATHER, node, nbytes, deps, alloc=nbytes,
                                             pipe=pipe)
            return
        gather = self._sync(f"{label} all-gather", ALL_GATHER, node, nbytes, deps, alloc=nbytes)
        self.ready[node.id] = self._add(f"{label} concat", self.compute, self._copy_s(_elements(node)), [gather],
                                        alloc=nbytes, free=nbytes)

    def _slice_is_view(self, node: PNode, source: PNode) -> bool:
        """Whether a partition's slice is a view: every dim before the split one has one element locally."""
        dim = int(node.attr("dim"))
        local = [d // s for d, s in zip(source.shape, source.degrees.shard)]
        return self.contiguous.get(source.id, True) and all(d == 1 for d in local[:dim])

    def _compute_forward(self, node: PNode) -> None:
        if node.id in self.early:   # computed with the product before it (a sibling of its pipeline)
            self.early.discard(node.id)
            return
        if node.id in self.rings:
            _timed, kernel, copy, nbytes = self._prepare(node)
            self.ready[node.id] = self._ring(node, kernel + copy, False, self._deps(node), alloc=nbytes)
            return
        pipe = self._pipe(node, backward=False)
        if pipe is None:
            known = self.forward_known.get(node.id)
            if known is None:   # first run: worked out (`_prepare`), and kept
                _timed, kernel, copy, nbytes = self._prepare(node)
                seconds = self.eff.op_time(kernel + copy) + self._dtensor_s(node, False) + self._interpreter_s
                known = self.forward_known[node.id] = (f"{node.label} #{node.id}", seconds, nbytes,
                                                       self.contiguous[node.id], self.extra[node.id],
                                                       self.views[node.id])
            else:   # `_prepare`'s records, as it would make them again
                ident = node.id
                _name, seconds, nbytes, self.contiguous[ident], self.extra[ident], self.views[ident] = known
                self.allocated[ident] = nbytes
            self.ready[node.id] = self._add(known[0], self.compute, known[1], self._deps(node), alloc=known[2])
            return
        fused = [node] + self._ready_siblings(pipe)
        run = [self._prepare(n) for n in fused]
        timed, kernel, copy, nbytes = run[0]
        if kernel == 0.0:   # a view (unpipelined nodes are run above)
            seconds = self.eff.op_time(kernel + copy) + self._dtensor_s(node, False)
            self.ready[node.id] = self._add(f"{node.label} #{node.id}", self.compute, seconds, self._deps(node),
                                            alloc=nbytes)
            return
        part = self.eff.op_time(sum(self._chunk(t, pipe).kernel_s + c / pipe.parts
                                    for t, _k, c, _b in run))
        whole = self.eff.op_time(sum(k + c for _t, k, c, _b in run))
        deps = sorted({d for n in fused for d in self._deps(n)})
        name = f"{node.label} #{node.id}" + "".join(f" + #{n.id}" for n in fused[1:])
        last = self._piped(pipe, False, True, name, self.compute, [part] * pipe.parts, whole, deps,
                           sum(b for _t, _k, _c, b in run), 0, "forward")
        for n in fused:
            self.ready[n.id] = last
        self.early.update(n.id for n in fused[1:])

    def _prepare(self, node: PNode) -> tuple[OpTime, float, float, int]:
        """A compute node's forward facts: (its time, its kernel's seconds, the seconds of the copy it saves for
        backward, the bytes it allocates); records whether its output is contiguous and what it holds."""
        timed = self.timed.get(node.id)   # kept across micro-batches and recomputation: the same node, the same time
        if timed is None:
            timed = self.timed[node.id] = self.times(node, [self.by_id[i] for i in node.inputs])
        laid_out = node.id in self.attention_views   # a flatten the fused attention kernel's layout makes a view
        view = node.op in VIEW_OPS or node.op == "flatten" and (laid_out or self.contiguous.get(node.inputs[0], True))
        self.contiguous[node.id] = laid_out or node.op != "transpose" and \
            (not view or self.contiguous.get(node.inputs[0], True))
        nbytes = 0 if view else _elements(node) * self.item
        saved = self._saved_extra(node, timed)
        self.allocated[node.id] = nbytes + saved
        self.extra[node.id] = saved
        self.views[node.id] = view
        copy = saved / self.eff.bandwidth(2 * saved, self.machine.memory_bandwidth) if saved else 0.0
        return timed, 0.0 if view else timed.kernel_s, copy, nbytes + saved

    def _ready_siblings(self, pipe: Pipeline) -> list[PNode]:
        """The pipeline's sibling products whose inputs are issued (their weights' chains issued now where they
        are not yet, `_issue_chains`), so that the gather's chunks feed them with its product, chunk by chunk,
        as one fused product (`Pipeline.siblings`)."""
        return [self.by_id[i] for i in pipe.siblings if self._issue_chains(self.by_id[i])]

    def _issue_chains(self, node: PNode) -> bool:
        """Whether every input of `node` is issued, after issuing now those that are values of a weight's chain
        (a framework holds its weights before the layer runs: in the PCG's order they may come after `node`'s
        first sibling); False, issuing nothing, where another input is not issued yet."""
        missing: set[int] = set()
        waiting = [i for i in node.inputs if i not in self.ready]
        while waiting:
            i = waiting.pop()
            if i not in missing:
                missing.add(i)
                waiting.extend(j for j in self.by_id[i].inputs if j not in self.ready)
        if not missing <= self.params or not self.first:
            return not missing
        for i in sorted(missing):
            self._forward_node(self.by_id[i])
        return True

    def _saved_extra(self, node: PNode, timed: OpTime) -> int:
        """Bytes torch allocates and saves for backward beyond the output: a batched product copies an input
        that is not contiguous when its batch dims cannot merge as a view (`torch.matmul` reshapes them into
        one: a transposed [b, h, s, d] needs a copy unless b or h is 1), layer norm keeps a mean and a 1/std
        per row, a fused kernel what `op_time` says it keeps (FlashAttention: a logsumexp per query row)."""
        extra = int(timed.saved_bytes)
        if node.op in PRODUCTS:
            for i in node.inputs:
                source = self.by_id[i]
                local = [d // s for d, s in zip(source.shape, source.degrees.shard)]
                if not self.contiguous.get(i, True) and sum(1 for d in local[:-2] if d > 1) >= 2:
                    extra += _elements(source) * self.item
        if node.op == "layernorm":
            extra += 2 * _elements(node) // max(1, node.shape[-1] // node.degrees.shard[-1]) * self.item
        return extra

    # ---------------------------------------------------------------- loss
    def loss(self) -> list[int]:
        """Per output, the backend's objective (parsat/backend/executor.py `objective`): a loss output as it is, any
        other against a target drawn from the seed before the step (not timed)."""
        tasks = []
        self.loss_bytes = 0
        resharded = {g.key: g for g in self.groups.values() if g.reshard and g.key in self.group_gathered}
        if resharded:   # FSDP2 frees a non-root group's gathered weights after its forward
            whole = sum(group_elements(g, self.by_id)[1] for g in resharded.values()) * self.item
            self._add("gathered blocks freed after forward", self.compute, 0.0, [len(self.steps) - 1], free=whole,
                      phase="forward")
        for out in self.pcg.outputs:
            node = self.by_id[out]
            piece = _elements(node)
            deps = [t for t in (self.ready.get(out),) if t is not None]
            seconds = self._loss_s(node) + (self.eff.step_loss_path_s if self.profile.interpreted else 0.0)
            self.loss_bytes += piece * self.item
            tasks.append(self._add(f"loss of #{out}", self.compute, seconds, deps, alloc=piece * self.item,
                                   phase="loss"))
        return tasks

    def _loss_s(self, node: PNode, backward: bool = False) -> float:
        """An output's objective (a loss output's own, a difference from a target's), or its backward: a difference
        from a target's as `parsat calibrate` measured it in a step's place (`OpEfficiency.loss_time`), else (a
        loss output, whose objective is its sum, or a machine without the figure) memory-bound operators on its
        piece."""
        loss = is_loss(node.shape)
        measured = None if loss else self.eff.loss_time(_elements(node), backward)
        if measured is not None:
            return measured
        if backward:
            return (SCALAR_LOSS_BACKWARD_OPS if loss else LOSS_BACKWARD_OPS) * self._copy_s(_elements(node), True)
        return (SCALAR_LOSS_OPS if loss else LOSS_OPS) * self._copy_s(_elements(node))

    # ---------------------------------------------------------------- backward
    def backward(self, loss: list[int]) -> tuple[list[int], dict[int, int]]:
        """Backward tasks in reverse order; returns (the grad-sync tasks, weight-storing node -> its grad task).

        Nodes are visited in reverse order, as autograd runs them (it takes the
        most recently created ready node first). So in `parsat run` the
        `replicate` of a weight, created with the leaves at the start, runs
        its gradient all-reduce only at the end of backward. With
        `eager_gradients` (DDP: autograd accumulates a parameter's gradient as
        soon as it is complete, its hook marks it ready for its bucket), the
        nodes between a weight and its readers are visited as soon as their
        last reader's backward is done.
        """
        for out, task in zip(self.pcg.outputs, loss):
            seconds = self._loss_s(self.by_id[out], backward=True)
            self._give(out, self._add(f"loss backward of #{out}", self.compute, seconds, [task], phase="backward"))
        self._module_calls(loss, backward=True)
        syncs: list[int] = []
        produced: dict[int, int] = {}
        buckets = self._buckets() if self.syncing else []
        waiting = dict(reader_counts(self.pcg))   # node -> its users whose backward is pending
        params = self.params
        done: set[int] = set()
        eager = self.profile.eager_gradients and self.syncing
        deferred: list[tuple[int, int]] = []   # gradients that reach their bucket through another axis's reduction
        skipped: set[int] = set()   # passed while their gradient, or a reader's, was held back (`_walk`)
        # the pass's tables, each made by `new_pass` and only changed in place until the next (read per node)
        held_back, grad_ready, allocated, deferred_inputs = self.held_back, self.grad_ready, self.allocated, \
            self.deferred
        block_of_run, recomputed, needs_grad, stored, dropped, by_id = self.block_of_run, self.recomputed, \
            self.needs_grad, self.stored, self.dropped, self.by_id

        def visit(node: PNode) -> None:
            ident = node.id
            done.add(ident)
            if ident in held_back:   # a regathered value's readers are all behind: nothing waits longer
                self.flush_weight_gradients(ident)
            block = block_of_run.get(ident)
            if block is not None and block not in recomputed:
                self._recompute(block)
            deps = grad_ready.get(ident)
            if deps and needs_grad[ident]:  # else no gradient reaches it (data, or off the loss's path)
                last = max(deps) if node.kind == "leaf" else self._node_backward(node, deps, syncs)
                if ident in stored and last is not None:
                    produced[ident] = last
                    if ident in self.bucket_of and self._through_reduction(last):
                        deferred.append((ident, last))
                    elif ident in self.bucket_of:
                        self.bucket_of[ident][1].ready(str(ident), last)
            if ident in dropped and allocated.get(ident):   # recomputed, but no gradient reached it
                self._add(f"{node.label} #{ident} dropped", self.compute, 0.0, [len(self.steps) - 1],
                          free=allocated.pop(ident), phase="backward")
            inputs = node.inputs
            for i in inputs:
                waiting[i] -= 1
            for i in (*inputs, *self._take_flushed()) if self.flushed else inputs:
                if i not in done and not waiting[i] and i not in deferred_inputs and \
                        (i in skipped or eager and i in params):
                    visit(by_id[i])

        self._walk(self._backward_order(), visit, done, skipped)
        # `visit` reads itself: dropped here, so that the builder (and its tasks) is freed when the step is
        # simulated, not left in a reference cycle for the collector (its lambdas read the cache, not `self`)
        visit = None   # noqa: F841
        if self.first and self.accumulating and self._accumulated_bytes():
            self._add("gradients kept across micro-batches", self.compute, 0.0, [len(self.steps) - 1],
                      alloc=self._accumulated_bytes(), phase="backward")
        if self.syncing:
            syncs.extend(self._group_syncs())
        if self.profile.transient_gradients and self.syncing:   # the gradients, until the update frees them
            self._add("the weights' gradients", self.compute, 0.0, [len(self.steps) - 1],
                      alloc=self.gradient_bytes(), phase="backward")
        for ident, task in deferred:   # after backward's own collectives, as Megatron's finalize_model_grads
            self.bucket_of[ident][1].ready(str(ident), task)
        backward_end = self._last_compute_task() if not self.profile.overlap_grad_reduce else None
        for bucketed in buckets:
            syncs.extend(bucketed.done(backward_end))
        if self.pcg.zero == 2 and self.accumulating and not self.syncing:
            self._scatter_microbatch_gradients()
        return syncs, produced

    def _last_compute_task(self) -> int | None:
        """The compute stream's latest task so far (where a reduction run after backward starts)."""
        stream_of = self.steps.stream_of
        return next((i for i in range(len(stream_of) - 1, -1, -1) if stream_of[i] == self.compute), None)

    def _backward_order(self) -> list[PNode]:
        """The order `backward` visits the nodes in: the reverse of the PCG's. Over several micro-batches the
        weights' chains run backward only in the last one (before it, their gradients accumulate), after the
        rest of its backward (the backend reduces the accumulated gradients then; `eager_gradients` aside). One
        batch runs them where autograd reaches them."""
        if not self.accumulating:
            return list(reversed(self.pcg.nodes))
        order = [n for n in reversed(self.pcg.nodes) if n.id not in self.params]
        if self.syncing:
            order += [n for n in reversed(self.pcg.nodes) if n.id in self.params]
        return order

    def _walk(self, order: Sequence[PNode], visit: Callable[[PNode], None], done: set[int],
              skipped: set[int]) -> None:
        """`visit` each node of `order` not yet `done`, but pass (into `skipped`) one whose gradient, or a reader's,
        is held back (`_defer_weight_gradient`): `visit` takes it once every reader's backward has run, or
        here after the rest, once every held-back gradient is issued."""
        for node in order:
            if node.id in done:
                continue
            if node.id in self.deferred or skipped and any(u.id in skipped and u.id not in done
                                                           for u in self.users.get(node.id, ())):
                skipped.add(node.id)
            else:
                visit(node)
        self.flush_weight_gradients()
        self.flushed = []
        for node in order:
            if node.id in skipped and node.id not in done:
                visit(node)

    def _scatter_microbatch_gradients(self) -> None:
        """ZeRO-2 keeps only its shard of a gradient, so every micro-batch's is reduce-scattered as it ends
        (DeepSpeed's stage 2), not accumulated whole for one reduction in the last (`cost.model`)."""
        for at, replicate in sorted(self.sharded.items()):
            nbytes = _elements(self.stored[at]) * self.item
            self._sync(f"{replicate.label} #{replicate.id} micro-batch reduce-scatter", REDUCE_SCATTER, replicate,
                       nbytes, [len(self.steps) - 1], phase="grad_sync")

    def _accumulated_bytes(self, node: PNode | None = None) -> int:
        """Bytes of the gradients a weight's chain holds across micro-batches (`NodeCost.accumulation_bytes`:
        a gathered weight's whole gradient, until its one reduce-scatter), of `node` or of all."""
        if not self.accumulating:
            return 0
        nodes = [node] if node is not None else [self.by_id[i] for i in self.params]
        return sum(_elements(n) * self.machine.precision_spec.gradient_bytes for n in nodes
                   if n.kind == "parallel" and n.op == parallel_ops.ALL_GATHER and n.id in self.params)

    def end_pass(self) -> None:
        """A micro-batch's values are freed before the next begins (the backend drops its values; a framework
        frees them in backward): over several micro-batches, what is left of this one's is freed here: every
        value where the profile keeps them to the end of the step, else those no backward freed (one that takes
        no gradient, such as a slice of the data a backward reads, whose own backward never runs). Left
        allocated, each micro-batch's would add to the next one's peak (llama-70b on 64 H100s, 16 micro-batches:
        7.3 GiB of its 90.9 GiB simulated peak, benchmarks/search_results.md 2026-12-04 evening, issue 28)."""
        if not self.accumulating:
            return
        held = sum(v for k, v in self.allocated.items() if k not in self.params) + self.loss_bytes
        # after the pass's last task, or, where communication overlaps, its last compute task: nothing that
        # runs on the compute stream waits for this pass's collectives because of it
        last = len(self.steps) - 1 if self.profile.keep_activations else self._last_compute_task()
        if held and last is not None:
            self._add("micro-batch's values freed", self.compute, 0.0, [last], free=held, phase="backward")

    def _buckets(self) -> list[GradientBuckets]:
        """DDP's buckets, one sequence per mesh axis the stored weights are replicated on (DDP's process
        group), each priced on that axis's group; `bucket_of` says which holds each weight."""
        if not self.profile.ddp_buckets:
            return []
        comm = self.machine.comm
        grad_bytes = self.machine.precision_spec.gradient_bytes
        out = []
        for axis, stored, grads in self._axis_gradients():
            group = GroupTopology.of_axis(self.pcg.mesh, axis)
            kind = REDUCE_SCATTER if self.sharded else ALL_REDUCE   # ZeRO: each rank keeps its shard's sum
            buckets = GradientBuckets(self.steps, DEVICE, grads,
                                      lambda nbytes, g=group, k=kind, t=self.times: t.collective(k, g, nbytes),
                                      *comm.bucket_caps(group.size, grad_bytes), stream_name=group.link,
                                      after_backward=not self.profile.overlap_grad_reduce)
            out.append(buckets)
            for at in stored:
                self.bucket_of[at] = (axis, buckets)
        return out

    def _axis_gradients(self) -> list[tuple[int, list[int], list[Gradient]]]:
        """Per mesh axis the stored weights are replicated on (`ir.pcg.state_shardings`: DDP's process group), in
        axis order: (the axis, those weights, their gradients in bucket order: the reverse of the weights')."""
        by_axis: dict[int, list[int]] = {}
        for at, replicate in state_shardings(self.pcg).items():
            by_axis.setdefault(self.by_id[replicate].axis(self.pcg.mesh), []).append(at)
        grad_bytes = self.machine.precision_spec.gradient_bytes
        return [(axis, stored, [Gradient(str(i), _elements(self.stored[i]) * grad_bytes)
                                for i in sorted(stored, reverse=True)])
                for axis, stored in sorted(by_axis.items())]

    def _gather_buckets(self) -> list[tuple[int, list[list[str]], list[int]]]:
        """ZeRO-1/2's all-gathers of the updated shards as DDP-style frameworks run them (Megatron's distributed
        optimizer: its parameter buckets are its gradient buckets): per mesh axis, (the axis, the stored weights'
        names bucket by bucket in forward order, each bucket's parameter bytes), the gradient buckets
        (`assign_buckets`, as `_buckets` makes them) reversed."""
        comm = self.machine.comm
        grad_bytes = self.machine.precision_spec.gradient_bytes
        out = []
        for axis, _stored, grads in self._axis_gradients():
            caps = comm.bucket_caps(self.pcg.mesh.size(axis), grad_bytes)
            buckets = [[g.name for g in b] for b in reversed(assign_buckets(grads, *caps))]
            out.append((axis, buckets, [sum(_elements(self.stored[int(n)]) for n in b) * self.item for b in buckets]))
        return out

    def _param_gathers(self) -> list[ParamGathers]:
        """Under ZeRO-1/2 where the profile overlaps them (`overlap_param_gather`, Megatron-Core's distributed
        optimizer): per mesh axis, the updated shards' all-gathers bucket by bucket (`_gather_buckets`), run during
        the first micro-batch's forward (`schedules.ParamGathers`; the step is a steady-state one) instead of
        after the update. Else none."""
        if self.pcg.zero not in SHARDING_STAGES or not (self.profile.overlap_param_gather and self.profile.overlap):
            return []
        out = []
        for axis, buckets, nbytes in self._gather_buckets():
            group = GroupTopology.of_axis(self.pcg.mesh, axis)
            out.append(ParamGathers(self.steps, DEVICE, buckets, nbytes,
                                    lambda n, g=group, times=self.times: times.collective(ALL_GATHER, g, n),
                                    stream_name=group.link))
        return out

    def _weights_of(self) -> dict[int, frozenset[int]]:
        """Node of a weight's chain -> the stored weights (`stored`) its value is made from."""
        out: dict[int, frozenset[int]] = {}
        for node in self.pcg.nodes:
            if node.id in self.stored:
                out[node.id] = frozenset((node.id,))
            elif node.id in self.params:
                out[node.id] = frozenset().union(*(out.get(i, frozenset()) for i in node.inputs))
        return out

    def _await_parameters(self, node: PNode) -> list[int]:
        """The parameter gathers (`_param_gathers`) a forward task of `node` waits for: those of the weights its
        inputs are made from, launching them (and the next bucket) now if they are not yet."""
        names = [str(w) for i in node.inputs for w in self.weights_of.get(i, ())]
        return [t for gathers in self.gathers for t in gathers.needed(names)] if names else []

    def _give(self, node_id: int, task: int) -> None:
        self.grad_ready.setdefault(node_id, []).append(task)

    def _node_backward(self, node: PNode, deps: list[int], syncs: list[int]) -> int | None:
        ident = node.id
        label = self.backward_labels.get(ident)
        if label is None:
            label = self.backward_labels[ident] = f"{node.label} #{ident} backward"
        held = self.allocated.get(ident, 0)
        # a recomputed value is freed by its backward whatever the profile (torch.utils.checkpoint's does)
        dropped = ident in self.dropped
        free = held if dropped or not self.profile.keep_activations else 0
        if free or dropped:   # what is left of it (`end_pass` frees the rest)
            self.allocated[ident] = 0
        if node.kind == "op":
            return self._compute_backward(node, label, deps, view=self.views.get(ident, held == 0), free=free)
        piece = _elements(node)
        source = node.inputs[0]
        weight = source in self.params      # a weight's value: its gradient's reduction is the gradient sync
        if node.op in (PARTITION, parallel_ops.REDUCE_SCATTER):
            if node.id in self.folded:
                return max(deps)
            nbytes = _elements(self.by_id[source]) * self.item
            pipe = self._pipe(node, backward=True)   # chunks land in the buffer the product's backward reads
            gather = self._sync(f"{label} all-gather", ALL_GATHER, node, nbytes, deps, free=free if pipe else 0,
                                phase="backward_comm", pipe=pipe, backward=True)
            task = gather if pipe else self._add(f"{label} concat", self.compute,
                                                 self._copy_s(_elements(self.by_id[source]), True), [gather],
                                                 free=free, phase="backward")
        elif node.op == COMBINE:
            task = self._add(label, self.compute, self._copy_s(_elements(self.by_id[source]), True), deps,
                                  free=free, phase="backward")
        elif weight and self.syncing and node.id in getattr(self.groups.get(source), "sync", ()):   # FSDP2
            task = max(deps)
            self.group_grads.setdefault(self.groups[source].key, []).append(task)
        elif node.op == parallel_ops.ALL_TO_ALL:   # the gradient moved back to the source's dim
            nbytes = piece * self.item
            pack = self._add(f"{label} pack", self.compute, self._copy_s(piece, True), deps, phase="backward")
            moved = self._sync(f"{label} all-to-all", ALL_TO_ALL, node, nbytes, [pack], phase="backward_comm",
                               backward=True)
            task = self._add(f"{label} unpack", self.compute, self._copy_s(piece, True), [moved], free=free,
                             phase="backward")
        elif node.id in self.rings:   # ring attention's k or v: its gradient came home with the ring's last step
            task = self._add(label, self.compute, 0.0, deps, free=free, phase="backward")
        elif node.op == parallel_ops.ALL_GATHER:   # the gathered gradient cut into blocks and reduce-scattered
            pipe = self._pipe(node, backward=True)   # chunks sent from the buffer the product's backward writes
            cut = deps if pipe else [self._add(f"{label} slices", self.compute, self._copy_s(piece, True), deps,
                                               phase="backward")]
            task = self._sync(f"{label} reduce-scatter", REDUCE_SCATTER, node, piece * self.item, cut,
                              free=free + self._accumulated_bytes(node),
                              phase="grad_sync" if weight else "backward_comm", pipe=pipe, backward=True)
            if weight:
                syncs.append(task)
        elif node.op == REPLICATE:
            nbytes = _elements(self.by_id[source]) * self.item
            bucketed = self.bucket_of.get(source)
            stream = self._reduction_stream(weight, deps)
            if bucketed is not None and bucketed[0] == node.axis(self.pcg.mesh):
                task = self._add(f"{label} (gradient into its bucket)", stream, self.eff.op_time(0.0, True),
                                      deps, free=free, phase="backward")
            elif self.sharded.get(source) is node:   # ZeRO: the gradient reduce-scattered onto the shards
                copy = self._add(f"{label} copy", stream, self._copy_s(piece, True), deps, phase="backward")
                task = self._sync(f"{label} reduce-scatter", REDUCE_SCATTER, node, nbytes, [copy], free=free,
                                  phase="grad_sync")
                syncs.append(task)
            else:
                copy = self._add(f"{label} copy", stream, self._copy_s(piece, True), deps, phase="backward")
                for _ in range(1 if weight else self._style_conversions(node)):
                    task = copy = self._sync(f"{label} all-reduce", ALL_REDUCE, node, nbytes, [copy], free=free,
                                             phase="grad_sync" if weight else "backward_comm")
                if weight:
                    syncs.append(task)
        else:  # reduce: the gradient passes through as a view
            task = self._add(label, self.compute, self.eff.op_time(0.0, True), deps, free=free, phase="backward")
        self._give(source, task)
        return task

    def _style_conversions(self, node: PNode) -> int:
        """How many all-reduces a replicated activation's gradient takes: one, or under torch's styles
        (`style_collectives`) one per module reading it with a weight (each `ColwiseParallel` converts its own
        input, and its backward all-reduces that input's partial gradient; autograd then adds them). A weight
        is read through the values computed from weights alone (a transposed weight)."""
        if not self.profile.style_collectives:
            return 1
        fed = self._weight_fed()
        styled = [u for u in self.users.get(node.id, []) if u.kind == "op" and any(i in fed for i in u.inputs)]
        return max(1, len(styled))

    def _weight_fed(self) -> set[int]:
        """The weights' chains and the values computed from them alone (a transposed weight)."""
        if self.weight_fed is None:
            self.weight_fed = set(self.params)
            for n in self.pcg.nodes:
                if n.kind == "op" and n.inputs and all(i in self.weight_fed for i in n.inputs):
                    self.weight_fed.add(n.id)
        return self.weight_fed

    def _dtensor_s(self, node: PNode, backward: bool) -> float:
        """What running `node` on DTensors adds (`dtensor_modules`): under torch's tensor-parallel styles the
        modules holding weights compute on DTensors, so an operator reading a weight pays DTensor's dispatch;
        without a tensor axis FSDP2 hands the modules plain tensors and nothing is added."""
        if not self.profile.dtensor_modules or not self.tensor_axes or self._dtensor_counted:
            return 0.0
        if not any(i in self._weight_fed() and i not in self.gathered_values for i in node.inputs):
            return 0.0
        return self.eff.dtensor_time(backward)

    # ---------------------------------------------------------------- FSDP2 groups (`cost.fsdp_groups`)
    def _group_gather(self, group: ParamGroup, node: PNode, deps: list[int], phase: str) -> int:
        """A sharded group gathered: its shards copied into one buffer, one all-gather, the whole copied out
        into the parameters (FSDP2's all_gather_copy_in, all_gather, split_with_sizes_copy); its hooks' own host
        time (`OpEfficiency.fsdp_hooks_time`) before forward and again before backward, where it was resharded:
        the same unshard either way."""
        pieces, whole = group_elements(group, self.by_id)
        backward = phase == "backward"
        hooks = self.eff.fsdp_hooks_time(len(group.members))
        copy = self._add(f"group {group.key} copy in", self.compute, self._copy_s(pieces, backward) + hooks, deps,
                         phase=phase)
        gather = self._sync(f"group {group.key} all-gather", ALL_GATHER, node, whole * self.item, [copy],
                            alloc=whole * self.item, phase=f"{phase}_comm", fsdp=True)
        return self._add(f"group {group.key} copy out", self.compute, self._copy_s(whole, backward), [gather],
                         phase=phase)

    def _module_calls(self, after: Sequence[int] = (), backward: bool = False) -> None:
        """The user's module's own calls beyond the graph's nodes, each one dispatch, at the start of its forward
        (or, `backward`, its autograd nodes beyond the graph's, at the start of backward): the views, casts and
        mask building the importer folded away (`ir.module_calls`); in forward also its own Python between calls
        (`ModuleCalls.python_forward` instructions, `OpEfficiency.python_instruction_s` each); none unless the
        profile runs a module."""
        extra = self._module_extra[backward]
        if extra:
            seconds = extra * self.eff.op_time(0.0, backward)   # dispatch each, in a step (`sequence_factor`)
            self._add(f"the module's own {'autograd nodes' if backward else 'calls'} beyond its graph "
                      f"({extra:.0f})", self.compute, seconds, list(after), phase="backward" if backward else "forward")
        python = 0.0 if backward or self.profile.module_calls is None else \
            self.profile.module_calls.python_instructions(self._compute_nodes)
        if python and self.eff.python_instruction_s:
            self._add(f"the module's own Python ({python:.0f} bytecode instructions)", self.compute,
                      python * self.eff.python_instruction_s, list(after), phase="forward")
        if self._dtensor_counted:
            calls = self.profile.module_calls.dtensor_calls(self._compute_nodes, backward)
            self._add(f"the module's {'backward ' if backward else ''}calls on DTensors ({calls:.0f})", self.compute,
                      calls * self.eff.dtensor_time(backward), list(after), phase="backward" if backward else "forward")

    @cached_property
    def _compute_nodes(self) -> int:
        return sum(1 for n in self.pcg.nodes if n.kind == "op")

    @cached_property
    def _dtensor_counted(self) -> bool:
        """Whether DTensor's dispatch is priced per call the module makes on DTensors (`ir.module_calls`: every
        call inside a module holding parameters, forward and in its backward, under a tensor axis) rather than
        once per graph node reading a weight (`_dtensor_s`): the module's calls were counted."""
        calls = self.profile.module_calls
        return (self.profile.dtensor_modules and bool(self.tensor_axes) and calls is not None
                and calls.dtensor_forward + calls.dtensor_backward > 0)

    @cached_property
    def _module_extra(self) -> tuple[float, float]:
        """(forward calls, autograd nodes) the module makes beyond this PCG's compute nodes (`_module_calls`):
        the same every pass, so counted once per step."""
        calls = self.profile.module_calls
        if calls is None:
            return 0.0, 0.0
        ops = [n for n in self.pcg.nodes if n.kind == "op"]
        return calls.extra_forward(len(ops)), calls.extra_backward(len(ops), sum(self.needs_grad[n.id] for n in ops))

    def _replicated_hooks(self) -> None:
        """FSDP2's pre-forward hooks of each replicated group (`replicate` on the root), which run as the
        module's forward starts, every pass: host time per parameter (`OpEfficiency.fsdp_hooks_time`; 0 unless
        calibrated). A sharded group pays its own where it is gathered (`_group_gather`)."""
        for group in {g.key: g for g in self.groups.values() if not g.sharded}.values():
            seconds = self.eff.fsdp_hooks_time(len(group.members))
            if seconds:
                self._add(f"group {group.key} FSDP2 pre-forward hooks", self.compute, seconds, [], phase="forward")

    def _group_syncs(self) -> list[int]:
        """Each group's gradients synchronised once backward has made them all, in the order backward finished
        the groups: a sharded group gathered again where FSDP2 freed it after forward, its gradients copied into
        one buffer and reduce-scattered; a replicated group's all-reduced and copied back. Collectives block
        the host here (`TORCH_NATIVE`), so issuing them as each group ends would take the same time."""
        tasks = []
        groups = {g.key: g for g in self.groups.values()}
        for key, grads in sorted(self.group_grads.items(), key=lambda kv: max(kv[1])):
            group = groups[key]
            node = self.by_id[group.sync[0]]
            pieces, whole = group_elements(group, self.by_id)
            deps = [max(grads)]
            if group.reshard:
                deps = [self._group_gather(group, node, deps, "backward")]
            hooks = self.eff.fsdp_hooks_time(len(group.members), backward=True)   # its post-backward hooks' own
            copy = self._add(f"group {key} gradients copied in", self.compute, self._copy_s(whole, True) + hooks,
                             deps, phase="backward")
            kind = REDUCE_SCATTER if group.sharded else ALL_REDUCE
            task = self._sync(f"group {key} {kind.replace('_', '-')}", kind, node, whole * self.item, [copy],
                              free=whole * self.item if group.sharded else 0, phase="grad_sync", fsdp=True)
            if not group.sharded:
                task = self._add(f"group {key} gradients copied out", self.compute, self._copy_s(pieces, True),
                                 [task], phase="backward")
            tasks.append(task)
        self.group_grads = {}
        return tasks

    def _through_reduction(self, task: int) -> bool:
        """Whether a stored weight's gradient, ready at `task`, came through another axis's reduction (a weight
        replicated on two axes, `_reduction_stream`). Its bucket is then launched when backward is done, as
        Megatron all-reduces sequence-parallel norms' gradients over tp after backward (finalize_model_grads):
        launched at once it would wait on that reduction and hold its own link's stream, where backward's
        tensor-parallel collectives queue behind it."""
        return self.profile.overlap and self.steps.stream_of[task] != self.compute

    def _reduction_stream(self, weight: bool, deps: Sequence[int]) -> int:
        """The stream of a weight's gradient handed on along its chain (`weight`: the replicate reads a value
        of a weight's chain): where its gradient comes from another reduction (a weight replicated on two
        axes: its gradient all-reduced over one, then bucketed over the other), the hand-on waits on that
        reduction's stream, as a framework's gradient hooks and NCCL's streams do; on the compute stream it
        would hold every later backward kernel until the reduction ends, which nothing there waits for.
        Otherwise the compute stream."""
        if weight and self.profile.overlap:
            comm = [d for d in deps if d is not None and self.steps.stream_of[d] != self.compute]
            if comm:
                return self.steps.stream_of[max(comm)]
        return self.compute

    def _regather(self, node: PNode, deps: Sequence[int]) -> int:
        """A regathered value's all-gather in backward (`regathered`), issued once a pass, when the first of its
        readers' backward may start (`deps`): into a buffer its gather's backward frees."""
        task = self.regathers.get(node.id)
        if task is None:
            nbytes = _elements(node) * self.item
            alloc = 0 if self.allocated.get(node.id) else nbytes   # recomputed in backward: it is there
            if alloc:
                self.allocated[node.id] = nbytes
            task = self.regathers[node.id] = self._sync(f"{node.label} #{node.id} all-gather again for backward",
                                                        ALL_GATHER, node, nbytes, list(deps), alloc=alloc,
                                                        phase="backward_comm")
        return task

    def _compute_backward(self, node: PNode, label: str, deps: list[int], view: bool, free: int) -> int:
        """A compute node's backward: one kernel per input needing a gradient (`OpTime.backward_kernel_s`), each
        input handed the task; a product pipelined with a collective runs it in chunks (`Pipeline`). One reading
        a regathered value (`regathered`) waits for its second all-gather (`_split_backward`)."""
        known = self.backward_known.get((node.id, view))
        # worked out in an earlier micro-batch, or a simulation without tensor-parallel overlap (`task_facts`),
        # unpipelined: a product this one pipelines is worked out below
        if known is not None and (view or self._pipe(node, backward=True) is None):
            grads, again, seconds = known
            if not again or view:
                task = self._add(label, self.compute, seconds, deps, free=free, phase="backward")
                ready = self.grad_ready   # `_give`, per input (the pass's most common backward)
                for i in grads:
                    ready.setdefault(i, []).append(task)
                return task
        timed = self.timed[node.id]
        grads, positions, again = [], [], []   # the inputs needing a gradient, their positions; the regathered'
        needs_grad, regathered = self.needs_grad, self.regathered
        for p, i in enumerate(node.inputs):
            if needs_grad[i]:
                grads.append(i)
                positions.append(p)
            if i in regathered:
                again.append(p)
        if again and not view:
            gathers = sorted({self._regather(self.by_id[node.inputs[p]], deps) for p in again})
            if node.op in PRODUCTS and self.profile.overlap:
                return self._split_backward(node, label, deps, gathers, again, free)
            deps = list(deps) + gathers
        kernel = 0.0 if view else timed.backward_kernel_s(positions)
        whole = self.eff.op_time(kernel, backward=True)
        pipe = None if view else self._pipe(node, backward=True)
        if node.id in self.rings:
            task = self._ring(node, kernel, True, list(deps), free=free)
        elif pipe is None:
            seconds = whole + self._dtensor_s(node, True)
            self.backward_known[(node.id, view)] = (grads, again, seconds)
            task = self._add(label, self.compute, seconds, deps, free=free, phase="backward")
        else:
            chunk = self._chunk(timed, pipe).backward_kernel_s(positions)
            parts = [self.eff.op_time(chunk, backward=True)] * pipe.parts
            task = self._piped(pipe, True, True, label, self.compute, parts, whole, list(deps), 0, free, "backward")
        for i in grads:
            self._give(i, task)
        return task

    def _split_backward(self, node: PNode, label: str, deps: list[int], gathers: list[int], again: list[int],
                        free: int) -> int:
        """A product reading regathered values (at positions `again`) as Megatron-LM runs its backward: the
        gradients of those operands (the input gradient, which reads the weight) first, beside their all-gathers
        (`gathers`, launched asynchronously before it), pipelined with their reduce-scatter where the product is
        (`Pipeline`); then the other operands' (the weight gradient, which reads the gathered values), after
        the all-gathers and after every other product reading the same value has run its input gradient
        (`_defer_weight_gradient`). The simulator's streams decide how much of the all-gather they hide. Runs on
        any profile that overlaps communication: Megatron-LM issues this all-gather asynchronously whether or not
        it pipelines collectives with GEMMs (`tp_comm_overlap`)."""
        timed = self.timed[node.id]
        first = [p for p, i in enumerate(node.inputs) if self.needs_grad[i] and p in again]
        second = [p for p, i in enumerate(node.inputs) if self.needs_grad[i] and p not in again]
        task = None
        if first:
            whole = self.eff.op_time(timed.backward_kernel_s(first), backward=True)
            pipe = self._pipe(node, backward=True)
            if pipe is None:
                task = self._add(f"{label} (input gradient)", self.compute, whole, deps,
                                 free=0 if second else free, phase="backward")
            else:
                parts = [self.eff.op_time(self._chunk(timed, pipe).backward_kernel_s(first), backward=True)]
                task = self._piped(pipe, True, True, f"{label} (input gradient)", self.compute,
                                   parts * pipe.parts, whole, list(deps), 0, 0 if second else free, "backward")
            for p in first:
                self._give(node.inputs[p], task)
        if second or task is None:
            seconds = self.eff.op_time(timed.backward_kernel_s(second), backward=True) if second else 0.0
            after = ([task] if task is not None else list(deps)) + gathers
            job = (node, f"{label} (weight gradient)", seconds, after, tuple(second), free)
            if task is not None and second:
                self._defer_weight_gradient(node.inputs[again[0]], job)
                return task
            task = self._weight_gradient(job)
        self._readers_done(node.inputs[again[0]])
        return task

    def _defer_weight_gradient(self, value: int, job: tuple) -> None:
        """Hold back a product's weight gradient (`job`, `_weight_gradient`'s) until every product reading the
        regathered `value` has issued its input gradient: they then all run beside the all-gather, as
        Megatron-Core's fused QKV GEMM (`linear_qkv`: q, k and v are one product there, whose input gradient
        is the three together) runs them before its one weight gradient, and not only the first reader's
        input gradient (docs/COSTMODEL.md "The backward re-gather")."""
        self.held_back.setdefault(value, []).append(job)
        self.deferred.update(job[0].inputs[p] for p in job[4])
        self._readers_done(value)

    def _readers_done(self, value: int) -> None:
        """One more split reader of `value` has run its input gradient: where it is the last, the weight
        gradients held back for it are issued (`flush_weight_gradients`)."""
        if value in self.split_left:
            self.split_left[value] -= 1
            if self.split_left[value] <= 0:
                self.flush_weight_gradients(value)

    def flush_weight_gradients(self, value: int | None = None) -> None:
        """Issue the weight gradients held back for `value` (every value's where None: a reader no gradient
        reached, at the regathered value's own backward or the end of backward)."""
        for key in [value] if value is not None else sorted(self.held_back):
            for job in self.held_back.pop(key, []):
                self._weight_gradient(job)

    def _take_flushed(self) -> list[int]:
        """The inputs whose held-back gradient was issued since last asked (`_weight_gradient`)."""
        taken, self.flushed = self.flushed, []
        return taken

    def _weight_gradient(self, job: tuple) -> int:
        """A split product's second part (`_split_backward`): the gradients of its operands at `second`."""
        node, name, seconds, after, second, free = job
        task = self._add(name, self.compute, seconds, after, free=free, phase="backward")
        for p in second:
            self._give(node.inputs[p], task)
            if node.inputs[p] in self.deferred:
                self.deferred.discard(node.inputs[p])
                self.flushed.append(node.inputs[p])
        return task

    # ---------------------------------------------------------------- optimizer
    def _degree(self, at: int) -> int:
        """How many shards a stored weight's state is in: its replicate's devices under ZeRO, else 1."""
        replicate = self.sharded.get(at)
        return self.pcg.mesh.size(replicate.axis(self.pcg.mesh)) if replicate is not None else 1

    def optimizer(self, after: list[int], produced: Mapping[int, int]) -> None:
        """The update, on each rank's shard of a weight whose state ZeRO shards; then those weights gathered."""
        updates = []
        for name, at, seconds in self._updates():
            deps = list(after) + (list(produced.values()) if at is None else [produced[at]] if at in produced else [])
            updates.append(self._add(name, self.compute, seconds, deps, phase="optimizer"))
        if self.profile.transient_gradients:   # zero_grad(set_to_none=True)
            self._add("zero_grad", self.compute, 0.0, [len(self.steps) - 1], free=self.gradient_bytes(),
                      phase="optimizer")
        if self.gathers:   # gathered during the next step's forward (`_param_gathers`)
            return
        if self.profile.ddp_buckets and self.sharded:   # ZeRO: the updated shards gathered bucket by bucket
            for _axis, buckets, nbytes in self._gather_buckets():
                for bucket, size in zip(buckets, nbytes):
                    replicate = self.sharded[int(bucket[0])]
                    self._sync(f"all-gather of the updated weights, {len(bucket)} of them", ALL_GATHER, replicate,
                               size, [max(updates)], phase="grad_sync")
            return
        for at, replicate in sorted(self.sharded.items()):   # ZeRO: each updated shard gathered into its weight
            self._sync(f"{replicate.label} #{replicate.id} all-gather of the updated weight", ALL_GATHER, replicate,
                       _elements(self.stored[at]) * self.item, [max(updates)], phase="grad_sync")

    def _updates(self) -> list[tuple[str, int | None, float]]:
        """The optimizer's tasks: (name, the stored-at node it updates, None for all, seconds). One multi-tensor
        update over every piece (torch's foreach/fused Adam), or a few operators per stored weight."""
        if self.profile.fused_optimizer:
            elements = sum(_elements(n) / self._degree(at) for at, n in self.stored.items())
            nbytes = elements * self.machine.precision_spec.optimizer_traffic_bytes(self.profile.optimizer)
            return [("optimizer update (fused)", None, memory_op_time(nbytes, self.machine))]
        return [(f"update {node.op if node.kind == 'leaf' else '#' + str(at)}", at,
                 update_time(self.profile.optimizer, _elements(node) / self._degree(at), self.item, self.machine))
                for at, node in self.stored.items()]

    # ---------------------------------------------------------------- a lower bound
    def floor(self, microbatches: int, plan: bool = True, shared: bool = False) -> float:
        """A lower bound of the step this builder's simulation gives over `microbatches` micro-batches, without
        making a task (`step_floor`).

        Why: the compute stream runs its tasks one at a time, in order, so the step (the last end of any task) is
        at least the sum of that stream's durations; this sums tasks that every simulation puts there, each at
        no more than the simulator makes it, with `op_time` and the copies never shorter for a longer kernel or
        more bytes. Every micro-batch runs, besides the weights' chains (left out): each node's forward
        (`_node_floor`), each output's objective and its backward (`_loss_s`), and the backward of each node a
        gradient reaches (`_gradient_reached`), and, recomputing, each recomputed block's forward again (every
        micro-batch's backward visits a node of each block, `_recompute`). The step ends with the optimizer's
        updates (`_updates`). Collectives and waits only add tasks. Less `FLOOR_SLACK` for the order of
        floating-point sums. Without the `plan`'s own part (the updates, which the ZeRO stage shards, and the
        recomputation) it is a floor of every ZeRO stage and recomputation of the layout.

        `shared` (`step_floor`: this builder's topology is `mesh_groups(pcg)`): the micro-batch's part is kept in
        the PCG's `derived` facts, by machine and profile and for this compute-time cache, and read from there:
        a layout's forms with another ZeRO stage or recomputation share those facts (`ir.pcg.restated`:
        the same nodes, outputs and mesh), and the part reads nothing else of a PCG, nor anything a form differs
        in (the ZeRO stage reaches only `_updates`, the recomputation only `checkpoints`; every helper it calls
        reads the nodes, the readers, the weights' chains and storage, the pipelines, the derived gradients and
        re-gathers, the machine, the profile and the compute times), so the grid's layout floor and its points'
        floors work it out once between them: the same sum, in the same order, so the same float."""
        per_pass, again = self.pcg.derive(("floor_pass", self.machine, self.profile), self.times, self._pass_floor) \
            if shared else self._pass_floor()
        if plan:
            per_pass += sum(again.get(i, 0.0) for c in self.checkpoints.values() for i in c.runs)
        total = microbatches * per_pass + (sum(seconds for _name, _at, seconds in self._updates()) if plan else 0.0)
        return total * (1.0 - FLOOR_SLACK)

    def _pass_floor(self) -> tuple[float, dict[int, float]]:
        """`floor`'s part for one micro-batch's forward and backward (the objective's included), and each node's
        forward as recomputation runs it again."""
        reached = self._gradient_reached()
        fused = {i for pipe in self.pipes.values() for i in pipe.siblings}   # counted with their product
        per_pass = sum(self._loss_s(self.by_id[o]) + self._loss_s(self.by_id[o], True) for o in self.pcg.outputs)
        again: dict[int, float] = {}   # node -> its forward run again by recomputation
        for node in self.pcg.nodes:
            if node.id in self.params or node.kind == "leaf":
                continue
            forward, backward, again[node.id] = self._node_floor(node, fused, reached)
            per_pass += forward + (backward if node.id in reached else 0.0)
        return per_pass, again

    def _gradient_reached(self) -> set[int]:
        """The nodes whose backward every micro-batch runs (`backward`'s `visit`: a node that needs a gradient,
        `needs_gradient`, and was handed one): each output that needs one (the loss's backward hands every
        output one), and each input needing one of such a node (a compute node's backward hands one to each
        such input, `_compute_backward`; a parallel node's to its source, `_node_backward`, which needs one
        where the parallel node does). Not every node an output is computed from: an input read only through
        the gradient-free operand of a node that needs no gradient (a mixture's routing) is handed none."""
        grads = self.needs_grad
        reached = {o for o in self.pcg.outputs if grads[o]}
        for node in reversed(self.pcg.nodes):
            if node.id in reached:
                reached.update(i for i in node.inputs if grads[i])
        return reached

    def _node_floor(self, node: PNode, fused: set[int], reached: set[int]) -> tuple[float, float, float]:
        """The least a node (not of a weight's chain) keeps the compute stream busy in a micro-batch's forward, in
        its backward, and in its forward run again by recomputation. A compute node: its kernel
        (`_compute_forward`; an operator that may run as a view, only its dispatch), and its backward kernels
        (`_piped_floor`). A parallel node its copies (`_parallel_forward`, `_node_backward`): a partition a
        slice (a view at least), a combine or all-gather its concatenation, a reduce-scatter its slices, a
        reduce its copy; backward a partition's, reduce-scatter's or combine's concatenation or slice of the
        input, an all-gather's slices, a replicate's copy (a weight's gradient, bucketed or sharded, is a
        chain's, left out); none of these copies where the collective is pipelined with its product
        (`Pipeline`: the chunks land in, or are sent from, the product's buffer); a partition on a weight's
        storage chain (`folded`) runs nothing. `fused`: the pipelines' sibling products; `reached`: the nodes
        whose backward runs (`_gradient_reached`)."""
        eff = self.eff
        if node.id in self.generated:   # the causal ring's mask, made inside its kernel
            return 0.0, 0.0, 0.0
        if node.kind == "op":
            if node.op in VIEW_OPS or node.op == "flatten" or node.piece_size == 0:
                return eff.op_time(0.0), eff.op_time(0.0, backward=True), eff.op_time(0.0)
            return self._piped_floor(node, node.id in fused, reached)
        if node.id in self.folded or node.id in self.rings:   # a ring's gathers issue nothing (`_ring`)
            return 0.0, 0.0, 0.0
        piece, source = _elements(node), _elements(self.by_id[node.inputs[0]])
        floors = {PARTITION: (eff.op_time(0.0), self._copy_s(source, True)),
                  COMBINE: (self._copy_s(piece), self._copy_s(source, True)),
                  parallel_ops.ALL_GATHER: (self._copy_s(piece), self._copy_s(piece, True)),
                  parallel_ops.REDUCE_SCATTER: (self._copy_s(source), self._copy_s(source, True)),
                  REPLICATE: (eff.op_time(0.0), self._copy_s(piece, True)),
                  REDUCE: (self._copy_s(piece), eff.op_time(0.0, True)),
                  parallel_ops.ALL_TO_ALL: (2 * self._copy_s(piece), 2 * self._copy_s(piece, True))}.get(node.op)
        if floors is None:
            raise TaskBuildError(f"unknown parallel operator '{node.op}'")   # as the simulation would
        forward, backward = floors
        if node.op in (COMBINE, parallel_ops.ALL_GATHER, parallel_ops.REDUCE_SCATTER) and self._pipe(node, False):
            forward = 0.0
        if node.op in (PARTITION, parallel_ops.ALL_GATHER, parallel_ops.REDUCE_SCATTER) and self._pipe(node, True):
            backward = 0.0
        return forward, backward, forward

    def _piped_floor(self, node: PNode, sibling: bool, reached: set[int]) -> tuple[float, float, float]:
        """A compute node's forward, backward (`_backward_floor`) and recomputed forward floor (`_node_floor`).

        A product pipelined with a collective (`Pipeline`) runs in forward fused with the siblings whose inputs
        are issued (the rest then run alone, whole), as `parts` chunk tasks of their thinner slices, or as one
        whole task where it does not wait for the collective's chunks (`_piped`): each product i of the group
        takes at least min(k_i, parts x c_i) of kernel (k its whole kernel, c a chunk's, `chunk_time`), and,
        `op_time` being monotone and subadditive (max(dispatch, k) or dispatch + k), the group at least
        `op_time` of their sum, counted on the product; a fused `sibling` issues no task of its own: 0.

        Where the product surely runs in chunks, each chunk task is at least `op_time(c)` (monotone: the
        siblings' slices and the saved copy only add to it), so at least `parts x op_time(c)`. That is so in
        every micro-batch's forward (its first pass over the nodes): a product that runs first
        (`Pipeline.product_first`: a reduce-scatter's) always runs in chunks (`_piped`), and one that runs
        second (an all-gather's, whose first reader it is) runs after its collective's forward, which
        `_gather_forward` issues as chunks (the collective is never a weight's chain: `_pipeline_of`) and makes
        its value's ready task the last chunk, which `_compute_forward` puts in the product's dependencies:
        `_piped` finds it there and runs the chunks. Not so in recomputation: a product recomputed without its
        collective runs whole, so there it is the lesser of `op_time(k)` and `parts x op_time(c)`, unless it
        runs first."""
        eff = self.eff
        timed = self.timed.get(node.id)
        if timed is None:
            timed = self.timed[node.id] = self.times(node, [self.by_id[i] for i in node.inputs])
        if sibling:
            return 0.0, self._backward_floor(node, timed, reached), 0.0
        forward = again = eff.op_time(timed.kernel_s)
        pipe = self._pipe(node, backward=False)
        if pipe is not None and pipe.product == node.id and timed.kernel_s > 0:   # 0: a whole task (`_compute_forward`)
            group = [timed] + [self.times(s, [self.by_id[i] for i in s.inputs])
                               for s in (self.by_id[i] for i in pipe.siblings)]
            forward = again = eff.op_time(sum(min(t.kernel_s, pipe.parts * self._chunk(t, pipe).kernel_s)
                                              for t in group))
            chunks = pipe.parts * eff.op_time(self._chunk(timed, pipe).kernel_s)
            forward = max(forward, chunks)
            again = forward if pipe.product_first(False) else max(again, min(eff.op_time(timed.kernel_s), chunks))
        return forward, self._backward_floor(node, timed, reached), again

    def _backward_floor(self, node: PNode, timed: OpTime, reached: set[int]) -> float:
        """A compute node's backward floor (`_compute_backward`): one task of a kernel per input needing a gradient
        (`OpTime.backward_kernel_s`: a value recomputation dropped is computed again before its backward, so
        only a view runs none).

        A product pipelined with a collective in backward runs that task as `parts` chunks, each `op_time(c)`
        of the chunk's kernels, or whole (`_piped`); reading regathered values (`regathered`) as two
        (`_split_backward`): the gradients of the regathered operands so, then the others' whole. Each side
        at least the lesser of the two, and the chunks where they surely run: where the product runs first
        (an all-gather's product: `_piped` always chunks the first side), or where its collective's backward
        runs in every micro-batch (`_gradient_reached`): a reduce-scatter's or partition's, whose input the
        product is, so visited before it (backward walks the nodes in reverse), issues its all-gather's chunks
        first (`_node_backward`) and hands the product its last chunk as its gradient, which is among the
        dependencies `_compute_backward` and `_split_backward` give `_piped`."""
        eff = self.eff
        needing = [p for p, i in enumerate(node.inputs) if self.needs_grad[i]]
        pipe = self._pipe(node, backward=True)
        if pipe is None or pipe.product != node.id:
            return eff.op_time(timed.backward_kernel_s(needing), backward=True)
        chunk = self._chunk(timed, pipe)
        sure = pipe.product_first(True) or pipe.collective in reached

        def piped(side: list[int]) -> float:
            chunks = pipe.parts * eff.op_time(chunk.backward_kernel_s(side), backward=True)
            return chunks if sure else min(eff.op_time(timed.backward_kernel_s(side), backward=True), chunks)
        gathered = {p for p, i in enumerate(node.inputs) if i in self.regathered}
        if not gathered:
            return piped(needing)
        first, second = [p for p in needing if p in gathered], [p for p in needing if p not in gathered]
        return (piped(first) if first else 0.0) + \
            (eff.op_time(timed.backward_kernel_s(second), backward=True) if second else 0.0)

    def memory_floor(self, microbatches: int) -> int:
        """A lower bound of the peak memory this builder's simulation gives over `microbatches` micro-batches,
        without making a task (`peak_floor`): what the device surely holds at one instant, the start of the last
        micro-batch's first backward task (its loss's backward, on the compute stream).

        Why it is one: the simulated peak is the largest running sum of the memory events, `resident` included
        (`StepBuilder._peaks`), so it is at least the level at that instant t. The compute stream runs its tasks
        in the order they were added, so a compute task added before the loss's backward started (and allocated)
        at or before t, and one added after it starts, and frees, at or after t (a zero-length task's free
        after the allocations of its instant). Every byte counted here is allocated by a task that started by t
        and freed only by a task that starts after it or never:

        * `resident()`: the level's start, held the whole step;
        * each output's loss (`loss`: a compute task of forward, freed by `end_pass` after the backward);
        * with `seeded_inputs`, each data leaf's whole tensor (`_leaf`: the pass's first tasks, freed by
          `end_pass`);
        * the output of each compute node the last micro-batch's forward runs (not a weight's chain's), on the
          compute stream (`_compute_forward`, `_piped`'s first chunk), counted only where it surely allocates
          (its operator never runs as a view: not in `VIEW_OPS`, not `flatten`), without what it saves beside
          (`_saved_extra`), and only where forward never frees it: not `released` (`_release`) unless a
          recomputed block keeps it (a block's output, which the next block's recomputation starts from:
          `_release` leaves it), not dropped by its block's recomputation (`_drop`). Its own backward, or
          `end_pass`, frees it after t;
        * without FSDP2's groups, each weight's gathered copy (a `combine` or `all_gather` of a weight's chain,
          `_gather_forward`, made by the first micro-batch and kept to its backward in the last): its all-gather
          starts before the forward task that reads it, and its concatenation, on the compute stream, frees only
          the gathered pieces it copies;
        * over several micro-batches, the gathered weights' gradients accumulated across them (`_accumulated_bytes`,
          allocated in the first micro-batch's backward, freed by the last one's reduce-scatters).

        Everything else the simulation allocates adds to the level, and what it frees by t was allocated before
        it (every free returns bytes a task allocated: a buffer, a value, a gathered copy), so leaving both out
        leaves the level no lower than this sum. It reads the builder's own facts (`resident`, `released`,
        `dropped`, `params`, `_accumulated_bytes`), so it follows the simulator as it changes; tests check it
        against simulated peaks (tests/test_memory_floor.py)."""
        item, by_id = self.item, self.by_id
        held = self.resident() + sum(_elements(by_id[o]) for o in self.pcg.outputs) * item
        if self.profile.seeded_inputs:
            held += sum(_full(n) for n in self.pcg.nodes if n.kind == "leaf" and n.role != "weight") * item
        # freed in forward: the released values (`_release`) but those a recomputed block keeps, and the values
        # recomputation drops (`_drop`)
        kept = {i for i in self.released if i in self.block_of_run and i not in self.dropped}
        skipped = (self.released - kept) | self.dropped
        for node in self.pcg.nodes:
            if node.id in self.params:
                gathered = node.kind == "parallel" and node.op in (COMBINE, parallel_ops.ALL_GATHER)
                if gathered and not self.groups:
                    held += _elements(node) * item
            elif node.kind == "op" and node.id not in skipped and node.op not in VIEW_OPS and node.op != "flatten":
                held += _elements(node) * item
        if microbatches > 1:
            self.accumulating = True
            held += self._accumulated_bytes()
        return held

    def resident(self) -> int:
        """Weights, their gradients and the optimizer state on the device for the whole step (bytes per
        parameter of the machine's precision and the profile's optimizer, `ir.precision`; a weight whose state
        ZeRO shards holds its share, `ParameterBytes.sharded`)."""
        held = self.machine.precision_spec.parameter_bytes(self.profile.optimizer)
        if self.profile.transient_gradients:
            held = replace(held, gradient=0)
        return int(sum(_elements(n) * held.sharded(self.pcg.zero, self._degree(at)) for at, n in self.stored.items()))

    def gradient_bytes(self) -> int:
        """The stored weights' gradients on the device (a ZeRO-3 weight's: its shard's, after the reduce-scatter)."""
        return sum(_elements(n) for n in self.stored.values()) * self.machine.precision_spec.gradient_bytes


def simulate_pcg(pcg: PCG, library: Library, machine: Machine, profile: ExecutionProfile = PARSAT_RUN,
                 topology: Topology | None = None, times: OpTimes | None = None,
                 microbatches: int = 1, repeat: bool = True) -> StepPrediction:
    """One training step of `pcg` on `machine` as `profile` runs it, simulated (see the module docstring).

    `topology` gives each parallel operator's group (default: one group of
    the mesh axis it acts on, `mesh_groups`); `times` a cache of compute
    nodes' times to share between calls for the same machine. With
    `microbatches` m (`Graph.microbatches`: `pcg` is one micro-batch's) the
    step is m forward and backward passes, the gradient synchronisation in
    the last one only, then one optimizer update. The middle micro-batches are alike: once one is known to
    repeat the one before (`_Builder.template`), the rest are its tasks copied (`repeat=False` builds each
    anew, the same tasks: what the tests compare).
    """
    if times is not None and times.machine != machine:
        raise TaskBuildError("the compute-time cache was made for another machine")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise TaskBuildError(f"micro-batches must be a positive integer, got {microbatches!r}")
    builder = _Builder(pcg, machine, profile, topology, times or OpTimes(library, machine))
    template = None
    for k in range(microbatches):
        first, syncing = k == 0, k == microbatches - 1
        if template is not None and not syncing and repeat:
            builder.repeat(template)
            continue
        start, lag, collectives = len(builder.steps), builder.since_sync, builder.collectives
        builder.new_pass(first=first, syncing=syncing, accumulating=microbatches > 1)
        builder.forward()
        loss = builder.loss()
        end_of_forward = len(builder.steps) - 1 if len(builder.steps) else None
        syncs, produced = builder.backward(loss)
        end_of_backward = len(builder.steps) - 1 if len(builder.steps) else None
        builder.end_pass()
        if not first and not syncing:
            template = builder.template(start, lag, collectives)
    builder.optimizer(syncs, produced)
    builder.finish()
    resident = builder.resident()
    return StepPrediction(builder.steps.simulate({DEVICE: resident}, last=True), resident, end_of_forward,
                          end_of_backward, bool(builder.pipes))


FLOOR_SLACK = 1e-9   # relative: the floor's sum and the simulator's chain of ends round in different orders


def step_floor(pcg: PCG, machine: Machine, times: OpTimes, microbatches: int = 1,
               profile: ExecutionProfile | None = None, plan: bool = True) -> float:
    """A lower bound of the step `simulate_pcg` gives `pcg` over `microbatches` micro-batches as `profile` (the
    machine's, `profile_for`) runs it, at a small part of its cost: what lets a search skip simulating a
    candidate that cannot be the fastest (`search.mesh.CandidateSteps.fastest`). `times` is the simulation's
    own cache of compute times. Why it is one: `_Builder.floor`. Without the `plan`'s own part (the
    optimizer's updates, which the ZeRO stage shards, and the recomputed forwards) it reads nothing the
    plan's ZeRO stage or recomputation changes: a bound for every ZeRO stage and recomputation of `pcg`'s
    layout."""
    profile = profile or profile_for(machine)
    return _Builder(pcg, machine, profile, None, times).floor(microbatches, plan, shared=True)


def peak_floor(pcg: PCG, machine: Machine, times: OpTimes, microbatches: int = 1,
               profile: ExecutionProfile | None = None) -> int:
    """A lower bound of the peak memory per device `simulate_pcg` gives `pcg` over `microbatches` micro-batches as
    `profile` (the machine's, `profile_for`) runs it, without making a task: what lets a search refuse a
    candidate that cannot fit without simulating it (`search.mesh.CandidateSteps`, `refusing`). Why it is one:
    `_Builder.memory_floor`. Unlike the per-node bound (`ir.costs.Totals.peak_memory_bytes`), which may lie above
    the simulated peak or far below it, this is never above it."""
    profile = profile or profile_for(machine)
    return _Builder(pcg, machine, profile, None, times).memory_floor(microbatches)


__all__ = ["DDP", "ExecutionProfile", "FLOOR_SLACK", "OpTimes", "PARSAT_RUN", "StepPrediction", "TORCH_NATIVE",
           "TaskBuildError", "collective_pipelines",
           "VIEW_OPS", "mesh_groups", "needs_gradient", "peak_floor", "profile_for", "simulate_pcg", "step_floor"]
