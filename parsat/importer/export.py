"""`from_torch(module, example_inputs)`, `import_module`: a torch `nn.Module` as a parsat graph, via `torch.export`.

`torch.export.export(module, inputs, strict=False)` gives the ATen graph of
one forward call with real shapes, every parameter, buffer and constant
lifted to a placeholder, and each node's source line and module path in
`node.meta`. The translator (`translator.py`) runs that graph once on the
example inputs and sorts each node into compute (mapped onto the library's
operators) or data (fed as input leaves: `imported.py`). `import_module`
leaves the module as it found it: exporting runs its forward, and a batch
norm in training mode would update its running statistics.

This is the one place the importer exports a module; `export_module` is
the call (the backend's `parallelize` takes an `ImportedModule` so that it
need not export again).
"""

from __future__ import annotations

from contextlib import contextmanager

from parsat.importer.errors import TorchImportError
from parsat.importer.imported import ImportedModule
from parsat.importer.self_check import ImportTrace, check_import
from parsat.importer.translator import Translator
from parsat.ir.block_layout import block_names
from parsat.ir.graph import Graph, GraphBuilder


def from_torch(module, example_inputs, library=None, name: str | None = None, *, check: bool = True) -> Graph:
    """The parsat graph of `module` applied to `example_inputs` (a tensor or a tuple of them).

    Raises `TorchImportError` listing every operator parsat cannot express,
    or, with `check` (the default), naming the first graph node whose value
    differs from the module's: the graph is evaluated against the module on
    the example inputs in float64, loss (or outputs) and every parameter's
    gradient, to a relative 1e-6 with an absolute floor of 1e-9
    (`self_check`). The check is skipped for meta tensors (no values to
    compare); `check=False` skips it on a model too large to run twice.
    """
    return import_module(module, example_inputs, library, name, check=check).graph


def export_module(module, inputs: tuple):
    """`torch.export` of `module` on `inputs` (non-strict), any failure as a `TorchImportError`."""
    import torch

    try:
        return torch.export.export(module, inputs, strict=False)
    except Exception as err:  # noqa: BLE001 - export raises many kinds; the user needs the reason, not a trace
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TorchImportError(f"torch.export cannot trace {type(module).__name__}: {type(err).__name__}: "
                               f"{first[:400]}") from None


def import_module(module, example_inputs, library=None, name: str | None = None, *,
                  check: bool = True) -> ImportedModule:
    """Export `module`, sort its nodes into compute and data, map the compute onto library operators, and with
    `check` evaluate the graph against the module in float64 (`from_torch`, `self_check.check_import`)."""
    import torch

    inputs = example_tuple(example_inputs)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TorchImportError("example inputs must be tensors (a tensor or a tuple of tensors)")
    # the same tensor passed twice (a causal LM's (ids, ids)): torch.export reads both through one placeholder, so
    # the graph would read the first input from the second, and a batch whose labels are not its ids would be
    # computed on the wrong one (a rewritten forward, `backend.torch_native.rewritten`): a copy gives each its own
    inputs = tuple(t.clone() if any(t is u for u in inputs[:i]) else t for i, t in enumerate(inputs))
    for path, sub in module.named_modules():  # torch.export itself fails on these, with a cryptic message
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm) and sub.training and sub.track_running_stats \
                and sub.momentum is None:
            raise TorchImportError(f"{type(module).__name__}: batch norm '{path}' has momentum=None (a cumulative "
                                   "average of its running statistics), which parsat does not support; give it a "
                                   "momentum")
    was_training = module.training
    with buffers_kept(module):
        program = export_module(module, inputs)
        module.train(was_training)
        translator = Translator(module, program, inputs, GraphBuilder(library, name=name or type(module).__name__))
        imported, trace = named_blocks(translator.run(), translator.trace())
        if check:
            check_import(imported, inputs, trace, type(module).__name__)
        return imported


def example_tuple(example_inputs) -> tuple:
    """The example inputs as the module is called with them: a tensor alone, or a tuple (or list) of them."""
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


@contextmanager
def buffers_kept(module):
    """The module's buffers as they were on entry, again on exit: exporting (or running) its forward executes
    it, and a batch norm in training mode updates its running statistics in place; an import must leave the
    module as it found it."""
    import torch

    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])


def named_blocks(imported: ImportedModule, trace: ImportTrace) -> tuple[ImportedModule, ImportTrace]:
    """The import with a stack of identical blocks (a transformer's layers) named as the search, pipeline stages
    and recomputation cut models, `b{i}_...` (`ir.block_layout.block_names`: found by structure, not by the
    module's names); as it is where it has none. Its self-check then runs on the renamed graph."""
    renaming = block_names(imported.graph)
    if not renaming:
        return imported, trace
    return imported.renamed(renaming), trace.renamed(renaming)
