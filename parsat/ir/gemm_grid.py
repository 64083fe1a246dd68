"""Measured GEMM rates on a grid of shapes, read between its points: a calibrated machine's price of a product.

`parsat calibrate` times products on a tensor grid of (m, n, k) (each of
m, n and k on the same few sizes: `backend.calibrate.GRID_DIVISORS`, a
quarter, a half and all of `--size`), forward and in both backward
layouts. A `GemmGrid` keeps what each reached, as a fraction of the
machine's peak FLOP/s, and prices a product at any (m, n, k):

* inside the grid's box, the fractions read between the eight grid points
  around it, linearly in log2 of each size (trilinear in log space: a
  product twice as large in one dimension sits one step further along it),
  on the logarithm of the fraction (rates multiply);
* outside the box (a dimension smaller than the smallest node or larger
  than the largest), the fraction at the nearest point of the box, times
  how much the machine's fitted Hockney curve (`OpEfficiency`'s half
  lengths) changes from there to the shape: the fit only where nothing was
  measured.

Why not the fit everywhere: the Hockney fit trades its peak against its
half lengths, so calibrations whose measured products agree within 1.08x
priced the demo's [128, 784] @ [784, 256] 1.24x apart, and single grid
shapes missed by up to 35% (benchmarks/demo_step.md, 2026-12-06 session 67
helper C). A product at a grid point is priced as it was measured.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from math import exp, log, log2, prod
from typing import Callable, Sequence

Curve = Callable[[float, float, float], float]
"""The fitted efficiency of an (m, n, k) product (a fraction of peak), used where the grid measured nothing."""


@dataclass(frozen=True)
class GemmGrid:
    """One layout's measured fractions of peak on the grid `ms` x `ns` x `ks` (sizes growing), `fractions` in
    m-major order (index (i * len(ns) + j) * len(ks) + l for ms[i], ns[j], ks[l])."""

    layout: str                       # "nn" (forward), "nt" (g @ w^T), "tn" (x^T @ g): `OpEfficiency`'s layouts
    ms: tuple[float, ...]
    ns: tuple[float, ...]
    ks: tuple[float, ...]
    fractions: tuple[float, ...]
    logs: tuple[float, ...] = field(init=False, repr=False, compare=False)   # log of each fraction (read often)

    def __post_init__(self) -> None:
        if len(self.fractions) != len(self.ms) * len(self.ns) * len(self.ks):
            raise ValueError(f"a {len(self.ms)} x {len(self.ns)} x {len(self.ks)} grid needs as many fractions, "
                             f"got {len(self.fractions)}")
        object.__setattr__(self, "logs", tuple(log(f) for f in self.fractions))

    def fraction(self, m: float, n: float, k: float, curve: Curve) -> float:
        """The fraction of peak an m x k by k x n product reaches: measured on the grid, read between its points
        in log space; outside its box the box's nearest point times `curve`'s change from there (module doc)."""
        shape = (m, n, k)
        inside = tuple(min(max(x, nodes[0]), nodes[-1]) for x, nodes in zip(shape, (self.ms, self.ns, self.ks)))
        width, depth = len(self.ns), len(self.ks)
        rows, cols, inner = (_bracket(nodes, x) for nodes, x in zip((self.ms, self.ns, self.ks), inside))
        logged = sum(wi * wj * wl * self.logs[(i * width + j) * depth + l] for i, wi in rows for j, wj in cols
                     for l, wl in inner)
        measured = exp(logged)
        return measured if inside == shape else measured * curve(*shape) / curve(*inside)

    def to_dict(self) -> dict:
        return {"m": list(self.ms), "n": list(self.ns), "k": list(self.ks), "fractions": list(self.fractions)}

    @staticmethod
    def from_dict(layout: str, data: dict) -> "GemmGrid":
        """A grid from its machine-file object (checked by `ir.validate`)."""
        return GemmGrid(layout, *(tuple(float(x) for x in data[key]) for key in ("m", "n", "k", "fractions")))


def _bracket(nodes: Sequence[float], x: float) -> tuple[tuple[int, float], ...]:
    """The one or two nodes around `x` (within the nodes' range) and their weights, linear in log2."""
    if len(nodes) == 1 or x <= nodes[0]:
        return ((0, 1.0),)
    upper = bisect_left(nodes, x)
    if x == nodes[upper]:
        return ((upper, 1.0),)
    t = (log2(x) - log2(nodes[upper - 1])) / (log2(nodes[upper]) - log2(nodes[upper - 1]))
    return ((upper - 1, 1.0 - t), (upper, t))


def grid_fractions(layout: str, measured: dict[tuple[int, int, int], float], nodes: Sequence[int], peak: float,
                   dispatch_s: float) -> GemmGrid | None:
    """The grid of `layout` on `nodes` (the sizes m, n and k each take) from `measured` (m, n, k) -> seconds a
    call: each point's fraction its FLOPs over `peak` x (its seconds less `dispatch_s`, the fixed cost the cost
    model adds to every call). None where fewer than two nodes were given, a point was not measured, or a call
    took no longer than its dispatch (nothing to read a rate from)."""
    axis = tuple(sorted(set(nodes)))
    shapes = [(a, b, c) for a in axis for b in axis for c in axis]
    if len(axis) < 2 or any(s not in measured or measured[s] <= dispatch_s for s in shapes):
        return None
    fractions = tuple(2.0 * prod(s) / (peak * (measured[s] - dispatch_s)) for s in shapes)
    nodes_f = tuple(float(x) for x in axis)
    return GemmGrid(layout, nodes_f, nodes_f, nodes_f, fractions)


__all__ = ["Curve", "GemmGrid", "grid_fractions"]
