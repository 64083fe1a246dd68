"""The order in which the pipeline search's (degree, micro-batch count) pairs are searched
(`pipeline_search.search_order`): the least 1F1B bubble first, and the plan the same as in the degree-major
order the search used before (the order decides which pairs a bar skips, not what is chosen)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import parsat.search.pipeline_search as pipeline_search
from parsat.ir.machine import Machine
from parsat.ir.plan import without_timing
from parsat.search.optimize import optimize
from parsat.search.pipeline_search import search_order

SIZES = {"blocks": 4, "batch": 16, "seq": 128, "hidden": 64, "heads": 4, "vocab": 128}


def test_pairs_come_least_bubble_first_ties_in_the_given_order():
    # llama-70b:64's pairs, degree-major as `search_pipelines` lists them: bubbles 3/19, 3/35, 7/39, 7/71
    assert search_order([(4, 16), (4, 32), (8, 32), (8, 64)]) == [(4, 32), (8, 64), (4, 16), (8, 32)]
    # (2, 4) and (4, 12): both 1/5, kept as given
    assert search_order([(4, 12), (2, 4), (2, 8)]) == [(2, 8), (4, 12), (2, 4)]
    assert search_order([(2, 4), (4, 12)]) == [(2, 4), (4, 12)]


def _plan(monkeypatch, order):
    """A 4-block gpt on 8 CPU devices of 3 MiB (its pipelined plan wins), its pairs searched in `order`."""
    with monkeypatch.context() as patch:
        patch.setattr(pipeline_search, "search_order", order)
        small = replace(Machine.resolve("cpu"), memory_capacity=3 * 2 ** 20)
        return optimize("gpt", small, devices=8, sizes=SIZES, pipeline=True)


def test_the_plan_is_the_degree_major_order_s(monkeypatch):
    """Searched least bubble first and degree-major (as before), the plan is the same in every figure but the
    pipeline search's trace, which lists the same pairs in the order searched."""
    plans = [_plan(monkeypatch, order) for order in (search_order, list)]
    assert all(plan.pipeline is not None for plan in plans)   # a pipelined plan: the pairs' plans were compared
    traces = [plan.saturation["pipeline_search"] for plan in plans]
    searched = [list(dict.fromkeys((t["pp"], t["microbatches"]) for t in trace)) for trace in traces]
    assert searched[0] == search_order(searched[1]) and len(searched[0]) >= 2 and searched[0] != searched[1]
    stripped = [without_timing(json.loads(plan.to_json())) for plan in plans]
    for plan in stripped:
        plan["saturation"].pop("pipeline_search")
    assert stripped[0] == stripped[1]
