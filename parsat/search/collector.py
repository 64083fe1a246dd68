"""Python's cyclic garbage collector, paused while a search runs.

A search allocates millions of objects that live for one of its steps or
until it ends (e-graph snapshots, PCG nodes, priced candidates) and few
cycles. Every first-generation collection walks what is alive of the
objects made since the one before, so an object that outlives one interval
is walked once whatever the interval: at the interpreter's default
threshold (700 allocations) the collector ran 5,266 times in a bert-large:64
search and took 6.2 of its 54 CPU s; at 50,000, 50 times for 2.0 CPU s; at
200,000 (and the older generations every 1,000 collections below, so that
the survivors were not walked again) 118 times and 1.8-2.3 CPU s of
llama-70b:64's call (session 75; before it, benchmarks/search_results.md,
"the collector during a search", 2026-12-04 09:00-10:15, 2026-12-05 helper
L). At 2,000,000 it was the same 1.8: the objects walked are the ones that
outlive an interval, and most of a step's outlive any. Paused, none of the
objects that die before the search ends (each step's snapshots,
candidates and simulations) is ever walked: the collection as the search
ends walks what is left and frees the cycles the search made, and the
collector took 0.65 CPU s of the call (0.50 of them that one collection),
peak RSS 1,107 -> 1,178 MiB (the cycles held until then: 680,000 objects,
most of them the meshes' e-graphs' rule provenance and their memos; gpt-175b:1024's collector 2.11 -> 0.91
CPU s, peak RSS 894 -> 897 MiB). The recursive walks that left a
cycle per call (`dsl.work`, `dsl.instantiate.index_bounds`: 330,000 more
objects) are plain recursions now, and the two cycles that held the
e-graphs are gone (session 76): a snapshot's provenance and its two views of it
(`egraph.session.Provenance`, which all read one `_ProvenanceRows` now), and
a grid pass kept with its snapshot by an exclusion function that held the
snapshot (`baselines.megatron_excluded`). llama-70b:64's search leaves
2,094 objects to that collection (697,262 before), which took 0.13 CPU s
(0.46), and its peak RSS fell 1,239 -> 1,166 MiB.

Reference counting frees everything that is not a cycle either way. What
the collector frees is unreachable, so when it runs never changes what
the search computes (the call's memos keyed by an object's identity keep
that object alive beside the answer): the plan is the same.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from parsat.ir.collector import collection_paused


def paused_while_searching() -> AbstractContextManager[None]:
    """No cyclic collection until the search's block ends (a stage search inside the search leaves it paused),
    then the collector as the caller had it (`ir.collector.collection_paused`), also when the search raises."""
    return collection_paused()
