"""What the verifier says about a rule: the verdict and its evidence.

Plain frozen data, JSON-ready, shared by the concrete search, the prover,
the cache and the CLI. A counterexample carries everything a person needs
to replay it (Alive2 style): the rank choice, sizes and degrees, input
values, and both sides' outputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PROVED = "PROVED"
REFUTED = "REFUTED"
UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class Counterexample:
    """Concrete sizes and values on which the two sides differ (replayed)."""

    reason: str
    groups: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    reals: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)  # name -> nested lists
    lhs: Any = None  # logical value (nested lists), or a description when undefined
    rhs: Any = None
    lhs_text: str = ""
    rhs_text: str = ""
    lhs_spread: str = ""
    rhs_spread: str = ""

    def render(self, indent: str = "  ") -> str:
        """The counterexample as a user reads it."""
        lines = [f"{indent}{self.reason}"]
        if self.groups:
            lines.append(indent + "ranks:  " + ", ".join(f"len({g}) = {n}" for g, n in self.groups.items()))
        if self.sizes:
            lines.append(indent + "sizes:  " + ", ".join(f"{k} = {v}" for k, v in self.sizes.items()))
        for name, value in self.reals.items():
            lines.append(f"{indent}{name} = {value}")
        for name, value in self.inputs.items():
            lines.append(f"{indent}{name} = {_fmt(value)}")
        lines.append(f"{indent}left   {self.lhs_text}")
        if self.lhs_spread:
            lines.append(f"{indent}  spread {self.lhs_spread}")
        lines.append(f"{indent}  = {_fmt(self.lhs)}")
        lines.append(f"{indent}right  {self.rhs_text}")
        if self.rhs_spread:
            lines.append(f"{indent}  spread {self.rhs_spread}")
        lines.append(f"{indent}  = {_fmt(self.rhs)}")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    text = str(value).replace(".0,", ",").replace(".0]", "]")
    return text if len(text) <= 400 else text[:400] + " ..."


@dataclass(frozen=True)
class Verdict:
    """One rule's outcome. `reason` is always set unless PROVED."""

    name: str
    file: str
    line: int
    verdict: str
    seconds: float = 0.0
    reason: str = ""
    counterexample: Counterexample | None = None
    assumptions: tuple[str, ...] = ()
    cached: bool = False

    @property
    def proved(self) -> bool:
        return self.verdict == PROVED

    def to_json(self) -> dict:
        record = asdict(self)
        record["assumptions"] = list(self.assumptions)
        return record

    @staticmethod
    def from_json(record: dict) -> "Verdict":
        cex = record.get("counterexample")
        return Verdict(record["name"], record["file"], record["line"], record["verdict"], record.get("seconds", 0.0),
                       record.get("reason", ""), Counterexample(**cex) if cex else None,
                       tuple(record.get("assumptions", ())), record.get("cached", False))

    def render(self) -> str:
        head = f"{self.file}:{self.line}: {self.name}: {self.verdict}"
        if self.verdict == PROVED:
            text = head + f" ({self.seconds:.2f} s)"
            if self.assumptions:
                text += "\n  assuming " + "; ".join(self.assumptions)
            return text
        text = head + (f": {self.reason}" if self.reason and not self.counterexample else "")
        if self.counterexample is not None:
            text += "\n" + self.counterexample.render()
        return text
