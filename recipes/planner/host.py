"""Host memory of one rank, phase by phase: the build (the model on the meta device, the engine's buffers filled
with their values bucket by bucket), the load (`train.init_from` streamed into the engine: each rank reads only
what it keeps) and the first step.

Each phase is what persists then (the engine's state as far as it exists) plus that phase's largest transient:
- build: the parameters (this rank's shards at stage 3, every element of a resident bucket), stages 0-1's flat
  gradients and the fp32 masters (bf16 / fp16, or offload); no optimizer state yet (AdamW makes its moments at
  the first step); while a bucket is filled, a stage-3 bucket's full buffer and the copy of its shard, and the
  fp32 values of the parameter being initialised where they cannot be written in place (a split parameter's
  whole tensor, drawn then cut; a bf16 / fp16 buffer's fp32 values); then the fp32 copy a master is made from;
- load: the build's state and the largest piece in flight (read with pread into a tensor of the file's dtype,
  its conversion to fp32 where that differs, and the fp32 box it is copied into) with, for a partitioned
  (stage-3) bucket, the fp32 shard it is read into (a resident bucket is read parameter by parameter straight
  into its buffer and master);
- step: the step's own peak (`memory_phases`: state, optimizer state, activations, logits, gradients).

Where the cluster's device memory is the host's (`Cluster.unified_memory`: the cpu preset, one process per
rank on one machine) every category counts; elsewhere only what lives on the host: offloaded parameters,
masters, optimizer state and gradient copies, nvme offload's chunk buffers and a stage-3 gather's nvme read buffer
(one at a time: the shard is copied to the device), the load's read buffers and mapped pages, the fp32 values drawn
on the CPU for a parameter being initialised. `Cluster.host_overhead_mb` is added
to every phase (memory beyond tensors the build leaves: module objects, the allocator's heaps), and the step's
`runtime_memory_mb` where unified (it is counted with the device's figures).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from omegaconf import DictConfig

from recipes.planner.build import Layout, RankModel
from recipes.planner.cluster import Cluster

SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                        "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_itemsize(directory: str | None) -> int:
    """Bytes per element of a safetensors model directory's tensors (the most bytes' dtype, from the files'
    headers: nothing else is read); 4 (fp32) where the directory cannot be read (planned before it exists)."""
    if not directory:
        return 4
    files = sorted(Path(directory).glob("*.safetensors")) if Path(directory).is_dir() else []
    by_size: dict[int, int] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            continue
        for name, t in header.items():
            if name != "__metadata__" and t.get("dtype") in SAFETENSORS_ITEMSIZE:
                size = SAFETENSORS_ITEMSIZE[t["dtype"]]
                start, stop = t["data_offsets"]
                by_size[size] = by_size.get(size, 0) + stop - start
    return max(by_size, key=by_size.get) if by_size else 4


def _split(rm: RankModel, name: str) -> tuple[int, bool] | None:
    """(whole parameter's elements, is an MoE parameter) of a parameter split across ranks (tp / ep), else None."""
    placement = rm.plan.placements.get(name)
    if placement is None or placement.is_whole:
        return None
    whole = 1
    for n in placement.shape:
        whole *= n
    return whole, name in getattr(rm.model, "_moe_params", {})


def _init_temporary(rm: RankModel, name: str, numel: int, isz: int) -> int:
    """Bytes of fp32 values drawn on the CPU to initialise parameter `name` (`numel` elements on this rank):
    a split parameter's whole tensor (an MoE parameter's local rows: the replay draws only those), beside the
    local fp32 values where the buffer is not fp32; none where the values are drawn in place."""
    split = _split(rm, name)
    local = numel * 4 if isz != 4 else 0
    if split is None:
        return local
    whole, moe = split
    return (numel if moe else whole) * 4 + local


def _add(where: dict, key: str, n: int) -> None:
    if n:
        where[key] = where.get(key, 0) + n


def built_state(layout: Layout, cfg: DictConfig, isz: int) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of what the engine holds once built: parameters, stages 0-1's flat gradients, the
    masters and cpu offload's host gradients, nvme offload's window (no optimizer state yet)."""
    z = cfg.zero
    dev: dict[str, int] = {}
    host: dict[str, int] = {}
    for b in layout.buckets:
        if b.resident:
            _add(dev, "parameters", b.padded * isz)
        elif z.offload_params == "cpu":
            _add(host, "parameters", b.shard * isz)
        elif z.offload_params != "nvme":
            _add(dev, "parameters", b.shard * isz)
        if not b.trainable:
            continue
        if z.stage <= 1:
            _add(dev, "gradients", b.padded * isz)
        if z.offload_optimizer == "cpu":
            _add(host, "master_weights", b.shard * 4)
            _add(host, "gradients", b.shard * 4 * (2 if z.get("offload_delayed_update", False) else 1))
        elif z.offload_optimizer == "none" and (isz != 4 or z.offload_params == "nvme"):
            _add(dev, "master_weights", b.shard * 4)
    shards = [b.shard for b in layout.buckets if b.trainable]
    if z.offload_optimizer == "nvme" and shards:
        _add(host, "offload_window", min(z.offload_chunk_size, max(shards)) * 4)
    return dev, host


def build_phase(layout: Layout, cfg: DictConfig, rm: RankModel, isz: int,
                unified: bool = True) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes at the build's peak: the largest of its three moments, in the engine's order:
    a bucket being filled (the parameters, no master or gradient yet), a master being copied (the parameters
    and the masters, no flat gradient yet), and all of it built (see the module's docstring); the largest in
    host memory (`unified`: device and host together)."""
    z = cfg.zero
    dev, host = built_state(layout, cfg, isz)
    filling = drawn = copy = 0
    for b in layout.buckets:
        if not b.resident:  # the full buffer while it is filled, and the copy of its shard that stays
            filling = max(filling, b.padded * isz + b.shard * isz)
        drawn = max([drawn] + [_init_temporary(rm, n, k, isz) for n, k in zip(b.names, b.numels)])
        if b.trainable and z.offload_optimizer == "none" and isz != 4:
            copy = max(copy, b.shard * 4)  # (.float() of the shard, then its clone: the master)
    params = {"parameters": dev.get("parameters", 0)}
    moments = [
        ({**params, "bucket_filling": filling}, {"parameters": host.get("parameters", 0), "initial_values": drawn}),
        ({**params, "master_weights": dev.get("master_weights", 0), "master_copy": copy}, dict(host)),
        (dev, host),
    ]
    dev, host = max(moments, key=lambda m: sum(m[1].values()) + (sum(m[0].values()) if unified else 0))
    return ({k: v for k, v in dev.items() if v}, {k: v for k, v in host.items() if v})


def load_phase(layout: Layout, cfg: DictConfig, isz: int, file_isz: int) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes at the load's peak: the built state and the largest read in flight."""
    dev, host = built_state(layout, cfg, isz)
    buffer = 0
    for b in layout.buckets:
        # a resident bucket is read parameter by parameter straight into its buffer and master; a partitioned
        # one into an fp32 shard first
        piece = max(k if b.resident else min(k, b.shard) for k in b.numels)
        buffer = max(buffer, (0 if b.resident else b.shard * 4) + piece * (4 + file_isz + (4 if file_isz != 4 else 0)))
    host["read_buffers"] = buffer
    return dev, host


def host_phases(layout: Layout, cfg: DictConfig, rm: RankModel, isz: int, step: tuple[dict[str, int], dict[str, int]],
                cluster: Cluster) -> dict[str, dict[str, int]]:
    """Host bytes by category of each phase: "build", "load" (with train.init_from) and "step" (the step's
    (device, host) figures at its largest moment)."""
    phases = {"build": build_phase(layout, cfg, rm, isz, cluster.unified_memory)}
    if cfg.train.get("init_from"):
        phases["load"] = load_phase(layout, cfg, isz, checkpoint_itemsize(cfg.train.init_from))
    phases["step"] = step
    out = {}
    overhead = int(cluster.host_overhead_mb * 2**20)
    for name, (dev, host) in phases.items():
        counted = dict(host)
        if cluster.unified_memory:
            for k, v in dev.items():
                counted[k] = counted.get(k, 0) + v
        if overhead:
            counted["runtime_overhead"] = overhead
        out[name] = {k: v for k, v in counted.items() if v}
    return out


def host_fit(ests: list, cluster: Cluster) -> str | None:
    """Why the layout does not fit the cluster's host memory (one line), or None: per node, the sum of its
    ranks' host peaks (build, load, step; each rank's largest, an upper bound of their sum at any moment) and
    each rank process's own `host_process_mb`, against `host_memory_gb`."""
    per_node = max(1, cluster.devices_per_node)
    process = int(cluster.host_process_mb * 2**20)
    worst = None
    for start in range(0, len(ests), per_node):
        node = ests[start:start + per_node]
        need = sum(e.host_peak_bytes + process for e in node)
        if worst is None or need > worst[0]:
            worst = (need, start // per_node, node)
    if worst is None or worst[0] <= cluster.host_memory_gb * 1e9:
        return None
    need, index, node = worst
    top = max(node, key=lambda e: e.host_peak_bytes)
    return (f"node {index} needs {need / 1e9:.2f} GB of host memory, more than cluster.host_memory_gb="
            f"{cluster.host_memory_gb:g} ({len(node)} ranks; rank {top.rank} {top.host_peak_bytes / 1e9:.2f} GB at its "
            f"{top.host_peak_phase} + {cluster.host_process_mb:g} MB per process): offload less to the host, "
            f"shard more (zero.stage=3, more ranks) or raise cluster.host_memory_gb")
