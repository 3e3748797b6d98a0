"""parallel.cp through the recipe's own parallelize (tests/parallel/harness.py): 4 ranks equal one, step by step.

The tiny Llama (4 heads, 2 kv heads) trains three SGD steps with ZeRO-3 under ring attention alone (cp=4, more ranks
than kv heads), under Ulysses x ring (sp=2 x cp=2) on packed documents, an MoE model with ep=2 under sp=2 x cp=2
(its routing statistics summed over the whole sequence), tensor parallelism under the ring (tp=2 x cp=2, ZeRO-1: each
rank's ring passes k/v of its own tp slice of the heads), and a Hugging Face Llama through the attention interface;
losses, gradient norms and every parameter after the first step (the gradient) and at the end are compared on every
rank (`tests.equivalence`). One spawn runs every case. The config's refusals come first, on one process.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tests.multirank import run_multirank

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CONF = Path(__file__).resolve().parents[2] / "recipes" / "conf"

# The default suite runs the case that composes the most (ZeRO-3, ep=2 MoE, Ulysses x ring) and tp x cp in the same
# spawn; the rest are slow.
# One step: its parameter change under SGD is the reduced gradient (tests.equivalence), which this case compares.
CASES = [({"sp": 2, "cp": 2, "ep": 2}, {"stage": 3, "moe": True, "steps": 1}),
         ({"tp": 2, "cp": 2}, {"stage": 1, "steps": 1})]
SLOW_CASES = [
    ({"cp": 4}, {"stage": 3, "steps": 2}),
    ({"sp": 2, "cp": 2}, {"stage": 3, "packed": True, "steps": 2}),
    ({"sp": 2, "cp": 2}, {"hf": "llama", "steps": 2}),
    ({"cp": 2}, {"hf": "llama", "steps": 2}),  # (two rings of two ranks, dp=2)
    ({"cp": 4}, {"hf": "llama", "steps": 2}),
]


def _many(cases: list) -> list[dict]:
    from tests.parallel.harness import train

    return [train(layout, **options) for layout, options in cases]


@functools.cache
def _reference(key: str) -> dict:
    from tests.parallel.harness import reference

    return reference(**json.loads(key))


@pytest.fixture(scope="module")
def per_rank():
    return run_multirank(_many, 4, CASES, timeout=600)


def _check(per_rank: list[list[dict]], cases: list) -> None:
    from tests.parallel.harness import assert_matches

    for index, (layout, options) in enumerate(cases):
        assert_matches([r[index] for r in per_rank], _reference(json.dumps(options, sort_keys=True)),
                       label=f"layout {layout} {options}")


def test_context_parallel_training_equals_one_process(per_rank):
    _check(per_rank, CASES)


@pytest.mark.slow
def test_context_parallel_training_equals_one_process_more_layouts():
    """cp=4 alone (more ranks than kv heads), packed documents under sp=2 x cp=2, a Hugging Face Llama at U x C =
    2x2, 1x2 and 1x4."""
    _check(run_multirank(_many, 4, SLOW_CASES, timeout=900), SLOW_CASES)


REFUSALS = [
    (["parallel.cp=2", "train.seq_len=30"], "not divisible by 2 \\* sp \\* cp = 2 \\* 1 \\* 2 = 4"),
    (["parallel.cp=2", "parallel.sp=2", "train.seq_len=36"], "not divisible by 2 \\* sp \\* cp = 2 \\* 2 \\* 2 = 8"),
    (["parallel.cp=2", "model.attention=nsa", "train.seq_len=64"],
     "ring attention \\(parallel.cp\\) does not run native sparse attention: .*; use parallel.sp \\(Ulysses\\) for "
     "model.attention=nsa$"),
    (["parallel.cp=2", "model.attention=sparse", "model.sparse.block_size=24", "train.seq_len=64"],
     "each of the 2 \\* parallel.cp = 4 chunks of the 64-token row \\(16 tokens\\) to be whole blocks of "
     "model.sparse.block_size=24; use a train.seq_len that is a multiple of 96$"),
    (["parallel.cp=3", "train.seq_len=60"], "cp=3 = 3 does not divide the 2 process"),
    (["parallel.cp=2", "parallel.dp=2", "train.seq_len=64"], "dp=2 x tp=1 x pp=1 x sp=1 x cp=2 = 4 does not match"),
    (["parallel.cp=2", "parallel.pp=2", "train.seq_len=64"], "parallel.cp=2 with parallel.pp=2 is not implemented"),
    (["parallel.cp=2", "parallel.tp=2", "train.seq_len=64"], "tp=2 x pp=1 x sp=1 x cp=2 = 4 does not divide the 2"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS, ids=[" ".join(o) for o, _ in REFUSALS])
def test_context_parallel_config_refused_in_one_line(overrides, message, monkeypatch):
    """Refused by the config check, before any process group exists (two processes claimed, none started)."""
    from recipes.config import check_config
    from zero.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with initialize_config_dir(version_base=None, config_dir=str(CONF)):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ConfigError, match=message) as info:
        check_config(cfg)
    assert "\n" not in str(info.value)


def test_context_parallel_with_tensor_parallel_accepted(monkeypatch):
    """cp=2 x tp=2 on four processes passes the config check (the layout the equivalence case trains)."""
    from recipes.config import check_config, data_parallel_degree

    monkeypatch.setenv("WORLD_SIZE", "4")
    with initialize_config_dir(version_base=None, config_dir=str(CONF)):
        cfg = compose("config", overrides=["parallel.cp=2", "parallel.tp=2", "train.seq_len=64"])
    check_config(cfg)
    assert data_parallel_degree(cfg) == 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.cp=4"], ["parallel.sp=2", "parallel.cp=2", "model.attention=sparse",
                                                        "model.sparse.layout=sliding_window",
                                                        "model.sparse.block_size=8", "model.sparse.window_blocks=2"],
                                    ["parallel.tp=2", "parallel.cp=2"]])
def test_recipe_comm_bytes_equal_the_planner(layout):
    """Four ranks of the recipe count (zero.dist.comm) what recipes.plan predicts for them, the ring's p2p
    included, per rank (the layout-aware ring sends rank 0 and rank cp-1 less; under tp each ring sends its slice of
    the kv heads)."""
    import recipes.config  # noqa: F401 (registers the config's schema, which the yaml files pull in)
    from recipes.planner import estimate
    from recipes.planner.measure import measure

    overrides = ["model=tiny", "train.micro_batch_size=2", "train.seq_len=64", "zero.stage=3", *layout]
    measured = run_multirank(measure, 4, overrides, 2, timeout=600, fresh=True)
    with initialize_config_dir(version_base=None, config_dir=str(CONF)):
        cfg = compose("config", overrides=overrides)
    predicted = estimate(cfg, world=4)
    assert [m["comm"] for m in measured] == [p.comm_bytes_by_kind for p in predicted]
    assert all(m["comm"]["p2p"] > 0 for m in measured)


@pytest.mark.slow
def test_checkpoints_reshard_across_cp(tmp_path):
    """A run saved under sp=2 x cp=2 (ZeRO-3) continues on one rank, then under cp=4 (ZeRO-1), on the trajectory of
    the uninterrupted one-rank run, AdamW moments included (tests/parallel/test_reshard.py's chain)."""
    from tests.parallel.test_reshard import _assert_trajectory, _legs, _per_leg, _reference

    d = str(tmp_path)
    legs = _per_leg(run_multirank(_legs, 4, d, [({"sp": 2, "cp": 2}, "a", None, 2, {"stage": 3})], timeout=600))
    legs += [[leg] for leg in _legs(d, [({}, "b", "a", 4, {})])]
    legs += _per_leg(run_multirank(_legs, 4, d, [({"cp": 4}, "c", "b", 6, {"stage": 1})], timeout=600))
    _assert_trajectory(legs, _reference(False))
