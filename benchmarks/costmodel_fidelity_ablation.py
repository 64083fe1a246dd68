"""The torch-native rows of one fidelity run predicted again with the profile's host-time terms switched off.

    PYTHONPATH=. .venv/bin/python benchmarks/costmodel_fidelity_ablation.py ROWS.json MACHINES_DIR

ROWS.json is a `costmodel_fidelity.py --runtime torch --json` run, MACHINES_DIR its `--keep` folder (the machine
calibrated before each round, `machine-{n}-{round}.json`). Each row is predicted again as the run did (the
geometric mean over the calibrations before and after its round) against the same measured step, with: everything;
no `module_calls` (the user's module's own calls beyond its graph, `ir.module_calls`); no per-group FSDP2 hook
cost (`fsdp_forward_group_s`, `fsdp_backward_group_s` at 0); neither. Runs of the benchmark differ by more
than these terms (the box's own speed moves between them), so a term is judged on one run's measurements.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from costmodel_fidelity import summarize  # noqa: E402
from costmodel_fidelity_torch import MODELS, torch_plans  # noqa: E402

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cost.pcg_tasks import TORCH_NATIVE, simulate_pcg  # noqa: E402
from parsat.ir.machine import Machine  # noqa: E402


def _no_group_hooks(machine: Machine) -> Machine:
    return replace(machine, efficiency=replace(machine.efficiency, fsdp_forward_group_s=0.0,
                                               fsdp_backward_group_s=0.0))


VARIANTS = {"everything": (lambda m: m, True), "no module calls": (lambda m: m, False),
            "no per-group hooks": (_no_group_hooks, True), "neither": (_no_group_hooks, False)}


def main(rows_file: str, machines: str) -> None:
    rows, library = json.loads(Path(rows_file).read_text()), operator_library()
    folder = Path(machines)
    plans = {n: {label: (pcg, figures.profile)
                 for label, pcg, _graph, figures in torch_plans(n, Machine.load(folder / f"machine-{n}-0.json"),
                                                                list(MODELS))}
             for n in sorted({r["nproc"] for r in rows})}
    print("| profile | median relative error, step | Spearman | measured / predicted, median |\n|---|---|---|---|")
    for name, (machine_of, calls) in VARIANTS.items():
        again = []
        for row in rows:
            pcg, profile = plans[row["nproc"]][row["plan"]]
            steps = [simulate_pcg(pcg, library, machine_of(Machine.load(folder / f"machine-{row['nproc']}-{k}.json")),
                                  profile if calls else TORCH_NATIVE).step_s for k in (row["round"], row["round"] + 1)]
            again.append(dict(row, predicted_s=(steps[0] * steps[1]) ** 0.5))
        line = next(s for s in summarize(again).splitlines() if s.startswith("plans:"))
        error = line.split("median relative error of step time ")[1].split(";")[0]
        spearman = line.split("Spearman rank correlation ")[1].split(";")[0]
        ratio = statistics.median(r["measured_s"] / r["predicted_s"] for r in again)
        print(f"| {name} | {error} | {spearman} | {ratio:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
