"""The data model's errors: each says, for the user, why a graph, machine or plan cannot be used.

They live apart from the classes that raise them so that the readers
(`graph`, `machine`, `plan`) and the structural checks they call first
(`validate`) share them without importing each other.
"""

from __future__ import annotations


class GraphError(Exception):
    """A graph that cannot be optimized; the message names the node."""


class MachineError(Exception):
    """A machine description that cannot be used."""


class PlanError(Exception):
    """A plan file that cannot be read."""
