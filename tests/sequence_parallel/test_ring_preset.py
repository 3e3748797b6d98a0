"""The 2M-token ring preset (`+experiment=two_million_cp`: cp=4, a 2-head model, sliding window, tiled MLP and loss,
checkpointing) through the recipe on 4 ranks at a shorter length: it trains to a finite, falling loss, and the last
1,000 tokens of a held-out sequence, computed as training computes them (each rank two mirrored chunks, the ring
between them), equal a plain forward over a crop covering their receptive field (recipes.crop_check)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.multirank import run_multirank

CONF = Path(__file__).resolve().parents[2] / "recipes" / "conf"


def _train(run_dir: str, seq_len: int, steps: int) -> dict:
    from hydra import compose, initialize_config_dir

    import recipes.config  # noqa: F401 (registers the config's schema)
    from recipes.pretrain import train

    with initialize_config_dir(version_base=None, config_dir=str(CONF)):
        cfg = compose("config", overrides=["+experiment=two_million_cp", f"train.seq_len={seq_len}",
                                           f"train.steps={steps}", f"run_dir={run_dir}", "wandb.mode=disabled",
                                           "train.progress=false"])
    return train(cfg)


def _check(tmp_path: Path, seq_len: int, steps: int) -> None:
    results = run_multirank(_train, 4, str(tmp_path), seq_len, steps, timeout=900)
    result = results[0]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x and "step" in x]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses), losses
    if steps > 1:
        assert losses[-1] < losses[0], losses
    assert result["crop_check_passed"] and result["crop_check_max_abs_diff"] <= 1e-4, result


@pytest.mark.slow
def test_two_million_preset_at_16k_tokens_on_four_ranks(tmp_path):
    _check(tmp_path, 16384, 2)


@pytest.mark.slow
def test_two_million_preset_at_256k_tokens_on_four_ranks(tmp_path):
    _check(tmp_path, 262144, 1)
