"""`count_module_calls`: what a module issues when it runs eagerly, counted once at its example inputs.

The torch-native runtime runs the user's module, whose forward makes calls the imported graph folds away
(`ir.module_calls`); the simulator prices them from these counts. A `TorchDispatchMode` counts the forward's
ATen calls as the dispatcher sees them below autograd (views and casts included, one per call, as
`parsat calibrate` times a dispatch); the autograd nodes are counted by walking the outputs' `grad_fn` graph
(nothing runs backward for that count). The calls a tensor axis runs on DTensors are counted too: the forward's
calls made inside a module that holds parameters itself (the runtime computes those modules on DTensors), and
the ATen calls their autograd nodes make in one backward (`torch.autograd.grad` of the outputs, under the same
kind of mode, each call told by the autograd node that makes it). The Python bytecode instructions the forward
executes are counted on one more forward under a tracer (`count_python_instructions`). The module is left
as it was found: its buffers (a batch norm's running statistics) are restored, the random generators forked,
so a dropout draws nothing a later step would, and no parameter's `.grad` is touched.
"""

from __future__ import annotations

import sys
from typing import Callable

from parsat.importer.export import buffers_kept, example_tuple
from parsat.ir.graph import Graph
from parsat.ir.module_calls import ModuleCalls


def count_module_calls(module, example_inputs, graph: Graph) -> ModuleCalls:
    """One eager forward of `module` on `example_inputs` (the import's: a tensor or a tuple of them), counted
    beside `graph`, the graph imported from it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    depth = [0]           # how many modules holding parameters the forward is inside
    inside: set = set()   # the autograd nodes their forwards made

    class _Counting(TorchDispatchMode):
        calls = holding_calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            self.holding_calls += depth[0] > 0
            return func(*args, **(kwargs or {}))

    class _Backward(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += torch._C._current_autograd_node() in inside
            return func(*args, **(kwargs or {}))

    def enter(_module, _args):
        depth[0] += 1

    def leave(_module, args, kwargs, output):
        depth[0] -= 1
        inside.update(_nodes(output, stop=(args, kwargs)))

    holding = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    hooks = [h for m in holding for h in (m.register_forward_pre_hook(enter),
                                          m.register_forward_hook(leave, with_kwargs=True))]
    try:
        with buffers_kept(module), torch.random.fork_rng(devices=[]), torch.enable_grad():
            counting = _Counting()
            with counting:
                outputs = module(*example_tuple(example_inputs))
            backward = _Backward()
            differentiable = [t for t in _tensors(outputs) if t.grad_fn is not None and t.is_floating_point()]
            params = [p for p in module.parameters() if p.requires_grad]
            if differentiable and params:
                with backward:
                    torch.autograd.grad(differentiable, params, [torch.ones_like(t) for t in differentiable],
                                        allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    with buffers_kept(module), torch.random.fork_rng(devices=[]), torch.enable_grad():   # no hook of ours counted
        instructions = count_python_instructions(lambda: module(*example_tuple(example_inputs)))
    return ModuleCalls(counting.calls, _autograd_nodes(outputs), len(graph.nodes), counting.holding_calls,
                       backward.calls, instructions)


def count_python_instructions(fn: Callable[[], object]) -> int:
    """The Python bytecode instructions `fn()` executes, in every Python frame it enters (a module's own code,
    `nn.Module.__call__`, torch's Python wrappers; C code, an ATen kernel, counts nothing): a deterministic
    measure of the host time a module spends between its ATen calls, which `parsat calibrate` prices per
    instruction (`OpEfficiency.python_instruction_s`). A tracer already set (a debugger, coverage) is put back."""
    count = [0]

    def tracer(frame, event, _arg):
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event == "opcode":
            count[0] += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count[0]


def _tensors(value) -> list:
    """The tensors in a module's output or inputs (a tensor, nested tuples and dicts, a model output)."""
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves(dict(value) if hasattr(value, "keys") and not isinstance(value, dict) else value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _nodes(outputs, stop=()) -> set:
    """The autograd nodes reachable from the tensors in `outputs`, not going past the nodes of the tensors in
    `stop` (a module's inputs: what its forward made is what lies between them and its outputs)."""
    boundary = {t.grad_fn for t in _tensors(stop) if t.grad_fn is not None}
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen: set = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen or fn in boundary:
            continue
        seen.add(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return seen


def _autograd_nodes(outputs) -> int:
    """Distinct autograd nodes reachable from the tensors in `outputs` (a tensor, a tuple, a dict-like model
    output), AccumulateGrad (a parameter's gradient landing, one per parameter) aside."""
    return sum(1 for fn in _nodes(outputs) if type(fn).__name__ != "AccumulateGrad")


__all__ = ["count_module_calls", "count_python_instructions"]
