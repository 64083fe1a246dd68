"""`generate(...)`: discover rewrite rules from operator semantics, prove them, keep the useful ones.

Pipeline (issue 7):

1. `saturate.enumerate` builds every small term over the chosen operators
   and groups terms by an exact fingerprint of their values at several
   random sizes and degrees.
2. Within a group, every member is a candidate rule with the group's
   smallest member, in both directions (towards the small term simplifies,
   away from it distributes or introduces parallelism) unless the right
   side merely wraps the left (`relu(x) => relu(relu(x))`). Terms are already symbolic (sizes
   `m, k, n`, degree `p`, split attributes `s, z`); a kept rule is then
   widened to independent dims where it still proves (`generalise`); the right side's definedness requirements
   that the left side does not imply become its `where`. It is type-checked
   with `dsl.checker.check_rule` and proven by the verifier.
3. Pruning: a candidate is dropped when the rules kept so far (and,
   optionally, the shipped library) already derive it by saturation: its
   left side, instantiated at concrete sizes, is saturated with saturate's
   egglog compilation of those rules, and its right side must land in the
   same e-class. Candidates are visited small first and, within a size,
   most useful first, so a rule is pruned only by smaller or more useful
   ones. Candidates derivable before proof are not proved at all (the
   rules that derive them are PROVED, so they are true).
4. Output: PROVED, non-derivable rules, most useful first (collectives and
   parallel pieces removed, then operators removed), printed by
   `dsl.printer` with a one-line comment.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from parsat.dsl import ast
from parsat.dsl.conditions import holds, symbolic_truth, to_poly
from parsat.dsl.errors import DslError
from parsat.dsl.library import Library
from parsat.dsl.printer import format_decl, format_expr
from parsat.dsl.spread import PARALLEL_OPS
from parsat.dsl.symbolic import Poly
from parsat.dsl.typecheck import RuleInstance, TypeCheckError, TypedTerm, check_rhs_bound, type_rule
from parsat.saturate.egglog_compile import CompileError, RuleProgram, Session, compile_rules, ctor, real_literal
from parsat.saturate.enumerate import (DEGREE, SIZE, START, Enumeration, Term, Vocabulary, enumerate_terms,
                                       environments, vocabulary)

Progress = Callable[[str], None]
COLLECTIVES = ("combine", "reduce")
PROVE_CHUNK = 64                      # candidates proved between two checks of the seconds limit   # all-gather, all-reduce in the forward pass


class GenerateError(Exception):
    """Why generation cannot start; the message is for the user."""


@dataclass(frozen=True)
class Settings:
    """What to enumerate and the limits of each phase."""

    ops: tuple[str, ...]
    max_ops: int = 2
    degrees: tuple[int, ...] = (2, 3)
    seconds: float = 600.0
    environments: int = 3
    max_terms: int = 200_000
    verify_timeout: float = 10.0
    jobs: int = 1
    prune_with_library: bool = False
    devices: int = 4                  # device count of the pruning saturation (degree 2, nested 4)
    prune_iterations: int = 5
    prune_enodes: int = 200_000
    prune_seconds: float = 30.0


@dataclass(frozen=True)
class Candidate:
    """A candidate rule and what it is worth."""

    rule: ast.RuleDecl
    size: int                        # operators on both sides
    score: tuple[int, int, int]      # (collectives removed, pieces ops removed, operators removed)
    key: str                         # canonical text (renamed metavariables)


@dataclass
class Summary:
    """Counts of every phase; `to_text` is what the command prints."""

    terms_built: int = 0
    terms_defined: int = 0
    groups: int = 0
    candidates: int = 0
    ill_typed: int = 0
    proved: int = 0
    refuted: int = 0
    unknown: int = 0
    pruned: int = 0
    kept: int = 0
    seconds: float = 0.0
    stopped: str = ""
    not_reached: int = 0   # candidates the seconds limit left unproved (the largest ones)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def to_text(self) -> str:
        text = (f"{self.terms_built} graphs enumerated ({self.terms_defined} defined, {self.groups} value groups), "
                f"{self.candidates} candidates ({self.ill_typed} ill-typed), {self.proved} proved, "
                f"{self.refuted} refuted, {self.unknown} unknown, {self.pruned} pruned, {self.kept} kept, "
                + (f"{self.not_reached} not reached, " if self.not_reached else "") + f"{self.seconds:.1f} s")
        return text + (f"; stopped early: {self.stopped}" if self.stopped else "")


@dataclass(frozen=True)
class GenerateResult:
    rules: tuple[ast.RuleDecl, ...]
    summary: Summary = field(hash=False)

    def text(self, ops: Sequence[str], command: str = "") -> str:
        header = ["Rules generated by `parsat generate` from the operator semantics, each PROVED by",
                  f"the verifier; operators: {', '.join(ops)}."]
        if command:
            header.append(f"command: {command}")
        blocks = ["\n".join(f"# {line}" for line in header), 'import "ops.rule"']
        blocks += [format_decl(rule) for rule in self.rules]
        return "\n\n".join(blocks) + "\n"


# ------------------------------------------------------------------ candidates


def _ops_of(expr: ast.Expr) -> list[str]:
    return [n.func for n in ast.walk(expr) if isinstance(n, ast.Call)]


def _names_used(expr: ast.Expr) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def score(lhs: ast.Expr, rhs: ast.Expr) -> tuple[int, int, int]:
    """How much applying lhs => rhs saves: collectives, then parallel ops, then operators."""
    left, right = _ops_of(lhs), _ops_of(rhs)

    def count(ops, names):
        return sum(1 for o in ops if o in names)

    return (count(left, COLLECTIVES) - count(right, COLLECTIVES),
            count(left, PARALLEL_OPS) - count(right, PARALLEL_OPS), len(left) - len(right))


def canonical(lhs: ast.Expr, rhs: ast.Expr, vocab: Vocabulary) -> str:
    """The rule's text with metavariables and their dims renamed in order of appearance.

    Two candidates that differ only by which input of the same kind they
    use (x or y, or w with its own dims) are one rule.
    """
    shapes = {v.name: v.dims for v in vocab.inputs}
    tensor_map: dict[str, str] = {}
    dim_map: dict[str, str] = {}
    text = format_expr(lhs) + " => " + format_expr(rhs)
    for token in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
        if token in shapes and token not in tensor_map:
            tensor_map[token] = f"t{len(tensor_map)}"
            for d in shapes[token]:
                dim_map.setdefault(d, f"d{len(dim_map)}")
    tags = [f"{tensor_map[t]}:{','.join(dim_map[d] for d in shapes[t])}" for t in tensor_map]
    renamed = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: tensor_map.get(m.group(0), m.group(0)), text)
    return renamed + " | " + " ".join(sorted(tags))


def _where(instance: RuleInstance) -> list[str]:
    """The right side's requirements that the left side does not state (as text)."""
    given = set(instance.lhs_requires)
    out = []
    for cond in instance.rhs_requires:
        if cond not in given and symbolic_truth(cond) is not True and str(cond) not in out:
            out.append(str(cond))
    return out


def rule_name(lhs: ast.Expr, rhs: ast.Expr, taken: set[str]) -> str:
    left = "_".join(dict.fromkeys(_ops_of(lhs))) or "x"
    right = "_".join(dict.fromkeys(_ops_of(rhs))) or "id"
    stem = f"gen_{left}__to__{right}"
    name, k = stem, 2
    while name in taken:
        name, k = f"{stem}_{k}", k + 1
    taken.add(name)
    return name


def make_rule(vocab: Vocabulary, lhs: ast.Expr, rhs: ast.Expr, name: str,
              binders: Sequence[ast.Param] | None = None) -> ast.RuleDecl | None:
    """The rule `lhs => rhs` with the binders it uses and the `where` it needs, parsed back (None: malformed).

    `binders` defaults to the vocabulary's (`generalise` passes its own, with fresh symbols).
    """
    from parsat.dsl.parser import parse

    used = _names_used(lhs) | _names_used(rhs)
    binders = [b for b in (binders if binders is not None else vocab.binders()) if b.name in used]
    draft = ast.RuleDecl(name, tuple(binders), (), lhs, rhs)
    try:
        check_rhs_bound(draft)
        instance = type_rule(draft, vocab.ops, {})
    except (TypeCheckError, KeyError, ZeroDivisionError):
        return None
    where = _where(instance)
    removed = score(lhs, rhs)
    doc = f"Generated: {format_expr(lhs)} equals {format_expr(rhs)}"
    if removed[0] > 0 or removed[1] > 0:
        doc += f" (removes {removed[0]} collective(s), {removed[1]} parallel op(s))."
    else:
        doc += "."
    lines = [f"# {doc}", f"rule {name}:", "  forall " + ", ".join(
        f"{b.name}: {'[' + ', '.join(format_expr(d) for d in b.type.dims) + ']' if b.is_tensor else b.type.kind}"
        for b in binders)]
    if where:
        lines.append("  where " + ", ".join(where))
    lines.append(f"  {format_expr(lhs)} => {format_expr(rhs)}")
    try:
        module = parse("\n".join(lines) + "\n", "<generated>")
    except DslError:
        return None
    rules = [d for d in module.items if isinstance(d, ast.RuleDecl)]
    return rules[0] if rules else None


def candidates(enumeration: Enumeration, vocab: Vocabulary) -> list[tuple[ast.Expr, ast.Expr, str]]:
    """(lhs, rhs, canonical key) per group member and the group's smallest member, both directions."""
    out: list[tuple[ast.Expr, ast.Expr, str]] = []
    seen: set[str] = set()
    for members in enumeration.groups.values():
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda t: (t.ops, len(t.text), t.text))
        head = ordered[0]
        for other in ordered[1:]:
            for lhs, rhs in ((other.expr, head.expr), (head.expr, other.expr)):
                if not isinstance(lhs, ast.Call):
                    continue
                if any(node == lhs for node in ast.walk(rhs)):
                    continue  # the right side wraps the left (relu(x) => relu(relu(x))): only blow-up
                key = canonical(lhs, rhs, vocab)
                if key in seen:
                    continue
                seen.add(key)
                out.append((lhs, rhs, key))
    return out


# ------------------------------------------------------------------ derivability by saturation


def _instance_sizes(instance: RuleInstance, devices: int, seed: int = 0) -> dict[str, int] | None:
    """Concrete sizes at which the rule applies and its right side is defined.

    Degrees are 2 (their products then divide `devices` = 4), dims distinct
    multiples of 4, ints small; drawn until every condition holds.
    """
    import random

    rng = random.Random(seed)
    names = sorted(instance.symbols)
    conds = list(instance.where) + list(instance.lhs_requires) + list(instance.rhs_requires)
    for attempt in range(400):
        sizes = {}
        dims = rng.sample([4, 8, 12, 16, 20, 24, 28, 32], k=min(8, sum(1 for n in names if instance.symbols[n] == "dim")))
        it = iter(dims)
        for n in names:
            kind = instance.symbols[n]
            if kind == "degree":
                sizes[n] = 2
            elif kind == "dim":
                sizes[n] = next(it)
            else:
                sizes[n] = rng.randint(0, 6) if attempt > 20 else rng.choice((1, 2, 3))
        if all(holds(c, sizes) for c in conds):
            pieces = [t.spread.pieces.evaluate(sizes) for side in (instance.lhs, instance.rhs) for t in side.walk()]
            if all(p <= devices and devices % p == 0 for p in pieces):
                return sizes
    return None


@dataclass
class _Writer:
    """Ground terms as egglog `let`s with their analysis rows (the format of egglog_compile.graph_program)."""

    instance: RuleInstance
    sizes: Mapping[str, int]
    lines: list[str] = field(default_factory=list)
    made: dict = field(default_factory=dict)
    prefix: str = "g"

    def num(self, poly: Poly) -> int:
        return int(poly.evaluate(self.sizes))

    def term(self, term: TypedTerm) -> str:
        key = format_expr(term.node)
        if key in self.made:
            return self.made[key]
        if term.kind == "input":
            body = f'(Leaf "{self.prefix}{term.name}")'
        elif term.kind == "parallel":
            args = [self.term(term.args[0])] + ([str(term.dim)] if term.dim is not None else [])
            body = f"({ctor(term.name)} {' '.join(args + [str(self.num(term.degree))])})"
        else:
            env = {s: Poly.sym(s) for s in self.instance.symbols}
            tensors = iter(term.args)
            args = []
            for param, arg in zip(term.instance.op.params, term.node.args):
                if param.is_tensor:
                    args.append(self.term(next(tensors)))
                elif param.type.kind == "real":
                    value = arg.value if isinstance(arg, ast.Num) else -arg.operand.value
                    args.append(real_literal(value))
                else:
                    args.append(str(self.num(to_poly(arg, env, self.instance.groups))))
            body = f"({ctor(term.name)} {' '.join(args)})"
        var = f"${self.prefix}{len(self.made)}"
        self.made[key] = var
        rows = [f"(let {var} {body})", f"(set (Rank {var}) {len(term.shape)})"]
        for i, dim in enumerate(term.shape):
            rows.append(f"(set (Dim {var} {i}) {self.num(dim)})")
            rows.append(f"(set (Shard {var} {i}) {self.num(term.spread.shard[i])})")
        rows.append(f"(set (Copy {var}) {self.num(term.spread.copy)})")
        rows.append(f"(set (Psum {var}) {self.num(term.spread.sum)})")
        rows.append(f"(set (Pieces {var}) {self.num(term.spread.pieces)})")
        self.lines.append("\n".join(rows))
        return var


@dataclass
class Deriver:
    """Saturates a rule's left side with a fixed rule set and checks its right side is reached.

    The rule program is compiled once per rule set (saturate's own
    compilation); each check builds a fresh e-graph from it.
    """

    library: Library
    rules: list[ast.RuleDecl]
    devices: int = 4
    iterations: int = 6
    enodes: int = 20_000
    seconds: float = 3.0
    _programs: dict = field(default_factory=dict)
    _typing: dict = field(default_factory=dict)

    def add(self, rule: ast.RuleDecl) -> None:
        self.rules.append(rule)
        self._programs.clear()

    def program(self, ranks: frozenset[int]) -> RuleProgram:
        if ranks not in self._programs:
            self._programs[ranks] = compile_rules(self.library, self.rules, set(ranks), self.devices, None,
                                                  self._typing)
        return self._programs[ranks]

    def derives(self, instance: RuleInstance, sizes: Mapping[str, int] | None = None) -> bool:
        """Whether saturating the left side (at concrete sizes) reaches the right side."""
        return self.derives_many([instance], [sizes])[0]

    def derives_many(self, instances: Sequence[RuleInstance],
                     sizes: Sequence[Mapping[str, int] | None] | None = None) -> list[bool]:
        """`derives` for many rules in one e-graph: every left side is loaded, saturated once, then every
        right side is looked up.

        Sharing an e-graph is sound for derivability: every equality in it
        follows from the rule set, whichever terms it went through. Each
        rule's terms get their own leaves (`c<i>_x`) at their own sizes.
        """
        out = [False] * len(instances)
        if not self.rules or not instances:
            return out
        sizes = list(sizes) if sizes is not None else [None] * len(instances)
        writers: list[tuple[int, _Writer, str]] = []
        ranks: set[int] = set()
        for index, (instance, given) in enumerate(zip(instances, sizes)):
            concrete = given if given is not None else _instance_sizes(instance, self.devices)
            if concrete is None:
                continue
            writer = _Writer(instance, concrete, prefix=f"c{index}_")
            try:
                left = writer.term(instance.lhs)
            except (ZeroDivisionError, KeyError):
                continue
            writers.append((index, writer, left))
            ranks |= {len(t.shape) for side in (instance.lhs, instance.rhs) for t in side.walk()}
        if not writers:
            return out
        try:
            session = Session(self.program(frozenset(ranks)),
                              "\n\n".join(chunk for _, w, _ in writers for chunk in w.lines))
        except CompileError:
            return out
        start = time.perf_counter()
        for _ in range(self.iterations):
            changed = False
            for ruleset in ("alg", "par"):
                updated, _counts = session.run(ruleset)
                changed |= updated
            if not changed or session.size() >= self.enodes or time.perf_counter() - start > self.seconds:
                break
        rights = []
        for index, writer, left in writers:
            done = len(writer.lines)
            try:
                right = writer.term(writer.instance.rhs)
            except (ZeroDivisionError, KeyError):
                continue
            for chunk in writer.lines[done:]:
                session._run(chunk)
            rights.append((index, left, right))
        lets = session.snapshot().lets
        for index, left, right in rights:
            out[index] = lets.get(left) is not None and lets.get(left) == lets.get(right)
        return out


# ------------------------------------------------------------------ verification


def _verify(args: tuple) -> tuple[int, str, str]:
    """Worker: (index, verdict, reason)."""
    index, rule, ops, timeout = args
    from parsat.verifier.core import RuleError, verify_rule

    try:
        verdict = verify_rule(rule, ops, timeout=timeout)
    except RuleError as err:
        return index, "ERROR", str(err)
    return index, verdict.verdict, verdict.reason


def verify_all(rules: Sequence[ast.RuleDecl], ops: Mapping[str, ast.OpDecl], timeout: float,
               jobs: int) -> list[tuple[str, str]]:
    """(verdict, reason) per rule, with the verifier's on-disk cache."""
    from parsat.verifier.cache import VerdictCache, rule_key
    from parsat.verifier.core import VERSION
    from parsat.verifier.verdict import Verdict

    cache = VerdictCache()
    out: list[tuple[str, str] | None] = [None] * len(rules)
    work = []
    for index, rule in enumerate(rules):
        hit = cache.get(rule_key(rule, ops, VERSION), timeout)
        if hit is not None:
            out[index] = (hit.verdict, hit.reason)
        else:
            work.append((index, rule, ops, timeout))
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_verify, work, chunksize=1))
    else:
        results = [_verify(item) for item in work]
    for index, verdict, reason in results:
        out[index] = (verdict, reason)
        if verdict in ("PROVED", "REFUTED"):
            rule = rules[index]
            cache.put(rule_key(rule, ops, VERSION), Verdict(rule.name, "", 0, verdict, 0.0, reason), timeout)
    return [o or ("UNKNOWN", "") for o in out]


# ------------------------------------------------------------------ the pipeline


def generate(library: Library, settings: Settings, progress: Progress | None = None) -> GenerateResult:
    """Enumerate, group, prove and prune; the kept rules, most useful first."""
    from parsat.dsl.checker import check_rule
    from parsat.saturate.enumerate import VocabularyError

    say = progress or (lambda _m: None)
    start = time.perf_counter()
    deadline = start + settings.seconds
    summary = Summary()
    try:
        vocab = vocabulary(settings.ops, library.ops)
    except VocabularyError as err:
        raise GenerateError(str(err)) from None
    if settings.max_ops < 1:
        raise GenerateError("--max-ops must be at least 1")
    if not settings.degrees or min(settings.degrees) < 2:
        raise GenerateError("--degrees must be integers of at least 2")
    envs = environments(vocab, settings.degrees, max(settings.environments, len(settings.degrees)))
    max_pieces = max(settings.degrees) ** 3
    # enumeration gets half the time: proving and pruning what it found must fit in the rest
    enumerate_until = start + settings.seconds / 2
    enumeration = enumerate_terms(vocab, settings.max_ops, envs, max_pieces,
                                  deadline=lambda: time.perf_counter() > enumerate_until,
                                  max_terms=settings.max_terms, progress=say)
    summary.terms_built, summary.terms_defined = enumeration.built, enumeration.typed
    summary.groups = sum(1 for g in enumeration.groups.values() if len(g) > 1)
    summary.stopped = enumeration.stopped
    pairs = candidates(enumeration, vocab)
    summary.candidates = len(pairs)
    say(f"candidates: {len(pairs)} from {summary.groups} groups")

    taken: set[str] = set()
    typed: list[Candidate] = []
    for lhs, rhs, key in pairs:
        rule = make_rule(vocab, lhs, rhs, rule_name(lhs, rhs, taken))
        if rule is None:
            summary.ill_typed += 1
            continue
        try:
            check_rule(rule, library.ops)
        except TypeCheckError:
            summary.ill_typed += 1
            continue
        typed.append(Candidate(rule, len(_ops_of(lhs)) + len(_ops_of(rhs)), score(lhs, rhs), key))
    typed.sort(key=lambda c: (c.size, [-s for s in c.score], c.key))

    base = [r for r in library.rules] if settings.prune_with_library else []
    deriver = Deriver(library, list(base), settings.devices, settings.prune_iterations, settings.prune_enodes,
                      settings.prune_seconds)
    kept: list[Candidate] = []
    by_size: dict[int, list[Candidate]] = {}
    for cand in typed:
        by_size.setdefault(cand.size, []).append(cand)
    sizes = sorted(by_size)
    for index, size in enumerate(sizes):
        level = by_size[size]
        if time.perf_counter() >= deadline:
            # `--seconds` is a limit: smaller rules (visited first) are kept, the larger ones are not looked at
            left = sum(len(by_size[s]) for s in sizes[index:])
            summary.not_reached = left
            summary.stopped = _also(summary.stopped, f"seconds (before size {size}: {left} candidates of sizes "
                                                     f"{size}-{sizes[-1]} not looked at)")
            say(f"stopped by seconds before size {size}: {left} candidates not looked at")
            break
        # 1. drop what the rules kept so far already derive (no proof needed: they are proved)
        derivable = _derivable(deriver, level, library)
        survivors = [c for c, d in zip(level, derivable) if not d]
        summary.pruned += len(level) - len(survivors)
        # 2. prove the rest, in chunks so that the seconds limit is checked (only PROVED rules are written)
        say(f"size {size}: {len(level)} candidates, {len(level) - len(survivors)} derivable, "
            f"proving {len(survivors)}")
        verdicts: list = []
        for begin in range(0, len(survivors), PROVE_CHUNK):
            if time.perf_counter() >= deadline:
                break
            verdicts += verify_all([c.rule for c in survivors[begin:begin + PROVE_CHUNK]], library.ops,
                                   settings.verify_timeout, settings.jobs)
        if len(verdicts) < len(survivors):
            left = len(survivors) - len(verdicts) + sum(len(by_size[s]) for s in sizes[index + 1:])
            summary.not_reached = left
            summary.stopped = _also(summary.stopped, f"seconds (while proving size {size}: {left} candidates not "
                                                     "looked at)")
        proved = []
        for cand, (verdict, _reason) in zip(survivors, verdicts):
            if verdict == "PROVED":
                summary.proved += 1
                proved.append(cand)
            elif verdict == "REFUTED":
                summary.refuted += 1
            else:
                summary.unknown += 1
        # 3. most useful first, in chunks: keep a chunk's rules that the rules kept before it do not derive,
        #    each generalised to independent sizes where that still proves
        proved.sort(key=lambda c: ([-s for s in c.score], c.key))
        chunk = max(8, len(proved) // 4)
        for begin in range(0, len(proved), chunk):
            part = proved[begin:begin + chunk]
            if kept and time.perf_counter() < deadline:
                flags = _derivable(deriver, part, library)
            else:
                flags = [False] * len(part)
            for cand, derivable in zip(part, flags):
                if derivable:
                    summary.pruned += 1
                    continue
                if time.perf_counter() < deadline:
                    cand = generalise(cand, vocab, library, settings)
                kept.append(cand)
                deriver.add(cand.rule)
        say(f"size {size}: {len(kept)} kept so far ({time.perf_counter() - start:.1f} s)")
        if summary.not_reached:
            break
    kept.sort(key=lambda c: ([-s for s in c.score], c.size, c.key))
    summary.kept = len(kept)
    summary.seconds = time.perf_counter() - start
    return GenerateResult(tuple(c.rule for c in kept), summary)


def _also(stopped: str, why: str) -> str:
    """`why` added to what stopped the run so far (enumeration may have stopped too)."""
    return f"{stopped}; {why}" if stopped else why


def _derivable(deriver: Deriver, cands: Sequence[Candidate], library: Library, batch: int = 200) -> list[bool]:
    """Which candidates the deriver's rules derive, a batch of them per e-graph."""
    out: list[bool] = []
    for begin in range(0, len(cands), batch):
        part = cands[begin:begin + batch]
        out += deriver.derives_many([_typed(c.rule, library) for c in part])
    return out


@dataclass(frozen=True)
class _Slot:
    """One occurrence of a size symbol: a dim of a tensor binder, or a token of the rule's text."""

    tensor: str = ""      # binder name ("" for a text token)
    pos: int = -1         # dim position in the binder, or character offset in the text


def _slots(symbol: str, tensors: Mapping[str, list[str]], body: str) -> list[_Slot]:
    out = [_Slot(name, i) for name, dims in tensors.items() for i, d in enumerate(dims) if d == symbol]
    out += [_Slot("", m.start()) for m in re.finditer(rf"\b{re.escape(symbol)}\b", body)]
    return out


def _rename(tensors: Mapping[str, list[str]], body: str, slots: Iterable[_Slot], old: str,
            new: str) -> tuple[dict[str, list[str]], str]:
    out = {name: list(dims) for name, dims in tensors.items()}
    offsets = sorted((s.pos for s in slots if not s.tensor), reverse=True)
    for slot in slots:
        if slot.tensor:
            out[slot.tensor][slot.pos] = new
    for offset in offsets:
        body = body[:offset] + new + body[offset + len(old):]
    return out, body


def generalise(cand: Candidate, vocab: Vocabulary, library: Library, settings: Settings,
               max_tries: int = 24) -> Candidate:
    """The rule with as many size symbols made independent as still type and prove.

    Enumeration gives inputs of one kind the same dims (x and y are both
    [m, k]) and split attributes the enumeration's symbols, which is narrower
    than needed: `concat(relu(x), relu(y), 0)` holds whatever x's and y's row
    counts, and `split(concat(x, y, 0), 0, m, m) => y` holds with y's rows
    and the split's size renamed together. Every occurrence of a symbol (a
    dim of a tensor binder, or a token of the rule) is a slot; a subset of a
    symbol's slots (never its first) is renamed to a fresh symbol, smallest
    subsets first, and kept when the rule still type-checks and proves
    (the verifier's concrete search refutes most wrong tries in
    milliseconds). Greedy, at most `max_tries` proofs per rule.
    """
    from itertools import combinations

    from parsat.dsl.checker import check_rule
    from parsat.dsl.parser import parse

    rule = cand.rule
    tensors = {b.name: [format_expr(d) for d in b.type.dims] for b in rule.binders if b.is_tensor}
    scalars = [b for b in rule.binders if not b.is_tensor]
    body = format_expr(rule.lhs) + " => " + format_expr(rule.rhs)
    symbols = list(dict.fromkeys([d for dims in tensors.values() for d in dims]
                                 + [b.name for b in scalars if b.type.kind == "int"]))
    tries = 0
    fresh = 0
    work = list(symbols)
    while work and tries < max_tries:
        symbol = work.pop(0)
        slots = _slots(symbol, tensors, body)
        found = True
        while found and len(slots) > 1 and tries < max_tries:
            found = False
            rest = slots[1:]
            for size in range(1, len(rest) + 1):
                for subset in combinations(rest, size):
                    fresh += 1
                    new = f"{symbol}{fresh}"
                    trial_tensors, trial_body = _rename(tensors, body, subset, symbol, new)
                    dims = {d for ds in trial_tensors.values() for d in ds}
                    ints = [b for b in scalars if b.name != symbol or symbol in trial_body]
                    if new not in dims:
                        ints.append(ast.Param(new, ast.ScalarType("int")))
                    forall = ", ".join([f"{n}: [{', '.join(ds)}]" for n, ds in trial_tensors.items()]
                                       + [f"{b.name}: {b.type.kind}" for b in ints])
                    try:
                        parsed = parse(f"rule r:\n  forall {forall}\n  {trial_body}\n", "<generalise>").items[0]
                    except DslError:
                        continue
                    general = make_rule(vocab, parsed.lhs, parsed.rhs, rule.name, binders=parsed.binders)
                    if general is None:
                        continue
                    try:
                        check_rule(general, library.ops)
                    except TypeCheckError:
                        continue
                    tries += 1
                    if verify_all([general], library.ops, settings.verify_timeout, 1)[0][0] == "PROVED":
                        tensors, body, rule = trial_tensors, trial_body, general
                        scalars = [b for b in general.binders if not b.is_tensor]
                        work.append(new)
                        slots = _slots(symbol, tensors, body)
                        found = True
                        break
                    if tries >= max_tries:
                        break
                if found or tries >= max_tries:
                    break
    return replace(cand, rule=rule)


def _typed(rule: ast.RuleDecl, library: Library) -> RuleInstance:
    return type_rule(rule, library.ops, {})


# ------------------------------------------------------------------ derivation of other rules


def rank_instances(rule: ast.RuleDecl, ops: Mapping[str, ast.OpDecl], rank: int = 2) -> list[RuleInstance]:
    """The rule typed at group lengths that make every tensor metavariable rank `rank`."""
    from parsat.dsl.typecheck import group_assignments

    out = []
    for groups in group_assignments(rule, rank):
        try:
            instance = type_rule(rule, ops, groups)
        except TypeCheckError:
            continue
        if instance.problems or any(len(s) != rank for s in instance.tensors.values()):
            continue
        out.append(instance)
    return out


@dataclass(frozen=True)
class Derivation:
    rule: str
    instances: int
    derived: int
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.instances > 0 and self.derived == self.instances


def derive_rules(target: Iterable[ast.RuleDecl], deriver: Deriver, library: Library,
                 progress: Progress | None = None) -> list[Derivation]:
    """For each rule, at every rank-2 instance: does saturating its lhs with `deriver`'s rules reach its rhs?

    All instances are first tried in one shared e-graph (fast); an instance
    not reached there is tried again alone, so that the shared e-graph's
    size limit never costs a derivation.
    """
    rules = list(target)
    work: list[tuple[int, RuleInstance, Mapping[str, int]]] = []
    counts = [0] * len(rules)
    notes = [""] * len(rules)
    for index, rule in enumerate(rules):
        instances = rank_instances(rule, library.ops)
        counts[index] = len(instances)
        if not instances:
            notes[index] = "no rank-2 instance"
        for instance in instances:
            sizes = _instance_sizes(instance, deriver.devices)
            if sizes is None:
                notes[index] = "no concrete sizes fit"
            else:
                work.append((index, instance, sizes))
    shared = deriver.derives_many([w[1] for w in work], [w[2] for w in work])
    derived = [0] * len(rules)
    for (index, instance, sizes), ok in zip(work, shared):
        if ok or deriver.derives(instance, sizes):
            derived[index] += 1
    out = []
    for index, rule in enumerate(rules):
        out.append(Derivation(rule.name, counts[index], derived[index], notes[index]))
        if progress is not None:
            progress(f"{rule.name}: {derived[index]}/{counts[index]}")
    return out


def rules_over(library: Library, ops: Iterable[str]) -> list[ast.RuleDecl]:
    """The library's rules that use only `ops` (parallel ops included when named)."""
    allowed = set(ops)
    return [r for r in library.rules if set(_ops_of(r.lhs)) | set(_ops_of(r.rhs)) <= allowed]
