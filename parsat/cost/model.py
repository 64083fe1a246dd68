"""The cost model: per-iteration training time, communication and memory of a PCG node.

Conventions (docs/plan-schema.md repeats them):

* Time of a training step = forward + backward + optimizer update, summed
  over nodes (no overlap of compute and communication is assumed).
* Compute runs on local pieces (SPMD). FLOPs and bytes follow from the
  operator's index semantics (`dsl.work.work`); the local share divides the global
  work by the degrees spread inference (`dsl.spread.infer_compute`) gives
  every index variable. Time is the roofline max(FLOPs/peak, bytes/bandwidth)
  with the machine's GEMM and bandwidth efficiency and a dispatch cost per
  call (`op_time`). Backward = 2 x forward (two products per product).
  Fused kernels (`op_time.FUSED`: causal attention) are priced as they run:
  their own FLOPs, rate and backward, and the bytes they keep for backward.
* Parallel operators, as in docs/ARCHITECTURE.md: partition fwd local slice / bwd
  all-gather of the gradient; combine fwd all-gather / bwd slice; replicate
  fwd none / bwd all-reduce of the gradient; reduce fwd all-reduce / bwd none.
  Graph inputs have no gradient. A weight read through `partition` is stored
  sharded (no communication at all) where that partition is its only
  reader; a weight read through `replicate` needs its gradient all-reduced
  every step: the gradient synchronisation. A partition of a weight that
  is not stored in the partition's placement (read after a replicate or an
  all_gather, or beside another reader) slices it and gathers the gradient
  back in backward, as for an activation.
* Collectives are priced as NCCL runs them (`cost.collectives`: ring,
  tree or hierarchical all-reduce, whichever is faster; measured points of
  the machine file where it has them) over the group of the mesh axis the
  operator acts on (`GroupTopology.of_axis`: NVLink when the group stays in
  a node, the network when it spans nodes, hierarchical when both).
* Communication volume (`comm_elements`) is the number of elements SENT per
  step, summed over all devices (a tensor with fewer pieces than devices is
  held redundantly, and each replica set runs its own collective): a ring all-reduce of n elements over p
  devices sends 2(p-1)/p n per device, 2(p-1) n in all; an all-gather of a
  tensor of n elements sends (p-1)/p n per device, (p-1) n in all. With this
  convention data parallelism of the 2-layer MLP on 2 devices sends
  2 * (784*512 + 512*10) = 813,056 gradient elements per step.
* Memory per device (an upper bound: every node's piece is counted as if it
  lived on every device): activations kept for backward (a node's output
  piece, in the compute dtype, where some reader's backward reads it, each
  value once, `cost.saved`; and what a fused kernel keeps beside it), and for weights the bytes per parameter of
  the machine's precision with Adam (`ir.precision`: 16 in fp32 and in bf16
  with fp32 master weights and moments), charged to the node that reads the
  weight leaf in the placement it reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from parsat.dsl.gradient import is_alias
from parsat.dsl.instantiate import OpInstance
from parsat.dsl.parallel_ops import ALL_GATHER, ALL_TO_ALL, COMBINE, PARTITION, REDUCE, REDUCE_SCATTER, REPLICATE
from parsat.dsl.spread import infer_compute, reads_plainly
from parsat.ir.costs import NodeCost
from parsat.ir.machine import Machine
from parsat.ir.pcg import SHARDED_STATE_STAGES, STORED_ROLES, WEIGHT, WEIGHT_PIECE, WEIGHT_ROLES, Degrees
from parsat.cost import collectives
from parsat.cost.collectives import GroupTopology, price
from parsat.cost.op_time import FUSED, OpTime, op_time
from parsat.cost.ring_time import ring_compute_s
from parsat.cost.saved import exposed_regather_s, regathers, runtime_regathers

OPTIMIZER = "adam"           # the optimizer the plan's memory and update time assume


def weight_bytes(machine: Machine) -> int:
    """Bytes per parameter held for training: working weight, gradient, master copy, Adam state (16)."""
    return machine.precision_spec.parameter_bytes(OPTIMIZER).total


def update_traffic_bytes(machine: Machine) -> int:
    """Bytes the Adam update moves per parameter (28)."""
    return machine.precision_spec.optimizer_traffic_bytes(OPTIMIZER)


# ----------------------------------------------------------------- collectives


_KIND = {"all-reduce": collectives.ALL_REDUCE, "all-gather": collectives.ALL_GATHER,
         "reduce-scatter": collectives.REDUCE_SCATTER, "all-to-all": collectives.ALL_TO_ALL}
# elements sent over a group: x (p-1) n (an all-to-all's n: one device's buffer, of which it sends (p-1)/p)
_SENT = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1}


def _collective(machine: Machine, kind: str, group: GroupTopology, n: int) -> tuple[float, int]:
    """(seconds, elements sent over the group) of one collective of n elements: all-reduce 2(p-1) n;
    all-gather (n: the gathered piece), reduce-scatter (n: its input) and all-to-all (n: one device's buffer)
    (p-1) n."""
    return price(_KIND[kind], group, n * machine.dtype_bytes, machine).seconds, _SENT[kind] * (group.size - 1) * n


# -------------------------------------------------------------------- node cost


def compute_time(instance: OpInstance, inputs: Sequence[Degrees], output: Degrees,
                 machine: Machine, memo: dict | None = None) -> tuple[OpTime, tuple[str, ...]]:
    """A compute operator's time on its local pieces, and the problems spread inference found (if any). `memo`
    (a dict the caller keeps for one library, e.g. `search.extract.ComputedCosts.inferred`): spread inference's
    findings kept where they read no size (`_inferred`), and what `op_time` reads of the instance alone (its
    `memo`), so the same results with or without it."""
    got, var_degrees, found = _inferred(instance, inputs, memo)
    problems = list(found)
    if not problems and got != output:
        problems.append(f"{instance.name}: spread inference gives {got}, the e-graph says {output}")
    shapes = [tuple(int(d.evaluate({})) for d in s) for s in instance.input_shapes]
    out_shape = tuple(int(d.evaluate({})) for d in instance.output_shape)
    local_elems = sum(l.piece_elements(s) for l, s in zip(inputs, shapes)) + output.piece_elements(out_shape)
    return op_time(instance, var_degrees, local_elems, machine, memo), tuple(problems)


def _infer(instance: OpInstance, inputs: Sequence[Degrees]) -> tuple[Degrees, dict, tuple[str, ...]]:
    """What `compute_time` reads of spread inference: the output's degrees, each index variable's degree (read,
    never changed, by `op_time`) and the problems."""
    inferred = infer_compute(instance, [l.to_symbolic() for l in inputs])
    return Degrees.of(inferred.spread), inferred.var_degrees, inferred.problems


_PLAIN, _INFERRED = "reads plainly", "inferred"   # `_inferred`'s two kinds of entries in its memo


def _inferred(instance: OpInstance, inputs: Sequence[Degrees], memo: dict | None) -> tuple[Degrees, dict,
                                                                                          tuple[str, ...]]:
    """`_infer`, kept in `memo` where the operator reads its inputs plainly (`dsl.spread.reads_plainly`: then
    spread, var_degrees and problems read no size value). Those are then one function of what the key holds:
    the operator (its name, checked to be the same declaration: its body, inputs, out_vars and dim names) and
    its group lengths (the body, out_vars and dim names as instantiated: `instantiate` expands them from these
    alone, attributes and sizes only bind values), and the input degrees. The six micro-batch sizes and the
    meshes of a search ask again for the same operators at other sizes. An operator with a non-plain access
    (a block read, whose tiling reads sizes) is inferred afresh each time. What inference would raise, `op_time`
    raises too (both read `index_bounds`)."""
    if memo is None:
        return _infer(instance, inputs)
    form = (instance.name, tuple(sorted(instance.groups.items())))
    plain = memo.get((_PLAIN, form))
    if plain is None or plain[0] is not instance.op:
        plain = memo[(_PLAIN, form)] = (instance.op, reads_plainly(instance))
    if not plain[1]:
        return _infer(instance, inputs)
    key = (_INFERRED, form, tuple(inputs))
    found = memo.get(key)
    if found is None or found[0] is not instance.op:
        found = memo[key] = (instance.op, *_infer(instance, inputs))
    return found[1], found[2], found[3]


def compute_cost(instance: OpInstance, inputs: Sequence[Degrees], output: Degrees, machine: Machine,
                 weight_inputs: Sequence[bool], kept: bool = True, ring: Sequence[float] = (),
                 memo: dict | None = None) -> NodeCost:
    """A compute operator on local pieces; weights read directly are stored whole. `kept`: whether some
    reader's backward reads its output (`cost.saved`), which is then kept until that backward, unless the
    operator is a view (its operand holds the storage); a fused kernel keeps its output for its own backward
    (`FusedKernel.keeps_output`) and what it saves beside it (`OpTime.saved_bytes`). `ring`: a ring attention's
    shares of its dense block row step by step (`cost.ring_time.ring_work`), its forward and backward then the
    slowest rank's compute over the pass (`ring_compute_s`), as the step simulator runs it. `memo`: `compute_time`'s."""
    timed, problems = compute_time(instance, inputs, output, machine, memo)
    if ring:
        eff = machine.efficiency
        back = timed.backward_kernel_s(range(len(instance.input_shapes)))
        timed = replace(timed, forward_s=ring_compute_s(timed.kernel_s, ring, eff.op_time),
                        backward_s=ring_compute_s(back, ring, lambda s: eff.op_time(s, backward=True)))
    shapes = [tuple(int(d.evaluate({})) for d in s) for s in instance.input_shapes]
    out_shape = tuple(int(d.evaluate({})) for d in instance.output_shape)
    fused = FUSED.get(instance.name)
    holds = (kept and not is_alias(instance.op)) or (fused is not None and fused.keeps_output)
    activation = holds * output.piece_elements(out_shape) * machine.dtype_bytes + int(timed.saved_bytes)
    memory = activation
    opt = 0.0
    for is_weight, degrees, shape in zip(weight_inputs, inputs, shapes):
        if is_weight:
            memory += degrees.piece_elements(shape) * weight_bytes(machine)
            opt += degrees.piece_elements(shape) * update_traffic_bytes(machine) / machine.memory_bandwidth
    alone = ()
    if timed.gemm is not None and timed.backward_factor is None:   # one product: its operands' gradients apart
        alone = tuple(machine.efficiency.op_time(timed.backward_kernel_s([p]), backward=True)
                      for p in range(len(shapes)))
    return NodeCost(timed.forward_s, timed.backward_s, opt, memory_bytes=memory, flops=timed.flops,
                    problems=tuple(problems),
                    activation_bytes=activation, input_grad_s=alone)


def parallel_cost(op: str, degree: int, shape: Sequence[int], source: Degrees, output: Degrees, machine: Machine,
                  source_role: str, devices: int | None = None,
                  group: GroupTopology | None = None, stores: bool = True, zero: int = 0,
                  microbatches: int = 1, gradient: bool = True, kept: bool = True,
                  cover_s: float = 0.0, kept_whole: bool = False) -> NodeCost:
    """A parallel operator on one mesh axis of `degree` devices. `source_role` (`ir.pcg`'s roles) says what it
    reads:

    * "input": a graph input or a piece of one: inputs have no gradient, and
      the data loader gives each device the piece it needs, so nothing moves;
    * "weight": a weight leaf: a partition stores it sharded (no
      communication), a replicate stores it whole and all-reduces its
      gradient (the gradient synchronisation);
    * "weight-piece": a weight stored sharded by partitions: a further
      partition stores it finer (its optimizer state shrinks by the
      difference), a replicate or all_gather of it synchronises its gradient
      (ZeRO-3 / FSDP: an all_gather of a stored shard gathers it forward and
      again backward, and reduce-scatters the gradient);
    * "weight-value": a weight's value made by other parallel operators
      (replicate, all_gather): not stored in this placement, so a partition of
      it slices it and gathers the gradient in backward, as for an
      activation; a replicate or all_gather of it synchronises its gradient;
    * "": an activation: each operator's collectives as in docs/ARCHITECTURE.md.

    `stores` (partitions of a "weight" or "weight-piece" only): whether this
    partition is the weight's storage, i.e. its only reader (as the backend
    stores weights, `ir.pcg.weight_storage`). An e-node cannot know its
    readers and assumes so; a PCG node knows. A partition that does not
    store the weight slices the weight held whole (or as its stored piece)
    and gathers the gradient back: its memory is its share of that weight
    and the slice.

    `zero` (1 or 2: the plan's ZeRO stage, `ir.pcg.PCG.zero`) shards the
    state of a stored weight over the devices of the replicate that
    synchronises its gradient (`shards_state`): stage 1 its master copy
    and optimizer moments (Megatron-LM's distributed optimizer), stage 2
    its gradient too. The all-reduce becomes a reduce-scatter of the
    gradient and, after each device updates its shard, an all-gather of
    the weight: the same elements sent as a ring all-reduce. Stage 2
    cannot accumulate a sharded gradient, so it reduce-scatters once per
    micro-batch (`microbatches`), as DeepSpeed's stage 2 does.

    A tensor with fewer pieces than `devices` is held redundantly (SPMD): each
    of the `devices / pieces` replica sets runs the collective, so the elements
    sent are multiplied accordingly (time is not: the sets run in parallel).

    `gradient` False: no gradient reaches the source (made from the data, or
    through a routing one-hot, `cost.pcg_tasks.needs_gradient`), so autograd
    runs none of the operator's backward collectives (a mixture of experts'
    dispatch all-to-all sends nothing back).

    `kept` (an activation's operators only): whether some reader's backward reads the output (`cost.saved`),
    which is then kept until that backward; otherwise it is freed once read. A `combine` or `all_gather` of an
    activation keeps nothing of its own: its source, the shard, is kept, and where its output is wanted it is
    gathered again in backward, as Megatron-LM's sequence-parallel layers do (`cost.saved`). That second
    all-gather runs beside its readers' input gradients (`cover_s`, per micro-batch: `cost.saved.regather_cover`),
    so only what they cannot hide is charged (`cost.saved.exposed_regather_s`); its elements are all sent. With
    `kept_whole` (a backward other than a product's reads it: `cost.saved.regathers`) it is kept whole instead.
    """
    p = degree
    shape = tuple(shape)
    if p <= 1:
        return NodeCost()
    group = group or GroupTopology.consecutive(p, machine.devices_per_node)
    weighty = source_role in WEIGHT_ROLES
    move = _Move(p, source, output, source.piece_elements(shape), output.piece_elements(shape), weighty,
                 slices_weight=op == PARTITION and weighty and not (stores and source_role in STORED_ROLES))
    sharding = zero if shards_state(op, source_role, zero) else 0
    regather = runtime_regathers(machine) and regathers(op, source_role, kept, kept_whole)
    held = _parallel_memory(op, source_role, stores, move, machine, sharding, kept, regather)
    runs = _sharded_sync_runs(move, sharding, microbatches) if sharding else _collective_runs(op, source_role, move)
    again = tuple(replace(run, phase="bwd") for run in runs if run.phase == "fwd") if regather and gradient else ()
    if not gradient:   # no gradient reaches the source (`cost.pcg_tasks.needs_gradient`): nothing runs backward
        runs = tuple(run for run in runs if run.phase != "bwd")
    comm = _priced_regather(machine, group, p, runs, again, _replica_sets(devices, source, output), cover_s)
    return NodeCost(optimizer_s=held.optimizer_s, comm_s=comm.seconds, comm_elements=comm.elements,
                    grad_sync_elements=comm.grad_sync_elements, memory_bytes=held.memory_bytes,
                    collectives=comm.collectives, activation_bytes=held.activation_bytes, weight_chain=weighty,
                    accumulation_bytes=held.accumulation_bytes, forward_comm_s=comm.forward_seconds,
                    forward_comm_elements=comm.forward_elements, grad_reduce_s=comm.reduce_seconds)


@dataclass(frozen=True)
class _Move:
    """What a parallel operator's collectives and memory depend on besides the operator: the axis's degree, the
    tensor's spread before and after (and the elements of one piece of each), whether it reads a weight, and
    whether it slices a weight not stored in its placement (a partition that is not the weight's storage)."""

    degree: int
    source: Degrees
    output: Degrees
    in_piece: int
    out_piece: int
    weighty: bool
    slices_weight: bool


@dataclass(frozen=True)
class _Run:
    """One collective a parallel operator runs per step: its phase ("fwd", "bwd"), kind, elements `n` (as
    `_collective` counts them), how many replica sets run it (`pieces`), whether it is the gradient
    synchronisation, and whether it runs after the optimizer update (ZeRO's all-gather of the updated
    shards) rather than as the backward produces the gradient."""

    phase: str
    kind: str
    n: int
    pieces: int
    sync: bool = False
    after_update: bool = False


@dataclass(frozen=True)
class _Held:
    """A parallel operator's memory per device (weight state or activation kept for backward), the activation
    and gradient-accumulation bytes among it, and its share of the optimizer update's time."""

    memory_bytes: int = 0
    activation_bytes: int = 0
    accumulation_bytes: int = 0
    optimizer_s: float = 0.0


@dataclass(frozen=True)
class _Comm:
    """The collectives of a parallel operator priced: seconds and elements sent per step (in all, forward only,
    gradient synchronisation), the seconds of the gradient's reduction (`NodeCost.grad_reduce_s`), and a line
    per collective for the report."""

    seconds: float
    elements: int
    grad_sync_elements: int
    forward_seconds: float
    forward_elements: int
    collectives: tuple[str, ...]
    reduce_seconds: float = 0.0


def shards_state(op: str, source_role: str, zero: int) -> bool:
    """Whether a parallel operator is a stored weight's gradient synchronisation whose state ZeRO stage `zero`
    (1 or 2) shards: a replicate reading the weight or its stored piece (`ir.pcg.STORED_ROLES`). Its replicas
    hold the same weight and sum their gradients, so each can update its own 1/p of it."""
    return zero in SHARDED_STATE_STAGES and op == REPLICATE and source_role in STORED_ROLES


def _state_saved(machine: Machine, zero: int, degree: int) -> float:
    """Bytes per parameter that ZeRO stage `zero` over `degree` devices takes off each device's state."""
    held = machine.precision_spec.parameter_bytes(OPTIMIZER)
    return held.total - held.sharded(zero, degree)


def _parallel_memory(op: str, source_role: str, stores: bool, move: _Move, machine: Machine,
                     zero: int = 0, kept: bool = True, regather: bool = False) -> _Held:
    """What a parallel operator keeps: a weight stored in its placement (its training state and update), a finer
    storage of a stored piece (the state shrinks), an activation kept for backward, the slice of a weight not
    stored so, a gathered weight kept until backward (and its gradient accumulated whole). Under ZeRO stage
    `zero` (`shards_state`) a replicate of a stored weight takes the sharded state off what the weight's
    storage holds, and its update runs on the device's shard only. An activation is kept only where `kept`
    (`cost.saved`): never a replicate's (a view), nor a gather's where the runtime gathers it again for backward
    (`regather`: its shard is kept); where it does not, the gathered value is kept (its shard too, counted by
    its own node: an upper bound by 1/degree)."""
    memory, activation, accumulation, opt = 0, 0, 0, 0.0
    out_piece, in_piece = move.out_piece, move.in_piece
    if zero:
        p = move.degree
        saved = -in_piece * _state_saved(machine, zero, p)
        update = -in_piece * (p - 1) / p * update_traffic_bytes(machine) / machine.memory_bandwidth
        if source_role == WEIGHT:   # this replicate is also the weight's storage
            saved += out_piece * weight_bytes(machine)
            update += out_piece * update_traffic_bytes(machine) / machine.memory_bandwidth
        return _Held(int(round(saved)), 0, 0, update)
    if source_role == WEIGHT and op in (PARTITION, REPLICATE):   # the weight is stored in this placement
        memory = out_piece * weight_bytes(machine)
        opt = out_piece * update_traffic_bytes(machine) / machine.memory_bandwidth
    elif source_role == WEIGHT_PIECE and op == PARTITION and stores:   # stored finer: the state shrinks
        memory = (out_piece - in_piece) * weight_bytes(machine)
        opt = (out_piece - in_piece) * update_traffic_bytes(machine) / machine.memory_bandwidth
    elif not source_role and kept and op != REPLICATE and not regather:
        memory = activation = out_piece * machine.dtype_bytes       # an activation kept for backward
    if move.slices_weight:   # the slice of a weight not stored so, kept for backward like an activation
        activation = out_piece * machine.dtype_bytes
        memory += activation
    if op == ALL_GATHER and move.weighty:
        # The gathered weight is kept for backward, as the backend runs ZeRO-3 (FSDP's reshard_after_forward
        # off): one all-gather per step, and its memory until backward is done. Over micro-batches its gradient
        # accumulates whole, for one reduce-scatter per step.
        memory += out_piece * machine.dtype_bytes
        accumulation = out_piece * machine.precision_spec.gradient_bytes
    return _Held(memory, activation, accumulation, opt)


def _sharded_sync_runs(move: _Move, zero: int, microbatches: int) -> tuple[_Run, ...]:
    """A stored weight's gradient synchronisation under ZeRO stage `zero` (`shards_state`): the gradient
    reduce-scattered (stage 2: once per micro-batch, a sharded gradient cannot accumulate), then the updated
    shards all-gathered into the weight, each over the replicas' group, the flat gradient padded to a multiple
    of the group's size (as `backend.state_shards` and FSDP do: every shard the same size)."""
    padded = -(-move.in_piece // move.degree) * move.degree   # each device's shard equal: the tensor padded
    scatter = _Run("bwd", "reduce-scatter", padded, move.source.pieces, sync=True)
    gather = _Run("bwd", "all-gather", padded, move.source.pieces, sync=True, after_update=True)
    return (scatter,) * (microbatches if zero == 2 else 1) + (gather,)


def _partition_runs(move: _Move) -> tuple[_Run, ...]:
    """Partition: forward a local slice; backward all-gathers the gradient, unless it stores a weight."""
    if not move.weighty or move.slices_weight:
        return (_Run("bwd", "all-gather", move.in_piece, move.source.pieces),)
    return ()


def _combine_runs(move: _Move) -> tuple[_Run, ...]:
    """Combine: forward all-gathers the pieces; backward slices the gradient."""
    return (_Run("fwd", "all-gather", move.out_piece, move.output.pieces),)


def _replicate_runs(move: _Move) -> tuple[_Run, ...]:
    """Replicate: backward all-reduces the gradient (a weight's: the gradient synchronisation)."""
    return (_Run("bwd", "all-reduce", move.in_piece, move.source.pieces, sync=move.weighty),)


def _reduce_runs(move: _Move) -> tuple[_Run, ...]:
    """Reduce: forward all-reduces the partial sums; backward passes the gradient on."""
    return (_Run("fwd", "all-reduce", move.out_piece, move.output.pieces),)


def _reduce_scatter_runs(move: _Move) -> tuple[_Run, ...]:
    """Reduce-scatter forward, all-gather of the gradient backward; one group per piece outside this axis: the
    partial sum is `degree` of the pieces."""
    groups = move.source.pieces // move.degree
    return (_Run("fwd", "reduce-scatter", move.in_piece, groups), _Run("bwd", "all-gather", move.in_piece, groups))


def _all_gather_runs(move: _Move) -> tuple[_Run, ...]:
    """All-gather forward, reduce-scatter of the gradient backward (a weight's: the gradient synchronisation);
    likewise, the gathered copies are `degree` of the output's pieces."""
    groups = move.output.pieces // move.degree
    return (_Run("fwd", "all-gather", move.out_piece, groups),
            _Run("bwd", "reduce-scatter", move.out_piece, groups, sync=move.weighty))


def _all_to_all_runs(move: _Move) -> tuple[_Run, ...]:
    """All-to-all forward (a shard moved from one dim to another: a mixture of experts' dispatch or combine), the
    reverse all-to-all of the gradient backward; one group per piece outside this axis, each device sending
    (p-1)/p of its piece."""
    groups = move.source.pieces // move.degree
    return (_Run("fwd", "all-to-all", move.in_piece, groups), _Run("bwd", "all-to-all", move.out_piece, groups))


_RUNS = {PARTITION: _partition_runs, COMBINE: _combine_runs, REPLICATE: _replicate_runs, REDUCE: _reduce_runs,
         REDUCE_SCATTER: _reduce_scatter_runs, ALL_GATHER: _all_gather_runs, ALL_TO_ALL: _all_to_all_runs}


def _collective_runs(op: str, source_role: str, move: _Move) -> tuple[_Run, ...]:
    """The collectives `op` runs per step, in order (none when it reads a graph input: inputs have no gradient and
    the data loader gives each device its piece); KeyError for an operator that is not a parallel one."""
    if source_role == "input":
        return ()
    if op not in _RUNS:
        raise KeyError(op)
    return _RUNS[op](move)


def _priced_regather(machine: Machine, group: GroupTopology, degree: int, runs: Sequence[_Run],
                     again: Sequence[_Run], sets: int, cover_s: float) -> _Comm:
    """`runs` and the second all-gather `again` (none where nothing is gathered again) priced (`_price_runs`):
    every element sent counts, but of `again`'s seconds only what the readers' input gradients (`cover_s`)
    leave exposed (`cost.saved.exposed_regather_s`)."""
    comm = _price_runs(machine, group, degree, tuple(runs) + tuple(again), sets)
    if not again:
        return comm
    gather_s = _price_runs(machine, group, degree, again, sets).seconds
    return replace(comm, seconds=comm.seconds - gather_s + exposed_regather_s(gather_s, cover_s))


def _replica_sets(devices: int | None, source: Degrees, output: Degrees) -> int:
    """How many replica sets run each collective: `devices / pieces` for a tensor held redundantly on fewer
    pieces than devices (where that divides), else 1."""
    spread_over = max(source.pieces, output.pieces)
    if devices and devices > spread_over and devices % spread_over == 0:
        return devices // spread_over
    return 1


def _price_runs(machine: Machine, group: GroupTopology, degree: int, runs: Sequence[_Run], sets: int) -> _Comm:
    """The runs priced in order over `group` (seconds added in run order), their elements sent counted over
    `sets` replica sets."""
    time, elements, grad_sync, forward_time, forward_elements, reduce_time = 0.0, 0, 0, 0.0, 0, 0.0
    lines = []
    for run in runs:
        t, e = _collective(machine, run.kind, group, run.n)
        time += t
        if run.sync and not run.after_update:
            reduce_time += t
        elements += e * run.pieces
        if run.phase == "fwd":
            forward_time += t
            forward_elements += e * run.pieces
        if run.sync:
            grad_sync += e * run.pieces
        lines.append(f"{run.phase} {run.kind} x{run.pieces} ({degree} devices, {run.n} elements)"
                     + (" [gradient sync]" if run.sync else ""))
    if sets != 1:
        elements *= sets
        grad_sync *= sets
        forward_elements *= sets
    return _Comm(time, elements, grad_sync, forward_time, forward_elements, tuple(lines), reduce_time)


def gather_cost(machine: Machine, degrees: Degrees, shape: Sequence[int], devices: int | None = None) -> NodeCost:
    """Bringing a tensor that arrives spread as `degrees` to every device whole (a pinned input used whole)."""
    p = degrees.pieces
    if p <= 1:
        return NodeCost()
    n = 1
    for d in shape:
        n *= d
    t, e = _collective(machine, "all-gather", GroupTopology.consecutive(p, machine.devices_per_node), n)
    sets = max(1, (devices or p) // p)
    return NodeCost(comm_s=t, comm_elements=e * sets,
                    collectives=(f"fwd all-gather of the pinned input ({p} devices, {n} elements)",))
