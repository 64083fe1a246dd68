"""Training precisions and the bytes a parameter costs under each, with ZeRO sharding.

Mixed precision as people train today (docs/COSTMODEL.md, "Bytes per
parameter"): the forward and backward passes compute in the compute dtype
(bf16 or fp16: activations, the working copy of the weights, their
gradients, and every collective of the step), while the optimizer keeps an
fp32 master copy of each weight and its Adam moments in fp32, because
bf16's 8-bit mantissa cannot accumulate small updates. fp32 ("TF32" on
tensor cores) and fp64 keep one copy of everything in one dtype.

Per parameter, Adam, mixed bf16: 2 (bf16 weight) + 2 (bf16 gradient) +
4 (fp32 master) + 4 + 4 (fp32 moments) = 16 bytes: the accounting of the
ZeRO paper (Rajbhandari et al., SC'20: 2 + 2 + K with K = 12). Megatron-LM
keeps the gradient in fp32 too (its `main_grad` accumulation buffer, for
exact gradient accumulation across micro-batches): 18 bytes; that is
`gradient_bytes=4` here (`Precision.with_fp32_gradients`). fp32 Adam:
4 + 4 + 4 + 4 = 16 bytes, no master copy.

ZeRO divides parts of this by the data-parallel degree d: stage 1 the
optimizer state (master copy and moments), stage 2 the gradients too,
stage 3 the weights too (FSDP's full sharding). `ParameterBytes.sharded`
gives the bytes one device holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

OPTIMIZER_MOMENTS = {"adam": 2, "sgd": 0, "momentum": 1}
"""Optimizer state tensors per parameter, each in the master dtype (Adam: first and second moment)."""


class PrecisionError(ValueError):
    """An unknown precision, optimizer or ZeRO stage."""


@dataclass(frozen=True)
class Precision:
    """One training precision: element sizes of what a step holds and moves."""

    name: str
    compute_bytes: int      # activations, working weights, collectives
    gradient_bytes: int     # a weight's gradient as backward produces and synchronises it
    master_bytes: int       # the optimizer's copy of a weight (0: the working copy is the master)
    state_bytes: int        # one optimizer state tensor (an Adam moment), per element
    note: str = ""

    def with_fp32_gradients(self) -> "Precision":
        """Megatron-LM's accounting: gradients accumulated in fp32 (18 bytes per parameter with Adam)."""
        return replace(self, name=self.name + "+fp32grad", gradient_bytes=4)

    def parameter_bytes(self, optimizer: str = "adam") -> "ParameterBytes":
        """What one parameter costs under this precision and optimizer, unsharded."""
        if optimizer not in OPTIMIZER_MOMENTS:
            raise PrecisionError(f"unknown optimizer '{optimizer}' ({', '.join(OPTIMIZER_MOMENTS)})")
        return ParameterBytes(self.compute_bytes, self.gradient_bytes, self.master_bytes,
                              OPTIMIZER_MOMENTS[optimizer] * self.state_bytes)

    def optimizer_traffic_bytes(self, optimizer: str = "adam") -> int:
        """Bytes the optimizer update reads and writes per parameter (it is memory-bound).

        Reads the gradient, the master weight and each state tensor; writes
        the master weight and each state tensor, and the working copy when it
        is a separate (lower-precision) tensor. Adam: 28 bytes in fp32
        (4 reads + 3 writes of 4 bytes) and in bf16 (2 + 4 + 8 read, 4 + 8 + 2 written).
        """
        p = self.parameter_bytes(optimizer)
        master = self.master_bytes or self.compute_bytes
        written_copy = self.compute_bytes if self.master_bytes else 0
        return self.gradient_bytes + master + p.optimizer + master + p.optimizer + written_copy


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", 2, 2, 4, 4, "bf16 compute and communication, fp32 master weights and Adam state"),
    "fp16": Precision("fp16", 2, 2, 4, 4, "as bf16, with loss scaling (no extra bytes per parameter)"),
    "fp32": Precision("fp32", 4, 4, 0, 4, "fp32 everywhere (TF32 tensor cores on GPUs)"),
    "fp64": Precision("fp64", 8, 8, 0, 8, "fp64 everywhere (what `parsat run` uses by default, for --check)"),
}
BYTES_TO_PRECISION = {8: "fp64", 4: "fp32", 2: "bf16"}
"""A machine file of version 1 gave only `dtype_bytes`: the precision it meant."""


def precision(name: str) -> Precision:
    found = PRECISIONS.get(name)
    if found is None:
        raise PrecisionError(f"unknown precision '{name}' ({', '.join(PRECISIONS)})")
    return found


@dataclass(frozen=True)
class ParameterBytes:
    """Bytes per parameter by what holds them: the working weight, its gradient, the master copy, optimizer state."""

    weight: int
    gradient: int
    master: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weight + self.gradient + self.master + self.optimizer

    def sharded(self, zero_stage: int = 0, degree: int = 1) -> float:
        """Bytes per parameter on one device when ZeRO stage `zero_stage` shards over `degree` data-parallel ranks.

        Stage 1 divides the optimizer state (master copy and moments), stage
        2 the gradients too, stage 3 the weights too. Stage 0 is plain data
        parallelism: every rank holds everything.
        """
        if zero_stage not in (0, 1, 2, 3):
            raise PrecisionError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage}")
        if degree < 1:
            raise PrecisionError(f"the data-parallel degree must be at least 1, got {degree}")
        state = (self.master + self.optimizer) / (degree if zero_stage >= 1 else 1)
        grad = self.gradient / (degree if zero_stage >= 2 else 1)
        weight = self.weight / (degree if zero_stage >= 3 else 1)
        return weight + grad + state


def bytes_per_parameter(name: str, optimizer: str = "adam", zero_stage: int = 0, degree: int = 1) -> float:
    """Bytes one device holds per parameter of the model (e.g. bf16 Adam: 16; ZeRO-3 over 8: 2)."""
    return precision(name).parameter_bytes(optimizer).sharded(zero_stage, degree)


__all__ = ["BYTES_TO_PRECISION", "OPTIMIZER_MOMENTS", "PRECISIONS", "ParameterBytes", "Precision", "PrecisionError",
           "bytes_per_parameter", "precision"]
