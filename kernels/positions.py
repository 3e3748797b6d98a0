"""Position ids for a batch of token sequences: the one place their default and accepted shapes are decided.

Positions are explicit (not implied by a token's index) so that a sequence shard keeps its global positions.
"""

from __future__ import annotations

import torch


def position_ids_for(tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids [batch, seq] for `tokens` [batch, seq].

    None gives 0..seq-1 in every row; a 1-D [seq] tensor is shared by every row; a [batch, seq] tensor is
    returned as it is. Defaults and shared rows are expanded views (no copy): call `.contiguous()` before
    writing into them.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}; add a batch dim")
    b, s = tokens.shape
    if position_ids is None:
        return torch.arange(s, device=tokens.device).expand(b, s)
    if position_ids.shape == (s,):
        return position_ids.expand(b, s)
    if position_ids.shape != tokens.shape:
        raise ValueError(
            f"position_ids {tuple(position_ids.shape)} must be [seq={s}] (shared by every row) or match tokens "
            f"[batch, seq] = {tuple(tokens.shape)}; pass None for positions 0..{s - 1}"
        )
    return position_ids
