"""Block-sparse and native sparse attention under Ulysses sp=2 equal sp=1 (plain and with the ALST pieces).

Each rank holds the full sequence for its heads, so a layout applies unchanged; NSA's gates travel to the
head shards with q. One spawn runs every case and returns the errors.
"""

from __future__ import annotations

import pytest

from tests.multirank import run_multirank

SPARSE = {"layout": "bigbird", "block_size": 4, "window_blocks": 2, "global_blocks": 1, "random_blocks": 2}
NSA = {"block_size": 4, "select_blocks": 3, "compress_block": 4, "compress_stride": 2, "window_blocks": 2}


def _records(attention: str) -> dict:
    import torch

    from moe_lst.models.llama import ModelConfig
    from tests.sequence_parallel.sp_model import sp_records

    extra = {"sparse": SPARSE} if attention == "sparse" else {"nsa": NSA}
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      attention=attention, **extra)
    gen = torch.Generator().manual_seed(1)
    s = 37  # 10 blocks of 4, the last ragged; odd, so shard_sequence pads it for sp=2
    tokens = torch.randint(0, 64, (2, s + 1), generator=gen)
    return sp_records(cfg, tokens[:, :-1], tokens[:, 1:], {"mlp_tile": 5, "loss_tile": 7, "offload": False})


def _worker() -> dict:
    return {attention: _records(attention) for attention in ("sparse", "nsa")}


@pytest.fixture(scope="module")
def results():
    return run_multirank(_worker, 2, timeout=240)


@pytest.mark.parametrize("attention", ["sparse", "nsa"])
def test_sparse_attention_sp2_equals_sp1(results, attention):
    from tests.sequence_parallel.sp_model import assert_sp_equivalent

    assert len(results) == 2
    assert_sp_equivalent([r[attention] for r in results], attention)
