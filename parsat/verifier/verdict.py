"""What the verifier says about a rule: the verdict and its evidence.

Plain frozen data, JSON-ready, shared by the concrete search, the prover,
the cache and the CLI. The verdict words mean exactly this:

* PROVED: for every size, every degree and every rank the rule applies at.
* BOUNDED: proved for every size and degree, but only at ranks up to
  `max_rank` (the largest rank of a metavariable): its rank-polymorphic
  groups could not be argued away. The optimizer never applies it above.
* VACUOUS: true only because it (almost) never applies: its assumptions
  force a degree to 1, or cannot hold at all. Not a usable rule.
* ILLEGAL: the spread analysis cannot place a node of the rule (the read
  it refuses and why): a term it cannot place is not a parallel program,
  so the rule is neither proved nor refuted with values. Never applied.
* REFUTED: a replayed counterexample (shapes, degrees, inputs, both sides,
  and where the devices or values differ).
* UNKNOWN: neither, with the reason and the limit that was hit.

A counterexample carries everything a person needs to replay it (Alive2
style): the rank choice, sizes and degrees, input values, both sides'
values, and the device and index where they differ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PROVED = "PROVED"
BOUNDED = "BOUNDED"
VACUOUS = "VACUOUS"
ILLEGAL = "ILLEGAL"
REFUTED = "REFUTED"
UNKNOWN = "UNKNOWN"
VERDICTS = (PROVED, BOUNDED, VACUOUS, ILLEGAL, REFUTED, UNKNOWN)


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
    device: str = ""  # where the devices differ from the semantics (device, local index, values)

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
        if self.device:
            lines.append(f"{indent}devices: {self.device}")
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    text = str(value).replace(".0,", ",").replace(".0]", "]")
    return text if len(text) <= 400 else text[:400] + " ..."


@dataclass(frozen=True)
class Verdict:
    """One rule's outcome. `reason` is set unless PROVED; `max_rank` only for BOUNDED."""

    name: str
    file: str
    line: int
    verdict: str
    seconds: float = 0.0
    reason: str = ""
    counterexample: Counterexample | None = None
    assumptions: tuple[str, ...] = ()
    cached: bool = False
    max_rank: int | None = None  # BOUNDED: proved for metavariables of rank up to this
    notes: tuple[str, ...] = ()  # bug reports (the spread analysis or the z3 lowering disagreed with the devices)

    @property
    def proved(self) -> bool:
        """Proved for every rank: the only verdict `parsat verify` exits 0 on."""
        return self.verdict == PROVED

    @property
    def usable(self) -> bool:
        """The optimizer may apply it (a BOUNDED rule only up to `max_rank`)."""
        return self.verdict in (PROVED, BOUNDED)

    def to_json(self) -> dict:
        record = asdict(self)
        record["assumptions"] = list(self.assumptions)
        record["notes"] = list(self.notes)
        return record

    @staticmethod
    def from_json(record: dict) -> "Verdict":
        cex = record.get("counterexample")
        return Verdict(record["name"], record["file"], record["line"], record["verdict"], record.get("seconds", 0.0),
                       record.get("reason", ""), Counterexample(**cex) if cex else None,
                       tuple(record.get("assumptions", ())), record.get("cached", False), record.get("max_rank"),
                       tuple(record.get("notes", ())))

    def headline(self) -> str:
        """The one-line form: `file:line: name: VERDICT` (with the bound for BOUNDED)."""
        head = f"{self.file}:{self.line}: {self.name}: {self.verdict}"
        if self.verdict == BOUNDED:
            head += f" (ranks up to {self.max_rank})"
        return head

    def render(self) -> str:
        head = self.headline()
        if self.verdict in (PROVED, BOUNDED):
            text = head + f" ({self.seconds:.2f} s)"
            if self.verdict == BOUNDED and self.reason:
                text += f"\n  {self.reason}"
            if self.assumptions:
                text += "\n  assuming " + "; ".join(self.assumptions)
        else:
            text = head + (f": {self.reason}" if self.reason and not self.counterexample else "")
            if self.counterexample is not None:
                text += "\n" + self.counterexample.render()
        for note in self.notes:
            text += f"\n  bug report: {note}"
        return text
