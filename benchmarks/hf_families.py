"""Twenty-one Hugging Face families imported, planned on 2 and 4 CPU ranks and trained like the module (issue 32).

Each family is built from a small config (2 layers, hidden 64, vocabulary
256, random weights) and wrapped as `hf_models.Loss` does it: the only code
around the model is a forward that returns the model's own `.loss`. Batches
are 4 sequences of 16 tokens, 4 images of 32x32, or 4 log-mel spectrograms.

Modes, one family at a time (the box is shared):

  python benchmarks/hf_families.py import --families falcon t5
      import each family (torch.export, the importer's float64 self-check);
      one JSON line per family: the graph's size and operators, or the
      refusal (every unsupported operator with its source line).

  python benchmarks/hf_families.py optimize --families falcon [--devices 4] [--out DIR]
      import, then `parsat.optimize(graph, machine="cpu", devices=N)` (N = 2
      by default); where the cost model prefers no parallelism, again with
      `degrees={"dp": N}` pinned; the plan is saved as DIR/<family>-N.json.

  torchrun --nproc-per-node N benchmarks/hf_families.py train --families falcon [--out DIR]
      `parsat.parallelize` with the N-device plan, 3 steps of the user's SGD
      loop against the unmodified module (`hf_models.train_one`), relative 1e-4.

  python benchmarks/hf_families.py report --logs A.jsonl B.jsonl ... [--md FILE] [--note TEXT]
      benchmarks/hf_families.md from those lines: one row per family.

Results and the commands that made them: benchmarks/hf_families.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models  # noqa: E402

BATCH, SEQ, VOCAB = 4, 16, 256
TOLERANCE = 1e-4
RULES = Path(__file__).resolve().parent.parent / "rules"
# The parallel rules without the algebraic ones: on LLaMA-like graphs the shipped library's e-graph explodes
# (benchmarks/search_results.md), and data parallelism needs no algebraic rewrite.
PARALLEL_RULES = [str(RULES / "parallel.rule"), str(RULES / "parallel_layers.rule")]

# Shared sizes of the decoder-only language models (LLaMA-like configs).
_LM = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB,
           max_position_embeddings=64)
_GQA = dict(_LM, num_key_value_heads=2)
_ENC = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB)
_IMG = dict(image_size=32, num_labels=10, drop_path_rate=0.0)   # stochastic depth draws in forward


def _configs(T) -> dict:
    """Family -> (model class, config, Loss kind): the whole of what differs between families."""
    return {
        "mistral": (T.MistralForCausalLM, T.MistralConfig(**_GQA), "causal"),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(**_GQA), "causal"),
        "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config(**_GQA, head_dim=16), "causal"),
        "opt": (T.OPTForCausalLM, T.OPTConfig(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4,
                                              vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=64),
                "causal"),
        "gpt_neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(**_LM), "causal"),
        "phi": (T.PhiForCausalLM, T.PhiConfig(**_LM), "causal"),
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config(**_GQA, pad_token_id=0, bos_token_id=1, eos_token_id=2), "causal"),
        "gemma": (T.GemmaForCausalLM, T.GemmaConfig(**_GQA, head_dim=16), "causal"),
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config(**_GQA, head_dim=16, query_pre_attn_scalar=16), "causal"),
        "falcon": (T.FalconForCausalLM, T.FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                       vocab_size=VOCAB), "causal"),
        "gptj": (T.GPTJForCausalLM, T.GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=VOCAB,
                                                 n_positions=64, bos_token_id=1, eos_token_id=2), "causal"),
        # Experts as Hugging Face's `batched_mm` runs them (each token's expert weights picked by index), a config
        # option: its default on CPU, `grouped_mm`, sorts the tokens by expert (aten.sort, histc) and multiplies
        # groups of data-dependent sizes (transformers::grouped_mm_fallback), which parsat does not import.
        "mixtral": (T.MixtralForCausalLM, T.MixtralConfig(**_GQA, num_local_experts=4, num_experts_per_tok=2,
                                                          experts_implementation="batched_mm"), "causal"),
        "t5": (T.T5ForConditionalGeneration, T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                        num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                        pad_token_id=0, attn_implementation="sdpa"), "seq2seq"),
        "distilbert": (T.DistilBertForMaskedLM, T.DistilBertConfig(n_layers=2, dim=64, hidden_dim=128, n_heads=4,
                                                                   vocab_size=VOCAB, max_position_embeddings=64),
                       "masked"),
        "roberta": (T.RobertaForMaskedLM, T.RobertaConfig(**_ENC, max_position_embeddings=64), "masked"),
        "albert": (T.AlbertForMaskedLM, T.AlbertConfig(**_ENC, embedding_size=32, max_position_embeddings=64),
                   "masked"),
        "convnext": (T.ConvNextForImageClassification, T.ConvNextConfig(num_stages=2, hidden_sizes=[32, 64],
                                                                        depths=[1, 1], **_IMG), "image"),
        "swin": (T.SwinForImageClassification, T.SwinConfig(patch_size=4, embed_dim=32, depths=[2, 1],
                                                            num_heads=[2, 4], window_size=4,
                                                            **dict(_IMG, image_size=40)), "image"),
        "deit": (T.DeiTForImageClassification, T.DeiTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                             num_attention_heads=4, patch_size=8, **_IMG), "image"),
        "beit": (T.BeitForImageClassification, T.BeitConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                            num_attention_heads=4, patch_size=8,
                                                            use_relative_position_bias=True, **_IMG), "image"),
        "whisper": (T.WhisperForConditionalGeneration, T.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=64, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=16,
            max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
            "speech"),
    }


FAMILIES = ("mistral", "qwen2", "qwen3", "opt", "gpt_neox", "phi", "phi3", "gemma", "gemma2", "falcon", "gptj",
            "mixtral", "t5", "distilbert", "roberta", "albert", "convnext", "swin", "deit", "beit", "whisper")


def inputs_for(kind: str, config) -> tuple:
    """A seeded batch for a Loss kind: token ids and labels, images and classes, or spectrograms and labels."""
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    if kind in ("causal", "seq2seq"):
        return ids, ids
    if kind == "masked":
        return ids, torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    if kind == "speech":
        return torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions), ids
    return torch.randn(BATCH, 3, config.image_size, config.image_size), torch.randint(0, 10, (BATCH,))


def make(name: str, seed: int = 0):
    """(wrapped model, example inputs) of one family, seeded."""
    import transformers as T

    cls, config, kind = _configs(T)[name]
    torch.manual_seed(seed)
    model = hf_models.Loss(cls(config), kind)
    return model, inputs_for(kind, config)


def import_family(args) -> None:
    """Import each family in turn; one JSON line each: the graph's size, or the refusal."""
    from parsat.importer.errors import TorchImportError
    from parsat.importer.export import import_module

    for name in args.families:
        module, inputs = make(name)
        start = time.process_time()
        try:
            graph = import_module(module, inputs).graph
            row = {"family": name, "import": "ok", "nodes": len(graph.nodes), "weights": len(graph.weights),
                   "operators": sorted({n.op for n in graph.nodes})}
        except TorchImportError as err:
            row = {"family": name, "import": "refused", "error": str(err)}
        row["cpu_s"] = round(time.process_time() - start, 2)
        print(json.dumps(row), flush=True)


def parallelism(plan) -> dict:
    """What a plan splits: the largest shard degree of any compute node, and how it splits the weights, which
    operators run on split dims and its collectives (`hf_models.split_summary`)."""
    data = plan.to_dict()
    shards = [max(n["spread"]["shard"] or [1]) for n in data["nodes"] if n["kind"] == "op"]
    return {"largest_shard": max(shards or [1]), **hf_models.split_summary(data)}


def progress(start: float):
    """The search's progress lines on stderr, each with the CPU seconds since `start`."""
    return lambda line: print(f"[{time.process_time() - start:7.1f} cpu s] {line}", file=sys.stderr, flush=True)


def optimize(args) -> None:
    """Import and plan each family on `--devices` CPU devices; pin data parallelism over all of them where the
    cost model picks none."""
    import parsat
    from parsat.importer.errors import TorchImportError
    from parsat.importer.export import import_module
    from parsat.ir.errors import GraphError, OptimizeError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.families:
        module, inputs = make(name)
        try:
            graph = import_module(module, inputs).graph
        except TorchImportError as err:
            print(json.dumps({"family": name, "import": "refused", "error": str(err)}), flush=True)
            continue
        start = time.process_time()
        options = dict(machine="cpu", devices=args.devices, microbatches=1, baselines=args.pin == "experts",
                       limits=args.limit,
                       rules=PARALLEL_RULES if args.rules == "parallel" else None, progress=progress(start))
        row = {"family": name, "devices": args.devices, "nodes": len(graph.nodes), "pinned": None}
        try:
            plan = parsat.optimize(graph, **options)
            if parallelism(plan)["largest_shard"] < 2 and args.pin is None:
                row["pinned"] = f"dp={args.devices}"
                plan = parsat.optimize(graph, degrees={"dp": args.devices}, **options)
        except (OptimizeError, GraphError) as err:
            row.update(optimize="refused", error=str(err), optimize_cpu_s=round(time.process_time() - start, 2))
            textbook = textbook_data_parallel(graph, args.devices) if row["pinned"] else None
            if textbook is not None:   # the plan trained instead, said so in the row
                (out / f"{name}-{args.devices}.json").write_text(json.dumps(textbook), encoding="utf-8")
                row["textbook"] = hf_models.split_summary({**textbook, "totals": {"time_s": 0.0,
                                                                                  "grad_sync_elements": None}})
            print(json.dumps(row), flush=True)
            continue
        if args.pin == "experts":   # the free search's choice recorded, the expert-parallel plan saved and trained
            row.update(pinned="experts", free=parallelism(plan), free_chosen=(plan.extraction or {}).get("chosen"),
                       free_time_ms=plan.totals.time_s * 1e3,
                       baselines_ms={k: v.time_s * 1e3 for k, v in plan.baselines.items() if v is not None})
            data = expert_parallel_plan(graph, plan)
            (out / f"{name}-{args.devices}.json").write_text(json.dumps(data), encoding="utf-8")
            print(json.dumps({**row, "optimize_cpu_s": round(time.process_time() - start, 2),
                              **hf_models.split_summary(data)}), flush=True)
            continue
        plan.save(out / f"{name}-{args.devices}.json")
        print(json.dumps({**row, "optimize_cpu_s": round(time.process_time() - start, 2), **parallelism(plan)}),
              flush=True)


def expert_parallel_plan(graph, plan) -> dict:
    """The search's `expert_parallel` baseline (`ir.expert_parallel`: the experts' weights split over the mesh
    axis, the rows all-to-all'd to their expert's rank and back; priced by the same cost model) as the plan file
    `parallelize` trains, with its simulated step and predicted communication as the totals."""
    import mesh_plans

    figures = plan.baselines["expert_parallel"]
    data = mesh_plans.plan_dict(graph, plan.baseline_plans["expert_parallel"].pcg, figures.comm_elements,
                                figures.grad_sync_elements)
    data["totals"]["time_s"] = figures.time_s
    return data


def textbook_data_parallel(graph, devices: int) -> dict | None:
    """Where the pinned search finds no plan: the textbook data-parallel PCG (`ir.data_parallel`, built from the
    graph, not by the rules) as a plan file with no cost figures (`mesh_plans.plan_dict`); None where it has
    none either."""
    import mesh_plans
    from parsat.backend.executor import operator_library
    from parsat.ir.data_parallel import data_parallel_pcg

    pcg = data_parallel_pcg(graph, operator_library(), devices)
    if pcg is None:
        return None
    return mesh_plans.plan_dict(graph, pcg)


def train(args) -> None:
    """Train each planned family 3 steps through `parsat.parallelize` beside the unmodified module."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for name in args.families:
        plan = Path(args.out) / f"{name}-{dist.get_world_size()}.json"
        if not plan.is_file():
            continue
        module, inputs = make(name)
        row = hf_models.train_one(module, inputs, plan, args.steps, TOLERANCE)
        if dist.get_rank() == 0:
            print(json.dumps({"family": name, **row}), flush=True)
    dist.destroy_process_group()


COMMANDS = """\
PYTHONPATH=. .venv/bin/python benchmarks/hf_families.py import > /tmp/hf_families/import.jsonl
PYTHONPATH=. .venv/bin/python benchmarks/hf_families.py optimize --out /tmp/hf_families/plans > /tmp/hf_families/optimize.jsonl
PYTHONPATH=. .venv/bin/torchrun --nproc-per-node 2 benchmarks/hf_families.py train --out /tmp/hf_families/plans \\
    > /tmp/hf_families/train.jsonl
PYTHONPATH=. .venv/bin/python benchmarks/hf_families.py optimize --devices 4 --out /tmp/hf_families/plans \\
    > /tmp/hf_families/optimize4.jsonl
PYTHONPATH=. .venv/bin/torchrun --nproc-per-node 4 benchmarks/hf_families.py train --out /tmp/hf_families/plans \\
    > /tmp/hf_families/train4.jsonl
.venv/bin/python benchmarks/hf_families.py report --logs /tmp/hf_families/*.jsonl --md benchmarks/hf_families.md"""


def read_rows(paths) -> dict[str, dict]:
    """Family -> its rows of every log merged: "import", and "optimize-N" and "train-N" for N ranks (each row names
    its family; an optimize row without its device count is from before `--devices`: 2)."""
    rows: dict[str, dict] = {}
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                if "check" in row:
                    mode = f"train-{row['ranks']}"
                elif "optimize_cpu_s" in row:
                    mode = f"optimize-{row.get('devices', 2)}"
                else:
                    mode = "import"
                rows.setdefault(row["family"], {})[mode] = row
    return rows


def plan_cell(row: dict | None) -> str:
    """What a family's plan splits, in words, or why there is none."""
    if row is None:
        return "not planned"
    if row.get("optimize") == "refused" and row.get("textbook"):
        collectives = ", ".join(f"{n} {op}" for op, n in sorted(row["textbook"]["collectives"].items())) or "none"
        return (f"the optimizer's: none ({row['error'].splitlines()[0]}); trained instead: the textbook "
                f"data-parallel PCG (`ir.data_parallel`, {row['pinned']}, no cost figures), collectives {collectives}")
    if row.get("optimize") == "refused":
        return f"no: {row['error'].splitlines()[0]}"
    split = sum(n for how, n in row["matrices"].items() if how.startswith("partition"))
    weights = sum(row["matrices"].values())
    if row["pinned"] == "experts":
        free = row["free"]
        others = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(row["baselines_ms"].items()))
        how = (f"expert parallel, pinned (the search's `expert_parallel` baseline, predicted "
               f"{row['baselines_ms'].get('expert_parallel', float('nan')):.2f} ms); the cost model's own choice: "
               f"{row['free_chosen']}, predicted {row['free_time_ms']:.2f} ms, collectives "
               f"{', '.join(f'{n} {op}' for op, n in sorted(free['collectives'].items())) or 'none'} "
               f"(baselines: {others})")
    elif row["pinned"]:
        how = f"data parallel, pinned {row['pinned']} (the cost model alone splits nothing)"
    else:
        how = "the cost model's choice" + (", tensor parallel (no gradient sync)" if not row["grad_sync_elements"]
                                           else "")
    collectives = ", ".join(f"{n} {op}" for op, n in sorted(row["collectives"].items())) or "none"
    return (f"yes: {how}; {split} of {weights} weight matrices read split; "
            f"{len(row['ops_on_sharded_dims'])} operators on split dims; collectives {collectives}; "
            f"search {row['optimize_cpu_s']:.0f} CPU s")


def train_cell(row: dict | None) -> str:
    """Whether training through `parallelize` equalled the module, with the largest relative difference."""
    if row is None:
        return "not run"
    verdict = "equal" if row["check"] == "passed" else "NOT equal"
    return f"{verdict} (max rel. diff {row['max_rel_diff']:.1e}, {row['steps']} steps, {row['ranks']} ranks)"


def site_packages() -> str:
    """The folder transformers is installed in, left out of the source lines the report quotes."""
    import transformers

    return str(Path(transformers.__file__).resolve().parent.parent) + os.sep


RANKS = (2, 4)


def import_cell(row: dict | None) -> str:
    """Whether a family imports: its graph's size, or the refusal as the importer words it."""
    if row is None:
        return "not run"
    if row["import"] == "ok":
        return f"yes ({row['nodes']} nodes, {len(row['operators'])} operators)"
    return "no: " + " ".join(row["error"].split()).replace(site_packages(), "")


def report(args) -> None:
    """benchmarks/hf_families.md from the logs of the other modes: one row per family, then the totals."""
    import transformers

    rows = read_rows(args.logs)
    columns = " | ".join(f"plan with parallelism on {n} ranks | training on {n} ranks vs the module" for n in RANKS)
    lines = ["# Twenty-one Hugging Face families: import, plan on 2 and 4 CPU ranks, train like the module (issue 32)",
             "", f"Script: `benchmarks/hf_families.py` (configs and modes in its docstring). torch {torch.__version__},",
             f"transformers {transformers.__version__}, CPython {sys.version.split()[0]}, a shared 2-core x86_64 box.",
             "Commands (from the repository root):", "", "```", COMMANDS, "```", "",
             f"| family | imports | {columns} |", "|---|---|" + "---|---|" * len(RANKS)]
    counts = {"import": 0, **{f"plan-{n}": 0 for n in RANKS}, **{f"train-{n}": 0 for n in RANKS}}
    for name in FAMILIES:
        got = rows.get(name, {})
        counts["import"] += got.get("import", {}).get("import") == "ok"
        cells = [import_cell(got.get("import"))]
        for n in RANKS:
            plan, trained = got.get(f"optimize-{n}"), got.get(f"train-{n}")
            counts[f"plan-{n}"] += plan is not None and plan.get("optimize") != "refused"
            counts[f"train-{n}"] += trained is not None and trained["check"] == "passed"
            cells += [plan_cell(plan), train_cell(trained)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    per_ranks = "; ".join(f"on {n} ranks {counts[f'plan-{n}']} have a plan with parallelism from the optimizer and "
                          f"{counts[f'train-{n}']} train through `parallelize` equal to the module" for n in RANKS)
    lines += ["", f"Of {len(FAMILIES)} families {counts['import']} import; {per_ranks} (losses, gradients and "
              f"updated weights, relative {TOLERANCE:g})."]
    Path(args.md).write_text("\n".join(lines + args.notes) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("import", "optimize", "train", "report"))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2, help="optimize: the number of CPU devices planned for")
    parser.add_argument("--pin", choices=("experts",), default=None,
                        help="optimize: save the search's expert-parallel baseline as the plan (a mixture of experts)")
    parser.add_argument("--rules", choices=("all", "parallel"), default="all",
                        help="the shipped library, or its parallel rules only (no algebraic rewrites)")
    parser.add_argument("--limit", type=lambda kv: kv.split("="), action="append", default=[],
                        help="a search budget, key=value (parsat's Limits: enodes=50000, generations=2)")
    parser.add_argument("--out", default=os.environ.get("PARSAT_HF_PLANS", "benchmarks/hf_plans"))
    parser.add_argument("--logs", nargs="+", default=[], help="report: the JSON lines of the other modes")
    parser.add_argument("--md", default="benchmarks/hf_families.md", help="report: the Markdown written")
    parser.add_argument("--note", dest="notes", action="append", default=[],
                        help="report: a paragraph appended after the table")
    args = parser.parse_args()
    args.limit = {k: float(v) if "." in v or k.endswith("seconds") else int(v) for k, v in args.limit} or None
    {"import": import_family, "optimize": optimize, "train": train, "report": report}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
