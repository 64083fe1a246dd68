"""Python's cyclic garbage collector, collecting less often while a search runs.

A search allocates millions of small objects that live until it ends (e-graph
snapshots, PCG nodes, priced candidates) and few cycles. At the interpreter's
default first-generation threshold (700 allocations) the collector ran 5,266
times in a bert-large:64 search and took 6.2 of its 54 CPU s, rescanning the
same live objects; at 50,000 it ran 50 times for 2.0 CPU s, with the same plan
(benchmarks/search_results.md, "the collector during a search"). Reference counting frees
everything that is not a cycle either way, so memory grows only by the
cycles left for later.

The thresholds are the process's, so they are set for the search's duration
and put back after it, also when it raises; a search inside another (the
pipeline's stage searches) leaves them as the outer one set them.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

SEARCH_THRESHOLD = 50_000   # allocations between first-generation collections during a search (Python's: 700)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Collect the first generation every `SEARCH_THRESHOLD` allocations (at least: never more often than the
    caller had it) until the block ends, then restore the thresholds as they were."""
    before = gc.get_threshold()
    if before[0] != 0 and before[0] < SEARCH_THRESHOLD:   # 0: collection is off (the caller's choice), kept
        gc.set_threshold(SEARCH_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
