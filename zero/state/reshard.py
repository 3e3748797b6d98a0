"""Read a sharded checkpoint under another layout ("universal" checkpoints).

Every shard file records its buckets: the parameter names, shapes, offsets in the flat buffer, how the
buffer was split over its group (ZeRO) and where each local parameter lies in the full one
(`zero.plan.Placement`: expert and tensor parallel slices). That is enough to find, for any element
of any parameter of any layout, the file and offset that hold it, for the fp32 master and for every
per-element optimizer state (Adam's moments). A rank loading under another layout (dp size, ZeRO stage,
sp, ep, tp, pp, bucket sizes) reads exactly the ranges of its own shard from whichever files hold them
(memory-mapped), builds the state dict its engine would have saved, and loads that: parameters and
optimizer state are moved, not re-initialised, and counters, scheduler and loss scale carry over.

Why not torch.distributed.checkpoint: it describes each tensor by its own sharding (DTensor/ShardedTensor
metadata), while the engine's unit of storage is a padded flat buffer of many parameters split at arbitrary
element boundaries over the ZeRO group; describing that to DCP would need a per-parameter view of every
shard and a second copy of the optimizer state in DCP's layout. Reading our own files by range costs no
conversion step and keeps one format for same-layout resume (a plain per-rank load) and resharding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zero.plan import Placement

if TYPE_CHECKING:
    from zero.state.interface import CheckpointedEngine


class ReshardError(ValueError):
    """The checkpoint cannot be read under this layout (another model, or data missing from it)."""


def _local_box(piece, start: list[int], size: list[int]) -> tuple[slice, ...]:
    """The slices of a piece's local tensor holding the global box at `start` of `size`."""
    return tuple(slice(pl + a - ps, pl + a - ps + n) for pl, a, ps, n in zip(piece.local, start, piece.start, size))


class _Set:
    """One bucket as its replica group wrote it: the shard of group rank r is in rank files[r]."""

    def __init__(self, entry: dict) -> None:
        self.names = entry["names"]
        self.shapes = [tuple(s) for s in entry["shapes"]]
        self.numels = entry["numels"]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.world, self.padded, self.trainable = entry["world"], entry["padded"], entry["trainable"]
        self.shard_size = self.padded // self.world
        self.shards: dict[int, tuple[int, int, int | None]] = {}  # group rank -> (file rank, bucket, trainable idx)


class CheckpointReader:
    """Random access to the parameters and optimizer state of a checkpoint directory written by any layout.

    `load(rank)` gives a shard file's state dict (memory-mapped, its record checked by the caller's
    `check`). Values come back as fp32 CPU tensors.
    """

    def __init__(self, path: Path, meta: dict, load: Callable[[int], dict]) -> None:
        self.path, self.meta = path, meta
        self.states = [load(r) for r in range(meta["world_size"])]
        self.holders: dict[str, list[tuple[Placement, _Set]]] = {}
        sets: dict[tuple, _Set] = {}
        for r, state in enumerate(self.states):
            layout = state["engine"]["layout"]
            trainable_index = 0
            for j, entry in enumerate(layout):
                if "placements" not in entry:  # written before placements were recorded
                    split = {k: v for k, v in (meta.get("layout") or {}).items() if k in ("tp", "ep") and v != 1}
                    if split:
                        raise ReshardError(f"checkpoint {path} was written with {split} before checkpoints recorded "
                                           "parameter placements: resume it with the layout it was written with")
                    # Data / ZeRO / sp / pp only: every parameter is whole (flat where no shape is recorded).
                    entry = {**entry, "shapes": entry.get("shapes") or [[n] for n in entry["numels"]],
                             "placements": [None] * len(entry["names"])}
                key = (tuple(entry["names"]), json.dumps(entry["placements"]), entry["world"], entry["padded"])
                new = key not in sets
                s = sets.setdefault(key, _Set(entry))
                s.shards.setdefault(entry["rank"], (r, j, trainable_index if entry["trainable"] else None))
                trainable_index += bool(entry["trainable"])
                if new:
                    for name, shape, p in zip(s.names, s.shapes, entry["placements"]):
                        placement = Placement.whole(shape) if p is None else Placement.from_json(p)
                        self.holders.setdefault(name, []).append((placement, s))
        for s in sets.values():
            if len(s.shards) != s.world:
                missing = sorted(set(range(s.world)) - set(s.shards))
                raise ReshardError(f"checkpoint {path}: no file holds shard(s) {missing} of the bucket of "
                                   f"{s.names[0]}")
        self._cache: tuple[tuple, torch.Tensor] | None = None

    # ------------------------------------------------------------------ raw reads
    def _shard(self, s: _Set, group_rank: int, key: str) -> torch.Tensor:
        r, j, t = s.shards[group_rank]
        engine = self.states[r]["engine"]
        if key == "values":
            return engine["shards"][j]
        if t is None:
            raise ReshardError(f"checkpoint {self.path}: {s.names[0]} ... was frozen when written and has no "
                               f"optimizer state {key!r}")
        return engine["optimizer"]["state"][t][key]

    def _read(self, s: _Set, name: str, key: str, a: int, e: int) -> torch.Tensor:
        """Elements [a, e) of local parameter `name` (flattened) in set `s`."""
        off = s.offsets[s.names.index(name)]
        lo, hi = off + a, off + e
        parts = []
        while lo < hi:
            g = lo // s.shard_size
            end = min(hi, (g + 1) * s.shard_size)
            parts.append(self._shard(s, g, key)[lo - g * s.shard_size: end - g * s.shard_size])
            lo = end
        out = torch.cat(parts) if len(parts) != 1 else parts[0]
        return out.to(torch.float32)

    def buffer(self, name: str) -> torch.Tensor | None:
        """Module buffer `name` as the first rank holding it wrote it (buffers are whole on every rank that holds
        them), or None where no rank's state holds it."""
        return next((s["engine"]["buffers"][name] for s in self.states if name in s["engine"]["buffers"]), None)

    # ------------------------------------------------------------------ parameters
    def names(self) -> list[str]:
        return list(self.holders)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._holders(name)[0][0].shape

    def _holders(self, name: str) -> list[tuple[Placement, _Set]]:
        if name not in self.holders:
            raise ReshardError(f"checkpoint {self.path} has no parameter {name!r}: it was written for another "
                               "model")
        return self.holders[name]

    def full(self, name: str, key: str = "values") -> torch.Tensor:
        """The whole (unsplit) parameter `name`, or its optimizer state `key`, assembled from its pieces."""
        return self._assemble(name, Placement.whole(self.shape(name)), key)

    def _assemble(self, name: str, placement: Placement, key: str) -> torch.Tensor:
        """The local tensor `placement` cuts out of parameter `name`, read from the pieces of the holders
        that overlap it (one holder's local tensor in memory at a time, never the whole parameter)."""
        out = torch.zeros(placement.local_shape, dtype=torch.float32)
        covered = torch.zeros(placement.local_shape, dtype=torch.bool)
        for held, s in self._holders(name):
            overlaps = []
            for p in held.pieces:
                for q in placement.pieces:
                    lo = [max(a, b) for a, b in zip(p.start, q.start)]
                    hi = [min(a + n, b + m) for a, n, b, m in zip(p.start, p.size, q.start, q.size)]
                    if all(a < b for a, b in zip(lo, hi)):
                        size = [b - a for a, b in zip(lo, hi)]
                        mine = _local_box(q, lo, size)
                        if not bool(covered[mine].all()):  # (a replica of what is read already is skipped)
                            overlaps.append((mine, _local_box(p, lo, size)))
            if not overlaps:
                continue
            i = s.names.index(name)
            local = self._read(s, name, key, 0, s.numels[i]).view(s.shapes[i])
            for mine, theirs in overlaps:
                out[mine] = local[theirs]
                covered[mine] = True
        if not bool(covered.all()):
            raise ReshardError(f"checkpoint {self.path}: its shards do not cover all of {name} {placement.shape}")
        return out

    def local(self, name: str, placement: Placement, a: int, e: int, key: str = "values") -> torch.Tensor:
        """Elements [a, e) of the flattened local tensor that `placement` cuts out of parameter `name`."""
        holders = self._holders(name)
        shape = holders[0][0].shape
        if shape != placement.shape:
            flat = len(shape) == 1 and placement.is_whole and math.prod(placement.shape) == shape[0]
            if not flat:  # (a flat, whole parameter of an older checkpoint is read as it is)
                raise ReshardError(f"checkpoint {self.path} holds {name} of shape {shape} but this model's is "
                                   f"{placement.shape}: it was written for another model")
            placement = Placement.whole(shape)
        for p, s in holders:
            if p == placement:  # the same local tensor was written: read just the range
                return self._read(s, name, key, a, e)
        cached = self._cache
        if cached is None or cached[0] != (name, key, placement):
            cached = self._cache = ((name, key, placement), self._assemble(name, placement, key).reshape(-1))
        return cached[1][a:e]

    def optimizer_keys(self) -> tuple[list[str], dict]:
        """(per-element state keys, scalar entries) of the optimizer state, or ([], {}) before any step."""
        for state in self.states:
            entries = state["engine"]["optimizer"]["state"]
            if entries:
                first = entries[min(entries)]
                keys = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
                scalars = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.items()
                           if k not in keys}
                return keys, scalars
        return [], {}


def resharded_state(engine: CheckpointedEngine, reader: CheckpointReader) -> dict:
    """The state dict `engine` would have saved (engine.state_dict()) built from a checkpoint of any layout."""
    keys, scalars = reader.optimizer_keys()
    shards, entries = [], {}
    for b in engine.buckets:
        flats = {k: torch.zeros(b.shard_size, dtype=torch.float32) for k in ["values"] + (keys if b.trainable else [])}
        for i, lo, hi in b.shard_ranges():
            name = b.names[i]
            placement = engine.placements.get(name) or Placement.whole(b.shapes[i])
            a = b.shard_start + lo - b.offsets[i]
            for k, flat in flats.items():
                flat[lo:hi] = reader.local(name, placement, a, a + hi - lo, k)
        shards.append(flats.pop("values"))
        if b.trainable and keys:  # one entry per trainable bucket, in order (the optimizer's indices)
            entries[len(entries)] = {**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                        for k, v in scalars.items()}, **flats}
    n_trainable = sum(b.trainable for b in engine.buckets)
    groups = next((s["engine"]["optimizer"]["param_groups"] for s in reader.states
                   if s["engine"]["optimizer"]["param_groups"]), None)
    if groups is None or len(groups) != 1:
        raise ReshardError(f"checkpoint {reader.path}: expected one optimizer parameter group")
    first = reader.states[0]["engine"]
    buffers = {}
    for name, buf in engine.module.named_buffers():
        found = [s["engine"]["buffers"][name] for s in reader.states if name in s["engine"]["buffers"]]
        if not found:
            continue
        if tuple(found[0].shape) != tuple(buf.shape):
            raise ReshardError(f"checkpoint {reader.path} holds buffer {name} of shape {tuple(found[0].shape)} but "
                               f"this model's is {tuple(buf.shape)}")
        buffers[name] = found[0]
    return {
        "format": "zero-sharded-v1",
        "stage": engine.config.stage,
        "dtype": engine.config.dtype,
        "layout": engine.bucket_records(),
        "shards": shards,
        "optimizer": {"state": entries, "param_groups": [{**groups[0], "params": list(range(n_trainable))}]},
        "lr_scheduler": first["lr_scheduler"],
        "loss_scaler": first["loss_scaler"],
        "buffers": buffers,
        "counters": first["counters"],
    }


def consolidate(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a checkpoint of any layout: every parameter unsplit (fp32
    masters) and every buffer (as the first rank holding it wrote it)."""
    out = {name: reader.full(name).clone() for name in reader.names()}
    for state in reader.states:
        for name, value in state["engine"]["buffers"].items():
            out.setdefault(name, value.clone())
    return out
