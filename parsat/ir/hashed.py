"""A frozen dataclass's hash worked out once per object and kept beside it.

A search keys its memos by whole PCGs and graphs (`search.mesh.CandidateSteps`: simulated steps by PCG;
`search.step.built_once`, `searched_once`, `independent_points`: by the step's graph), and the hash a frozen
dataclass generates walks every field on every call: a llama-70b stage PCG's ~15,000 nodes, each hashing its
shape, degrees and placement, ~7 ms a call. llama-70b:64 hashed 40 distinct PCGs 98 times (0.7 CPU s) and 23
graphs 135 times (0.25 CPU s). Kept, the second and later hashes are a dict read.

Why it is the same hash: the value is the one the dataclass would generate (the fields that take part in
comparison, in order, hashed as one tuple), and those fields never change once the object is made (frozen;
the only writes to such an object's `__dict__`, `ir.pcg.PCG.reshaped` and `ir.pcg.restated`, set
facts worked out from the fields, never a field). It is not pickled (`state_without_hash`): str hashes differ
between processes (hash randomisation), so a kept hash is only good in the process that worked it out.
"""

from __future__ import annotations

from dataclasses import fields

HASH_KEY = "_hash_once"   # the `__dict__` entry holding the kept hash (no field has this name)


def hash_once(obj) -> int:
    """`obj`'s dataclass hash (its compared fields as one tuple), worked out on the first call and kept."""
    found = obj.__dict__.get(HASH_KEY)
    if found is None:
        found = obj.__dict__[HASH_KEY] = hash(tuple(getattr(obj, f.name) for f in fields(obj)
                                                           if (f.compare if f.hash is None else f.hash)))
    return found


def state_without_hash(obj) -> dict:
    """`obj`'s `__dict__` for pickling and copying, less the kept hash (good in this process only)."""
    state = dict(obj.__dict__)
    state.pop(HASH_KEY, None)
    return state
