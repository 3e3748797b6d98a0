"""Expert tensor parallelism of Hugging Face MoE blocks (moe_lst.models.hf.experts.expert_tensor_parallel): at tp=2
each rank keeps its slice of every routed and shared expert's hidden units and the block's output is reduce-scattered
to sequence shards, against one process of the same block.

The default case runs, in one 2-rank spawn, the MoE block of a tiny DeepSeek-V3 (shared experts from the plan's
colwise / rowwise entries, sigmoid grouped routing with a score-correction bias, a first dense layer) and of a tiny
GPT-OSS (interleaved gate / up pairs in a transposed layout, expert biases, a router bias, a block that returns a
tuple, transformers' balancing loss) and of a tiny AXK1 (a norm over the block's summed output, which must run after
the reduce-scatter): the output shards, the balancing loss, the input's gradient (summed over the ranks, as the
gather before the block sums it) and every parameter's gradient (assembled from the ranks'
slices by their declared TensorSplit) equal the one-process block's. Under -m slow: a whole model through the engine
at ep=2 x tp=2 on 4 ranks against one process (losses and every parameter after two SGD steps)."""

from __future__ import annotations

import pytest
import torch

from tests.multirank import run_multirank

#: Tiny configs (the coverage sweep's sizes), the MoE block each case splits.
CASES = (("deepseek_v3", "model.layers.1.mlp"), ("gpt_oss", "model.layers.0.mlp"), ("axk1", "model.layers.1.mlp"))
SEQ, BATCH = 8, 2


def _configs() -> list[tuple[dict, str]]:
    from moe_lst.models.hf.coverage import tiny_config

    return [(tiny_config(kind).to_dict(), block) for kind, block in CASES]


def _built(config):
    """The adapted model of `config` (seed 0), its biases and 1-D parameters moved off their initial constants (zero
    biases would hide a bias added twice)."""
    from moe_lst.models.hf.model import build

    torch.manual_seed(0)
    model = build(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def _block_run(model, block_name: str, x: torch.Tensor, tp_group) -> dict:
    """The block's forward on the full sequence x [b, s, H] (its balancing loss included) and backward of a fixed
    weighting of its output (this rank's sequence shard of it under tp); the gradients of x and of every parameter."""
    from zero.dist.topology import group_rank, group_size

    block = model.get_submodule(block_name)
    x = x.clone().requires_grad_(True)
    if model.balance is not None:
        model.balance.begin(True)
    out = block(x)
    if model.balance is not None:
        model.balance.finish()
    y = out[0] if isinstance(out, tuple) else out
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    shard = x.shape[1] // group_size(tp_group)
    rank = group_rank(tp_group)
    (y * weight[:, rank * shard:(rank + 1) * shard]).sum().backward()
    return {"y": y.detach(), "balance": model.balance and model.balance.last_value, "x_grad": x.grad,
            "grads": {n: p.grad for n, p in block.named_parameters()}}


def _expert_tp_blocks(cases: list[tuple[dict, str]]) -> None:
    """On each of 2 ranks: every case's block at tp=2 against the same block in one process (computed here too)."""
    import torch.distributed as dist
    from moe_lst.models.hf.experts import expert_tensor_parallel
    from moe_lst.models.hf.model import _plan_styles
    from transformers import CONFIG_MAPPING

    from zero.dist import comm
    from zero.parallel.tensor import TensorParallel

    group, rank = dist.group.WORLD, dist.get_rank()
    for config_dict, block_name in cases:
        config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
        x = torch.randn(BATCH, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(3))
        whole = {n: p.detach().clone() for n, p in _built(config).named_parameters()}
        reference = _block_run(_built(config), block_name, x, None)
        model = _built(config)
        styles = _plan_styles(model, config.base_model_tp_plan or {}, ValueError)
        expert_tensor_parallel(model, styles, 2, ValueError)
        block = model.get_submodule(block_name)
        splits = {f"{block_name}.{n}": s for n, s in styles[block_name].apply(block, group).items()}
        assert set(splits) == {f"{block_name}.{n}" for n, _ in block.named_parameters()}, "every parameter split"
        got = _block_run(model, block_name, x, group)
        label = f"{config.model_type} rank {rank}"
        shard = SEQ // 2
        torch.testing.assert_close(got["y"], reference["y"][:, rank * shard:(rank + 1) * shard], rtol=1e-5,
                                   atol=1e-6, msg=lambda m, label=label: f"{label} output: {m}")
        if reference["balance"] is not None:
            assert abs(got["balance"] - reference["balance"]) <= 1e-6 * abs(reference["balance"]), label
        comm.all_reduce(got["x_grad"], group)  # (the gather before the block reduce-scatters this sum)
        torch.testing.assert_close(got["x_grad"], reference["x_grad"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, label=label: f"{label} input gradient: {m}")
        for name, split in splits.items():  # (where checkpoints, ZeRO-3 shards and init_from place each slice)
            local = model.get_parameter(name).detach()
            torch.testing.assert_close(split.placement(local.shape, rank, 2).take(whole[name]), local, rtol=0, atol=0,
                                       msg=lambda m, n=name, label=label: f"{label} placement of {n}: {m}")
        plan = TensorParallel(group, model, splits)
        local = {n: model.get_parameter(n).grad for n in splits}
        assert all(g is not None for g in local.values()), f"{label}: a parameter got no gradient"
        for name, grad in plan.full_state_dict(local).items():
            want = reference["grads"][name[len(block_name) + 1:]]
            scale = float(want.abs().max()) or 1.0
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda m, n=name, label=label: f"{label} gradient of {n}: {m}")


def test_expert_tp_blocks_equal_one_process():
    run_multirank(_expert_tp_blocks, 2, _configs(), timeout=120)


def _ep_tp_run(config_dict: dict) -> dict:
    """One of 4 ranks (dp=2 with ep=2 over it, tp=2): two SGD steps of the whole model through the engine, as the
    coverage sweep's ranks run them; the global losses and this rank's parameters after them (tp slices
    assembled, experts left as this rank's ep slice)."""
    import torch.distributed as dist
    from moe_lst.models.hf import coverage
    from moe_lst.models.hf.model import build
    from transformers import CONFIG_MAPPING

    import zero
    from moe import apply_expert_parallel
    from zero.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

    config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    dims = zero.ParallelDims(dp=2, ep=2, tp=2)
    torch.manual_seed(0)
    model = build(config)
    plans = [model.loss_plan(), apply_expert_parallel(model, dims)]
    tp_plan = apply_tensor_parallel(model, dims.tp_group)
    engine = zero.initialize(model, lambda params: torch.optim.SGD(params, lr=coverage.LR), zero.ZeroConfig(stage=0),
                             dims, plans=[*plans, tp_plan])
    losses = []
    for step in range(coverage.STEPS):
        x, y = coverage._batch(step)
        rows = slice(dims.dp_rank * coverage.BATCH // 2, (dims.dp_rank + 1) * coverage.BATCH // 2)
        x, y = x[rows], y[rows]
        loss_sum, _ = vocab_parallel_cross_entropy(engine(x).flatten(0, 1), y.flatten(), dims.tp_group)
        loss = loss_sum / y.numel()
        engine.backward(loss)
        engine.step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=dims.dp_group)
        losses.append(value.item() / 2)
    state = tp_plan.full_state_dict({k: v.clone() for k, v in engine.full_state_dict().items()})
    ranges = {n: list(model.get_submodule(n).experts.expert_range) for n in model.moe_blocks}
    return {"losses": losses, "state": state, "expert_ranges": ranges}


@pytest.mark.slow
def test_expert_and_tensor_parallel_together_equal_one_process():
    from moe_lst.models.hf import coverage

    config = coverage.tiny_config("glm4_moe")  # (DeepSeek-style routing, shared experts, a first dense layer)
    ranks = run_multirank(_ep_tp_run, 4, config.to_dict(), timeout=600)
    coverage.compare(ranks, coverage.reference_run(config, "ep2"))
