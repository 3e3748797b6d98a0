"""A model the project did not write, brought in through the model contract (`zero.contract`) alone.

`Tiny` below is not the project's Llama: LayerNorm, learned absolute positions, GELU MLP, a separate head,
its own block and stage classes. It implements the contract's parts (blocks, attention sites, MLP sites,
pipeline stages and shapes) and nothing else, and trains under dp=2 ZeRO-3, sp=2 Ulysses with tiled MLP
and activation checkpointing, and pp=2 with the same losses, gradient norms and parameters as plain
single-process training (`tests.equivalence`). A part it lacks is a one-line error naming it.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from moe_lst.kernels.attention import attention

import zero
from tests.equivalence import Recorder, assert_equivalent, reference_trajectory
from tests.multirank import run_multirank
from zero.contract import AttentionSite, ContractError, ModelContract

VOCAB, DIM, HEADS, SEQ, ROWS, STEPS, LAYERS = 48, 32, 4, 12, 4, 3, 4
SGD = functools.partial(torch.optim.SGD, lr=0.5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.attend = attention  # swapped through its site

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, HEADS, -1)).unbind(2)  # each [b, s, heads, d]
        x = x + self.proj(self.attend(q, k, v, causal=True).flatten(-2))
        return x + self.mlp(self.ln2(x))

    def get_attend(self):
        return self.attend

    def set_attend(self, fn) -> None:
        del self.attend
        self.attend = fn


class Stage(nn.Module, ModelContract):
    """Blocks `layers` of a Tiny (the embeddings when first, the final norm and head when last)."""

    def __init__(self, model: Tiny, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = model.tok, model.pos
        self.trunk = nn.ModuleDict({str(i): model.trunk[i] for i in layers})  # the model's names
        if last:
            self.ln, self.head = model.ln, model.head

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"trunk.{i}", b) for i, b in self.trunk.items()]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(position_ids)
        for block in self.trunk.values():
            x = block(x)
        return self.head(self.ln(x)) if self.last else x


class Tiny(nn.Module, ModelContract):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.trunk = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    # -- the contract's parts this model offers (no tensor-parallel plan, no per-parameter init)
    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"trunk.{i}", b) for i, b in enumerate(self.trunk)]

    def attention_sites(self) -> list[AttentionSite]:
        return [AttentionSite(f"trunk.{i}", b.get_attend, b.set_attend) for i, b in enumerate(self.trunk)]

    def mlp_sites(self) -> list[tuple[str, nn.Module]]:
        return [(f"trunk.{i}.mlp", b.mlp) for i, b in enumerate(self.trunk)]

    def pipeline_stage(self, layers: range, first: bool, last: bool) -> nn.Module:
        return Stage(self, layers, first, last)

    def pipeline_shapes(self, tokens_shape):
        return (*tokens_shape, DIM), (*tokens_shape, VOCAB)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
        x = self.tok(tokens) + self.pos(position_ids)
        for block in self.trunk:
            x = block(x)
        return self.head(self.ln(x))


def _build() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _reference() -> dict:
    model = _build()
    return reference_trajectory(model, SGD(model.parameters()), STEPS, lambda m, step: [
        F.cross_entropy(m(batch(step)[0]).flatten(0, 1), batch(step)[1].flatten())])


def _train(layout: dict) -> dict:
    from sequence_parallel import (
        apply_activation_checkpointing,
        apply_tiled_mlp,
        apply_ulysses,
        cross_entropy_sum,
        shard_sequence,
        sp_loss,
    )
    from zero.parallel.pipeline import apply_pipeline

    dims = zero.ParallelDims(**layout)
    model, plans = _build(), []
    if dims.sp > 1:  # the long-sequence pieces, each through its contract part
        apply_ulysses(model, dims.sp_group)
        apply_tiled_mlp(model, tile_size=5)
        apply_activation_checkpointing(model)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return sp_loss(*cross_entropy_sum(logits, labels), dims.sp_group)

    module = model
    if dims.pp > 1:
        pipe = apply_pipeline(model, dims, "1f1b", microbatches=2, loss_fn=loss_fn)
        module, plans = pipe.module, [pipe]
    stage = 3 if dims.dp > 1 else 1
    engine = zero.initialize(module, SGD, zero.ZeroConfig(stage=stage, grad_accum_steps=2 if plans else 1), dims,
                             plans=plans)
    record = Recorder(engine, dims.dp_group if dims.dp > 1 else None)
    rows = slice(dims.dp_rank * ROWS // dims.dp, (dims.dp_rank + 1) * ROWS // dims.dp)
    for step in range(STEPS):
        tokens, labels = (t[rows] for t in batch(step))
        tokens, labels, pos = shard_sequence(tokens, labels, dims.sp_group)
        if plans:
            loss = pipe.train_step(engine, tokens, labels, position_ids=pos)
        else:
            loss = loss_fn(engine(tokens, pos), labels)
            engine.backward(loss)
            loss = loss.item()
        assert engine.step()
        record.step(loss)
    return record.result()


@pytest.mark.parametrize("layout", [{"dp": 2}, {"sp": 2}, {"pp": 2}], ids=["dp2-zero3", "sp2-alst", "pp2"])
def test_a_model_of_the_contract_trains_under_every_layout_as_on_one_rank(layout):
    assert_equivalent(run_multirank(_train, 2, layout), _reference(), label=str(layout))


def test_a_missing_contract_part_is_one_line_naming_it():
    from zero.parallel.tensor import apply_tensor_parallel

    assert isinstance(_build(), ModelContract)
    with pytest.raises(ContractError, match=r"Tiny does not offer tensor_parallel_styles\(tp\) of the model contract"):
        _build().tensor_parallel_styles(2)
    with pytest.raises(ContractError, match=r"apply_ulysses needs Linear.attention_sites\(\) of the model contract"):
        from sequence_parallel import apply_ulysses

        apply_ulysses(nn.Linear(2, 2), None)
    assert apply_tensor_parallel(_build(), None).placements == {}  # one tp rank: nothing asked of the model
