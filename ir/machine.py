"""The machine a plan is costed for: devices, nodes, speeds and links.

Bandwidths are per device and unidirectional, in bytes/s; latencies in
seconds (the alpha of the alpha-beta collective model). A preset describes
one kind of node; `with_devices(n)` gives as many nodes as `n` devices need,
so `h100x8` works for any node count.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from parsat.dsl.files import write_atomic
from parsat.ir.errors import MachineError
from parsat.ir.json_files import read_json_file
from parsat.ir.validate import MACHINE_SCHEMA, MACHINE_VERSION, validate_machine_dict


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
    dtype_bytes: int = 4       # bytes per element (fp32 training)

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
        return {"schema": MACHINE_SCHEMA, "version": MACHINE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        """Write the machine JSON atomically (raises FileProblem), if `load` would take it (else MachineError)."""
        validate_machine_dict(self.to_dict(), {k: f.type for k, f in Machine.__dataclass_fields__.items()})
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def from_dict(data: dict) -> "Machine":
        validate_machine_dict(data, {k: f.type for k, f in Machine.__dataclass_fields__.items()})
        fields = {k: v for k, v in data.items() if k not in ("schema", "version")}
        try:
            machine = Machine(**fields)
        except TypeError as err:
            raise MachineError(f"bad machine description: {err}") from None
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


GB = 1e9
PRESETS: dict[str, Machine] = {
    # 8x H100 SXM per node, NVSwitch; 400 Gb/s InfiniBand per GPU (50 GB/s).
    # Peak: dense TF32 (fp32 training), 989/2 TFLOP/s. Links: all-reduce bus
    # bandwidth ~267 GB/s on NVSwitch and ~30 us for an 8-GPU all-reduce
    # (published measurements on 8x H100 with NVSwitch), i.e. alpha ~2 us per ring step (2(p-1) steps).
    "h100x8": Machine("h100x8", 8, 1, peak_flops=989e12 / 2, memory_bandwidth=3350 * GB,
                      memory_capacity=80 * 2 ** 30, intra_bandwidth=267 * GB, intra_latency=2e-6,
                      inter_bandwidth=50 * GB, inter_latency=5e-6),
    "a100x8": Machine("a100x8", 8, 1, peak_flops=312e12 / 2, memory_bandwidth=2039 * GB,
                      memory_capacity=80 * 2 ** 30, intra_bandwidth=150 * GB, intra_latency=3e-6,
                      inter_bandwidth=25 * GB, inter_latency=8e-6),
    # A small CPU box: 2 cores' worth of FLOPs, shared memory as the "link".
    "cpu": Machine("cpu", 4, 1, peak_flops=100e9, memory_bandwidth=20 * GB, memory_capacity=8 * 2 ** 30,
                   intra_bandwidth=5 * GB, intra_latency=20e-6, inter_bandwidth=1 * GB, inter_latency=50e-6),
}
