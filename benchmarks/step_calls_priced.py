"""A plan's predicted step on a calibrated machine file with and without each of the step's calls that `parsat
calibrate` times as `parsat run` makes them (`calibrate.StepCalls`): the figure the issue-31 demo's prediction
moves by, field by field, on the same machine file (benchmarks/demo_step.md, session 67 helper B).

    PYTHONPATH=. .venv/bin/python benchmarks/step_calls_priced.py PLAN MACHINE [PLAN MACHINE ...]
"""

from __future__ import annotations

import sys
from dataclasses import replace

from parsat.backend.cli import load_plan
from parsat.backend.executor import operator_library
from parsat.cost.pcg_tasks import PARSAT_RUN, simulate_pcg
from parsat.cost.step_report import summarize
from parsat.ir.machine import Machine

FIELDS = ("step_backward_dispatch_s", "step_node_s", "step_loss_path_s", "step_parallel_s",
          ("step_update_sgd_s", "step_update_adam_s"))


def without(machine: Machine, fields) -> Machine:
    names = (fields,) if isinstance(fields, str) else tuple(fields)
    return replace(machine, efficiency=replace(machine.efficiency, **{name: 0.0 for name in names}))


def main() -> None:
    library = operator_library()
    for path, machine_path in zip(sys.argv[1::2], sys.argv[2::2]):
        machine = Machine.load(machine_path)
        pcg, _graph, _ = load_plan(path, machine.devices)
        step = simulate_pcg(pcg, library, machine, PARSAT_RUN).step_s
        every = [name for f in FIELDS for name in ((f,) if isinstance(f, str) else f)]
        none = simulate_pcg(pcg, library, without(machine, every), PARSAT_RUN).step_s
        eff = machine.efficiency
        print(f"{path} on {machine_path}: " + ", ".join(f"{name} {getattr(eff, name) * 1e6:.1f} us" for name in every))
        print(f"  predicted {step * 1e3:.3f} ms; without the fields {none * 1e3:.3f} ms (+{(step - none) * 1e3:.3f})")
        for label, priced in (("with", machine), ("without", without(machine, every))):
            _streams, timeline = summarize(simulate_pcg(pcg, library, priced, PARSAT_RUN), PARSAT_RUN.name)
            print(f"  phases {label} the fields (compute / communication, ms): " + ", ".join(
                f"{p.phase} {p.compute_s * 1e3:.3f} / {p.comm_s * 1e3:.3f}" for p in timeline.phases))
        for f in FIELDS:
            alone = simulate_pcg(pcg, library, without(machine, f), PARSAT_RUN).step_s
            print(f"  without {f if isinstance(f, str) else ' and '.join(f)}: {alone * 1e3:.3f} ms "
                  f"(it adds {(step - alone) * 1e3:.3f})")


if __name__ == "__main__":
    main()
