"""UlyssesAttention's input checks and `local_attention`, which takes the Ulysses wrappers out for a while."""

from __future__ import annotations

import pytest
import torch

from moe_lst.models.llama import ModelConfig, Transformer
from sequence_parallel import UlyssesAttention, apply_ulysses, local_attention


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32))


def _attn_fns(model: Transformer) -> dict[str, object]:
    return {site.name: site.get() for site in model.attention_sites()}


def _wrapped() -> Transformer:
    """Every attention site wrapped in a one-rank UlyssesAttention (apply_ulysses leaves sp=1 alone)."""
    model = _model()
    assert apply_ulysses(model, None) is model and not any(isinstance(f, UlyssesAttention)
                                                           for f in _attn_fns(model).values())
    for site in model.attention_sites():
        site.set(UlyssesAttention(None, attn_fn=site.get()))
    return model


def test_local_attention_unwraps_inside_and_restores_the_same_wrappers():
    model = _wrapped()
    wrappers = _attn_fns(model)
    assert len(wrappers) == 2 and all(isinstance(f, UlyssesAttention) for f in wrappers.values())
    modules, keys = [n for n, _ in model.named_modules()], list(model.state_dict())
    tokens = torch.randint(0, 30, (1, 9))
    with torch.no_grad():
        wrapped_out = model(tokens)
        with local_attention(model) as inside:
            assert inside is model
            assert _attn_fns(model) == {n: w.attn_fn for n, w in wrappers.items()}
            assert not any(isinstance(m, UlyssesAttention) for m in model.modules())
            torch.testing.assert_close(model(tokens), wrapped_out, rtol=0, atol=0)  # sp=1: same attention
    assert all(f is wrappers[n] for n, f in _attn_fns(model).items())
    assert [n for n, _ in model.named_modules()] == modules and list(model.state_dict()) == keys


def test_local_attention_restores_after_an_exception_and_ignores_plain_models():
    model = _wrapped()
    wrappers = _attn_fns(model)
    with pytest.raises(RuntimeError, match="boom"):
        with local_attention(model):
            assert not any(isinstance(f, UlyssesAttention) for f in _attn_fns(model).values())
            raise RuntimeError("boom")
    assert all(f is wrappers[n] for n, f in _attn_fns(model).items())
    plain = _model()
    before = _attn_fns(plain)
    with local_attention(plain):
        assert _attn_fns(plain) == before
    assert _attn_fns(plain) == before


def test_ulysses_rejects_inputs_that_cannot_be_packed_together():
    attn = UlyssesAttention(None)
    q = torch.randn(2, 5, 4, 8)
    with pytest.raises(ValueError, match=r"UlyssesAttention expects \[batch, local sequence, heads, head_dim\]"):
        attn(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="must agree in batch, local sequence length and head_dim"):
        attn(q, torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8))
    with pytest.raises(ValueError, match=r"dtypes differ \(torch.float32, torch.float64, torch.float64\)"):
        attn(q, torch.randn(2, 5, 2, 8, dtype=torch.float64), torch.randn(2, 5, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of kv heads \(3\)"):
        attn(q, torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8))
    with pytest.raises(ValueError, match="must have the same shape"):
        attn(q, torch.randn(2, 5, 2, 8), torch.randn(2, 5, 1, 8))
