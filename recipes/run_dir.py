"""A run's directory: its lock and identity, the config it was started with (and what changed since), its
checkpoints (saving, the keep policy, which one a run resumes from) and its result file."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import zero
from recipes.config import ConfigError, atomic_write_text, checkpoints
from zero.dist import comm
from zero.state.checkpoint import LegacyCheckpointError

#: Keys whose change means a resumed run would not continue the run its run_dir holds.
RESUME_KEYS = ("model", "data", "train.seed", "train.seq_len")


def lock_run_dir(run_dir: Path, world) -> object:
    """Hold an exclusive lock on run_dir for this process's lifetime (rank 0); a second run on the same
    directory is refused on every rank with the holder's pid, and a lock file that cannot be opened is
    refused by name."""
    handle, problem = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = run_dir / ".lock"
        try:
            handle = open(path, "a+", encoding="utf-8", errors="replace")
        except OSError as e:
            problem = (f"{path} cannot be opened ({e.strerror or e}): it is this run_dir's lock file; remove it "
                       "(no run can hold it) and start again")
    if handle is not None:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
        except BlockingIOError:
            handle.seek(0)
            pid = handle.read(32).strip()
            problem = (f"run_dir {run_dir} is in use by another run (pid {pid if pid.isdigit() else '?'}); "
                       "wait for it to finish or choose another run_dir")
            handle.close()
    problem = comm.all_gather_object(problem, world)[0]
    if problem is not None:
        raise ConfigError(problem)
    return handle


RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def run_identity(run_dir: Path, world) -> str:
    """The run's identity (created with its run_dir, kept across resumes), recorded in every checkpoint shard
    and used as the W&B run id. A run_id file that does not hold one is refused by name on every rank."""
    run_id, problem = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = run_dir / "run_id"
        try:
            if not path.exists():
                atomic_write_text(path, uuid.uuid4().hex + "\n")
            run_id = path.read_text(errors="replace").strip()
            if not RUN_ID.match(run_id):
                raise ValueError("it does not hold a run identity (32 hex digits)")
        except (OSError, ValueError) as e:
            problem = (f"{path} is damaged ({getattr(e, 'strerror', None) or e}): restore it (each checkpoint's "
                       "meta.json records it as run_id), or remove it if run_dir has no checkpoints")
    run_id, problem = comm.all_gather_object((run_id, problem), world)[0]
    if problem is not None:
        raise ConfigError(problem)
    return run_id


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def read_saved_config(path: Path) -> dict:
    """The resolved config that run_dir's config.yaml holds, flat (`train.steps`: value); a file that cannot be
    read as one is refused in one line naming it."""
    try:
        saved = OmegaConf.load(path)
        if not isinstance(saved, DictConfig):
            raise ValueError("it does not hold a mapping of config keys")
        flat = _flat(OmegaConf.to_container(saved, resolve=True))
        for key in ("train.micro_batch_size", "train.grad_accum"):
            if not isinstance(flat.get(key), int):
                raise ValueError(f"it has no {key}")
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"{path} is damaged ({_first_line(e)}): restore it, or remove it to resume without "
                          "comparing the config (the run writes it anew)") from None
    return flat


def _first_line(error: BaseException) -> str:
    """What went wrong reading a file, in one short line (a YAML error: the problem and its line)."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem and error.problem_mark is not None:
        return f"{error.problem} at line {error.problem_mark.line + 1}"
    text = (getattr(error, "strerror", None) or str(error)).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:160]


def check_resumed_config(cfg: DictConfig, run_dir: Path, dims: zero.ParallelDims, is_rank0: bool) -> None:
    """When the run will resume (run_dir has checkpoints and train.resume is not false), compare its config
    with the one its run_dir was started with: a change that breaks resume (model, data, seed, sequence
    length, global batch) is refused by name; other changes (steps, cadences, ...) are reported and
    appended to config_changes.jsonl."""
    saved_file = run_dir / "config.yaml"
    if not checkpoints(run_dir) or cfg.train.resume in (False, "false") or not saved_file.exists():
        return
    old = read_saved_config(saved_file)
    new = _flat(OmegaConf.to_container(cfg, resolve=True))
    changed = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and k != "run_dir"}
    old_dp = old.get("parallel.dp")
    old_dp = old_dp if isinstance(old_dp, int) and old_dp > 0 else dims.dp  # (null / auto: this run's)
    old_batch = old["train.micro_batch_size"] * old["train.grad_accum"] * old_dp
    new_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * dims.dp
    breaking = [k for k in changed if k.startswith(RESUME_KEYS)]
    if old_batch != new_batch:
        breaking.append(f"global batch ({old_batch} -> {new_batch} sequences)")
    if breaking:
        raise ConfigError(f"run_dir {run_dir} was started with another {', '.join(breaking)}; resuming would not "
                          "continue that run: restore those values or choose another run_dir")
    if changed and is_rank0:
        print("config changed since this run started: " + ", ".join(f"{k}: {a!r} -> {b!r}"
                                                                    for k, (a, b) in changed.items()), flush=True)
        with open(run_dir / "config_changes.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "changes": {k: list(v) for k, v in changed.items()}}) + "\n")


def save_config(cfg: DictConfig, run_dir: Path) -> None:
    """The run's resolved config as config.yaml (what check_resumed_config compares a resumed run with)."""
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))


def resumes(cfg: DictConfig, run_dir: Path) -> bool:
    """Whether the run starts from a checkpoint: train.resume names one, or is auto / true and run_dir has some."""
    mode = cfg.train.resume
    return mode not in (False, "false") and (mode not in (True, "true", "auto") or bool(checkpoints(run_dir)))


def resume(engine: zero.Engine, run_dir: Path, cfg: DictConfig, is_rank0: bool) -> int:
    """Load the checkpoint train.resume selects and return the step to start from.

    auto / true: the newest checkpoint of run_dir that verifies, saying which newer ones were skipped and
    why; if checkpoints exist but none verifies it is an error, never a silent restart. false: start
    from step 0, refused when run_dir already has checkpoints. A path: that checkpoint, verified."""
    mode, found = cfg.train.resume, checkpoints(run_dir)
    if mode in (False, "false"):
        if found:
            raise ConfigError(f"run_dir {run_dir} has {len(found)} checkpoint(s) (newest {found[0].name}) and "
                              "train.resume=false would train over them: choose another run_dir or train.resume=auto")
        return 0
    explicit = mode not in (True, "true", "auto")
    skipped: list[str] = []
    for path in [Path(mode)] if explicit else found:
        try:
            client_state = engine.load_checkpoint(path)
        except zero.CheckpointError as e:
            if explicit or isinstance(e, LegacyCheckpointError):  # converted by the user's command, never skipped
                raise
            skipped.append(str(e))
            continue
        if is_rank0:
            note = f" (skipped {len(skipped)} newer: {'; '.join(skipped)})" if skipped else ""
            written = engine.loaded_checkpoint["resharded_from"]
            if written is not None:
                note += f" (resharded: written with {written}, now {engine.dims} at ZeRO stage {engine.config.stage})"
            print(f"resuming from {path}{note}", flush=True)
        torch.set_rng_state(client_state["rng"])
        return client_state["step"]
    if found:
        raise zero.CheckpointError(f"none of the {len(found)} checkpoints in {run_dir / 'checkpoints'} can be "
                                   f"loaded (newest: {skipped[0]}); repair or remove them, or choose another run_dir")
    return 0


class CheckpointWriteError(Exception):
    """A checkpoint that the file system refused to take (no space left, over quota, not writable); the message
    names it and, for space, the bytes it needs and those free. The previous checkpoints are intact."""

    def __init__(self, message: str, path: Path, needed: int | None = None, free: int | None = None) -> None:
        super().__init__(message)
        self.path, self.needed, self.free = path, needed, free


#: errno values that mean the disk (or the user's quota) has no room left.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def save_checkpoint(engine, run_dir: Path, step: int, is_rank0: bool, keep: int = 0,
                    run_id: str | None = None) -> None:
    """Save step `step`, point `latest` at it, and keep only the newest `keep` checkpoints (0: all). A save the
    file system refuses (an OSError on any rank: no space, over quota, not writable) raises CheckpointWriteError
    on every rank, the previous checkpoints intact."""
    name = f"step_{step:07d}"
    path = run_dir / "checkpoints" / name
    try:
        engine.save_checkpoint(path, client_state={"step": step, "rng": torch.get_rng_state()}, run_id=run_id)
    except Exception as e:
        # (zero's save fails on every rank together, and each rank's own error is the cause on that rank)
        raise _write_failure(engine, path, e) from e
    if is_rank0:  # the pointer moves only after the checkpoint is complete
        try:
            atomic_write_text(run_dir / "checkpoints" / "latest", name)
        except OSError as e:
            raise CheckpointWriteError(f"checkpoint {path} was saved, but its pointer {run_dir / 'checkpoints'}/latest "
                                       f"could not be written ({e.strerror or e}); resuming finds the checkpoint "
                                       "without it", path) from None
        for old in checkpoints(run_dir)[keep:] if keep else []:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def _write_failure(engine, path: Path, error: Exception) -> Exception:
    """A failed collective save as CheckpointWriteError when an OSError caused it on any rank (every rank takes
    part: they all failed together); any other error as it is. For no space: the checkpoint's size (every
    rank's tensors) and the space free where it goes."""
    cause = next((e for e in (error, error.__cause__) if isinstance(e, OSError)), None)
    own = (cause.errno, cause.strerror or str(cause)) if cause is not None else None
    try:
        size = _tensor_bytes(engine.state_dict(file_backed=True))
    except Exception:  # noqa: BLE001 - the size is for the message only
        size = 0
    world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    causes = comm.all_gather_object((own, size), world)
    failures = [(rank, c) for rank, (c, _) in enumerate(causes) if c is not None]
    if not failures:
        return error
    rank, (number, reason) = next(((r, c) for r, c in failures if c[0] in NO_SPACE), failures[0])
    where = f" on rank {rank}" if world is not None else ""
    if number not in NO_SPACE:
        return CheckpointWriteError(f"checkpoint {path} could not be written{where}: {reason}; the previous "
                                    "checkpoints are intact: make the run_dir writable, then run the same command "
                                    "to resume", path)
    needed = sum(size for _, size in causes)
    free = shutil.disk_usage(path.parent).free
    return CheckpointWriteError(
        f"checkpoint {path} could not be written{where}: {reason} (it needs about {_size(needed)}, {_size(free)} are "
        f"free there); the previous checkpoints are intact: free at least {_size(max(needed - free, 0))} or lower "
        "train.keep_checkpoints, then run the same command to resume", path, needed, free)


def _tensor_bytes(state) -> int:
    """The bytes of every tensor in a (nested) state: what its checkpoint shard holds, less a small header."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _size(n: int) -> str:
    """A byte count exact and readable: '12,345,678 bytes (11.8 MiB)'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def finite_or_none(value):
    """JSON-safe: non-finite floats become null (result files stay valid JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    return value


def read_result(run_dir: Path) -> dict | None:
    """What result.json says about how the run ended (None: no result yet); a file that is not a JSON object
    is refused in one line naming it."""
    path = run_dir / "result.json"
    if not path.exists():
        return None
    try:
        result = json.loads(path.read_text())
        if not isinstance(result, dict):
            raise ValueError("it does not hold a JSON object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is damaged ({_first_line(e)}): remove it and run the same command again "
                          "(the run's checkpoints and metrics are kept; it is written anew at the end)") from None
    return result


def write_result(run_dir: Path, result: dict) -> None:
    """result.json: how the run ended (complete, preempted, diverged or hung) and its last values, as valid
    JSON."""
    atomic_write_text(run_dir / "result.json", json.dumps(finite_or_none(result)))
