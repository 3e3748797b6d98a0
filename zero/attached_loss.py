"""Losses attached to activations: their gradient enters in backward, scaled like the main loss.

A layer that computes a side loss (e.g. an MoE balancing loss) can make it part of whatever loss is
later backpropagated from its output, without threading it through the model's return values. The
engine multiplies the main loss by a factor before backward (fp16 loss scale / accumulation steps);
an `AttachedLossScale` given to `zero.initialize(loss_scale_hooks=...)` receives that same factor.
"""

from __future__ import annotations

import torch


class AttachedLossScale:
    """The factor the gradient of attached losses is multiplied by (read in backward, so it is the
    factor of the backward that actually runs). Calling it sets the factor: it is a loss-scale hook."""

    def __init__(self, value: float = 1.0) -> None:
        self.value = float(value)

    def __call__(self, scale: float) -> None:
        self.value = float(scale)

    def __repr__(self) -> str:
        return f"AttachedLossScale({self.value})"


class _AttachLoss(torch.autograd.Function):
    """Returns `output` unchanged; backward also sends gradient `scale.value` into `loss`."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: AttachedLossScale) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        loss_grad = torch.full(ctx.loss_shape, ctx.scale.value, dtype=ctx.loss_dtype, device=grad.device)
        return grad, loss_grad, None


def attach_loss(output: torch.Tensor, loss: torch.Tensor, scale: AttachedLossScale) -> torch.Tensor:
    """`output`, through which backward also differentiates `loss` with gradient `scale.value`."""
    return _AttachLoss.apply(output, loss, scale)
