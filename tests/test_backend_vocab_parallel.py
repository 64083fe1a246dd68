"""Megatron-LM's vocabulary-parallel cross-entropy in the grid's layout (`ir.megatron`, `vocabulary_parallel`): the
logits split along the vocabulary on the tensor axis are never gathered; each rank's block maxima are gathered and
their max taken, each rank's shifted sum of exps and negative log-likelihood are partial sums, reduced. The layout
computes the loss the unmodified graph does: run by the interpreter on 2 gloo ranks, `--check` passes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mesh_plans  # noqa: E402

from parsat.backend.executor import operator_library  # noqa: E402
from parsat.cli import main  # noqa: E402
from parsat.dsl.parallel_ops import ALL_GATHER, COMBINE  # noqa: E402
from parsat.ir.megatron import megatron_pcg  # noqa: E402
from parsat.ir.models import build_example  # noqa: E402
from parsat.ir.placement import PARTIAL, shard_dim  # noqa: E402
from parsat.search.step import idle_pinned_axes  # noqa: E402

LIBRARY = operator_library()
GPT = dict(blocks=1, batch=4, seq=4, hidden=8, heads=2, vocab=16)


@pytest.mark.parametrize("sequence", [False, True])
def test_the_logits_are_never_gathered_and_the_loss_sums_vocabulary_shards(sequence):
    gpt = build_example("gpt", GPT, LIBRARY)
    pcg = megatron_pcg(gpt, LIBRARY, (1, 2), sequence=sequence, vocabulary_loss=True)
    vocab = GPT["vocab"]
    gathered = [n for n in pcg.nodes if n.kind == "parallel" and n.op in (COMBINE, ALL_GATHER) and n.shape[-1] == vocab]
    assert gathered == []
    ops = {n.op: n for n in pcg.nodes if n.kind == "op"}
    assert "logsumexp" not in ops and {"amax", "sumexp_shifted", "nll_sum"} <= set(ops)
    tp = pcg.mesh.names.index("tp")
    by_id = {n.id: n for n in pcg.nodes}
    for name in ("sumexp_shifted", "nll_sum"):   # each rank's part of a sum over the vocabulary: a partial sum
        node = ops[name]
        logits = by_id[node.inputs[0]]
        assert node.placement.codes[tp] == PARTIAL, (name, node.placement)
        assert logits.shape[-1] == vocab and shard_dim(logits.placement.codes[tp]) == len(logits.shape) - 1
    # no value of the loss reads as a sequence cut: `--degrees sp=1` still holds on the layout without it
    assert idle_pinned_axes(pcg, {"tp": 2}, sequence) == {}

def test_the_vocabulary_parallel_loss_trains_like_the_unmodified_module(tmp_path, capsys):
    gpt = build_example("gpt", GPT, LIBRARY)
    path = tmp_path / "tp.json"
    layout = megatron_pcg(gpt, LIBRARY, (1, 2), vocabulary_loss=True)
    path.write_text(json.dumps(mesh_plans.plan_dict(gpt, layout)), encoding="utf-8")
    code = main(["run", str(path), "--nproc", "2", "--backend", "gloo", "--steps", "2", "--json", "--check"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["check"] == "passed", result


def test_a_kin_graph_s_vocabulary_parallel_layout_is_rescaled_not_built_again():
    """`megatron_pcg`'s `kin`: the parts of the vocabulary-parallel logsumexp are no graph values, and a layout of
    the graph at another batch still rescales them (`_vocabulary_part`) into the layout built alone."""
    from parsat.ir.megatron import _rescaled

    small, large = (build_example("gpt", {**GPT, "batch": b}, LIBRARY) for b in (4, 8))
    for sequence in (False, True):
        layout = megatron_pcg(small, LIBRARY, (2, 2), sequence=sequence, vocabulary_loss=True)
        rescaled = _rescaled(layout, small, large)
        assert rescaled is not None and rescaled == megatron_pcg(large, LIBRARY, (2, 2), sequence=sequence,
                                                                 vocabulary_loss=True)
        assert any(n.op == "unflatten" and n.origin.endswith("_blocks") for n in rescaled.nodes)
