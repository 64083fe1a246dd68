"""`load_model_factory("model.py:make_model")`: a user's module and example inputs from a Python file.

What `parsat optimize model.py:factory` and `parsat run --model` read: the
file is imported as a module of its own (its folder is not added to
sys.path) and the factory called; it returns (module, example inputs).
Every failure (no torch, no file, an error in the user's code, a factory
that returns something else) is a `TorchImportError` with the reason, which
the CLI reports like any bad argument.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from parsat.importer.errors import TorchImportError
from parsat.importer.export import from_torch
from parsat.ir.graph import Graph


def load_model_factory(path_spec: str):
    """(module, example inputs) from `file.py:factory`; every failure is a `TorchImportError` with the reason.

    The file is imported as a module of its own (its folder is not added to sys.path).
    """
    file_part, sep, factory = path_spec.rpartition(":")
    if not sep or not file_part or not factory:
        raise TorchImportError(f"'{path_spec}': give a Python file and a factory, like model.py:make_model")
    path = Path(file_part)
    if not path.is_file():   # said before torch loads (3 CPU s)
        raise TorchImportError(f"'{file_part}' is not a file")
    try:
        import torch  # noqa: F401 - only to give a clear message when it is missing
    except ImportError:
        raise TorchImportError("importing a torch model needs torch: pip install torch==2.13.0") from None
    module_name = f"parsat_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TorchImportError(f"'{file_part}' cannot be imported as Python")
    user = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = user
    try:
        spec.loader.exec_module(user)
    except Exception as err:  # noqa: BLE001 - a user's file: report its error, not ours
        raise TorchImportError(f"importing {file_part} failed: {type(err).__name__}: {err}") from None
    finally:
        sys.modules.pop(module_name, None)
    make = getattr(user, factory, None)
    if not callable(make):
        raise TorchImportError(f"{file_part} has no function '{factory}'")
    try:
        made = make()
    except Exception as err:  # noqa: BLE001
        raise TorchImportError(f"{file_part}:{factory}() failed: {type(err).__name__}: {err}") from None
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise TorchImportError(f"{file_part}:{factory}() must return (module, example_inputs)")
    return made[0], made[1]


def load_model_file(path_spec: str, library=None) -> Graph:
    """The graph of `file.py:factory`: the factory returns (module, example inputs)."""
    module, example_inputs = load_model_factory(path_spec)
    return from_torch(module, example_inputs, library, name=Path(path_spec.rpartition(":")[0]).stem)
