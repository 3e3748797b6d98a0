"""Pipeline and tensor parallelism, alone and composed with dp, sp, ep and ZeRO, equal the single-rank run.

Every case trains the tiny Llama of `harness` for three SGD steps (four micro-batches each, gradient
clipping on) and compares, on every rank, the global-batch losses, the global gradient norms and every
parameter it holds after the first step (the initial value minus the clipped gradient, so it checks all
gradients) and at the end, each replica and slice cut from the same training on one rank by its
placement (`tests.equivalence`). Several layouts share one spawn of ranks to keep the suite fast.
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.multirank import run_multirank
from tests.parallel.harness import assert_matches, reference, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@functools.cache
def _reference(key: str) -> dict:
    kwargs = json.loads(key)
    return reference(**{k: v for k, v in kwargs.items() if k in ("moe", "model_overrides", "steps", "eval_first")})


def _many(cases: list[tuple[dict, dict]]) -> list[dict]:
    """Run each (layout, options) in turn on every rank; this rank's records."""
    return [train(layout, **options) for layout, options in cases]


def _check(world: int, cases: list[tuple[dict, dict]]) -> None:
    per_rank = run_multirank(_many, world, cases, timeout=600)
    assert len(per_rank) == world and all(len(r) == len(cases) for r in per_rank)
    for i, (layout, options) in enumerate(cases):
        assert_matches([r[i] for r in per_rank], _reference(json.dumps(options, sort_keys=True)),
                       label=f"layout {layout} {options}")


SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]


def test_pp2_every_schedule_with_dp2():
    # Four ranks: two pipeline stages (or four virtual ones), each replicated over dp=2.
    _check(4, [({"dp": 2, "pp": 2}, {"schedule": s}) for s in SCHEDULES])


def test_pp2_schedules_on_two_ranks_untied_and_zero_stages():
    cases = [({"pp": 2}, {"schedule": s, "model_overrides": {"tie_embeddings": False}}) for s in ("1f1b", "zbv")]
    cases += [({"pp": 2}, {"stage": stage, "eval_first": stage == 1}) for stage in (1, 2, 3)]
    cases += [({"pp": 2}, {"stage": 2, "schedule": "interleaved_zb"}),
              ({"pp": 2}, {"stage": 3, "schedule": "dualpipev"})]
    _check(2, cases)


def test_pp4_1f1b_and_interleaved():
    eight = {"model_overrides": {"n_layers": 8}}
    _check(4, [({"pp": 4}, {"schedule": "1f1b"}), ({"pp": 4}, {"schedule": "interleaved_1f1b", **eight}),
               ({"pp": 4}, {"schedule": "gpipe", "stage": 2})])


def test_tp2_tied_and_untied():
    _check(2, [({"tp": 2}, {}), ({"tp": 2}, {"model_overrides": {"tie_embeddings": False}, "stage": 3})])


def test_tp4_and_tp_composed_with_dp_pp_sp():
    # tp=4 with 2 kv heads: each kv head is replicated on two ranks, its gradient summed over them.
    _check(4, [({"tp": 4}, {}), ({"dp": 2, "tp": 2}, {"stage": 2}), ({"pp": 2, "tp": 2}, {"eval_first": True}),
               ({"pp": 2, "tp": 2}, {"schedule": "zbv"}), ({"sp": 2, "tp": 2}, {"stage": 1})])


def test_moe_with_pp2_and_tp2():
    # interleaved_zb: the balancing losses attached inside the layers backpropagate in the input pass
    # with the engine's scale, and the experts' backward runs again in the weight pass.
    _check(2, [({"pp": 2}, {"moe": True}), ({"pp": 2}, {"moe": True, "schedule": "interleaved_zb"}),
               ({"tp": 2}, {"moe": True}),
               ({"tp": 2}, {"moe": {"num_shared_experts": 1, "bias_update_rate": 0.01}, "stage": 2})])


def test_moe_ep2_pp2():
    # dp=2 under ep: the balancing (aux) loss is a product of per-rank means, so it cannot equal one
    # rank's value on the whole batch; it is off here (the z-loss, a mean, stays on).
    _check(4, [({"dp": 2, "ep": 2, "pp": 2}, {"moe": {"aux_loss_coef": 0.0}}),
               ({"dp": 2, "ep": 2, "pp": 2}, {"moe": {"aux_loss_coef": 0.0}, "stage": 2, "schedule": "zbv"})])


def _resume(layout: dict, directory: str) -> tuple[dict, dict]:
    whole = train(layout, steps=4, ckpt_dir=directory)  # saves after step 3 of 4
    resumed = train(layout, steps=4, resume_from=directory)
    return whole, resumed


@pytest.mark.parametrize("layout, world", [({"pp": 2}, 2), ({"tp": 2}, 2)])
def test_checkpoint_resume(tmp_path, layout, world):
    for rank, (whole, resumed) in enumerate(run_multirank(_resume, world, layout, str(tmp_path / "ckpt"),
                                                          timeout=300)):
        assert len(resumed["losses"]) == 1 and resumed["losses"] == whole["losses"][3:]  # bit-exact continuation
        for view in ("master", "compute"):
            assert whole["final"][view] and whole["final"][view].keys() == resumed["final"][view].keys()
            for name, value in whole["final"][view].items():
                assert resumed["final"][view][name].equal(value), (rank, view, name)


def _save_then_load_other_layout(directory: str) -> tuple[str | None, str]:
    train({"pp": 2, "tp": 2}, steps=2, ckpt_dir=directory)
    resharded = train({"dp": 2, "tp": 2}, steps=2, resume_from=directory)["resharded_from"]
    try:
        train({"dp": 2, "tp": 2}, steps=2, resume_from=directory, model_overrides={"ffn_dim": 96})
    except ValueError as e:
        return resharded, str(e)
    return resharded, "loaded"


def test_checkpoint_of_another_layout_reshards_and_of_another_model_is_refused_by_name(tmp_path):
    # (tests/parallel/test_reshard.py checks that resharded runs continue the same trajectory.)
    resharded, message = run_multirank(_save_then_load_other_layout, 4, str(tmp_path / "ckpt"), timeout=300)[0]
    assert resharded == "dp=1 tp=2 pp=2 sp=1 ep=1, ZeRO stage 0, 4 ranks"
    assert "feed_forward.w2.weight of shape (32, 64)" in message and "is (32, 96)" in message, message


def test_zero3_moe_zero_bubble_and_offload_with_virtual_stages(tmp_path):
    # The weight-gradient passes of zero-bubble schedules run without ZeRO-3's gather hooks (the experts'
    # backward reads their weights); with two stages per rank a stage's final pass marks its gradients
    # final for offloaded stores (nvme computes the norm from them).
    nvme = {"offload_optimizer": "nvme", "nvme_path": str(tmp_path), "offload_chunk_size": 1000}
    _check(2, [({"pp": 2}, {"moe": True, "stage": 3, "schedule": "interleaved_zb"}),
               ({"pp": 2}, {"moe": True, "stage": 3, "schedule": "zbv"}),
               ({"pp": 2}, {"stage": 2, "schedule": "looped_bfs", "zero_options": nvme,
                            "model_overrides": {"tie_embeddings": False}}),
               ({"pp": 2}, {"stage": 2, "schedule": "interleaved_zb", "zero_options": {"offload_optimizer": "cpu"}})])


def _mismatched_microbatches() -> str:
    import torch

    import zero
    from moe_lst.models.llama import Transformer
    from tests.parallel.harness import model_config
    from zero.parallel.pipeline import apply_pipeline

    dims = zero.ParallelDims(pp=2)
    pipe = apply_pipeline(Transformer(model_config()), dims, microbatches=2, loss_fn=lambda out, y: out.sum())
    engine = zero.initialize(pipe.module, OPT_SGD, zero.ZeroConfig(grad_accum_steps=4), dims, plans=[pipe])
    try:
        pipe.train_step(engine, torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long),
                        position_ids=torch.zeros(4, 16, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return "ran"


def OPT_SGD(params):
    import torch

    return torch.optim.SGD(params, lr=0.1)


def test_pipeline_refuses_microbatches_other_than_the_engines_accumulation():
    for message in run_multirank(_mismatched_microbatches, 2):
        assert "runs 2 micro-batches per step but the engine accumulates grad_accum_steps=4" in message
