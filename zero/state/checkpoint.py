"""Sharded, atomic, verified checkpoints: each rank writes its own shard file into a directory.

Ranks write into `<path>.tmp`; only when every rank succeeded is the directory renamed over `<path>`,
so a failed or interrupted save leaves the previous checkpoint untouched. `meta.json`, written last,
lists every shard with its size and SHA-256, and each shard records its rank, step and run. Loading (and
`verify_checkpoint`) checks all of it, the ranks sharing the shards between them, and agrees across ranks
before any collective that depends on the shards, so a truncated, corrupted or foreign shard stops every
rank with the same one-line error naming the file, never a hang. A checkpoint of another layout is
resharded on load (zero.state.reshard); one of another model raises ReshardError.

A shard holds data only (`rank00000.safetensors`: tensors, and a JSON skeleton for the rest; zero.state.shardfile),
so loading one never runs code: the checksums prove integrity against corruption, not against whoever wrote both
files, and a crafted shard is refused by name. Checkpoints of the older pickle format (`rank00000.pt`) are
refused with the command that converts them (`python -m zero.state.convert <dir>`, zero.state.convert).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zero.dist import comm
from zero.state.reshard import CheckpointReader, ReshardError, resharded_state
from zero.state.shardfile import ShardFormatError, dump, load

if TYPE_CHECKING:
    from zero.state.interface import CheckpointedEngine


#: meta.json's format: shards are safetensors files (zero.state.shardfile). zero-checkpoint-v2 and older were pickles.
FORMAT = "zero-checkpoint-v3"
#: The shard file of the pickle format, which loading refuses (zero.state.convert converts it).
LEGACY_SHARD = "rank{rank:05d}.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the checkpoint, the file and the problem."""


class LegacyCheckpointError(CheckpointError):
    """A checkpoint of the old pickle format: never loaded, converted by the user's explicit command."""


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _world() -> tuple[int, int, object]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    return 0, 1, None


def _shard_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank:05d}.safetensors"


def _write(obj: dict, target: Path) -> None:
    with open(target, "wb") as f:
        dump(obj, f)
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


def save_checkpoint(engine: CheckpointedEngine, path: str | os.PathLike, client_state: dict | None = None,
                    run_id: str | None = None) -> None:
    """Collective: every rank writes its shard; the directory appears at `path` only if all succeeded.

    `run_id` (e.g. the run directory's identity) is recorded in every shard and the metadata; loading
    refuses a shard whose run, rank or step differs from the checkpoint's."""
    rank, world, group = _world()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier(group)
    state = {
        "shard": {"rank": rank, "world_size": world, "global_steps": engine.global_steps, "run_id": run_id},
        # StreamedTensors: each read from where it lives while the shard is written (below, before any further
        # step), so a save holds no copy of the state beyond one tensor or nvme chunk
        "engine": engine.state_dict(streamed=True),
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
    # Split parameters without a placement make the checkpoint resumable only under its own layout.
    unplaced = [n for names in comm.all_gather_object(engine.unplaced_split_params(), group) for n in names]
    if rank == 0:
        meta = {"format": FORMAT, "world_size": world, "shards": shards, "layout": _degrees(engine),
                "stage": engine.config.stage, "dtype": engine.config.dtype, "global_steps": engine.global_steps,
                "run_id": run_id, "unplaced": sorted(set(unplaced))}
        _write_meta(tmp, meta)
        _publish(tmp, path)
    comm.barrier(group)


def _publish(tmp: Path, path: Path) -> None:
    """Rename the complete `tmp` over `path`. The only window without a complete `path` is between the two
    renames; loading falls back to `.old` there."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    _fsync_dir(path.parent)  # the rename survives a power loss before the old copy goes
    shutil.rmtree(old, ignore_errors=True)


def _degrees(engine: CheckpointedEngine) -> dict[str, int]:
    d = engine.dims
    return {"dp": d.dp, "tp": d.tp, "pp": d.pp, "sp": d.sp, "ep": d.ep}


def describe_layout(meta: dict) -> str:
    """A checkpoint's layout in words, e.g. 'dp=2 tp=1 pp=1 sp=1 ep=1, ZeRO stage 3, 2 ranks'."""
    layout = " ".join(f"{k}={v}" for k, v in (meta.get("layout") or {}).items())
    return f"{layout}, ZeRO stage {meta.get('stage')}, {meta.get('world_size')} ranks"


def _read_meta(path: Path) -> tuple[str | None, dict | None]:
    meta_file = path / "meta.json"
    if not meta_file.exists():
        return f"no checkpoint at {path} (missing meta.json)", None
    try:
        meta = json.loads(meta_file.read_text())
        int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{meta_file}: unreadable ({type(e).__name__}: {e})", None
    if meta.get("format") != FORMAT and not is_legacy(meta):
        return (f"{meta_file}: format {meta.get('format')!r} is not one this version reads ({FORMAT}): load it "
                "with the version that wrote it"), None
    return None, meta


def is_legacy(meta: dict) -> bool:
    """Whether a checkpoint whose meta.json reads `meta` is of the old pickle format."""
    return meta.get("format") in (None, "zero-checkpoint-v2")


def _legacy_problem(path: Path, meta: dict | None) -> str | None:
    if meta is None or not is_legacy(meta):
        return None
    return (f"{path / LEGACY_SHARD.format(rank=0)}: a checkpoint of the old pickle format, which is never loaded "
            "(unpickling runs whatever code the file carries); if you trust where it came from, convert it once "
            f"with `python -m zero.state.convert {shlex.quote(str(path))}`")


def _shard_problem(path: Path, meta: dict, rank: int, shard: Path | None = None) -> str | None:
    """Why shard `rank` of the checkpoint at `path` (file `shard`, by default the current format's) is unusable
    (missing, not listed, wrong size or checksum), or None."""
    shard = shard or _shard_file(path, rank)
    if not shard.exists():
        return f"{shard}: missing"
    listed = meta.get("shards")
    if listed is not None:  # checkpoints written before checksums were recorded have none to check
        entry = listed[rank] if rank < len(listed) else None
        if entry is None or entry.get("file") != shard.name:
            return f"{path / 'meta.json'}: does not list {shard.name}"
        size = shard.stat().st_size
        if size != entry["bytes"]:
            return f"{shard}: {size} bytes, the checkpoint lists {entry['bytes']} (truncated or replaced)"
        if _digest(shard) != entry["sha256"]:
            return f"{shard}: checksum mismatch (corrupted, or a shard of another checkpoint)"
    return None


def _load_shard(path: Path, meta: dict, rank: int) -> dict:
    """Shard `rank`'s state (memory-mapped: an offloaded engine streams each tensor to where it lives),
    its record (rank, step, run) checked against the checkpoint's; raises CheckpointError."""
    shard = _shard_file(path, rank)
    try:
        state = load(shard)
    except ShardFormatError as e:  # a matching checksum proves integrity, not who wrote the file
        raise CheckpointError(f"{shard}: {e}; a shard holds only tensors and JSON and is never unpickled") from None
    except Exception as e:  # noqa: BLE001 - unreadable despite a matching checksum
        raise CheckpointError(f"{shard}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{shard}: holds a {type(state).__name__}, not a shard's state")
    own = state.get("shard", {"rank": rank, "global_steps": meta.get("global_steps")})
    if not isinstance(own, dict) or not {"rank", "global_steps"} <= own.keys():
        raise CheckpointError(f"{shard}: its shard record {own!r:.80} lacks the rank and step")
    if (own["rank"], own["global_steps"]) != (rank, meta.get("global_steps")):
        raise CheckpointError(f"{shard}: holds rank {own['rank']} at step {own['global_steps']}, the checkpoint is "
                              f"rank {rank} at step {meta.get('global_steps')}")
    if own.get("run_id") != meta.get("run_id"):
        raise CheckpointError(f"{shard}: written by run {own.get('run_id')}, the checkpoint is of run "
                              f"{meta.get('run_id')}")
    return state


def _resolve(path: str | os.PathLike) -> Path:
    """`path`, or its `.old` copy when a save was interrupted between its two renames."""
    path = Path(path)
    if not path.exists() and path.with_name(path.name + ".old").exists():
        return path.with_name(path.name + ".old")
    return path


def _agree(problem: str | None, group, error: type[Exception] = CheckpointError) -> None:
    """Collective: raise the first rank's problem (in rank order) on every rank, if any rank has one."""
    first = next((p for p in comm.all_gather_object(problem, group) if p is not None), None)
    if first is not None:
        raise error(first)


def _verify(path: Path, rank: int, world: int, group) -> dict:
    """Collective: the ranks share the integrity checks of every shard (rank r checks shards r, r + world,
    ...) and agree; raises the same CheckpointError everywhere if anything is wrong. Returns the meta."""
    problem, meta = _read_meta(path)
    _agree(_legacy_problem(path, meta), group, LegacyCheckpointError)
    if problem is None:
        for r in range(rank, int(meta["world_size"]), world):
            problem = _shard_problem(path, meta, r)
            if problem is not None:
                break
    _agree(problem, group)
    return meta


def verify_checkpoint(engine: CheckpointedEngine | None, path: str | os.PathLike) -> dict:
    """Collective: check the checkpoint at `path` (metadata, every shard's presence, size and checksum)
    on every rank and agree; raise the same CheckpointError on every rank if any part is unusable.
    Returns the checkpoint's metadata. (A checkpoint of another layout verifies: loading reshards it.)"""
    rank, world, group = _world()
    return _verify(_resolve(path), rank, world, group)


def _attempt(fn, group, error: type[Exception] = CheckpointError):
    """Collective: fn() on every rank; if any rank fails, every rank raises the first failure (as `error`;
    an unexpected exception is re-raised as it is on the rank that hit it)."""
    result, problem, unexpected = None, None, None
    try:
        result = fn()
    except (CheckpointError, ReshardError) as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - reported collectively so no rank is left waiting
        problem, unexpected = f"{type(e).__name__}: {e}", e
    try:
        _agree(problem, group, error)
    except error:
        if unexpected is not None:
            raise unexpected from None
        raise
    return result


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """Offline, in one process (no collectives): verify every shard of the checkpoint at `path` and open it
    for reading under any layout (e.g. `zero.consolidate(open_checkpoint(path))`, the whole model)."""
    path = _resolve(path)
    problem, meta = _read_meta(path)
    legacy = _legacy_problem(path, meta)
    if legacy is not None:
        raise LegacyCheckpointError(legacy)
    for r in range(int(meta["world_size"])) if problem is None else ():
        problem = problem or _shard_problem(path, meta, r)
    if problem is not None:
        raise CheckpointError(problem)
    return CheckpointReader(path, meta, lambda r: _load_shard(path, meta, r))


def load_checkpoint(engine: CheckpointedEngine, path: str | os.PathLike) -> dict | None:
    """Collective: restore engine state and RNG from `path`; returns this rank's client_state.

    A checkpoint written under the same layout is loaded shard by shard. Under another layout (world
    size, dp/tp/pp/sp/ep sizes, ZeRO stage, bucket sizes) it is resharded: every rank reads its part of
    the parameters and optimizer state from whichever shards hold it (see zero.state.reshard). Either way
    `engine.loaded_checkpoint` says which happened. Rank r takes the RNG and client_state of the
    checkpoint's rank r (rank 0's where the checkpoint had fewer ranks)."""
    rank, world, group = _world()
    path = _resolve(path)
    meta = _verify(path, rank, world, group)
    same = (meta["world_size"] == world and meta.get("layout") in (None, _degrees(engine))
            and meta.get("stage", engine.config.stage) == engine.config.stage)

    def own():
        state = _load_shard(path, meta, rank)
        return state, engine.state_mismatch(state["engine"])

    state = mismatch = None
    if same:
        state, mismatch = _attempt(own, group)
    if not same or any(m is not None for m in comm.all_gather_object(mismatch, group)):
        # Every parameter name of the whole model (pipeline ranks hold different ones).
        names = {n for mine in comm.all_gather_object([n for b in engine.buckets for n in b.names], group)
                 for n in mine}

        def reshard():
            if meta.get("unplaced"):
                raise ReshardError(f"checkpoint {path} ({describe_layout(meta)}) holds parameters split over tp or ep "
                                   f"without a recorded placement (e.g. {meta['unplaced'][0]}): it resumes only "
                                   "under the layout it was written with; declare zero.initialize(placements=...) "
                                   "to write reshardable checkpoints")
            reader = CheckpointReader(path, meta, lambda r: _load_shard(path, meta, r))
            extra = sorted(set(reader.names()) - names)
            if extra:
                more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
                raise ReshardError(f"checkpoint {path} holds {extra[0]}{more}, which this model does not have: it "
                                   "was written for another model")
            return resharded_state(engine, reader), reader.states[rank if rank < len(reader.states) else 0]

        engine_state, state = _attempt(reshard, group, ReshardError)
        engine.load_state_dict(engine_state)
        engine.loaded_checkpoint = {"path": str(path), "resharded_from": describe_layout(meta)}
    else:
        engine.load_state_dict(state["engine"])
        engine.loaded_checkpoint = {"path": str(path), "resharded_from": None}
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["client_state"]
