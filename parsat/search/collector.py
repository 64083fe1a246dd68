"""Python's cyclic garbage collector, collecting less often while a search runs.

A search allocates millions of small objects that live until it ends (e-graph
snapshots, PCG nodes, priced candidates) and few cycles. At the interpreter's
default first-generation threshold (700 allocations) the collector ran 5,266
times in a bert-large:64 search and took 6.2 of its 54 CPU s, rescanning the
same live objects; at 50,000 it ran 50 times for 2.0 CPU s, with the same plan
(benchmarks/search_results.md, "the collector during a search"). Reference counting frees
everything that is not a cycle either way, so memory grows only by the
cycles left for later.

The older generations are collected less often too (`OLDER_THRESHOLD`): a
second-generation collection rescans every survivor of the first (the
search's snapshots, priced candidates, laid-out grids: hundreds of
thousands of objects), and at Python's 10 first-generation collections per
second-generation one it ran 10 times in a llama-7b:64 search and a full
collection once, 0.4-0.8 of the collector's 0.9-1.5 CPU s; at 100 it ran
7 times and the full collection not at all, the collector taking 0.66-0.71
CPU s, peak RSS 445 -> 450 MiB (benchmarks/search_results.md, 2026-12-04
09:00-10:15). What the collector frees is unreachable: when it runs never
changes what the search computes (the call's memos keyed by an object's
identity keep that object alive beside the answer), so the plan is the same.

Once the search's own reference cycles were gone (an error held in a local of a frame its traceback holds:
`search.extract`, `search.microbatches`, `search.optimize`), what the older generations found was survivors
to rescan, not garbage: on llama-70b:64 the first generation every 200,000 allocations and the older ones
every 1,000 collections below took the collector from 2.2 to 1.1 CPU s (the middle generation's collections
from 0.9-1.2 CPU s to under 0.01), peak RSS 1,214 -> 1,213 MiB (benchmarks/search_results.md, 2026-12-05,
helper L).

The thresholds are the process's, so they are set for the search's duration
and put back after it, also when it raises; a search inside another (the
pipeline's stage searches) leaves them as the outer one set them.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

SEARCH_THRESHOLD = 200_000  # allocations between first-generation collections during a search (Python's: 700)
OLDER_THRESHOLD = 1_000     # collections of the generation below between older ones, during a search (Python's: 10)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Collect the first generation every `SEARCH_THRESHOLD` allocations and each older one every
    `OLDER_THRESHOLD` collections of the one below (at least: never more often than the caller had it) until the
    block ends, then restore the thresholds as they were."""
    before = gc.get_threshold()
    if before[0] != 0:   # 0: collection is off (the caller's choice), kept
        gc.set_threshold(max(before[0], SEARCH_THRESHOLD), *(max(t, OLDER_THRESHOLD) for t in before[1:]))
    try:
        yield
    finally:
        gc.set_threshold(*before)
