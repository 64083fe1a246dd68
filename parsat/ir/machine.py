"""The machine a plan is costed for: devices, nodes, speeds, links, precision.

Bandwidths are per device and unidirectional, in bytes/s; latencies in
seconds (the alpha of the alpha-beta collective model: one step of a ring).
A preset describes one kind of node; `with_devices(n)` gives as many nodes
as `n` devices need, so `h100x8` works for any node count.

`precision` is the training precision (`ir.precision`: bf16 on the GPU
presets, with fp32 master weights and Adam state); `peak_flops` is the
dense peak at that precision and `peaks` the peaks at the others, so
`with_precision` switches (`--precision bf16|fp32`). `efficiency` and
`comm` (`ir.machine_profile`) hold what `parsat calibrate` measures beyond
the peaks: per-operator overheads, GEMM and bandwidth efficiency, measured
collectives. Machine files: version 2 (docs/COSTMODEL.md); version 1 files
(no precision, `dtype_bytes` instead) still load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from parsat.dsl.files import write_atomic
from parsat.ir.errors import MachineError
from parsat.ir.json_files import read_json_file
from parsat.ir.machine_profile import CommProfile, OpEfficiency, Oversubscribed
from parsat.ir.precision import BYTES_TO_PRECISION, PRECISIONS, Precision, precision
from parsat.ir.validate import MACHINE_SCHEMA, MACHINE_VERSION, machine_field, validate_machine_dict


@dataclass(frozen=True)
class Machine:
    name: str
    devices_per_node: int
    nodes: int
    peak_flops: float          # FLOP/s per device (dense, training precision)
    memory_bandwidth: float    # bytes/s per device
    memory_capacity: float     # bytes per device
    intra_bandwidth: float     # bytes/s per device inside a node (NVLink)
    intra_latency: float       # s per collective step inside a node
    inter_bandwidth: float     # bytes/s per device between nodes (InfiniBand)
    inter_latency: float       # s per collective step between nodes
    precision: str = "fp32"    # training precision (`ir.precision.PRECISIONS`)
    peaks: tuple[tuple[str, float], ...] = ()   # (precision, dense peak FLOP/s) for `with_precision`
    efficiency: OpEfficiency = OpEfficiency()
    comm: CommProfile = CommProfile()
    oversubscribed: Oversubscribed | None = None   # calibrated with more ranks than cores (`--oversubscribe`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peaks", tuple(sorted((str(k), float(v)) for k, v in self.peaks)))  # one order

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of activations and communication: the compute dtype's."""
        return self.precision_spec.compute_bytes

    @property
    def precision_spec(self) -> Precision:
        return precision(self.precision)

    def with_precision(self, name: str | None) -> "Machine":
        """This machine training in precision `name` (None: unchanged), at that precision's peak."""
        if name is None or name == self.precision:
            return self
        if name not in PRECISIONS:
            raise MachineError(f"unknown precision '{name}' ({', '.join(PRECISIONS)})")
        peaks = dict(self.peaks)
        if name not in peaks:
            known = sorted(set(peaks) | {self.precision})
            raise MachineError(f"machine '{self.name}' has no peak for {name} (it knows {', '.join(known)})")
        return replace(self, precision=name, peak_flops=peaks[name])

    @property
    def runtime_regathers(self) -> bool:
        """Whether plans for this machine are priced as a runtime that gathers a kept activation again in backward
        (`cost.saved.runtime_regathers`, which the cost model reads; here so that the torch runtime, which may not
        import the cost model, runs what the plan was priced as: `sequence_products`' re-gathering products)."""
        return self.efficiency.async_dispatch

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    def with_devices(self, devices: int) -> "Machine":
        """This kind of node, with enough nodes for `devices` devices."""
        if devices < 1:
            raise MachineError(f"the device count must be at least 1, got {devices}")
        if devices > self.devices_per_node and devices % self.devices_per_node:
            raise MachineError(f"{devices} devices do not fill whole nodes of {self.devices_per_node} "
                               f"({self.name}); use a multiple of {self.devices_per_node}")
        return replace(self, nodes=max(1, math.ceil(devices / self.devices_per_node)))

    def link(self, group: int) -> tuple[float, float]:
        """(bandwidth, latency) of a collective among `group` consecutive devices."""
        if group <= self.devices_per_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    @staticmethod
    def preset(name: str, nodes: int = 1) -> "Machine":
        if name not in PRESETS:
            raise MachineError(f"unknown machine preset '{name}' (presets: {', '.join(PRESETS)})")
        return replace(PRESETS[name], nodes=nodes)

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        flat = {k: getattr(self, k) for k in _FLAT_FIELDS}
        return {"schema": MACHINE_SCHEMA, "version": MACHINE_VERSION, **flat, "precision": self.precision,
                "dtype_bytes": self.dtype_bytes, "peaks": dict(self.peaks), "efficiency": self.efficiency.to_dict(),
                "comm": self.comm.to_dict(),
                **({"oversubscribed": self.oversubscribed.to_dict()} if self.oversubscribed else {})}

    def save(self, path: str | Path) -> None:
        """Write the machine JSON atomically (raises FileProblem), if `load` would take it (else MachineError)."""
        validate_machine_dict(self.to_dict(), {k: f.type for k, f in Machine.__dataclass_fields__.items()})
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def from_dict(data: dict) -> "Machine":
        """A machine file's object (version 2, or version 1: `dtype_bytes` and no profile)."""
        validate_machine_dict(data, {**{k: Machine.__dataclass_fields__[k].type for k in _FLAT_FIELDS},
                                     "precision": "str", "dtype_bytes": "int"})
        fields = {k: v for k, v in data.items() if k not in ("schema", "version", "dtype_bytes", "peaks", "efficiency",
                                                              "comm", "oversubscribed")}
        name = data.get("precision")
        if name is None:  # version 1: only the element size
            name = BYTES_TO_PRECISION.get(data.get("dtype_bytes", 4))
            if name is None:
                raise MachineError(f"machine: dtype_bytes must be one of {', '.join(map(str, BYTES_TO_PRECISION))}, "
                                   f"got {data.get('dtype_bytes')!r}")
        elif name not in PRECISIONS:
            raise MachineError(f"machine: unknown precision '{name}' ({', '.join(PRECISIONS)})")
        elif "dtype_bytes" in data and data["dtype_bytes"] != PRECISIONS[name].compute_bytes:
            raise MachineError(f"machine: dtype_bytes {data['dtype_bytes']} contradicts precision {name} "
                               f"({PRECISIONS[name].compute_bytes} bytes)")
        fields["precision"] = name
        peaks = data.get("peaks", {})
        if any(k not in PRECISIONS for k in peaks):   # the values: validate_machine_dict's ranges
            raise MachineError(f"machine: 'peaks' must map precisions ({', '.join(PRECISIONS)}) to FLOP/s")
        fields["peaks"] = tuple(sorted((k, float(v)) for k, v in peaks.items()))
        fields["efficiency"] = OpEfficiency.from_dict(data.get("efficiency", {}))
        fields["comm"] = CommProfile.from_dict(data.get("comm", {}))
        if "oversubscribed" in data:
            fields["oversubscribed"] = Oversubscribed.from_dict(data["oversubscribed"])
        if data.get("version", 1) not in READABLE_MACHINE_VERSIONS:
            raise MachineError(f"machine file version {data.get('version')!r} is not supported (this parsat reads "
                               f"{' and '.join(map(str, READABLE_MACHINE_VERSIONS))})")
        missing = [k for k in _FLAT_FIELDS if k not in fields]
        if missing:
            raise MachineError(f"machine: the field{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(machine_field(k) for k in missing)} "
                               f"{'are' if len(missing) > 1 else 'is'} missing")
        machine = Machine(**fields)
        for key in ("devices_per_node", "nodes", "peak_flops", "memory_bandwidth", "memory_capacity",
                    "intra_bandwidth", "inter_bandwidth"):
            if not getattr(machine, key) > 0:
                raise MachineError(f"machine '{machine.name}': {key} must be positive")
        return machine

    @staticmethod
    def load(path: str | Path) -> "Machine":
        return Machine.from_dict(read_json_file(path, MachineError, "machine"))

    @staticmethod
    def resolve(spec: "str | Machine") -> "Machine":
        """A preset name, a JSON file, or a Machine."""
        if isinstance(spec, Machine):
            return spec
        if spec in PRESETS:
            return Machine.preset(spec)
        if Path(spec).suffix == ".json" or Path(spec).exists():
            return Machine.load(spec)
        raise MachineError(f"unknown machine '{spec}': give a preset ({', '.join(PRESETS)}) or a JSON file")


READABLE_MACHINE_VERSIONS = (1, 2)   # 1: dtype_bytes, no precision, peaks, efficiency or comm
_FLAT_FIELDS = ("name", "devices_per_node", "nodes", "peak_flops", "memory_bandwidth", "memory_capacity",
                "intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency")

GB = 1e9
# GPU presets train in bf16 (fp32 master weights and Adam state); `--precision fp32` means TF32 tensor cores.
# Operator efficiency and collective launch costs are ASSUMED (not measured here: no GPU; `parsat calibrate`
# on the GPU replaces them, docs/COSTMODEL.md): ~5 us of eager PyTorch dispatch per operator, hidden behind
# longer kernels (asynchronous launch); half the HBM bandwidth reached around 1 MiB per copy; NCCL's tree at
# ~90% of the ring's bus bandwidth, ~5 us to launch a collective.
# GEMM efficiency (`gemm_peak_fraction`, `gemm_half_*`) is MEASURED, on the same H200: fitted by least squares in
# log rate to the 46 `gemm` rows of benchmarks/gpu/gpu_kernels.json that take at least 50 us (m 512-16384, k and
# n 1024-16384; the 10 shorter calls are launch-bound) by benchmarks/gpu_gemm_fit.py: 80.2% of peak for the
# largest, half rate at 64 rows, 320 columns and 384 of contraction; every fitted row within 0.81-1.13 of
# measured (the assumed curve before, fraction 1 and halves 128/128/64, priced them 1.1-1.9x too fast). The A100
# preset's half lengths are the H200's halved, as before (no A100 was measured); its fraction is FITTED, not
# measured: 0.760, fitted (2026-12-04, issue 31) to 6 of the 13 SC'21 rows of benchmarks/published_runs.py, chosen
# by a rule stated before fitting (every other A100 row in the table's order, from the second: sc21-3.6b, 18.4b,
# 76.1b, 310.1b, 1008b, 175b-768), by least squares in log(published / predicted step) with each row's step
# taken as a + b / fraction through its steps at 0.695 and 0.78; the other 7 rows held out
# (benchmarks/published_runs.md, "2026-12-04 (helper I)": re-fitted when the rows' attention was written out as
# 2021's Megatron-LM ran it, no longer FlashAttention's; 0.695 before, when a product's bias gradient stopped
# being priced as a third GEMM in simulated steps; 0.719 before that, 0.728 on 2026-12-03, before the `gpt`
# example computed q, k, v as one product). It stands for whatever the A100 rows' runs lost beside
# the GEMMs' size terms (2021's kernels: fp16 GEMMs of cuBLAS 11), not a
# measurement of the A100's GEMMs; the H200's 0.802 before. The H100 preset's fraction is FITTED likewise (2026-12-04,
# issue 31; the H200's measured 0.802 before): 0.701, to 4 of the 9 Megatron-Core rows of
# benchmarks/published_runs.py chosen by the same rule (every other H100 row from the second: mcore-7.1b, 32b, 119b,
# 314b), each row's step taken as a + b / fraction through its steps at 0.802 and 0.70; the other 5 held out
# (benchmarks/published_runs.md, "2026-12-04 (morning)"). The H200's curve (half lengths, the measured shape terms)
# is kept: the fit stands for what Megatron-Core's runs lost beside it (kernels, launch gaps, the input pipeline,
# logging: its throughputs are end to end), not for a measured H100 GEMM.
# Fused causal attention (`attention_efficiency`, `attention_half_flops`) is MEASURED, on an H200 (the same
# 989 TFLOP/s dense bf16 peak as the H100; benchmarks/gpu_results.md): FlashAttention through SDPA, forward +
# backward, causal FLOPs. Fitted by least squares in log rate to 15 of the 16 `attention` rows of
# benchmarks/gpu/gpu_kernels.json (b 1-4, heads 16-96, d 128, s 1024-8192; left out: b 1, heads 16, s 1024,
# whose forward + backward took 14x its forward where every other row's took 3.4-5.9x, a one-off): 52% of peak on
# long sequences, half of that at 4.4e10 forward FLOPs per call; every fitted row within 0.89-1.18 of measured.
# One rate for forward and backward, fitted to their sum (a training step runs both). The
# A100 preset assumes the same fraction and the same fixed time per call (its half length scaled by its peak).
_ATTENTION_EFFICIENCY, _ATTENTION_HALF_FLOPS = 0.52, 4.4e10
# The H200's measured curve, as measured (tests check it against the rows it was fitted to); each GPU preset
# derives its own from it (the H100 and A100 presets' fractions FITTED to published runs, above).
MEASURED_GPU_EFFICIENCY = OpEfficiency(dispatch_s=5e-6, backward_dispatch_s=5e-6, gemm_half_m=64, gemm_half_n=320,
                                       gemm_half_k=384, gemm_peak_fraction=0.802, memory_half_bytes=1 << 20,
                                       async_dispatch=True, attention_efficiency=_ATTENTION_EFFICIENCY,
                                       attention_half_flops=_ATTENTION_HALF_FLOPS)
# Data-parallel buckets as Megatron-Core sizes them (the GPU presets are priced as Megatron-Core runs a plan:
# `pcg_tasks.DDP`'s tensor-parallel overlap and parameter gathers are its): max(40M, 1M x the data-parallel size)
# elements, no smaller first bucket (`DistributedDataParallelConfig.bucket_size`'s default), not PyTorch DDP's
# 25 MiB: over 48 ranks across nodes each bucket's collective pays 47 ring steps of latency.
_GPU_COMM = CommProfile(launch_s=5e-6, tree_bandwidth_factor=0.9, bucket_elements=40_000_000,
                        bucket_elements_per_rank=1_000_000)
PRESETS: dict[str, Machine] = {
    # 8x H100 SXM per node, NVSwitch; 400 Gb/s InfiniBand per GPU (50 GB/s).
    # Peaks: dense bf16 989 TFLOP/s, TF32 989/2. In-node link: NVLink 4 is 900 GB/s bidirectional per GPU,
    # 450 GB/s each way (the line rate); with NCCL's protocol overhead (~20%) the effective NVLink bandwidth is
    # ~370 GB/s, the bus bandwidth nccl-tests shows for all-gather, reduce-scatter and ring all-reduce on 8 GPUs
    # (NCCL's maintainer, NVIDIA/nccl-tests#212). That is the bus bandwidth here: every in-node collective is
    # priced as a ring (or, for Megatron's tensor-parallel overlap, a ring exchange of point-to-point steps) on
    # it. An all-reduce on NVLink SHARP (NVLS, NCCL's default on H100) reaches ~480 GB/s bus bandwidth (algbw
    # ~275 GB/s, the same source), which is not modelled: an in-node all-reduce is priced as the ring. The figure
    # used before, ~267 GB/s "all-reduce bus bandwidth", matches NVLS's algbw, not a bus bandwidth: it priced
    # every in-node collective 1.39x slow. ~30 us for a small 8-GPU all-reduce, i.e. alpha ~2 us per ring step.
    "h100x8": Machine("h100x8", 8, 1, peak_flops=989e12, memory_bandwidth=3350 * GB,
                      memory_capacity=80 * 2 ** 30, intra_bandwidth=370 * GB, intra_latency=2e-6,
                      inter_bandwidth=50 * GB, inter_latency=5e-6, precision="bf16",
                      peaks=(("bf16", 989e12), ("fp16", 989e12), ("fp32", 989e12 / 2)),
                      efficiency=replace(MEASURED_GPU_EFFICIENCY, gemm_peak_fraction=0.701), comm=_GPU_COMM),
    # 8x A100 SXM 80 GB: dense bf16 312 TFLOP/s, TF32 156; 200 Gb/s IB. In-node link: NVLink 3 is 12 links of
    # 25 GB/s each way, ~20 GB/s effective each with NCCL's 128-byte payloads, 240 GB/s, of which NCCL reaches
    # ~230 GB/s bus bandwidth on 8 A100s (NCCL's maintainer, NVIDIA/nccl-tests#149): the H100's method and source
    # kind. 150 GB/s before 2026-12-03 (unsourced) priced every in-node collective 1.53x slow.
    "a100x8": Machine("a100x8", 8, 1, peak_flops=312e12, memory_bandwidth=2039 * GB,
                      memory_capacity=80 * 2 ** 30, intra_bandwidth=230 * GB, intra_latency=3e-6,
                      inter_bandwidth=25 * GB, inter_latency=8e-6, precision="bf16",
                      peaks=(("bf16", 312e12), ("fp16", 312e12), ("fp32", 312e12 / 2)),
                      efficiency=replace(MEASURED_GPU_EFFICIENCY, gemm_half_m=32, gemm_half_n=160, gemm_half_k=192,
                                         gemm_peak_fraction=0.760,
                                         attention_half_flops=_ATTENTION_HALF_FLOPS * 312 / 989),
                      comm=_GPU_COMM),
    # A small CPU box: 2 cores' worth of FLOPs, shared memory as the "link".
    "cpu": Machine("cpu", 4, 1, peak_flops=100e9, memory_bandwidth=20 * GB, memory_capacity=8 * 2 ** 30,
                   intra_bandwidth=5 * GB, intra_latency=20e-6, inter_bandwidth=1 * GB, inter_latency=50e-6,
                   peaks=(("fp32", 100e9), ("fp64", 50e9))),
}
