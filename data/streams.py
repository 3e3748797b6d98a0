"""Token streams served as deterministic, resumable, layout-independent global batches, and packing by document.

The global batch of step t depends only on (seed, t, global batch size): each data-parallel rank takes its slice
of every global batch, so dp=2 x micro 4 trains on exactly the tokens of dp=1 x micro 8.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from moe_lst.kernels.documents import positions_from_starts

from .format import DataError
from .prepared import Corpus, OffsetIndex, load_prepared

PACKINGS = ("document", "concat")
VAL_SEED_OFFSET = 1_000_003  # validation draws from its own seed stream: a new train seed does not move the eval set
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

    def rows(self, micro: int, dp_rank: int) -> slice:
        """The rows of the global batch that micro batch `micro` of data-parallel rank `dp_rank` holds (global row
        order: micro-step major, then dp rank)."""
        start = (micro * self.dp_size + dp_rank) * self.micro_batch_size
        return slice(start, start + self.micro_batch_size)


def document_marks(documents, offsets: np.ndarray, length: int) -> torch.Tensor:
    """[rows, length] bool: True where the token at that offset of the window starting at `offsets[row]` is the
    first token of a document of `documents` (an OffsetIndex or MegatronDocuments)."""
    marks = np.zeros((len(offsets), length), dtype=bool)
    for row, first in enumerate(np.asarray(offsets).tolist()):
        marks[row, documents.starts_between(first, first + length) - first] = True
    return torch.from_numpy(marks)


def pack_documents(tokens: torch.Tensor, labels: torch.Tensor, marks: torch.Tensor,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packing by document: rows [b, s] of inputs and labels and the document starts of each row's seq_len + 1
    tokens (`marks` [b, s + 1]) -> (inputs, labels with each document's last label ignored, position ids that
    restart at every document)."""
    return tokens, labels.masked_fill(marks[:, 1:], ignore_index), positions_from_starts(marks[:, :-1])


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
        return self._offsets(step)[self.spec.rows(micro, dp_rank)]

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


class DocumentStream(TokenStream):
    """A TokenStream over a prepared split that also knows where its documents start (the split's index), for
    document-aware packing: `document_starts` marks them in the same rows `batch` returns.

    With `packing="document"`, `packed_batch` gives the position ids that restart at every document (the model
    then keeps attention inside each document) and ignores the label of each document's last token (the next
    document's first token is not predicted from it). Rows are the same windows either way: whole documents,
    and the documents cut at a row's two ends.
    """

    def __init__(self, tokens: np.ndarray, documents, spec: BatchSpec, seed: int, vocab_size: int,
                 identity: dict, packing: str = "document") -> None:
        super().__init__(tokens, spec, seed, vocab_size)
        if packing not in PACKINGS:
            raise DataError(f"data.packing={packing!r} must be one of {', '.join(PACKINGS)}")
        # (an array of token offsets, [documents + 1], or an index object with starts_between)
        self.documents = OffsetIndex(documents) if isinstance(documents, np.ndarray) else documents
        self.identity = identity
        self.packing = packing

    @property
    def starts(self) -> np.ndarray:
        return self.documents.starts

    def document_starts(self, step: int, micro: int, dp_rank: int, length: int | None = None) -> torch.Tensor:
        """[micro_batch, length] bool (length: seq_len by default; seq_len + 1 covers the last label too): True
        where the token at that offset of the row of `batch(step, micro, dp_rank)` is the first token of a
        document (its BOS, or the token after the previous document's EOS). A row's first position is True only
        when its window begins exactly at a document; either way the tokens before the row's first True belong
        to one (cut) document."""
        length = self.spec.seq_len if length is None else length
        return document_marks(self.documents, self._row_offsets(step, micro, dp_rank), length)

    def packed_batch(self, step: int, micro: int, dp_rank: int,
                     ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, labels, position ids) [micro_batch, seq_len]; see the class docstring."""
        tokens, labels = self.batch(step, micro, dp_rank)
        if self.packing == "concat":
            return tokens, labels, None
        marks = self.document_starts(step, micro, dp_rank, self.spec.seq_len + 1)
        return pack_documents(tokens, labels, marks, ignore_index)


def tokenizer_identity(path: str, meta: dict) -> dict:
    """What identifies a prepared corpus's ids: its tokenizer (name, kind, path, sha256) and vocabulary."""
    tokenizer = meta["tokenizer"]
    return {"path": str(Path(path).resolve()), "tokenizer": tokenizer["name"], "tokenizer_kind": tokenizer["kind"],
            "tokenizer_path": tokenizer["path"], "tokenizer_sha256": tokenizer["sha256"],
            "vocab_size": meta["vocab_size"]}


def check_vocabulary(path: str, meta: dict, vocab_size: int, key: str = "data.path") -> None:
    if meta["vocab_size"] > vocab_size:
        raise DataError(f"{key}={path!r} was tokenized by {meta['tokenizer']['name']} with a vocabulary of "
                        f"{meta['vocab_size']:,} tokens, more than model.vocab_size={vocab_size}: set "
                        f"model.vocab_size={meta['vocab_size']} (or more)")


def check_long_enough(corpus: Corpus, seq_len: int, what: str) -> None:
    if len(corpus.tokens) < seq_len + 2:
        raise DataError(f"{what} has {len(corpus.tokens):,} tokens, fewer than one sequence of "
                        f"train.seq_len={seq_len} (+ 2): lower train.seq_len, or prepare more documents (or a "
                        "larger --val-fraction)")


def tokenized_streams(path: str, spec: BatchSpec, seed: int, vocab_size: int,
                      packing: str = "document") -> tuple[DocumentStream, ...]:
    """(train, val) DocumentStreams over a prepared corpus, refused in one line when its tokenizer's vocabulary
    does not fit the model. `packing`: document (attention and loss stay inside documents) or concat."""
    if packing not in PACKINGS:
        raise DataError(f"data.packing={packing!r} must be one of {', '.join(PACKINGS)}")
    meta, splits = load_prepared(path)
    check_vocabulary(path, meta, vocab_size)
    identity = tokenizer_identity(path, meta)
    for split, corpus in splits.items():
        check_long_enough(corpus, spec.seq_len, f"data.path={path!r}: its {split} split")
    train, val = splits["train"], splits["val"]
    return (DocumentStream(train.tokens, train.documents, spec, seed, vocab_size, identity, packing),
            DocumentStream(val.tokens, val.documents, spec, seed + VAL_SEED_OFFSET, vocab_size, identity, packing))
