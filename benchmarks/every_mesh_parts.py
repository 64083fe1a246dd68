"""The search of every stage mesh (`pipeline_search._search_every_mesh`) of one `models_bench.py optimize` run, by part.

    PYTHONPATH=TREE .venv/bin/python benchmarks/every_mesh_parts.py llama-70b:64 OUT.json [--machine a100x8]

Runs `benchmarks/models_bench.py --json OUT.json optimize CASE [OPTIONS]` (whose `cpu_s` is issue 28's figure) with a few
functions wrapped where they are looked up, and prints one line, `EVERY`, with the CPU seconds
(`time.process_time`) of the call of `_search_every_mesh` and, inside it, of: the meshes' searches
(`step.search_meshes_of`: saturation, pricing, extraction of each mesh), `step.stop_where_cannot_win`,
`step._the_scouts_choice` (where the tree has it), simulating the meshes' joint plans (`MeshSearch.simulated`),
`step.compare_baselines` (inside `_the_scouts_choice` too), `step.assemble_plan` and the pricing of the stage plan
returned (`pipeline_search._priced`). Only calls made inside the search of every mesh are counted. Run it from the
root of the tree measured (PYTHONPATH that tree), so that two trees can be compared run by run.
"""

from __future__ import annotations

import runpy
import sys
import time

import parsat.search.mesh as mesh
import parsat.search.pipeline_search as pipeline_search
import parsat.search.step as step

PARTS = [(step, "search_meshes_of", "meshes searched"), (step, "stop_where_cannot_win", "stop_where_cannot_win"),
         (step, "_the_scouts_choice", "_the_scouts_choice"), (mesh.MeshSearch, "simulated", "joint plans simulated"),
         (step, "compare_baselines", "compare_baselines"), (step, "assemble_plan", "assemble_plan"),
         (pipeline_search, "_priced", "stage plan priced")]


def main(case: str, out: str, options: list[str]) -> None:
    inside, spent = [False], {}

    def wrapped(function, label):
        def timed(*args, **kwargs):
            if not inside[0]:
                return function(*args, **kwargs)
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.process_time() - start
        return timed

    for owner, name, label in PARTS:
        if hasattr(owner, name):
            setattr(owner, name, wrapped(getattr(owner, name), label))
    every = pipeline_search._search_every_mesh

    def every_mesh(*args, **kwargs):
        inside[0], start = True, time.process_time()
        try:
            return every(*args, **kwargs)
        finally:
            inside[0] = False
            print(f"EVERY {time.process_time() - start:.2f} CPU s: "
                  + "; ".join(f"{label} {seconds:.2f}" for label, seconds in spent.items()), file=sys.stderr)
    pipeline_search._search_every_mesh = every_mesh
    sys.argv = ["models_bench.py", "--json", out, "optimize", case, *options]
    runpy.run_path("benchmarks/models_bench.py", run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print(__doc__.strip())
        sys.exit(2)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
