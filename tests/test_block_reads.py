"""Sharding through reshapes: dims read block by block (`j * k + r`, `j / n`).

The spread analysis accepts exactly the index shapes that keep a block of
the output inside one block of the input; the verifier proves the true
rules and refutes the wrong ones.
"""

from __future__ import annotations

import pytest

from parsat.dsl.checker import check_paths
from parsat.verifier.api import verify_paths

TRUE_RULES = '''import "ops.rule"

rule unflatten_rows_parallel:
  forall x: [m, n], k: int, p: degree
  where m % k == 0, (m / k) % p == 0
  unflatten(partition(x, 0, p), 0, k) => partition(unflatten(x, 0, k), 0, p)

rule flatten_rows_parallel:
  forall x: [m, n, c], p: degree
  where m % p == 0
  flatten(partition(x, 0, p), 0) => partition(flatten(x, 0), 0, p)

rule heads_parallel:
  forall x: [b, h, d], p: degree
  where h % p == 0
  unflatten(partition(flatten(x, 1), 1, p), 1, d) => partition(x, 1, p)
'''


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PARSAT_CACHE_DIR", str(tmp_path / "cache"))


def test_block_reads_are_accepted_and_proved(write_rules, cache):
    path = write_rules(TRUE_RULES)
    assert check_paths([path]).diagnostics == []
    report = verify_paths([path])
    assert [v.verdict for v in report.verdicts] == ["PROVED"] * 3, [v.reason for v in report.verdicts]


def test_flatten_sharded_on_the_inner_dim_is_refused(diagnostics):
    found = diagnostics("""
        rule r:
          forall x: [m, n], p: degree
          where n % p == 0
          flatten(partition(x, 1, p), 0) => partition(flatten(x, 0), 0, p)
    """)
    assert len(found) == 1 and found[0].kind == "illegal-spread"
    assert "dim 1 of 'x' is sharded (p) but is read at j % n" in found[0].message


def test_unflatten_requires_the_split_range_to_divide(diagnostics):
    # sharding rows of x by p is not enough: the new leading dim (m / k) must split too
    found = diagnostics("""
        rule r:
          forall x: [4, n], p: degree
          where p == 2
          unflatten(partition(x, 0, p), 0, 4) => partition(unflatten(x, 0, 4), 0, p)
    """)
    assert len(found) == 1 and found[0].kind == "never"


def test_unflatten_sharded_on_the_wrong_output_dim_is_refuted(write_rules, cache):
    path = write_rules('''import "ops.rule"
rule wrong_dim:
  forall x: [m, n], k: int, p: degree
  where m % k == 0, (m / k) % p == 0, k % p == 0
  unflatten(partition(x, 0, p), 0, k) => partition(unflatten(x, 0, k), 1, p)
''')
    (verdict,) = verify_paths([path]).verdicts
    assert verdict.verdict == "REFUTED"
