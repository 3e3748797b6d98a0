"""Activation checkpointing, with and without offload, gives the gradients of no checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from moe_lst.models.llama import ModelConfig, Transformer
from sequence_parallel import (
    ActivationOffload,
    apply_activation_checkpointing,
    apply_tiled_mlp,
    checkpoint_module,
    is_checkpointed,
)
from zero.contract import ContractError


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
    stats = ActivationOffload()
    apply_activation_checkpointing(ckpt, offload=stats if offload else False)
    if tiled:
        apply_tiled_mlp(ckpt, tile_size=5)
    assert list(ckpt.state_dict()) == names  # in place: checkpoints keep loading
    assert all(is_checkpointed(layer) for layer in ckpt.layers)
    assert sum(is_checkpointed(m) for m in ckpt.modules()) == len(ckpt.layers)
    loss, grads = _step(ckpt, tokens)
    assert loss == ref_loss
    # Per step, each block's input h [2, 17, dim] (float32) goes to host memory and back; RoPE tables stay.
    moved = (cfg.n_layers, cfg.n_layers * tokens.numel() * cfg.dim * 4) if offload else (0, 0)
    assert (stats.packed_tensors, stats.packed_bytes) == moved
    assert (stats.restored_tensors, stats.restored_bytes) == moved
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
    with pytest.raises(ContractError, match=r"needs Sequential.blocks\(\) of the model contract"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="the predicate selected nothing"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), predicate=lambda name, module: False)


class _Block(nn.Module):
    """A layer taking an activation and a constant table, as a transformer block takes h and RoPE."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h) + table)


class _Model(nn.ModuleDict):
    """Its blocks (the model contract's `blocks`) are the items of `layers`."""

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}", block) for i, block in enumerate(self["layers"])]


@pytest.mark.parametrize("offload", [None, "object", "true"])
def test_offload_packs_each_block_input_once_and_restores_it_in_backward(offload):
    torch.manual_seed(0)
    dim, n_blocks = 8, 3
    ref = _Model({"embed": nn.Linear(4, dim), "layers": nn.ModuleList(_Block(dim) for _ in range(n_blocks))})
    model = copy.deepcopy(ref)
    stats = ActivationOffload()
    chosen = {None: False, "object": stats, "true": True}[offload]
    assert apply_activation_checkpointing(model, offload=chosen) is model
    x, table = torch.randn(2, 5, 4), torch.randn(dim)  # table: no grad, so it stays where it is

    def step(m: nn.Module) -> list[torch.Tensor]:
        h = m["embed"](x)
        for layer in m["layers"]:
            h = layer(h, table)
        h.square().sum().backward()
        return [p.grad for p in m.parameters()]

    expected = step(ref)
    per_step = n_blocks * 2 * 5 * dim * 4  # one float32 [2, 5, dim] input per block
    for n_steps in (1, 2):  # counters add up over steps
        model.zero_grad(set_to_none=True)
        got = step(model)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        if offload == "object":
            assert (stats.packed_tensors, stats.packed_bytes) == (n_blocks * n_steps, per_step * n_steps)
            assert (stats.restored_tensors, stats.restored_bytes) == (n_blocks * n_steps, per_step * n_steps)
            assert stats.held_bytes == 0
    if offload != "object":
        assert stats == ActivationOffload()  # not given to the model, so never touched
    # Every block holds the same offload: the one passed, a new one for True, none for False.
    offloads = {id(layer.forward.offload) for layer in model["layers"]}
    first = model["layers"][0].forward.offload
    assert len(offloads) == 1
    assert first is {None: None, "object": stats}.get(offload, first) and (first is None) == (offload is None)


def test_offload_counts_forward_before_backward_and_skips_inputs_without_grad():
    stats = ActivationOffload()
    block = checkpoint_module(_Block(4), offload=stats)
    h = torch.randn(3, 4, requires_grad=True)
    out = block(h, torch.randn(4))
    assert (stats.packed_tensors, stats.packed_bytes, stats.restored_tensors) == (1, 3 * 4 * 4, 0)
    assert stats.held_bytes == 3 * 4 * 4  # waiting for backward
    out.sum().backward()
    assert (stats.restored_tensors, stats.restored_bytes, stats.held_bytes) == (1, 3 * 4 * 4, 0)
    block(torch.randn(3, 4), torch.randn(4)).sum().backward()  # input without grad: nothing to offload
    with torch.no_grad():
        block(h, torch.randn(4))  # no backward coming: no checkpoint
    assert (stats.packed_tensors, stats.restored_tensors) == (1, 1)
    stats.reset()
    assert stats == ActivationOffload()
    with pytest.raises(TypeError, match="ActivationOffload"):
        checkpoint_module(_Block(4), offload="yes")


def test_checkpointed_block_recomputes_once_and_copies():
    calls = []
    block = _Block(4)
    block.linear.register_forward_hook(lambda m, args, out: calls.append(1))
    checkpoint_module(block)
    assert checkpoint_module(block) is block and is_checkpointed(block)  # applying twice changes nothing
    block(torch.randn(2, 4), torch.zeros(4)).sum().backward()
    assert len(calls) == 2  # forward without a graph + recomputation in backward
    twin = copy.deepcopy(block)
    assert is_checkpointed(twin) and twin.forward.module is twin
    x = torch.randn(2, 4, requires_grad=True)
    twin(x, torch.zeros(4)).sum().backward()
    assert twin.linear.weight.grad is not None and x.grad is not None
    assert set(vars(block)) == set(vars(_Block(4))) | {"forward"}  # no flags beside the replaced forward
