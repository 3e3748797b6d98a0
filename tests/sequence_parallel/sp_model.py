"""A small Llama trained under Ulysses sp through the ZeRO engine, and its sp=1 reference: shared by the
sequence-parallel multi-rank tests. The engine, not the test, sums the SP-partial gradients."""

from __future__ import annotations

import copy
import functools

import torch

STEPS = 2


def sp_records(cfg, inputs: torch.Tensor, labels: torch.Tensor, alst: dict) -> dict:
    """Every rank of the world trains `cfg` with sp = world size for STEPS SGD steps on one batch, plain
    (stage 1) and with every ALST piece on (stage 3; `alst`: mlp_tile, loss_tile, offload); returns this
    rank's records (`tests.equivalence.Recorder`) and the single-process reference on the full batch."""
    import zero
    from moe_lst.models.llama import Transformer
    from sequence_parallel import (
        apply_activation_checkpointing,
        apply_tiled_mlp,
        apply_ulysses,
        cross_entropy_sum,
        shard_sequence,
        sp_loss,
        tiled_cross_entropy,
    )
    from tests.equivalence import Recorder, reference_trajectory

    torch.manual_seed(0)
    ref_model = Transformer(cfg)
    vocab = cfg.vocab_size
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    model = copy.deepcopy(ref_model)
    out = {"reference": reference_trajectory(
        model, sgd(model.parameters()), STEPS,
        lambda m, step: [torch.nn.functional.cross_entropy(m(inputs).reshape(-1, vocab), labels.reshape(-1))])}
    dims = zero.ParallelDims(sp=torch.distributed.get_world_size())
    for variant, stage in (("plain", 1), ("alst", 3)):
        model = apply_ulysses(copy.deepcopy(ref_model), dims.sp_group)
        if variant == "alst":
            apply_tiled_mlp(model, tile_size=alst["mlp_tile"])
            apply_activation_checkpointing(model, offload=alst["offload"])
        engine = zero.initialize(model, sgd, zero.ZeroConfig(stage=stage), dims)
        record = Recorder(engine)  # sp_loss is already the global mean on every rank of the group
        tok_l, lab_l, pos_l = shard_sequence(inputs, labels, dims.sp_group)
        for _ in range(STEPS):
            engine.before_forward()
            hidden = engine.module.forward_hidden(tok_l, pos_l)
            if variant == "alst":
                loss_sum, count = tiled_cross_entropy(hidden, engine.module.output_weight, lab_l,
                                                      tile_size=alst["loss_tile"])
            else:
                loss_sum, count = cross_entropy_sum(torch.nn.functional.linear(hidden, engine.module.output_weight),
                                                    lab_l)
            loss = sp_loss(loss_sum, count, dims.sp_group)
            engine.backward(loss)
            assert engine.step()
            record.step(loss.item())
        out[variant] = {"record": record.result(), "local_count": int(count), "local_len": tok_l.shape[1]}
    return out


def assert_sp_equivalent(results: list[dict], label: str) -> None:
    """Every rank's plain and ALST records equal the sp=1 reference (`tests.equivalence`)."""
    from tests.equivalence import assert_equivalent

    assert results
    for variant in ("plain", "alst"):
        assert_equivalent([r[variant]["record"] for r in results], results[0]["reference"],
                          label=f"{label} {variant}")
