"""`count_module_calls`: what a module issues when it runs eagerly, counted once at its example inputs.

The torch-native runtime runs the user's module, whose forward makes calls the imported graph folds away
(`ir.module_calls`); the simulator prices them from these counts. A `TorchDispatchMode` counts the forward's
ATen calls as the dispatcher sees them below autograd (views and casts included, one per call, as
`parsat calibrate` times a dispatch); the autograd nodes are counted by walking the outputs' `grad_fn` graph
(nothing runs backward). The module is left as it was found: its buffers (a batch norm's running statistics)
are restored and the random generators forked, so a dropout draws nothing a later step would.
"""

from __future__ import annotations

from parsat.importer.export import buffers_kept, example_tuple
from parsat.ir.graph import Graph
from parsat.ir.module_calls import ModuleCalls


def count_module_calls(module, example_inputs, graph: Graph) -> ModuleCalls:
    """One eager forward of `module` on `example_inputs` (the import's: a tensor or a tuple of them), counted
    beside `graph`, the graph imported from it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counting(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    with buffers_kept(module), torch.random.fork_rng(devices=[]), torch.enable_grad():
        counting = _Counting()
        with counting:
            outputs = module(*example_tuple(example_inputs))
    return ModuleCalls(counting.calls, _autograd_nodes(outputs), len(graph.nodes))


def _autograd_nodes(outputs) -> int:
    """Distinct autograd nodes reachable from the tensors in `outputs` (a tensor, a tuple, a dict-like model
    output), AccumulateGrad (a parameter's gradient landing, one per parameter) aside."""
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves(dict(outputs) if hasattr(outputs, "keys") and not isinstance(outputs, dict) else outputs)
    stack = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return sum(1 for fn in seen if type(fn).__name__ != "AccumulateGrad")


__all__ = ["count_module_calls"]
