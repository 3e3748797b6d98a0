"""Ring attention (context parallelism) over a cp process group, alone or inside Ulysses (sp inside, cp across).

Each ring rank holds two mirrored chunks of every row (chunks c and 2cp-1-c of 2cp, so causal work is even over the
ring). The keys and values of the other ranks arrive block by block while the current block computes; partial
outputs are merged exactly by their log-sum-exp; backward sends dK/dV back to the ranks that own them. Dense
attention (causal or bidirectional, packed documents) passes whole blocks around the ring; a block-sparse layout
is routed by the layout: a rank receives only the chunks some query of it attends (a sliding window: neighbours).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.nn as nn
from moe_lst.kernels.attention import attention, check_qkv
from moe_lst.kernels.documents import Documents, document_ids
from moe_lst.kernels.nsa import NativeSparseAttention
from moe_lst.kernels.sparse import BlockLayout, SparseAttention, SparseConfig, block_layout, native_kernel
from torch.distributed import ProcessGroup

from sequence_parallel.data import check_context_parallel_length
from sequence_parallel.ulysses import UlyssesAttention
from zero.config import ConfigError, key_namer
from zero.contract import contract_of
from zero.dist import comm
from zero.dist.topology import group_rank, group_size

_NEG_INF = float("-inf")
# Scores held at once by the dense pair kernel ([batch, heads, rows, keys] fp32): 16 MiB per tile of query rows.
_TILE_ELEMENTS = 1 << 22
_KV_TAG, _GRAD_TAG = 0, 1
#: The attentions the ring runs (model.attention's words): dense attention and block-sparse layouts.
RING_ATTENTIONS = ("dense", "sparse")


class RingRefusal(ConfigError, NotImplementedError):
    """What the ring does not run: a ConfigError (the recipe refuses it before any process group exists) that is
    also a NotImplementedError (the runtime names the missing capability)."""


def check_ring(attention: str, seq_len: int | None = None, sp: int = 1, cp: int = 1, block_size: int | None = None,
               packed_documents: bool = False, keys: Mapping[str, str] | None = None) -> None:
    """The ring's rules, on numbers alone: `attention` ("dense", "sparse" with its layout's `block_size`, "nsa" or a
    function's name) over rows of `seq_len` tokens cut into 2 * cp mirrored chunks of sp pieces, with packed
    documents or not. The one copy of these rules: RingAttention checks them at construction and forward, the
    recipe's config check before any process group exists. `keys` names the values in the caller's words
    ("RingAttention.<name>", zero.config.key_name). Raises ConfigError (a RingRefusal for what is not implemented)."""
    k = key_namer(keys, "RingAttention")
    if attention not in RING_ATTENTIONS:
        _refuse_attention(attention, k)
    if seq_len is None:
        return
    try:
        check_context_parallel_length(seq_len, sp, cp)
    except ValueError as e:
        raise ConfigError(f"{k('seq_len')}={seq_len} with {k('cp')}={cp}: {e}") from None
    if attention == "sparse":
        _blocks_per_chunk(block_size, seq_len, cp, k)
        if packed_documents:
            raise RingRefusal(f"ring attention ({k('cp')}) runs block-sparse layouts on unpacked rows only: a layout "
                              f"per packed document is not implemented; pack rows without documents ({k('packing')}="
                              f"concat) or use {k('sp')} for sparse attention over packed documents")


def _refuse_attention(attention: str, k: Callable[[str], str]) -> NoReturn:
    """RingRefusal for an attention the ring does not run ("nsa", or a function's name)."""
    if attention == "nsa":
        raise RingRefusal(f"ring attention ({k('cp')}) does not run native sparse attention: its selected branch picks "
                          "key blocks per query from the compressed keys of the whole row, and a ring of fixed chunks "
                          f"has no exchange of compressed keys or per-query block routing; use {k('sp')} (Ulysses) "
                          f"for {k('attention')}=nsa")
    raise RingRefusal(f"ring attention ({k('cp')}) runs dense attention and block-sparse layouts, not {attention}: "
                      f"a ring needs the attention's mask per pair of chunks; use {k('sp')}")


def ring_attention_kind(attn_fn: Callable[..., torch.Tensor]) -> SparseConfig | None:
    """What the ring runs for `attn_fn`: None for the dense `attention`, the layout's config for a
    `SparseAttention`; any other attention (NSA, a model's own function) is refused in `check_ring`'s words."""
    if attn_fn is attention or getattr(attn_fn, "takes_window_and_sinks", False):
        return None  # dense (a Hugging Face model's dense attention also passes sliding windows: masked exactly)
    if isinstance(attn_fn, SparseAttention):
        return attn_fn.config
    name = "nsa" if isinstance(attn_fn, NativeSparseAttention) else getattr(attn_fn, "__name__", repr(attn_fn))
    _refuse_attention(name, key_namer(None, "RingAttention"))


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp) ring rank `rank` holds: its own and the mirrored one."""
    return rank, 2 * cp - 1 - rank


def sparse_chunk_pairs(config: SparseConfig, seq_len: int, cp: int, causal: bool = True) -> torch.Tensor:
    """bool [2cp, 2cp]: whether some query of chunk i attends some key of chunk j under the layout."""
    layout = block_layout(config, seq_len, causal)
    nb = _blocks_per_chunk(config.block_size, seq_len, cp)
    n_chunks = 2 * cp
    valid = torch.arange(layout.cols.shape[-1]) < layout.counts[..., None]
    rows = (torch.arange(layout.num_blocks) // nb)[:, None].expand_as(layout.cols)
    out = torch.zeros(n_chunks, n_chunks, dtype=torch.bool)
    out[rows[valid], layout.cols[valid] // nb] = True
    return out


def ring_slots(pairs: torch.Tensor, cp: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """slots[c][s]: which of ring rank s's two chunks (0: its own, 1: the mirrored) rank c's queries attend."""
    return tuple(tuple(tuple(slot for slot, j in enumerate(chunks_of(s, cp))
                             if any(bool(pairs[i, j]) for i in chunks_of(c, cp))) for s in range(cp))
                 for c in range(cp))


def ring_bytes_per_rank(seq_len: int, batch: int, kv_heads: int, head_dim: int, cp: int, element_size: int,
                        sparse: SparseConfig | None = None, causal: bool = True) -> list[dict[str, int]]:
    """Bytes each ring rank sends for one attention call, {"forward": ..., "backward": ...}: what `RingAttention`
    puts through `zero.dist.comm` (p2p), for the planner and the tests. Keys and values travel in the input dtype
    (`element_size`), dK/dV in fp32. Dense: both chunks pass around the ring (cp-1 hops, again in backward, and
    cp-1 hops of dK/dV); a layout: each rank sends another only the chunks its queries attend, and gets their
    dK/dV back."""
    chunk = seq_len // (2 * cp)
    kv_chunk = batch * chunk * kv_heads * 2 * head_dim  # elements of one chunk's keys and values
    if sparse is None:
        forward = (cp - 1) * 2 * kv_chunk * element_size
        return [{"forward": forward, "backward": forward + (cp - 1) * 2 * kv_chunk * 4} for _ in range(cp)]
    slots = ring_slots(sparse_chunk_pairs(sparse, seq_len, cp, causal), cp)
    out = []
    for me in range(cp):
        sent = sum(len(slots[dst][me]) for dst in range(cp) if dst != me) * kv_chunk * element_size
        grads = sum(len(slots[me][src]) for src in range(cp) if src != me) * kv_chunk * 4
        out.append({"forward": sent, "backward": sent + grads})
    return out


def _blocks_per_chunk(block_size: int, seq_len: int, cp: int, k: Callable[[str], str] = str) -> int:
    chunk = seq_len // (2 * cp)
    if chunk % block_size:
        raise ConfigError(f"ring attention with a block-sparse layout needs each of the 2 * {k('cp')} = {2 * cp} "
                          f"chunks of the {seq_len}-token row ({chunk} tokens) to be whole blocks of "
                          f"{k('block_size')}={block_size}; use a {k('seq_len')} that is a multiple of "
                          f"{2 * cp * block_size}")
    return chunk // block_size


# ------------------------------------------------------------------------------------ one pair of chunks
def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp with rows that attend nothing (-inf) set to 0, so exp(score - lse) of their
    (all -inf) scores is 0 instead of nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _dense_pair_forward(q, k, v, scale, mask_rows):
    """softmax attention of q [b, Lq, h, d] over k, v [b, Lk, hk, d] in fp32, the mask of query rows r0:r1
    given by `mask_rows(r0, r1)` (bool [b or 1, rows, Lk], or None: all keys): (out [b, Lq, h, d], lse [b, h, Lq]).
    Tiled over query rows so the scores never exceed _TILE_ELEMENTS."""
    b, lq, h, d = q.shape
    hk, lk = k.shape[2], k.shape[1]
    g = h // hk
    qh = q.float().reshape(b, lq, hk, g, d).permute(0, 2, 3, 1, 4)  # [b, hk, g, Lq, d]
    kt = k.float().permute(0, 2, 3, 1)[:, :, None]  # [b, hk, 1, d, Lk]
    vh = v.float().permute(0, 2, 1, 3)[:, :, None]  # [b, hk, 1, Lk, d]
    out = torch.empty(b, hk, g, lq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hk, g, lq, dtype=torch.float32, device=q.device)
    tile = max(1, _TILE_ELEMENTS // max(1, b * h * lk))
    for r0 in range(0, lq, tile):
        r1 = min(lq, r0 + tile)
        scores = torch.matmul(qh[:, :, :, r0:r1], kt).mul_(scale)  # [b, hk, g, rows, Lk]
        mask = mask_rows(r0, r1)
        if mask is not None:
            scores.masked_fill_(~mask[:, None, None], _NEG_INF)
        rows_lse = torch.logsumexp(scores, dim=-1)
        scores.sub_(_finite(rows_lse)[..., None]).exp_()
        torch.matmul(scores, vh, out=out[:, :, :, r0:r1])
        lse[:, :, :, r0:r1] = rows_lse
    return out.permute(0, 3, 1, 2, 4).reshape(b, lq, h, d), lse.reshape(b, h, lq)


def _dense_pair_backward(q, k, v, dout, out, lse, scale, mask_rows):
    """Gradients (dq, dk, dv) in fp32 of one pair's share of the attention, from the final output `out` and
    log-sum-exp `lse` (of all pairs: then each pair's probabilities are the final ones)."""
    b, lq, h, d = q.shape
    hk, lk = k.shape[2], k.shape[1]
    g = h // hk
    qh = q.float().reshape(b, lq, hk, g, d).permute(0, 2, 3, 1, 4)  # [b, hk, g, Lq, d]
    doh = dout.float().reshape(b, lq, hk, g, d).permute(0, 2, 3, 1, 4)
    delta = (dout.float() * out).sum(-1).reshape(b, lq, hk, g).permute(0, 2, 3, 1)  # [b, hk, g, Lq]
    lse = _finite(lse).reshape(b, hk, g, lq)
    kh = k.float().permute(0, 2, 1, 3)[:, :, None]  # [b, hk, 1, Lk, d]
    vh = v.float().permute(0, 2, 1, 3)[:, :, None]
    dq = torch.empty_like(qh)
    dk = torch.zeros(b, hk, lk, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    tile = max(1, _TILE_ELEMENTS // max(1, b * h * lk))
    for r0 in range(0, lq, tile):
        r1 = min(lq, r0 + tile)
        qt, dot = qh[:, :, :, r0:r1], doh[:, :, :, r0:r1]
        p = torch.matmul(qt, kh.transpose(-1, -2)).mul_(scale)  # [b, hk, g, rows, Lk]
        mask = mask_rows(r0, r1)
        if mask is not None:
            p.masked_fill_(~mask[:, None, None], _NEG_INF)
        p.sub_(lse[:, :, :, r0:r1, None]).exp_()
        dv += torch.matmul(p.transpose(-1, -2), dot).sum(2)
        ds = torch.matmul(dot, vh.transpose(-1, -2)).sub_(delta[:, :, :, r0:r1, None]).mul_(p)
        dq[:, :, :, r0:r1] = torch.matmul(ds, kh).mul_(scale)
        dk += torch.matmul(ds.transpose(-1, -2), qt).sum(2).mul_(scale)
    return (dq.permute(0, 3, 1, 2, 4).reshape(b, lq, h, d), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3))


class _PairMasks:
    """The attention between chunk i's queries and chunk j's keys, for one forward: which pairs attend anything,
    and their forward and backward (dense masks from global positions and documents; a layout's blocks through the
    block-sparse CPU kernel, or as a token mask where that kernel does not run)."""

    def __init__(self, chunk: int, causal: bool, doc_ids: torch.Tensor | None, layout: BlockLayout | None,
                 window: int | None = None) -> None:
        self.chunk, self.causal, self.doc_ids, self.layout, self.window = chunk, causal, doc_ids, layout, window
        self._local: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def needed(self, i: int, j: int) -> bool:
        if self.layout is not None:
            return self._local_layout(i, j) is not None
        L = self.chunk
        if self.window is not None and (j + 1) * L - 1 <= i * L - self.window:  # every key before every window
            return False
        return not (self.causal and j > i)

    def _local_layout(self, i: int, j: int):
        """The layout's blocks of query chunk i in key chunk j, in the pair's own block numbers: (cols [nb, w],
        counts [nb]), or None if the pair attends nothing."""
        if (i, j) not in self._local:
            lay, nb = self.layout, self.chunk // self.layout.block_size
            cols, counts = lay.cols[i * nb:(i + 1) * nb], lay.counts[i * nb:(i + 1) * nb]
            valid = torch.arange(cols.shape[-1]) < counts[:, None]
            inside = valid & (cols >= j * nb) & (cols < (j + 1) * nb)
            n_in = inside.sum(-1)
            width = int(n_in.max()) if n_in.numel() else 0
            if width == 0:
                self._local[(i, j)] = None
            else:
                start = (valid & (cols < j * nb)).sum(-1)  # a row's key blocks ascend: the pair's are contiguous
                slot = torch.arange(width)
                picked = cols.gather(-1, (start[:, None] + slot).clamp(max=cols.shape[-1] - 1)) - j * nb
                local = torch.where(slot < n_in[:, None], picked, torch.zeros_like(picked))
                self._local[(i, j)] = (local.contiguous(), n_in.contiguous())
        return self._local[(i, j)]

    def _native(self, q: torch.Tensor) -> bool:
        if q.is_cuda:
            return False
        try:
            native_kernel()
        except RuntimeError:
            return False
        return True

    def _mask_rows(self, i: int, j: int, device) -> Callable:
        L = self.chunk
        if self.layout is not None:
            cols, counts = self._local_layout(i, j)
            B = self.layout.block_size
            blocks = torch.zeros(L // B, L // B + 1, dtype=torch.bool)
            blocks.scatter_(-1, torch.where(torch.arange(cols.shape[-1]) < counts[:, None], cols, L // B), True)
            token = blocks[:, : L // B].repeat_interleave(B, 0).repeat_interleave(B, 1).to(device)
            if self.causal and i == j:
                token &= torch.ones(L, L, dtype=torch.bool, device=device).tril()
            return lambda r0, r1: token[None, r0:r1]
        docs, window = self.doc_ids, self.window
        diagonal = self.causal and i == j
        if docs is None and not diagonal and window is None:
            return lambda r0, r1: None
        keys = torch.arange(L, device=device)

        def rows(r0: int, r1: int) -> torch.Tensor:
            mask = None
            if diagonal:
                mask = (keys[None, :] <= torch.arange(r0, r1, device=device)[:, None])[None]
            if window is not None:  # key j is seen by query i when i - window < j (global positions)
                near = (j * L + keys[None, :] > i * L + torch.arange(r0, r1, device=device)[:, None] - window)[None]
                mask = near if mask is None else mask & near
            if docs is not None:
                same = docs[:, i * L + r0:i * L + r1, None] == docs[:, None, j * L:(j + 1) * L]
                mask = same if mask is None else mask & same
            return mask
        return rows

    def forward(self, i, j, q, k, v, scale):
        if self.layout is not None and self._native(q):
            cols, counts = self._local_layout(i, j)
            nb, w = cols.shape
            out, lse = native_kernel().forward(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                               cols.view(1, 1, nb, w), counts.view(1, 1, nb),
                                               self.layout.block_size, self.causal and i == j, scale)
            return out, lse
        return _dense_pair_forward(q, k, v, scale, self._mask_rows(i, j, q.device))

    def backward(self, i, j, q, k, v, dout, out, lse, scale):
        if self.layout is not None and self._native(q):
            cols, counts = self._local_layout(i, j)
            nb, w = cols.shape
            return native_kernel().backward(dout.float().contiguous(), q.float().contiguous(),
                                            k.float().contiguous(), v.float().contiguous(), out.contiguous(),
                                            lse.contiguous(), cols.view(1, 1, nb, w), counts.view(1, 1, nb),
                                            self.layout.block_size, self.causal and i == j, scale)
        return _dense_pair_backward(q, k, v, dout, out, lse, scale, self._mask_rows(i, j, q.device))

    def backward_add(self, i, j, q, k, v, dout, out, lse, scale, dq, dk, dv) -> None:
        """`backward`'s gradients added into dq [b, L, h, d], dk and dv [b, L, hk, d] (fp32): the block-sparse CPU
        kernel adds them in place (no gradient tensors of the pair's own) where q, k, v and the targets are
        contiguous fp32; otherwise they are computed, then added."""
        targets = (dq, dk, dv)
        if self.layout is not None and self._native(q) and all(t.is_contiguous() for t in targets):
            cols, counts = self._local_layout(i, j)
            nb, w = cols.shape
            q, k, v, dout = (x.float().contiguous() for x in (q, k, v, dout))  # (views of one row: no copy)
            native_kernel().backward_into(dout, q, k, v, out.contiguous(), lse.contiguous(), cols.view(1, 1, nb, w),
                                          counts.view(1, 1, nb), self.layout.block_size, self.causal and i == j,
                                          scale, dq, dk, dv)
            return
        for target, grad in zip(targets, self.backward(i, j, q, k, v, dout, out, lse, scale)):
            target += grad


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part, first: bool) -> None:
    """Merge a partial attention `part` (out [b, L, h, d], lse [b, h, L], over keys disjoint from those already
    merged) into `out` and `lse` in place (`first`: nothing merged yet, so it is copied). `part` is consumed."""
    o2, l2 = part
    if first:
        out.copy_(o2)
        lse.copy_(l2)
        return
    new = torch.logaddexp(lse, l2)
    safe = _finite(new)
    w1 = torch.exp(lse - safe).transpose(1, 2)[..., None]  # [b, h, L] -> [b, L, h, 1]
    w2 = torch.exp(l2 - safe).transpose(1, 2)[..., None]
    out.mul_(w1).add_(o2.mul_(w2))
    lse.copy_(new)


# ------------------------------------------------------------------------------------ the ring
@dataclass
class _Ring:
    """One call's ring: the group, this rank, the pair masks, and how key/value chunks travel (`slots` None:
    whole blocks pass around the ring; else slots[c][s] of rank s's chunks go to rank c directly)."""

    group: ProcessGroup | None
    cp: int
    me: int
    chunk: int
    masks: _PairMasks
    scale: float
    slots: tuple | None

    def _fetch(self, t: int, own: tuple, current):
        """Start the transfer of step t's keys and values (of ring rank me - t): (handles, buffer, slots)."""
        if t >= self.cp:
            return [], None, ()
        cp, me, L = self.cp, self.me, self.chunk
        k = own[0]
        per_chunk = (k.shape[0], L, *k.shape[2:])  # one chunk's keys (or values): [b, L, hk, d]
        if self.slots is None:  # a ring: pass on what this rank computed with, take the previous rank's
            buffer = k.new_empty((2, 2, *per_chunk))
            handles = comm.send_recv([(_message(current, (0, 1), L), (me + 1) % cp)], [(buffer, (me - 1) % cp)],
                                     self.group, _KV_TAG)
            return handles, buffer, (0, 1)
        src, dst = (me - t) % cp, (me + t) % cp
        send_slots, recv_slots = self.slots[dst][me], self.slots[me][src]
        sends = [(_message(own, send_slots, L), dst)] if send_slots else []
        buffer = k.new_empty((2, len(recv_slots), *per_chunk)) if recv_slots else None
        recvs = [(buffer, src)] if recv_slots else []
        return comm.send_recv(sends, recvs, self.group, _KV_TAG), buffer, recv_slots

    def _pairs(self, src: int, slots: tuple[int, ...]):
        """(query slot, key slot index in the buffer, query chunk, key chunk) of every pair this step computes."""
        for qs, i in enumerate(chunks_of(self.me, self.cp)):
            for n, ks in enumerate(slots):
                j = chunks_of(src, self.cp)[ks]
                if self.masks.needed(i, j):
                    yield qs, n, i, j

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        L = self.chunk
        own = (k, v)  # this rank's chunks, read in place; messages are packed per send
        b, _, h, d = q.shape
        # The output and log-sum-exp of both chunks, each pair merged into them in place as it is computed.
        out = torch.zeros((b, 2 * L, h, d), dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, 2 * L), _NEG_INF, dtype=torch.float32, device=q.device)  # no key yet
        merged = [False, False]
        current, slots = own, (0, 1)
        for t in range(self.cp):
            src = (self.me - t) % self.cp
            handles, nxt, nxt_slots = self._fetch(t + 1, own, current)  # in flight while this step computes
            for qs, n, i, j in self._pairs(src, slots):
                kj, vj = _keys_values(current, n, L)
                rows = slice(qs * L, (qs + 1) * L)
                part = self.masks.forward(i, j, q[:, rows], kj, vj, self.scale)
                _merge_into(out[:, rows], lse[:, :, rows], part, not merged[qs])
                merged[qs] = True
                del part, kj, vj
            for hd in handles:
                hd.wait()
            current, slots = nxt, nxt_slots
        return out, lse

    def backward(self, q, k, v, dout, out, lse):
        L, cp, me = self.chunk, self.cp, self.me
        own = (k, v)
        b, _, hk, d = k.shape
        # dQ of the two chunks [2 (chunks), b, L, h, d] and dK, dV [2 (dK, dV), 2 (chunks), b, L, hk, d] (as they
        # travel): each chunk's contiguous, the kernel adds into them
        dq = torch.zeros((2, b, L, *q.shape[2:]), dtype=torch.float32, device=q.device)
        d_own = torch.zeros((2, 2, b, L, hk, d), dtype=torch.float32, device=k.device)
        current, slots = own, (0, 1)
        pending: list = []  # dK/dV transfers of the previous step: (handles, what to do once they arrive)
        for t in range(cp):
            src = (me - t) % cp
            handles, nxt, nxt_slots = self._fetch(t + 1, own, current)
            if t == 0:
                part = d_own  # this rank's own chunks: accumulated in place
            else:
                part = None if current is None else torch.zeros(current.shape, dtype=torch.float32, device=q.device)
            for qs, n, i, j in self._pairs(src, slots):
                rows = slice(qs * L, (qs + 1) * L)
                kj, vj = _keys_values(current, n, L)
                self.masks.backward_add(i, j, q[:, rows], kj, vj, dout[:, rows], out[:, rows], lse[:, :, rows],
                                        self.scale, dq[qs], part[0, n], part[1, n])
                del kj, vj
            if self.slots is not None and t > 0:
                current = None  # (a received message: computed with, not passed on)
            for done in pending:
                for h in done[0]:
                    h.wait()
                done[1](part)
            pending = []
            if t == 0:
                pass
            elif self.slots is None:  # pass the sum of dK/dV on with the block; its owner receives it last
                incoming = torch.empty_like(d_own)
                pending.append((comm.send_recv([(part, (me + 1) % cp)], [(incoming, (me - 1) % cp)], self.group,
                                               _GRAD_TAG), _relay_add(incoming, d_own, t == cp - 1)))
            else:  # send the dK/dV of the chunks taken from src back to it, take those of ours from me + t
                dst = (me + t) % cp
                back = self.slots[dst][me]
                incoming = d_own.new_empty((2, len(back), *d_own.shape[2:])) if back else None
                sends = [(part, src)] if slots else []
                recvs = [(incoming, dst)] if back else []
                pending.append((comm.send_recv(sends, recvs, self.group, _GRAD_TAG),
                                _direct_add(incoming, back, d_own)))
            for h in handles:
                h.wait()
            current, slots = nxt, nxt_slots
        for done in pending:
            for h in done[0]:
                h.wait()
            done[1](None)
        # [2 chunks, b, L, hk, d] -> [b, 2L, hk, d] (a view for one row)
        return _rows(dq), _rows(d_own[0]), _rows(d_own[1])


def _rows(chunks: torch.Tensor) -> torch.Tensor:
    """[chunks, b, L, ...] -> [b, chunks * L, ...]."""
    return chunks.transpose(0, 1).reshape(chunks.shape[1], -1, *chunks.shape[3:])


def _keys_values(current, n: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk n's keys and values [b, L, hk, d] of what this step holds: this rank's own (k, v), or a received
    message [2 (keys, values), chunks, b, L, hk, d] (each chunk's keys and values contiguous: the kernel reads
    them in place)."""
    if isinstance(current, tuple):
        return current[0][:, n * L:(n + 1) * L], current[1][:, n * L:(n + 1) * L]
    return current[0, n], current[1, n]


def _message(current, slots: tuple[int, ...], L: int) -> torch.Tensor:
    """The chunks `slots` of what this step holds as one message [2 (keys, values), len(slots), b, L, hk, d]."""
    if not isinstance(current, tuple):
        if slots == tuple(range(current.shape[1])):
            return current
        return current[:, list(slots)].contiguous()
    k, v = current
    msg = k.new_empty((2, len(slots), k.shape[0], L, *k.shape[2:]))
    for n, s in enumerate(slots):
        msg[0, n].copy_(k[:, s * L:(s + 1) * L])
        msg[1, n].copy_(v[:, s * L:(s + 1) * L])
    return msg


def _relay_add(incoming: torch.Tensor, d_own: torch.Tensor, last: bool):
    """Once the previous rank's running dK/dV sum arrives: add it to the next step's partial (to pass on), or,
    after the last step, to this rank's own dK/dV (the sum over every other rank)."""
    def add(part: torch.Tensor | None) -> None:
        if last:
            d_own.add_(incoming)
        else:
            part.add_(incoming)
    return add


def _direct_add(incoming: torch.Tensor | None, slots: tuple[int, ...], d_own: torch.Tensor):
    def add(part: torch.Tensor | None) -> None:
        for n, s in enumerate(slots):
            d_own[:, s] += incoming[:, n]
    return add


class _RingFunction(torch.autograd.Function):
    """The ring's forward and a backward that recomputes each pair from the saved output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse = ring.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(q, k, v, dout, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class RingAttention(nn.Module):
    """Attention over the row shared by the ranks of `cp_group`: q [b, n, h, d], k/v [b, n, h_kv, d] -> [b, n, h, d].

    A rank's n tokens are its two mirrored chunks (`sequence_parallel.data.context_parallel_indices`); inside
    Ulysses (`ulysses` = its sp degree) they arrive as the sp pieces of both chunks from each Ulysses rank, and are
    put in chunk order here. `attn_fn` names the attention (`ring_attention_kind`). Packed documents
    (`documents=`) are those of this rank's tokens; their position ids over the whole row are gathered once per
    forward. Keys and values travel as the kv heads only (GQA), never repeated per query head.
    """

    handles_documents = True
    wraps_attention = True  # `attn_fn` is the attention it runs (local_attention unwraps it)

    def __init__(self, cp_group: ProcessGroup | None, attn_fn: Callable[..., torch.Tensor] = attention,
                 ulysses: int = 1) -> None:
        super().__init__()
        self.sparse = ring_attention_kind(attn_fn)
        self.cp_group, self.attn_fn, self.ulysses = cp_group, attn_fn, ulysses

    @property
    def cp(self) -> int:
        return group_size(self.cp_group)

    def extra_repr(self) -> str:
        return f"cp={self.cp}, ulysses={self.ulysses}, attn_fn={getattr(self.attn_fn, '__name__', self.attn_fn)}"

    def _chunk_order(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """[b, (sp pieces of both chunks), ...] <-> [b, (chunk, mirrored chunk), ...] (a no-op without Ulysses)."""
        U = self.ulysses
        if U == 1:
            return x
        b, n = x.shape[:2]
        shape = (U, 2) if not inverse else (2, U)
        return x.reshape(b, *shape, n // (2 * U), *x.shape[2:]).transpose(1, 2).reshape(x.shape)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                documents: Documents | None = None, scale: float | None = None, window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        check_qkv(q, k, v, same_seq=True, what="RingAttention", seq="local sequence")
        if sinks is not None:
            raise NotImplementedError("ring attention (parallel.cp) does not run attention sinks (a sink logit per "
                                      "head joins every query's softmax); use parallel.sp for this model")
        if window is not None and self.sparse is not None:
            raise ValueError("RingAttention: window= is a dense attention's sliding window; a block-sparse layout "
                             "has its own")
        cp, n = self.cp, q.shape[1]
        if n % (2 * self.ulysses):
            raise ValueError(f"RingAttention: a rank's {n} tokens must split into 2 chunks of ulysses="
                             f"{self.ulysses} pieces; shard rows with sequence_parallel.data.shard_context_parallel")
        seq_len = n * cp
        L = n // 2
        doc_ids = None if documents is None else self._document_ids(documents)
        layout = None
        if self.sparse is not None:
            check_ring("sparse", seq_len, self.ulysses, cp, self.sparse.block_size, doc_ids is not None)
            layout = block_layout(self.sparse, seq_len, causal)
        slots = None
        if self.sparse is not None:
            slots = ring_slots(sparse_chunk_pairs(self.sparse, seq_len, cp, causal), cp)
        ring = _Ring(self.cp_group, cp, group_rank(self.cp_group), L, _PairMasks(L, causal, doc_ids, layout, window),
                     1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, slots)
        q, k, v = (self._chunk_order(x) for x in (q, k, v))
        return self._chunk_order(_RingFunction.apply(q, k, v, ring), inverse=True)

    def _document_ids(self, documents: Documents) -> torch.Tensor | None:
        """Document ids [b, seq_len] of the whole rows in row order (None when every row is one document),
        from one all-gather of the position ids over the ring, made once per forward."""
        key = ("ring_document_ids", id(self.cp_group), self.ulysses)
        if key not in documents.derived:
            cp = self.cp
            local = self._chunk_order(documents.position_ids).t().contiguous()  # [2L, b]
            gathered = local.new_empty((cp * local.shape[0], local.shape[1]))
            comm.all_gather_into_tensor(gathered, local, self.cp_group)
            L = local.shape[0] // 2
            by_rank = gathered.view(cp, 2, L, -1)
            order = [by_rank[x, 0] if x < cp else by_rank[2 * cp - 1 - x, 1] for x in range(2 * cp)]
            positions = torch.cat(order, dim=0).t()  # [b, seq_len]
            ids = document_ids(positions)
            documents.derived[key] = None if bool((ids[:, -1] == 0).all()) else ids
        return documents.derived[key]


def apply_context_parallel(model: nn.Module, cp_group: ProcessGroup | None,
                           sp_group: ProcessGroup | None = None) -> nn.Module:
    """Every attention site of `model` (`zero.contract`) runs ring attention over `cp_group`, inside Ulysses over
    `sp_group` when it has more than one rank (a site already wrapped by `apply_ulysses` is re-wrapped around its
    own attention). Rows are sharded by `sequence_parallel.data.shard_context_parallel`. Returns the model."""
    sites = contract_of(model, "apply_context_parallel", "attention_sites").attention_sites()
    sp = group_size(sp_group)
    for site in sites:
        fn = site.get()
        if isinstance(fn, UlyssesAttention):
            fn = fn.attn_fn
        if isinstance(fn, RingAttention):
            fn = fn.attn_fn
        ring = RingAttention(cp_group, fn, ulysses=sp)
        site.set(UlyssesAttention(sp_group, ring) if sp > 1 else ring)
    return model
