"""The torch-native rows of one fidelity run predicted again with the profile's host-time terms switched off.

    PYTHONPATH=. .venv/bin/python benchmarks/costmodel_fidelity_ablation.py ROWS.json MACHINES_DIR

ROWS.json is a `costmodel_fidelity.py --runtime torch --json` run, MACHINES_DIR its `--keep` folder (the machine
calibrated before each round, `machine-{n}-{round}.json`). Each row is predicted again as the run did (the
geometric mean over the calibrations before and after its round) against the same measured step, with: everything;
no sequence factor (every operator call priced as timed alone, `OpEfficiency.sequence_factor` 1); that and no waits;
no Python instruction priced (the module's own Python between its ATen calls); no elementwise arithmetic's measured
rate (add, mul, scale, ... by their bytes at the bandwidth, as before session 62); no scalar function's measured
rate (tanh, exp, erf, ... memory-bound as before session 61); no measured product grid (the
Hockney fit alone, as before session 67); fused attention at the GEMMs' peak (no fitted rate);
neither; no `module_calls` (the user's module's own calls beyond its graph, `ir.module_calls`); no collective host work
(DTensor's `redistribute`, FSDP2's collectives); no per-group FSDP2 hook
cost (`fsdp_forward_group_s`, `fsdp_backward_group_s` at 0); neither; no wait for a peer's turn on a shared
core (`comm.turn_s` at 0; the skew's slope stays as fitted beside it); neither that nor stragglers; the
collectives as runs T1-T5 priced them (the plans' meshes one rank a node, so every group priced by the analytic
model as crossing nodes; a reduce-scatter at its own timing, not gloo's all-reduce); that and no turn (T5's
model on this run's calibrations). Runs of the benchmark differ by more
than these terms (the box's own speed moves between them), so a term is judged on one run's measurements.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from costmodel_fidelity import summarize  # noqa: E402
from costmodel_fidelity_torch import MODELS, torch_plans  # noqa: E402

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cost.pcg_tasks import TORCH_NATIVE, ExecutionProfile, simulate_pcg  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402
from parsat.ir.machine_profile import FSDP_COLLECTIVE_FIELDS, REDISTRIBUTE_FIELDS  # noqa: E402


def _no_group_hooks(machine: Machine) -> Machine:
    return replace(machine, efficiency=replace(machine.efficiency, fsdp_forward_group_s=0.0,
                                               fsdp_backward_group_s=0.0))


def _no_collective_host_work(machine: Machine) -> Machine:
    """The host time DTensor's `redistribute` and FSDP2's collectives add (session 60, helper E) at 0."""
    return replace(machine, efficiency=replace(machine.efficiency, **dict.fromkeys(
        REDISTRIBUTE_FIELDS + FSDP_COLLECTIVE_FIELDS, 0.0)))


def _no_python(machine: Machine) -> Machine:
    return replace(machine, efficiency=replace(machine.efficiency, python_instruction_s=0.0))


def _no_functions(machine: Machine) -> Machine:
    """Scalar functions (tanh, exp, erf, ...) priced as before session 61 helper C: not measured, an operator
    evaluating them memory-bound."""
    return replace(machine, efficiency=replace(machine.efficiency, function_times=()))


def _no_elementwise(machine: Machine) -> Machine:
    """Elementwise arithmetic priced by its bytes at the bandwidth alone, as before session 62 helper D."""
    return replace(machine, efficiency=replace(machine.efficiency, elementwise_unary_s=0.0, elementwise_binary_s=0.0,
                                               elementwise_broadcast_s=0.0))


def _no_attention_fit(machine: Machine) -> Machine:
    """Fused causal attention at the GEMMs' peak, as a calibrated machine priced it before session 61 helper C."""
    return replace(machine, efficiency=replace(machine.efficiency, attention_efficiency=1.0, attention_half_flops=0.0))


def _no_gemm_grid(machine: Machine) -> Machine:
    """Products priced by the Hockney fit alone, as calibrated machines priced them before session 67 helper C's
    grid of measured products (`OpEfficiency.gemm_grids`)."""
    return replace(machine, efficiency=replace(machine.efficiency, gemm_grids=()))


def _no_sequence(machine: Machine) -> Machine:
    return replace(machine, efficiency=replace(machine.efficiency, sequence_factor=1.0))


def _no_sequence_no_waits(machine: Machine) -> Machine:
    return _no_waits(_no_sequence(machine))


def _line_collectives(machine: Machine) -> Machine:
    """Each collective on its fitted line only, as machine files before `CollectivePoint.samples` priced it."""
    return replace(machine, comm=replace(machine.comm, points=tuple(replace(p, samples=())
                                                                    for p in machine.comm.points)))


def _no_turn(machine: Machine) -> Machine:
    return replace(machine, comm=replace(machine.comm, turn_s=0.0))


def _no_waits(machine: Machine) -> Machine:
    return replace(machine, comm=replace(machine.comm, turn_s=0.0, sync_skew=0.0))


@dataclass(frozen=True)
class Variant:
    """One way of predicting the rows again: the machine as kept, changed by `machine`; the module's own calls
    priced or not; the profile changed by `profile`; the plans' meshes with `per_node` ranks a node (None: the
    machine's, all ranks of the box one node)."""

    machine: Callable[[Machine], Machine] = lambda m: m
    calls: bool = True
    profile: Callable[[ExecutionProfile], ExecutionProfile] = lambda p: p
    per_node: int | None = None


def _t5_collectives(profile: ExecutionProfile) -> ExecutionProfile:
    return replace(profile, reduce_scatter_as_all_reduce=False)


VARIANTS = {"everything": Variant(), "no module calls": Variant(calls=False),
            "no elementwise rates (as before session 62 helper D)": Variant(_no_elementwise),
            "no scalar function times (function_times ())": Variant(_no_functions),
            "attention at the GEMMs' peak (attention_efficiency 1)": Variant(_no_attention_fit),
            "neither of those two (as before session 61 helper C)": Variant(lambda m: _no_attention_fit(_no_functions(m))),
            "no measured product grid (gemm_grids (), the fit alone)": Variant(_no_gemm_grid),
            "no module Python (python_instruction_s 0)": Variant(_no_python),
            "no sequence factor (each call as timed alone: sequence_factor 1)": Variant(_no_sequence),
            "no sequence factor, no peer's turn, no stragglers": Variant(_no_sequence_no_waits),
            "no collective host work (DTensor's redistribute, FSDP2's collectives: 0)": Variant(_no_collective_host_work),
            "no per-group hooks": Variant(_no_group_hooks), "neither": Variant(_no_group_hooks, calls=False),
            "no peer's turn (comm.turn_s 0)": Variant(_no_turn),
            "collectives on the fitted line (no samples)": Variant(_line_collectives),
            "no peer's turn, no stragglers (sync_skew 0)": Variant(_no_waits),
            "collectives as T5 priced them (groups across nodes, reduce-scatter as timed)":
                Variant(profile=_t5_collectives, per_node=1),
            "T5's model (the line above, no peer's turn)": Variant(_no_turn, profile=_t5_collectives, per_node=1)}


def main(rows_file: str, machines: str) -> None:
    rows, library = json.loads(Path(rows_file).read_text()), operator_library()
    folder = Path(machines)
    built: dict = {}

    def plans(n: int, per_node: int | None) -> dict:
        if (n, per_node) not in built:
            machine = Machine.load(folder / f"machine-{n}-0.json")
            built[(n, per_node)] = {label: (pcg, figures.profile) for label, pcg, _graph, figures
                                    in torch_plans(n, machine, list(MODELS), per_node)}
        return built[(n, per_node)]

    print("| profile | median relative error, step | Spearman | measured / predicted, median |\n|---|---|---|---|")
    for name, variant in VARIANTS.items():
        again = []
        for row in rows:
            pcg, profile = plans(row["nproc"], variant.per_node)[row["plan"]]
            profile = variant.profile(profile if variant.calls else TORCH_NATIVE)
            steps = [simulate_pcg(pcg, library, variant.machine(Machine.load(folder / f"machine-{row['nproc']}-{k}.json")),
                                  profile).step_s for k in (row["round"], row["round"] + 1)]
            again.append(dict(row, predicted_s=(steps[0] * steps[1]) ** 0.5))
        line = next(s for s in summarize(again).splitlines() if s.startswith("plans:"))
        error = line.split("median relative error of step time ")[1].split(";")[0]
        spearman = line.split("Spearman rank correlation ")[1].split(";")[0]
        ratio = statistics.median(r["measured_s"] / r["predicted_s"] for r in again)
        print(f"| {name} | {error} | {spearman} | {ratio:.2f} |")
        if name == "everything" and len(sys.argv) > 3:   # the rows as this model predicts them, for `summarize`
            Path(sys.argv[3]).write_text(json.dumps(again, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:3])   # a third argument: write the rows as predicted by "everything" there
