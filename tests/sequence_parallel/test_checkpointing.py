"""Activation checkpointing, with and without offload, gives the gradients of no checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from recipes.models.llama import ModelConfig, Transformer
from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp, checkpoint_module


def _step(model: nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    logits = model(tokens)
    targets = tokens.roll(-1, 1).reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("tiled", [False, True])
def test_checkpointing_gives_identical_gradients(offload, tiled):
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 50, (2, 17))
    ref_loss, ref = _step(model, tokens)
    ckpt = copy.deepcopy(model)
    ckpt.zero_grad(set_to_none=True)
    names = list(ckpt.state_dict())
    apply_activation_checkpointing(ckpt, offload=offload)
    if tiled:
        apply_tiled_mlp(ckpt, tile_size=5)
    assert list(ckpt.state_dict()) == names  # in place: checkpoints keep loading
    assert all(getattr(layer, "_checkpointed", False) for layer in ckpt.layers)
    loss, grads = _step(ckpt, tokens)
    assert loss == ref_loss
    for n in ref:
        if tiled:  # tiling only reorders the sums of weight gradients
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(grads[n], ref[n]), n


def test_checkpoint_recomputation_replays_dropout():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    other = copy.deepcopy(block)
    checkpoint_module(other, offload=True)
    x = torch.randn(4, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)
    block(x1).sum().backward()
    torch.manual_seed(1)
    other(x2).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    for p, q in zip(block.parameters(), other.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_checkpointing_without_grad_runs_plainly_and_bad_predicate_errors():
    block = checkpoint_module(nn.Linear(4, 4))
    with torch.no_grad():
        assert block(torch.randn(2, 4)).shape == (2, 4)
    with pytest.raises(ValueError, match="selected no submodule"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)))
