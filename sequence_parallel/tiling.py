"""Sequence tiling for long contexts: MLPs and the logits+loss computed tile by tile.

Neither the MLP's [tokens, ffn_dim] intermediates nor the [tokens, vocab] logits ever exist for the
whole sequence; only one tile's worth at a time, in forward and in backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from zero.contract import contract_of


def _tile_bounds(n: int, tile_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile_size, n)) for start in range(0, n, tile_size)]


def _resolve_tile_size(n: int, num_tiles: int | None, tile_size: int | None, default: int) -> int:
    if num_tiles is not None and tile_size is not None:
        raise ValueError(f"give num_tiles ({num_tiles}) or tile_size ({tile_size}), not both")
    if num_tiles is not None:
        if num_tiles < 1:
            raise ValueError(f"num_tiles={num_tiles} must be >= 1")
        return max(1, math.ceil(n / num_tiles))
    size = default if tile_size is None else tile_size
    if size < 1:
        raise ValueError(f"tile_size={size} must be >= 1")
    return size


# ------------------------------------------------------------------------------------------ MLP
class _TiledMLPFunction(torch.autograd.Function):
    """Forward tile by tile without a graph; backward recomputes each tile with grad.

    Parameters are inputs of the function, so their gradients are returned (summed over tiles)
    and autograd accumulates them once, like any other op; hooks on parameters fire once per step.
    """

    @staticmethod
    def forward(ctx, fn, tile_size: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tile_size, ctx.params = fn, tile_size, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return _tiles_without_graph(fn, x, tile_size)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = list(ctx.params)
        x2 = x.detach().reshape(-1, x.shape[-1])
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_x = ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x2) if need_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        for a, b in _tile_bounds(x2.shape[0], ctx.tile_size):
            x_tile = x2[a:b].detach().requires_grad_(need_x)
            with torch.enable_grad():
                y = ctx.fn(x_tile)
                wanted = ([x_tile] if need_x else []) + params
                grads = torch.autograd.grad(y, wanted, g2[a:b], allow_unused=True)
            if need_x:
                grad_x[a:b] = grads[0]
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is not None:
                    grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
        grad_x = None if grad_x is None else grad_x.reshape(x.shape)
        return (None, None, grad_x, *grad_params)


def _tiles_without_graph(fn, x: torch.Tensor, tile_size: int) -> torch.Tensor:
    """fn over x [..., dim] tile by tile, each tile's output written into one preallocated output."""
    x2 = x.reshape(-1, x.shape[-1])  # token-wise: [..., dim] -> [tokens, dim]
    if x2.shape[0] == 0:
        return fn(x)
    out = None
    for a, b in _tile_bounds(x2.shape[0], tile_size):
        y = fn(x2[a:b])
        if out is None:
            out = y.new_empty((x2.shape[0], y.shape[-1]))
        out[a:b] = y
    return out.reshape(*x.shape[:-1], out.shape[-1])


def tiled_mlp_forward(module: nn.Module, x: torch.Tensor, tile_size: int, forward=None) -> torch.Tensor:
    """Run token-wise `module` (or its given `forward`) over x [..., dim] in tiles of `tile_size` tokens.

    Without a backward coming (no grad: evaluation, or the forward of a checkpointed layer) the tiles run
    without a graph, so the [tokens, ffn] intermediates never exist for the whole sequence there either."""
    fn = forward or module.forward
    params = [p for p in module.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        with torch.no_grad():
            return _tiles_without_graph(fn, x, tile_size)
    return _TiledMLPFunction.apply(fn, tile_size, x, *params)


class TiledMLP(nn.Module):
    """Wrap a token-wise module so that it runs over sequence tiles and recomputes per tile in backward.

    `TiledMLP(mlp, tile_size=1024)` or `TiledMLP(mlp, num_tiles=8)`; with neither, tiles hold `dim`
    tokens (the input width), which keeps a tile's SwiGLU intermediates near dim * ffn_dim elements.
    Values and gradients equal the untiled module's (up to float summation order of the weight
    gradients). Only the input x is kept for backward.

    The contract, which the caller vouches for (nothing here inspects the module): it is token-wise
    (each output row depends on its input row only), deterministic (no dropout: the recomputation must
    reproduce the forward) and free of per-call side effects. An MoE layer breaks the last one: its
    router statistics (aux / z losses, load counts, expert-bias updates) would become per tile and be
    recorded twice (forward and recomputation), which silently changes training; keep such layers out,
    e.g. with `apply_tiled_mlp(..., exclude=(MoELayer,))`.
    """

    def __init__(self, mlp: nn.Module, num_tiles: int | None = None, tile_size: int | None = None) -> None:
        super().__init__()
        _resolve_tile_size(1, num_tiles, tile_size, 1)  # validate the arguments early
        self.mlp = mlp
        self.num_tiles, self.tile_size = num_tiles, tile_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // x.shape[-1]
        size = _resolve_tile_size(n, self.num_tiles, self.tile_size, x.shape[-1])
        return tiled_mlp_forward(self.mlp, x, size)


class _TiledForward:
    """The `forward` that `apply_tiled_mlp` installs; being it is the module's only mark of being tiled.

    A plain class (not a closure), so the module still deep-copies and pickles.
    """

    def __init__(self, module: nn.Module, original: Callable, num_tiles: int | None, tile_size: int | None) -> None:
        self.module, self.original = module, original
        self.num_tiles, self.tile_size = num_tiles, tile_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // x.shape[-1]
        size = _resolve_tile_size(n, self.num_tiles, self.tile_size, x.shape[-1])
        return tiled_mlp_forward(self.module, x, size, forward=self.original)


def apply_tiled_mlp(model: nn.Module, num_tiles: int | None = None, tile_size: int | None = None,
                    exclude: tuple[type[nn.Module], ...] = ()) -> nn.Module:
    """Tile every MLP site of `model` (`zero.contract`: the model's `mlp_sites()`) in place: its forward is
    replaced, parameter names stay.

    Each must meet the `TiledMLP` contract. `exclude` names the module classes that must not be tiled
    (e.g. `(MoELayer,)`): a site that is, or contains, an instance of one is left as it is. Sites
    already tiled are left alone. Returns the model.
    """
    _resolve_tile_size(1, num_tiles, tile_size, 1)
    if not isinstance(exclude, tuple) or not all(isinstance(c, type) for c in exclude):
        raise TypeError(f"exclude must be a tuple of module classes, e.g. exclude=(MoELayer,); got {exclude!r}")
    sites = contract_of(model, "apply_tiled_mlp", "mlp_sites").mlp_sites()
    if not sites:
        raise ValueError(f"apply_tiled_mlp: {type(model).__name__}.mlp_sites() lists no MLP")
    for _, module in sites:
        if any(isinstance(m, exclude) for m in module.modules()):
            continue
        if not isinstance(vars(module).get("forward"), _TiledForward):
            module.forward = _TiledForward(module, module.forward, num_tiles, tile_size)
    return model


# ------------------------------------------------------------------------------------------ loss
class _TiledCrossEntropy(torch.autograd.Function):
    """Logits + cross-entropy per tile; gradients w.r.t. hidden and weight are computed in forward.

    Choice: gradients in forward (not recomputation in backward). The loss is the last op before
    backward starts, so the stored gradients ([N, dim] + [V, dim]) are exactly the buffers backward
    would allocate at that same moment anyway: peak memory is the same as recomputing, and one
    logits matmul per tile is saved. Per tile only [tile, V] logits exist.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                tile_size: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        count = (labels != ignore_index).sum()
        for a, b in _tile_bounds(hidden.shape[0], tile_size):
            h, y = hidden[a:b], labels[a:b]
            valid = y != ignore_index
            logits = (h @ weight.t()).float()  # [tile, V]
            lse = torch.logsumexp(logits, dim=-1)
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            target = logits.gather(1, safe_y[:, None])[:, 0]
            loss_sum += ((lse - target) * valid).sum()
            if need_h or need_w:
                # d loss / d logits = softmax - onehot on valid rows, 0 on ignored rows; in place on logits.
                probs = logits.sub_(lse[:, None]).exp_()
                probs.scatter_add_(1, safe_y[:, None], -torch.ones_like(lse)[:, None])
                probs.mul_(valid[:, None])
                g = probs.to(hidden.dtype)
                if need_h:
                    grad_h[a:b] = g @ weight
                if need_w:
                    grad_w.addmm_(probs.t(), h.float())
            del logits
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(count)
        return loss_sum, count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_count):
        grad_h, grad_w = ctx.saved_tensors
        # Scaling in place: these buffers are used once.
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss)
        return grad_h, grad_w, None, None, None


def tiled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        ignore_index: int = -100, tile_size: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, count of non-ignored labels) of `hidden @ weight.T` against `labels`.

    hidden [N, dim] (or [b, s, dim]), weight [V, dim] (the lm head), labels [N] (or [b, s]). Never
    materialises [N, V] logits: at most [tile_size, V] at once (default: tiles of ~16M logits).
    Feed the result to `sequence_parallel.data.sp_loss` (or divide by count without SP).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree on all "
                         "but hidden's last (model) dim")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, dim={hidden.shape[-1]}], got {tuple(weight.shape)}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    vocab = weight.shape[0]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels must be in [0, {vocab}) or ignore_index={ignore_index}; got "
                         f"{labels[bad][:5].tolist()}")
    size = tile_size if tile_size is not None else max(1, (16 * 2**20) // vocab)
    if size < 1:
        raise ValueError(f"tile_size={size} must be >= 1")
    return _TiledCrossEntropy.apply(hidden, weight, labels, ignore_index, size)
