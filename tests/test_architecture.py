"""The house's rules, checked on the source: which package may import which (docs/ARCHITECTURE.md).

Every module of every package (each folder under `parsat/`) is parsed
(`ast`, nothing is imported) and each import it makes, at the top or inside
a function, is held against the allowed directions:

    dsl <- ir <- cost <- search,  ir <- egraph <- search,  egraph <- generate,
    dsl <- verifier <- generate,  ir <- importer <- backend,  ir <- report,

with `rules` (package data) below everything and the facade (the modules
directly in `parsat/`) above everything. A package may import what it
points to, directly or through others (search may import dsl). Also
refused: a cycle between packages or between modules (a function-level
import does not hide one), a private (underscore) name taken from another
package, and a heavy dependency outside its one home (egglog: the e-graph's
session; z3: verifier; torch: importer and backend; highspy: search).
Importing `parsat`, the dsl and the data model must load none of them:
checked in a fresh interpreter.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> the packages it may import (the transitive closure of the directions above)
ALLOWED = {
    "rules": set(),
    "dsl": {"rules"},
    "ir": {"dsl", "rules"},
    "verifier": {"dsl", "rules"},
    "cost": {"ir", "dsl", "rules"},
    "egraph": {"ir", "dsl", "rules"},
    "search": {"cost", "egraph", "ir", "dsl", "rules"},
    "generate": {"egraph", "verifier", "ir", "dsl", "rules"},
    "importer": {"ir", "dsl", "rules"},
    "backend": {"importer", "ir", "dsl", "rules"},
    "report": {"ir", "dsl", "rules"},
    "parsat": {"dsl", "rules", "ir", "verifier", "cost", "egraph", "search", "generate", "importer", "backend",
               "report"},
}
DIRECTIONS = ("dsl <- ir <- cost <- search, ir <- egraph <- search, egraph <- generate, dsl <- verifier <- generate, "
              "ir <- importer <- backend, ir <- report, the facade on top")
# third-party module -> the only files (or packages) that may import it
HEAVY = {
    "egglog": ("parsat/egraph/session.py",),
    "z3": ("parsat/verifier/",),
    "torch": ("parsat/importer/", "parsat/backend/"),
    "highspy": ("parsat/search/",),
}
LIGHT_PACKAGES = ("parsat", "parsat.dsl", "parsat.ir")


@dataclass(frozen=True)
class Import:
    source: str        # file, relative to the repository ("parsat/search/optimize.py")
    line: int
    module: str        # the module imported ("parsat.verifier.api")
    names: tuple[str, ...] = ()   # names taken from it (`from module import names`)


PACKAGE = ROOT / "parsat"


def package_dirs() -> dict[str, Path]:
    """Subpackage name ("dsl", and "parsat" for the facade) -> its folder: every folder of `parsat/` that is a
    package, and `parsat/` itself for the facade."""
    return dict(_package_dirs(PACKAGE))


@functools.lru_cache(maxsize=None)
def _package_dirs(package: Path) -> dict[str, Path]:
    """`package_dirs` of the tree at `package`, listed once a process: `folder_of` and `package_of` ask for it
    for every import (3,000 listings of `parsat/` a pass, a third of `all_imports`' CPU). Keyed by the folder,
    so the size checks' made-up tree (`PACKAGE` patched) is listed as itself; the tree does not change while
    the tests run."""
    found = {folder.name: folder for folder in sorted(package.iterdir()) if (folder / "__init__.py").is_file()}
    return {"parsat": package, **found}


def package_files(package: str, folder: Path) -> list[Path]:
    """The modules of a package: the facade's are the files directly in `parsat/`, a stage's every file below
    its folder."""
    return sorted(folder.glob("*.py") if package == "parsat" else folder.rglob("*.py"))


def module_name(path: Path, package: str, folder: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["parsat"] + ([] if package == "parsat" else [package]) + parts)


def imports_of(path: Path, package: str, folder: Path) -> list[Import]:
    """Every import of a file: `import a.b`, `from a.b import c`, relative ones, `importlib.import_module("a.b")`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    source = path.relative_to(ROOT).as_posix()
    here = module_name(path, package, folder)
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(source, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names = tuple(alias.name for alias in node.names)
            found.append(Import(source, node.lineno, base, names))
            # `from parsat.cost import model` imports the module parsat.cost.model
            found += [Import(source, node.lineno, f"{base}.{name}") for name in names
                      if (ROOT / folder_of(f"{base}.{name}")).with_suffix(".py").exists()]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append(Import(source, node.lineno, node.args[0].value))
    return found


def folder_of(module: str) -> Path:
    """The path (without suffix) a parsat module lives at, e.g. parsat.cost.model -> saturate/cost."""
    dirs = package_dirs()
    parts = module.split(".")
    if parts[0] != "parsat":
        return Path("/nonexistent")
    if len(parts) > 1 and parts[1] in dirs and parts[1] != "parsat":
        return dirs[parts[1]].relative_to(ROOT).joinpath(*parts[2:])
    return dirs["parsat"].relative_to(ROOT).joinpath(*parts[1:])


def package_of(module: str) -> str | None:
    """The subpackage a module belongs to ("search"), "parsat" for the facade, None if not parsat's."""
    parts = module.split(".")
    if parts[0] != "parsat":
        return None
    if len(parts) > 1 and parts[1] in package_dirs() and parts[1] != "parsat":
        return parts[1]
    return "parsat"


def all_imports() -> dict[str, list[Import]]:
    """Package -> every import its modules make."""
    out: dict[str, list[Import]] = {}
    for package, folder in package_dirs().items():
        for path in package_files(package, folder):
            out.setdefault(package, []).extend(imports_of(path, package, folder))
    return out


# ------------------------------------------------------------------ the checks


def across_packages(imports: dict[str, list[Import]]):
    """(importing package, imported package, the import) for every import of another parsat package."""
    for package, found in imports.items():
        for imp in found:
            target = package_of(imp.module)
            if target is not None and target != package:
                yield package, target, imp


def direction_violations(imports: dict[str, list[Import]]) -> list[str]:
    problems = []
    for package, target, imp in across_packages(imports):
        if target not in ALLOWED[package]:
            allowed = ", ".join(sorted(ALLOWED[package])) or "nothing of parsat"
            problems.append(f"{imp.source}:{imp.line} imports {imp.module}: {package} may import only "
                            f"{allowed} ({DIRECTIONS})")
    return problems


def private_violations(imports: dict[str, list[Import]]) -> list[str]:
    problems = []
    for _package, _target, imp in across_packages(imports):
        hidden = [n for n in imp.names if n.startswith("_") and not n.endswith("__")]
        hidden += [part for part in imp.module.split(".") if part.startswith("_") and part != "__init__"]
        if hidden:
            problems.append(f"{imp.source}:{imp.line} takes the private name(s) {', '.join(hidden)} from "
                            f"{imp.module}: another package's underscore names are not its API")
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_edges(imports: dict[str, list[Import]]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {package: set() for package in imports}
    for package, target, _imp in across_packages(imports):
        edges[package].add(target)
    return edges


def module_edges(imports: dict[str, list[Import]]) -> dict[str, set[str]]:
    """File -> the parsat files it imports (a package's __init__ counts as a file)."""
    edges: dict[str, set[str]] = {}
    for found in imports.values():
        for imp in found:
            if package_of(imp.module) is None:
                continue
            base = folder_of(imp.module)
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if (ROOT / candidate).exists():
                    if candidate.as_posix() != imp.source:
                        edges.setdefault(imp.source, set()).add(candidate.as_posix())
                    break
    return edges


def heavy_violations(imports: dict[str, list[Import]]) -> list[str]:
    problems = []
    for found in imports.values():
        for imp in found:
            top = imp.module.split(".")[0]
            if top in HEAVY and not any(imp.source == home or (home.endswith("/") and imp.source.startswith(home))
                                        for home in HEAVY[top]):
                problems.append(f"{imp.source}:{imp.line} imports {top}: only {', '.join(HEAVY[top])} may")
    return problems


# ---------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def imports() -> dict[str, list[Import]]:
    """`all_imports()`, read once for the module's five checks of it (each made its own pass, ~2 CPU s apiece:
    every file parsed and walked, every import resolved). The checks are the functions they were, each fed the
    same mapping it read before; `test_the_checks_catch_what_they_guard` still feeds them made-up imports."""
    return all_imports()


def test_every_package_is_known():
    assert set(package_dirs()) == set(ALLOWED)


def test_imports_follow_the_directions(imports):
    problems = direction_violations(imports)
    assert not problems, "imports against the directions:\n" + "\n".join(problems)


def test_no_cycle_between_packages(imports):
    found = cycles(package_edges(imports))
    assert not found, "packages that import each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_cycle_between_modules(imports):
    found = cycles(module_edges(imports))
    assert not found, "modules that import each other (a function-level import does not hide it): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_no_private_name_crosses_a_package(imports):
    problems = private_violations(imports)
    assert not problems, "\n".join(problems)


def test_heavy_dependencies_stay_home(imports):
    problems = heavy_violations(imports)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_guard():
    """Each check refuses a made-up import that breaks its rule, so a passing run means something."""
    fake = {"search": [Import("parsat/search/x.py", 1, "parsat.verifier.api", ("verify_library",)),
                       Import("parsat/search/x.py", 2, "parsat.dsl.library", ("_display",))],
            "verifier": [Import("parsat/verifier/y.py", 3, "parsat.search.extract", ("work",))]}
    assert any("search may import only" in p for p in direction_violations(fake))
    assert any("_display" in p for p in private_violations(fake))
    assert cycles(package_edges(fake)) == [["search", "verifier"]]
    assert heavy_violations({"ir": [Import("parsat/ir/z.py", 4, "egglog.bindings")]})


def test_importing_parsat_the_dsl_and_the_data_model_loads_no_heavy_dependency():
    modules = [m for package in LIGHT_PACKAGES for m in _modules(package)]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            # a submodule counts: parsat loads egglog's bindings without the egglog package (egraph.session)
            f"print(sorted(m for m in {tuple(HEAVY)!r} if any(k.split('.')[0] == m for k in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _modules(package: str) -> list[str]:
    """`package` and, for dsl and ir, every module in it (the facade's own modules may import lazily only)."""
    if package == "parsat":
        return ["parsat"]
    name = package.split(".")[-1]
    folder = package_dirs()[name]
    return [module_name(path, name, folder) for path in sorted(folder.glob("*.py"))]


# ------------------------------------------------------------------ sizes: read in one sitting

MAX_FUNCTION_LINES = 80     # a function longer than this does more than one thing (issue: the house, second step)
MAX_PACKAGE_SHARE = 0.25    # of parsat's source lines, for any one package


def function_lengths() -> list[tuple[int, str]]:
    """(lines, "file:line name") of every function and method of parsat's source, longest first; a function's
    lines run from its `def` to its last line, docstring included."""
    found = []
    for package, folder in package_dirs().items():
        for path in package_files(package, folder):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((node.end_lineno - node.lineno + 1,
                                  f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def package_lines() -> dict[str, int]:
    """Package -> the lines of its modules (the facade: the modules directly in `parsat/`)."""
    return {package: sum(len(path.read_text(encoding="utf-8").splitlines()) for path in package_files(package, folder))
            for package, folder in package_dirs().items()}


def test_no_function_is_longer_than_80_lines():
    long = [f"{where}: {lines} lines" for lines, where in function_lengths() if lines > MAX_FUNCTION_LINES]
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_package_holds_more_than_a_quarter_of_the_source():
    sizes = package_lines()
    total = sum(sizes.values())
    large = [f"{package}: {lines} of {total} lines ({lines / total:.0%})" for package, lines in sizes.items()
             if lines > MAX_PACKAGE_SHARE * total]
    assert not large, "packages over a quarter of the source:\n" + "\n".join(large)


def test_the_size_checks_catch_what_they_guard(tmp_path, monkeypatch):
    """A made-up package with one 81-line function and most of the lines fails both checks."""
    fake = tmp_path / "parsat"
    (fake / "huge").mkdir(parents=True)
    (fake / "__init__.py").write_text('"""facade"""\n')
    (fake / "huge" / "__init__.py").write_text("def f():\n" + "    x = 1\n" * 79 + "    return x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert function_lengths()[0][0] == 81
    sizes = package_lines()
    assert sizes["huge"] > MAX_PACKAGE_SHARE * sum(sizes.values())


def unlisted_modules() -> list[str]:
    """Modules that their package's docstring does not name (as `module`): the docstring is the package's map."""
    missing = []
    for package, folder in package_dirs().items():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
        missing += [f"{package}.{path.stem}" for path in sorted(folder.glob("*.py"))
                    if path.stem != "__init__" and f"`{path.stem}`" not in doc]
    return missing


def test_every_package_docstring_lists_its_modules():
    missing = unlisted_modules()
    assert not missing, "modules their package's docstring does not name: " + ", ".join(missing)
