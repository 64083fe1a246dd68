"""A pipeline stage's plan that fits extraction's bound but not as its pipeline runs it is extracted again leaner
(`mesh._leaner_as_run`), and the stage candidates rank as their pipeline runs them (`mesh.rank`; the fast tests of
the ranking are in tests/test_pipeline_shared_judgments.py, on its stage step) (issue 28). llama-70b:64's stage step
chose its scout's `gpu 8` plan (16.156 s pipelined) where `gpu0 4 x gpu1 2` kept every activation at 76.6 GiB
extracted again leaner and pipelines in 15.234 s."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parsat.ir.machine import Machine
from parsat.search.optimize import optimize


@pytest.mark.slow
def test_a_stage_plan_over_its_pipeline_s_memory_is_extracted_again_leaner_and_the_plan_pipelines_faster():
    """gpt on 8 cpu devices of 3 MiB, 2 stages x 4 micro-batches: on both stage meshes the plans extracted ranking
    memory by the stage machine's bound (p x 3 MiB) fit it but not as the pipeline runs them; each is extracted
    again, lean, under the bound scaled by its overshoot (`mesh._leaner_as_run`), and fits as run. With the stage
    candidates ranked by their pipelined price the plan pipelines in 10.52 ms (recomputing blocks, ZeRO-1,
    interleaved), where before this change it was 15.28 ms (keeping every activation, ZeRO-1, 1F1B)."""
    cpu = Machine.resolve("cpu")
    small = replace(cpu, memory_capacity=3 * 2 ** 20)
    sizes = {"blocks": 4, "batch": 16, "seq": 128, "hidden": 64, "heads": 4, "vocab": 128}
    said = []
    plan = optimize("gpt", small, devices=8, sizes=sizes, degrees={"pp": 2}, microbatches=4, progress=said.append)
    again = [m for m in said if "extracted again within" in m and "fits as its pipeline runs" in m]
    assert {m.split(":")[0] for m in again} == {"mesh gpu 4", "mesh gpu0 2 x gpu1 2"}
    assert plan.pipeline is not None and plan.totals.fits(small)
    assert plan.totals.time_s < 0.9 * 0.015284   # the plan before: 15.28 ms
