"""Training data: byte-level corpora (default: the Python standard library's own source), token `.bin` memmaps
and corpora prepared by `python -m recipes.prepare_data` (with their documents' starts), served as deterministic,
resumable, layout-independent global batches.

The global batch of step t depends only on (seed, t, global batch size): each data-parallel rank takes
its slice of every global batch, so dp=2 x micro 4 trains on exactly the tokens of dp=1 x micro 8.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from moe_lst.kernels.documents import positions_from_starts

from recipes.config import atomic_write_text
from recipes.prepare_data import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_DTYPE,
    META,
    PARTIAL,
    SPLITS,
    PrepareError,
    TextTokenizer,
    TokenizerSpec,
    index_name,
    shard_name,
    tokenizer_sha256,
)


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

    #: What identifies the data beyond the config (a prepared corpus: its tokenizer), or None.
    identity: dict | None = None

    def __init__(self, tokens: np.ndarray, spec: BatchSpec, seed: int, vocab_size: int) -> None:
        if len(tokens) < spec.seq_len + 2:
            raise DataError(
                f"corpus of {len(tokens)} tokens is shorter than one sequence of train.seq_len={spec.seq_len}"
            )
        self.tokens, self.spec, self.seed, self.vocab_size = tokens, spec, seed, vocab_size

    def _offsets(self, step: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        return rng.integers(0, len(self.tokens) - self.spec.seq_len - 1, size=self.spec.global_batch)

    def _row_offsets(self, step: int, micro: int, dp_rank: int) -> np.ndarray:
        """Where the windows of one micro batch of one rank start."""
        spec = self.spec
        start = (micro * spec.dp_size + dp_rank) * spec.micro_batch_size
        return self._offsets(step)[start:start + spec.micro_batch_size]

    def batch(self, step: int, micro: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        offsets = self._row_offsets(step, micro, dp_rank)
        rows = np.stack([np.asarray(self.tokens[o:o + spec.seq_len + 1], dtype=np.int64) for o in offsets])
        rows = torch.from_numpy(rows)
        if int(rows.max()) >= self.vocab_size:
            raise DataError(f"token id {int(rows.max())} in the data is >= model.vocab_size={self.vocab_size}")
        return rows[:, :-1], rows[:, 1:]

    def packed_batch(self, step: int, micro: int, dp_rank: int,
                     ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`batch(...)` with the position ids the model runs at: None (0..seq_len-1 in every row) for a stream
        that packs by concatenation, as this one does."""
        return (*self.batch(step, micro, dp_rank), None)


PACKINGS = ("document", "concat")


class DocumentStream(TokenStream):
    """A TokenStream over a prepared split that also knows where its documents start (the split's index), for
    document-aware packing: `document_starts` marks them in the same rows `batch` returns.

    With `packing="document"`, `packed_batch` gives the position ids that restart at every document (the model
    then keeps attention inside each document) and ignores the label of each document's last token (the next
    document's first token is not predicted from it). Rows are the same windows either way: whole documents,
    and the documents cut at a row's two ends.
    """

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, spec: BatchSpec, seed: int, vocab_size: int,
                 identity: dict, packing: str = "document") -> None:
        super().__init__(tokens, spec, seed, vocab_size)
        if packing not in PACKINGS:
            raise DataError(f"data.packing={packing!r} must be one of {', '.join(PACKINGS)}")
        self.starts = starts  # [documents + 1] token offsets of each document's first token, then the end
        self.identity = identity
        self.packing = packing

    def document_starts(self, step: int, micro: int, dp_rank: int, length: int | None = None) -> torch.Tensor:
        """[micro_batch, length] bool (length: seq_len by default; seq_len + 1 covers the last label too): True
        where the token at that offset of the row of `batch(step, micro, dp_rank)` is the first token of a
        document (its BOS, or the token after the previous document's EOS). A row's first position is True only
        when its window begins exactly at a document; either way the tokens before the row's first True belong
        to one (cut) document."""
        offsets = self._row_offsets(step, micro, dp_rank)
        length = self.spec.seq_len if length is None else length
        marks = np.zeros((len(offsets), length), dtype=bool)
        for row, first in enumerate(offsets.tolist()):
            lo, hi = np.searchsorted(self.starts, [first, first + length])
            marks[row, np.asarray(self.starts[lo:hi], dtype=np.int64) - first] = True
        return torch.from_numpy(marks)

    def packed_batch(self, step: int, micro: int, dp_rank: int,
                     ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, labels, position ids) [micro_batch, seq_len]; see the class docstring."""
        tokens, labels = self.batch(step, micro, dp_rank)
        if self.packing == "concat":
            return tokens, labels, None
        marks = self.document_starts(step, micro, dp_rank, self.spec.seq_len + 1)
        return tokens, labels.masked_fill(marks[:, 1:], ignore_index), positions_from_starts(marks[:, :-1])


def load_tokenized(path: str) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """A corpus `python -m recipes.prepare_data` wrote: its meta.json and per split (tokens, document starts) as
    read-only memmaps, after checking that the files are complete and belong together (one-line DataError)."""
    root = Path(path)
    redo = f"prepare it with python -m recipes.prepare_data --tokenizer TOKENIZER --out {path} INPUT..."
    if not root.is_dir():
        raise DataError(f"data.path={path!r} is not a directory: {redo}")
    if not (root / META).is_file():
        names = [shard_name(s) for s in SPLITS] + [index_name(s) for s in SPLITS]
        if any(p.name in names or p.name.endswith(PARTIAL) for p in root.iterdir()):
            raise DataError(f"data.path={path!r} has no {META}: its preparation did not finish (interrupted?); "
                            f"run it again (it replaces the partial files): {redo}")
        raise DataError(f"data.path={path!r} holds no prepared corpus (no {META}): {redo}")
    try:
        meta = json.loads((root / META).read_text())
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a {FORMAT} version {FORMAT_VERSION} meta.json")
        dtype = np.dtype(meta["dtype"])
        if dtype.name not in ("uint16", "uint32"):
            raise ValueError(f"dtype {dtype.name}")
        splits = {s: _split_files(root, meta["splits"][s], dtype) for s in SPLITS}
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = e.args[0] if isinstance(e, KeyError) else (getattr(e, "strerror", None) or str(e).splitlines()[0])
        raise DataError(f"data.path={path!r}: {META} cannot be used ({what}); {redo}") from None
    return meta, splits


def _split_files(root: Path, split: dict, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """One split's token and index memmaps, their sizes checked against meta.json."""
    arrays = []
    for name, itemsize, count in ((split["file"], dtype.itemsize, split["tokens"]),
                                  (split["index"], INDEX_DTYPE.itemsize, split["documents"] + 1)):
        file = root / name
        if not file.is_file():
            raise ValueError(f"{name} is missing")
        if file.stat().st_size != itemsize * count:
            raise ValueError(f"{name} has {file.stat().st_size} bytes where {META} records {itemsize * count}: the "
                             "files are not of one preparation")
        arrays.append(np.memmap(file, dtype=dtype if name == split["file"] else INDEX_DTYPE, mode="r"))
    tokens, starts = arrays
    if int(starts[0]) != 0 or int(starts[-1]) != len(tokens):
        raise ValueError(f"{split['index']} does not span {split['file']}")
    return tokens, starts


def tokenized_streams(path: str, spec: BatchSpec, seed: int, vocab_size: int,
                      packing: str = "document") -> tuple[DocumentStream, ...]:
    """(train, val) DocumentStreams over a prepared corpus, refused in one line when its tokenizer's vocabulary
    does not fit the model. `packing`: document (attention and loss stay inside documents) or concat."""
    if packing not in PACKINGS:
        raise DataError(f"data.packing={packing!r} must be one of {', '.join(PACKINGS)}")
    meta, splits = load_tokenized(path)
    tokenizer = meta["tokenizer"]
    if meta["vocab_size"] > vocab_size:
        raise DataError(f"data.path={path!r} was tokenized by {tokenizer['name']} with a vocabulary of "
                        f"{meta['vocab_size']:,} tokens, more than model.vocab_size={vocab_size}: set "
                        f"model.vocab_size={meta['vocab_size']} (or more)")
    identity = {"path": str(Path(path).resolve()), "tokenizer": tokenizer["name"], "tokenizer_kind": tokenizer["kind"],
                "tokenizer_path": tokenizer["path"], "tokenizer_sha256": tokenizer["sha256"],
                "vocab_size": meta["vocab_size"]}
    for split, (tokens, _) in splits.items():
        if len(tokens) < spec.seq_len + 2:
            raise DataError(f"data.path={path!r}: its {split} split has {len(tokens):,} tokens, fewer than one "
                            f"sequence of train.seq_len={spec.seq_len} (+ 2): lower train.seq_len, or prepare more "
                            "documents (or a larger --val-fraction)")
    return (DocumentStream(*splits["train"], spec, seed, vocab_size, identity, packing),
            DocumentStream(*splits["val"], spec, seed + VAL_SEED_OFFSET, vocab_size, identity, packing))


def stream_tokenizer(stream: TokenStream) -> TextTokenizer | None:
    """The tokenizer that prepared a stream's data (to encode a prompt and decode a sample), or None for data
    without one (stdlib, bin). Refused in one line when the tokenizer at its recorded path is gone or has changed."""
    mine = stream.identity
    if mine is None:
        return None
    spec = TokenizerSpec(mine["tokenizer_kind"], mine["tokenizer_path"])
    try:
        if tokenizer_sha256(spec) != mine["tokenizer_sha256"]:
            raise PrepareError("it is another tokenizer now (its sha256 differs from meta.json's)")
        return TextTokenizer(spec)
    except (OSError, PrepareError) as e:
        raise DataError(f"the tokenizer of data.path={mine['path']} ({mine['tokenizer_path']}) cannot decode its "
                        f"ids: {getattr(e, 'strerror', None) or e}") from None


DATA_IDENTITY = "data_identity.json"


def check_data_identity(stream: TokenStream, run_dir: Path, resuming: bool, is_rank0: bool) -> None:
    """A run records the tokenizer of its data in run_dir (data_identity.json) when it starts; a resumed run whose
    data.path was since prepared with another tokenizer (its hash differs) is refused in one line, since its ids
    would mean other text. Data without a tokenizer (stdlib, bin) records nothing."""
    mine = stream.identity
    if mine is None:
        return
    path = Path(run_dir) / DATA_IDENTITY
    if resuming and path.exists():
        try:
            started = json.loads(path.read_text())
            sha256 = started["tokenizer_sha256"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path} is damaged ({type(e).__name__}): restore it, or remove it to resume without "
                            "checking the data's tokenizer") from None
        if sha256 != mine["tokenizer_sha256"]:
            raise DataError(f"data.path={mine['path']} is now tokenized by {mine['tokenizer']} (sha256 "
                            f"{mine['tokenizer_sha256'][:12]}), but this run started with {started.get('tokenizer')} "
                            f"(sha256 {sha256[:12]}): resume on data of that tokenizer, or start a new run_dir")
        return
    if is_rank0:
        atomic_write_text(path, json.dumps(mine, indent=1, sort_keys=True) + "\n")


VAL_SEED_OFFSET = 1_000_003  # validation draws from its own seed stream: a new train seed does not move the eval set


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
    elif kind == "tokenized":
        return tokenized_streams(data_cfg.path, spec, seed, vocab_size, data_cfg.get("packing", "document"))
    else:
        raise DataError(f"data.kind={kind!r} is unknown; use 'stdlib', 'bin' or 'tokenized'")
    return TokenStream(train, spec, seed, vocab_size), TokenStream(val, spec, seed + VAL_SEED_OFFSET, vocab_size)
