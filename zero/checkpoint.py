"""Sharded, atomic checkpoints: each rank writes its own shard file into a directory.

Ranks write into `<path>.tmp`; only when every rank succeeded is the directory renamed over `<path>`,
so a failed or interrupted save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

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
        "engine": engine.state_dict(file_backed=True),  # written below, before any further step
        "client_state": client_state,
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
    }
    error: BaseException | None = None
    try:
        _write(state, _shard_file(tmp, rank))
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
    if rank == 0:
        meta = {
            "world_size": world,
            "layout": _layout(engine),
            "stage": engine.config.stage,
            "dtype": engine.config.dtype,
            "global_steps": engine.global_steps,
        }
        with open(tmp / "meta.json", "w") as f:
            f.write(json.dumps(meta))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)  # the shard files' directory entries reach the disk before the rename
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


def load_checkpoint(engine: Engine, path: str | os.PathLike) -> dict | None:
    """Collective: restore engine state and RNG from `path`; returns this rank's client_state."""
    rank, world, group = _world()
    path = Path(path)
    if not path.exists() and path.with_name(path.name + ".old").exists():
        path = path.with_name(path.name + ".old")  # a save was interrupted between its two renames
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise FileNotFoundError(f"no checkpoint at {path} (missing meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta["world_size"] != world:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks but this run has {world}: "
            "resume with the same world size, or convert through "
            "engine.full_state_dict()/load_full_state_dict()"
        )
    saved = meta.get("layout")
    if saved is not None and saved != _layout(engine):
        fmt = ", ".join(f"{k}={v}" for k, v in saved.items())
        raise ValueError(f"checkpoint {path} was written with the parallel layout {fmt} but this run has "
                         f"{', '.join(f'{k}={v}' for k, v in _layout(engine).items())}: resume with the same "
                         "layout (reshard through engine.full_state_dict()/load_full_state_dict())")
    # Memory-mapped: an offloaded engine streams each tensor to where it lives without holding them all.
    state = torch.load(_shard_file(path, rank), map_location="cpu", weights_only=False, mmap=True)
    # Every rank learns whether any rank cannot load its shard, so all of them fail together (none waits).
    problem = engine.state_mismatch(state["engine"])
    failed = torch.tensor([problem is not None], dtype=torch.int32, device=engine.device)
    comm.all_reduce(failed, group, op=dist.ReduceOp.MAX)
    if failed.item():
        raise ValueError(problem or f"checkpoint {path} does not match this engine on another rank "
                                    "(see its error); resume with the same model and layout")
    engine.load_state_dict(state["engine"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["client_state"]
