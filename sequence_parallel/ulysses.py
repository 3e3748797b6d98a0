"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards around any attention.

Each rank of the SP group holds s/P tokens of every sequence; one all-to-all gives every rank the full
sequence for a block of heads, the attention function runs unchanged, and the inverse all-to-all
returns the rank's own tokens for all heads. Uneven head counts and GQA are handled by the head layout.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from moe_lst.kernels.attention import attention, check_qkv
from moe_lst.kernels.documents import Documents, attend
from torch.distributed import ProcessGroup

from zero.config import ConfigError, key_namer
from zero.contract import AttentionSite, ModelContract, contract_of
from zero.dist import comm
from zero.dist.topology import group_rank, group_size


@dataclass(frozen=True)
class HeadSplit:
    """How the heads of one attention call are divided over the P ranks of the SP group.

    `kv_repeat` is how many times every kv head is replicated before the split (1 = none), chosen as
    the smallest factor that lets each rank own whole kv groups; `q_counts[r]` / `kv_counts[r]` are
    the numbers of query / (replicated) kv heads rank r owns, as contiguous blocks in head order.
    """

    n_heads: int
    n_kv_heads: int
    sp: int
    kv_repeat: int
    q_counts: tuple[int, ...]
    kv_counts: tuple[int, ...]

    @property
    def q_offsets(self) -> tuple[int, ...]:
        return _offsets(self.q_counts)

    @property
    def kv_offsets(self) -> tuple[int, ...]:
        return _offsets(self.kv_counts)

    @property
    def even(self) -> bool:
        return len(set(self.q_counts)) == 1


def _offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return tuple(out)


def check_ulysses_heads(n_heads: int, sp: int, tp: int = 1, keys: Mapping[str, str] | None = None) -> None:
    """Ulysses splits the query heads a rank holds (n_heads / tp under tensor parallelism) over its sp ranks:
    ConfigError unless sp <= n_heads / tp. `keys` names the degrees in the caller's words (zero.config.key_name)."""
    name = key_namer(keys, "ParallelDims")
    per_rank = n_heads // tp
    if sp > per_rank:
        held = f"{n_heads}" if tp == 1 else f"{n_heads} / {name('tp')}={tp} = {per_rank} per rank"
        raise ConfigError(f"Ulysses sequence parallelism splits attention heads over ranks, so {name('sp')}={sp} "
                          f"cannot exceed the number of query heads ({held}): the rule is sp <= n_heads / tp; use "
                          f"{name('sp')} <= {max(per_rank, 1)} and put the remaining ranks into ring attention "
                          "(parallel.cp) or data parallelism")


@functools.lru_cache(maxsize=64)
def head_split(n_heads: int, n_kv_heads: int, sp: int) -> HeadSplit:
    """Split `n_heads` query heads and their kv groups over `sp` ranks.

    A rank must hold the kv head of every query head it owns, so the split is made on kv heads (query
    heads follow in groups of n_heads / n_kv_heads). When there are fewer kv heads than ranks, or a
    finer split balances the query heads better, each kv head is replicated `kv_repeat` times (a
    divisor of the group size, so a replica serves a contiguous sub-group of query heads). Among the
    candidates we take the one with the smallest largest per-rank query-head count (attention cost
    follows query heads), and among those the least replication (communication follows kv heads).
    """
    if n_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of kv heads ({n_kv_heads}) for GQA")
    check_ulysses_heads(n_heads, sp)
    group = n_heads // n_kv_heads
    best: HeadSplit | None = None
    for rep in range(1, group + 1):
        if group % rep:
            continue
        kv_total = n_kv_heads * rep
        if kv_total < sp:
            continue
        base, extra = divmod(kv_total, sp)
        kv_counts = tuple(base + (1 if r < extra else 0) for r in range(sp))
        q_counts = tuple(c * (group // rep) for c in kv_counts)
        if best is None or max(q_counts) < max(best.q_counts):
            best = HeadSplit(n_heads, n_kv_heads, sp, rep, q_counts, kv_counts)
    assert best is not None  # rep == group always qualifies because n_heads >= sp
    return best


def _to_full_sequence(x: torch.Tensor, P: int, b: int, sl: int, d: int) -> torch.Tensor:
    # [P, n, b, s/P, d] (source rank major) -> [b, n, s, d] in memory, returned as a [b, s, n, d] view:
    # attention kernels work head-major, so this layout spares them another copy.
    return x.permute(2, 1, 0, 3, 4).reshape(b, x.shape[1], P * sl, d).transpose(1, 2)


class UlyssesAttention(nn.Module):
    """Attention on sequence shards: q [b, s/P, h, d], k/v [b, s/P, h_kv, d] -> out [b, s/P, h, d].

    Every rank must pass the same local sequence length (use `sequence_parallel.data.shard_sequence`,
    which pads). q, k and v travel in ONE all-to-all (packed per destination rank); the output returns
    in a second one. Both are differentiable, so the backward pass is the two opposite all-to-alls.
    Extra keyword arguments are passed through to `attn_fn`: tensors are per-token, per-query-head inputs
    [b, s/P, h, *] (e.g. native sparse attention's branch gates) and go to the head shards as q does, one
    more all-to-all each; anything else (e.g. `scale`) is passed unchanged.
    Packed documents (`documents=`, `moe_lst.kernels.documents`) are those of this rank's shard: their
    boundaries over the whole sequence are gathered once per forward and the inner attention runs with them.
    """

    handles_documents = True
    wraps_attention = True  # `attn_fn` is the attention it runs (local_attention unwraps it)

    def __init__(self, sp_group: ProcessGroup | None,
                 attn_fn: Callable[..., torch.Tensor] = attention) -> None:
        super().__init__()
        if isinstance(attn_fn, UlyssesAttention):
            raise ValueError("attn_fn is already a UlyssesAttention; wrapping twice would shard heads twice")
        self.sp_group = sp_group
        self.attn_fn = attn_fn

    @property
    def sp(self) -> int:
        return group_size(self.sp_group)

    def extra_repr(self) -> str:
        return f"sp={self.sp}, attn_fn={getattr(self.attn_fn, '__name__', self.attn_fn)}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                documents: Documents | None = None, **kwargs) -> torch.Tensor:
        P = self.sp
        check_qkv(q, k, v, same_seq=True, same_dtype=True, what="UlyssesAttention", seq="local sequence")
        layout = head_split(q.shape[2], k.shape[2], P)  # raises for sp > heads, naming the fix
        if P == 1:
            return attend(self.attn_fn, q, k, v, causal=causal, documents=documents, **kwargs)
        if documents is not None:
            documents = whole_sequence_documents(documents, self.sp_group)
        b, sl, h, d = q.shape
        me = group_rank(self.sp_group)
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                kwargs[name] = self._query_heads_full(name, value, q.shape, layout, me)
        if layout.kv_repeat > 1:
            # Replicas of a kv head serve contiguous sub-groups of its query heads; autograd sums
            # their gradients back into the original head.
            k = k.repeat_interleave(layout.kv_repeat, dim=2)
            v = v.repeat_interleave(layout.kv_repeat, dim=2)

        # Pack q, k, v per destination rank: [b, s/P, heads, d] -> head-major rows [heads, b, s/P, d].
        # torch.split (not slicing) so that backward assembles each gradient with one concatenation
        # instead of one zero-filled full-size tensor per slice.
        q_parts = q.permute(2, 0, 1, 3).split(list(layout.q_counts), dim=0)
        k_parts = k.permute(2, 0, 1, 3).split(list(layout.kv_counts), dim=0)
        v_parts = v.permute(2, 0, 1, 3).split(list(layout.kv_counts), dim=0)
        send = torch.cat([t for j in range(P) for t in (q_parts[j], k_parts[j], v_parts[j])], dim=0)
        nq, nkv = layout.q_counts[me], layout.kv_counts[me]
        n_me = nq + 2 * nkv
        input_splits = [layout.q_counts[j] + 2 * layout.kv_counts[j] for j in range(P)]
        recv = comm.all_to_all(send, self.sp_group, output_splits=[n_me] * P, input_splits=input_splits)
        # Transient buffers are dropped as soon as they are used: they would otherwise live until
        # return and double this layer's peak memory.
        del send, q_parts, k_parts, v_parts
        # One block per source rank (= sequence chunk): [P * n_me, b, s/P, d] -> [P, n_me, b, s/P, d]
        q_recv, k_recv, v_recv = recv.view(P, n_me, b, sl, d).split([nq, nkv, nkv], dim=1)
        q_full = _to_full_sequence(q_recv, P, b, sl, d)  # [b, s, h_me, d]
        k_full = _to_full_sequence(k_recv, P, b, sl, d)  # [b, s, h_kv_me, d]
        v_full = _to_full_sequence(v_recv, P, b, sl, d)
        del recv, q_recv, k_recv, v_recv

        out = attend(self.attn_fn, q_full, k_full, v_full, causal=causal, documents=documents,
                     **kwargs)  # [b, s, h_me, d]
        del q_full, k_full, v_full

        # [b, s, h_me, d] -> [P, h_me, b, s/P, d]: destination rank major, its sequence chunk inside.
        send_out = out.reshape(b, P, sl, nq, d).permute(1, 3, 0, 2, 4).reshape(P * nq, b, sl, d)
        del out
        recv_out = comm.all_to_all(send_out, self.sp_group, output_splits=list(layout.q_counts),
                                   input_splits=[nq] * P)
        return recv_out.permute(1, 2, 0, 3)  # [h, b, s/P, d] -> [b, s/P, h, d]

    def _query_heads_full(self, name: str, x: torch.Tensor, q_shape: torch.Size, layout: HeadSplit,
                          me: int) -> torch.Tensor:
        """A per-query-head tensor [b, s/P, h, e] -> [b, s, h_me, e], split over ranks like q."""
        if x.dim() != 4 or x.shape[:3] != q_shape[:3]:
            raise ValueError(f"UlyssesAttention: tensor argument {name}{tuple(x.shape)} must be [batch, local "
                             f"sequence, heads, *] = [{q_shape[0]}, {q_shape[1]}, {q_shape[2]}, *] like q")
        P, (b, sl, _, e) = self.sp, x.shape
        send = x.permute(2, 0, 1, 3).contiguous()  # [h, b, s/P, e], destination ranks' heads contiguous
        nq = layout.q_counts[me]
        recv = comm.all_to_all(send, self.sp_group, output_splits=[nq] * P, input_splits=list(layout.q_counts))
        return _to_full_sequence(recv.view(P, nq, b, sl, e), P, b, sl, e)


def whole_sequence_documents(documents: Documents, sp_group: ProcessGroup | None) -> Documents:
    """The documents of the whole rows, given those of this rank's contiguous shard of them (shards in rank
    order, as `shard_sequence` cuts them): one all-gather of the shard's position ids, made once per forward
    (kept in `documents.derived`) and shared by every layer."""
    key = ("whole_sequence", id(sp_group))
    if key not in documents.derived:
        local = documents.position_ids.t().contiguous()  # [s/P, b]: shards stack along the sequence
        out = local.new_empty((group_size(sp_group) * local.shape[0], local.shape[1]))
        comm.all_gather_into_tensor(out, local, sp_group)
        documents.derived[key] = Documents(out.t().contiguous())
    return documents.derived[key]


def apply_ulysses(model: nn.Module, sp_group: ProcessGroup | None) -> nn.Module:
    """Wrap the attention function of every attention site of `model` (`zero.contract`: the model's
    `attention_sites()`) in a UlyssesAttention over `sp_group`; sites already wrapped are left alone, and
    a group of one rank (or None) changes nothing. Returns the model (changed in place)."""
    sites = contract_of(model, "apply_ulysses", "attention_sites").attention_sites()
    if group_size(sp_group) == 1:
        return model
    for site in sites:
        fn = site.get()
        if not isinstance(fn, UlyssesAttention):
            site.set(UlyssesAttention(sp_group, attn_fn=fn))
    return model


@contextlib.contextmanager
def local_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every attention site that `apply_ulysses` (or `apply_context_parallel`) wrapped calls its
    inner attention again.

    Each rank then attends over exactly the sequence it is given, with no all-to-all: for running the
    whole of one sequence on every rank (e.g. sampling) while the model stays set up for sequence
    parallelism. On exit, normal or by an exception, the same UlyssesAttention objects are put back.
    A model that is not a contract model has no sites to unwrap. Yields the model.
    """
    sites = model.attention_sites() if isinstance(model, ModelContract) else []
    swapped: list[tuple[AttentionSite, nn.Module]] = []
    try:
        for site in sites:
            wrapper = inner = site.get()
            while getattr(inner, "wraps_attention", False):  # Ulysses, ring attention, or both
                inner = inner.attn_fn
            if inner is not wrapper:
                site.set(inner)
                swapped.append((site, wrapper))
        yield model
    finally:
        for site, wrapper in reversed(swapped):
            site.set(wrapper)
