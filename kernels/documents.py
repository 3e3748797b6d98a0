"""Packed documents: where they start, and attention that never crosses from one document into another.

A packed row holds several documents end to end. Its position ids restart at each document (Llama 3 and ALST
pack this way), so the position ids alone say where documents start: at a row's first token, and wherever a
token's position is not its predecessor's plus one. `Documents` reads that once per forward and every
attention call of the model shares it; `attend` runs any attention function so that each document attends
only to itself, and gives exactly the outputs of each document run alone:

- an attention function that handles documents itself (`handles_documents = True`: Ulysses, which first
  gathers the boundaries of the whole sequence, and the dense `attention`, which on CUDA uses flash-attn's
  varlen kernel or a FlexAttention document mask) gets them as `documents=`;
- any other (block-sparse layouts, native sparse attention, a model's own function) runs once per document:
  only the diagonal blocks of the [seq, seq] scores are ever computed, never a mask of the whole row.
Rows that hold one document each (unpacked data, default positions) take the plain call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
__all__ = ["Documents", "attend", "per_document", "document_ids", "positions_from_starts"]


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Position ids [b, s] that restart at 0 wherever `starts` [b, s] (bool) is True; a row's tokens before its
    first True continue a document cut at the row's start and count from 0 too."""
    if starts.dim() != 2 or starts.dtype != torch.bool:
        raise ValueError(f"starts must be a [batch, seq] bool tensor, got {starts.dtype} {tuple(starts.shape)}")
    b, s = starts.shape
    index = torch.arange(s, device=starts.device).expand(b, s)
    marks = starts.clone()
    marks[:, 0] = True
    last_start = torch.where(marks, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int: the index of each token's document within its row (0, 1, ...), from restarting positions."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(dim=1) - 1


class Documents:
    """The documents of a batch of rows, read from its position ids [b, s] (see the module docstring).

    The boundaries are read to the host once (`bounds()`), which the per-document loop needs anyway. `derived`
    keeps what callers compute from them once per forward (e.g. Ulysses: the documents of the whole sequence
    when each rank holds a shard of it), shared by every layer.
    """

    def __init__(self, position_ids: torch.Tensor) -> None:
        if position_ids.dim() != 2:
            raise ValueError(f"Documents needs position ids [batch, seq], got shape {tuple(position_ids.shape)}")
        self.position_ids = position_ids
        self._bounds: list[tuple[int, ...]] | None = None
        self.derived: dict = {}

    @property
    def seq_len(self) -> int:
        return self.position_ids.shape[1]

    def bounds(self) -> list[tuple[int, ...]]:
        """Per row, the offsets where its documents start, then the row's length: (0, s1, ..., seq_len)."""
        if self._bounds is None:
            pos = self.position_ids
            breaks = (pos[:, 1:] != pos[:, :-1] + 1).cpu()
            s = self.seq_len
            self._bounds = [(0, *(breaks[r].nonzero().flatten() + 1).tolist(), s) for r in range(pos.shape[0])]
        return self._bounds

    @property
    def single(self) -> bool:
        """True when every row is one document: attention needs no document handling."""
        return all(len(b) == 2 for b in self.bounds())

    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """(int32 offsets of every document in the flattened [b * s] rows, then b * s; the longest document), as
        flash-attn's varlen kernel takes them."""
        s, offsets, longest = self.seq_len, [], 0
        for r, b in enumerate(self.bounds()):
            offsets.extend(r * s + x for x in b[:-1])
            longest = max(longest, max(e - a for a, e in zip(b[:-1], b[1:])))
        offsets.append(len(self.bounds()) * s)
        return torch.tensor(offsets, dtype=torch.int32, device=self.position_ids.device), longest

    def __repr__(self) -> str:
        return f"Documents(rows={self.position_ids.shape[0]}, seq_len={self.seq_len})"


def attend(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           causal: bool = True, documents: Documents | None = None, **kwargs) -> torch.Tensor:
    """`fn(q, k, v, causal=causal, **kwargs)` with no attention across the boundaries of `documents`."""
    if documents is None:
        return fn(q, k, v, causal=causal, **kwargs)
    if documents.seq_len != q.shape[1]:
        raise ValueError(f"attention over {q.shape[1]} tokens was given the documents of {documents.seq_len}")
    if getattr(fn, "handles_documents", False):
        return fn(q, k, v, causal=causal, documents=documents, **kwargs)
    if documents.single:
        return fn(q, k, v, causal=causal, **kwargs)
    return per_document(fn, q, k, v, documents, causal=causal, **kwargs)


def per_document(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: Documents, causal: bool = True, **kwargs) -> torch.Tensor:
    """Run `fn` on each document alone and put the outputs back in place. Tensor keyword arguments are
    per-token ([b, s, ...], e.g. native sparse attention's gates) and are cut like q. Rows whose documents
    start at the same offsets run together. Inputs are cut with `split` (not slicing), so backward joins the
    gradients with one concatenation instead of adding a zero-filled full-size tensor per document."""
    bounds = documents.bounds()
    if len(set(bounds)) == 1:
        return _run_row_group(fn, q, k, v, bounds[0], causal, kwargs)
    rows = []
    one = [1] * q.shape[0]
    cut = {n: t.split(one) for n, t in kwargs.items() if torch.is_tensor(t)}
    for r, (qr, kr, vr) in enumerate(zip(q.split(one), k.split(one), v.split(one))):
        kw = {n: (cut[n][r] if n in cut else t) for n, t in kwargs.items()}
        rows.append(_run_row_group(fn, qr, kr, vr, bounds[r], causal, kw))
    return torch.cat(rows, dim=0)


def _run_row_group(fn, q, k, v, bounds: tuple[int, ...], causal: bool, kwargs: dict) -> torch.Tensor:
    if len(bounds) == 2:
        return fn(q, k, v, causal=causal, **kwargs)
    sizes = [e - a for a, e in zip(bounds[:-1], bounds[1:])]
    cut = {n: t.split(sizes, dim=1) for n, t in kwargs.items() if torch.is_tensor(t)}
    outs = []
    for i, (qd, kd, vd) in enumerate(zip(q.split(sizes, dim=1), k.split(sizes, dim=1), v.split(sizes, dim=1))):
        kw = {n: (cut[n][i] if n in cut else t) for n, t in kwargs.items()}
        outs.append(fn(qd, kd, vd, causal=causal, **kw))
    return torch.cat(outs, dim=1)
