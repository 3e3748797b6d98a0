"""Correctness at length: the last tokens of a long sequence, computed the way training computes them
(tiled, checkpointed, sequence-sharded), against a plain forward over a crop that covers their
receptive field.

With sliding-window attention a token sees at most `window_blocks * block_size` tokens back per layer,
so after `n_layers` layers nothing before `n_layers * window_blocks * block_size` tokens earlier can
reach it. A plain model (no tiling, no sharding, no checkpointing) run on just that crop, at the same
absolute positions and starting on the same block boundary, must give the same per-token losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
from moe_lst.models.llama import ModelConfig, Transformer
from zero.dist import comm

TOLERANCE = 1e-4  # largest per-token loss difference (fp32) for the check to pass


def receptive_field(cfg: ModelConfig) -> int:
    """Tokens before a token that can influence its output (sliding-window sparse attention)."""
    if cfg.attention != "sparse" or cfg.sparse.layout != "sliding_window":
        raise ValueError("a bounded receptive field needs model.attention=sparse with "
                         "model.sparse.layout=sliding_window")
    return cfg.n_layers * cfg.sparse.window_blocks * cfg.sparse.block_size


@torch.no_grad()
def last_token_losses(engine, tokens: torch.Tensor, labels: torch.Tensor, n: int,
                      dims: zero.ParallelDims) -> torch.Tensor:
    """Per-token losses [n] of the last `n` tokens of the sequence tokens [1, s], through the engine (its
    model as trained: tiled, checkpointed, the sequence split over sp); the same on every rank."""
    s = tokens.shape[1]
    positions = torch.arange(s, device=tokens.device)[None]
    if dims.sp > 1 or dims.cp > 1:
        from sequence_parallel import shard_sequence

        tokens, labels, positions = shard_sequence(tokens, labels, dims.sp_group, position_ids=positions,
                                                   cp_group=dims.cp_group)
    hidden = engine(tokens, positions, return_hidden=True)[0]  # [local s, dim]
    mine = (positions[0] >= s - n) & (positions[0] < s)
    out = torch.zeros(n, dtype=torch.float64, device=hidden.device)
    if bool(mine.any()):
        logits = F.linear(hidden[mine], engine.module.output_weight).float()
        out[positions[0][mine] - (s - n)] = F.cross_entropy(logits, labels[0][mine], reduction="none").double()
    if dims.sp > 1 or dims.cp > 1:
        comm.all_reduce(out, dims.sequence_group)
    return out


@torch.no_grad()
def crop_losses(weights: dict[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor, labels: torch.Tensor,
                n: int) -> tuple[torch.Tensor, int]:
    """Per-token losses [n] of the last `n` tokens from a plain model on the crop that covers their
    receptive field (starting on a block boundary), and the crop's length."""
    s, block = tokens.shape[1], cfg.sparse.block_size
    start = max(0, (s - n - receptive_field(cfg)) // block * block)
    model = Transformer(cfg)
    model.load_state_dict(weights)
    model.eval()
    positions = torch.arange(start, s)[None]
    logits = model(tokens[:, start:], positions)[0, -n:].float()
    return F.cross_entropy(logits, labels[0, -n:], reduction="none").double(), s - start


def crop_check(engine, cfg: ModelConfig, dims: zero.ParallelDims, tokens: torch.Tensor, labels: torch.Tensor,
               n: int) -> dict[str, float]:
    """Collective: the largest per-token loss difference over the last `n` tokens of tokens [1, s] between
    the engine's model and a plain forward over their receptive-field crop (computed on rank 0)."""
    ours = last_token_losses(engine, tokens, labels, n, dims).cpu()
    weights = engine.full_state_dict()
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    plain, crop = crop_losses(weights, cfg, tokens.cpu(), labels.cpu(), n)
    diff = float((ours - plain).abs().max())
    return {"crop_check_max_abs_diff": diff, "crop_check_passed": diff <= TOLERANCE, "crop_check_tokens": n,
            "crop_check_crop_len": crop, "crop_check_mean_loss": float(ours.mean())}
