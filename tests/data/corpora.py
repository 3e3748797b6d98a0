"""Small corpora for the data tests: prepared directories (both layouts) from a byte-level BPE trained on the text
of Python's help topics, and Megatron datasets written from the format's documented layout by hand."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


def topics() -> list[str]:
    import pydoc_data.topics

    return [p for _, t in sorted(pydoc_data.topics.topics.items()) for p in t.split("\n\n") if p.strip()]


def bpe(path: Path, texts: list[str], vocab_size: int = 400) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return str(path)


def prepare(root: Path, name: str, texts: list[str], tokenizer: str, fmt: str = "moe-lst-tokenized") -> Path:
    from recipes import prepare_data

    src = root / f"{name}.jsonl"
    import json

    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = root / name
    prepare_data.prepare([str(src)], tokenizer, out, val_fraction=0.1, workers=1, progress=False,
                         say=lambda *_: None, fmt=fmt)
    return out


def write_megatron_by_hand(prefix: Path, documents: list[list[np.ndarray]], dtype=np.int32, code: int = 4,
                           version: int = 1) -> None:
    """PREFIX.bin / .idx as Megatron-Core's layout documents it, each document a list of sequences (sentences):
    magic, version (uint64), dtype code (uint8), sequence count and document-index count (uint64), then the int32
    sequence lengths, the int64 byte pointers and the int64 document indices."""
    sequences = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    lengths = np.array([len(s) for s in sequences], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64))]) * np.dtype(dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(doc) for doc in documents])]).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(s.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
