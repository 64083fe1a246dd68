"""A search's memos are freed by reference counting when it ends, not left in a reference cycle for the cyclic
collector: llama-70b:64's unstaged search raised DoesNotFit, whose traceback held the frames that held it, and
the whole call's memos (2.3 million objects) waited for a full collection (2.2 CPU s) after the call."""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import replace

import parsat.search.microbatches as microbatches
from parsat.egraph.runner import Limits
from parsat.ir.errors import DoesNotFit
from parsat.ir.machine import Machine
from parsat.search.deadline import Deadline
from parsat.search.request import resolve_request


def test_an_unstaged_search_that_fits_nothing_frees_its_request_without_the_collector():
    machine = replace(Machine.resolve("cpu"), memory_capacity=1024)   # nothing fits, not even the weights' state
    request = resolve_request("mlp", machine, None, None, 2, baselines=False)
    held = weakref.ref(request)
    collecting = gc.isenabled()
    gc.disable()
    try:
        message = ""
        try:
            microbatches.search_unstaged(request, Deadline(time.perf_counter() + 600, Limits()))
        except DoesNotFit as err:   # raised again by the count search (`split_further`) after it stored it
            message = str(err)
        assert "no plan fits" in message
        del request
        assert held() is None   # no cycle keeps it: freed as its last reference went
    finally:
        if collecting:
            gc.enable()
