"""Loading `.rule` files into a `Library`: imports resolved, cycles refused.

An `import "x.rule"` is resolved against the importing file's folder, then
against the shipped rules folder, so a user's file can `import "ops.rule"`
to build on parsat's operators. Every file is loaded once (by real path).

Only `.rule` files are read, each through `files.read_capped`, and all the
files of one library together are bounded (`files.max_rule_bytes`): an
`import "/proc/self/environ"` is refused by its name before it is opened
(so no line of it can appear in an error), and a 10 MB file is refused in
a moment instead of being checked for minutes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from parsat.dsl import ast
from parsat.dsl.errors import Diagnostic, DslError, SourceCache, printable
from parsat.dsl.files import FileProblem, FileTooLarge, max_rule_bytes, read_text_capped
from parsat.dsl.parse_cache import parse_cached


def shipped_rules_dir() -> Path:
    """Where the installed `.rule` library lives (package data)."""
    from parsat.rules import RULES_DIR

    return RULES_DIR


@dataclass(frozen=True)
class Library:
    """All operators and rules of a set of files, in load order."""

    modules: tuple[ast.Module, ...]
    sources: SourceCache = field(compare=False, repr=False)

    @cached_property
    def ops(self) -> dict[str, ast.OpDecl]:
        """Operator name -> its declaration, the first file's where two declare it. Computed once per library:
        building a graph looks an operator up per node (a 100,001-node graph spent 10 s rebuilding this table);
        callers read it, never write to it."""
        found: dict[str, ast.OpDecl] = {}
        for module in self.modules:
            for op in module.ops:
                found.setdefault(op.name, op)
        return found

    @property
    def rules(self) -> tuple[ast.RuleDecl, ...]:
        return tuple(rule for module in self.modules for rule in module.rules)

    def rule(self, name: str) -> ast.RuleDecl:
        for rule in self.rules:
            if rule.name == name:
                return rule
        raise KeyError(name)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(m.path for m in self.modules)

    @cached_property
    def rule_locations(self) -> dict[str, str]:
        """Rule name -> `name (file:line)`, in library order: how a plan's node names the rules that produced it
        (`search.solve`'s provenance, the grid's head-ordered layouts). Computed once per library; callers read
        it, never write to it."""
        return {rule.name: f"{rule.name} ({rule.span.file}:{rule.span.line})" if rule.span else rule.name
                for rule in self.rules}


MAX_FOLDER_ENTRIES = 100_000   # `parsat check /` must end: a folder of rules is not the whole file system


def rule_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The `.rule` files named, with folders expanded (sorted, recursive; symbolic links to folders are not
    followed, and a walk past MAX_FOLDER_ENTRIES entries is refused)."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(_rule_files_under(path))
        elif path.exists():
            if path.suffix != ".rule":
                raise DslError(Diagnostic("io", f"{printable(str(path))}: not a .rule file (parsat reads rules only "
                                                "from .rule files and folders of them)", None))
            found.append(path)
        else:
            raise DslError(Diagnostic("io", f"{printable(str(path))}: no such file or folder", None))
    return found


def _rule_files_under(folder: Path) -> list[Path]:
    found, seen = [], 0
    for root, dirs, names in os.walk(folder):
        seen += len(dirs) + len(names)
        if seen > MAX_FOLDER_ENTRIES:
            raise DslError(Diagnostic("io", f"{printable(str(folder))}: more than {MAX_FOLDER_ENTRIES:,} files and "
                                            "folders under it; name the folder that holds the .rule files", None))
        dirs.sort()
        found += [Path(root) / name for name in names if name.endswith(".rule") and (Path(root) / name).is_file()]
    return sorted(found)


@dataclass
class _Frame:
    """A file being loaded: its module, and the imports of it still to load."""

    path: Path
    real: str
    module: ast.Module
    pending: Iterator[ast.Import]


class _Loader:
    def __init__(self) -> None:
        self.sources = SourceCache()
        self.modules: list[ast.Module] = []
        self.done: set[str] = set()
        self.errors: list[Diagnostic] = []
        self.budget = max_rule_bytes()   # bytes of .rule text this library may still read

    def load(self, path: Path) -> None:
        """`path` and, depth first, every file it imports, each module after the ones it imports.

        A loop over an explicit stack of files, not recursion: an import chain
        of 1,200 files ended in Python's RecursionError. The stack is also the
        chain an import cycle is named by."""
        chain: list[_Frame] = []
        first = self._open(path, chain, None)
        if first is not None:
            chain.append(first)
        while chain:
            item = next(chain[-1].pending, None)
            if item is None:
                self.modules.append(chain.pop().module)
                continue
            target = self._target(chain[-1], item)
            frame = self._open(target, chain, item) if target is not None else None
            if frame is not None:
                chain.append(frame)

    def _target(self, frame: _Frame, item: ast.Import) -> Path | None:
        """The file an import names, or None with a diagnostic (not a .rule file, not found, a bad path)."""
        shown = _short_path(item.path)
        if not item.path.endswith(".rule"):
            self.errors.append(self.sources.diagnostic(
                "import", f"cannot import '{shown}': only .rule files can be imported", item.span))
            return None
        try:
            target = _resolve(frame.path.parent, item.path)
        except (OSError, ValueError) as err:   # too long for the file system, a loop of links, a NUL byte
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            self.errors.append(self.sources.diagnostic("import", f"cannot import '{shown}': {reason}", item.span))
            return None
        if target is None:
            self.errors.append(self.sources.diagnostic(
                "import", f"cannot find '{shown}' (looked next to {printable(display_path(frame.path))} and in the "
                          "shipped rules)", item.span))
        return target

    def _open(self, path: Path, chain: list[_Frame], via: ast.Import | None) -> _Frame | None:
        """Read and parse `path` for the chain; None when it is already loaded, closes a cycle or fails."""
        real = os.path.realpath(path)
        reals = [frame.real for frame in chain]
        if real in reals:
            cycle = " -> ".join(os.path.basename(p) for p in reals[reals.index(real):] + [real])
            self.errors.append(self.sources.diagnostic("import", f"import cycle: {cycle}", via.span if via else None))
            return None
        if real in self.done:
            return None
        self.done.add(real)
        display = display_path(path)
        span = via.span if via else None
        try:
            text = read_text_capped(display, self.budget, "rule", "PARSAT_MAX_RULE_BYTES")
        except FileTooLarge:
            self.errors.append(self.sources.diagnostic(
                "io", f"{printable(display)}: too much rule text: the .rule files of one library may hold "
                      f"{max_rule_bytes():,} bytes together (PARSAT_MAX_RULE_BYTES)", span))
            return None
        except FileProblem as err:
            self.errors.append(self.sources.diagnostic("io", str(err), span))
            return None
        self.budget -= len(text.encode("utf-8"))
        self.sources.add(display, text)
        try:
            module = parse_cached(text, display)   # Lark once per file content
        except DslError as err:
            self.errors.extend(err.diagnostics)
            return None
        return _Frame(Path(path), real, module, iter(module.imports))


def _short_path(path: str) -> str:
    """An imported path as a message shows it: a 5,000-character one by its start and its length."""
    return printable(path if len(path) <= 120 else f"{path[:60]}... ({len(path):,} characters)")


def display_path(path: Path) -> str:
    """A path as the user would write it: relative to the working folder when inside it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if relative.startswith("..") else relative


def _resolve(folder: Path, name: str) -> Path | None:
    for base in (folder, shipped_rules_dir()):
        candidate = base / name
        if candidate.is_file():
            return candidate
    return None


def load_library(paths: Sequence[str | os.PathLike] | None = None, *, strict: bool = True) -> tuple[Library, list[Diagnostic]]:
    """Parse the files (default: the shipped library) and their imports.

    Returns the library and the load/parse diagnostics; with `strict`, any
    diagnostic raises `DslError` instead.
    """
    loader = _Loader()
    try:
        files = rule_files(paths if paths else [shipped_rules_dir()])
    except DslError as err:
        if strict:
            raise
        return Library((), loader.sources), err.diagnostics
    for file in files:
        loader.load(file)
    library = Library(tuple(loader.modules), loader.sources)
    if strict and loader.errors:
        raise DslError(loader.errors)
    return library, loader.errors
