"""A pipelined plan as people read it: the stages and their figures in text, the schedule as lanes and as SVG.

Everything is drawn from `ir.pipeline.PipelinePlan` (the stages, their
layers and figures) and its simulated schedule (`PipelinePlan.simulate`);
nothing here prices anything.
"""

from __future__ import annotations

from typing import Sequence

from parsat.ir.pipeline import BACKWARD, FORWARD, GPIPE, ONE_F_ONE_B, Chunk, PipelinePlan, ScheduleRun

def describe_pipeline(pipeline: PipelinePlan, devices_per_node: int) -> list[str]:
    """`explain`'s pipeline section: degree, schedule, bubble, transfers, each stage's layers and memory, and the
    schedule drawn per stage."""
    p, s_dev = pipeline.degree, pipeline.stage_devices
    where = "across nodes" if s_dev >= devices_per_node else "inside a node" if p * s_dev <= devices_per_node \
        else "across and inside nodes"
    v = pipeline.layout.chunks_per_stage
    lines = [f"  pipeline: PP {p} {where} ({s_dev} device(s) per stage), {_schedule_name(pipeline.schedule, v)}, "
             f"{pipeline.microbatches} micro-batches; bubble {pipeline.bubble_fraction:.1%} of the step; "
             f"point-to-point {pipeline.p2p_bytes / 2**20:.2f} MiB sent per rank per step, "
             f"{pipeline.transfer_s * 1e3:.3f} ms per micro-batch transfer"]
    for s, figures in enumerate(pipeline.stages):
        layers = [layer for c in pipeline.layout.stage_chunks(s) for layer in c.layers]
        lines.append(f"    stage {s}: {_layer_text(pipeline.layout.stage_chunks(s))}; per micro-batch forward "
                     f"{figures.forward_s * 1e3:.3f} ms, backward {figures.backward_s * 1e3:.3f} ms; sync "
                     f"{figures.sync_s * 1e3:.3f} ms, optimizer {figures.optimizer_s * 1e3:.3f} ms per step; "
                     f"memory {figures.memory_bytes / 2**30:.2f} GiB ({figures.in_flight} in flight)"
                     + ("" if layers else " (no layers)"))
    if pipeline.layout.shared_weights:
        lines.append("    weights held on several stages, gradients summed each step: "
                     + ", ".join(f"#{n} on stages {', '.join(map(str, st))}" for n, st in pipeline.layout.shared_weights))
    if pipeline.chunk_forward_s:
        lines += schedule_lanes(pipeline.simulate(), p)
    return lines


def _schedule_name(schedule: str, v: int) -> str:
    return {GPIPE: "GPipe", ONE_F_ONE_B: "1F1B"}.get(schedule, f"interleaved 1F1B, {v} chunks per stage")


def _layer_text(chunks: Sequence[Chunk]) -> str:
    parts = []
    for chunk in chunks:
        blocks = [layer for layer in chunk.layers if layer >= 0]
        text = ("prelude" if -1 in chunk.layers else "") + \
            (("" if -1 not in chunk.layers else " + ") + (f"block {blocks[0]}" if len(blocks) == 1 else
                                                         f"blocks {blocks[0]}-{blocks[-1]}") if blocks else "")
        parts.append(text)
    return "; ".join(parts)


def schedule_lanes(run: ScheduleRun, degree: int, width: int = 96) -> list[str]:
    """The simulated schedule, one lane per stage, one character per equal slice of the step: F forward, B
    backward (f and b for a stage's later chunks when interleaved), '.' waiting."""
    lines = [f"  pipeline timeline ({width} slices of {run.time_s * 1e3 / width:.3f} ms; F forward, B backward, "
             "f/b a later chunk, . idle):"]
    for s, actions in enumerate(run.busy):
        lane = []
        for k in range(width):
            t = (k + 0.5) * run.time_s / width
            found = next((a for a, b, e in actions if b <= t < e), None)
            if found is None:
                lane.append(".")
            else:
                letter = found.phase
                lane.append(letter if found.chunk < degree else letter.lower())
        lines.append(f"    stage {s:<3}|{''.join(lane)}|")
    return lines




def schedule_svg(pipeline: PipelinePlan) -> str:
    """The simulated schedule as an SVG drawing: one row per stage, a box per forward (blue) and backward
    (green) labelled with its micro-batch, a later chunk's lighter; the bubble is the white between."""
    run = pipeline.simulate()
    p = pipeline.degree
    width, row, left, top = 1200.0, 28.0, 70.0, 40.0
    scale = (width - left - 10) / run.time_s if run.time_s > 0 else 0.0
    height = top + row * p + 20
    colors = {(FORWARD, 0): "#4a78c2", (FORWARD, 1): "#9db8e6", (BACKWARD, 0): "#3f9b5a", (BACKWARD, 1): "#a3d4ae"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'font-family="sans-serif" font-size="10">',
             f'<text x="{left}" y="16" font-size="13">{_schedule_name(pipeline.schedule, pipeline.layout.chunks_per_stage)}'
             f', {p} stages, {pipeline.microbatches} micro-batches: step {run.time_s * 1e3:.3f} ms, bubble '
             f'{run.bubble_fraction:.1%}</text>']
    for s, actions in enumerate(run.busy):
        y = top + s * row
        parts.append(f'<text x="4" y="{y + row * 0.6:.1f}">stage {s}</text>')
        parts.append(f'<rect x="{left}" y="{y:.1f}" width="{width - left - 10:.1f}" height="{row - 4:.1f}" '
                     f'fill="white" stroke="#ccc"/>')
        for action, begin, end in actions:
            x, w = left + begin * scale, max((end - begin) * scale, 0.5)
            fill = colors[(action.phase, 0 if action.chunk < p else 1)]
            parts.append(f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{row - 4:.1f}" fill="{fill}">'
                         f'<title>{action.phase} micro-batch {action.microbatch} chunk {action.chunk}: '
                         f'{begin * 1e3:.3f}-{end * 1e3:.3f} ms</title></rect>')
            if w > 12:
                parts.append(f'<text x="{x + w / 2:.2f}" y="{y + row * 0.55:.1f}" fill="white" '
                             f'text-anchor="middle">{action.microbatch}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
