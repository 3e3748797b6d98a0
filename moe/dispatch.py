"""Token dispatch: sort-based permutation of token-slots into per-expert segments and back.

Dropless by default; with a capacity, each expert keeps its highest-scoring slots. Dispatchers share
one interface (`TokenDispatcher`): the local one keeps every expert on this rank, the all-to-all one
moves the permuted tokens to the ranks that own their experts (expert parallelism). Two slot assignments:
the host one (`assign_slots`, exact-size, the CPU path) and the static one (`assign_slots_static`, every slot
kept in a fixed-size buffer, no host synchronisation: the device path).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from zero.config import ConfigError, key_namer
from zero.dist import comm
from zero.dist.topology import group_size
from zero.parallel.tensor import reduce_scatter_sequence


def check_expert_parallel(num_experts: int, ep: int, keys: Mapping[str, str] | None = None) -> None:
    """ConfigError unless `ep` expert-parallel ranks split `num_experts` experts evenly (each holds num_experts / ep
    of them); `keys` names ep and num_experts in the text (zero.config.key_name)."""
    k = key_namer(keys, "MoELayer")
    if num_experts % ep:
        raise ConfigError(f"{k('ep')}={ep} must divide the {num_experts} experts ({k('num_experts')}): each "
                          f"expert-parallel rank holds num_experts / ep of them; use an ep that divides {num_experts}")


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """capacity = ceil(capacity_factor * tokens * top_k / E) token-slots per expert."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


@dataclass
class SlotAssignment:
    """Where each kept token-slot goes; slots are ordered by expert id (contiguous segments)."""

    token_index: torch.Tensor  # [M] source token of each kept slot, expert-sorted
    slot_index: torch.Tensor  # [M] flat slot id (token * k + j) of each kept slot, to fetch gate weights
    tokens_per_expert: torch.Tensor  # [E] int64 kept slots per expert
    routed_per_expert: torch.Tensor  # [E] int64 slots routed per expert before any drop
    num_slots: int  # N * k
    #: A static assignment (assign_slots_static) lists all N*k slots: the kept ones first, in expert order, then the
    #: dropped ones (capacity mode), so its sizes never depend on the routing and no host sync made it.
    static: bool = False
    drops: bool = False  # static with a capacity: slots past the kept ones carry gate 0
    #: static assignments: [N*k] row of the buffer holding each slot (the inverse of slot_index), so permutation and
    #: combine are gathers both ways (no scatter-add, no atomics, deterministic)
    slot_position: torch.Tensor | None = None

    @property
    def num_dropped(self) -> torch.Tensor:
        return self.routed_per_expert.sum() - self.tokens_per_expert.sum()

    def kept_mask(self) -> torch.Tensor:
        """[num_slots] 1.0 for a kept slot, 0.0 for a dropped one (static assignments: kept slots come first)."""
        slots = torch.arange(self.num_slots, device=self.token_index.device)
        return (slots < self.tokens_per_expert.sum()).float()

    def gemm_counts(self) -> torch.Tensor:
        """[E] rows per expert segment of a static assignment's buffer: the kept slots, with the dropped tail
        appended to the last expert's segment (rows of zeros: `permute` zeroes them, so the last expert computes
        finite values whatever its weights, which the combine weights by 0), so the segments cover every row."""
        if not self.drops:
            return self.tokens_per_expert
        counts = self.tokens_per_expert.clone()
        counts[-1] += self.num_slots - self.tokens_per_expert.sum()
        return counts

    def compacted(self, num_kept: int) -> SlotAssignment:
        """The exact-size assignment of a static assignment's first `num_kept` (its kept) slots, once that number
        is known on the host (expert parallelism exchanges the split sizes anyway)."""
        return SlotAssignment(self.token_index[:num_kept], self.slot_index[:num_kept], self.tokens_per_expert,
                              self.routed_per_expert, self.num_slots)


def count_per_expert(flat_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 occurrences of each expert id in flat_expert [M], without a host sync (torch.bincount
    reads the largest id on the host on CUDA; this is a fixed-size scatter). The same integers as bincount."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_expert.device)
    return counts.index_add_(0, flat_expert, torch.ones_like(flat_expert, dtype=torch.int64))


def assign_slots(indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
              capacity: int | None = None) -> SlotAssignment:
    """Assign the slots for indices/weights [N, k]; no one-hot [N, E, C] tensors anywhere.

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
    return SlotAssignment(token_index=order // k, slot_index=order, tokens_per_expert=kept,
                        routed_per_expert=routed, num_slots=n * k)


def assign_slots_static(indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     capacity: int | None = None) -> SlotAssignment:
    """The assignment of `assign_slots` with no host synchronisation: every tensor has a size known before routing.

    The slot order is assign_slots's (the same stable sorts), so the kept slots are the same rows in the same
    order. Dropless, the two assignments are equal. With `capacity`, the dropped slots are not cut out (that
    would size a tensor by the routing) but moved behind the kept ones by one more stable sort; the
    dispatchers give them gate weight 0 (`SlotAssignment.kept_mask`).
    """
    n, k = indices.shape
    flat_expert = indices.reshape(-1)  # [N, k] -> [N*k]
    routed = count_per_expert(flat_expert, num_experts)
    if capacity is None:
        order = torch.argsort(flat_expert, stable=True)
        kept = routed
    else:
        by_score = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
        order = by_score[torch.argsort(flat_expert[by_score], stable=True)]
        # Position of every sorted slot inside its expert's segment (a gather, not repeat_interleave).
        starts = torch.cumsum(routed, 0) - routed
        position = torch.arange(order.numel(), device=order.device) - starts.index_select(0, flat_expert[order])
        dropped = (position >= capacity).to(torch.uint8)
        order = order[torch.argsort(dropped, stable=True)]  # kept slots first, each group still in expert order
        kept = routed.clamp(max=capacity)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return SlotAssignment(token_index=order // k, slot_index=order, tokens_per_expert=kept, routed_per_expert=routed,
                        num_slots=n * k, static=True, drops=capacity is not None, slot_position=position)


def permute(x: torch.Tensor, assignment: SlotAssignment) -> torch.Tensor:
    """x [N, dim] -> [M, dim] token copies grouped by expert."""
    if assignment.static and x.shape[0]:
        keep = None
        if assignment.drops:  # the dropped tail enters the GEMM as zeros: a non-finite row times gate 0 would be NaN
            slots = torch.arange(assignment.num_slots, device=x.device)
            keep = (slots < assignment.tokens_per_expert.sum()).unsqueeze(1)  # [N*k, 1], on the device: no sync
        return _GatherTokens.apply(x, assignment.token_index, assignment.slot_position, keep)
    return x.index_select(0, assignment.token_index)


class _GatherTokens(torch.autograd.Function):
    """rows = x[token_index] for a static assignment (every token's k slots in the buffer); backward gathers each
    token's k row gradients through slot_position and sums them, instead of scatter-adding them. `keep` [rows, 1]
    (capacity mode, else None): rows where it is False (dropped slots) are zeros, and pass no gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_index: torch.Tensor, slot_position: torch.Tensor,
                keep: torch.Tensor | None = None):
        ctx.save_for_backward(slot_position, keep)
        ctx.num_tokens = x.shape[0]
        rows = x.index_select(0, token_index)
        return rows if keep is None else rows.masked_fill_(~keep, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slot_position, keep = ctx.saved_tensors
        n = ctx.num_tokens
        if keep is not None:
            grad = grad.masked_fill(~keep, 0)
        # [N*k, dim] in slot order (token * k + j) -> [N, k, dim] -> sum over a token's k slots
        return grad.index_select(0, slot_position).view(n, -1, grad.shape[-1]).sum(1), None, None, None


class _Permutation(torch.autograd.Function):
    """y[p] = x[perm[p]] for a permutation; backward the same gather by the inverse permutation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _combine_static(y: torch.Tensor, assignment: SlotAssignment, weights: torch.Tensor,
                    num_tokens: int) -> torch.Tensor:
    """[N*k, dim] expert outputs of a static assignment -> [N, dim]: every token's k slot outputs gathered next to
    each other (slot order), weighted by their gates and summed; a dropped slot's gate is 0."""
    gate = weights.reshape(-1).to(y.dtype)  # [N*k] in slot order
    if assignment.drops:
        gate = gate * assignment.kept_mask().index_select(0, assignment.slot_position).to(gate.dtype)
    by_slot = _Permutation.apply(y, assignment.slot_position, assignment.slot_index)  # [N*k, dim], slot s at row s
    return (by_slot.view(num_tokens, -1, y.shape[-1]) * gate.view(num_tokens, -1, 1)).sum(1)


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


def unpermute(y: torch.Tensor, assignment: SlotAssignment, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[M, dim] expert outputs -> [N, dim]: weight by the gate and scatter-add back to their tokens.

    Dropped slots add nothing, so a token whose every slot was dropped gets zero (the residual path).
    """
    if assignment.static and num_tokens:
        return _combine_static(y, assignment, weights, num_tokens)
    gate = weights.reshape(-1).index_select(0, assignment.slot_index).to(y.dtype)  # [M]
    return _WeightedScatterAdd.apply(y, gate, assignment.token_index, num_tokens)


@dataclass
class DispatchState:
    """What `combine` needs to bring one `dispatch`'s expert outputs back to their tokens."""

    assignment: SlotAssignment
    weights: torch.Tensor  # [N, k] gate weights of the routing decision
    shape: torch.Size  # the tokens' shape [..., dim] (N tokens): what combine gives back
    tokens_per_local_expert: torch.Tensor  # [E_local] rows this rank's experts compute

    @property
    def num_tokens(self) -> int:
        return self.weights.shape[0]


@dataclass
class _A2AState(DispatchState):
    input_splits: list[int]  # rows sent to each ep rank
    output_splits: list[int]  # rows received from each ep rank
    regroup: torch.Tensor  # [R] received-row order that makes local-expert segments contiguous


class TokenDispatcher:
    """Moves routed tokens to the experts that compute them and their outputs back: one interface.

    dispatch(x [..., dim], assignment, weights [N, k]) -> (rows [R, dim] for this rank's experts in contiguous
    per-local-expert segments, state); combine(expert outputs [R, dim], state, shared) -> y [..., dim], the
    gate-weighted sum over each token's experts (dropped slots add nothing) plus `shared` (the shared
    experts' output for the same tokens, or None). `run` is what MoELayer calls: dispatch -> experts ->
    combine, which a dispatcher may fuse. A wrapper may change what combine returns: with expert tensor
    parallelism (`ExpertTensorParallelDispatcher`) it is this rank's sequence shard of the summed output.
    """

    num_local: int

    def dispatch(self, x: torch.Tensor, assignment: SlotAssignment,
                 weights: torch.Tensor) -> tuple[torch.Tensor, DispatchState]:
        raise NotImplementedError

    def combine(self, y: torch.Tensor, state: DispatchState, shared: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def run(self, x: torch.Tensor, assignment: SlotAssignment, weights: torch.Tensor, experts,
            shared: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(y [..., dim], tokens_per_local_expert) for `experts(rows, tokens_per_local_expert)` and the
        shared experts `shared(x [N, dim])` (None: none)."""
        rows, state = self.dispatch(x, assignment, weights)
        out = shared(x.reshape(-1, x.shape[-1])) if shared is not None else None
        if assignment.static:  # the device path: grouped GEMMs with device-side offsets, nothing read on the host
            expert_out = experts(rows, state.tokens_per_local_expert, sync_free=True)
        else:
            expert_out = experts(rows, state.tokens_per_local_expert)
        y = self.combine(expert_out, state, out)
        return y, state.tokens_per_local_expert


def _with_shared(y: torch.Tensor, shared: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """[N, dim] routed output (+ the shared experts' output) in the tokens' shape."""
    return (y if shared is None else y + shared).view(shape)


class LocalDispatcher(TokenDispatcher):
    """Every expert on this rank: dispatch is a permutation, combine the weighted scatter-add back.

    `run` fuses gather -> grouped expert MLP -> weighted scatter into one autograd node
    (`GroupedExperts.forward_tokens`), so no permuted [M, dim] copy of the tokens outlives forward;
    fused=False runs the three steps apart, as every other dispatcher does (same numbers). A static assignment
    (the device path) always runs them apart: permutation, grouped GEMMs on device-side offsets, combine.
    """

    def __init__(self, num_experts: int, fused: bool = True) -> None:
        self.num_local = num_experts
        self.fused = fused

    def dispatch(self, x, assignment, weights):
        # a static assignment's buffer holds every slot: its segments include the dropped tail (gemm_counts)
        counts = assignment.gemm_counts() if assignment.static else assignment.tokens_per_expert
        state = DispatchState(assignment, weights, x.shape, counts)
        return permute(x.reshape(-1, x.shape[-1]), assignment), state

    def combine(self, y, state, shared=None):
        return _with_shared(unpermute(y, state.assignment, state.weights, state.num_tokens), shared, state.shape)

    def run(self, x, assignment, weights, experts, shared=None):
        if assignment.static:  # report the slots kept (as the host path does), not the rows computed
            return super().run(x, assignment, weights, experts, shared)[0], assignment.tokens_per_expert
        if not self.fused:
            return super().run(x, assignment, weights, experts, shared)
        flat = x.reshape(-1, x.shape[-1])
        gate = weights.reshape(-1).index_select(0, assignment.slot_index).to(x.dtype)  # [M]
        y = experts.forward_tokens(flat, assignment.token_index, gate, assignment.tokens_per_expert)
        return _with_shared(y, shared(flat) if shared is not None else None, x.shape), assignment.tokens_per_expert


class AllToAllDispatcher(TokenDispatcher):
    """Moves expert-sorted token-slots to the ranks owning their experts and brings the outputs back.

    Expert e lives on ep rank e // E_local. Split sizes are uneven and exchanged first with a small
    all-to-all of per-expert counts; ranks or experts receiving zero tokens are fine.
    """

    def __init__(self, ep_group: ProcessGroup | None, num_experts: int) -> None:
        self.group = ep_group
        self.ep_size = group_size(ep_group)
        check_expert_parallel(num_experts, self.ep_size)
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size

    def dispatch(self, x, assignment, weights):
        """x [..., dim] (N tokens) -> ([R, dim] sorted by local expert, state)."""
        if assignment.static:
            return self._dispatch_static(x, assignment, weights)
        p, el = self.ep_size, self.num_local
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        tokens_per_expert = assignment.tokens_per_expert
        # received[src * E_local + j] = slots rank src sends to my local expert j
        received = torch.empty_like(tokens_per_expert)
        comm.all_to_all_single(received, tokens_per_expert.contiguous(), self.group)
        input_splits = tokens_per_expert.view(p, el).sum(1).tolist()
        output_splits = received.view(p, el).sum(1).tolist()
        x_recv = comm.all_to_all(permute(x, assignment), self.group, output_splits, input_splits)
        # Rows arrive grouped by (source rank, local expert); regroup them by local expert.
        local_expert = torch.arange(el, device=x.device).repeat(p).repeat_interleave(received)
        regroup = torch.argsort(local_expert, stable=True)
        state = _A2AState(assignment, weights, shape, received.view(p, el).sum(0), input_splits, output_splits, regroup)
        return x_recv.index_select(0, regroup), state

    def _dispatch_static(self, x, assignment, weights):
        """dispatch for a static assignment (the device path): the split sizes, read on the host in one transfer, are
        its one host synchronisation; the kept slots (the assignment's first rows) travel, exactly as assign_slots's."""
        p, el = self.ep_size, self.num_local
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        received = torch.empty_like(assignment.tokens_per_expert)
        comm.all_to_all_single(received, assignment.tokens_per_expert.contiguous(), self.group)
        splits = torch.stack([assignment.tokens_per_expert.view(p, el).sum(1), received.view(p, el).sum(1)])
        input_splits, output_splits = splits.tolist()  # the permitted exchange: all-to-all sizes
        assignment = assignment.compacted(sum(input_splits))
        x_recv = comm.all_to_all(permute(x, assignment), self.group, output_splits, input_splits)
        local_expert = torch.arange(el, device=x.device).repeat(p).repeat_interleave(
            received, output_size=sum(output_splits))  # the size is known: no second sync
        regroup = torch.argsort(local_expert, stable=True)
        state = _A2AState(assignment, weights, shape, received.view(p, el).sum(0), input_splits, output_splits, regroup)
        return x_recv.index_select(0, regroup), state

    def combine(self, y, state, shared=None):
        """[R, dim] local expert outputs -> [..., dim]: back to the sending ranks, then to the tokens."""
        y_recv = _inverse_gather(y, state.regroup)
        y_perm = comm.all_to_all(y_recv, self.group, state.input_splits, state.output_splits)
        return _with_shared(unpermute(y_perm, state.assignment, state.weights, state.num_tokens), shared, state.shape)


class ExpertTensorParallelDispatcher(TokenDispatcher):
    """Expert tensor parallelism at the dispatcher boundary, around the dispatcher that moves the tokens.

    Every tp rank routes the same full sequence (gathered by the norm before the layer) and its experts
    (routed and shared) hold a slice of each expert's hidden units, so each computes a partial sum of the
    output; combine sums the partials over `tp_group` and scatters the sequence (dim -2 of [..., s, dim])
    back to this rank's shard, in one reduce-scatter for routed and shared experts together.
    """

    def __init__(self, inner: TokenDispatcher, tp_group: ProcessGroup | None) -> None:
        if isinstance(inner, ExpertTensorParallelDispatcher):
            raise ValueError("this dispatcher is already expert-tensor-parallel")
        self.inner, self.group = inner, tp_group
        self.num_local = inner.num_local

    def _scatter(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_sequence(y, self.group, dim=max(y.dim() - 2, 0))

    def dispatch(self, x, assignment, weights):
        return self.inner.dispatch(x, assignment, weights)

    def combine(self, y, state, shared=None):
        return self._scatter(self.inner.combine(y, state, shared))

    def run(self, x, assignment, weights, experts, shared=None):
        y, local_counts = self.inner.run(x, assignment, weights, experts, shared)
        return self._scatter(y), local_counts


def _inverse_gather(y: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """out[perm] = y, differentiably (a gather with the inverse permutation)."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return y.index_select(0, inverse)
