"""Forked workers (the verifier's and the generator's pools) never free what they inherited from the parent: a
child that frees an egglog e-graph waits forever on egglog's thread pool, whose threads were not forked (this
hung the whole suite once a search had left an e-graph in a reference cycle before `verify --jobs 2`)."""

from __future__ import annotations

import gc
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from parsat.dsl.lifetime import end_children, process_pool
from parsat.egraph.session import bindings


def _collect_in_child() -> int:
    return gc.collect() >= 0


def test_a_forked_worker_does_not_free_the_parent_s_e_graphs():
    egraph = bindings.EGraph()
    egraph.run_program(*egraph.parse_program("(datatype E (Num i64)) (let a (Num 1))"))
    cycle = {"egraph": egraph}
    cycle["self"] = cycle          # garbage only the cycle collector frees
    del egraph, cycle
    gc.disable()                   # ... and it has not yet, when the pool forks
    try:
        with process_pool(1) as pool:
            future = pool.submit(_collect_in_child)
            try:
                assert future.result(timeout=60)
            except FutureTimeout:
                end_children()
                pytest.fail("a forked worker hung freeing an e-graph it inherited")
    finally:
        gc.enable()
