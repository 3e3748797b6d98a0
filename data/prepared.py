"""Readers of token corpora on disk: a directory `python -m recipes.prepare_data` wrote (either layout of
moe_lst.data.format) and a bare Megatron dataset prefix, each as a `Corpus` (memory-mapped tokens and a document
index), checked before any training: a damaged or foreign file is refused in one line naming it."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .format import (
    FORMAT,
    FORMAT_VERSION,
    FORMATS,
    INDEX_DTYPE,
    MEGATRON_FORMAT,
    META,
    PARTIAL,
    SPLITS,
    DataError,
    index_name,
    megatron_prefix,
    shard_name,
    split_files,
)
from .megatron import MegatronIndexed, is_megatron_prefix

REDO = "prepare it with python -m recipes.prepare_data --tokenizer TOKENIZER --out {path} INPUT..."


class OffsetIndex:
    """Document starts given as token offsets (`starts`: [documents + 1], the last one the corpus's length), as
    the moe-lst layout's SPLIT.idx holds them (memory-mapped: searched, never loaded whole)."""

    def __init__(self, starts: np.ndarray) -> None:
        self.starts = starts
        self._view = np.asarray(starts).view(np.ndarray)  # (searched by bisect: reads only what it compares)

    @property
    def documents(self) -> int:
        return len(self.starts) - 1

    def starts_between(self, lo: int, hi: int) -> np.ndarray:
        # (not np.searchsorted: uint64 offsets against Python ints would convert the whole index to float64)
        a, b = bisect.bisect_left(self._view, lo), bisect.bisect_left(self._view, hi)
        return np.asarray(self._view[a:b], dtype=np.int64)


class MegatronDocuments:
    """A Megatron dataset's document index behind OffsetIndex's interface."""

    def __init__(self, dataset: MegatronIndexed) -> None:
        self.dataset = dataset

    @property
    def documents(self) -> int:
        return self.dataset.documents

    def starts_between(self, lo: int, hi: int) -> np.ndarray:
        return self.dataset.starts_between(lo, hi)

    @property
    def starts(self) -> np.ndarray:
        """Every document's start, then the end (built whole: for inspection, not for training)."""
        return np.append(self.starts_between(0, len(self.dataset.tokens)), len(self.dataset.tokens))


@dataclass
class Corpus:
    """One split of a corpus: its tokens (a read-only memmap) and where its documents start."""

    tokens: np.ndarray
    documents: OffsetIndex | MegatronDocuments
    where: str = ""  # the file(s), for messages
    extra: dict = field(default_factory=dict)

    @property
    def starts(self) -> np.ndarray:
        return self.documents.starts

    def __iter__(self):  # (tokens, starts), as load_tokenized always gave
        return iter((self.tokens, self.starts))


def load_prepared(path: str, key: str = "data.path") -> tuple[dict, dict[str, Corpus]]:
    """A corpus `python -m recipes.prepare_data` wrote: its meta.json and per split a Corpus, after checking that
    the files are complete and belong together (one-line DataError naming `key`=path and the file)."""
    root = Path(path)
    redo = REDO.format(path=path)
    if not root.is_dir():
        raise DataError(f"{key}={path!r} is not a directory: {redo}")
    if not (root / META).is_file():
        names = {n for s in SPLITS for fmt in FORMATS for n in split_files(s, fmt)}
        if any(p.name in names or p.name.endswith(PARTIAL) for p in root.iterdir()):
            raise DataError(f"{key}={path!r} has no {META}: its preparation did not finish (interrupted?); "
                            f"run it again (it replaces the partial files): {redo}")
        raise DataError(f"{key}={path!r} holds no prepared corpus (no {META}): {redo}")
    try:
        meta = json.loads((root / META).read_text())
        if meta.get("format") not in FORMATS or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a {FORMAT} or {MEGATRON_FORMAT} version {FORMAT_VERSION} meta.json")
        dtype = np.dtype(meta["dtype"])
        if dtype.name not in ("uint16", "uint32"):
            raise ValueError(f"dtype {dtype.name}")
        if meta["format"] == MEGATRON_FORMAT:
            splits = {s: _megatron_split(root, s, meta["splits"][s], dtype) for s in SPLITS}
        else:
            splits = {s: _split_files(root, meta["splits"][s], dtype) for s in SPLITS}
    except DataError as e:
        raise DataError(f"{key}={path!r}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = e.args[0] if isinstance(e, KeyError) else (getattr(e, "strerror", None) or str(e).splitlines()[0])
        raise DataError(f"{key}={path!r}: {META} cannot be used ({what}); {redo}") from None
    return meta, splits


def _split_files(root: Path, split: dict, dtype: np.dtype) -> Corpus:
    """One split's token and index memmaps (moe-lst layout), their sizes checked against meta.json."""
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
    return Corpus(tokens, OffsetIndex(starts), str(root / split["file"]))


def _megatron_split(root: Path, name: str, split: dict, dtype: np.dtype) -> Corpus:
    """One split written in Megatron's layout, checked against meta.json's counts and dtype."""
    corpus = open_megatron(str(root / megatron_prefix(name)))
    if corpus.tokens.dtype.name != dtype.name or len(corpus.tokens) != split["tokens"] \
            or corpus.documents.documents != split["documents"]:
        raise ValueError(f"{megatron_prefix(name)}.bin/.idx hold {len(corpus.tokens)} {corpus.tokens.dtype.name} "
                         f"tokens in {corpus.documents.documents} documents where {META} records {split['tokens']} "
                         f"{dtype.name} in {split['documents']}: the files are not of one preparation")
    return corpus


def open_megatron(prefix: str) -> Corpus:
    dataset = MegatronIndexed(prefix)
    return Corpus(dataset.tokens, MegatronDocuments(dataset), f"{prefix}.bin")


def describe_source(path: str, key: str = "data.path") -> str:
    """What kind of corpus `path` is: "prepared" (a directory with meta.json), "megatron" (a PREFIX of PREFIX.bin
    and PREFIX.idx) or a DataError naming both forms."""
    if Path(path).is_dir() and (Path(path) / META).is_file():
        return "prepared"
    if is_megatron_prefix(path):
        return "megatron"
    if Path(path).is_dir():
        load_prepared(path, key)  # (its own message: an unfinished preparation, or no corpus)
    if Path(f"{path}.bin").exists() != Path(f"{path}.idx").exists():
        there, missing = (".bin", ".idx") if Path(f"{path}.bin").exists() else (".idx", ".bin")
        raise DataError(f"{path}{there} has no {path}{missing} beside it: a Megatron dataset is PREFIX.bin + "
                        "PREFIX.idx")
    raise DataError(f"{path!r} is neither a prepared directory (with {META}) nor a Megatron dataset prefix "
                    f"(PREFIX.bin + PREFIX.idx): {REDO.format(path=path)}")


__all__ = ["Corpus", "OffsetIndex", "MegatronDocuments", "load_prepared", "open_megatron", "describe_source",
           "shard_name", "index_name"]
