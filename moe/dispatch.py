"""Token dispatch: sort-based permutation of token-slots into per-expert segments and back.

Dropless by default; with a capacity, each expert keeps its highest-scoring slots. Dispatchers share
one interface (`TokenDispatcher`): the local one keeps every expert on this rank, the all-to-all one
moves the permuted tokens to the ranks that own their experts (expert parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from zero.dist import comm
from zero.dist.topology import group_size


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """capacity = ceil(capacity_factor * tokens * top_k / E) token-slots per expert."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


@dataclass
class DispatchPlan:
    """Where each kept token-slot goes; slots are ordered by expert id (contiguous segments)."""

    token_index: torch.Tensor  # [M] source token of each kept slot, expert-sorted
    slot_index: torch.Tensor  # [M] flat slot id (token * k + j) of each kept slot, to fetch gate weights
    tokens_per_expert: torch.Tensor  # [E] int64 kept slots per expert
    routed_per_expert: torch.Tensor  # [E] int64 slots routed per expert before any drop
    num_slots: int  # N * k

    @property
    def num_dropped(self) -> torch.Tensor:
        return self.routed_per_expert.sum() - self.tokens_per_expert.sum()


def make_plan(indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
              capacity: int | None = None) -> DispatchPlan:
    """Plan the permutation for indices/weights [N, k]; no one-hot [N, E, C] tensors anywhere.

    Dropless: a stable argsort of the expert ids. With `capacity`: slots are sorted by descending
    gate weight first, then (stably) by expert, so each expert's segment lists its best slots first
    and cutting every segment at `capacity` drops the lowest-scoring ones.
    """
    n, k = indices.shape
    flat_expert = indices.reshape(-1)  # [N, k] -> [N*k]
    routed = torch.bincount(flat_expert, minlength=num_experts)
    if capacity is None:
        order = torch.argsort(flat_expert, stable=True)
        kept = routed
    else:
        by_score = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
        order = by_score[torch.argsort(flat_expert[by_score], stable=True)]
        # Position of every sorted slot inside its expert's segment; keep the first `capacity`.
        starts = torch.cumsum(routed, 0) - routed
        position = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(routed)
        order = order[position < capacity]
        kept = routed.clamp(max=capacity)
    return DispatchPlan(token_index=order // k, slot_index=order, tokens_per_expert=kept,
                        routed_per_expert=routed, num_slots=n * k)


def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """x [N, dim] -> [M, dim] token copies grouped by expert."""
    return x.index_select(0, plan.token_index)


class _WeightedScatterAdd(torch.autograd.Function):
    """out[token_index[m]] += gate[m] * y[m], without keeping a weighted [M, dim] copy alive.

    Backward gathers the output gradient once and reuses it for both inputs; the gate gradient is a
    row-wise dot product, so no [M, dim] product is materialised for it.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, gate: torch.Tensor, token_index: torch.Tensor, num_tokens: int):
        ctx.save_for_backward(y, gate, token_index)
        out = y.new_zeros(num_tokens, y.shape[1])
        return out.index_add_(0, token_index, y * gate.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, gate, token_index = ctx.saved_tensors
        grad_rows = grad.index_select(0, token_index)  # [M, dim]
        grad_gate = None
        if ctx.needs_input_grad[1]:
            grad_gate = torch.linalg.vecdot(grad_rows, y)  # row-wise dot, no [M, dim] product kept
        grad_y = grad_rows.mul_(gate.unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return grad_y, grad_gate, None, None


def unpermute(y: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[M, dim] expert outputs -> [N, dim]: weight by the gate and scatter-add back to their tokens.

    Dropped slots add nothing, so a token whose every slot was dropped gets zero (the residual path).
    """
    gate = weights.reshape(-1).index_select(0, plan.slot_index).to(y.dtype)  # [M]
    return _WeightedScatterAdd.apply(y, gate, plan.token_index, num_tokens)


@dataclass
class DispatchState:
    """What `combine` needs to bring one `dispatch`'s expert outputs back to their tokens."""

    plan: DispatchPlan
    weights: torch.Tensor  # [N, k] gate weights of the routing decision
    num_tokens: int  # N
    tokens_per_local_expert: torch.Tensor  # [E_local] rows this rank's experts compute


@dataclass
class _A2AState(DispatchState):
    input_splits: list[int]  # rows sent to each ep rank
    output_splits: list[int]  # rows received from each ep rank
    regroup: torch.Tensor  # [R] received-row order that makes local-expert segments contiguous


class TokenDispatcher:
    """Moves routed tokens to the experts that compute them and their outputs back: one interface.

    dispatch(x [N, dim], plan, weights [N, k]) -> (rows [R, dim] for this rank's experts in contiguous
    per-local-expert segments, state); combine(expert outputs [R, dim], state) -> y [N, dim], the
    gate-weighted sum over each token's experts (dropped slots add nothing).
    `run` is what MoELayer calls: dispatch -> experts -> combine, which a dispatcher may fuse.
    """

    num_local: int

    def dispatch(self, x: torch.Tensor, plan: DispatchPlan,
                 weights: torch.Tensor) -> tuple[torch.Tensor, DispatchState]:
        raise NotImplementedError

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        raise NotImplementedError

    def run(self, x: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor,
            experts) -> tuple[torch.Tensor, torch.Tensor]:
        """(y [N, dim], tokens_per_local_expert) for `experts(rows, tokens_per_local_expert)`."""
        rows, state = self.dispatch(x, plan, weights)
        y = self.combine(experts(rows, state.tokens_per_local_expert), state)
        return y, state.tokens_per_local_expert


class LocalDispatcher(TokenDispatcher):
    """Every expert on this rank: dispatch is a permutation, combine the weighted scatter-add back.

    `run` fuses gather -> grouped expert MLP -> weighted scatter into one autograd node
    (`GroupedExperts.forward_tokens`), so no permuted [M, dim] copy of the tokens outlives forward;
    fused=False runs the three steps apart, as every other dispatcher does (same numbers).
    """

    def __init__(self, num_experts: int, fused: bool = True) -> None:
        self.num_local = num_experts
        self.fused = fused

    def dispatch(self, x, plan, weights):
        state = DispatchState(plan, weights, x.shape[0], plan.tokens_per_expert)
        return permute(x, plan), state

    def combine(self, y, state):
        return unpermute(y, state.plan, state.weights, state.num_tokens)

    def run(self, x, plan, weights, experts):
        if not self.fused:
            return super().run(x, plan, weights, experts)
        gate = weights.reshape(-1).index_select(0, plan.slot_index).to(x.dtype)  # [M]
        y = experts.forward_tokens(x, plan.token_index, gate, plan.tokens_per_expert)
        return y, plan.tokens_per_expert


class AllToAllDispatcher(TokenDispatcher):
    """Moves expert-sorted token-slots to the ranks owning their experts and brings the outputs back.

    Expert e lives on ep rank e // E_local. Split sizes are uneven and exchanged first with a small
    all-to-all of per-expert counts; ranks or experts receiving zero tokens are fine.
    """

    def __init__(self, ep_group: ProcessGroup | None, num_experts: int) -> None:
        self.group = ep_group
        self.ep_size = group_size(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size "
                             f"{self.ep_size}; choose num_experts as a multiple of ep")
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size

    def dispatch(self, x, plan, weights):
        """x [N, dim] -> ([R, dim] sorted by local expert, state)."""
        p, el = self.ep_size, self.num_local
        tokens_per_expert = plan.tokens_per_expert
        # received[src * E_local + j] = slots rank src sends to my local expert j
        received = torch.empty_like(tokens_per_expert)
        comm.all_to_all_single(received, tokens_per_expert.contiguous(), self.group)
        input_splits = tokens_per_expert.view(p, el).sum(1).tolist()
        output_splits = received.view(p, el).sum(1).tolist()
        x_recv = comm.all_to_all(permute(x, plan), self.group, output_splits, input_splits)
        # Rows arrive grouped by (source rank, local expert); regroup them by local expert.
        local_expert = torch.arange(el, device=x.device).repeat(p).repeat_interleave(received)
        regroup = torch.argsort(local_expert, stable=True)
        state = _A2AState(plan, weights, x.shape[0], received.view(p, el).sum(0),
                          input_splits, output_splits, regroup)
        return x_recv.index_select(0, regroup), state

    def combine(self, y, state):
        """[R, dim] local expert outputs -> [N, dim]: back to the sending ranks, then to the tokens."""
        y_recv = _inverse_gather(y, state.regroup)
        y_perm = comm.all_to_all(y_recv, self.group, state.input_splits, state.output_splits)
        return unpermute(y_perm, state.plan, state.weights, state.num_tokens)


def _inverse_gather(y: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """out[perm] = y, differentiably (a gather with the inverse permutation)."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return y.index_select(0, inverse)
