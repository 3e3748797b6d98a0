"""Tokenize text corpora into the shards that `data=tokenized` trains on (docs/data.md has the formats).

`python -m recipes.prepare_data --tokenizer PATH --out DIR INPUT...` reads .txt files (one document each), .jsonl
(one per line) and .parquet (one per row), tokenizes them over worker processes and writes DIR/train.bin and val.bin
(token ids, each document followed by the tokenizer's EOS), train.idx and val.idx (where documents start) and
meta.json; with `--format megatron`, Megatron-LM's indexed dataset (DIR/train_text_document.bin / .idx, ...) instead.
The layouts are moe_lst.data.format's, which the readers import too. The same inputs give the same bytes whatever
the number of workers; memory is bounded by the work in flight, not by the corpus; meta.json, written last, is what
makes a preparation complete.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from moe_lst.data.format import (
    FORMAT,
    FORMAT_VERSION,
    FORMATS,
    INDEX_DTYPE,
    MEGATRON_FORMAT,
    META,
    PARTIAL,
    SPLITS,
    index_name,
    megatron_prefix,
    shard_name,
    split_files,
    token_dtype,
)
from moe_lst.data.megatron import MegatronWriter
from tqdm import tqdm

SUFFIXES = (".txt", ".jsonl", ".parquet")
# Files of a Hugging Face tokenizer directory that define its tokenization (the hash covers these, not weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
# Names under which tokenizer.json files commonly hold their end- and start-of-document tokens, when no
# tokenizer_config.json beside them says.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[BOS]")
# Texts per encode call inside a unit: a few hundred KB, so the Python lists of ids stay small.
BATCH_CHARS = 1 << 18


class PrepareError(ValueError):
    """An input, tokenizer or output that cannot be prepared; the message names it and the fix."""


# ---------------------------------------------------------------------------- tokenizers
@dataclass(frozen=True)
class TokenizerSpec:
    """What loads a tokenizer (in this process or a worker): `kind` is tokenizers (a tokenizer.json), transformers
    (a Hugging Face tokenizer directory) or sentencepiece (a .model file)."""

    kind: str
    path: str


class TextTokenizer:
    """The three kinds of tokenizer behind one interface: ids of texts without special tokens, text of ids, the
    vocabulary size, a token's id, and the start / end-of-document tokens the tokenizer declares."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        try:
            if spec.kind == "tokenizers":
                from tokenizers import Tokenizer

                self.impl = Tokenizer.from_file(spec.path)
            elif spec.kind == "transformers":
                from transformers import AutoTokenizer

                self.impl = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
            else:
                import sentencepiece

                self.impl = sentencepiece.SentencePieceProcessor(model_file=spec.path)
        except Exception as e:  # noqa: BLE001 - every loader has its own errors; all mean: not this kind
            what = {"tokenizers": "a tokenizers tokenizer.json", "transformers": "a Hugging Face tokenizer directory",
                    "sentencepiece": "a SentencePiece model"}[spec.kind]
            raise PrepareError(f"--tokenizer {spec.path} cannot be loaded as {what}: {_first_line(e)}") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.spec.kind == "tokenizers":
            return [e.ids for e in self.impl.encode_batch_fast(texts, add_special_tokens=False)]
        if self.spec.kind == "transformers":
            return self.impl(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return self.impl.encode(texts, out_type=int, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        if self.spec.kind == "tokenizers":
            return self.impl.decode(ids, skip_special_tokens=False)
        return self.impl.decode(ids)

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can give."""
        if self.spec.kind == "tokenizers":
            return max(self.impl.get_vocab(with_added_tokens=True).values()) + 1
        if self.spec.kind == "transformers":
            return max(len(self.impl), max(self.impl.get_vocab().values()) + 1)
        return self.impl.get_piece_size()

    def token_id(self, token: str) -> int | None:
        if self.spec.kind == "tokenizers":
            return self.impl.token_to_id(token)
        if self.spec.kind == "transformers":
            found = self.impl.convert_tokens_to_ids(token)
            unknown = found == self.impl.unk_token_id and token != self.impl.unk_token
            return None if found is None or unknown else found
        found = self.impl.piece_to_id(token)
        return None if found == self.impl.unk_id() and token != self.impl.id_to_piece(found) else found

    def declared_specials(self) -> tuple[str | None, str | None]:
        """(BOS, EOS) as the tokenizer declares them (None where it declares none)."""
        if self.spec.kind == "transformers":
            return self.impl.bos_token, self.impl.eos_token
        if self.spec.kind == "sentencepiece":
            ids = self.impl.bos_id(), self.impl.eos_id()
            bos, eos = (self.impl.id_to_piece(i) if i >= 0 else None for i in ids)
            return bos, eos
        return _tokenizer_json_specials(Path(self.spec.path), self.impl)


def _tokenizer_json_specials(path: Path, impl) -> tuple[str | None, str | None]:
    """A tokenizer.json's BOS and EOS: from the tokenizer_config.json beside it, else its special tokens with the
    usual names."""
    config = path.with_name("tokenizer_config.json")
    if config.is_file():
        try:
            values = json.loads(config.read_text())
            names = [values.get(k) for k in ("bos_token", "eos_token")]
            names = [n.get("content") if isinstance(n, dict) else n for n in names]
            if names[1]:
                return names[0], names[1]
        except (OSError, ValueError, AttributeError):
            pass  # not a readable config: fall back to the names
    specials = {t.content for t in impl.get_added_tokens_decoder().values() if t.special}
    bos = next((n for n in BOS_NAMES if n in specials), None)
    return bos, next((n for n in EOS_NAMES if n in specials), None)


def tokenizer_kind(path: Path) -> str:
    """What kind of tokenizer `path` holds: a directory is a Hugging Face one, a JSON file a tokenizer.json,
    anything else is read as a SentencePiece model."""
    if not path.exists():
        raise PrepareError(f"--tokenizer {path}: no such file or directory")
    if path.is_dir():
        return "transformers"
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return "tokenizers" if head.startswith(b"{") else "sentencepiece"


def tokenizer_sha256(spec: TokenizerSpec) -> str:
    """The hash that identifies a tokenizer: its file, or a directory's tokenizer files (names and contents)."""
    digest = hashlib.sha256()
    path = Path(spec.path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.is_file() and (p.name in TOKENIZER_FILES or p.name.startswith("tokenizer")))
        if not files:
            raise PrepareError(f"--tokenizer {path} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
        for p in files:
            digest.update(p.name.encode() + b"\0")
            _hash_file(digest, p)
    else:
        _hash_file(digest, path)
    return digest.hexdigest()


def _hash_file(digest, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)


# ---------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class Job:
    """Everything a worker needs besides its unit: the tokenizer, the document framing, the split rule."""

    tokenizer: TokenizerSpec
    bos_id: int | None  # put before every document (None: nothing)
    eos_id: int  # put after every document
    vocab_size: int
    val_fraction: float
    text_field: str

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)


def resolve_job(tokenizer: str, val_fraction: float, text_field: str, eos: str | None = None,
                bos: bool = True) -> tuple[Job, TextTokenizer, dict]:
    """Load the tokenizer, find its BOS / EOS ids (`eos` names the EOS where the tokenizer declares none) and
    describe it for meta.json; one-line PrepareError for what cannot work."""
    if not 0 < val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction} must be between 0 and 1 (e.g. 0.01: 1 document in 100)")
    spec = TokenizerSpec(tokenizer_kind(Path(tokenizer)), str(Path(tokenizer).resolve()))
    sha256 = tokenizer_sha256(spec)
    tok = TextTokenizer(spec)
    bos_name, eos_name = tok.declared_specials()
    eos_name = eos or eos_name
    if eos_name is None:
        raise PrepareError(f"--tokenizer {tokenizer} declares no end-of-document token: name one of its tokens with "
                           "--eos TOKEN (documents are separated by it)")
    eos_id = tok.token_id(eos_name)
    if eos_id is None:
        raise PrepareError(f"--eos {eos_name!r} is not a token of {tokenizer}")
    bos_id = tok.token_id(bos_name) if bos and bos_name else None
    if bos_id == eos_id:  # one token for both (GPT-2's <|endoftext|>): it separates documents once
        bos_id, bos_name = None, None
    vocab = tok.vocab_size
    job = Job(spec, bos_id, eos_id, vocab, val_fraction, text_field)
    described = {"kind": spec.kind, "path": spec.path, "name": Path(spec.path).name, "sha256": sha256,
                 "vocab_size": vocab, "bos": bos_name if bos_id is not None else None, "bos_id": bos_id,
                 "eos": eos_name, "eos_id": eos_id}
    return job, tok, described


# ---------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Unit:
    """One piece of work: txt files (one document each), a byte range [start, end) of a .jsonl file (the lines
    that start in it), or one row group (`start`) of a .parquet file. `size` is its input bytes (progress)."""

    kind: str
    paths: tuple[str, ...]
    start: int = 0
    end: int = 0
    size: int = 0


def expand_inputs(patterns: list[str]) -> list[Path]:
    """The input files: each argument a file, a directory (its .txt / .jsonl / .parquet files, recursively, hidden
    ones aside) or a glob, in the order given, each directory and glob sorted; a file named twice is read once."""
    files: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise PrepareError(f"input {pattern!r} matches no file")
        elif not Path(pattern).exists():
            raise PrepareError(f"input {pattern!r}: no such file or directory")
        else:
            matches = [pattern]
        for match in matches:
            path = Path(match)
            if path.is_dir():
                found = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                                and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                               key=lambda p: p.relative_to(path).as_posix())
                if not found:
                    raise PrepareError(f"input directory {match!r} holds no {', '.join(SUFFIXES)} file")
            elif path.suffix not in SUFFIXES:
                raise PrepareError(f"input {match!r} is not a {', '.join(SUFFIXES)} file (one document per .txt "
                                   "file, per .jsonl line, per .parquet row)")
            else:
                found = [path]
            for p in found:
                if p.resolve() not in seen:
                    seen.add(p.resolve())
                    files.append(p)
    return files


def plan_units(files: list[Path], chunk_bytes: int, text_field: str) -> list[Unit]:
    """Cut the inputs into units of about `chunk_bytes` (consecutive .txt files together, .jsonl files by byte
    range, .parquet files by row group), checking each .jsonl's first record and each .parquet's schema for
    `text_field` first, so the common mistakes fail before any work."""
    units: list[Unit] = []
    txt: list[Path] = []
    txt_bytes = 0

    def flush_txt() -> None:
        nonlocal txt, txt_bytes
        if txt:
            units.append(Unit("txt", tuple(map(str, txt)), size=txt_bytes))
        txt, txt_bytes = [], 0

    for path in files:
        size = path.stat().st_size
        if path.suffix == ".txt":
            txt.append(path)
            txt_bytes += size
            if txt_bytes >= chunk_bytes:
                flush_txt()
            continue
        flush_txt()
        if path.suffix == ".jsonl":
            _check_jsonl(path, text_field)
            units += [Unit("jsonl", (str(path),), a, min(a + chunk_bytes, size), min(chunk_bytes, size - a))
                      for a in range(0, size, chunk_bytes)]
        else:
            groups = _parquet_row_groups(path, text_field)
            units += [Unit("parquet", (str(path),), i, i + 1, n) for i, n in enumerate(groups)]
    flush_txt()
    if not units:
        raise PrepareError("the inputs hold no document")
    return units


def _check_jsonl(path: Path, text_field: str) -> None:
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                _jsonl_text(line, text_field, path, offset)
                return
            offset += len(line)


def _jsonl_text(line: bytes, text_field: str, path: Path | str, offset: int) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise PrepareError(f"{path} (byte {offset}): not a JSON line ({_first_line(e)})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise PrepareError(f"{path} (byte {offset}): no string field {text_field!r} (it has: {keys}); choose the "
                           "field with --text-field")
    return record[text_field]


def _parquet_row_groups(path: Path, text_field: str) -> list[int]:
    """The uncompressed bytes of each row group of a .parquet file whose `text_field` column holds strings."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        reader = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is not parquet vary
        raise PrepareError(f"{path} cannot be read as parquet: {_first_line(e)}") from None
    schema = reader.schema_arrow
    if text_field not in schema.names:
        raise PrepareError(f"{path} has no column {text_field!r} (it has: {', '.join(schema.names)}); choose the "
                           "column with --text-field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise PrepareError(f"{path}: column {text_field!r} holds {kind}, not strings")
    meta = reader.metadata
    return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]


def unit_texts(unit: Unit, text_field: str) -> Iterator[str]:
    """The documents of a unit, in order."""
    if unit.kind == "txt":
        for path in unit.paths:
            try:
                yield Path(path).read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise PrepareError(f"{path} is not UTF-8 text (byte {e.start})") from None
    elif unit.kind == "jsonl":
        yield from _jsonl_texts(unit.paths[0], unit.start, unit.end, text_field)
    else:
        import pyarrow.parquet as pq

        reader = pq.ParquetFile(unit.paths[0])
        for batch in reader.iter_batches(batch_size=1024, row_groups=[unit.start], columns=[text_field]):
            yield from (text or "" for text in batch.column(0).to_pylist())


def _jsonl_texts(path: str, start: int, end: int, text_field: str) -> Iterator[str]:
    """The records of the lines that start in [start, end): a line belongs to the range its first byte is in."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the rest of the line that started before `start` (or just its newline)
        offset = f.tell()
        while offset < end:
            line = f.readline()
            if not line:
                break
            if line.strip():
                yield _jsonl_text(line, text_field, path, offset)
            offset += len(line)


# ---------------------------------------------------------------------------- tokenizing (workers)
@dataclass
class UnitTokens:
    """A unit's documents, framed and split: per split the token ids and each document's length."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    empty: int  # documents without text (skipped)
    size: int  # input bytes (progress)


def in_val(text: str, val_fraction: float) -> bool:
    """The split rule: a document is held out when a hash of its text falls below val_fraction, so its split
    depends on nothing else (not its position, file or the workers) and repeated documents share one split."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def frame(docs: list[list[int]], job: Job) -> tuple[np.ndarray, np.ndarray]:
    """Documents as one array, [BOS] ids EOS each, and their lengths."""
    extra = 1 + (job.bos_id is not None)
    lengths = np.fromiter((len(ids) + extra for ids in docs), np.int64, count=len(docs))
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]) if len(docs) else 0, job.dtype)
    out[ends - 1] = job.eos_id
    starts = ends - lengths
    if job.bos_id is not None:
        out[starts] = job.bos_id
    for first, ids in zip((starts + (extra - 1)).tolist(), docs):
        out[first:first + len(ids)] = ids
    return out, lengths


def tokenize_unit(unit: Unit, job: Job | None = None, tok: TextTokenizer | None = None) -> UnitTokens:
    """Tokenize one unit (in a worker: with the worker's job and tokenizer)."""
    job, tok = job or _WORKER["job"], tok or _WORKER["tok"]
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s: [] for s in SPLITS}
    empty, batch, chars = 0, [], 0

    def encode() -> None:
        held = [in_val(text, job.val_fraction) for text in batch]
        try:
            ids = tok.encode_batch(batch)
        except Exception as e:  # noqa: BLE001 - a tokenizer's own error (e.g. text it cannot take): name the input
            raise PrepareError(f"{unit.paths[0]}: the tokenizer failed on a document ({_first_line(e)})") from None
        for split, keep in (("train", False), ("val", True)):
            docs = [d for d, h in zip(ids, held) if h == keep]
            if docs:
                parts[split].append(frame(docs, job))

    for text in unit_texts(unit, job.text_field):
        if not text:
            empty += 1
            continue
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            encode()
            batch, chars = [], 0
    if batch:
        encode()
    tokens, lengths = {}, {}
    for split in SPLITS:
        tokens[split] = np.concatenate([t for t, _ in parts[split]]) if parts[split] else np.empty(0, job.dtype)
        lengths[split] = np.concatenate([n for _, n in parts[split]]) if parts[split] else np.empty(0, np.int64)
        if len(tokens[split]) and int(tokens[split].max()) >= job.vocab_size:  # (would have wrapped in the dtype)
            raise PrepareError(f"{unit.paths[0]}: the tokenizer gave id {int(tokens[split].max())} >= its "
                               f"vocabulary size {job.vocab_size}")
    return UnitTokens(tokens, lengths, empty, unit.size)


_WORKER: dict = {}  # this worker's job and tokenizer (a forked worker finds its parent's here)


def _init_worker(job: Job) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the processes are the parallelism
    if _WORKER.get("job") != job:  # (a spawned worker loads the tokenizer itself)
        _WORKER["job"], _WORKER["tok"] = job, TextTokenizer(job.tokenizer)


@contextlib.contextmanager
def _one_thread():
    """Tokenizers' own thread pool off while this process tokenizes, or forks workers that do."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _start_method() -> str:
    """fork where there is one: a worker starts in milliseconds with the tokenizer already loaded (a spawned one
    imports and loads it again, a second or more: most of the work of a small corpus). The workers only read
    files and tokenize, as a DataLoader's forked workers do. Only from a parent that runs one thread and has no
    child processes, as the command line's does: a fork copies another thread's held locks into the child
    (prepare() called inside a threaded program, a test runner with a process pool), where they are never
    released and a worker can hang; such a caller's workers are spawned."""
    lone = threading.active_count() == 1 and not mp.active_children()
    return "fork" if lone and "fork" in mp.get_all_start_methods() else "spawn"


def tokenized_units(units: list[Unit], job: Job, tok: TextTokenizer, workers: int) -> Iterator[UnitTokens]:
    """Every unit's tokens, in unit order: here (workers=1) or over `workers` processes with at most two units
    each in flight, so memory does not grow with the corpus."""
    with _one_thread():
        if workers == 1:
            for unit in units:
                yield tokenize_unit(unit, job, tok)
            return
        _WORKER.update(job=job, tok=tok)
        try:
            with mp.get_context(_start_method()).Pool(workers, initializer=_init_worker, initargs=(job,)) as pool:
                pending: deque = deque()
                todo = iter(units)
                for unit in todo:
                    pending.append(pool.apply_async(tokenize_unit, (unit,)))
                    if len(pending) >= 2 * workers:
                        break
                while pending:
                    done = pending.popleft().get()
                    unit = next(todo, None)
                    if unit is not None:
                        pending.append(pool.apply_async(tokenize_unit, (unit,)))
                    yield done
        finally:
            _WORKER.clear()


# ---------------------------------------------------------------------------- writing
class SplitWriter:
    """Appends one split's tokens and document offsets to its `.partial` files, hashing them as they go."""

    def __init__(self, out: Path, split: str, dtype: np.dtype) -> None:
        self.out, self.split, self.dtype = out, split, dtype
        self.tokens = self.documents = 0
        self.files = {"tokens": out / (shard_name(split) + PARTIAL), "index": out / (index_name(split) + PARTIAL)}
        self.handles = {k: open(p, "wb") for k, p in self.files.items()}
        self.digests = {k: hashlib.sha256() for k in self.files}
        self._write("index", np.zeros(1, INDEX_DTYPE))

    def _write(self, what: str, array: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        self.handles[what].write(data)
        self.digests[what].update(data)

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        self._write("tokens", tokens.astype(self.dtype, copy=False))
        self._write("index", (self.tokens + np.cumsum(lengths)).astype(INDEX_DTYPE))
        self.tokens += len(tokens)
        self.documents += len(lengths)

    def close(self) -> None:
        for handle in self.handles.values():
            if not handle.closed:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()

    def discard(self) -> None:
        for handle in self.handles.values():
            handle.close()
        for path in self.files.values():
            path.unlink(missing_ok=True)

    def describe(self) -> dict:
        return {"file": shard_name(self.split), "index": index_name(self.split), "tokens": self.tokens,
                "documents": self.documents, "sha256": self.digests["tokens"].hexdigest(),
                "index_sha256": self.digests["index"].hexdigest()}

    def publish(self) -> None:
        """Move the finished files to their final names (meta.json, written after, makes them count)."""
        os.replace(self.files["tokens"], self.out / shard_name(self.split))
        os.replace(self.files["index"], self.out / index_name(self.split))


class MegatronSplitWriter:
    """One split written in Megatron-LM's indexed layout (SPLIT_text_document.bin / .idx, one sequence per
    document; moe_lst.data.megatron), with SplitWriter's interface."""

    def __init__(self, out: Path, split: str, dtype: np.dtype) -> None:
        self.split = split
        self.writer = MegatronWriter(out / megatron_prefix(split), dtype)

    @property
    def documents(self) -> int:
        return self.writer.documents

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self.writer.append(tokens, lengths)

    def close(self) -> None:
        self.writer.close()

    def discard(self) -> None:
        self.writer.discard()

    def describe(self) -> dict:
        self.writer.close()
        file, index = split_files(self.split, MEGATRON_FORMAT)
        return {"file": file, "index": index, "tokens": self.writer.tokens, "documents": self.writer.documents,
                "sha256": self.writer.digest.hexdigest(), "index_sha256": self.writer.index_sha256()}

    def publish(self) -> None:
        self.writer.publish()


WRITERS = {FORMAT: SplitWriter, MEGATRON_FORMAT: MegatronSplitWriter}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(out: Path, writers: dict, meta: dict) -> None:
    """Make the preparation complete in an order that no interruption can leave looking complete: the old
    meta.json goes first, then the shards move into place, then the new meta.json (written whole, then renamed)."""
    for writer in writers.values():
        writer.close()
    (out / META).unlink(missing_ok=True)
    _fsync_dir(out)
    for writer in writers.values():
        writer.publish()
    _fsync_dir(out)
    write_meta(out, meta)
    _fsync_dir(out)


def write_meta(out: Path, meta: dict) -> None:
    tmp = out / (META + PARTIAL)
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / META)


def claim_output(out: Path, force: bool, say) -> object:
    """Lock the output directory for this preparation. A complete one is replaced only with --force; the files
    of an interrupted one (no meta.json, or `.partial` files) are said and removed."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".prepare.lock", "a+")
    except OSError as e:
        raise PrepareError(f"--out {out} cannot be written ({e.strerror or e})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise PrepareError(f"--out {out} is being written by another preparation; wait for it or choose another "
                           "--out") from None
    if (out / META).exists() and not force:
        lock.close()
        raise PrepareError(f"--out {out} already holds a prepared corpus ({META}); pass --force to replace it or "
                           "choose another --out")
    names = [n for s in SPLITS for fmt in FORMATS for n in split_files(s, fmt)]
    leftovers = sorted(p.name for p in out.iterdir() if p.name.endswith(PARTIAL)
                       or (p.name in names and not (out / META).exists()))
    if leftovers:
        say(f"{out} holds an interrupted preparation ({', '.join(leftovers)}): replacing it")
        for name in leftovers:
            (out / name).unlink()
    return lock


# ---------------------------------------------------------------------------- the whole preparation
@dataclass
class Prepared:
    """What a preparation wrote (its meta.json) and how fast it went."""

    meta: dict
    seconds: float
    input_bytes: int
    units: int
    workers: int

    @property
    def tokens_per_s(self) -> float:
        return self.meta["tokens"] / max(self.seconds, 1e-9)


def prepare(inputs: list[str], tokenizer: str, out: str | os.PathLike, *, val_fraction: float = 0.01,
            text_field: str = "text", workers: int | None = None, chunk_bytes: int = 4 << 20, force: bool = False,
            progress: bool = True, eos: str | None = None, bos: bool = True, say=print,
            fmt: str = FORMAT) -> Prepared:
    """Tokenize `inputs` with `tokenizer` into `out` (see the module docstring); PrepareError before any work for
    bad arguments, inputs or tokenizer, and for inputs found bad while working (then nothing is left behind)."""
    start = time.perf_counter()
    if chunk_bytes < 1:
        raise PrepareError(f"--chunk-mb gives {chunk_bytes} bytes per unit; it must be > 0")
    if fmt not in WRITERS:
        raise PrepareError(f"--format {fmt!r} is not one of {', '.join(WRITERS)}")
    job, tok, described = resolve_job(tokenizer, val_fraction, text_field, eos, bos)
    files = expand_inputs(inputs)
    units = plan_units(files, chunk_bytes, text_field)
    workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(units)))
    out = Path(out)
    lock = claim_output(out, force, say)
    writers: dict = {}
    try:
        writers.update({s: WRITERS[fmt](out, s, job.dtype) for s in SPLITS})
        total = sum(u.size for u in units)
        empty = 0
        with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress,
                  dynamic_ncols=True) as bar:
            try:
                for done in tokenized_units(units, job, tok, workers):
                    for split in SPLITS:
                        writers[split].append(done.tokens[split], done.lengths[split])
                    empty += done.empty
                    bar.update(done.size)
            except BaseException:
                bar.leave = False  # the error's line replaces the bar's
                raise
        meta = build_meta(job, described, inputs, files, writers, empty, fmt)
        commit(out, writers, meta)
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    finally:
        lock.close()
    return Prepared(meta, time.perf_counter() - start, total, len(units), workers)


def build_meta(job: Job, described: dict, inputs: list[str], files: list[Path], writers: dict,
               empty: int, fmt: str = FORMAT) -> dict:
    """meta.json: the format, the tokenizer (identity and hash), the framing, the split and the counts. Nothing
    in it depends on the run (time, workers, output path), so the same inputs give the same file."""
    splits = {s: w.describe() for s, w in writers.items()}
    for split in SPLITS:
        if not splits[split]["documents"]:
            n = sum(s["documents"] for s in splits.values())
            fix = "raise" if split == "val" else "lower"
            raise PrepareError(f"the {split} split got none of the {n} documents: {fix} --val-fraction "
                               f"{job.val_fraction} or give more documents")
    listing = hashlib.sha256()
    for path in files:
        listing.update(f"{path}\0{path.stat().st_size}\n".encode())
    return {
        "format": fmt, "version": FORMAT_VERSION, "tokenizer": described, "vocab_size": job.vocab_size,
        "dtype": job.dtype.name, "bos_id": job.bos_id, "eos_id": job.eos_id, "index_dtype": INDEX_DTYPE.name,
        "layout": "[BOS] text EOS per document" if job.bos_id is not None else "text EOS per document",
        "split": {"rule": "blake2b-64 of the UTF-8 text / 2**64 < val_fraction", "val_fraction": job.val_fraction},
        "inputs": {"arguments": list(inputs), "files": len(files), "bytes": sum(p.stat().st_size for p in files),
                   "listing_sha256": listing.hexdigest(), "text_field": job.text_field},
        "tokens": sum(s["tokens"] for s in splits.values()),
        "documents": sum(s["documents"] for s in splits.values()), "empty_documents_skipped": empty,
        "splits": splits,
    }


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.prepare_data", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="a .txt / .jsonl / .parquet file, a directory or a glob")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json, a Hugging Face tokenizer directory or a "
                   "SentencePiece .model")
    p.add_argument("--out", required=True, help="the output directory (train.bin, val.bin, *.idx, meta.json)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="documents held out for validation (0.01)")
    p.add_argument("--text-field", default="text", help="the .jsonl field / .parquet column of the text (text)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: the usable cores)")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="input MiB per unit of work (4)")
    p.add_argument("--eos", default=None, help="the end-of-document token, where the tokenizer declares none")
    p.add_argument("--no-bos", action="store_true", help="no BOS before documents, even if the tokenizer has one")
    p.add_argument("--format", default="moe-lst", choices=("moe-lst", "megatron"), help="moe-lst: SPLIT.bin + "
                   "SPLIT.idx (default); megatron: Megatron-LM's indexed dataset, SPLIT_text_document.bin / .idx")
    p.add_argument("--force", action="store_true", help="replace a complete preparation in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.workers is not None and args.workers < 1:
            raise PrepareError(f"--workers {args.workers} must be >= 1")
        done = prepare(args.inputs, args.tokenizer, args.out, val_fraction=args.val_fraction,
                       text_field=args.text_field, workers=args.workers, chunk_bytes=int(args.chunk_mb * 2**20),
                       force=args.force, progress=not args.quiet, eos=args.eos, bos=not args.no_bos,
                       fmt=MEGATRON_FORMAT if args.format == "megatron" else FORMAT)
    except (PrepareError, OSError) as e:  # (an input that cannot be read while working: permissions, a disk error)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"interrupted before the preparation was complete: run the same command again (it replaces what "
              f"was left in {args.out})", file=sys.stderr, flush=True)
        sys.exit(130)
    m = done.meta
    print(f"prepared {m['documents']:,} documents ({m['splits']['train']['documents']:,} train, "
          f"{m['splits']['val']['documents']:,} val), {m['tokens']:,} tokens ({m['dtype']}, vocabulary "
          f"{m['vocab_size']:,}) in {done.seconds:.1f} s ({done.tokens_per_s:,.0f} tokens/s, {done.workers} "
          f"worker(s)) -> {args.out}", flush=True)


if __name__ == "__main__":
    # The importable module's main, not this __main__'s copy: a spawned worker unpickles the tasks and the parent
    # the results by their module's name, which __main__ is not everywhere (run in-process by runpy, or after
    # multiprocessing has bound __mp_main__ to another script); recipes.prepare_data always is.
    from recipes.prepare_data import main as importable_main

    importable_main()
