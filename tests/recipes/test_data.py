import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from recipes.data import BatchSpec, DataError, TokenStream, build_streams, check_token_ids, load_bin, stdlib_corpus


def test_stdlib_corpus_splits_and_determinism():
    train, val = stdlib_corpus(max_bytes=2_000_000)
    train2, val2 = stdlib_corpus(max_bytes=2_000_000)
    assert np.array_equal(train, train2) and np.array_equal(val, val2)
    assert len(val) > 0 and len(train) > 10 * len(val) // 2
    assert train.dtype == np.uint8
    assert b"def " in train[:200_000].tobytes()


def test_layout_independence_of_global_batches():
    tokens = np.arange(10_000, dtype=np.uint16) % 500
    one = TokenStream(tokens, BatchSpec(8, 1, 1, 32), seed=7, vocab_size=512)
    two = TokenStream(tokens, BatchSpec(4, 1, 2, 32), seed=7, vocab_size=512)
    accum = TokenStream(tokens, BatchSpec(2, 2, 2, 32), seed=7, vocab_size=512)
    for step in (0, 3):
        x1, y1 = one.batch(step, 0, 0)
        x2 = torch.cat([two.batch(step, 0, r)[0] for r in range(2)])
        xa = torch.cat([accum.batch(step, m, r)[0] for m in range(2) for r in range(2)])
        assert torch.equal(x1, x2) and torch.equal(x1, xa)
        assert torch.equal(y1[:, :-1], x1[:, 1:])  # labels are inputs shifted by one
    assert not torch.equal(one.batch(0, 0, 0)[0], one.batch(1, 0, 0)[0])
    other_seed = TokenStream(tokens, BatchSpec(8, 1, 1, 32), seed=8, vocab_size=512)
    assert not torch.equal(one.batch(0, 0, 0)[0], other_seed.batch(0, 0, 0)[0])


def test_rank_slices_are_disjoint_rows():
    tokens = np.arange(100_000, dtype=np.uint32)
    s = TokenStream(tokens, BatchSpec(3, 1, 2, 16), seed=0, vocab_size=100_000)
    a, b = s.batch(0, 0, 0)[0], s.batch(0, 0, 1)[0]
    assert set(a[:, 0].tolist()).isdisjoint(b[:, 0].tolist())


def test_bin_files(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)
    arr = load_bin(path, "uint16")
    assert arr.shape == (4000,) and int(arr[123]) == 123
    cfg = OmegaConf.create({"kind": "bin", "train_path": str(path), "val_path": str(path), "dtype": "uint16"})
    tr, va = build_streams(cfg, BatchSpec(2, 1, 1, 8), seed=0, vocab_size=5000)
    x, y = tr.batch(0, 0, 0)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    with pytest.raises(DataError, match="does not exist"):
        load_bin(tmp_path / "missing.bin", "uint16")
    with pytest.raises(DataError, match=">= model.vocab_size"):
        build_streams(cfg, BatchSpec(2, 1, 1, 8), seed=0, vocab_size=100)[0].batch(0, 0, 0)
    # One bad id deep in the file is found before training starts, not when a batch draws it.
    bad = np.zeros(100_000, dtype=np.uint16)
    bad[97_531] = 300
    bad.tofile(tmp_path / "bad.bin")
    cfg_bad = OmegaConf.create({"kind": "bin", "train_path": str(tmp_path / "bad.bin"), "val_path": str(path),
                                "dtype": "uint16"})
    with pytest.raises(DataError, match="train_path=.*token id 300 \\(first bad id at position 97531\\)"):
        check_token_ids(load_bin(tmp_path / "bad.bin", "uint16"), 256, "data.train_path='bad.bin'", chunk=4096)
    with pytest.raises(DataError, match="first bad id at position 97531"):
        build_streams(cfg_bad, BatchSpec(2, 1, 1, 8), seed=0, vocab_size=300)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="not a multiple"):
        load_bin(tmp_path / "odd.bin", "uint16")
    with pytest.raises(DataError, match="shorter than one sequence"):
        TokenStream(np.zeros(5, dtype=np.uint8), BatchSpec(1, 1, 1, 8), 0, 256)
