"""The egglog encoding of a graph on a device mesh (docs/MESH.md), shared by the rules and the graph.

* Tensors are the sort `T`, with the constructors of `encoding` (`Leaf`,
  `Op_<op>`); a parallel operator's last argument is the mesh axis it acts
  on (an index), not a degree: `P_partition x dim axis`, `P_replicate x axis`.
* One analysis relation per rank r, `At<r>`, one row per e-class (an
  e-class is a value with a placement, so it is well defined):
  `(At<r> c d1 .. dr code1 .. codeA)`, the shape of the piece one device
  holds, then the placement code on every axis (`ir.placement`: free 0,
  replica 1, partial 2, shard(d) 3 + d). A rule binds a metavariable's
  local sizes and placement with one atom, and requires free (0) on the
  axes it acts on by writing 0 in it. It used to be two functions whose
  values were datatype terms (`Local c = (S<r> d...)`, `Pl c = (V<A>
  code...)`): four atoms per metavariable, each of which egglog's
  semi-naive evaluation joins again whenever its rows are new, and they
  are new for every class a union touches. The flat relation gives the
  same e-graph (the same classes and e-nodes) for about half the
  saturation's CPU time (docs/MESH.md, "Saturation").
* A lifted rule's table of legal placements on one other axis
  (`lifting.OtherAxisTable`) is a relation `Lift_<hash>` of i64 columns,
  declared once per program however many rule instances share it.
* Provenance rows (`Made_...`) as in `encoding`.
* Fused parallel operators (`dsl.parallel_ops`: reduce_scatter, all_gather)
  mean their steps, so wherever the steps stand one on the other on one
  axis the fused operator is unioned in by definition, not by a rule (the
  `fold` rules, in the ruleset that runs before every step, `FOLD_MADE`
  their maker): `partition(reduce(x, a), d, a)` gets `reduce_scatter(x, d,
  a)`, `replicate(combine(x, d, a), a)` gets `all_gather(x, d, a)`,
  `partition(combine(x, d, a), e, a)` (d != e) gets `all_to_all(x, d, e, a)`.

The global shape of a class is not stored: it is the local shape times the
sizes of the axes that shard each dim, computed when the e-graph is read
back (`session.Session.snapshot`).
"""

from __future__ import annotations

import hashlib
import re
from typing import Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.parallel_ops import PARALLEL_OPS, PARTITION, REPLICATE, step_calls
from parsat.ir.graph import Graph
from parsat.ir.mesh import Mesh
from parsat.ir.placement import REPLICA, Placement, apply_parallel, shard_dim
from parsat.egraph.encoding import (GRAPH_MADE, MADE_PREFIX, MAX_RANK, PIN_SUFFIX, SHAPE_RULESET, ctor,
                                    equated_relation, made_row, node_arguments, quote)
from parsat.egraph.snapshot import Application, ENode

AT_PREFIX = "At"   # `At<rank>`: a class's local sizes and placement codes, one flat row (module doc)
AXIS_SIZE = "AxisSize"   # `(AxisSize a)`: the size of mesh axis `a`, set per mesh (`axis_sizes`), read by the rules
_AXIS_VAR = re.compile(r'"(?:[^"\\]|\\.)*"|\bz(\d+)\b')   # a size variable, or a string (left as it is)


def at_relation(rank: int) -> str:
    """The name of the relation holding the local shape and placement of the classes of rank `rank`."""
    return f"{AT_PREFIX}{rank}"


def at_fact(var: str, dims: Sequence[str], codes: Sequence[str | int]) -> str:
    """`var`'s row of `At<rank>` (a query atom or an action inserting it): its local sizes, then one
    placement code per mesh axis."""
    return f"({at_relation(len(dims))} {var}{''.join(' ' + str(d) for d in dims)}{''.join(' ' + str(c) for c in codes)})"


def axis_var(axis: int) -> str:
    """The rule variable bound to the size of mesh axis `axis` (`axis_lookup`); no other rule variable starts
    with `z` (`lifted_text`: `s_`, `m_`, `c_`, `o_`, `r_`, and fresh `k`, `d`, `t`)."""
    return f"z{axis}"


def axis_lookup(axis: int) -> str:
    """The query atom binding `axis_var(axis)` to the size of the axis."""
    return f"(= {axis_var(axis)} ({AXIS_SIZE} {axis}))"


def axes_read(text: str) -> list[int]:
    """The axes whose size variable (`axis_var`) `text` reads, in order."""
    return sorted({int(axis) for axis in _AXIS_VAR.findall(text) if axis})


def at_sizes(text: str, sizes: Sequence[int]) -> str:
    """`text` with every axis size variable written as the axis's size: the rule a mesh of `sizes` runs."""
    return _AXIS_VAR.sub(lambda match: str(sizes[int(match.group(1))]) if match.group(1) else match.group(0), text)


def axis_sizes(mesh: Mesh) -> str:
    """The rows of `AxisSize` for `mesh`: what a loaded program reads its axes' sizes from (`Session`)."""
    return "".join(f"(set ({AXIS_SIZE} {axis}) {size})\n" for axis, size in enumerate(mesh.shape))


def table_name(rows: Sequence[tuple[int, ...]], width: int) -> str:
    """A lift table's relation name, from its content: equal tables are declared once."""
    digest = hashlib.sha1(repr((width, tuple(rows))).encode()).hexdigest()[:12]
    return f"Lift_{digest}"


def table_text(name: str, width: int, rows: Sequence[tuple[int, ...]]) -> str:
    return (f"(relation {name} ({' '.join('i64' for _ in range(width))}))\n"
            + "".join(f"({name} {' '.join(map(str, row))})\n" for row in rows))


def mesh_declarations(ops: Mapping[str, ast.OpDecl], mesh: Mesh) -> str:
    """The sort of tensors, its constructors and provenance relations, and the two analysis tables."""
    signatures = {ctor(op.name): ["T" if p.is_tensor else ("String" if p.type.kind == "real" else "i64")
                                  for p in op.params] for op in ops.values()}
    # a parallel operator's integer arguments: its dim (if it has one), then its mesh axis
    signatures.update({ctor(op.name): ["T"] + ["i64"] * len(op.attrs) for op in PARALLEL_OPS.values()})
    lines = ["(datatype T", "  (Leaf String)"]
    lines += [f"  ({name} {' '.join(sorts)})" for name, sorts in signatures.items()]
    lines[-1] += ")"
    lines += [f"(relation {MADE_PREFIX}{name} ({' '.join(sorts)} String))" for name, sorts in signatures.items()]
    lines.append(equated_relation())
    axes = len(mesh)
    lines += [f"(relation {at_relation(r)} (T{' i64' * (r + axes)}))" for r in range(MAX_RANK + 1)]
    lines.append(f"(function {AXIS_SIZE} (i64) i64 :no-merge)")   # its rows: `axis_sizes`, per mesh
    lines.append(f"(ruleset {SHAPE_RULESET})")   # the runner runs it first every step: the fold rules
    lines += fold_rules()
    return "\n".join(lines) + "\n"


FOLD_MADE = "fused operator (by definition)"


def fold_rules() -> list[str]:
    """For every fused operator, the egglog rule that unions it with its steps where they occur (module doc)."""
    out = []
    for op in PARALLEL_OPS.values():
        if not op.steps:
            continue
        names = {param: var for param, var in zip(op.dim_params, ("d", "e"))}
        (inner, inner_dim), (outer, outer_dim) = step_calls(op.name, names)
        inner_args = ["x"] + ([inner_dim] if inner_dim else []) + ["a"]
        outer_args = ["c"] + ([outer_dim] if outer_dim else []) + ["a"]
        fused_args = ["x", *names.values(), "a"]
        distinct = " (!= d e)" if len(names) == 2 else ""   # all_to_all moves a shard between two dims
        out.append(f"(rule ((= o ({ctor(outer)} {' '.join(outer_args)})) (= c ({ctor(inner)} "
                   f"{' '.join(inner_args)})){distinct}) ((union o ({ctor(op.name)} {' '.join(fused_args)})) "
                   f"{made_row(ctor(op.name), fused_args, FOLD_MADE)}) :ruleset {SHAPE_RULESET})")
    return out


def fold_applications(classes: Mapping[int, Sequence[ENode]]) -> list[Application]:
    """What the `fold` rules did, read back from the snapshot (they are not library rules and record no
    match): each fused e-node with, in its class, the steps it was unioned with (`fold_rules`' pattern:
    the inner step read first, the outer one, the match's root, last)."""
    out = []
    for nodes in classes.values():
        for fused in nodes:
            op = PARALLEL_OPS.get(fused.op)
            if op is None or not op.steps:
                continue
            *dims, axis = fused.attrs
            (inner, inner_dim), (outer, outer_dim) = step_calls(op.name, dict(zip(op.dim_params, dims)))
            for root in nodes:
                if root.op != outer or root.attrs != ((outer_dim, axis) if outer_dim is not None else (axis,)):
                    continue
                out.extend(Application(FOLD_MADE, (step, root), (fused,)) for step in classes.get(root.children[0], ())
                           if step.op == inner and step.children == fused.children[:1]
                           and step.attrs == ((inner_dim, axis) if inner_dim is not None else (axis,)))
    return out


def _rows(var: str, local: Sequence[int], placement: Placement) -> list[str]:
    return [at_fact(var, [str(d) for d in local], placement.codes)]


def pin_chain(placement: Placement) -> list[tuple[str, int, int | None]]:
    """The parallel operators (op, axis, dim) that bring a tensor from free on every axis to `placement`: the
    partitions axis by axis in mesh order (so a dim sharded on two axes nests major first), then replicas."""
    steps: list[tuple[str, int, int | None]] = []
    for axis, code in enumerate(placement.codes):
        dim = shard_dim(code)
        if dim is not None:
            steps.append((PARTITION, axis, dim))
    steps += [(REPLICATE, axis, None) for axis, code in enumerate(placement.codes) if code == REPLICA]
    return steps


def mesh_graph_program(graph: Graph, ops: Mapping[str, ast.OpDecl], mesh: Mesh,
                       pins: Mapping[str, Placement] | None = None) -> tuple[str, dict[str, str]]:
    """One `let` per leaf and per operator (a DAG), every tensor free on every axis; pins as in
    `encoding.graph_program`: an output's pinned placement is reached by parallel terms that become the
    extraction root ("pin:NAME"), an input arrives in its pinned placement (a second, free leaf
    `Leaf "NAME@pinned"` unioned with those terms)."""
    lines: list[str] = []
    names: dict[str, str] = {}
    shapes = graph.shapes()
    inputs = {leaf.name for leaf in graph.leaves if leaf.role == "input"}
    whole = Placement.whole(len(mesh))
    for index, leaf in enumerate(graph.leaves):
        var = f"$l{index}"
        names[leaf.name] = var
        lines.append(f"\n(let {var} (Leaf {quote(leaf.name)}))")
        lines.extend(_rows(var, leaf.shape, whole))
    for index, node in enumerate(graph.nodes):
        var = f"$n{index}"
        names[node.name] = var
        args = node_arguments(ops[node.op], node, names)
        lines.append(f"\n(let {var} ({ctor(node.op)} {' '.join(args)}))")
        lines.append(made_row(ctor(node.op), args, GRAPH_MADE))
        lines.extend(_rows(var, node.shape, whole))
    for pin_index, (name, placement) in enumerate((pins or {}).items()):
        var = names[name]
        current = whole
        for step, (op, axis, dim) in enumerate(pin_chain(placement)):
            current = apply_parallel(current, op, axis, dim)
            args = [var] + ([str(dim)] if dim is not None else []) + [str(axis)]
            var = f"$p{pin_index}_{step}"
            lines.append(f"\n(let {var} ({ctor(op)} {' '.join(args)}))")
            lines.extend(_rows(var, current.local_shape(shapes[name], mesh.shape), current))
        if name in inputs and var != names[name]:
            lines.append(f"\n(union {var} (Leaf {quote(name + PIN_SUFFIX)}))")
        names[f"pin:{name}"] = var
    return "\n".join(lines) + "\n", names
