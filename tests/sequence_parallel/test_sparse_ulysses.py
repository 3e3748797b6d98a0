"""Block-sparse and native sparse attention under Ulysses sp=2 equal sp=1 (plain and with the ALST pieces).

Each rank holds the full sequence for its heads, so a layout applies unchanged; NSA's gates travel to the
head shards with q. One spawn runs every case and returns the errors.
"""

from __future__ import annotations

import copy

import pytest

from tests.multirank import run_multirank

SPARSE = {"layout": "bigbird", "block_size": 4, "window_blocks": 2, "global_blocks": 1, "random_blocks": 2}
NSA = {"block_size": 4, "select_blocks": 3, "compress_block": 4, "compress_stride": 2, "window_blocks": 2}
TOL = 1e-5


def _model_errors(attention: str, group) -> dict:
    import torch

    from recipes.models.llama import ModelConfig, Transformer
    from sequence_parallel import (
        apply_activation_checkpointing,
        apply_tiled_mlp,
        apply_ulysses,
        cross_entropy_sum,
        shard_sequence,
        sp_loss,
        tiled_cross_entropy,
    )
    from zero import comm

    extra = {"sparse": SPARSE} if attention == "sparse" else {"nsa": NSA}
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      attention=attention, **extra)
    torch.manual_seed(0)
    ref_model = Transformer(cfg)
    gen = torch.Generator().manual_seed(1)
    s = 37  # 10 blocks of 4, the last ragged; odd, so shard_sequence pads it for sp=2
    tokens = torch.randint(0, 64, (2, s + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref_loss = torch.nn.functional.cross_entropy(ref_model(inputs).reshape(-1, 64), labels.reshape(-1))
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    out = {}
    for variant in ("plain", "alst"):
        model = apply_ulysses(copy.deepcopy(ref_model), group)
        model.zero_grad(set_to_none=True)
        tok_l, lab_l, pos_l = shard_sequence(inputs, labels, group)
        if variant == "alst":
            apply_tiled_mlp(model, tile_size=5)
            apply_activation_checkpointing(model)
            loss_sum, count = tiled_cross_entropy(model.forward_hidden(tok_l, pos_l), model.output_weight, lab_l,
                                                  tile_size=7)
        else:
            loss_sum, count = cross_entropy_sum(model(tok_l, pos_l), lab_l)
        loss = sp_loss(loss_sum, count, group)
        loss.backward()
        errors = []
        for n, p in model.named_parameters():
            grad = p.grad.clone()
            comm.all_reduce(grad, group)  # the runtime sums SP-partial gradients over the group
            errors.append((grad - ref_grads[n]).abs().max().item())
        out[variant] = {"loss": abs(loss.item() - ref_loss.item()), "grad": max(errors)}
    return out


def _worker() -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())))
    return {attention: _model_errors(attention, group) for attention in ("sparse", "nsa")}


@pytest.fixture(scope="module")
def results():
    return run_multirank(_worker, 2, timeout=240)


@pytest.mark.parametrize("attention", ["sparse", "nsa"])
def test_sparse_attention_sp2_equals_sp1(results, attention):
    for rank, res in enumerate(results):
        for variant in ("plain", "alst"):
            r = res[attention][variant]
            assert r["loss"] < TOL, f"{attention} {variant} rank {rank}: loss differs by {r['loss']}"
            assert r["grad"] < TOL, f"{attention} {variant} rank {rank}: grads differ by {r['grad']}"
