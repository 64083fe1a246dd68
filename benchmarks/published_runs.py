"""The measured Megatron runs of shared/anchors/published_runs.md, pinned to their published configuration and priced.

    .venv/bin/python benchmarks/published_runs.py [--rows sc21-7.5b,mcore-1.7b,...] [--json out.json]

Each row is a GPT of the published sizes (the built-in `gpt` example: pre-LN,
tied embedding, GELU MLP of 4h, causal attention whose q, k, v are one [h, 3h]
product laid out per head, as both Megatron-LM versions' `query_key_value`
/ `linear_qkv` compute them) at the published global
batch and sequence, on the published GPU count of `a100x8` (Narayanan et al.
SC'21, Table 1 and Table 2) or `h100x8` (Megatron-Core's README table),
optimized with `--degrees tp=t,pp=p` pinned to the published t and p (d is
what is left), micro-batch size 1 where it is not published (the step's
micro-batches: batch / d), and, for the A100 rows, the interleaved schedule
and full activation recomputation that paper states, on the runtime it ran:
Megatron-LM of 2021 all-reduced the data-parallel gradients after the
backward (after the pipeline's flush), not beside it (`Row.machine_of`:
the preset with `comm.overlap_grad_reduce` off; the H100 rows keep the
presets' overlapped buckets). The H100 table states
neither recomputation nor micro-batch size: those rows let the search
choose recomputation (default `auto`) at micro-batch size 1. The H100 rows
pin Megatron's distributed optimizer, ZeRO-1 over the data-parallel ranks
(`--degrees zero=1`; `--zero-free` lets the search choose, as before
2026-12-02): the anchor says only that their data-parallel communication
was overlapped, but the README it summarizes names the flags,
`--overlap-grad-reduce --overlap-param-gather`, and Megatron-LM refuses
`--overlap-param-gather` without `--use-distributed-optimizer`
(megatron/training/arguments.py: "--overlap-param-gather only supported
with distributed optimizer"). SC'21's Megatron-LM predates both the
distributed optimizer and sequence parallelism (Korthikanti et al., 2022):
the A100 rows pin ZeRO 0 and sequence parallelism off (`--degrees
zero=0,sp=1`; `--zero-free` leaves both to the search, as before
2026-12-03, when a pinned `--recompute` first reached every grid point and
the A100 rows took ZeRO-1 and sequence parallelism, which that run never
had). SC'21's Megatron-LM also predates fused attention (FlashAttention,
2022): it wrote out the [b, heads, s, s] scores (`torch.baddbmm`), a fused
scale-mask-softmax kernel and `torch.bmm` (a8d172b
megatron/model/transformer.py lines 167-332, megatron/model/fused_softmax.py),
so the A100 rows build `gpt` with `unfused_attention=1` and leave out the
rule that would fuse it back (`without_rules=("fuse_causal_attention",)`).

With `--free`, each row is also optimized with nothing pinned (the same
model, batch, machine and GPU count; the search chooses t, p, d, ZeRO,
micro-batches, schedule and recomputation under its default work budgets),
and the free plan's predicted step is printed beside the pinned one with
the side that wins (issue 31: the free search must be at least as fast as
the published configuration it could have pinned).

For each row: whether the plan fits, its predicted step, the published step
(the published FLOPs of one step divided by the published TFLOP/s per GPU
times the GPUs: the A100 rows count hardware FLOPs by their eq. 3, 96 B s l
h^2 (1 + s/(6h) + V/(16 l h)); the H100 rows model FLOPs, 72 B s l h^2 (1 +
s/(6h) + V/(12 l h))), their ratio (predicted / measured throughput, that is
published step / predicted step: above 1 the prediction is faster than the
measured run), the MFU of both steps by model FLOPs (the same count on every
row, so that A100 and H100 rows compare: model FLOPs / (step x GPUs x the
preset's bf16 peak)), and the CPU seconds the search took. Results are
recorded in benchmarks/published_runs.md; `--markdown` prints the table and
the summary lines from the recorded JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Row:
    name: str
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops_per_gpu: float   # published, per the row's FLOP count
    machine: str            # a100x8 (SC'21) or h100x8 (Megatron-Core)
    seq: int
    vocab: int
    distributed_optimizer: bool = False   # the run used Megatron's distributed optimizer (ZeRO-1 over dp)

    def machine_of(self):
        """The preset this row is priced on, with its runtime's gradient reduction: SC'21's Megatron-LM
        (`--DDP-impl local`, its default) all-reduced the gradients after the forward-backward function returned
        (megatron/training.py `train_step` -> `allreduce_gradients()`, NVIDIA/Megatron-LM a8d172b, 2021-04-28,
        lines 376-381; megatron/model/distributed.py lines 188-218), not overlapped with backward as the presets'
        Megatron-Core buckets are (`CommProfile.overlap_grad_reduce`)."""
        from dataclasses import replace

        from parsat.ir.machine import PRESETS

        preset = PRESETS[self.machine]
        if self.hardware_flops:
            return replace(preset, comm=replace(preset.comm, overlap_grad_reduce=False))
        return preset

    @property
    def hardware_flops(self) -> bool:
        """SC'21 counts hardware FLOPs (recomputation included, their eq. 3); Megatron-Core model FLOPs."""
        return self.machine == "a100x8"

    def model_flops(self) -> float:
        """Model FLOPs of one step (shared/anchors/published_runs.md): no recomputation counted."""
        b, s, l, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))

    def step_flops(self) -> float:
        """The FLOPs of one step as the row's source counts them (its published TFLOP/s divide these)."""
        if not self.hardware_flops:
            return self.model_flops()
        b, s, l, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def mfu(self, step_s: float) -> float:
        """Model FLOPs utilization of a step of `step_s` seconds: model FLOPs over the GPUs' bf16 peak."""
        from parsat.ir.machine import PRESETS

        return self.model_flops() / (step_s * self.gpus * PRESETS[self.machine].peak_flops)

    def sizes(self) -> dict[str, int]:
        """The built-in `gpt` example's sizes for this row (`parsat.optimize(..., sizes=)`)."""
        return {"blocks": self.layers, "hidden": self.hidden, "heads": self.heads, "seq": self.seq,
                "vocab": self.vocab, "batch": self.batch}

    def published_step_s(self) -> float:
        return self.step_flops() / (self.tflops_per_gpu * 1e12 * self.gpus)


def _sc21(name, heads, hidden, layers, t, p, gpus, batch, tflops):
    return Row(name, heads, hidden, layers, t, p, gpus, batch, tflops, "a100x8", 2048, 51200)


def _mcore(name, heads, hidden, layers, t, p, gpus, batch, tflops):
    return Row(name, heads, hidden, layers, t, p, gpus, batch, tflops, "h100x8", 4096, 131072, True)


ROWS = (
    _sc21("sc21-1.7b", 24, 2304, 24, 1, 1, 32, 512, 137), _sc21("sc21-3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
    _sc21("sc21-7.5b", 32, 4096, 36, 4, 1, 128, 512, 142), _sc21("sc21-18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _sc21("sc21-39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138), _sc21("sc21-76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _sc21("sc21-145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _sc21("sc21-310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _sc21("sc21-529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _sc21("sc21-1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    _sc21("sc21-175b-384", 96, 12288, 96, 8, 12, 384, 1536, 153),
    _sc21("sc21-175b-768", 96, 12288, 96, 8, 12, 768, 1536, 149),
    _sc21("sc21-175b-1536", 96, 12288, 96, 8, 12, 1536, 1536, 141),
    _mcore("mcore-1.7b", 16, 2048, 24, 1, 1, 48, 192, 408.8), _mcore("mcore-7.1b", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _mcore("mcore-16b", 48, 6144, 32, 4, 1, 192, 192, 489.1), _mcore("mcore-32b", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _mcore("mcore-70b", 64, 8192, 84, 8, 2, 768, 384, 419.7), _mcore("mcore-119b", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _mcore("mcore-177b", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _mcore("mcore-314b", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _mcore("mcore-462b", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)


def price(row: Row, zero_free: bool = False) -> dict:
    """The row optimized with its published configuration pinned (its optimizer's ZeRO stage too, unless
    `zero_free`), and its figures beside the published step."""
    import parsat

    d = row.gpus // (row.t * row.p)
    degrees = {"tp": row.t, "pp": row.p} if row.p > 1 else {"tp": row.t, "dp": d}
    if row.distributed_optimizer and not zero_free:
        degrees["zero"] = 1
    if row.hardware_flops and not zero_free:
        # SC'21's Megatron-LM had neither the distributed optimizer nor sequence parallelism (both 2022): its
        # runs held the weights' state whole and the layer norms' activations replicated on the tp ranks
        degrees.update(zero=0, sp=1)
    options = {"degrees": degrees, "microbatches": row.batch // d}   # micro-batch size 1 per data-parallel rank
    sizes = row.sizes()
    if row.hardware_flops:
        # SC'21's Megatron-LM (2021) had no fused attention: the scores written out, and the search kept from
        # fusing them back (`gpt`'s `unfused_attention`)
        sizes["unfused_attention"] = 1
        options["without_rules"] = ("fuse_causal_attention",)
        options["recompute"] = "blocks"
        if row.p > 1:
            options["schedule"] = "interleaved"
    if row.p == 1:
        options["pipeline"] = False
    start = time.process_time()
    out = {**asdict(row), "d": d, "pins": degrees, "published_step_s": row.published_step_s(),
           "overlap_grad_reduce": row.machine_of().comm.overlap_grad_reduce,
           "flops": "hardware (SC'21 eq. 3)" if row.hardware_flops else "model",
           "attention": "written out (2021)" if row.hardware_flops else "fused"}
    try:
        plan = parsat.optimize("gpt", machine=row.machine_of(), devices=row.gpus, sizes=sizes,
                               progress=lambda m: print(f"  [{row.name}] {m}", file=sys.stderr, flush=True),
                               **options)
    except Exception as err:  # noqa: BLE001 - the error is the result
        out["error"] = f"{type(err).__name__}: {err}"
    else:
        out.update(predicted_step_s=plan.totals.time_s, memory_gib=plan.totals.peak_memory_bytes / 2 ** 30,
                   simulated_peak_gib=simulated_peak_gib(plan),
                   fits=plan.totals.fits(plan.machine), recompute=plan.pcg.recompute, zero=plan.pcg.zero,
                   schedule=plan.pipeline.schedule if plan.pipeline else None,
                   chunks_per_stage=plan.pipeline.layout.chunks_per_stage if plan.pipeline else None,
                   ratio=row.published_step_s() / plan.totals.time_s,
                   predicted_tflops_per_gpu=row.step_flops() / plan.totals.time_s / row.gpus / 1e12)
    out["cpu_s"] = round(time.process_time() - start, 1)
    return out


def simulated_peak_gib(plan) -> float | None:
    """The step simulator's peak per device with transient buffers (`totals.step.peak_memory_bytes`), beside the
    per-node bound that decides what fits (`memory_gib`): a run that fitted on real GPUs tells which of the two
    holds. None where the plan's step was not simulated (a pipelined plan's totals are its schedule's)."""
    step = plan.totals.step
    return None if step is None else step.peak_memory_bytes / 2 ** 30


def price_free(row: Row) -> dict:
    """The row optimized with nothing pinned: its predicted step, layout, memory and CPU seconds."""
    import parsat
    from parsat.report.explain import explain_plan

    start = time.process_time()
    out: dict = {}
    try:
        plan = parsat.optimize("gpt", machine=row.machine, devices=row.gpus, sizes=row.sizes(),
                               progress=lambda m: print(f"  [{row.name} free] {m}", file=sys.stderr, flush=True))
    except Exception as err:  # noqa: BLE001 - the error is the result
        out["error"] = f"{type(err).__name__}: {err}"
    else:
        grid = plan.baseline_plans.get("best_grid")
        out.update(step_s=plan.totals.time_s, memory_gib=plan.totals.peak_memory_bytes / 2 ** 30,
                   simulated_peak_gib=simulated_peak_gib(plan),
                   fits=plan.totals.fits(plan.machine), recompute=plan.pcg.recompute, zero=plan.pcg.zero,
                   microbatches=plan.graph.microbatches, chosen=plan.extraction.get("chosen"),
                   best_grid=dict(grid.config) if grid is not None and grid.config else None,
                   pipeline=({"pp": plan.pipeline.degree, "schedule": plan.pipeline.schedule,
                              "microbatches": plan.pipeline.microbatches} if plan.pipeline else None),
                   explain=explain_plan(plan).splitlines()[:6])
    out["cpu_s"] = round(time.process_time() - start, 1)
    return out


def free_line(r: dict) -> str:
    """One row's free plan beside its pinned one: steps, their ratio and the side that wins."""
    free = r.get("free") or {}
    if "error" in free or "error" in r:
        return f"{r['name']}: pinned {r.get('error') or 'ok'}; free {free.get('error') or 'ok'}"
    pinned, found = r["predicted_step_s"], free["step_s"]
    side = "free" if found < pinned * (1 - 1e-9) else ("equal" if found <= pinned * (1 + 1e-9) else "PINNED")
    pipe = free.get("pipeline") or {}
    return (f"{r['name']}: pinned {pinned:.3f} s, free {found:.3f} s ({pinned / found:.2f}x), wins: {side}; free "
            f"plan {free.get('chosen')}, pp {pipe.get('pp', 1)}{' ' + pipe['schedule'] if pipe else ''}, "
            f"ZeRO-{free['zero']}, "
            f"recompute {free['recompute']}, fits {free['fits']}, {free['cpu_s']} CPU s")


BAND = (0.85, 1.15)   # issue 31: every row's predicted / measured throughput in it (the median in 0.93-1.07)


def _row(result: dict) -> Row:
    return Row(**{k: result[k] for k in Row.__dataclass_fields__ if k in result})


def markdown(results: list[dict]) -> str:
    """Recorded results as the table of benchmarks/published_runs.md."""
    lines = ["| row | GPUs | t | p | d | batch | published FLOPs | fits | GiB per device | recompute | schedule "
             "| predicted step | published step | predicted / measured throughput | MFU predicted / published "
             "(model FLOPs) | CPU s |", "|" + "---|" * 16]
    for r in results:
        row = _row(r)
        published_mfu = row.mfu(r["published_step_s"])
        if "error" in r:
            lines.append(f"| {r['name']} | {r['gpus']} | {r['t']} | {r['p']} | {r['d']} | {r['batch']} | {r['flops']} "
                         f"| refused: {r['error']} | | | | | {r['published_step_s']:.3f} s | | - / {published_mfu:.0%} "
                         f"| {r['cpu_s']} |")
            continue
        lines.append(f"| {r['name']} | {r['gpus']} | {r['t']} | {r['p']} | {r['d']} | {r['batch']} | {r['flops']} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['memory_gib']:.1f} | {r['recompute']}"
                     f"{', ZeRO-' + str(r['zero']) if r.get('zero') else ''} | "
                     f"{r['schedule'] or '-'} | {r['predicted_step_s']:.3f} s | {r['published_step_s']:.3f} s | "
                     f"{r['ratio']:.2f} | {row.mfu(r['predicted_step_s']):.0%} / {published_mfu:.0%} | {r['cpu_s']} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """How many rows fit, and the range and median of predicted / measured throughput by machine."""
    fit = [r for r in results if r.get("fits")]
    lines = [f"{len(fit)} of {len(results)} rows fit where they ran."]
    lines += [free_line(r) for r in results if "free" in r]
    for machine in [None, *sorted({r["machine"] for r in results})]:
        ratios = sorted(r["ratio"] for r in fit if machine is None or r["machine"] == machine)
        if ratios:
            inside = sum(BAND[0] <= x <= BAND[1] for x in ratios)
            lines.append(f"{machine or 'all'}: {len(ratios)} rows, predicted / measured throughput "
                         f"{ratios[0]:.3f}-{ratios[-1]:.3f}, median {statistics.median(ratios):.3f}, "
                         f"{inside} in {BAND[0]}-{BAND[1]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: every row)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--zero-free", action="store_true",
                        help="let the search choose the ZeRO stage of the rows that ran Megatron's distributed "
                             "optimizer, instead of pinning ZeRO-1")
    parser.add_argument("--free", action="store_true",
                        help="also optimize each row with nothing pinned, and print which of the two is faster")
    parser.add_argument("--markdown", default=None, metavar="JSON",
                        help="print the recorded results of JSON as a markdown table and its summary, and nothing else")
    args = parser.parse_args(argv)
    if args.markdown:
        recorded = json.load(open(args.markdown, encoding="utf-8"))
        print(markdown(recorded))
        print()
        print(summary(recorded))
        return 0
    wanted = set(args.rows.split(",")) if args.rows else None
    results = []
    for row in ROWS:
        if wanted is not None and row.name not in wanted:
            continue
        result = price(row, args.zero_free)
        if args.free:
            result["free"] = price_free(row)
            print(free_line(result), flush=True)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(results, handle, indent=1)
    print(f"{'row':<16} {'t':>2} {'p':>3} {'d':>4} {'fits':>5} {'GiB':>6} {'predicted':>10} {'published':>10} "
          f"{'ratio':>6} {'CPU s':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['name']:<16} {r['t']:>2} {r['p']:>3} {r['d']:>4}  error: {r['error'][:90]}")
            continue
        print(f"{r['name']:<16} {r['t']:>2} {r['p']:>3} {r['d']:>4} {str(r['fits']):>5} {r['memory_gib']:>6.1f} "
              f"{r['predicted_step_s']:>9.3f}s {r['published_step_s']:>9.3f}s {r['ratio']:>6.2f} {r['cpu_s']:>6.1f}")
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
