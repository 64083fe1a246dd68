"""What a user's module issues when it runs eagerly, beyond the graph parsat imported from it.

The torch-native runtime runs the user's own module (docs/TORCH_NATIVE.md), not the imported graph: its
forward also makes the views, reshapes, dtype casts and mask-building calls the importer folds away, and its
backward runs an autograd node for each differentiable one of them. On a CPU each is a dispatch's host time
(`OpEfficiency.dispatch_s`, `backward_dispatch_s`): on the small BERT of
benchmarks/costmodel_fidelity_torch.py 42 forward calls and 34 autograd nodes beyond its 63 graph nodes, about
1.7 ms at the ~20 us a dispatch a quiet 2-core box calibrates, against a measured 19 ms step (data parallel, 2
ranks: benchmarks/costmodel_fidelity.md run T4). The step simulator prices them under a profile that runs the module
(`cost.pcg_tasks.ExecutionProfile.module_calls`); `importer.call_count` counts them.

Under a tensor axis the runtime's modules that hold parameters compute on DTensors (torch's styles and
`distribute_module`), so every ATen call they make, forward and in their backward, pays DTensor's dispatch
(`OpEfficiency.dtensor_time`, which `parsat calibrate --dtensor` measures per operator): on the small LLaMA of
that benchmark 91 forward and about 220 backward calls a step, where one per graph node reading a weight (21
and 21) was priced before (benchmarks/costmodel_fidelity.md, 2026-12-04 helper T). `dtensor_forward` and
`dtensor_backward` count them.

Between its ATen calls the module also runs its own Python (a Hugging Face model's masks, config branches,
`nn.Module.__call__` of every submodule), which no per-call figure holds: on those three models 12-17 thousand
bytecode instructions a forward, 0.3 ms of a 2.3-2.7 ms forward on one thread (the eager forward against a replay of
its ATen calls; benchmarks/costmodel_fidelity.md, 2026-12-05 helper M). `python_forward` counts them, and
`OpEfficiency.python_instruction_s` prices them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleCalls:
    """One eager forward of the module on the import's example inputs, counted, beside its imported graph."""

    forward_calls: int    # ATen calls the forward dispatched (below autograd: views and casts included)
    backward_nodes: int   # autograd nodes its outputs' backward runs (AccumulateGrad, one per parameter, aside)
    graph_nodes: int      # compute nodes of the graph imported from the module
    dtensor_forward: int = 0    # of the forward calls, those made inside a module that holds parameters itself
    dtensor_backward: int = 0   # ATen calls the backward of those modules' autograd nodes makes
    python_forward: int = 0     # Python bytecode instructions the forward executes (the module's own code)

    def __post_init__(self) -> None:
        if min(self.forward_calls, self.backward_nodes, self.graph_nodes, self.dtensor_forward,
               self.dtensor_backward, self.python_forward) < 0:
            raise ValueError(f"call counts cannot be negative: {self}")

    def _share(self, compute_nodes: int) -> float:
        """The part of the module a PCG holding `compute_nodes` of the graph's compute nodes runs: 1 for the
        whole graph, in proportion for a pipeline stage's part."""
        return compute_nodes / self.graph_nodes if self.graph_nodes else 0.0

    def extra_forward(self, compute_nodes: int) -> float:
        """Forward calls beyond the graph's own compute nodes (each of which the simulator prices as a call)."""
        return max(0.0, self.forward_calls * self._share(compute_nodes) - compute_nodes)

    def extra_backward(self, compute_nodes: int, gradient_nodes: int) -> float:
        """Autograd nodes beyond the `gradient_nodes` of the PCG's compute nodes a gradient flows through (each
        of which the simulator prices as a backward node)."""
        return max(0.0, self.backward_nodes * self._share(compute_nodes) - gradient_nodes)

    def python_instructions(self, compute_nodes: int) -> float:
        """The Python bytecode instructions a PCG holding `compute_nodes` of the graph's compute nodes runs in
        the module's forward (its share, as for the calls)."""
        return self.python_forward * self._share(compute_nodes)

    def dtensor_calls(self, compute_nodes: int, backward: bool) -> float:
        """The calls a PCG holding `compute_nodes` of the graph's compute nodes runs on DTensors under a tensor
        axis: the forward's calls inside modules holding parameters, or (`backward`) their backward's."""
        return (self.dtensor_backward if backward else self.dtensor_forward) * self._share(compute_nodes)


__all__ = ["ModuleCalls"]
