"""Python's cyclic garbage collector paused while bulk data is built.

A collection walks every object of the generation it collects, and building
many objects that all live on (a graph's 100,001 nodes read from JSON, its
dict for the plan file, its text loaded into egglog) keeps promoting them
and so keeps triggering full collections over everything the process
holds, which find next to nothing: `optimize` of the 100,001-tensor chain
spent about 5 of its 21 CPU s in collections that found 8,000 unreachable
objects (1.4 s of them while loading into egglog). The builders pause it;
what they made is collected as usual after.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collection_paused() -> Iterator[None]:
    """No cyclic collection inside the block (reference counting still frees what dies); the collector is on
    again after it, as it was before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
