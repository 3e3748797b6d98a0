"""Packed documents through the Hugging Face adapter: position ids restarting per document keep attention inside
each one (the adapter's registered attention runs it per document), so every document's logits and the gradients of
its loss equal the document run alone; plain positions over the same row do not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_lst.kernels.documents import positions_from_starts

from tests.hf.tiny import ALL, adapted_copy, plain_model

LENGTHS = (9, 20, 1, 14)


def _row():
    tokens = torch.randint(0, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0, torch.tensor((0,) + LENGTHS[:-1]).cumsum(0)] = True
    return tokens, positions_from_starts(starts)


def _loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


@pytest.mark.parametrize("kind", ALL)
def test_packed_documents_equal_documents_alone(kind):
    model = adapted_copy(plain_model(kind))
    model.balance = None  # per-token logits only (the routers' balancing loss is a statistic of the whole batch)
    tokens, positions = _row()
    docs = tokens.split(list(LENGTHS), dim=1)
    alone = [model(d) for d in docs]
    sum(_loss(a, d) for a, d in zip(alone, docs)).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    packed = model(tokens, positions, packed=True)
    torch.testing.assert_close(packed, torch.cat(alone, 1), atol=1e-5, rtol=1e-5)
    sum(_loss(p, d) for p, d in zip(packed.split(list(LENGTHS), dim=1), docs)).backward()
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    with torch.no_grad():  # without packed=True the documents attend to the ones before them
        for unpacked in (model(tokens, torch.arange(tokens.shape[1])[None]), model(tokens, positions)):
            assert (unpacked[:, LENGTHS[0]:] - packed[:, LENGTHS[0]:]).abs().max() > 1e-4
