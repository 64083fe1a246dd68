"""Verdict cache: warm runs reuse verdicts; a changed operator invalidates them."""

from dataclasses import replace

from parsat.dsl.library import load_library
from parsat.verifier.api import verify_library
from parsat.verifier.cache import VerdictCache, rule_key

RULE = """
import "ops.rule"
rule row:
  forall x: [m, k], w: [k, n], p: degree
  where m % p == 0
  matmul(partition(x, 0, p), replicate(w, p)) => partition(matmul(x, w), 0, p)
"""


def test_warm_run_hits_the_cache(tmp_path):
    path = tmp_path / "r.rule"
    path.write_text(RULE)
    library, _ = load_library([path])
    cache = VerdictCache(tmp_path / "cache")
    files = {str(r.span.file) for r in library.rules}
    cold = verify_library(library, cache=cache, only_files=files)
    warm = verify_library(library, cache=cache, only_files=files)
    assert [v.verdict for v in cold.verdicts] == ["PROVED"] and not cold.verdicts[0].cached
    assert [v.verdict for v in warm.verdicts] == ["PROVED"] and warm.verdicts[0].cached


def test_key_depends_on_rule_and_used_operators_not_on_docs(tmp_path):
    path = tmp_path / "r.rule"
    path.write_text(RULE)
    library, _ = load_library([path])
    rule, ops = library.rule("row"), library.ops
    key = rule_key(rule, ops, "v")
    assert rule_key(replace(rule, doc=("a comment",)), ops, "v") == key
    assert rule_key(rule, ops, "w") != key
    changed = dict(ops, matmul=replace(ops["matmul"], body=ops["add"].body))
    assert rule_key(rule, changed, "v") != key
    unrelated = dict(ops, relu=replace(ops["relu"], body=ops["add"].body))
    assert rule_key(rule, unrelated, "v") == key
