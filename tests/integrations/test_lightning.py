"""lightning.Trainer(strategy=ZeroStrategy(...), accelerator="cpu", devices=2) on the project's Llama: the same
per-step losses as `python -m recipes.pretrain` with the same settings, and a resume from Lightning's own
checkpoint that continues bit for bit (losses and final parameters); and a Hugging Face model through the adapter with
pipeline stages (pp=2) as the engine's own loop trains it."""

from __future__ import annotations

import functools
import json
import sys
import types

import pytest
import torch

import zero
from tests.integrations.common import REPO, assert_same_state, launch, recipe_run

# optional frameworks (pyproject's test extra): without them these tests are skipped
pytest.importorskip("lightning")

RUNS = {
    # ZeRO-3 with a meta-device build (the engine fills it through the model contract's init_parameter)
    "zero3": {"stage": 3, "meta": True},
    # an expert-parallel plan declared from configure_model, ZeRO-2 with the optimizer offloaded to the host
    "moe_ep2": {"stage": 2, "offload": "cpu", "moe": True, "ep": 2},
    # Ulysses over both processes (dp=1, so micro-batches of 8: the global batch of dp=2 x 4), ZeRO-3 with
    # parameters and optimizer offloaded
    "sp2": {"stage": 3, "offload": "cpu", "sp": 2, "micro": 8},
    # a tensor-parallel plan (dp=1, micro-batches of 8), ZeRO-1
    "tp2": {"stage": 1, "tp": 2, "micro": 8},
}


# fit, validate and test at these ZeRO stages, in the same processes after RUNS
SWEEP_STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    launch([sys.executable, str(REPO / "tests/integrations/lightning_run.py"), str(out), json.dumps(RUNS),
            ",".join(map(str, SWEEP_STAGES)), "hf_pp"])
    return out, json.loads((out / "losses.json").read_text())


def _check(out, runs: dict, reference: dict, whole_model: bool = True, atol: float = 1e-6) -> None:
    """Losses and gradient norms as the recipe's; the final model as the recipe's (`whole_model`: when every rank
    holds whole parameters); the resumed run bit for bit the straight one."""
    straight, first, resumed = runs["straight"], runs["first"], runs["resumed"]
    assert straight["val_loss"] < straight["loss"][0] - 0.3  # trainer.validate after fit, on the trained engine
    for key in ("loss", "grad_norm"):
        assert straight[key] == pytest.approx(reference[key], rel=1e-5, abs=0), key
        assert first[key] == straight[key][:2], key  # the checkpointed run trained the same 2 steps
        assert resumed[key] == straight[key][2:], key  # and resuming continues bit for bit
    for rank in (0, 1):
        final = torch.load(out / f"final_rank{rank}.pt")
        assert_same_state(final["straight"], final["resumed"])
        if whole_model:
            assert_same_state(final["straight"], reference["final"], rtol=1e-5, atol=atol)


def test_zero3_equals_the_recipe_and_resumes_exactly(lightning_runs, recipe_zero3):
    out, losses = lightning_runs
    _check(out / "zero3", losses["zero3"], recipe_zero3)


def test_expert_parallel_plan_with_offload(lightning_runs, tmp_path):
    out, losses = lightning_runs
    reference = recipe_run(tmp_path / "run", ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "zero.stage=2",
                                                 "zero.offload_optimizer=cpu"])
    _check(out / "moe_ep2", losses["moe_ep2"], reference, whole_model=False)  # (each rank: its experts)


@pytest.mark.parametrize("name", ["sp2", "tp2"])
def test_sequence_and_tensor_parallel_plans(lightning_runs, recipe_zero3, name):
    out, losses = lightning_runs
    # The same global batches as the recipe's dp=2 run (the data depend on the global batch, not the layout). The
    # layout sums in another order, and AdamW's per-element normalisation magnifies that where a gradient is near
    # zero: a few weights differ by up to 2e-5 after 4 steps of lr 2e-3 (bit for bit at the recipe's own layout).
    _check(out / name, losses[name], recipe_zero3, whole_model=name == "sp2", atol=1e-4)  # (tp: rank slices)
    # validation through the parallel layout gives the dp=2 run's value
    assert losses[name]["straight"]["val_loss"] == pytest.approx(losses["zero3"]["straight"]["val_loss"], rel=1e-5)


def test_fit_validate_test_at_every_zero_stage(lightning_runs):
    """fit, then trainer.validate and trainer.test on the same engine, every loader split over the ranks by
    Lightning's DistributedSampler: at each stage the losses, gradient norms and trained weights of stage 0, and
    validation and test losses equal to the trained model's evaluated in one process over the whole sets."""
    out, _ = lightning_runs
    ranks = [json.loads((out / f"sweep_rank{rank}.json").read_text()) for rank in (0, 1)]
    reference = ranks[0]["0"]
    assert reference["loss"][-1] < reference["loss"][0] - 0.3  # it trains
    first = torch.load(out / "sweep_stage0.pt")
    for stage in SWEEP_STAGES:
        run = ranks[0][str(stage)]
        for key in ("val_loss", "test_loss"):
            assert ranks[1][str(stage)][key] == run[key], (stage, key)  # synchronised over the ranks
            assert run[key] == pytest.approx(run["plain"][key], rel=1e-5), (stage, key)
            assert run[key] == pytest.approx(reference[key], rel=1e-5), (stage, key)
        assert run["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=0), stage
        assert run["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5, abs=0), stage
        assert_same_state(torch.load(out / f"sweep_stage{stage}.pt"), first, rtol=1e-5, atol=1e-6)


def test_pipeline_stages_of_a_hugging_face_model(lightning_runs):
    """ZeroStrategy(pp=2): each training_step runs one step's batch, its 4 micro-batches (the own loop's 2 data-
    parallel ranks x 2 accumulated) forward and backward under 1F1B (hf_parallel.pipeline_loss), the optimizer step
    the engine's: the losses, gradient norms and weights of the engine's own loop over the plain model; validate
    runs forward through the stages."""
    out, _ = lightning_runs
    runs = json.loads((out / "hf_pp.json").read_text())
    for rank, losses in enumerate(runs["pp2"]["loss"]):  # the last stage's loss, on both stages' ranks
        assert losses == pytest.approx(runs["own"]["loss"], rel=1e-5, abs=0), rank
    assert runs["pp2"]["grad_norm"] == pytest.approx(runs["own"]["grad_norm"], rel=1e-5, abs=0)
    assert runs["own"]["loss"][-1] < runs["own"]["loss"][0] - 0.3  # it trains
    for rank in (0, 1):
        final = torch.load(out / f"hf_final_rank{rank}.pt")  # (the pipeline's gathered over its stages)
        assert sorted(final["pp2"]) == sorted(final["own"])
        for name, value in final["own"].items():
            torch.testing.assert_close(final["pp2"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    # trainer.validate through the stages: the trained model's loss over the first batch, in one forward
    assert runs["pp2"]["val_loss"] == pytest.approx(runs["pp2"]["plain_val_loss"], rel=1e-5)


# ---------------------------------------------------------------------------- one process: what is refused


def test_configure_optimizers_becomes_the_engines_factories():
    from moe_lst.integrations.lightning import optimizer_factories

    weight = torch.nn.Parameter(torch.zeros(3))
    built = torch.optim.AdamW([weight], lr=0.01, betas=(0.8, 0.9), weight_decay=0.2, fused=True)
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: 0.5)
    factory, scheduler = optimizer_factories({"optimizer": built, "lr_scheduler": {"scheduler": schedule}})
    rebuilt = factory([torch.nn.Parameter(torch.ones(5))])
    assert type(rebuilt) is torch.optim.AdamW and scheduler is schedule
    assert {k: rebuilt.defaults[k] for k in ("lr", "betas", "weight_decay", "fused")} == \
        {"lr": 0.01, "betas": (0.8, 0.9), "weight_decay": 0.2, "fused": True}
    assert optimizer_factories([zero.FastAdamW(lr=1e-3)])[1] is None


@pytest.mark.parametrize("returned, error", [
    (lambda p: [torch.optim.SGD([{"params": [p], "weight_decay": 0.1}, {"params": [torch.nn.Parameter(torch.ones(1))],
                                                                         "weight_decay": 0.0}], lr=0.1)],
     NotImplementedError),  # param groups with different hyperparameters
    (lambda p: [torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)], NotImplementedError),  # two optimizers
    (lambda p: {"optimizer": zero.FastAdamW(lr=1e-3), "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([p], lr=0.1), lambda s: 1.0)}, TypeError),  # a built scheduler
    (lambda p: {"optimizer": zero.FastAdamW(lr=1e-3), "lr_scheduler": {"scheduler": lambda o: None,
                                                                        "interval": "epoch"}}, NotImplementedError),
    (lambda p: None, TypeError),
])
def test_configure_optimizers_refusals(returned, error):
    from moe_lst.integrations.lightning import optimizer_factories

    with pytest.raises(error):
        optimizer_factories(returned(torch.nn.Parameter(torch.zeros(2))))


def test_trainer_settings_reach_the_engine_config():
    from moe_lst.integrations.lightning import _engine_config

    def trainer(accum=2, clip=0.5, algorithm="norm"):
        return types.SimpleNamespace(accumulate_grad_batches=accum, gradient_clip_val=clip,
                                     gradient_clip_algorithm=algorithm)

    config = _engine_config(zero.ZeroConfig(stage=3), trainer())
    assert (config.stage, config.grad_accum_steps, config.clip_grad_norm) == (3, 2, 0.5)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        _engine_config(zero.ZeroConfig(grad_accum_steps=4), trainer())
    with pytest.raises(ValueError, match="gradient_clip_val"):
        _engine_config(zero.ZeroConfig(clip_grad_norm=1.0), trainer())
    with pytest.raises(NotImplementedError, match="value"):
        _engine_config(zero.ZeroConfig(), trainer(algorithm="value"))


def test_pipeline_refusals():
    from moe_lst.integrations.lightning import ZeroPrecision, ZeroStrategy

    strategy = ZeroStrategy(pp=2)  # Lightning's own accumulation under pp: before any process group exists
    strategy._lightning_module = types.SimpleNamespace(_trainer=True,
                                                       trainer=types.SimpleNamespace(accumulate_grad_batches=2))
    with pytest.raises(ValueError, match=r"^Trainer\(accumulate_grad_batches=2\) with ZeroStrategy\(pp=2\)"):
        strategy.setup_environment()
    precision = ZeroPrecision()
    precision.pipelined = True  # the schedule ran backward: a loss with a graph means the step did not run it
    with pytest.raises(RuntimeError, match="returned a loss with one"):
        precision.backward(torch.ones(1, requires_grad=True), None, None)
    precision.backward(torch.ones(1), None, None)  # (the pipeline's loss: nothing left to do)


def test_the_sampler_splits_over_data_parallel_ranks_only():
    from moe_lst.integrations.lightning import ZeroStrategy

    strategy = ZeroStrategy(sp=2)
    with pytest.raises(RuntimeError, match="configure_model"):
        _ = strategy.dims
    strategy._dims = types.SimpleNamespace(dp=3, dp_rank=1)  # (as 6 processes with sp=2 would give rank 2 or 3)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 1}
