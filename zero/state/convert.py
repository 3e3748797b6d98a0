"""Convert checkpoints of the old pickle format (`rank*.pt` shards) into the current one (safetensors, JSON) in place.

    python -m zero.state.convert <checkpoint dir or a directory holding checkpoints> ...

Loading a pickle runs whatever code the file carries, so loading a checkpoint never unpickles. This command does,
with `torch.load(weights_only=False)`, for the checkpoints you name and only because you ask: run it only on
checkpoints you trust. Each shard's size and SHA-256 are checked against meta.json first (integrity, not trust);
the converted checkpoint is written beside the old one and renamed over it once complete, as a save is, so an
interrupted conversion leaves the old checkpoint as it was.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from zero.state.checkpoint import (
    FORMAT,
    LEGACY_SHARD,
    CheckpointError,
    _digest,
    _publish,
    _read_meta,
    _shard_file,
    _shard_problem,
    _write,
    _write_meta,
    is_legacy,
)
from zero.state.shardfile import ShardFormatError

WARNING = ("zero.state.convert loads the old shards with torch.load(weights_only=False): unpickling runs whatever "
           "code they carry, which is why loading a checkpoint never does it; you asked for it here, so convert only "
           "checkpoints you trust")


def convert_checkpoint(path: str | Path) -> int:
    """Convert the old-format checkpoint directory `path` in place; returns its number of shards. Raises
    CheckpointError (nothing changed) if it is not one, a shard fails its check, or a value cannot be stored."""
    path = Path(path)
    problem, meta = _read_meta(path)
    if problem is not None:
        raise CheckpointError(problem)
    if not is_legacy(meta):
        raise CheckpointError(f"{path}: already in the current format ({FORMAT}), nothing to convert")
    world = int(meta["world_size"])
    old = [path / LEGACY_SHARD.format(rank=r) for r in range(world)]
    for r, shard in enumerate(old):
        problem = _shard_problem(path, meta, r, shard)
        if problem is not None:
            raise CheckpointError(problem)
    tmp = path.with_name(path.name + ".convert.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shards = []
        for r, shard in enumerate(old):
            state = torch.load(shard, map_location="cpu", weights_only=False, mmap=True)  # see WARNING
            target = _shard_file(tmp, r)
            try:
                _write(state, target)
            except ShardFormatError as e:
                raise CheckpointError(f"{shard}: {e}; the new format holds only tensors and plain data") from None
            del state
            shards.append({"file": target.name, "bytes": target.stat().st_size, "sha256": _digest(target)})
        for other in path.iterdir():  # anything else that was put beside the shards moves along
            if other.name != "meta.json" and other not in old:
                (shutil.copytree if other.is_dir() else shutil.copy2)(other, tmp / other.name)
        _write_meta(tmp, {**meta, "format": FORMAT, "shards": shards})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, path)
    return world


def legacy_checkpoints(root: Path) -> list[Path]:
    """`root` if it is an old-format checkpoint, else the old-format checkpoints under it (e.g. a run directory)."""
    if (root / "meta.json").is_file():
        return [root]
    found = (meta.parent for meta in root.rglob("meta.json")
             if (meta.parent / LEGACY_SHARD.format(rank=0)).is_file()
             and not meta.parent.name.endswith((".tmp", ".old")))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero.state.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path,
                        help="checkpoint directories, or directories to search for old-format checkpoints")
    args = parser.parse_args(argv)
    todo = []
    for root in args.paths:
        found = legacy_checkpoints(root) if root.is_dir() else []
        if not found:
            print(f"error: {root}: no checkpoint of the old pickle format (rank00000.pt beside meta.json) there",
                  file=sys.stderr)
            return 2
        todo += found
    print(WARNING, flush=True)
    for path in todo:
        try:
            n = convert_checkpoint(path)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"converted {path}: {n} shard(s), rank*.pt -> rank*.safetensors", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
