"""The Hugging Face adapter on 2 gloo ranks equals one process of the plain transformers model: data parallel at
ZeRO-3 (dense models built on the meta device) and Ulysses sequence parallel, losses, gradient norms and every
parameter after the first step (the gradient, under SGD) and the last (tests/equivalence.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_lst.models.hf import moe_supported

from tests.equivalence import Recorder, assert_equivalent, reference_trajectory
from tests.hf.tiny import MAIN, MOE, tiny_config
from tests.multirank import run_multirank

STEPS, LR, BATCH, SEQ = 3, 0.5, 4, 16
LAYOUTS = ("dp2_zero3", "sp2")


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _rank_run(kind: str, layout: str) -> dict:
    from moe_lst.models.hf import build

    import zero
    from moe import apply_expert_parallel
    from sequence_parallel import apply_ulysses, shard_sequence, sp_loss

    dims = zero.ParallelDims(dp=2) if layout == "dp2_zero3" else zero.ParallelDims(dp=1, sp=2)
    torch.manual_seed(0)
    model = build(tiny_config(kind), meta=layout == "dp2_zero3" and kind not in MOE, sp_group=dims.sp_group)
    plans = [model.loss_plan()] + ([apply_expert_parallel(model, dims)] if kind in MOE else [])
    apply_ulysses(model, dims.sp_group)
    engine = zero.initialize(model, lambda params: torch.optim.SGD(params, lr=LR),
                             zero.ZeroConfig(stage=3 if layout == "dp2_zero3" else 0), dims, plans=plans)
    recorder = Recorder(engine, data_group=dims.dp_group)
    for step in range(STEPS):
        x, y = _global_batch(step)
        if dims.dp > 1:
            rows = slice(dims.dp_rank * BATCH // 2, (dims.dp_rank + 1) * BATCH // 2)
            x, y = x[rows], y[rows]
        x, y, positions = shard_sequence(x, y, dims.sp_group)
        loss_sum = F.cross_entropy(engine(x, positions).flatten(0, 1), y.flatten(), reduction="sum")
        loss = sp_loss(loss_sum, y.numel(), dims.sp_group)
        engine.backward(loss)
        engine.step()
        recorder.step(loss.item())
    return recorder.result()


def _ranks(kinds: list[str]) -> dict[tuple[str, str], dict]:
    return {(kind, layout): _rank_run(kind, layout) for kind in kinds for layout in LAYOUTS}


def _reference(kind: str, layout: str) -> dict:
    """One process, the plain transformers model with the adapter's initial weights: the global batch as the
    dp ranks' two micro-batches (an MoE balancing loss is per micro-batch, as on each dp rank) or whole (sp)."""
    from moe_lst.models.hf import build
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    initial = build(tiny_config(kind)).state_dict()
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    model.load_state_dict(initial)
    parts = (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)) if layout == "dp2_zero3" else (slice(0, BATCH),)

    def micro_losses(m, step):
        x, y = _global_batch(step)
        for rows in parts:
            out = m(input_ids=x[rows])
            loss = F.cross_entropy(out.logits.flatten(0, 1), y[rows].flatten())
            aux = getattr(out, "aux_loss", None)
            if aux is not None:  # its gradient joins the loss's, its value not (the ranks record cross-entropy)
                term = m.config.router_aux_loss_coef * aux
                loss = loss + (term - term.detach())
            yield loss

    return reference_trajectory(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, micro_losses)


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    """Every model type's runs in one spawn (starting two processes that import transformers costs most)."""
    kinds = ["llama", "qwen3", *(MOE if moe_supported() else ())]
    return run_multirank(_ranks, 2, kinds, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", MAIN)
def test_zero3_data_parallel_and_ulysses_equal_one_process(per_rank, kind, layout):
    assert_equivalent([r[kind, layout] for r in per_rank], _reference(kind, layout), label=f"{kind} {layout}")
