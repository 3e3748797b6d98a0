"""Top-k expert routing: softmax or sigmoid scores, group-limited selection, expert bias.

Also the balancing terms computed from a routing decision: the Switch/GShard auxiliary loss, the
ST-MoE router z-loss, and the load counts that drive auxiliary-loss-free bias balancing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from zero.dist import comm
from zero.dist.topology import group_size

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One routing decision for N tokens (all fp32 except the indices, and the logits of a router with
    fp32_logits=False, which keep the input's dtype)."""

    weights: torch.Tensor  # [N, k] gate weights of the chosen experts (unbiased scores, maybe renormalised)
    indices: torch.Tensor  # [N, k] int64 chosen expert ids
    logits: torch.Tensor  # [N, E] raw router logits
    probs: torch.Tensor  # [N, E] per-token distribution over experts used by the aux loss


class TopKRouter(nn.Module):
    """Scores every token against every expert and picks `top_k` experts per token.

    score_func="softmax" (Switch/GShard/Mixtral): probabilities over all experts, top-k, then
    optionally renormalised over the chosen k. score_func="sigmoid" (DeepSeek-V3): independent
    sigmoid affinities, gate weights normalised over the chosen experts. `expert_bias` (a buffer) is
    added to the scores for SELECTION only; the gate weights always use the unbiased scores.
    The router runs in fp32 by default: bf16 logits flip near-tied top-k choices between otherwise
    identical runs and make the z-loss meaningless. `fp32_logits=False` computes the logits in the input's
    dtype instead and only the scores in fp32, as Hugging Face's Mixtral and Qwen3-MoE routers do (the
    logits then keep that dtype; with fp32 inputs both are the same).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int = 2, score_func: str = "softmax",
                 renormalize: bool | None = None, jitter_eps: float = 0.0, num_groups: int | None = None,
                 topk_groups: int | None = None, init_std: float = 0.02, *, fp32_logits: bool = True) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCTIONS:
            raise ValueError(f"router={score_func!r} is not a known score function; "
                             f"use one of {SCORE_FUNCTIONS}")
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts} must be >= 1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]; "
                             "lower top_k or add experts")
        if jitter_eps < 0 or jitter_eps >= 1:
            raise ValueError(f"jitter_eps={jitter_eps} must be in [0, 1) (multiplicative input noise)")
        if (num_groups is None) != (topk_groups is None):
            raise ValueError(f"num_groups={num_groups} and topk_groups={topk_groups} must be given "
                             "together (or both left None for ungrouped routing)")
        if num_groups is not None:
            if num_groups < 1 or num_experts % num_groups:
                raise ValueError(f"num_groups={num_groups} must be >= 1 and divide "
                                 f"num_experts={num_experts}")
            if not 1 <= topk_groups <= num_groups:
                raise ValueError(f"topk_groups={topk_groups} must be in [1, num_groups={num_groups}]")
            if topk_groups * (num_experts // num_groups) < top_k:
                raise ValueError(f"topk_groups={topk_groups} groups of {num_experts // num_groups} "
                                 f"experts hold fewer than top_k={top_k} experts; raise topk_groups")
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.score_func = score_func
        # Top-1 softmax renormalised would always weigh 1.0 and starve the router of gradient.
        self.renormalize = (top_k > 1 or score_func == "sigmoid") if renormalize is None else renormalize
        self.jitter_eps = jitter_eps
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.fp32_logits = fp32_logits
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight, std=init_std)
        # Selection-only bias for auxiliary-loss-free balancing (DeepSeek-V3); updated outside autograd.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score_func={self.score_func}, renormalize={self.renormalize}, groups="
                f"{self.topk_groups}/{self.num_groups}")

    def _group_mask(self, select: torch.Tensor) -> torch.Tensor:
        """[N, E] bool: experts inside each token's `topk_groups` best groups."""
        n, e = select.shape
        grouped = select.view(n, self.num_groups, e // self.num_groups)  # [N, E] -> [N, G, E/G]
        if self.score_func == "sigmoid":
            # DeepSeek-V3: a group is as good as the sum of its two best affinities.
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_score = grouped.max(dim=-1).values  # DeepSeek-V2 device-limited routing
        top_groups = group_score.topk(self.topk_groups, dim=-1).indices  # [N, topk_groups]
        group_keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
        return group_keep.unsqueeze(-1).expand_as(grouped).reshape(n, e)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, dim] (any dtype) -> Routing with fp32 weights/probs (and logits, unless fp32_logits=False)."""
        x = x.float() if self.fp32_logits else x
        if self.training and self.jitter_eps > 0:
            # Switch Transformer input jitter: multiplicative uniform noise, training only.
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        logits = F.linear(x, self.weight.to(x.dtype))  # [N, E]
        if self.score_func == "softmax":
            scores = logits.float().softmax(dim=-1)
            probs = scores
        else:
            scores = logits.float().sigmoid()
            # The aux loss needs a distribution over experts: normalise the affinities per token.
            probs = scores / scores.sum(dim=-1, keepdim=True)
        select = scores.detach() + self.expert_bias
        if self.num_groups is not None:
            select = select.masked_fill(~self._group_mask(select), float("-inf"))
        indices = select.topk(self.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, indices)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return Routing(weights=weights, indices=indices, logits=logits, probs=probs)


def expert_counts(indices: torch.Tensor, num_experts: int, num_seqs: int = 1) -> torch.Tensor:
    """[num_seqs, E] float counts of token-slots per expert; indices [N, k], N = num_seqs * seq."""
    seq_idx = torch.arange(num_seqs, device=indices.device).repeat_interleave(
        indices.shape[0] // num_seqs * indices.shape[1])
    flat = seq_idx * num_experts + indices.reshape(-1)
    # a fixed-size scatter, not torch.bincount (which reads the largest id on the host on CUDA): same counts
    counts = torch.zeros(num_seqs * num_experts, dtype=torch.int64, device=indices.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    return counts.view(num_seqs, num_experts).float()


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor, num_seqs: int = 1,
                        stats_group: ProcessGroup | None = None) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_i f_i * P_i, averaged over `num_seqs` sequences.

    f_i = fraction of token-slots routed to expert i, P_i = mean router probability of expert i, both
    over a sequence's tokens (num_seqs=1: over all tokens). With `stats_group` the counts and
    probability sums are first summed over the group (e.g. the sequence-parallel group holding the
    other shards of the same sequences), so every rank gets the aux loss of the whole sequence and its
    local tokens receive exactly their share of the gradient. Equals 1.0 under perfect balance.
    """
    n, e = probs.shape
    k = indices.shape[1]
    counts = expert_counts(indices, e, num_seqs)  # [B, E]
    prob_sum = probs.view(num_seqs, n // num_seqs, e).sum(dim=1)  # [B, s, E] -> [B, E]
    tokens = torch.full((num_seqs, 1), float(n // num_seqs), device=probs.device)
    if group_size(stats_group) > 1:
        stacked = torch.cat([counts, tokens], dim=1)
        comm.all_reduce(stacked, stats_group)
        counts, tokens = stacked[:, :e], stacked[:, e:]
        prob_sum = comm.all_reduce_sum_autograd(prob_sum, stats_group)
    tokens = tokens.clamp_min(1.0)  # a rank (or group) with no tokens contributes nothing, not NaN
    f = counts / (tokens * k)
    p = prob_sum / tokens
    return (e * (f * p).sum(dim=1)).mean()


def router_z_loss(logits: torch.Tensor, stats_group: ProcessGroup | None = None) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2 (over `stats_group`'s tokens if given)."""
    total = torch.logsumexp(logits, dim=-1).square().sum()
    # a fill, not torch.tensor(..., device=): a host-to-device copy from pageable memory waits for the stream
    count = torch.full((), float(logits.shape[0]), device=logits.device)
    if group_size(stats_group) > 1:
        total = comm.all_reduce_sum_autograd(total, stats_group)
        comm.all_reduce(count, stats_group)
    return total / count.clamp_min(1.0)


@torch.no_grad()
def update_expert_bias(router: TopKRouter, loads: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing step: bias_i += rate * sign(mean_load - load_i)."""
    loads = loads.float()
    router.expert_bias.add_(rate * torch.sign(loads.mean() - loads))
