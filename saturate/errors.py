"""Why `optimize` could not make a plan: the one error of this package that reaches the user."""

from __future__ import annotations


class OptimizeError(Exception):
    """Why no plan could be made; the message is for the user."""
