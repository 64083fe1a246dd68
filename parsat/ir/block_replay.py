"""A block's run of operators laid out as a layout builder laid an alike block's run out before it, renamed and
renumbered, rather than placed operator by operator again: the mechanism the directly built layouts share
(`ir.megatron`'s Megatron-LM layout, `ir.data_parallel`'s data parallelism; issue 28: llama-70b's 80 blocks,
each placed operator by operator in every layout the independent grid builds).

The builders place a graph's operators one after another, in graph order, each step reading the graph, caches
whose entries are functions of what they are keyed by, and the builder's state (the nodes so far and the tables
that say which node holds a graph value). `BlockReplay` holds what every builder's replay does alike: the
graph's runs of one block (`block_runs`), the template (the last run placed operator by operator, kept where
its builder says it may be replayed), the check that a later run is the template's renamed (`_moved`: the
same operators, attributes, shapes and inputs, each value it names alike by the builder's `value`), and the
nodes appended, the template's renamed and renumbered. What a builder's state is, what a run read of it from
outside its block and what it added, the builder's replay says (`record`, `completed`, `outside`, `added`): it
argues there why each step of a replayed run reads what the template's read, renamed, so the same nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from parsat.ir.blocks import OUTSIDE, block_of, in_block
from parsat.ir.graph import Graph
from parsat.ir.pcg import PNode


def block_runs(graph: Graph) -> tuple[tuple[int, tuple], ...]:
    """The graph's nodes in order, cut into runs of one block (`ir.blocks.block_of`; OUTSIDE for the nodes outside
    every block), each with its block: what a builder places run by run. One run for the whole graph, as
    OUTSIDE, where some block's nodes are not all in one run (no run is then repeated: `BlockReplay`)."""
    runs: list[tuple[int, list]] = []
    for gnode in graph.nodes:
        block = block_of(gnode.name)
        if runs and runs[-1][0] == block:
            runs[-1][1].append(gnode)
        else:
            runs.append((block, [gnode]))
    blocks = [block for block, _run in runs if block != OUTSIDE]
    if len(set(blocks)) != len(blocks):
        return ((OUTSIDE, tuple(graph.nodes)),)
    return tuple((block, tuple(run)) for block, run in runs)


def _moved(name: str, block: int, to: int) -> str:
    """`name` of a layout of block `block` (which reads block `block` - 1) as the layout of block `to` names it:
    a name of `block` in `to`, one of `block` - 1 in `to` - 1, any other kept (`BlockReplay`)."""
    found = block_of(name)
    if found == block:
        return in_block(name, to)
    return in_block(name, to - 1) if found == block - 1 and found != OUTSIDE else name


@dataclass
class BlockTemplate:
    """A block's run as a builder placed it node by node: its nodes are the builder's `first` .. `end - 1`;
    `usable` where its builder's replay may lay later runs out from it (`BlockReplay.completed`). A builder's
    replay adds what it records of its own state (a subclass)."""

    block: int
    run: tuple
    first: int
    end: int = 0
    usable: bool = False


class BlockReplay:
    """A builder's runs laid out from the last run it placed operator by operator (the template), renamed, where
    the run is the template's with every name of block t in block j and of t - 1 in j - 1 (`alike`) and the
    builder's replay finds what the run reads from outside its block as the template found it (`outside`).

    The builder lays its runs out in graph order (`block_runs`) by `lay_out`, which for each run calls
    `replayed(block, run)`; where that is False, `before(block, run)`, the builder's placing of the run node by
    node, then `after(mark)`. A subclass says what its builder
    reads and adds: `record` (the template's record of the state before the run), `completed` (what the run
    added, and whether the template is usable: it read nothing and added nothing but what `outside` compares
    and `added` repeats), `outside` (the node of each value from outside the block that the template read, ->
    the node of that value moved, or None where some differs as the builder reads it), `added` (the state the
    template added besides its nodes, renamed) and `value` (what the builder reads of a graph value besides its
    nodes, the same for a name and its move in every run replayed: `alike`)."""

    def __init__(self, build, shared: "ReplayShared | None" = None):
        self.build = build
        self.template: BlockTemplate | None = None
        self.shared = shared if shared is not None else ReplayShared()

    def lay_out(self, runs: Sequence[tuple[int, Sequence]], place: Callable[[Sequence], str | None]) -> str | None:
        """Each of `runs` (block, run) laid out in order: replayed from the template where it applies, else placed
        by `place` (node by node; a refusal, or None) and kept as the next template where usable. The first
        refusal `place` gives (the rest not laid out), None where every run is laid out. Runs outside every
        block (OUTSIDE; one run of a whole graph to lay out without replaying) are placed, never templates."""
        for block, run in runs:
            if self.replayed(block, run):
                continue
            mark = self.before(block, run)
            refused = place(run)
            if refused is not None:
                return refused
            self.after(mark)
        return None

    def before(self, block: int, run: Sequence) -> BlockTemplate | None:
        """A template's record of what stands before a run of `block` is placed (None outside every block)."""
        return None if block == OUTSIDE else self.record(block, run)

    def after(self, mark: BlockTemplate | None) -> None:
        """The template `mark` completed once its run is placed; kept where usable (else the next run is placed
        node by node and becomes the template)."""
        if mark is None:
            return
        mark.end = len(self.build.nodes)
        mark.usable = self.completed(mark)
        self.template = mark if mark.usable else None

    def replayed(self, block: int, run: Sequence) -> bool:
        """Whether the run of `block` was laid out from the template: its nodes appended, renamed and renumbered,
        and what the template added to the builder's state added so (`added`); False (nothing done) where the
        template does not apply."""
        t, nodes = self.template, self.build.nodes
        if t is None or block == OUTSIDE or block == t.block:
            return False
        names = self.shared.moves(t.block, block)   # each name's move, worked out once per pair of blocks

        def name_of(n: str) -> str:
            found = names.get(n)
            if found is None:
                found = names[n] = _moved(n, t.block, block)
            return found
        if not self.known_alike(t, block, run, name_of):
            return False
        outside = self.outside(t, name_of)
        if outside is None:
            return False
        shift = len(nodes) - t.first

        def moved(i: int) -> int:
            return i + shift if i >= t.first else outside[i]
        first = t.first
        for node in nodes[first:t.end]:   # `moved` and `name_of` written out (a parallel operator names no origin)
            origin = node.origin
            nodes.append(PNode(node.id + shift, node.kind, name_of(node.op) if node.kind == "leaf" else node.op,
                               tuple([i + shift if i >= first else outside[i] for i in node.inputs]), node.attrs,
                               node.shape, node.degrees, node.role, origin and (names.get(origin) or name_of(origin)),
                               node.placement, node.rules))
        self.added(t, moved, name_of)
        return True

    def known_alike(self, t: BlockTemplate, block: int, run: Sequence, name_of: Callable[[str], str]) -> bool:
        """`alike`, worked out once per pair of blocks and `context` (`ReplayShared.verdicts`) where the builder
        gives one: `alike` reads the two runs (the graph's runs of blocks `t.block` and `block`, one each:
        `block_runs`), the names' moves (a function of the names and the two blocks) and `value`, which reads the
        graph and what the context names; so the layouts of one graph that share a `ReplayShared` (the builds of a
        grid on several meshes, with and without sequence parallelism) ask each pair once per context rather than
        once per layout."""
        context = self.context()
        if context is None:
            return self.alike(t, run, name_of)
        key = (t.block, block, context)
        verdicts = self.shared.verdicts
        found = verdicts.get(key)
        if found is None or found[0] is not t.run or found[1] is not run:
            found = verdicts[key] = (t.run, run, self.alike(t, run, name_of))
        return found[2]

    def alike(self, t: BlockTemplate, run: Sequence, name_of: Callable[[str], str]) -> bool:
        """Whether `run` is the template's run with its names moved (`name_of`, `_moved` to the run's block): the
        same operators, attributes, shapes and inputs, and every value they name alike by `value`."""
        if len(run) != len(t.run):
            return False
        names: set[str] = set()
        for was, now in zip(t.run, run):
            if now.name != name_of(was.name) or now.op != was.op or now.attrs != was.attrs or \
                    tuple(now.shape) != tuple(was.shape) or tuple(now.inputs) != tuple(map(name_of, was.inputs)):
                return False
            names.add(was.name)
            names.update(was.inputs)
        return all(self.value(n) == self.value(name_of(n)) for n in names)

    # ------------------------------------------------------------------ what a builder's replay says
    def record(self, block: int, run: Sequence) -> BlockTemplate:
        raise NotImplementedError

    def completed(self, mark: BlockTemplate) -> bool:
        raise NotImplementedError

    def outside(self, t: BlockTemplate, name_of: Callable[[str], str]) -> dict[int, int] | None:
        raise NotImplementedError

    def added(self, t: BlockTemplate, moved: Callable[[int], int], name_of: Callable[[str], str]) -> None:
        raise NotImplementedError

    def value(self, name: str) -> tuple:
        raise NotImplementedError

    def context(self) -> tuple | None:
        """What `value` reads besides the graph, for `known_alike` to keep a verdict by (the builder's data axis,
        which inputs it does not split, ...); None where `value` reads state no key names (each run then asks)."""
        return None


class ReplayShared:
    """What the replays of one graph's layouts share (`BlockReplay`'s `shared`; each layout of a grid made a replay
    of its own, which worked these out again): the names moved from one block to another (`moves`: `_moved`, a
    function of the name and the two blocks), and `alike`'s verdicts by pair of blocks and the builder's `context`
    (`BlockReplay.known_alike`), each kept beside the two runs it compared. One per graph: a verdict is a run's of
    that graph (a graph's block has one run, `block_runs`)."""

    def __init__(self) -> None:
        self._moves: dict[tuple[int, int], dict[str, str]] = {}
        self.verdicts: dict[tuple, tuple[tuple, tuple, bool]] = {}

    def moves(self, was: int, now: int) -> dict[str, str]:
        """Name -> its move from block `was` to block `now` (`_moved`), filled as asked; read and extend only so."""
        return self._moves.setdefault((was, now), {})
