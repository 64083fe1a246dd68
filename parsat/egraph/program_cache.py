"""Compiled mesh programs, remembered by their content, so a warm `parsat optimize` does not compile them again.

Compiling the rules for one mesh (`program.compile_mesh_rules`: each rule
typed at the graph's ranks, lifted onto every assignment of its degrees to
the mesh's axes, written as egglog text) is a pure function of its inputs:
the operators, the rules, the graph's ranks, operators and signatures, the
mesh, the chunk size, and the code of `egraph/`, `dsl/` and `ir/`. It took
0.32 of the 2.0 CPU s of a warm `parsat optimize mlp` (8 devices: seven
programs), where reading the seven back takes under 5 ms. A program compiled
to its end (not cut by a deadline) is kept under a key made of all of them
(`program_key`), as JSON under `$PARSAT_CACHE_DIR/programs` (default
`~/.cache/parsat`), written atomically.

Why it can be trusted again: an entry names its key and holds nothing but
strings and integers, read back into the program's own frozen dataclasses
after every field's type is checked. JSON builds nothing but lists, dicts,
strings and numbers, so a planted file runs nothing; a planted, truncated or
edited file, or one stored under another key, is a miss: the program is
compiled and the entry written again. A folder that cannot be written only
costs the compile. Only a caller that asks for it stores programs
(`MeshCaches(folder)`: `parsat.api.optimize` does); a test or the rule
generator compiling throwaway rules writes nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Sequence

from parsat.dsl import ast
from parsat.dsl.files import FileProblem, read_text_capped, write_atomic
from parsat.dsl.library import Library
from parsat.ir.mesh import Mesh
from parsat.egraph import program as compiler
from parsat.egraph.instances import Signature
from parsat.egraph.program import MeshCaches, RuleProgram, compile_mesh_rules
from parsat.egraph.rule_text import CompiledRule, RuleBody, SkippedRule

FORMAT = 1
ENTRY_BYTES = 64 * 2**20   # the 8-device mlp's largest program is 143 KB of JSON; a 24-block model's a few MB
CODE_FOLDERS = ("egraph", "dsl", "ir")


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """A hash of the code a compiled program depends on: every `.py` (and the grammar) of `CODE_FOLDERS`."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in CODE_FOLDERS:
        for path in sorted((root / folder).glob("*")):
            if path.suffix in (".py", ".lark") and path.is_file():
                digest.update(f"{folder}/{path.name}".encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _digest(value: object, memo: dict) -> str:
    """A hash of `value`'s repr (the AST's frozen dataclasses print every field that is content, and no span),
    worked out once per object in `memo` (one search's: its meshes share the rule and operator objects)."""
    found = memo.get(id(value))
    if found is not None and found[0] is value:
        return found[1]
    digest = hashlib.sha256(repr(value).encode("utf-8")).hexdigest()
    memo[id(value)] = (value, digest)   # the object is kept, so its id is not reused while the memo lives
    return digest


def program_key(library: Library, rules: Sequence[ast.RuleDecl], ranks: set[int], mesh: Mesh,
                graph_ops: set[str] | None, signatures: set[Signature] | None, memo: dict) -> str:
    """What a compiled program is a function of (the module docstring), as one hash."""
    parts = [str(FORMAT), code_hash(), f"chunk={compiler.CHUNK_RULES}", _digest(library.ops, memo),
             "\0".join(_digest(rule, memo) for rule in rules), repr(sorted(ranks)), repr(mesh),
             "*" if graph_ops is None else repr(sorted(graph_ops)),
             "*" if signatures is None else repr(sorted(map(repr, signatures)))]
    return hashlib.sha256("\n\0".join(parts).encode("utf-8")).hexdigest()


def _entry(key: str, folder: Path) -> Path:
    return folder / "programs" / f"{key[:32]}.json"


def _encoded(program: RuleProgram) -> dict:
    rules = [[r.name, r.variant, r.ruleset, [r.body.pattern, list(r.body.facts), r.body.actions], r.phase, r.key,
              r.chunk, r.text, [[name, width, [list(row) for row in rows]] for name, width, rows in r.tables]]
             for r in program.rules]
    return {"declarations": program.declarations, "rules": rules,
            "skipped": [[s.name, s.reason] for s in program.skipped], "unfinished": program.unfinished}


def _strings(values, count: int) -> bool:
    return isinstance(values, list) and len(values) == count and all(isinstance(v, str) for v in values)


def _ints(values) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _rule(item) -> CompiledRule:
    """One compiled rule from its JSON list; ValueError unless every field has its type."""
    if not (isinstance(item, list) and len(item) == 9 and _strings(item[:3] + item[4:8], 7)):
        raise ValueError("not a compiled rule")
    body, tables = item[3], item[8]
    if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], str) and isinstance(body[2], str)
            and isinstance(body[1], list) and all(isinstance(f, str) for f in body[1])):
        raise ValueError("not a rule body")
    if not (isinstance(tables, list) and all(
            isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and _ints([t[1]])
            and isinstance(t[2], list) and all(_ints(row) for row in t[2]) for t in tables)):
        raise ValueError("not a rule's lift tables")
    name, variant, ruleset, phase, key, chunk, text = item[:3] + item[4:8]
    return CompiledRule(name, variant, ruleset, RuleBody(body[0], tuple(body[1]), body[2]), phase, key, chunk, text,
                        tuple((t[0], t[1], tuple(tuple(row) for row in t[2])) for t in tables))


def _decoded(data) -> RuleProgram:
    """The program an entry holds; ValueError (or TypeError) for anything that is not one."""
    if not (isinstance(data, dict) and isinstance(data.get("declarations"), str)
            and isinstance(data.get("rules"), list) and isinstance(data.get("skipped"), list)
            and data.get("unfinished") == 0):
        raise ValueError("not a compiled program")
    if not all(_strings(s, 2) for s in data["skipped"]):
        raise ValueError("not a list of skipped rules")
    return RuleProgram(data["declarations"], tuple(_rule(r) for r in data["rules"]),
                       tuple(SkippedRule(*s) for s in data["skipped"]), 0)


def read_program(key: str, folder: Path) -> RuleProgram | None:
    """The program stored under `key`, or None: no entry, or one that is not a program of this key."""
    try:
        data = json.loads(read_text_capped(_entry(key, folder), ENTRY_BYTES, "compiled program cache entry"))
        if not (isinstance(data, dict) and data.get("format") == FORMAT and data.get("key") == key):
            return None
        return _decoded(data.get("program"))
    except (FileProblem, OSError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def write_program(key: str, program: RuleProgram, folder: Path) -> None:
    """Store a program compiled to its end under `key`; a folder that cannot be written is passed over."""
    if program.unfinished:
        return   # cut by a deadline: not what the inputs compile to
    path = _entry(key, folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"format": FORMAT, "key": key, "program": _encoded(program)}), durable=False)
    except (FileProblem, OSError, TypeError, ValueError):
        pass


def cached_mesh_rules(library: Library, rules: Sequence[ast.RuleDecl], ranks: set[int], mesh: Mesh,
                      graph_ops: set[str] | None = None, signatures: set[Signature] | None = None,
                      deadline: float | None = None, caches: MeshCaches | None = None) -> RuleProgram:
    """`program.compile_mesh_rules`, or the program the same inputs compiled to before when `caches` has a
    folder (a stored program is complete whatever `deadline` says: it costs no compile time)."""
    folder = caches.folder if caches is not None else None
    if folder is None:
        return compile_mesh_rules(library, rules, ranks, mesh, graph_ops, signatures, deadline, caches)
    key = program_key(library, rules, ranks, mesh, graph_ops, signatures, caches.digests)
    found = read_program(key, folder)
    if found is not None:
        return found
    program = compile_mesh_rules(library, rules, ranks, mesh, graph_ops, signatures, deadline, caches)
    write_program(key, program, folder)
    return program


__all__ = ["cached_mesh_rules", "program_key", "read_program", "write_program"]
