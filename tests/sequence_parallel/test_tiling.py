"""TiledMLP and tiled_cross_entropy equal their untiled versions in values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_lst.models.llama import FeedForward
from sequence_parallel import TiledMLP, apply_tiled_mlp, tiled_cross_entropy
from zero.contract import ContractError


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("kwargs", [{"tile_size": 5}, {"num_tiles": 3}, {"tile_size": 1000}, {}])
def test_tiled_mlp_matches_untiled(kwargs):
    torch.manual_seed(0)
    ff = FeedForward(16, 48)
    tiled_ff = copy.deepcopy(ff)
    x = torch.randn(2, 23, 16)
    g = torch.randn(2, 23, 16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = ff(x1)
    y1.backward(g)
    y2 = TiledMLP(tiled_ff, **kwargs)(x2)
    y2.backward(g)
    torch.testing.assert_close(y2, y1, rtol=0, atol=1e-6)
    for a, b in zip(_grads(tiled_ff, x2), _grads(ff, x1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tiled_mlp_runs_the_module_per_tile_and_accumulates_param_grads_once():
    torch.manual_seed(0)
    ff = FeedForward(8, 16)
    sizes = []
    ff.w1.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[0]))
    hook_calls = []
    ff.w1.weight.register_post_accumulate_grad_hook(lambda p: hook_calls.append(1))
    x = torch.randn(1, 10, 8, requires_grad=True)
    TiledMLP(ff, tile_size=4)(x).sum().backward()
    # 3 tiles in forward (no grad) + 3 recomputed in backward; never the whole sequence at once
    assert sizes == [4, 4, 2, 4, 4, 2]
    assert hook_calls == [1]  # one accumulation per step, as for an untiled layer


class _Untileable(nn.Module):
    """Stands for a layer with per-call side effects (e.g. an MoE layer's router statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.numel() // x.shape[-1])
        return self.proj(x)


class _Block(nn.Module):
    """A model of one block whose MLP site (the model contract's `mlp_sites`) is its feed-forward."""

    def __init__(self, feed_forward: nn.Module) -> None:
        super().__init__()
        self.feed_forward = feed_forward

    def mlp_sites(self) -> list[tuple[str, nn.Module]]:
        return [("feed_forward", self.feed_forward)]


class _Blocks(nn.Sequential):
    def mlp_sites(self) -> list[tuple[str, nn.Module]]:
        return [(f"{i}.feed_forward", block.feed_forward) for i, block in enumerate(self)]


def test_apply_tiled_mlp_tiles_dense_layers_and_leaves_excluded_ones_untouched():
    torch.manual_seed(0)
    wrapped = nn.Sequential(_Untileable())  # contains an excluded class: left alone too
    model = _Blocks(_Block(FeedForward(8, 16)), _Block(_Untileable()), _Block(wrapped))
    names = list(model.state_dict())
    assert apply_tiled_mlp(model, tile_size=3, exclude=(_Untileable,)) is model
    assert apply_tiled_mlp(model, tile_size=3, exclude=(_Untileable,)) is model  # twice changes nothing
    assert list(model.state_dict()) == names
    untouched = [model[1].feed_forward, wrapped]
    assert all("forward" not in vars(m) for m in untouched)  # still the class's own forward
    sizes = []
    model[0].feed_forward.w1.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[0]))
    x = torch.randn(1, 7, 8, requires_grad=True)
    for block in model:
        block.feed_forward(x).sum().backward()
    assert sizes == [3, 3, 1, 3, 3, 1]  # the dense one ran in tiles (forward, then recomputation)
    assert model[1].feed_forward.calls == [7] and wrapped[0].calls == [7]  # once, on the whole sequence


def test_apply_tiled_mlp_without_exclude_tiles_every_mlp_site_and_errors():
    layer = _Untileable()
    apply_tiled_mlp(_Block(layer), num_tiles=2)  # the caller vouches for it: no attribute is inspected
    layer(torch.randn(1, 5, 8, requires_grad=True)).sum().backward()
    assert layer.calls == [3, 2, 3, 2]
    with pytest.raises(TypeError, match="tuple of module classes"):
        apply_tiled_mlp(_Block(FeedForward(8, 16)), exclude=_Untileable)
    with pytest.raises(ValueError, match="not both"):
        TiledMLP(FeedForward(8, 16), num_tiles=2, tile_size=3)
    with pytest.raises(ContractError, match=r"apply_tiled_mlp needs Linear.mlp_sites\(\) of the model contract"):
        apply_tiled_mlp(nn.Linear(2, 2))


@pytest.mark.parametrize("tile_size", [1, 7, 64, None])
def test_tiled_cross_entropy_matches_full_logits(tile_size):
    torch.manual_seed(0)
    hidden = torch.randn(2, 19, 16)
    weight = torch.randn(40, 16) * 0.3
    labels = torch.randint(0, 40, (2, 19))
    labels[0, :7] = -100
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h1 @ w1.t()).reshape(-1, 40), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    loss_sum, count = tiled_cross_entropy(h2, w2, labels, tile_size=tile_size)
    assert int(count) == int((labels != -100).sum())
    (loss_sum / count).backward()
    torch.testing.assert_close(loss_sum / count, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-7)


def test_tiled_cross_entropy_scales_by_the_incoming_gradient_and_handles_all_ignored():
    torch.manual_seed(0)
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    labels = torch.randint(0, 9, (6,))
    (3.0 * tiled_cross_entropy(h, w, labels, tile_size=4)[0]).backward()
    g3 = h.grad.clone()
    h.grad = None
    tiled_cross_entropy(h, w, labels, tile_size=4)[0].backward()
    torch.testing.assert_close(g3, 3.0 * h.grad)
    loss_sum, count = tiled_cross_entropy(h, w, torch.full((6,), -100))
    assert loss_sum.item() == 0.0 and int(count) == 0


def test_tiled_cross_entropy_errors():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        tiled_cross_entropy(h, w, torch.tensor([0, 1, 10, -100]))
    with pytest.raises(ValueError, match="weight must be"):
        tiled_cross_entropy(h, torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="must agree"):
        tiled_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))
