"""shard_sequence padding and positions, head layouts, and single-rank behaviour of the SP pieces."""

from __future__ import annotations

import pytest
import torch
from moe_lst.kernels.attention import attention

from sequence_parallel import UlyssesAttention, head_split, shard_sequence, sp_loss


def test_shard_sequence_single_rank_is_identity_with_positions():
    tokens = torch.randint(0, 9, (2, 7))
    labels = torch.randint(0, 9, (2, 7))
    t, lab, pos = shard_sequence(tokens, labels, None)
    assert torch.equal(t, tokens) and torch.equal(lab, labels)
    assert torch.equal(pos, torch.arange(7).expand(2, 7))


def test_sp_loss_single_rank_is_the_mean():
    s = torch.tensor(6.0, requires_grad=True)
    loss = sp_loss(s, torch.tensor(4), None)
    assert loss.item() == 1.5
    loss.backward()
    assert s.grad.item() == 0.25
    assert sp_loss(torch.tensor(0.0), 0, None).item() == 0.0  # no labels: 0, not nan


def test_shard_sequence_errors():
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        shard_sequence(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), None)
    with pytest.raises(ValueError, match="already shifted"):
        shard_sequence(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), None)


@pytest.mark.parametrize("h,hkv,sp", [(8, 8, 2), (8, 2, 4), (6, 6, 4), (6, 2, 4), (8, 2, 3), (3, 3, 2),
                                      (32, 8, 8), (12, 4, 8)])
def test_head_split_keeps_kv_groups_and_balances(h, hkv, sp):
    lay = head_split(h, hkv, sp)
    assert sum(lay.q_counts) == h and sum(lay.kv_counts) == hkv * lay.kv_repeat
    assert max(lay.q_counts) == -(-h // sp)  # as balanced as query heads allow
    group = h // (hkv * lay.kv_repeat)
    for r in range(sp):
        assert lay.q_counts[r] == group * lay.kv_counts[r] and lay.kv_counts[r] >= 1
        # query head i uses original kv head i // (h // hkv); its replica lives on the same rank
        for i in range(lay.q_offsets[r], lay.q_offsets[r + 1]):
            replica = i // group
            assert lay.kv_offsets[r] <= replica < lay.kv_offsets[r + 1]
            assert replica // lay.kv_repeat == i // (h // hkv)
    if hkv % sp == 0:
        assert lay.kv_repeat == 1  # no replication when kv heads already split evenly


def test_head_split_refuses_sp_above_heads_naming_the_fix():
    with pytest.raises(ValueError, match=r"sp=8 cannot exceed the number of query heads \(4\).*sp <= 4"):
        head_split(4, 2, 8)


def test_ulysses_single_rank_is_the_wrapped_function():
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)
    torch.testing.assert_close(UlyssesAttention(None)(q, k, v, causal=True), attention(q, k, v, causal=True))
    with pytest.raises(ValueError, match="already a UlyssesAttention"):
        UlyssesAttention(None, attn_fn=UlyssesAttention(None))
