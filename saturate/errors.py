"""Why `optimize` could not make a plan: the one error of this package that reaches the user."""

from __future__ import annotations


class OptimizeError(Exception):
    """Why no plan could be made; the message is for the user."""


class DoesNotFit(OptimizeError):
    """No plan fits in memory: the smallest needs `needed_bytes` per device of `capacity_bytes`."""

    def __init__(self, message: str, needed_bytes: int, capacity_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.capacity_bytes = needed_bytes, capacity_bytes
