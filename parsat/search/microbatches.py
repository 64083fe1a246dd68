"""The unstaged search over micro-batch counts: the batch split only as far as memory makes it necessary.

A built-in example with a `batch` size is searched whole first; if the
best plan does not fit in memory, the batch is split into the fewest
micro-batches whose activations fit beside the weights' state (estimated
from that plan, `micro_batches_needed`, and searched again, doubling while
the plan still does not fit), so the plan that comes back fits whenever a
split of the batch makes one fit. Once a count fits, up to `REFINEMENTS`
more searches bisect between it and the largest count that failed (the
estimate can overshoot), and the fastest plan that fits wins. A plan that
fits without micro-batches is not split further: more micro-batches cost
latency and smaller kernels and save only memory.

Counts are compared by scouts (`step`: the first mesh and the baselines
built apart from the e-graph); once the search settles on a count, every
mesh is searched at that count (`search_every_mesh`), and the fastest plan
that fits, of every count, wins.

The counts share the call's clock: each gets a part of the time left
(`count_share`), and once it is spent no further count is searched: the
best plan found comes back, its `saturation.search_limit` saying what was
left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import Callable, Sequence

from parsat.cost.model import weight_bytes
from parsat.ir.errors import DoesNotFit, OptimizeError
from parsat.ir.plan import BASELINES, BaselinePlan, Plan
from parsat.ir.recompute import AUTO, NONE
from parsat.ir.units import fmt_bytes, fmt_bytes_pair
from parsat.search.deadline import Deadline
from parsat.search.request import SearchRequest, step_context
from parsat.search.step import search_step

GRID_SEARCHES = 2   # searches at more micro-batches spent finding a grid configuration that fits (at most)
EXPECTED_COUNTS = 4   # micro-batch counts a search usually makes (the first, an estimate, the count that keeps
                      # every activation, a refinement)
REFINEMENTS = 3   # searches spent looking for fewer micro-batches once a count fits (at most)


def search_unstaged(request: SearchRequest, clock: Deadline, microbatches: int | None = None,
                    searches: int | None = None, every_mesh: bool = True) -> Plan:
    """The cheapest unstaged plan (see the module docstring). `microbatches=m` runs the step as m micro-batches
    and searches that count only: a built-in example is built at its `batch` / m, any other graph is taken as
    one micro-batch's. `searches` caps the micro-batch counts searched while none fits (the last plan comes
    back, or DoesNotFit). Where the weights' state alone cannot fit, the call was refused before
    (`optimize.refuse_unfitting_state`)."""
    if microbatches is not None:   # its bound was checked before the rules loaded (`request.check_microbatches`)
        return search_step(step_context(request, microbatches), clock)
    if request.batch is None:
        return search_step(step_context(request, 1), clock.part(1.0))   # no batch to split: one search
    search = CountSearch(request, clock, searches, every_mesh)
    try:
        return search.run()
    except DoesNotFit as err:
        # raised again without the frames it passed: they hold it (`after`'s and `split_further`'s `needed`),
        # and it them, a reference cycle through which the call's memos (`request`) outlived the call until a
        # full collection of the cyclic collector freed them (llama-70b:64: 2.3 million objects, 2.2 CPU s, in
        # whatever ran after the call). The caller reads its message and figures, never its traceback.
        raise err.with_traceback(None)
    finally:
        search.needed = None   # it holds, in its traceback, the frames that hold this search


def count_share(searched: int) -> float:
    """The part of the time left for the `searched`-th micro-batch count's search: half for the first (the one
    always made, and the one that pays for compiling the rules on every mesh), equal parts of what is left for
    the others expected, half of what they leave for any further one."""
    if searched == 1:
        return 0.5
    return 1.0 / (EXPECTED_COUNTS + 1 - searched) if searched <= EXPECTED_COUNTS else 0.5


@dataclass
class CountSearch:
    """The search over micro-batch counts of one built-in example's batch: what it has tried and found so far."""

    request: SearchRequest
    clock: Deadline
    searches: int | None
    every_mesh: bool = True         # search every mesh at the count chosen (else the caller may: `every_mesh_at`)
    m: int = 1
    tried: set[int] = field(default_factory=set)
    failed: int = 0                 # the largest count at which keeping every activation did not fit
    best: Plan | None = None        # the fastest plan that fits
    plans: list[Plan] = field(default_factory=list)
    refined: int = 0
    kept_tried: bool = False        # whether the count at which keeping every activation fits was tried
    needed: DoesNotFit | None = None   # why the last count searched found no plan that fits (dropped at the end)

    @property
    def batch(self) -> int:
        return self.request.batch

    def search(self, k: int, share: float) -> Plan:
        """The scout's plan of `k` micro-batches, within `share` of the time left."""
        return search_step(step_context(self.request, k, scout=True), self.clock.part(share))

    def search_every_mesh(self, chosen: Plan) -> Plan:
        """Every mesh searched at the count of `chosen` (`every_mesh_at`) unless the caller does it: the plan of
        the two ranked first (`rank_plans`), the one of every mesh on a tie. Kept in `plans` and `best`."""
        full = every_mesh_at(self.request, self.clock, chosen) if self.every_mesh else chosen
        if full.saturation.get("scouted"):
            return full
        self.plans.insert(0, full)
        self.keep_if_best(full, wins_ties=True)
        return min((full, chosen), key=rank_plans)

    def keep_if_best(self, plan: Plan, wins_ties: bool = False) -> None:
        """`plan` becomes `best` when it fits and is faster (or, `wins_ties`, as fast)."""
        if not plan.totals.fits(plan.machine):
            return
        if self.best is None or plan.totals.time_s < self.best.totals.time_s or \
                (wins_ties and plan.totals.time_s == self.best.totals.time_s):
            self.best = plan

    def run(self) -> Plan:
        while True:
            if self.tried and self.clock.spent:
                return self.cut_short(f"micro-batch count {self.m} not searched: {self.clock.why_spent()}")
            self.tried.add(self.m)
            try:
                plan, self.needed = self.search(self.m, count_share(len(self.tried))), None
            except KeyboardInterrupt:
                self.clock.interrupt()
                if self.best is None and not self.plans:
                    raise
                return self.cut_short(f"micro-batch count {self.m} not searched: interrupted (Ctrl-C)")
            except DoesNotFit as err:
                plan, self.needed = None, err
            except OptimizeError as err:
                if len(self.tried) == 1 or (self.best is None and not self.plans):
                    raise
                # a later count's search that its part of the time limit cut short: the counts searched stand
                return self.cut_short(f"micro-batch count {self.m}: {err}")
            done = self.after(plan, self.needed)
            if done is not None:
                return done

    def after(self, plan: Plan | None, needed: DoesNotFit | None) -> Plan | None:
        """Record the plan searched at the current count and choose the next count; the answer when done."""
        m = self.m
        if plan is not None:
            self.plans.append(plan)
            self.keep_if_best(plan)
        fits = plan is not None and plan.totals.fits(plan.machine)
        recomputes = plan is not None and plan.pcg.recompute != NONE
        if fits and m == 1 and not recomputes:
            return self.search_every_mesh(plan)
        if not fits or recomputes:   # a count at which keeping every activation does not fit
            self.failed = max(self.failed, m)
        if fits and recomputes and self.try_keeping_activations(plan):
            return None
        if self.best is not None:
            return self.refine()
        return self.split_further(plan, needed)

    def try_keeping_activations(self, plan: Plan) -> bool:
        """Recomputing costs a forward per step: more micro-batches that keep every activation may run faster.
        Whether that count is searched next."""
        if self.kept_tried or self.request.recompute != AUTO:
            return False
        self.kept_tried = True
        more = micro_batches_needed(plan, self.batch, self.m)
        if more is None or more in self.tried or (self.searches is not None and len(self.tried) >= self.searches):
            return False
        self.request.say(f"a plan fits with {self.m} micro-batch(es) by recomputing activations: trying {more}, "
                         "where keeping them may fit")
        self.m = more
        return True

    def refine(self) -> Plan | None:
        """A count fits: the estimate that led to it may have overshot, and fewer micro-batches run faster (larger
        kernels, fewer activation collectives), so bisect towards the largest count that failed."""
        fewer = fewer_micro_batches(self.batch, self.failed, self.best.graph.microbatches, self.tried)
        if fewer is None or self.refined == REFINEMENTS:
            self.search_every_mesh(self.best)
            # beside a pipeline search, the grid's pipelined points stand in for more unstaged searches
            return with_grid(self.best, self.plans, self.tried, self.batch, self.request.say, self.search,
                             GRID_SEARCHES if self.searches is None else 0, self.clock)
        self.refined += 1
        self.request.say(f"a plan fits with {self.best.graph.microbatches} micro-batches: trying {fewer}")
        self.m = fewer
        return None

    def split_further(self, plan: Plan | None, needed: DoesNotFit | None) -> Plan | None:
        """Nothing fits yet: more micro-batches, estimated from the plan (or the smallest plan's memory); the
        last plan (or DoesNotFit) when no further count is to be searched."""
        m, batch = self.m, self.batch
        more = (micro_batches_needed(plan, batch, m) if plan is not None else
                more_micro_batches(needed, self.request, m))
        if more is not None and m > 1:
            # the first estimate (from one whole batch) saves searches; later ones only double: memory is not
            # monotone in m (a micro-batch that no longer divides among the data-parallel devices needs tensor
            # parallelism), so a far jump can pass over the count that fits best
            more = min(more, next_count(batch, 2 * m) or more)
        if more is None or more in self.tried or (self.searches is not None and len(self.tried) >= self.searches):
            if plan is not None:
                return self.search_every_mesh(plan)
            raise needed
        held = ("the plan needs {} per device of {}".format(
                    *fmt_bytes_pair(plan.totals.memory_bytes, plan.machine.memory_capacity))
                if plan is not None else
                f"no plan fits with {m} micro-batch(es) ({fmt_bytes(needed.needed_bytes)} per device needed)")
        self.request.say(f"{held}: searching again with {more} micro-batches")
        self.m = more
        return None

    def cut_short(self, why: str) -> Plan:
        """The best plan found so far (else the leanest), saying what the time limit left out."""
        self.request.say(why)
        if self.best is not None:
            return limited(with_grid(self.best, self.plans, self.tried, self.batch, self.request.say, self.search,
                                     0), why)
        if self.plans:
            return limited(min(self.plans, key=lambda p: p.totals.memory_bytes), why)
        raise DoesNotFit(f"{self.needed} ({why}; raise the limit to search it)", self.needed.needed_bytes,
                         self.needed.capacity_bytes)


def every_mesh_at(request: SearchRequest, clock: Deadline, chosen: Plan) -> Plan:
    """Every mesh searched at the micro-batch count of `chosen`, a scout's plan. `chosen` itself (a scout's
    plan still) when it is not a scout's or that search finds no plan (said), and, saying so in
    `saturation.search_limit`, when the clock is spent (`--limit seconds` or Ctrl-C) or Ctrl-C cuts that search."""
    if not chosen.saturation.get("scouted"):
        return chosen
    m = chosen.graph.microbatches
    if clock.spent:
        return limited(chosen, f"every mesh at micro-batch count {m} not searched: {clock.why_spent()}")
    request.say(f"micro-batch count {m} chosen: searching every mesh")
    try:
        return search_step(step_context(request, m), clock.part(1.0))
    except KeyboardInterrupt:
        clock.interrupt()
        return limited(chosen, f"interrupted (Ctrl-C): every mesh at micro-batch count {m} not searched")
    except OptimizeError as err:   # DoesNotFit too: the scout's plan stands
        request.say(f"micro-batch count {m}, every mesh: {err}")
        return chosen


def merged(full: Plan, chosen: Plan, batch: int, say: Callable[[str], None]) -> Plan:
    """`chosen` (a scout's plan) or `full` (`every_mesh_at` its count), whichever ranks first, with the better
    of their baselines (`with_grid`); `full` when no search of every mesh came of it."""
    if full.saturation.get("scouted"):
        return full
    return with_grid(full, [full, chosen], set(), batch, say, None, 0)


def rank_plans(plan: Plan) -> tuple:
    """Plans that fit first, then the fastest; when none fits, the one needing least memory."""
    fits = plan.totals.fits(plan.machine)
    return (not fits, plan.totals.time_s if fits else plan.totals.memory_bytes)


def limited(plan: Plan, why: str) -> Plan:
    """`plan`, saying in `saturation.search_limit` what the search's time limit left out (after what its own
    search already said there: which limit cut it, `step`)."""
    said = "; ".join(dict.fromkeys(filter(None, (plan.saturation.get("search_limit"), why))))
    return replace(plan, saturation={**dict(plan.saturation), "search_limit": said})


def next_count(batch: int, least: int, skip: set[int] = frozenset()) -> int | None:
    """The smallest micro-batch count from `least` on that divides `batch` and is not in `skip`."""
    return next((k for k in range(least, batch + 1) if batch % k == 0 and k not in skip), None)


def with_grid(best: Plan, plans: Sequence[Plan], tried: set[int], batch: int, say: Callable[[str], None],
              search: Callable[[int, float], Plan] | None, extra: int = GRID_SEARCHES,
              clock: Deadline | None = None) -> Plan:
    """`best` compared with every baseline at every micro-batch count searched: Megatron-style grids choose
    their micro-batch count too, and theirs may be larger than the joint plan's (tensor parallelism of one
    sequence per data-parallel rank). While no grid configuration fits, up to `extra` searches at
    twice the micro-batches are added (by `search`). A baseline faster than the joint plan at its own count makes that
    search's plan the answer (it is a whole plan at that count); otherwise each baseline's best totals across
    counts are kept, with the count in its configuration, and its PCG when it was found at `best`'s count."""
    plans = list(plans)

    def fitting(name: str) -> list[Plan]:
        return [p for p in plans if p.baselines.get(name) is not None and p.baselines[name].fits(p.machine)]

    if "best_grid" in best.baselines:   # baselines were asked for
        m = max(p.graph.microbatches for p in plans)
        for _ in range(extra):
            if fitting("best_grid") or (clock is not None and clock.spent):
                break
            m = next_count(batch, 2 * m, tried)
            if m is None:
                break
            tried.add(m)
            say(f"no grid configuration fits at the micro-batch counts searched: searching {m} for the baselines")
            try:
                plans.append(search(m, 0.5))
            except DoesNotFit:
                continue
    best = min((p for p in plans if p.totals.fits(p.machine)), key=lambda p: p.totals.time_s, default=best)
    baselines, baseline_plans = dict(best.baselines), dict(best.baseline_plans)
    for name in BASELINES:
        found = fitting(name)
        if not found:
            continue
        # the fastest that fits, `best`'s own on a tie (then it is already in place, with its PCG)
        source = min(found, key=lambda p: (p.baselines[name].time_s, p is not best))
        if source is best:
            continue
        baselines[name] = source.baselines[name]
        kept = source.baseline_plans.get(name)
        config = {**dict((kept and kept.config) or {}), "microbatches": source.graph.microbatches}
        baseline_plans[name] = BaselinePlan(None, {}, config)   # found at another count: no PCG for this graph
    return replace(best, baselines=baselines, baseline_plans=baseline_plans)


def fewer_micro_batches(batch: int, failed: int, fits: int, tried: set[int]) -> int | None:
    """A count of micro-batches (a divisor of `batch`) between the largest that failed and one that fits, near
    their geometric middle; None when no untried count lies between."""
    between = [k for k in range(failed + 1, fits) if batch % k == 0 and k not in tried]
    if not between:
        return None
    middle = (max(failed, 1) * fits) ** 0.5
    return min(between, key=lambda k: (abs(k - middle), k))


def more_micro_batches(err: DoesNotFit, request: SearchRequest, m: int) -> int | None:
    """More micro-batches after no plan fit at `m`: the smallest plan's memory less a lower bound of the
    weights' state (every weight sharded over every device, ZeRO-3) is taken as activations, which shrink
    with the micro-batch; at least twice `m`."""
    batch, machine = request.batch, request.machine
    state = sum(prod(w.shape) for w in request.whole.weights) * weight_bytes(machine) / machine.devices
    room = err.capacity_bytes - state
    if room <= 0:
        return None
    wanted = max(2 * m, m * (err.needed_bytes - state) / room)
    return next((k for k in range(m + 1, batch + 1) if batch % k == 0 and k >= wanted), None)


def micro_batches_needed(plan: Plan, batch: int, m: int) -> int | None:
    """The fewest micro-batches (a divisor of `batch`, more than `m`) whose activations fit beside the weights'
    state, estimated from `plan` at `m` micro-batches: its activations shrink by m / m', its weights' state
    does not. None when the weights' state alone does not fit (splitting the batch cannot help). For a plan
    that recomputes (`ir.recompute`), the count at which keeping every activation would fit: its kept ones and
    every block's recomputed ones (`transient_bytes`, one block's per node that carries any)."""
    costs = plan.costs.values()
    transient = [c.transient_bytes for c in costs]
    kept = sum(c.activation_bytes for c in costs)
    activations = kept + sum(transient)
    state = plan.totals.peak_memory_bytes - kept - max(transient, default=0)
    room = plan.machine.memory_capacity - state
    if room <= 0 or activations <= 0:
        return None
    wanted = m * activations / room
    for k in range(m + 1, batch + 1):
        if batch % k == 0 and k >= wanted:
            return k
    return None
