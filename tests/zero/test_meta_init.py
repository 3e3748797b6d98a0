"""A model built on the meta device and materialised by the engine equals the same model built whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero
from tests.multirank import run_multirank


def _cfg(tie: bool):
    from moe_lst.models.llama import ModelConfig

    return ModelConfig(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, tie_embeddings=tie)


def _run(stage: int, tie: bool, meta: bool, root: str, **offload) -> tuple[dict, list[float]]:
    from moe_lst.models.llama import Transformer

    torch.manual_seed(11)
    model = Transformer(_cfg(tie), device="meta" if meta else None)
    if "nvme" in offload.values():
        offload["nvme_path"] = root
    engine = zero.initialize(model, zero.FastAdamW(lr=1e-2), zero.ZeroConfig(stage=stage, **offload),
                             param_init=model.init_parameter if meta else None)
    start = engine.full_state_dict()
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randint(0, 96, (2, 9), generator=gen)
        loss = F.cross_entropy(engine(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return start, losses


def _compare(root: str) -> list[str]:
    bad = []
    cases = [(s, tie, {}) for s in (0, 1, 2, 3) for tie in (True, False)]
    cases.append((3, True, {"offload_params": "nvme", "offload_optimizer": "nvme"}))
    for stage, tie, offload in cases:
        ref_state, ref_losses = _run(stage, tie, False, root, **offload)
        state, losses = _run(stage, tie, True, root, **offload)
        if sorted(state) != sorted(ref_state) or any(not torch.equal(state[k], ref_state[k]) for k in state):
            bad.append(f"stage {stage} tie {tie} {offload}: initial values differ")
        if losses != ref_losses:
            bad.append(f"stage {stage} tie {tie} {offload}: losses {losses} != {ref_losses}")
    return bad


def test_meta_model_materialised_by_the_engine_equals_the_eager_one(tmp_path):
    for bad in run_multirank(_compare, 2, str(tmp_path), timeout=240):
        assert bad == []


def test_init_parameter_does_not_depend_on_call_order():
    from moe_lst.models.llama import Transformer

    torch.manual_seed(5)
    model = Transformer(_cfg(True))
    names = [n for n, _ in model.named_parameters()][::-1]
    params = dict(model.named_parameters())
    for name in names:
        out = torch.empty_like(params[name])
        model.init_parameter(name, out)
        assert torch.equal(out, params[name]), name


def test_meta_model_errors_are_clear():
    from moe_lst.models.llama import Transformer

    with pytest.raises(ValueError, match="meta device.*param_init"):
        zero.initialize(nn.Linear(4, 4, device="meta"), zero.FastAdamW(lr=1e-3))
    # a model of the contract brings its own per-parameter init: the same values as param_init would give
    torch.manual_seed(11)
    implicit = zero.initialize(Transformer(_cfg(True), device="meta"), zero.FastAdamW(lr=1e-3)).full_state_dict()
    torch.manual_seed(11)
    model = Transformer(_cfg(True), device="meta")
    explicit = zero.initialize(model, zero.FastAdamW(lr=1e-3), param_init=model.init_parameter).full_state_dict()
    assert implicit.keys() == explicit.keys() and all(torch.equal(implicit[k], explicit[k]) for k in implicit)
    mixed = Transformer(_cfg(True), device="meta")
    mixed.norm.weight = nn.Parameter(torch.ones(32))
    with pytest.raises(ValueError, match="mixes meta-device and materialised"):
        zero.initialize(mixed, zero.FastAdamW(lr=1e-3), param_init=mixed.init_parameter)
    with pytest.raises(TypeError, match="param_init must be a callable"):
        zero.initialize(Transformer(_cfg(True)), zero.FastAdamW(lr=1e-3), param_init=3)
