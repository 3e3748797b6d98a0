"""Training data: byte-level corpora (default: the Python standard library's own source) and token
`.bin` memmaps, served as deterministic, resumable, layout-independent global batches.

The global batch of step t depends only on (seed, t, global batch size): each data-parallel rank takes
its slice of every global batch, so dp=2 x micro 4 trains on exactly the tokens of dp=1 x micro 8.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class DataError(ValueError):
    """A data file or data setting that cannot be used."""


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus(max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated `.py` sources of the running Python's standard library as (train, val) uint8 arrays.

    Every file goes wholly to one split (1 in 20 to validation, chosen by a hash of its relative
    path), so validation text is never seen in training. Files are visited in sorted order, so the
    corpus is the same on every run of the same Python.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            data = path.read_bytes() + b"\n"
            bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20
            (val if bucket == 0 else train).append(data)
            total += len(data)
            if max_bytes is not None and total >= max_bytes:
                break
        if max_bytes is not None and total >= max_bytes:
            break
    if not train or not val:
        raise DataError(f"no Python sources found under {root} to build the default corpus")
    return (np.frombuffer(b"".join(train), dtype=np.uint8), np.frombuffer(b"".join(val), dtype=np.uint8))


def load_bin(path: str | os.PathLike, dtype: str) -> np.ndarray:
    """A flat token file (uint8/uint16/uint32) as a read-only memmap."""
    if dtype not in ("uint8", "uint16", "uint32"):
        raise DataError(f"data dtype {dtype!r} is not supported; use uint8, uint16 or uint32")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist (set data.train_path / data.val_path)")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"data file {str(path)!r} has {size} bytes, not a multiple of {dtype}'s {itemsize}")
    if size == 0:
        raise DataError(f"data file {str(path)!r} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


def check_token_ids(tokens: np.ndarray, vocab_size: int, what: str, chunk: int = 1 << 24) -> None:
    """Every token id < vocab_size, checked over the whole file before training (in chunks of a memmap:
    one pass at memory bandwidth, a few seconds per GB), so a bad id fails now, not at step 90,000."""
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        top = int(part.max())
        if top >= vocab_size:
            where = start + int(np.argmax(part >= vocab_size))
            raise DataError(f"{what}: token id {top} (first bad id at position {where}) is >= "
                            f"model.vocab_size={vocab_size}")


@dataclass
class BatchSpec:
    """How each optimizer step's global batch is split: dp ranks x grad_accum micro batches."""

    micro_batch_size: int
    grad_accum: int
    dp_size: int
    seq_len: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp_size


class TokenStream:
    """Random contiguous windows of `seq_len + 1` tokens, drawn per step from (seed, step).

    `batch(step, micro, dp_rank)` returns (inputs, labels) [micro_batch, seq_len] for one micro batch
    of one rank. Window offsets for a step are drawn for the whole global batch, in global row order
    (micro-step major, then dp rank), so the set of rows in a step is independent of the layout.
    """

    def __init__(self, tokens: np.ndarray, spec: BatchSpec, seed: int, vocab_size: int) -> None:
        if len(tokens) < spec.seq_len + 2:
            raise DataError(
                f"corpus of {len(tokens)} tokens is shorter than one sequence of train.seq_len={spec.seq_len}"
            )
        self.tokens, self.spec, self.seed, self.vocab_size = tokens, spec, seed, vocab_size

    def _offsets(self, step: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        return rng.integers(0, len(self.tokens) - self.spec.seq_len - 1, size=self.spec.global_batch)

    def batch(self, step: int, micro: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        start = (micro * spec.dp_size + dp_rank) * spec.micro_batch_size
        offsets = self._offsets(step)[start:start + spec.micro_batch_size]
        rows = np.stack([np.asarray(self.tokens[o:o + spec.seq_len + 1], dtype=np.int64) for o in offsets])
        rows = torch.from_numpy(rows)
        if int(rows.max()) >= self.vocab_size:
            raise DataError(f"token id {int(rows.max())} in the data is >= model.vocab_size={self.vocab_size}")
        return rows[:, :-1], rows[:, 1:]


def build_streams(data_cfg, spec: BatchSpec, seed: int, vocab_size: int) -> tuple[TokenStream, TokenStream]:
    """(train, val) streams for the recipe's `data` config group."""
    kind = data_cfg.get("kind", "stdlib")
    if kind == "stdlib":
        if vocab_size < 256:
            raise DataError(f"the byte-level stdlib corpus needs model.vocab_size >= 256, got {vocab_size}")
        train, val = stdlib_corpus(data_cfg.get("max_bytes"))
    elif kind == "bin":
        train = load_bin(data_cfg.train_path, data_cfg.dtype)
        val = load_bin(data_cfg.val_path, data_cfg.dtype)
        for name, tokens in (("data.train_path", train), ("data.val_path", val)):
            check_token_ids(tokens, vocab_size, f"{name}={data_cfg[name.split('.')[1]]!r}")
    else:
        raise DataError(f"data.kind={kind!r} is unknown; use 'stdlib' or 'bin'")
    # Validation draws from its own seed stream so changing the train seed does not move the eval set.
    return TokenStream(train, spec, seed, vocab_size), TokenStream(val, spec, seed + 1_000_003, vocab_size)
