"""What a training step trains on: seeded weights, inputs and targets, cut into micro-batches; its objective.

Every value is drawn from the run's seed (`TrainConfig.seed`), the leaf's
name and the step, never from a rank's identity, so every rank and the
single-process reference of `--check` draw the same values without
communication; a rank reads its piece through the plan's parallel
operators.

A step of m micro-batches (`ir.microbatch.StepBatch`, `Graph.microbatches`)
trains on one batch: where the whole batch's graph is known, each input is
drawn at the whole batch's shape, as a plan without micro-batches draws it,
and micro-batch k reads block k along its cut (an input without a cut, the
same for every micro-batch); targets likewise. Where it is not known, each
micro-batch's inputs and targets are drawn on their own (as step
`step * m + k` of a run without micro-batches), which is a batch of m
independent micro-batches. `StepData` draws each whole value once per step.

The objective (`objective`): an output that is the graph's loss (a scalar,
`ir.microbatch.is_loss`) is minimized as it is; any other output is
trained against a seeded target with 0.5 * mean((output - target)^2). Both
are means over the micro-batch's samples, so the mean of the m micro-batch
objectives is the whole batch's objective: the step differentiates each
micro-batch's objective divided by m and accumulates the gradients
(parsat/backend/executor.py `run_rank`), which is the gradient of the whole batch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from parsat.backend.collectives import PARALLEL_TABLE
from parsat.ir.data_forms import MASK, ONEHOT, data_leaves  # noqa: F401 - data_leaves: read from here too
from parsat.ir.microbatch import StepBatch, is_loss


@dataclass(frozen=True)
class TrainConfig:
    """Training-step settings shared by the distributed run and its reference."""

    steps: int = 3
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    dtype: str = "float64"   # float64 makes --check tolerances tight
    check: bool = False
    tolerance: float = 1e-9  # largest relative difference --check accepts (`compare_values`)

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def _generator(seed: int, name: str, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + step) % 2**62)


def leaf_value(name: str, shape: Sequence[int], role: str, config: TrainConfig, step: int = 0,
               data: str = "", fan_in: int = 1) -> torch.Tensor:
    """The full value of a leaf: weights from the seed (scaled by 1/sqrt(fan_in)), data from the seed and the step.

    `data` is what the operators reading an input need (`data_leaves`): "onehot" rows of random ids,
    "mask" the causal 0/1 mask, anything else standard normal values.
    """
    gen = _generator(config.seed, name, 0 if role == "weight" else step + 1)
    dtype = config.torch_dtype()
    if data == ONEHOT:
        ids = torch.randint(0, shape[-1], tuple(shape[:-1]), generator=gen)
        return torch.nn.functional.one_hot(ids, shape[-1]).to(dtype)
    if data == MASK:
        return causal_mask(shape, dtype)
    value = torch.randn(tuple(shape), generator=gen, dtype=dtype)
    if role == "weight" and fan_in > 1:
        value = value / fan_in ** 0.5
    return value


# Where a weight is read, which of its dims are the inputs of one output: (operator, argument) -> dims.
# A weight read through `transpose` swaps them (torch's [out, in] Linear weight feeding `linear`).
# torch's `linear_t` and `linear_nobias_t` read it [out, in], as nn.Linear stores it: its fan-in is dim 1.
_FAN_IN_DIMS = {("matmul", 1): (0,), ("linear", 1): (0,), ("linear_nobias", 1): (0,), ("linear_t", 1): (1,),
                ("linear_nobias_t", 1): (1,), ("conv2d", 1): (1, 2, 3), ("bmm", 1): (-2,)}


def fan_in(nodes: Sequence[tuple[str, str, Sequence[str]]], shapes: dict, name: str) -> int:
    """The fan-in of weight `name` from the first operator that contracts it (1 if none does: norms, biases,
    embedding tables). `nodes` are (name, op, inputs) in order; `shapes` every tensor's shape.

    It is followed through parallel operators, `concat` and `split` (they keep its dims where they were, so
    the dims contracted are still its own), as a rewritten PCG reads it: `concat(wa, wb)` feeding one matmul
    (`matmul_fuse_shared_input`) gives `wa` the fan-in its own matmul gives it in the graph."""
    targets = {name: False}  # tensor -> read transposed
    for node_name, op, inputs in nodes:
        for position, ref in enumerate(inputs):
            if ref not in targets:
                continue
            if op == "transpose" and len(shapes[ref]) == 2:
                targets[node_name] = not targets[ref]
                continue
            if op in PARALLEL_OPS_NAMES or op in _KEEPS_DIMS:
                targets[node_name] = targets[ref]
                continue
            dims = _FAN_IN_DIMS.get((op, position))
            if dims is None:
                continue
            shape = shapes[name]
            if targets[ref]:
                dims = tuple(len(shape) - 1 - (d % len(shape)) for d in dims)
            fan = 1
            for d in dims:
                fan *= shape[d]
            return fan
    return 1


def target_value(name: str, shape: Sequence[int], config: TrainConfig, step: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=_generator(config.seed, "target:" + name, step + 1),  # () too
                       dtype=config.torch_dtype())


PARALLEL_OPS_NAMES = tuple(PARALLEL_TABLE)
# Operators that move a tensor's entries along one dim and keep every dim where it was (`fan_in` reads through).
_KEEPS_DIMS = ("concat", "split")


def causal_mask(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """1 where a query (second-last dim) may see a key (last dim): keys up to its own position, aligned at the
    end when there are more keys than queries (as the importer builds torch's causal mask)."""
    if len(shape) < 2:
        return torch.ones(tuple(shape), dtype=dtype)
    s, k = shape[-2], shape[-1]
    return torch.ones(s, k, dtype=dtype).tril(diagonal=max(0, k - s)).expand(tuple(shape)).contiguous()


def objective(out: torch.Tensor, target: torch.Tensor | None, numel: int) -> torch.Tensor:
    """One output's part of the objective (the module docstring), over a piece `out` of an output of `numel`
    elements: a loss output's piece as it is, any other 0.5 * sum((out - target)^2) / numel."""
    if target is None:
        return out.sum()
    return 0.5 * ((out - target) ** 2).sum() / numel


def loss_terms(pieces: Sequence[tuple[torch.Tensor, torch.Tensor | None, int, int, int]]) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    """(this rank's share of the objective to differentiate, its share of the loss to report) over its output
    pieces, each (piece, its target's piece or None, the output's elements, its replicas, the ranks holding the
    piece): each piece's `objective` over its replicas (their gradients add up) and over its holders (the
    reported sums add up). What a step runs after its forward (`RankProgram.loss`), and what `parsat calibrate`
    times as the loss (`calibrate._loss`), so the two are one code."""
    backward_terms, report_terms = [], []
    for piece, target, numel, replicas, holders in pieces:
        term = objective(piece, target, numel)
        backward_terms.append(term / replicas)
        report_terms.append(term.detach() / holders)
    return sum(backward_terms), sum(report_terms)


class StepData:
    """One step's inputs and targets, micro-batch by micro-batch (the module docstring).

    `leaves` are the input leaves as (name, micro-batch shape, data form:
    `data_leaves`), `outputs` the outputs as (name, micro-batch shape).
    """

    def __init__(self, batch: StepBatch, config: TrainConfig, step: int,
                 leaves: Sequence[tuple[str, Sequence[int], str]], outputs: Sequence[tuple[str, Sequence[int]]]):
        self.batch, self.config, self.step = batch, config, step
        self.leaves, self.outputs = list(leaves), list(outputs)
        self._whole: dict[str, torch.Tensor] = {}
        self._loaded: dict[int, tuple[dict, dict]] = {}

    @property
    def microbatches(self) -> int:
        return self.batch.microbatches

    def loaded(self) -> "StepData":
        """This data with every micro-batch's inputs and targets drawn now, as a data loader hands a step its
        batch before the step starts. A run's timed step then holds the plan's work only, which is what the
        cost model prices: drawing the data is not (on the demo's MLP it was 1.5-3 ms of a 7 ms step)."""
        self._loaded = {k: (self.inputs(k), self.targets(k)) for k in range(self.microbatches)}
        return self

    def inputs(self, k: int) -> dict[str, torch.Tensor]:
        """Micro-batch k's full input values by leaf name."""
        if k in self._loaded:
            return dict(self._loaded[k][0])
        return {name: self._value(name, shape, form, k, target=False) for name, shape, form in self.leaves}

    def targets(self, k: int) -> dict[str, torch.Tensor | None]:
        """Micro-batch k's full targets by output name (None for a loss output: it has none)."""
        if k in self._loaded:
            return dict(self._loaded[k][1])
        return {name: None if is_loss(shape) else self._value(name, shape, "", k, target=True)
                for name, shape in self.outputs}

    def whole_inputs(self) -> dict[str, torch.Tensor]:
        """The whole batch's input values (only where its graph is known)."""
        return {name: self._drawn(name, "", form, False) for name, _, form in self.leaves}

    def whole_targets(self) -> dict[str, torch.Tensor | None]:
        return {name: None if is_loss(shape) else self._drawn(name, "", "", True) for name, shape in self.outputs}

    def _value(self, name: str, shape, form: str, k: int, target: bool) -> torch.Tensor:
        m = self.batch.microbatches
        if self.batch.whole is None:   # m independent micro-batches
            index = self.step * m + k
            if target:
                return target_value(name, shape, self.config, index)
            return leaf_value(name, shape, "input", self.config, index, form)
        whole = self._drawn(name, shape, form, target)
        if m == 1:
            return whole
        # a copy: a view would keep (and be measured as) the whole batch's storage
        return whole[self.batch.block(whole.shape, name, k)].clone()

    def _drawn(self, name: str, shape, form: str, target: bool) -> torch.Tensor:
        key = ("target:" if target else "") + name
        if key not in self._whole:
            if self.batch.whole is None:
                raise ValueError("the whole batch of a step is not known: its micro-batches are drawn on their own")
            whole_shape = self.batch.whole.shape(name)
            self._whole[key] = (target_value(name, whole_shape, self.config, self.step) if target else
                                leaf_value(name, whole_shape, "input", self.config, self.step, form))
        return self._whole[key]
