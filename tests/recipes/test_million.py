"""The million-token preset (`+experiment=million`) at 65,536 tokens: it trains, and the last 1,000
tokens of a held-out sequence, computed as training computes them (tiled MLP, tiled loss, activation
checkpointing, block-sparse sliding-window attention), equal a plain forward over a crop covering their
receptive field (recipes.crop_check)."""

import json
import math

import pytest
from hydra import compose, initialize_config_dir

from recipes.pretrain import train
from tests.recipes.test_pretrain import REPO, _losses


def _million(run_dir, *overrides):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=["+experiment=million", "train.seq_len=65536", f"run_dir={run_dir}",
                                            "wandb.mode=disabled", "train.progress=false", *overrides])


@pytest.mark.slow
def test_million_preset_at_64k_tokens_trains_and_matches_a_plain_crop(tmp_path):
    result = train(_million(tmp_path, "train.steps=2"))
    losses = _losses(tmp_path)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses.values()) and losses[2] < losses[1]
    assert result["crop_check_tokens"] == 1000 and result["crop_check_crop_len"] == 1536
    assert result["crop_check_max_abs_diff"] <= 1e-4 and result["crop_check_passed"], result
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["tokens_per_s"] > 0 and record["peak_rss_mb"] > 0
