"""Sharded, atomic, verified checkpoints: each rank writes its own shard file into a directory.

Ranks write into `<path>.tmp`; only when every rank succeeded is the directory renamed over `<path>`,
so a failed or interrupted save leaves the previous checkpoint untouched. `meta.json`, written last,
lists every shard with its size and SHA-256, and each shard records its rank and step. Loading (and
`verify_checkpoint`) checks all of it on every rank and agrees across ranks before any collective that
depends on the shards, so a truncated, corrupted or foreign shard stops every rank with the same
one-line error naming the file, never a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zero import comm

if TYPE_CHECKING:
    from zero.engine import Engine


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the checkpoint, the file and the problem."""


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _world() -> tuple[int, int, object]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    return 0, 1, None


def _shard_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank:05d}.pt"


def _write(obj: dict, target: Path) -> None:
    with open(target, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_meta(directory: Path, meta: dict) -> None:
    """meta.json, written last, then the directory's entries reach the disk before any rename."""
    with open(directory / "meta.json", "w") as f:
        f.write(json.dumps(meta))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(engine: Engine, path: str | os.PathLike, client_state: dict | None = None) -> None:
    """Collective: every rank writes its shard; the directory appears at `path` only if all succeeded."""
    rank, world, group = _world()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    old = path.with_name(path.name + ".old")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier(group)
    state = {
        "shard": {"rank": rank, "world_size": world, "global_steps": engine.global_steps},
        "engine": engine.state_dict(file_backed=True),  # written below, before any further step
        "client_state": client_state,
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
    }
    error: BaseException | None = None
    info = None
    try:
        _write(state, _shard_file(tmp, rank))
        shard = _shard_file(tmp, rank)
        info = {"file": shard.name, "bytes": shard.stat().st_size, "sha256": _digest(shard)}
    except Exception as e:  # reported collectively below so no rank is left waiting
        error = e
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=engine.device)
    comm.all_reduce(failed, group)
    if int(failed):
        comm.barrier(group)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"saving checkpoint {path} failed on {int(failed)} rank(s) (this rank: {error!r}); "
            "the previous checkpoint at that path is left intact"
        ) from error
    shards = comm.all_gather_object(info, group)
    if rank == 0:
        meta = {
            "format": "zero-checkpoint-v2",
            "world_size": world,
            "shards": shards,
            "layout": _layout(engine),
            "stage": engine.config.stage,
            "dtype": engine.config.dtype,
            "global_steps": engine.global_steps,
        }
        _write_meta(tmp, meta)
        # The only window without a complete `path` is between these renames; load falls back to `.old`.
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)  # the rename survives a power loss before the old copy goes
        shutil.rmtree(old, ignore_errors=True)
    comm.barrier(group)


def _layout(engine: Engine) -> dict[str, int]:
    d = engine.dims
    return {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sp": d.sp, "ep": d.ep}


def _problem(engine: Engine, path: Path, rank: int, world: int) -> tuple[str | None, dict | None]:
    """Why this rank cannot load its part of the checkpoint at `path` (None if it can), and its meta."""
    meta_file = path / "meta.json"
    if not meta_file.exists():
        return f"no checkpoint at {path} (missing meta.json)", None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        return f"{meta_file}: unreadable ({e})", None
    if meta.get("world_size") != world:
        return (f"checkpoint {path} was written by {meta.get('world_size')} ranks but this run has {world}: "
                "resume with the same world size, or convert through "
                "engine.full_state_dict()/load_full_state_dict()"), meta
    saved = meta.get("layout")
    if saved is not None and saved != _layout(engine):
        fmt = ", ".join(f"{k}={v}" for k, v in saved.items())
        return (f"checkpoint {path} was written with the parallel layout {fmt} but this run has "
                f"{', '.join(f'{k}={v}' for k, v in _layout(engine).items())}: resume with the same layout "
                "(reshard through engine.full_state_dict()/load_full_state_dict())"), meta
    shard = _shard_file(path, rank)
    if not shard.exists():
        return f"{shard}: missing", meta
    listed = meta.get("shards")
    if listed is not None:  # checkpoints written before checksums were recorded have none to check
        entry = listed[rank] if rank < len(listed) else None
        if entry is None or entry.get("file") != shard.name:
            return f"{meta_file}: does not list {shard.name}", meta
        size = shard.stat().st_size
        if size != entry["bytes"]:
            return f"{shard}: {size} bytes, the checkpoint lists {entry['bytes']} (truncated or replaced)", meta
        if _digest(shard) != entry["sha256"]:
            return f"{shard}: checksum mismatch (corrupted, or a shard of another checkpoint)", meta
    return None, meta


def _resolve(path: str | os.PathLike) -> Path:
    """`path`, or its `.old` copy when a save was interrupted between its two renames."""
    path = Path(path)
    if not path.exists() and path.with_name(path.name + ".old").exists():
        return path.with_name(path.name + ".old")
    return path


def _agree(problem: str | None, group) -> None:
    """Collective: raise the first rank's problem (in rank order) on every rank, if any rank has one."""
    first = next((p for p in comm.all_gather_object(problem, group) if p is not None), None)
    if first is not None:
        raise CheckpointError(first)


def verify_checkpoint(engine: Engine, path: str | os.PathLike) -> dict:
    """Collective: check the checkpoint at `path` on every rank (metadata, layout, each shard's size and
    checksum) and agree; raise the same CheckpointError on every rank if any rank's part is unusable.
    Returns the checkpoint's metadata."""
    rank, world, group = _world()
    problem, meta = _problem(engine, _resolve(path), rank, world)
    _agree(problem, group)
    return meta


def load_checkpoint(engine: Engine, path: str | os.PathLike) -> dict | None:
    """Collective: restore engine state and RNG from `path`; returns this rank's client_state."""
    rank, world, group = _world()
    path = _resolve(path)
    meta = verify_checkpoint(engine, path)
    # Memory-mapped: an offloaded engine streams each tensor to where it lives without holding them all.
    shard = _shard_file(path, rank)
    try:
        state = torch.load(shard, map_location="cpu", weights_only=False, mmap=True)
        own = state.get("shard", {"rank": rank, "global_steps": meta.get("global_steps")})
        problem = (f"{shard}: holds rank {own['rank']} at step {own['global_steps']}, the checkpoint is rank "
                   f"{rank} at step {meta.get('global_steps')}"
                   if (own["rank"], own["global_steps"]) != (rank, meta.get("global_steps")) else
                   engine.state_mismatch(state["engine"]))
    except Exception as e:  # unreadable despite a matching checksum (e.g. written by another torch)
        state, problem = None, f"{shard}: unreadable ({type(e).__name__}: {e})"
    _agree(problem, group)  # all ranks fail together when any cannot load its shard (none waits)
    engine.load_state_dict(state["engine"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["client_state"]
