"""Packed documents are exact: in a packed row (position ids restarting per document) every document's per-token
losses and its gradients equal those of that document run alone, for dense, sliding-window block-sparse and
native sparse attention, with tiled MLP, tiled loss and activation checkpointing on, at sp=1 and under Ulysses
sp=2 (the boundaries of the whole sequence are gathered by UlyssesAttention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.multirank import run_multirank

LENGTHS = (13, 40, 7, 1, 19, 16)  # 96 tokens: documents shorter than a block, one token long, across blocks
VOCAB = 64
ATTENTIONS = {
    "dense": {},
    "sparse": {"sparse": {"layout": "sliding_window", "block_size": 8, "window_blocks": 2}},
    "nsa": {"nsa": {"block_size": 8, "select_blocks": 3, "compress_block": 8, "compress_stride": 4,
                    "window_blocks": 2}},
}


def _model(attention: str):
    from moe_lst.models.llama import Transformer
    from moe_lst.models.llama.model import ModelConfig
    from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention,
                      **ATTENTIONS[attention])
    model = Transformer(cfg)
    apply_tiled_mlp(model, tile_size=16)
    apply_activation_checkpointing(model)
    return model


def _packed_batch():
    """(tokens [1, 96], labels with each document's last label ignored, restarting position ids)."""
    from moe_lst.kernels.documents import positions_from_starts

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, sum(LENGTHS) + 1), generator=gen)
    starts = torch.zeros(1, sum(LENGTHS) + 1, dtype=torch.bool)
    starts[0, torch.tensor((0,) + LENGTHS).cumsum(0)] = True
    labels = tokens[:, 1:].masked_fill(starts[:, 1:], -100)
    return tokens[:, :-1], labels, positions_from_starts(starts[:, :-1])


def _alone(model, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses of every document run alone (its last token has no label) and the gradients of their sum."""
    model.zero_grad()
    losses = []
    for doc in tokens.split(list(LENGTHS), dim=1):
        logits = model(doc)[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), doc[:, 1:].flatten(), reduction="none")
        loss.sum().backward()
        losses.append(torch.cat([loss.detach(), loss.new_full((1,), float("nan"))]))
    return torch.cat(losses), {n: p.grad.clone() for n, p in model.named_parameters()}


def _per_token(model, tokens, labels, positions, packed: bool) -> torch.Tensor:
    logits = F.linear(model.forward_hidden(tokens, positions, packed=packed), model.output_weight)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    return loss.masked_fill(labels.flatten() == -100, float("nan"))


def _tiled_loss_sum(model, tokens, labels, positions) -> torch.Tensor:
    from sequence_parallel import tiled_cross_entropy

    hidden = model.forward_hidden(tokens, positions, packed=True)
    loss_sum, _ = tiled_cross_entropy(hidden.flatten(0, 1), model.output_weight, labels.flatten(), tile_size=16)
    return loss_sum


def _check(losses, reference, grads, ref_grads) -> None:
    torch.testing.assert_close(losses, reference, rtol=0, atol=1e-5, equal_nan=True)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_packed_documents_equal_documents_alone(attention):
    model = _model(attention)
    tokens, labels, positions = _packed_batch()
    reference, ref_grads = _alone(model, tokens)
    model.zero_grad()
    losses = _per_token(model, tokens, labels, positions, packed=True)
    assert losses.isnan().sum() == len(LENGTHS)  # one ignored label per document
    _tiled_loss_sum(model, tokens, labels, positions).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    _check(losses.detach(), reference, grads, ref_grads)


@pytest.mark.parametrize("positions", ["plain", "restarting"])
def test_unpacked_rows_attend_across_documents(positions):
    """The check above can fail: the same row as one document (plain positions, or restarting ones without
    packed=True) gives other losses: attention crosses the documents' boundaries."""
    model = _model("dense")
    tokens, labels, restarting = _packed_batch()
    reference, _ = _alone(model, tokens)
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1])[None] if positions == "plain" else restarting
        losses = _per_token(model, tokens, labels, pos, packed=False)
    first = LENGTHS[0]  # the first document has nothing before it: equal; the later ones differ
    torch.testing.assert_close(losses[:first], reference[:first], equal_nan=True)
    assert (losses[first:] - reference[first:]).nan_to_num().abs().max() > 1e-3


def _sp2_worker(attention: str) -> dict:
    import torch.distributed as dist

    import zero
    from sequence_parallel import apply_ulysses, collect_sequence, shard_sequence

    dims = zero.ParallelDims(sp=dist.get_world_size())
    model = _model(attention)
    tokens, labels, positions = _packed_batch()
    reference, ref_grads = _alone(model, tokens)
    model.zero_grad()
    apply_ulysses(model, dims.sp_group)
    tok, lab, pos = shard_sequence(tokens, labels, dims.sp_group, position_ids=positions)
    with torch.no_grad():
        local = _per_token(model, tok, lab, pos, packed=True)
    losses = collect_sequence(local[None], dims.sp_group, length=tokens.shape[1])[0]
    _tiled_loss_sum(model, tok, lab, pos).backward()  # this rank's share of the summed loss
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad, group=dims.sp_group)
        grads[n] = p.grad
    _check(losses, reference, grads, ref_grads)
    return {"checked": len(grads)}


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_packed_documents_under_ulysses_sp2(attention):
    out = run_multirank(_sp2_worker, 2, attention)
    assert out[0]["checked"] == out[1]["checked"] > 0
