"""Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx), read memory-mapped and written, without Megatron.

The layout, as Megatron-Core's `indexed_dataset.py` documents and writes it (all little-endian):

    PREFIX.idx  9 bytes   magic b"MMIDIDX\\x00\\x00"
                8 bytes   version, uint64 (1)
                1 byte    dtype code of the tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                          7 float32, 8 uint16)
                8 bytes   S, the number of sequences, uint64
                8 bytes   D, the number of document indices, uint64 (documents + 1)
                S int32   sequence lengths, in tokens
                S int64   sequence pointers: byte offset of each sequence in PREFIX.bin
                D int64   document indices: the sequence each document starts at, then S
                (S int8   sequence modes, only in multimodal datasets: ignored here)
    PREFIX.bin  the sequences' tokens back to back

A document is the sequences from one document index to the next (one sequence per document unless the text was
split into sentences). Nothing is loaded whole: the arrays are views of one memory map, and the document starts of a
window are found by binary search (a few pages touched), so a corpus of billions of tokens costs what is read.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from .format import PARTIAL, DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
TOKEN_CODES = (1, 2, 3, 4, 5, 8)  # the integer ones: token ids
CODE_OF = {np.dtype(t).name: c for c, t in DTYPE_CODES.items()}


def is_megatron_prefix(path: str | os.PathLike) -> bool:
    """Whether PATH.idx and PATH.bin exist (PATH is a Megatron dataset's prefix, not a directory)."""
    return Path(f"{path}.idx").is_file() and Path(f"{path}.bin").is_file()


class MegatronIndexed:
    """A Megatron indexed dataset, memory-mapped: `tokens` (every sequence back to back, the .bin), and the
    document index (`documents`, `starts_between`). Refused in one line (DataError naming the file) when the
    index is of another version, dtype or size, or does not describe the .bin."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for file in (idx, bin_):
            if not file.is_file():
                raise DataError(f"{file} does not exist: a Megatron dataset is PREFIX.bin + PREFIX.idx (give PREFIX)")
        size = idx.stat().st_size
        with open(idx, "rb") as f:
            head = f.read(HEADER.size)
        if len(head) < HEADER.size or head[:9] != MAGIC:
            raise DataError(f"{idx} is not a Megatron index (its first bytes are not {MAGIC!r}): rewrite it with "
                            "Megatron's preprocess_data or python -m recipes.prepare_data --format megatron")
        _, version, code, sequences, doc_count = HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{idx} is a Megatron index of version {version}; only version {VERSION} is read")
        if code not in DTYPE_CODES or code not in TOKEN_CODES:
            what = np.dtype(DTYPE_CODES[code]).name if code in DTYPE_CODES else "unknown"
            raise DataError(f"{idx} declares dtype code {code} ({what}); token ids need an integer code "
                            f"({', '.join(f'{c} {np.dtype(DTYPE_CODES[c]).name}' for c in TOKEN_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        if not sequences:
            raise DataError(f"{idx} holds no sequence: an empty dataset cannot be trained on")
        plain = HEADER.size + sequences * (4 + 8) + doc_count * 8
        if size not in (plain, plain + sequences) or doc_count < 2:
            raise DataError(f"{idx} has {size} bytes where its header ({sequences} sequences, {doc_count} document "
                            f"indices) needs {plain}: the file is damaged or cut short")
        self.sizes = np.memmap(idx, np.dtype("<i4"), "r", HEADER.size, (sequences,))
        self.pointers = np.memmap(idx, np.dtype("<i8"), "r", HEADER.size + 4 * sequences, (sequences,))
        self.doc_idx = np.memmap(idx, np.dtype("<i8"), "r", HEADER.size + 12 * sequences, (doc_count,))
        need = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
        if bin_.stat().st_size != need or int(self.pointers[0]) != 0:
            raise DataError(f"{bin_} has {bin_.stat().st_size} bytes where {idx} describes {need}: the two files "
                            "are not of one dataset (or one is damaged)")
        if int(self.doc_idx[0]) != 0 or int(self.doc_idx[-1]) != sequences:
            raise DataError(f"{idx}: its document indices run from {int(self.doc_idx[0])} to "
                            f"{int(self.doc_idx[-1])}, not 0 to its {sequences} sequences: the file is damaged")
        self.tokens = np.memmap(bin_, self.dtype, "r")
        self.sequences = sequences
        # Plain views to search: the arrays sit at offsets that are not multiples of 8 (the header is 34 bytes), and
        # numpy's searchsorted copies an unaligned array whole; bisect reads only the entries it compares.
        self._pointers, self._doc_idx = self.pointers.view(np.ndarray), self.doc_idx.view(np.ndarray)

    @property
    def documents(self) -> int:
        return len(self.doc_idx) - 1

    def document(self, i: int) -> np.ndarray:
        """The tokens of document `i` (all its sequences)."""
        first, end = int(self.doc_idx[i]), int(self.doc_idx[i + 1])
        lo = int(self.pointers[first]) // self.dtype.itemsize
        hi = len(self.tokens) if end == self.sequences else int(self.pointers[end]) // self.dtype.itemsize
        return self.tokens[lo:hi]

    def starts_between(self, lo: int, hi: int) -> np.ndarray:
        """Token offsets in [lo, hi) at which a document starts (binary searches of the memory-mapped index)."""
        item = self.dtype.itemsize
        pointers, doc_idx = self._pointers, self._doc_idx
        a, b = bisect.bisect_left(pointers, lo * item), bisect.bisect_left(pointers, hi * item)  # sequences in it
        d0, d1 = bisect.bisect_left(doc_idx, a), bisect.bisect_left(doc_idx, b)  # documents starting with one
        firsts = np.asarray(doc_idx[d0:d1], dtype=np.int64)
        return np.asarray(pointers[firsts], dtype=np.int64) // item


class MegatronWriter:
    """Writes PREFIX.bin and PREFIX.idx (one sequence per document) as `.partial` files while documents come in,
    holding none of them in memory (the lengths and pointers go to files of their own until the index is put
    together at close); `publish` moves them to their names."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype) -> None:
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        if self.dtype.name not in CODE_OF:
            raise DataError(f"dtype {self.dtype.name} has no Megatron dtype code")
        self.tokens = self.documents = 0
        self.paths = {k: Path(f"{prefix}.{k}{PARTIAL}") for k in ("bin", "idx", "sizes", "pointers")}
        self.handles = {k: open(p, "wb") for k, p in self.paths.items() if k != "idx"}
        self.digest = hashlib.sha256()

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given back to back (`tokens`) with their lengths."""
        if not len(lengths):
            return
        data = memoryview(np.ascontiguousarray(tokens.astype(self.dtype.newbyteorder("<"), copy=False))).cast("B")
        self.handles["bin"].write(data)
        self.digest.update(data)
        ends = np.cumsum(lengths, dtype=np.int64)
        starts = self.tokens + ends - np.asarray(lengths, dtype=np.int64)
        self.handles["sizes"].write(np.asarray(lengths, dtype="<i4").tobytes())
        self.handles["pointers"].write((starts * self.dtype.itemsize).astype("<i8").tobytes())
        self.tokens += int(ends[-1])
        self.documents += len(lengths)

    def close(self) -> None:
        """Finish the .bin and put the .idx together (header, lengths, pointers, document indices)."""
        for handle in self.handles.values():
            if not handle.closed:
                handle.close()
        if self.paths["idx"].exists() or not self.paths["sizes"].exists():
            return
        with open(self.paths["idx"], "wb") as out:
            out.write(HEADER.pack(MAGIC, VERSION, CODE_OF[self.dtype.name], self.documents, self.documents + 1))
            for part in ("sizes", "pointers"):
                with open(self.paths[part], "rb") as f:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)
                self.paths[part].unlink()
            for first in range(0, self.documents + 1, 1 << 20):
                out.write(np.arange(first, min(first + (1 << 20), self.documents + 1), dtype="<i8").tobytes())
            out.flush()
            os.fsync(out.fileno())

    def index_sha256(self) -> str:
        digest = hashlib.sha256()
        with open(self.paths["idx"] if self.paths["idx"].exists() else f"{self.prefix}.idx", "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()

    def discard(self) -> None:
        for handle in self.handles.values():
            handle.close()
        for path in self.paths.values():
            path.unlink(missing_ok=True)

    def publish(self) -> None:
        os.replace(self.paths["bin"], f"{self.prefix}.bin")
        os.replace(self.paths["idx"], f"{self.prefix}.idx")


def write_megatron(prefix: str | os.PathLike, documents: list[np.ndarray], dtype=np.uint16) -> None:
    """PREFIX.bin / PREFIX.idx holding `documents` (one sequence each): the writer in one call."""
    writer = MegatronWriter(prefix, np.dtype(dtype))
    try:
        lengths = np.array([len(d) for d in documents], dtype=np.int64)
        writer.append(np.concatenate(documents) if documents else np.empty(0, dtype), lengths)
        writer.close()
        writer.publish()
    except BaseException:
        writer.discard()
        raise
