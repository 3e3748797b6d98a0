"""The engine's global gradient norm (logged as grad_norm, used for clipping) is the float64 norm of the gradient:
summed in fp32 over a flat shard of millions of elements it drifted by ~1e-4 of its value with the shard's size, so
one process and its dp ranks logged different norms of the same gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero


class _Big(nn.Module):
    """One flat weight of 2M elements: the gradient of (w * c).sum() is c."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


@pytest.mark.parametrize("stage", [0, 3])
def test_global_grad_norm_is_the_float64_norm_of_a_large_gradient(stage) -> None:
    c = torch.randn(1 << 21, generator=torch.Generator().manual_seed(0)).abs()  # (same sign: no cancellation)
    engine = zero.initialize(_Big(c.numel()), lambda params: torch.optim.SGD(params, lr=0.0),
                             zero.ZeroConfig(stage=stage))
    engine.backward(engine(c))
    assert engine.step()
    want = float(c.double().norm())
    assert engine.global_grad_norm == pytest.approx(want, rel=1e-9)
