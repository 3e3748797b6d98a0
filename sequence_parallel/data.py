"""Sequence-parallel batches: shard [b, s] along the sequence, keep global positions, reduce the loss.

The loss convention: every SP rank backpropagates the same total loss (sum of token losses over the
group / global count of non-ignored labels) and its gradient reaches only its own tokens' term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from moe_lst.kernels.positions import position_ids_for
from torch.distributed import ProcessGroup

from zero.dist import comm
from zero.dist.topology import group_rank, group_size


def padded_length(seq_len: int, sp: int) -> int:
    """The sequence length after padding the end up to a multiple of `sp`."""
    return -(-seq_len // sp) * sp


def shard_sequence(tokens: torch.Tensor, labels: torch.Tensor, sp_group: ProcessGroup | None,
                   position_ids: torch.Tensor | None = None, ignore_index: int = -100,
                   pad_token: int = 0, cp_group: ProcessGroup | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's contiguous chunk of `tokens`, `labels` and global `position_ids`, all [b, s_pad/sp].

    `labels` must already be shifted (labels[:, i] is the target of tokens[:, i]), so each rank's
    chunk is self-contained. When s is not divisible by sp the end is padded: tokens with `pad_token`,
    labels with `ignore_index` (no loss), position ids continuing the count. Padding at the end of a
    causal sequence cannot change the outputs of the real tokens before it, so losses are unchanged.
    With a ring (`cp_group` of more than one rank) the rank's tokens are its two mirrored pieces instead
    (`context_parallel_indices`, no padding: 2 * sp * cp must divide s), [b, s/(sp*cp)] each.
    """
    position_ids = position_ids_for(tokens, position_ids)  # also checks that tokens are [batch, seq]
    if labels.shape != tokens.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must have the shape of tokens {tuple(tokens.shape)}; pass labels "
            "already shifted by one (labels[:, i] is the target of tokens[:, i])"
        )
    s = tokens.shape[1]
    if group_size(cp_group) > 1:
        return tuple(shard_context_parallel(x, sp_group, cp_group) for x in (tokens, labels, position_ids))
    sp, rank = group_size(sp_group), group_rank(sp_group)
    pad = padded_length(s, sp) - s
    if pad:
        tokens = F.pad(tokens, (0, pad), value=pad_token)
        labels = F.pad(labels, (0, pad), value=ignore_index)
        # Continue each row's positions past its last one so RoPE sees a plausible, distinct angle.
        extra = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
        position_ids = torch.cat([position_ids, extra], dim=1)
    chunk = (s + pad) // sp
    sl = slice(rank * chunk, (rank + 1) * chunk)
    return tokens[:, sl].contiguous(), labels[:, sl].contiguous(), position_ids[:, sl].contiguous()


def context_parallel_indices(seq_len: int, sp: int, sp_rank: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The positions (in the whole row) of the tokens that rank (sp_rank, cp_rank) holds under Ulysses x ring.

    The row is cut into 2 * cp chunks; ring rank c owns chunks c and 2cp-1-c (mirrored, so that causal work is
    even over the ring), and each of those is cut into sp pieces, one per Ulysses rank: the rank holds piece
    sp_rank of chunk c then piece sp_rank of chunk 2cp-1-c. Ulysses' all-to-all then gives each ring rank its two
    whole chunks (for a block of heads). Raises a ValueError unless 2 * sp * cp divides `seq_len`.
    """
    check_context_parallel_length(seq_len, sp, cp)
    chunk = seq_len // (2 * cp)
    piece = chunk // sp
    first = cp_rank * chunk + sp_rank * piece
    mirror = (2 * cp - 1 - cp_rank) * chunk + sp_rank * piece
    return torch.cat([torch.arange(first, first + piece), torch.arange(mirror, mirror + piece)])


def check_context_parallel_length(seq_len: int, sp: int, cp: int) -> None:
    """Raise a ValueError unless `seq_len` splits into 2 * cp mirrored chunks of sp equal pieces."""
    if seq_len % (2 * sp * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * sp * cp = 2 * {sp} * {cp} = "
                         f"{2 * sp * cp}: ring attention cuts each row into 2 * cp mirrored chunks of sp pieces; "
                         f"use a sequence length that is a multiple of {2 * sp * cp}")


def shard_context_parallel(x: torch.Tensor, sp_group: ProcessGroup | None, cp_group: ProcessGroup | None,
                           dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` (the whole rows along `dim`) under Ulysses `sp_group` x ring `cp_group`
    (`context_parallel_indices`), contiguous."""
    idx = context_parallel_indices(x.shape[dim], group_size(sp_group), group_rank(sp_group), group_size(cp_group),
                                   group_rank(cp_group))
    return x.index_select(dim, idx.to(x.device)).contiguous()


def collect_context_parallel(x: torch.Tensor, sp_group: ProcessGroup | None, cp_group: ProcessGroup | None,
                            dim: int = 1) -> torch.Tensor:
    """The whole rows of `x` from every rank's tokens (`shard_context_parallel`'s inverse), in row order.

    Not differentiable; meant for tests, evaluation and logging.
    """
    sp, cp = group_size(sp_group), group_size(cp_group)
    local = collect_sequence(x, sp_group, dim)  # sp pieces of both chunks: [piece u of c, piece u of mirror]...
    local = collect_sequence(local, cp_group, dim)
    n = x.shape[dim]
    seq_len = n * sp * cp
    # Position of every gathered token in the row, in the gathered order (cp rank major, then sp rank).
    order = torch.cat([context_parallel_indices(seq_len, sp, u, cp, c) for c in range(cp) for u in range(sp)])
    out = torch.empty_like(local)
    out.index_copy_(dim, order.to(x.device), local)
    return out


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of non-ignored labels) of logits [..., V] against labels [...]."""
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
    return loss_sum, (labels != ignore_index).sum()


def sp_loss(loss_sum: torch.Tensor, count: torch.Tensor | int, sp_group: ProcessGroup | None) -> torch.Tensor:
    """Mean token loss over the whole sequence batch: sum over SP ranks / global non-ignored count.

    Correct when ranks hold different numbers of non-ignored labels (a plain mean of per-rank means
    is not). Differentiable: every rank gets the same value; backward sends each rank's gradient
    only into its own `loss_sum`, so summing gradients over the SP group gives the full gradient.
    """
    if loss_sum.dim() != 0:
        raise ValueError(f"loss_sum must be a scalar (sum of token losses), got {tuple(loss_sum.shape)}")
    count_t = torch.as_tensor(count, device=loss_sum.device).detach().to(torch.float64).reshape(1).clone()
    comm.all_reduce(count_t, sp_group)
    total = comm.all_reduce_sum_autograd(loss_sum, sp_group)
    # An all-padding batch has no labels; clamping keeps the loss 0 instead of nan.
    return total / count_t[0].clamp(min=1).to(total.dtype)


def collect_sequence(x: torch.Tensor, sp_group: ProcessGroup | None, dim: int = 1,
                     length: int | None = None) -> torch.Tensor:
    """All SP ranks' chunks of `x` concatenated along `dim` (rank order), trimmed to `length`.

    Not differentiable; meant for tests, evaluation and logging.
    """
    sp = group_size(sp_group)
    x = x.detach()
    if sp > 1:
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((sp * moved.shape[0],) + tuple(moved.shape[1:]))
        comm.all_gather_into_tensor(out, moved, sp_group)
        x = out.movedim(0, dim)
    if length is not None:
        x = x.narrow(dim, 0, length)
    return x
