"""Checkpoints reshard: a run saved under one layout continues under another (dp size, ZeRO stage, ep,
sp, pp, tp) with the same loss trajectory as the uninterrupted single-rank run, AdamW moments included.

Each chain trains the tiny Llama of `harness` for a few steps per layout ("leg"), saving at the end of
each leg and resuming the next leg, under the next layout, from that checkpoint. The losses, gradient
norms and final parameters of the whole chain must equal one uninterrupted run on one rank (fp32
tolerance). A round trip A -> B -> A gives back every shard of A bit for bit: parameters and optimizer
state are moved, never recomputed.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.equivalence import assert_snapshot
from tests.multirank import run_multirank
from tests.parallel.harness import reference, train
from zero.state.shardfile import dump, load

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MOE = {"aux_loss_coef": 0.0}  # under dp > 1 the balancing loss is a product of per-rank means (see test_layouts)


@functools.cache
def _reference(moe: bool) -> dict:
    return reference(steps=6, moe=MOE if moe else False, optim="adamw")


def _legs(directory: str, legs: list, moe: bool = False) -> list[dict]:
    """Each leg (layout, name, resume_from, stop step, options) trains to `stop` and saves as `name`."""
    return [train(layout, steps=stop, moe=MOE if moe else False, optim="adamw", ckpt_dir=f"{directory}/{name}",
                  save_at=stop, resume_from=f"{directory}/{source}" if source else None, **options)
            for layout, name, source, stop, options in legs]


def _per_leg(per_rank: list[list[dict]]) -> list[list[dict]]:
    """run_multirank's [rank][leg] records as [leg][rank]."""
    return [list(leg) for leg in zip(*per_rank)]


def _assert_trajectory(legs: list[list[dict]], reference: dict) -> None:
    """`legs`: per leg, every rank's record. The chained losses and norms on every rank, and every rank's
    final parameters, equal the uninterrupted one-rank run."""
    assert legs and all(legs)
    for rank in range(max(len(leg) for leg in legs)):
        losses = [v for leg in legs for v in leg[min(rank, len(leg) - 1)]["losses"]]
        norms = [v for leg in legs for v in leg[min(rank, len(leg) - 1)]["norms"]]
        assert len(losses) == len(reference["losses"]), (rank, len(losses))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(reference["norms"]), rtol=1e-5, atol=2e-6)
    for rank, record in enumerate(legs[-1]):
        assert_snapshot(record["final"], reference["final"], where=f"last leg, rank {rank}")


def _shards_equal(a: str, b: str, world: int) -> None:
    for r in range(world):
        x, y = (load(f"{d}/rank{r:05d}.safetensors")["engine"] for d in (a, b))
        assert x["layout"] == y["layout"]
        for u, v in zip(x["shards"], y["shards"]):
            assert u.equal(v)
        sx, sy = x["optimizer"]["state"], y["optimizer"]["state"]
        assert sx.keys() == sy.keys() and sx
        for i in sx:
            for k in sx[i]:
                assert torch.as_tensor(sx[i][k]).equal(torch.as_tensor(sy[i][k])), (r, i, k)
        assert x["counters"] == y["counters"]


def test_dp_2_to_1_to_4(tmp_path):
    d = str(tmp_path)
    legs = _per_leg(run_multirank(_legs, 2, d, [({"dp": 2}, "a", None, 2, {"stage": 2})], timeout=300))
    legs += [[leg] for leg in _legs(d, [({}, "b", "a", 4, {})])]
    legs += _per_leg(run_multirank(_legs, 4, d, [({"dp": 4}, "c", "b", 6, {"stage": 1})], timeout=300))
    assert [len(leg) for leg in legs] == [2, 1, 4]
    assert [leg[0]["resharded_from"] for leg in legs] == [
        None, "dp=2 tp=1 pp=1 sp=1 ep=1, ZeRO stage 2, 2 ranks", "dp=1 tp=1 pp=1 sp=1 ep=1, ZeRO stage 0, 1 ranks"]
    _assert_trajectory(legs, _reference(False))


def test_zero_stage_3_to_1_to_2_then_sp2_pp2_tp2(tmp_path):
    d = str(tmp_path)
    legs = _per_leg(run_multirank(_legs, 2, d, [({"dp": 2}, "a", None, 1, {"stage": 3}),
                                       ({"dp": 2}, "b", "a", 2, {"stage": 1}),
                                       ({"dp": 2}, "c", "b", 3, {"stage": 2}),
                                       ({"sp": 2}, "d", "c", 4, {"stage": 1}),
                                       ({"pp": 2}, "e", "d", 5, {"stage": 2}),
                                       ({"tp": 2}, "f", "e", 6, {"stage": 3})], timeout=300))
    assert len(legs) == 6
    _assert_trajectory(legs, _reference(False))


def _moe_chain_then_unplaced(directory: str) -> tuple[list[dict], str]:
    legs = _legs(directory, [({"dp": 2, "ep": 2}, "a", None, 2, {"stage": 1}),
                             ({"tp": 2}, "b", "a", 4, {}),  # ep 2 -> 1 (experts split by tp)
                             ({"dp": 2, "ep": 2}, "c", "b", 6, {"stage": 2}),  # ep 1 -> 2
                             ({"dp": 2}, "d", "c", 6, {}),  # round trip: c -> ep 1 -> c
                             ({"dp": 2, "ep": 2}, "e", "d", 6, {"stage": 2})], moe=True)
    # Experts split over ep without declared placements: such a checkpoint resumes only at its own layout.
    _legs(directory, [({"dp": 2, "ep": 2}, "f", None, 1, {"placements": False})], moe=True)
    try:
        _legs(directory, [({"dp": 2}, "g", "f", 2, {})], moe=True)
    except ValueError as e:
        return legs, str(e)
    return legs, "loaded"


def test_moe_ep_2_to_1_to_2_with_expert_tp_and_round_trip(tmp_path):
    d = str(tmp_path)
    results = run_multirank(_moe_chain_then_unplaced, 2, d, timeout=300)
    refused = results[0][1]
    legs = _per_leg([legs for legs, _ in results])
    assert len(legs) == 5
    _assert_trajectory(legs[:3], _reference(True))
    _shards_equal(f"{d}/c", f"{d}/e", 2)
    assert "split over tp or ep without a recorded placement (e.g. layers.1.feed_forward.experts.w_in)" in refused


def test_checkpoint_of_a_model_with_more_parameters_is_refused_and_older_checkpoints_resume(tmp_path):
    import functools
    import json

    import zero

    def engine(n: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n)])
        return zero.initialize(model, functools.partial(torch.optim.AdamW, lr=0.1))

    e = engine(3)
    e.module(torch.ones(2, 4)).sum().backward()
    e.step()
    e.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(zero.ReshardError, match="holds 2.bias .and 1 more., which this model does not have"):
        engine(2).load_checkpoint(tmp_path / "ckpt")
    # A checkpoint written before shapes and placements were recorded still resumes at its own layout.
    shard = tmp_path / "ckpt" / "rank00000.safetensors"
    state = load(shard)
    for bucket in state["engine"]["layout"]:
        del bucket["shapes"], bucket["placements"]
    with open(shard.with_name("rewritten"), "wb") as f:
        dump(state, f)
    shard.with_name("rewritten").replace(shard)  # the old file stays mapped by `state` until here
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    meta["shards"] = None
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(meta))
    again = engine(3)
    again.load_checkpoint(tmp_path / "ckpt")
    assert again.loaded_checkpoint["resharded_from"] is None
    for a, b in zip(again.module.parameters(), e.module.parameters()):
        assert a.equal(b)
    assert zero.consolidate(zero.open_checkpoint(tmp_path / "ckpt"))["1.weight"].numel() == 16
