"""Megatron indexed datasets: one written by the test from the format's documented layout reads back the same tokens
and documents; the library's writer and `prepare_data --format megatron` round-trip through it; a foreign, damaged or
mismatched index is refused in one line naming the file."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from moe_lst.data.format import DataError
from moe_lst.data.megatron import MegatronIndexed, write_megatron
from moe_lst.data.prepared import load_prepared, open_megatron

from tests.data.corpora import bpe, prepare, topics, write_megatron_by_hand


def _documents(seed: int = 0, count: int = 40) -> list[list[np.ndarray]]:
    """Documents of one to three sentences (sequences) of token ids, some ids past 2**16 (int32)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 70_000, size=rng.integers(1, 30)) for _ in range(rng.integers(1, 4))]
            for _ in range(count)]


def test_a_hand_written_megatron_dataset_reads_back(tmp_path):
    docs = _documents()
    write_megatron_by_hand(tmp_path / "corpus", docs)
    data = MegatronIndexed(tmp_path / "corpus")
    assert data.dtype == np.dtype("<i4") and data.documents == len(docs)
    assert data.sequences == sum(len(d) for d in docs)
    flat = [np.concatenate(d) for d in docs]
    for i, want in enumerate(flat):
        assert np.array_equal(data.document(i), want)
    assert np.array_equal(np.asarray(data.tokens), np.concatenate(flat))
    # the document starts of any window: the documents (not the sentences) that begin inside it
    starts = np.concatenate([[0], np.cumsum([len(d) for d in flat])[:-1]])
    for lo, hi in ((0, 1), (0, 50), (17, 300), (int(starts[5]), int(starts[9])), (len(data.tokens) - 3, 10**9)):
        assert data.starts_between(lo, hi).tolist() == [s for s in starts.tolist() if lo <= s < hi]
    # memory-mapped, never loaded whole
    assert all(isinstance(a, np.memmap) for a in (data.tokens, data.sizes, data.pointers, data.doc_idx))


def test_the_writer_round_trips_through_the_documented_layout(tmp_path):
    docs = [np.concatenate(d) % 60_000 for d in _documents(1)]
    write_megatron(tmp_path / "mine", docs, np.uint16)
    write_megatron_by_hand(tmp_path / "theirs", [[d] for d in docs], np.uint16, code=8)
    for ext in (".bin", ".idx"):  # byte for byte what the layout says
        assert (tmp_path / f"mine{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()
    data = MegatronIndexed(tmp_path / "mine")
    assert [data.document(i).tolist() for i in range(data.documents)] == [d.tolist() for d in docs]


def test_prepare_data_writes_megatron_that_reads_as_the_default_layout(tmp_path):
    texts = topics()[:300]
    tokenizer = bpe(tmp_path / "tok.json", texts)
    plain = prepare(tmp_path, "plain", texts, tokenizer)
    megatron = prepare(tmp_path, "megatron", texts, tokenizer, fmt="megatron-indexed")
    meta_a, a = load_prepared(str(plain))
    meta_b, b = load_prepared(str(megatron))
    assert meta_b["format"] == "megatron-indexed" and meta_a["splits"]["train"]["tokens"] == \
        meta_b["splits"]["train"]["tokens"]
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(a[split].tokens), np.asarray(b[split].tokens))
        assert np.array_equal(np.asarray(a[split].starts), b[split].starts)
    # the split is also a plain Megatron prefix that reads alike
    bare = open_megatron(str(megatron / "train_text_document"))
    assert np.array_equal(bare.starts, np.asarray(a["train"].starts))


def _header(path) -> bytes:
    return path.read_bytes()[:34]


@pytest.mark.parametrize("damage,message", [
    ("magic", r"corpus.idx is not a Megatron index"),
    ("version", r"corpus.idx is a Megatron index of version 2; only version 1 is read"),
    ("float", r"corpus.idx declares dtype code 6 \(float64\); token ids need an integer code"),
    ("code", r"corpus.idx declares dtype code 99 \(unknown\)"),
    ("truncated idx", r"corpus.idx has \d+ bytes where its header .* needs \d+: the file is damaged or cut short"),
    ("short bin", r"corpus.bin has \d+ bytes where .*corpus.idx describes \d+"),
    ("no bin", r"corpus.bin does not exist"),
])
def test_bad_indices_are_refused_in_one_line_naming_the_file(tmp_path, damage, message):
    write_megatron_by_hand(tmp_path / "corpus", _documents(2, 5))
    idx, bin_ = tmp_path / "corpus.idx", tmp_path / "corpus.bin"
    raw = bytearray(idx.read_bytes())
    if damage == "magic":
        raw[:3] = b"XYZ"
    elif damage == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif damage in ("float", "code"):
        raw[17] = 6 if damage == "float" else 99
    elif damage == "truncated idx":
        raw = raw[:-8]
    idx.write_bytes(bytes(raw))
    if damage == "short bin":
        bin_.write_bytes(bin_.read_bytes()[:-4])
    elif damage == "no bin":
        bin_.unlink()
    with pytest.raises(DataError, match=message) as e:
        MegatronIndexed(tmp_path / "corpus")
    assert "\n" not in str(e.value)
