"""A cluster as the planner sees it: devices per node, memories, link bandwidths and latencies, FLOP rates.

Presets live in recipes/conf/cluster/<name>.yaml (`cluster=h100` on the planner's command line); any key
can be overridden (`cluster.inter_gbps=25`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

PRESET_DIR = Path(__file__).resolve().parent.parent / "conf" / "cluster"
GB = 1e9


@dataclass
class Cluster:
    """One kind of device, `devices_per_node` of them per node; bandwidths in GB/s per direction."""

    name: str = "cpu"
    devices_per_node: int = 4
    device_memory_gb: float = 16
    host_memory_gb: float = 16
    nvme_gbps: float = 1.0
    intra_gbps: float = 2.0
    intra_latency_us: float = 60
    inter_gbps: float = 2.0
    inter_latency_us: float = 60
    flops: dict[str, float] = field(default_factory=lambda: {"fp32": 2e10, "bf16": 1e10, "fp16": 1e10})
    mfu: float = 1.0  # fraction of `flops` that training GEMMs reach
    host_gbps: float = 5.0
    memory_gbps: float = 5.0  # device memory bandwidth (the optimizer step is bound by it)
    compute_units: int | None = None  # what a node's ranks share (a CPU's cores); None: one per device
    layer_overhead_us: float = 0.0  # host time per layer pass (forward, backward, recompute): launches, Python
    unit_overhead_us: float = 0.0  # host time per ZeRO-3 unit gather or free (hooks, copies)
    moe_overhead_us: float = 0.0  # host time per MoE layer pass beyond a dense layer's (routing, permutation, dispatch)
    # the rate at which the non-GEMM operations (norms, SiLU, softmax, copies) get through the activation bytes a
    # step produces (the planner's `activation_bytes`); 0: not counted (fitted for the cpu preset only)
    elementwise_gbps: float = 0.0
    # memory a rank's runtime holds beyond its tensors from its first step on (the allocator's heaps of small
    # blocks, libraries' buffers, the autograd graph's objects), counted in every moment of the step
    runtime_memory_mb: float = 0.0
    # memory the CPU math library keeps per cached GEMM shape: torch's CPU bf16 / fp16 matmul compiles a oneDNN
    # primitive per shape, held by oneDNN's cache and by ideep's in front of it (bounded by
    # moe.experts.bound_onednn_caches); 0: no such caches (GPU presets; fp32 CPU GEMMs keep none)
    gemm_cache_entry_kb: float = 0.0
    # whether the collectives' backend copies whole buffers: gloo's reduce-scatter and all-gather into a flat
    # tensor allocate a temporary of the whole input / output (NCCL works in place)
    collective_copies: bool = False
    # whether a rank's device memory is the host's (this CPU machine): its host figures then count everything
    unified_memory: bool = False
    # host memory a rank holds beyond its tensors from its build on (module objects, the allocator's heaps), in
    # each phase of the host figures (recipes.planner.host)
    host_overhead_mb: float = 0.0
    # what a rank's process holds before it builds anything (the interpreter, torch and its libraries, the CUDA
    # context, the corpus): not in the host figures, but in what a node's host memory must hold
    host_process_mb: float = 0.0

    def link(self, ranks: int) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of a group of `ranks` consecutive ranks: inside a node or across."""
        if ranks <= self.devices_per_node:
            return self.intra_latency_us * 1e-6, self.intra_gbps * GB
        return self.inter_latency_us * 1e-6, self.inter_gbps * GB

    def share(self, world: int = 1) -> float:
        """The fraction of a compute unit one rank gets when `world` ranks run (a node's ranks share its units)."""
        per_node = min(world, self.devices_per_node)
        return 1.0 if self.compute_units is None else min(1.0, self.compute_units / per_node)

    def spare_unit(self, world: int = 1) -> bool:
        """Whether a node's ranks leave a compute unit free (for collectives overlapping compute) when `world` run."""
        return self.compute_units is None or min(world, self.devices_per_node) < self.compute_units

    def flop_rate(self, dtype: str, world: int = 1) -> float:
        """FLOP/s one rank reaches when `world` ranks run (those of a node share its compute units)."""
        return float(self.flops[dtype]) * self.mfu * self.share(world)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_cluster(name: str = "cpu", overrides: dict | None = None) -> Cluster:
    """The preset `name` with `overrides` (key -> value) applied; ValueError naming a bad key or preset."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"cluster={name} is not a preset; choose one of {', '.join(presets())}")
    values = yaml.safe_load(path.read_text()) or {}
    values.update(overrides or {})
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"cluster.{unknown[0]} is not a cluster key; known: {', '.join(sorted(known))}")
    # (yaml reads 6.7e13, without a dot, as text)
    values["flops"] = {k: float(v) for k, v in values.get("flops", Cluster().flops).items()}
    return Cluster(**values)
