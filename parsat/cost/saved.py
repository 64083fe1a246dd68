"""What training keeps for backward: the values some reader's backward reads, each value once.

Autograd keeps, per operator, the tensors its backward reads, not every
operator's output: a product its operands, a sum nothing, a norm or an
activation function its input, fused attention its inputs, output and
one logsumexp per row (`dsl.gradient.backward_reads`, read from each
operator's semantics; `op_time.FUSED` for fused kernels). A value read so
by several operators (the input of q, k and v) is kept once. So a value
is kept when some reader's backward reads it (`kept_values` for a PCG,
`kept_classes` for an e-graph, where a class's readers are every e-node
that reads it, an upper bound for ranking), and:

* a view (an operator whose output is one operand re-indexed:
  `dsl.gradient.is_alias`, a transpose, flatten, unflatten) and a
  `replicate` of an activation keep nothing of their own: where their
  output is kept, their operand is;
* a `combine` or `all_gather` of an activation keeps its operand, the
  shard, and, on a runtime that re-gathers (`runtime_regathers`), gathers
  it again in backward where only products (`PRODUCTS`) read it there, for
  their other operand's gradient (`regathered_values`), as Megatron-LM's
  sequence-parallel linear layers do
  (`LinearWithGradAccumulationAndAsyncCommunication` saves the sequence
  shard and all-gathers it for the weight's gradient). A gathered value
  another backward reads (logits gathered for a cross-entropy, a softmax's
  input) is kept whole, as torch's autograd keeps it (DTensor's
  cross-entropy) and Megatron-LM keeps its vocabulary-parallel loss's
  softmax;
* every other parallel operator's output (a slice, a reduced or
  reduce-scattered sum) is a tensor of its own, kept only where a reader's
  backward reads it: a row-parallel product's partial sum is read only by
  its reduction, whose backward reads nothing, so it is not kept.

Reference: Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4: per layer s b h (34 + 5 a s / h)
bytes at 16 bits without parallelism, divided by t with tensor and
sequence parallelism; with the attention core recomputed (FlashAttention
does the same) 34 s b h / t. Their 34 counts 2 s b h of dropout masks
(1 byte an element, after attention's projection and after the MLP),
which a block without dropout does not keep (tests/test_cost_saved.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Hashable, Iterable, Mapping, Sequence

from parsat.dsl.gradient import backward_reads, gradient_free, is_alias
from parsat.dsl.library import Library
from parsat.dsl.parallel_ops import ALL_GATHER, COMBINE, PARALLEL_OPS, REPLICATE
from parsat.ir.graph import Graph
from parsat.ir.machine import Machine
from parsat.ir.pcg import INPUT, PCG, pcg_roles

GATHERS = (COMBINE, ALL_GATHER)
ALIASING_PARALLEL = (REPLICATE,) + GATHERS   # their output kept means their operand kept (the module docstring)

Reader = tuple[Hashable, str, Sequence[Hashable]]   # (the value it makes, its operator, the values it reads)

PRODUCTS = frozenset({"matmul", "bmm", "linear", "linear_nobias", "linear_t", "linear_nobias_t"})
"""GEMM-kind operators: one product `a [*, m, k] x b [*, k, n]` (linear's b is its weight [k, n]; torch's `linear_t`
and `linear_nobias_t` read it [n, k]: `cost.pcg_tasks.TRANSPOSED_B`). Their backward reads each operand for the
other's gradient, which a runtime that re-gathers computes from the operand's shard gathered again
(`regathered_values`); torch runs them through torch.matmul or F.linear, and they are what a pipelined collective
feeds or drains (`cost.pcg_tasks.Pipeline`)."""


def kept_values(pcg: PCG, library: Library) -> frozenset[int]:
    """The ids of the PCG nodes whose value is kept for backward (the module docstring). Worked out once per PCG
    and library (`PCG.derive`): pricing, the step simulator and extraction's re-pricing each ask for it."""
    return pcg.derive("kept_values", library, lambda: _kept_values(pcg, library), structural=True)


def _kept_values(pcg: PCG, library: Library) -> frozenset[int]:
    """`kept_values` worked out."""
    by_products, by_others = _kept_reads(pcg, library)
    return by_products | by_others


def regathered_values(pcg: PCG, library: Library) -> frozenset[int]:
    """The ids of the PCG's gathers of an activation that a runtime that re-gathers (`runtime_regathers`) keeps as
    their shard and gathers again for backward (`regathers`): their value some product's backward reads and no
    other backward does (the module docstring). What both the per-node price (`search.solve.pcg_node_costs`) and
    the step simulator (`cost.pcg_tasks.regathered`) read, so that they charge the same second all-gathers.
    Worked out once per PCG and library (`PCG.derive`)."""
    return pcg.derive("regathered_values", library, lambda: _regathered_values(pcg, library), structural=True)


def _regathered_values(pcg: PCG, library: Library) -> frozenset[int]:
    """`regathered_values` worked out."""
    roles, (by_products, by_others) = pcg_roles(pcg), _kept_reads(pcg, library)
    return frozenset(n.id for n in pcg.nodes if n.kind == "parallel"
                     and regathers(n.op, roles.get(n.inputs[0], ""), n.id in by_products, n.id in by_others))


def _kept_reads(pcg: PCG, library: Library) -> tuple[frozenset[int], frozenset[int]]:
    """`kept_reads` of the PCG's operators, once per PCG and library."""
    readers = ((n.id, n.op, n.inputs) for n in pcg.nodes if n.kind != "leaf")
    return pcg.derive("kept_reads", library, lambda: kept_reads(readers, library, pcg_roles(pcg)), structural=True)


def graph_kept_bytes(graph: Graph, library: Library, machine: Machine) -> int:
    """Bytes of the activations one pass of `graph`, on one device and unparallelized, keeps for backward: the
    operators' outputs `kept` finds (weights and inputs are not activations). The pipeline search sizes a
    stage's activations by it before any stage plan exists (`search.pipeline_search.pipeline_degrees`)."""
    made = {node.name for node in graph.nodes}
    values = kept(((node.name, node.op, node.inputs) for node in graph.nodes), library,
                  {leaf.name: leaf.role for leaf in graph.leaves})
    shapes = graph.shapes()
    return sum(prod(shapes[v]) for v in values if v in made) * machine.dtype_bytes


def kept(readers: Iterable[Reader], library: Library, roles: Mapping[Hashable, str]) -> frozenset:
    """The values some reader's backward reads, through views and gathers to the value that holds the storage.
    `roles`: a value's role (`ir.pcg`'s: "input" takes no gradient, and a gather of a weight is its chain, not
    an activation)."""
    by_products, by_others = kept_reads(readers, library, roles)
    return by_products | by_others


def kept_reads(readers: Iterable[Reader], library: Library,
               roles: Mapping[Hashable, str]) -> tuple[frozenset, frozenset]:
    """`kept`, in two parts (each through views and gathers): the values a product's (`PRODUCTS`) backward reads,
    and those another operator's backward reads; a value in both is in both. A gather read only by products is
    the one a runtime gathers again (`regathers`)."""
    direct: set = set()
    others: set = set()
    aliases: dict[Hashable, list[Hashable]] = {}
    inputs = frozenset(v for v, role in roles.items() if role == INPUT)   # the values that take no gradient
    # by operator name, what the loop reads of its declaration (`_reading`), and by needs what its backward reads
    # (`_Reading.backward_reads`): `gradient_free` and `backward_reads` are memoised by the declaration, and
    # hashing one (its whole semantics, a frozen dataclass tree, hashed anew on every call) twice per node was 60%
    # of this function on a whole model's PCG. The same name is the same declaration of `library`, so the same
    # answers.
    readings: dict[str, _Reading] = {}
    for made, op, reads in readers:
        reading = readings.get(op)
        if reading is None:
            reading = readings[op] = _reading(op, library, direct if op in PRODUCTS else others)
        if reading.view is not None:   # a view: its output is that operand's storage
            aliases.setdefault(made, []).append(reads[reading.view])
            continue
        if reading.gathers:   # a replicate or gather of an activation stands for its source
            if reads and not roles.get(reads[0], ""):
                aliases.setdefault(made, []).append(reads[0])
            continue
        if reading.decl is None:   # another parallel operator, or an operator the library does not declare
            continue
        names = reading.names
        if inputs.isdisjoint(reads):
            # no operand is an input: the needs, and so the operands kept, follow from the operator and the
            # operand count alone (`_Reading.kept_at`), as the general case below works them out
            at = reading.kept_at.get(len(reads))
            if at is None:
                needs = frozenset(n for n, _v in zip(names, reads) if n not in reading.free)
                wanted = reading.backward_reads(needs)
                at = reading.kept_at[len(reads)] = tuple(p for p, (n, _v) in enumerate(zip(names, reads))
                                                         if n in wanted)
            reading.into.update([reads[p] for p in at])
            continue
        needs = frozenset(n for n, v in zip(names, reads) if roles.get(v, "") != INPUT and n not in reading.free)
        wanted = reading.backward_reads(needs)
        reading.into.update(v for n, v in zip(names, reads) if n in wanted)
    return through_aliases(direct, aliases), through_aliases(others, aliases)


@dataclass
class _Reading:
    """What `kept_reads` reads of one operator of the library, worked out the first time a node of it is met:
    `view`, the operand a view's output is (`_alias_position`), `gathers`, whether it is a replicate or gather
    (`ALIASING_PARALLEL`: its source stands for it where that is an activation), `decl` (None for another
    parallel operator or an undeclared one: nothing kept), its operands' `names` and the `free` ones
    (`gradient_free`), `into`, the set its backward's reads go to (products', others'), `kept_at`, by operand
    count, the positions kept where no operand is an input, and `wants`, its backward's reads by the operands
    that need a gradient (both filled as met). One per operator and `kept_reads` call: `into` is that call's."""

    view: int | None = None
    gathers: bool = False
    decl: object = None
    names: tuple[str, ...] = ()
    free: frozenset[str] = frozenset()
    into: set = field(default_factory=set)
    kept_at: dict[int, tuple[int, ...]] = field(default_factory=dict)
    wants: dict[frozenset[str], frozenset[str]] = field(default_factory=dict)

    def backward_reads(self, needs: frozenset[str]) -> frozenset[str]:
        """`dsl.gradient.backward_reads` of the declaration for `needs`, kept by `needs` (`wants`)."""
        wanted = self.wants.get(needs)
        if wanted is None:
            wanted = self.wants[needs] = backward_reads(self.decl, needs)
        return wanted


def _reading(op: str, library: Library, into: set) -> _Reading:
    """`_Reading` of `op` (the alias and the declared path's facts of `kept_reads`, in the order it asks them)."""
    if op in ALIASING_PARALLEL:
        return _Reading(gathers=True)
    at = _alias_position(op, library)
    if at is not None:
        return _Reading(view=at)
    decl = library.ops.get(op)
    if decl is None or op in PARALLEL_OPS:
        return _Reading()
    return _Reading(decl=decl, names=tuple(p.name for p in decl.tensor_params), free=frozenset(gradient_free(decl)),
                    into=into)


def through_aliases(direct: Iterable[Hashable], aliases: Mapping[Hashable, list[Hashable]]) -> frozenset:
    """`direct` and every value they alias, followed transitively (a view or gather -> the value it reads): what
    keeping `direct` for the backward keeps. The walk starts from the values of `direct` that alias some value (a
    value that aliases none adds nothing: popped, it was looked up for nothing; a whole PCG keeps thousands of
    values, of which its views and gathers are few); the values found are the same in any order of the walk."""
    found = set(direct)
    stack = list(found.intersection(aliases))
    while stack:
        for source in aliases.get(stack.pop(), ()):
            if source not in found:
                found.add(source)
                stack.append(source)
    return frozenset(found)


def runtime_regathers(machine: Machine) -> bool:
    """Whether plans for `machine` are priced as a runtime that re-gathers (`regathers`): a GPU machine's (the
    host dispatching ahead, `pcg_tasks.profile_for`'s `DDP`), priced as Megatron-LM runs; not a machine priced
    as `parsat run` runs (its interpreter, like torch's autograd on a DTensor gather, keeps the gathered value,
    and `--check` counts the collectives it sends against the prediction). `Machine.runtime_regathers` is the
    test, which the torch runtime reads too."""
    return machine.runtime_regathers


def regathers(op: str, source_role: str, kept: bool, kept_whole: bool = False) -> bool:
    """Whether a parallel operator is a gather of an activation (`source_role` "": not an input, not a weight's
    chain) whose output a product's backward reads (`kept`, `kept_reads`' first part) and no other backward does
    (`kept_whole`, its second): training then keeps the shard and gathers it again for the products' backward
    (the module docstring). A gathered value another backward reads is kept whole, and re-gathering it would
    save nothing. The one test the per-node price (`cost.model.parallel_cost`) and the step simulator
    (`cost.pcg_tasks`) read (`regathered_values`), so that they charge the same second all-gather."""
    return kept and not kept_whole and not source_role and op in GATHERS


def regather_cover(input_grads: Iterable[float]) -> float:
    """The seconds of compute a re-gathered value's second all-gather runs beside (`regathers`): the input
    gradients of the products reading it (`input_grads`, one per reader; `NodeCost.input_grad_s` at the
    value's position, 0 for a reader that is not a product), each computed from the output's gradient and the
    weight, not from the gathered value. Megatron-LM launches the all-gather asynchronously before the input
    gradient (`LinearWithGradAccumulationAndAsyncCommunication`), and a fused QKV GEMM's input gradient is its
    three siblings' together; the step simulator runs every sibling's input gradient before any weight
    gradient that waits for the gathered value (`cost.pcg_tasks._Builder._split_backward`)."""
    return sum(input_grads)


def exposed_regather_s(gather_s: float, cover_s: float) -> float:
    """The part of a re-gather's `gather_s` that its readers' input gradients (`cover_s`, `regather_cover`)
    cannot hide, on a runtime that runs communication on its own stream (`runtime_regathers`): what the per-node
    price charges (`cost.model.parallel_cost`), the same part the step simulator's streams leave exposed when
    nothing else holds the link (tests/test_cost_regather_cover.py), so that a PCG's per-node sum (a grid layout's,
    a re-priced plan's) ranks layouts as the simulator runs them, and the pipelined stage price
    (`cost.pipeline.TpOverlap`, whose reference run hides the re-gather too) takes off nothing of it again. An
    e-node is charged the whole second all-gather (`search.extract._price_enode`)."""
    return max(0.0, gather_s - cover_s)


def _alias_position(op: str, library: Library) -> int | None:
    """Which operand a compute operator's output is a view of (`is_alias`); None where it is no view."""
    decl = library.ops.get(op)
    if decl is None or not is_alias(decl):
        return None
    return [p.name for p in decl.tensor_params].index(decl.body.tensor)


__all__ = ["ALIASING_PARALLEL", "GATHERS", "PRODUCTS", "exposed_regather_s", "kept", "kept_reads", "kept_values",
           "regather_cover", "regathered_values", "regathers", "runtime_regathers"]
