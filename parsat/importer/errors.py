"""What the importer reports: `TorchImportError`, and each unsupported node with where it came from.

Nothing is dropped silently. Mapping one node raises `Refused` with the
reason; the translator (`translator.py`) turns it into an `Unsupported`
entry (the ATen operator, the reason, the line of the user's code that made
the node and the module path, read from `node.meta`) and goes on, so one
`TorchImportError` lists every operator parsat cannot import at once; nodes
that depend on a failed node are not reported again. The names of ATen
nodes (`aten_short`, what the operator table is keyed by) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass


class TorchImportError(ValueError):
    """A module parsat cannot import; the message lists every unsupported operator and where it is.

    A ValueError, so that `parsat optimize model.py:factory` reports it like any bad model argument.
    """


@dataclass(frozen=True)
class Unsupported:
    """One node parsat cannot map: the ATen operator, why, the user's source line and the module path."""

    aten: str
    reason: str
    source: str
    module: str

    def __str__(self) -> str:
        where = f"in module '{self.module}'" if self.module else "in the top-level forward"
        line = f"\n      at {self.source}" if self.source else ""
        return f"  - {self.aten} {where}: {self.reason}{line}"


class Refused(Exception):
    """Raised inside the mapping of one node; becomes an `Unsupported` entry."""


def aten_short(node) -> str:
    """`aten.add.Tensor` -> `add`; in-place `add_` -> `add`; a higher-order op by its name."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", None) or str(target)
    name = name.split(".")[-1]
    if name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return name


def aten_name(node) -> str:
    return str(node.target) if not callable(node.target) or hasattr(node.target, "_overloadpacket") \
        else getattr(node.target, "__name__", str(node.target))


def source_line(node) -> str:
    """`file:line: code` of the innermost frame outside torch in the node's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.strip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith('File "') \
                else ""
            path, _, rest = line[6:].partition('", line ')
            number = rest.split(",")[0]
            frames.append((path, number, code))
    user = [f for f in frames if "/torch/" not in f[0] and "/parsat/" not in f[0] and "/backend/" not in f[0]]
    if not user:
        return ""
    path, number, code = user[-1]
    return f"{path}:{number}: {code}" if code else f"{path}:{number}"


def module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
    return path
