"""Calls in a traced stage module's fx graphs pointed at other functions (the one walk `sequence_products` and
`loss_parallel` share). A traced stage (`torch.distributed.pipelining.pipeline()`) is an fx GraphModule whose
submodules (`InterpreterModule`s) run their own graphs; a node's target changed there is what runs."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def retarget(module: nn.Module, choose: Callable[[str, torch.fx.Node], Callable | None]) -> int:
    """Each `call_function` node of the graphs of `module` and its submodules for which `choose(the submodule's
    name, node)` gives a function made a call of that function (same arguments); the count made."""
    made = 0
    for prefix, sub in module.named_modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for node in graph.nodes:
            target = choose(prefix, node) if node.op == "call_function" else None
            if target is not None:
                node.target = target
                changed = True
                made += 1
        if changed and hasattr(sub, "recompile"):   # an fx GraphModule; an InterpreterModule runs its graph as it is
            sub.recompile()
    return made


# checks torch.export records in a traced graph that return nothing (HF LLaMA's RMSNorm `.to(torch.float32)`
# traces as `_assert_tensor_metadata` of its input's dtype): DTensor has no sharding strategy for them, so a
# stage running on DTensors fails there; the traced values already carry what they check
TRACED_ASSERTIONS = ("_assert_tensor_metadata",)


def drop_assertions(module: nn.Module) -> int:
    """The unused `TRACED_ASSERTIONS` calls erased from the graphs of `module` and its submodules; the count."""
    dropped = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        found = [node for node in graph.nodes if node.op == "call_function" and not node.users
                 and getattr(getattr(node.target, "_overloadpacket", None), "__name__", "") in TRACED_ASSERTIONS]
        for node in found:
            graph.erase_node(node)
        if found and hasattr(sub, "recompile"):
            sub.recompile()
        dropped += len(found)
    return dropped
