"""Weighted mixtures of corpora: each global batch's composition is a function of (seed, step, global batch size)
alone, so a run resumed under another data-parallel, sequence-parallel or world size continues the same samples.

How rows are dealt. The first n rows of the run go to the sources by a chain of splits: source 1 gets
floor(n * f1 + phase1) - floor(phase1) of them, source 2 the same share f2 = w2 / (w2 + ... + wK) of the rest, and
so on; each count grows by 0 or 1 per row, so every source's count after any number of rows is within K rows of
its weight's share, and the count before step t (n = t x global batch) is known in O(K), with nothing replayed.
Within a step the rows are shuffled by (seed, step). A source's j-th row is the window of seq_len + 1 tokens at
k x seq_len for k the (j mod windows)-th entry of a permutation of its windows drawn for its epoch j // windows
(a Feistel network: no table, O(1) memory whatever the corpus). A source past its limit stops the stream with a
one-line DataError; `exhaustion` says before training which sources a run would read past their limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .format import DataError
from .prepared import Corpus, describe_source, load_prepared, open_megatron
from .streams import (
    PACKINGS,
    VAL_SEED_OFFSET,
    BatchSpec,
    DocumentStream,
    check_long_enough,
    check_vocabulary,
    document_marks,
    pack_documents,
    tokenizer_identity,
)

ON_EXHAUSTED = ("stop", "repeat")


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (array arithmetic wraps without a warning)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """The images of `indices` (< n) under a pseudo-random permutation of range(n) chosen by `key`: a 4-round
    Feistel network on the smallest even number of bits that holds n, cycle-walked back into range(n)."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = _mix(np.arange(4, dtype=np.uint64) + _mix(np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)))
    out = np.asarray(indices, dtype=np.uint64).copy()
    todo = np.ones(len(out), dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        out[todo] = (left << np.uint64(half)) | right
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


class Schedule:
    """How many of the run's first n rows each source gets (see the module docstring)."""

    def __init__(self, weights: list[float], seed: int) -> None:
        total = float(sum(weights))
        rest = np.cumsum(np.asarray(weights, dtype=np.float64)[::-1])[::-1]  # w_k + ... + w_K
        self.shares = [w / r for w, r in zip(weights, rest)]
        self.weights = [w / total for w in weights]
        self.phases = np.random.Generator(np.random.PCG64([seed, 0x6D6978])).random(len(weights)).tolist()

    def cumulative(self, rows: int) -> np.ndarray:
        out, rest = [], rows
        for share, phase in zip(self.shares[:-1], self.phases):
            count = math.floor(rest * share + phase) - math.floor(phase)
            out.append(count)
            rest -= count
        return np.array(out + [rest], dtype=np.int64)


@dataclass
class Source:
    """One source of a mixture: its corpus (train or validation), weight, limit and what identifies its ids."""

    name: str
    path: str
    weight: float
    corpus: Corpus
    max_epochs: float | None = None
    identity: dict | None = None  # tokenizer of a prepared source (None: a bare Megatron prefix)

    def windows(self, seq_len: int) -> int:
        return (len(self.corpus.tokens) - 1) // seq_len


class MixtureStream:
    """Global batches drawn from several sources by weight (the TokenStream interface: batch, packed_batch,
    document_starts). `on_exhausted`: stop (a source read once through ends the stream) or repeat (another
    epoch, in a new order, up to the source's max_epochs)."""

    def __init__(self, sources: list[Source], spec: BatchSpec, seed: int, vocab_size: int,
                 on_exhausted: str = "stop", packing: str = "document", identity: dict | None = None) -> None:
        if on_exhausted not in ON_EXHAUSTED:
            raise DataError(f"data.on_exhausted={on_exhausted!r} must be one of {', '.join(ON_EXHAUSTED)}")
        if packing not in PACKINGS:
            raise DataError(f"data.packing={packing!r} must be one of {', '.join(PACKINGS)}")
        self.sources, self.spec, self.seed, self.vocab_size = sources, spec, seed, vocab_size
        self.on_exhausted, self.packing, self.identity = on_exhausted, packing, identity
        self.schedule = Schedule([s.weight for s in sources], seed)
        self.windows = [s.windows(spec.seq_len) for s in sources]
        self._planned: tuple[int, np.ndarray, np.ndarray] | None = None

    def limit(self, k: int) -> float:
        """How many rows source k may give (math.inf: no limit)."""
        if self.on_exhausted == "stop":
            return self.windows[k]
        epochs = self.sources[k].max_epochs
        return math.inf if epochs is None else math.floor(epochs * self.windows[k])

    def rows_before(self, step: int) -> np.ndarray:
        """Rows each source gave to steps 0 .. step - 1."""
        return self.schedule.cumulative(step * self.spec.global_batch)

    def tokens_seen(self, steps: int) -> dict[str, int]:
        """Input tokens each source gave to the first `steps` steps."""
        return {s.name: int(n) * self.spec.seq_len for s, n in zip(self.sources, self.rows_before(steps))}

    def exhaustion(self, steps: int) -> list[tuple[int, float, float]]:
        """(source, epochs read, epochs allowed) for each source that `steps` steps read more than once through
        (allowed: inf without a limit)."""
        rows = self.rows_before(steps)
        out = []
        for k, n in enumerate(rows.tolist()):
            epochs = n / self.windows[k]
            if epochs > 1:
                out.append((k, epochs, self.limit(k) / self.windows[k]))
        return out

    def plan(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window start) of every row of step `step`'s global batch, in global row order."""
        if self._planned is not None and self._planned[0] == step:
            return self._planned[1], self._planned[2]
        before, after = self.rows_before(step), self.rows_before(step + 1)
        counts = after - before
        source = np.repeat(np.arange(len(self.sources)), counts)
        nth = np.concatenate([b + np.arange(c, dtype=np.int64) for b, c in zip(before.tolist(), counts.tolist())])
        order = np.random.Generator(np.random.PCG64([self.seed, step])).permutation(len(source))
        source, nth = source[order], nth[order]
        offsets = np.empty(len(nth), dtype=np.int64)
        for k in np.unique(source).tolist():
            rows = source == k
            offsets[rows] = self._offsets(k, nth[rows], step)
        self._planned = (step, source, offsets)
        return source, offsets

    def _offsets(self, k: int, nth: np.ndarray, step: int) -> np.ndarray:
        last = int(nth.max())
        if last >= self.limit(k):
            s = self.sources[k]
            rule = ("data.on_exhausted=stop reads each source once" if self.on_exhausted == "stop"
                    else f"its max_epochs={s.max_epochs}")
            raise DataError(f"data source {s.name} ({s.path}) is exhausted at step {step + 1}: its "
                            f"{self.windows[k]:,} sequences of {self.spec.seq_len} tokens are used up ({rule}); "
                            "lower its weight or train.steps, or allow more epochs (data.on_exhausted=repeat, "
                            "max_epochs)")
        n = self.windows[k]
        out = np.empty(len(nth), dtype=np.int64)
        epochs = nth // n
        for epoch in np.unique(epochs).tolist():
            mine = epochs == epoch
            key = (self.seed * 0x9E3779B97F4A7C15 + k * 0xC2B2AE3D27D4EB4F + epoch) & 0xFFFFFFFFFFFFFFFF
            out[mine] = permute(nth[mine] % n, n, key) * self.spec.seq_len
        return out

    def _rows(self, step: int, micro: int, dp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        source, offsets = self.plan(step)
        rows = self.spec.rows(micro, dp_rank)
        return source[rows], offsets[rows]

    def batch(self, step: int, micro: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.spec.seq_len + 1
        source, offsets = self._rows(step, micro, dp_rank)
        rows = np.stack([np.asarray(self.sources[k].corpus.tokens[o:o + length], dtype=np.int64)
                         for k, o in zip(source.tolist(), offsets.tolist())])
        if int(rows.max()) >= self.vocab_size:
            k = int(source[int(np.argmax(rows.max(axis=1)))])
            raise DataError(f"token id {int(rows.max())} of data source {self.sources[k].name} "
                            f"({self.sources[k].path}) is >= model.vocab_size={self.vocab_size}")
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def document_starts(self, step: int, micro: int, dp_rank: int, length: int | None = None) -> torch.Tensor:
        length = self.spec.seq_len if length is None else length
        source, offsets = self._rows(step, micro, dp_rank)
        marks = torch.zeros(len(source), length, dtype=torch.bool)
        for k in np.unique(source).tolist():
            rows = source == k
            marks[torch.from_numpy(rows)] = document_marks(self.sources[k].corpus.documents, offsets[rows], length)
        return marks

    def packed_batch(self, step: int, micro: int, dp_rank: int,
                     ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs, labels, position ids): packing by document across the mixture (each row's documents are its
        own source's), or by concatenation (position ids None)."""
        tokens, labels = self.batch(step, micro, dp_rank)
        if self.packing == "concat":
            return tokens, labels, None
        return pack_documents(tokens, labels, self.document_starts(step, micro, dp_rank, self.spec.seq_len + 1),
                              ignore_index)


# ---------------------------------------------------------------------------- from a config
def _item(cfg, key: str, default=None):
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def check_mixture_config(data_cfg) -> None:
    """The rules of a `data=mixture` config that need no file: at least one source, each with a path and a
    positive weight (and a positive max_epochs when given), distinct names, a known on_exhausted."""
    sources = list(_item(data_cfg, "sources") or [])
    if not sources:
        raise DataError("data.sources is empty: give the mixture's sources, e.g. data.sources='[{path: data/web, "
                        "weight: 0.7}, {path: data/code, weight: 0.3}]'")
    for i, s in enumerate(sources):
        path, weight, epochs = _item(s, "path"), _item(s, "weight", 1.0), _item(s, "max_epochs")
        if not path or not isinstance(path, str):
            raise DataError(f"data.sources[{i}].path={path!r} must name a prepared directory or a Megatron prefix")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 \
                or not math.isfinite(weight):
            raise DataError(f"data.sources[{i}].weight={weight!r} ({path}) must be a number > 0 (weights are "
                            "relative: 0.7 and 0.3, or 7 and 3)")
        if epochs is not None and not (isinstance(epochs, (int, float)) and epochs > 0):
            raise DataError(f"data.sources[{i}].max_epochs={epochs!r} ({path}) must be > 0 or null (no limit)")
    names = [source_name(s) for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataError(f"data.sources: two sources are named {twice[0]}: give each a distinct name (name: ...)")
    on_exhausted = _item(data_cfg, "on_exhausted", "stop")
    if on_exhausted not in ON_EXHAUSTED:
        raise DataError(f"data.on_exhausted={on_exhausted!r} must be stop (the run ends when a source is used up) "
                        "or repeat (another epoch, up to each source's max_epochs)")


def source_name(cfg) -> str:
    path = str(_item(cfg, "path")).rstrip("/")
    return _item(cfg, "name") or path.rpartition("/")[2] or path


def open_source(i: int, cfg, split: str) -> tuple[Corpus | None, dict | None]:
    """Source i's corpus of `split` (None: a bare Megatron prefix has no validation split unless val_path names
    one) and its prepared meta.json (None for a bare prefix)."""
    path, key = _item(cfg, "path"), f"data.sources[{i}].path"
    if describe_source(path, key) == "prepared":
        meta, splits = load_prepared(path, key)
        return splits[split], meta
    if split == "train":
        return open_megatron(path), None
    val = _item(cfg, "val_path")
    if val is None:
        return None, None
    if describe_source(val, f"data.sources[{i}].val_path") != "megatron":
        raise DataError(f"data.sources[{i}].val_path={val!r} is not a Megatron prefix (PREFIX.bin + PREFIX.idx)")
    return open_megatron(val), None


def _check_same_ids(sources: list[Source], metas: list[dict | None]) -> dict | None:
    """Every prepared source tokenized alike (tokenizer hash and vocabulary); the first one's identity."""
    first = None
    for s, meta in zip(sources, metas):
        if meta is None:
            continue
        if first is None:
            first = (s, meta)
            continue
        f, fm = first
        if meta["tokenizer"]["sha256"] != fm["tokenizer"]["sha256"] or meta["vocab_size"] != fm["vocab_size"]:
            raise DataError(f"data source {s.name} ({s.path}) was tokenized by {meta['tokenizer']['name']} "
                            f"(vocabulary {meta['vocab_size']:,}, sha256 {meta['tokenizer']['sha256'][:12]}) but "
                            f"{f.name} ({f.path}) by {fm['tokenizer']['name']} (vocabulary {fm['vocab_size']:,}, "
                            f"sha256 {fm['tokenizer']['sha256'][:12]}): prepare every source with one tokenizer")
    return None if first is None else tokenizer_identity(first[0].path, first[1])


def mixture_sources(data_cfg, split: str, seq_len: int, vocab_size: int) -> tuple[list[Source], dict | None]:
    """The sources of a `data=mixture` config for `split`, opened and checked (one-line DataError); sources
    without that split are left out."""
    check_mixture_config(data_cfg)
    sources, metas = [], []
    for i, cfg in enumerate(data_cfg["sources"] if hasattr(data_cfg, "__getitem__") else data_cfg.sources):
        corpus, meta = open_source(i, cfg, split)
        if corpus is None:
            continue
        name, path = source_name(cfg), _item(cfg, "path")
        if meta is not None:
            check_vocabulary(path, meta, vocab_size, f"data.sources[{i}].path")
        check_long_enough(corpus, seq_len, f"data source {name} ({corpus.where})")
        sources.append(Source(name, path, float(_item(cfg, "weight", 1.0)), corpus, _item(cfg, "max_epochs"),
                              None if meta is None else tokenizer_identity(path, meta)))
        metas.append(meta)
    return sources, _check_same_ids(sources, metas)


def mixture_streams(data_cfg, spec: BatchSpec, seed: int, vocab_size: int):
    """(train, val) for `data=mixture`: the train mixture, and the validation mixture of the sources that have a
    validation split (the same weights; it repeats freely, since evaluation draws the same batches each time),
    None when none has one."""
    packing = _item(data_cfg, "packing", "document")
    train, identity = mixture_sources(data_cfg, "train", spec.seq_len, vocab_size)
    train_stream = MixtureStream(train, spec, seed, vocab_size, _item(data_cfg, "on_exhausted", "stop"), packing,
                                 identity)
    val, _ = mixture_sources(data_cfg, "val", spec.seq_len, vocab_size)
    val_stream = MixtureStream(val, spec, seed + VAL_SEED_OFFSET, vocab_size, "repeat", packing, identity) \
        if val else None
    return train_stream, val_stream


def per_source_streams(val: MixtureStream) -> dict[str, DocumentStream]:
    """One validation stream per source of a validation mixture (random windows of that source alone)."""
    return {s.name: DocumentStream(s.corpus.tokens, s.corpus.documents, val.spec, val.seed, val.vocab_size,
                                   s.identity or {}, val.packing) for s in val.sources}
