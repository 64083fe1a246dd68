"""What one `optimize` call searches with, resolved once at its entry point: `SearchRequest` and `StepContext`.

Every search an `optimize` call makes (one per micro-batch count, one per
pipeline stage plan, one saturation per device mesh within each) reads the
same library, rules, machine, limits and pins. They are resolved and
checked once, in `resolve_request`, before any saturation starts (bad input
is refused there, before any proof is looked up), and travel as one
frozen record (flexflow's `MachineMappingContext` plays the same part), so
no loop below resolves a machine, a library or a graph again.

A `StepContext` is one step's search: the request, the graph at one
micro-batch count, and the machine and device count that step runs on (a
pipeline stage's, for a stage plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from parsat.cost.pipeline import StageFit
from parsat.dsl import ast
from parsat.dsl.bounds import BoundError, check
from parsat.dsl.checker import resolve_library
from parsat.dsl.library import Library
from parsat.egraph.program import MeshCaches
from parsat.egraph.runner import Limits
from parsat.ir.blocks import OUTSIDE, block_of, has_blocks
from parsat.ir.budget import GraphBudget
from parsat.ir.errors import OptimizeError
from parsat.ir.validate import MAX_DEVICES
from parsat.ir.graph import Graph
from parsat.ir.machine import Machine
from parsat.ir.microbatch import batch_dims
from parsat.ir.models import BATCH, EXAMPLES
from parsat.ir.pcg import Degrees
from parsat.ir.recompute import AUTO, BLOCKS, POLICIES
from parsat.search.extract import ComputedCosts
from parsat.search.fit import MemoryFit
from parsat.search.inputs import check_devices, check_graph_source, check_pins, pinned_layouts, resolve_graph
from parsat.search.repeat import SEARCHED_BLOCKS, Repetition, repetition_for

ZERO_STAGES = (0, 1, 2, 3)   # what `--degrees zero=N` may pin

Progress = Callable[[str], None]
RuleChooser = Callable[[Library], tuple[Sequence[ast.RuleDecl], str]]
"""Picks the rules saturation may apply out of a library, with a note for the plan (`saturation.rules_note`)."""


def every_rule(library: Library) -> tuple[list[ast.RuleDecl], str]:
    """The default `RuleChooser`: every rule of the library, unverified (the facade's chooser keeps PROVED ones)."""
    return list(library.rules), "all rules used (no proof check was asked for)"


def _silent(_message: str) -> None:
    """The default progress: say nothing."""


@dataclass(frozen=True)
class SearchRequest:
    """One `optimize` call's inputs, resolved and checked: what every search of the call shares.

    `graph` is what the caller named (a built-in example is rebuilt at each
    micro-batch count from `sizes`); `whole` is it built at the whole batch,
    checked against the devices and pins. `rules` are the ones the caller's
    chooser kept, chosen once for the call."""

    graph: object                       # a Graph, a graph JSON path or a built-in example's name
    whole: Graph
    library: Library
    rules: tuple[ast.RuleDecl, ...]
    rules_note: str
    machine: Machine                    # with the nodes the call's devices need
    devices: int
    limits: Limits
    sizes: Mapping[str, int]            # an example's sizes (`--set`)
    batch: int | None                   # an example's global batch; None for any other graph
    parallel_dims: Mapping[str, int]    # `--degrees` pins other than pp (`strategies.pinned_meshes`)
    pipeline_degree: int | None         # `--degrees pp`
    output_pins: Mapping[str, Degrees | Mapping] | None = None
    input_pins: Mapping[str, Degrees | Mapping] | None = None
    free_input_placements: bool = True
    baselines: bool = True
    repeat_blocks: bool = True
    recompute: str = AUTO
    zero: int | str = AUTO              # `--degrees zero=N` (0-3), or AUTO: the search chooses 0, 1 or 2
    sequence_parallel: bool | None = None   # `--degrees sp=N`: on (N = tp) or off (N = 1); None: searched
    caches: MeshCaches = field(default_factory=MeshCaches, compare=False)
    say: Progress = _silent
    # the independent grid's points by (graph, machine, devices): a scout's step and the search of every mesh at
    # its count share them (`step.independent_points`)
    grid_points: dict = field(default_factory=dict, compare=False)
    # the grid's layouts built for one graph, which its other graphs of the same structure (the step's graph at
    # other micro-batch counts) take rescaled where the build cannot tell them apart (`megatron_pcg`'s `kin`)
    layouts: dict = field(default_factory=dict, compare=False)
    # built-in examples built by name and sizes for the call (`ir.microbatch.built_example`): the steps' graphs at
    # each micro-batch count (`step_context`) and the grids' `batch_dims` builds (`ir.megatron._Kin`, which
    # `layouts` seeds with it) read one memo; llama-70b:64 built 17 graphs of 9 sizes, 0.67 CPU s
    examples: dict = field(default_factory=dict, compare=False)
    # what the steps of one call share beside: each mesh's search by its inputs (`step.searched_once`), and the
    # simulated steps and compute times by machine and micro-batch count (`mesh.CandidateSteps`)
    mesh_searches: dict = field(default_factory=dict, compare=False)
    # the meshes' saturated e-graphs by what saturation reads of a graph beside its sizes: another micro-batch
    # count's graph takes one where every rule reads the same of its sizes (`mesh._resized`, `egraph.resize`)
    saturations: dict = field(default_factory=dict, compare=False)
    simulations: dict = field(default_factory=dict, compare=False)
    # compute operators' costs by what they read, for every pricer of the call (`extract.Pricer`'s `computed`):
    # the meshes' e-graphs and the grids' layouts hold the same operators at the same spreads; beside them the
    # operators' instances by shapes (`ComputedCosts.instances`)
    prices: dict = field(default_factory=ComputedCosts, compare=False)
    # the rules a joint plan used, by its snapshot and choice: a scout's plan and the plan of the search of every
    # mesh at its count are often the same extraction of the same e-graph (`step.plan_rules`)
    rules_found: dict = field(default_factory=dict, compare=False)
    # the baselines a step builds apart from the meshes' e-graphs (data and expert parallelism, the sequential
    # search) by their inputs, and which candidates' PCGs can be placed: a scout's step and the search of every
    # mesh at its count build and check the same ones (`step.built_once`, `step.sequential_once`,
    # `step._unplaceable`)
    built: dict = field(default_factory=dict, compare=False)
    # a pipeline stage candidate's memory as its pipeline runs it, by the step's (graph, machine, devices, StageFit):
    # a scout's step and the search of every mesh at its pair judge the same candidates (`search.fit.MemoryFit`)
    stage_figures: dict = field(default_factory=dict, compare=False)
    deadline: float | None = None       # the call's `--limit seconds` deadline (perf_counter), None without one
    # leave out the associativity rules that cannot pay off on a graph whose sums are sequential (`egraph.sums`,
    # docs/MESH.md "Sequential sums"); False saturates with every rule (what the tests compare against)
    cut_sums: bool = True

    def graph_budget(self) -> GraphBudget:
        """What a graph of this call may hold and until when it may be built (`ir.budget`)."""
        return graph_budget(self.limits, self.deadline)

    @property
    def pinned(self) -> bool:
        """Whether kinds of parallelism are pinned (`--degrees`): the plan is then the pinned one."""
        return bool(self.parallel_dims) or bool(self.pipeline_degree and self.pipeline_degree > 1)

    @property
    def state_zero(self) -> int | str:
        """The ZeRO stage the cost model prices weights' state with (`ir.pcg.PCG.zero`): AUTO, 0, 1 or 2. A
        pinned stage 3 is a layout (weights stored split on the data axis, `strategies.pinned_meshes`), priced
        unsharded otherwise."""
        return 0 if self.zero == 3 else self.zero


def resolve_request(graph, machine: Machine | str, rules, limits: Limits | Mapping | None, devices: int | None, *,
                    choose_rules: RuleChooser = every_rule, output_spreads=None, input_spreads=None,
                    free_input_placements: bool = True, baselines: bool = True, sizes: Mapping[str, int] | None = None,
                    degrees: Mapping[str, int] | None = None, progress: Progress | None = None,
                    repeat_blocks: bool = True, recompute: str = AUTO,
                    caches: MeshCaches | None = None, deadline: float | None = None,
                    cut_sums: bool = True, without_rules: Sequence[str] = ()) -> SearchRequest:
    """The call's inputs resolved and checked, then its rules chosen (a bad graph name or size, device count or
    `--degrees` pin is refused before the rules load, a graph the devices cannot use before any proof is looked
    up). `without_rules` names rules the search must not apply although chosen: a pin of what a runtime
    could not run (a 2021 Megatron-LM had no fused attention, `fuse_causal_attention`); an unknown name is
    refused. `deadline` (a `time.perf_counter()` value: the call's `--limit seconds`)
    bounds building the graph too. Raises OptimizeError, GraphError or MachineError with a message for the
    user."""
    checked = check_arguments(machine, devices, degrees, recompute)   # before the rules load
    dims, pp, zero, sequence, machine = checked.dims, checked.pp, checked.zero, checked.sequence, checked.machine
    count = checked.devices
    limits = Limits.resolve(limits)
    sizes = dict(sizes or {})
    check_graph_source(graph, sizes or None)
    library = resolve_library(rules)
    examples: dict = {}
    whole = resolve_graph(graph, library, sizes or None, graph_budget(limits, deadline), examples)
    if recompute == BLOCKS and not has_blocks(leaf.name for leaf in whole.leaves):
        raise OptimizeError(f"--recompute blocks: '{whole.name}' has no blocks to recompute (ir.blocks: a block's "
                            "weights are named b0_..., b1_..., as the built-in examples name them and the importer "
                            "names a module's stack of identical layers)")
    check_devices(whole, count)
    check_pins(whole, output_spreads, input_spreads, count)
    say = progress or _silent
    chosen, note = choose_rules(library)
    chosen = tuple(chosen)
    if without_rules:
        left_out = set(without_rules)
        unknown = sorted(left_out - {r.name for r in library.rules})
        if unknown:
            raise OptimizeError(f"without_rules: no rule named {', '.join(unknown)}")
        chosen = tuple(r for r in chosen if r.name not in left_out)
        note += f"; left out as pinned: {', '.join(sorted(left_out))}"
    say(f"{len(chosen)} rules; {note}")
    return SearchRequest(graph, whole, library, chosen, note, machine, count, limits, sizes,
                         example_batch(graph, sizes), dims, pp, output_spreads, input_spreads, free_input_placements,
                         baselines, repeat_blocks, recompute, zero, sequence, caches or MeshCaches(), say,
                         layouts={"examples": examples}, examples=examples, deadline=deadline, cut_sums=cut_sums)


@dataclass(frozen=True)
class Arguments:
    """A call's arguments that need no graph, checked (`check_arguments`)."""
    dims: Mapping[str, int]    # the mesh pins (dp, tp, ...), without pp, zero and sp
    pp: int | None
    zero: int | str            # a ZeRO stage or AUTO
    sequence: bool | None      # `sequence_pin`
    machine: Machine           # whole nodes for the call's devices
    devices: int


def check_arguments(machine: Machine | str, devices: int | None, degrees: Mapping[str, int] | None,
                    recompute: str = AUTO) -> Arguments:
    """What a call asks for that needs no graph, checked: the recompute policy, the machine, the device count
    and every `--degrees` pin. `resolve_request` starts with it; the CLI calls it before importing a model file
    too (torch and an export cost seconds a bad pin should not). Raises OptimizeError or MachineError with a
    message for the user."""
    if recompute not in POLICIES + (AUTO,):
        raise OptimizeError(f"--recompute must be one of {', '.join(POLICIES + (AUTO,))}, got {recompute!r}")
    dims = dict(degrees or {})
    pp = dims.pop("pp", None)
    if pp is not None and (isinstance(pp, bool) or not isinstance(pp, int) or pp < 1):
        raise OptimizeError(f"--degrees pp must be a positive integer, got {pp!r}")
    zero = dims.pop("zero", AUTO)
    if zero != AUTO and (isinstance(zero, bool) or zero not in ZERO_STAGES):
        raise OptimizeError(f"--degrees zero must be a ZeRO stage, {', '.join(map(str, ZERO_STAGES))}, got {zero!r} "
                            "(1: optimizer state sharded over the data-parallel ranks, as Megatron-LM's distributed "
                            "optimizer; 2: gradients too; 3: weights too, as FSDP)")
    if zero == 3 and "dp" not in dims:
        raise OptimizeError("--degrees zero=3 stores the weights split over the data-parallel axis: pin that axis "
                            "too (dp=N)")
    sequence = sequence_pin(dims.pop("sp", None), dims.get("tp"))
    base = Machine.resolve(machine)
    count = base.devices if devices is None else devices
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES:
        raise OptimizeError(f"the device count must be a whole number, at least 1 and at most {MAX_DEVICES:,}, "
                            f"got {count!r}")
    stage = count // pp if pp and pp > 1 and count % pp == 0 else count   # dp x tp are one stage's devices
    machine = base.with_devices(count)
    pinned_layouts(dims, stage, machine.devices_per_node, zero, sequence)
    return Arguments(dims, pp, zero, sequence, machine, count)


def sequence_pin(sp, tp) -> bool | None:
    """`--degrees sp=N` as the search keeps it: True (Megatron-LM's sequence parallelism, on the tensor-parallel
    ranks, so N is the pinned tp), False (`sp=1`: activations never cut along the sequence), None (not pinned:
    searched). Checked here, before the rules load."""
    if sp is None:
        return None
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise OptimizeError(f"--degrees sp must be a positive integer, got {sp!r}")
    if sp == 1:
        return False
    if tp is None or sp != tp:
        degree = f"tp={sp},sp={sp}" if tp is None else f"sp={tp} with tp={tp}"
        raise OptimizeError(f"--degrees sp={sp}: sequence parallelism cuts the norms' and residuals' activations "
                            "along the sequence on the tensor-parallel ranks (Megatron-LM), so it needs tp pinned "
                            f"to the same degree ({degree}); sp=1 pins it off")
    return True


def graph_budget(limits: Limits, deadline: float | None) -> GraphBudget:
    """The graph budget of `limits`: at most `enodes` tensors, and with a finite `seconds` no more tensors than
    it pays for, built before `deadline`; with no seconds limit the clock is never read."""
    timed = math.isfinite(limits.seconds)
    return GraphBudget(limits.enodes, deadline if timed else None, limits.seconds if timed else None)


def example_batch(graph, sizes: Mapping[str, int]) -> int | None:
    """The global batch of a built-in example that has one (None for any other graph)."""
    if isinstance(graph, str) and graph in EXAMPLES:
        return {**EXAMPLES[graph].defaults(), **sizes}.get(BATCH)
    return None


def check_microbatches(graph, sizes: Mapping[str, int] | None, microbatches: int | None) -> None:
    """Refuse a micro-batch count (`--microbatches`) outside its bound (`dsl.bounds`), or one that does not divide
    a built-in example's batch: called first, so a bad count is said before the rules load and their proofs are
    looked up (2-3 CPU s), not after."""
    if microbatches is None:
        return
    try:
        check("optimize", "--microbatches", microbatches)
    except BoundError as err:
        raise OptimizeError(str(err)) from None
    sizes = dict(sizes or {})
    batch = example_batch(graph, sizes) if all(isinstance(v, int) for v in sizes.values()) else None
    if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1:
        check_divides(batch, microbatches)


def check_divides(batch: int, microbatches: int) -> None:
    """OptimizeError unless `microbatches` micro-batches split a batch of `batch` evenly."""
    if batch % microbatches:
        raise OptimizeError(f"{microbatches} micro-batches do not divide the batch of {batch}")


def stageable(graph, sizes: Mapping[str, int], devices: int) -> bool:
    """Whether `graph` can be pipelined on `devices` devices: a built-in example of several blocks, with a batch, or
    a graph (an imported module's) whose weights fall in several blocks, on several devices."""
    blocks = graph_blocks(graph, sizes)
    return blocks is not None and blocks >= 2 and devices >= 2


def graph_blocks(graph, sizes: Mapping[str, int]) -> int | None:
    """The blocks a pipeline cuts `graph` between (None where it has none it can cut): a built-in example's `blocks`
    size, where it has a batch; a `Graph`'s distinct blocks its weights are named into (`ir.blocks.block_of`:
    `b{i}_...`, as the importer names an imported module's layers). Why a `Graph` is cut by its weights' names:
    the stages are cut by `ir.pipeline.LayerMap`, which reads nothing else (a node's block is the latest of its
    weights'), so a graph whose weights are named into blocks has the layers the built-in examples have; its step
    is taken as one micro-batch's (`step_context`), so any micro-batch count splits it."""
    if isinstance(graph, Graph):
        return len({block_of(w.name) for w in graph.weights} - {OUTSIDE}) or None
    if not example_batch(graph, sizes):
        return None
    blocks = {**EXAMPLES[graph].defaults(), **sizes}.get("blocks")
    return blocks if isinstance(blocks, int) else None


@dataclass(frozen=True)
class StepContext:
    """One step's search: the request, the graph at this step's micro-batch count (`graph.microbatches`), its
    repeated blocks, and the machine and devices the step runs on (a pipeline stage's for a stage plan)."""

    request: SearchRequest
    graph: Graph
    repetition: Repetition | None
    machine: Machine                     # with the nodes `devices` need
    devices: int
    pins: Mapping[str, Degrees]          # pinned degrees of outputs and inputs, checked on `graph`
    memory: MemoryFit                    # what fits in memory, as the plan runs (`search.fit`)
    in_flight: int = 1                   # micro-batches whose activations extraction ranks alive at once (a stage's)
    batch_inputs: Mapping[str, int] = field(default_factory=dict)   # pinned dp or tp: inputs -> their batch dim
    scout: bool = False                  # search the first mesh only: a count or pair compared (`step`)

    @property
    def stage(self) -> StageFit | None:
        """How a pipeline stage's plan runs (None unstaged): only its grid baseline is read beside it."""
        return self.memory.stage

    @property
    def searched(self) -> Graph:
        """The graph saturation sees: the searched blocks when blocks repeat, else the whole graph."""
        return self.repetition.searched if self.repetition else self.graph

    @property
    def input_pins(self) -> dict[str, Degrees]:
        return {k: v for k, v in self.pins.items() if k not in self.graph.outputs}

    @property
    def say(self) -> Progress:
        return self.request.say


def step_context(request: SearchRequest, microbatches: int = 1, machine: Machine | None = None,
                 devices: int | None = None, in_flight: int = 1, stage: StageFit | None = None,
                 scout: bool = False) -> StepContext:
    """The step of `microbatches` micro-batches on `devices` devices of `machine` (default: the request's): an
    example is built at its batch / m (the whole graph is the request's for m = 1), any other graph is taken
    as one micro-batch's. A pipeline stage's step (`stage`: how its pipeline runs) judges what fits as the
    pipeline runs it (`search.fit`); `in_flight` is what its extraction ranks memory with."""
    machine, devices = machine or request.machine, devices or request.devices
    sizes = dict(request.sizes)
    if request.batch is not None and microbatches > 1:
        check_divides(request.batch, microbatches)
        sizes[BATCH] = request.batch // microbatches
    budget = request.graph_budget()
    graph = request.whole if sizes == dict(request.sizes) else \
        resolve_graph(request.graph, request.library, sizes, budget, request.examples)
    repetition = repetition_for(graph) if request.repeat_blocks else None
    if microbatches != 1:
        graph = graph.with_microbatches(microbatches)
        repetition = repetition and repetition.with_microbatches(microbatches)
    if repetition:
        request.say(f"'{graph.name}' has {repetition.blocks} identical blocks: searching {SEARCHED_BLOCKS}, the "
                    f"middle one's plan repeated {repetition.copies} times")
    check_devices(graph, devices)
    pins = check_pins(graph, request.output_pins, request.input_pins, devices)
    # pinned axes are promises: the inputs that carry the batch are split along it on a data axis, and along
    # another dim (the vocabulary of one-hot ids and targets) on a tensor axis (`strategies.config_excluded`)
    pinned = any(request.parallel_dims.get(kind, 1) > 1 for kind in ("dp", "tp"))
    samples = batch_dims(graph, request.library) if pinned else {}
    machine = machine.with_devices(devices)
    # a stage candidate's figure reads the graph, machine, devices and how the pipeline runs (`StageFit`, compared
    # without its memo and bar: neither changes a figure) and nothing else of the step: steps alike in those share
    figures = request.stage_figures.setdefault((graph, machine, devices, stage), {}) if stage is not None else {}
    return StepContext(request, graph, repetition, machine, devices, pins,
                       MemoryFit(machine, graph, devices, stage, figures), in_flight, samples, scout)
