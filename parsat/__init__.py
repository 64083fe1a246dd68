"""parsat: proven rewrites, jointly optimized parallelization.

The public API is re-exported here; importing `parsat` imports neither
torch, z3 nor egglog (each is imported by the subpackage that needs it).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_rules", "check"]


def load_rules(paths=None):
    """The checked `Library` of the given files or folders (default: shipped).

    Raises `parsat.dsl.errors.DslError` listing every diagnostic.
    """
    from parsat.dsl.checker import load_checked

    return load_checked(paths)


def check(paths=None):
    """A `CheckReport` (diagnostics and counts) for files or folders."""
    from parsat.dsl.checker import check_paths

    return check_paths(paths)
