"""Recipe runs with block-sparse and native sparse attention, and their config errors."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes.config import ConfigError, check_config
from recipes.pretrain import train
from tests.recipes.test_pretrain import TINY, _run_cli

REPO = Path(__file__).resolve().parents[2]
SPARSE = ["model.attention=sparse", "model.sparse.layout=bigbird", "model.sparse.block_size=8",
          "model.sparse.window_blocks=2", "model.sparse.random_blocks=1"]
NSA = ["model.attention=nsa", "model.nsa.block_size=8", "model.nsa.compress_block=8", "model.nsa.compress_stride=4",
       "model.nsa.select_blocks=4", "model.nsa.window_blocks=2"]


def _cfg(run_dir, *overrides):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=[*TINY, f"run_dir={run_dir}", "wandb.mode=disabled", *overrides])


@pytest.mark.parametrize("attention", [SPARSE, NSA], ids=["sparse", "nsa"])
def test_recipe_trains_with_sparse_attention(tmp_path, attention):
    # 64 tokens are 8 blocks of 8: the layouts leave most blocks out
    train(_cfg(tmp_path, *attention, "train.seq_len=64", "train.steps=12", "train.eval_every=6"))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]


@pytest.mark.parametrize("overrides, message", [
    (["model.attention=sparse", "model.sparse.block_size=0"], "model.sparse.block_size=0 must be an integer >= 1"),
    (["model.attention=sparse", "model.sparse.window_blocks=0"], "window_blocks=0 must be an integer >= 1"),
    (["model.attention=sparse", "model.sparse.layout=bigbird", "model.sparse.block_size=8",
      "model.sparse.global_blocks=5"], "model.sparse.global_blocks=5 is more global blocks than the sequence has"),
    (["model.attention=sparse", "model.sparse.layout=longformer", "model.sparse.global_tokens=[40]"],
     "model.sparse.global_tokens=[40] must be token positions < the sequence length 32"),
    (["model.attention=sparse", "model.sparse.layout=strided"], "model.sparse.layout='strided' is not a layout"),
    (["model.sparse.layout=bigbird"], "model.sparse.layout='bigbird' is set but model.attention=dense"),
    (["model.nsa.window_blocks=2"], "model.nsa.window_blocks=2 is set but model.attention=dense"),
    (["model.attention=sparse", "model.sparse.random_blocks=3"], "has no effect with model.sparse.layout=fixed"),
    (["model.attention=nsa", "model.nsa.select_blocks=1"], "model.nsa.select_blocks=1 must be an integer >= 3"),
    (["model.attention=nsa", "parallel.tp=2"], "model.attention=nsa with tp=2 is not supported"),
    (["model.attention=nsa", "parallel.sp=4"], "NSA selects blocks once per GQA group"),
    (["model.attention=dense_ish"], "model.attention='dense_ish' must be one of dense, sparse, nsa"),
])
def test_bad_attention_configs_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        check_config(_cfg(tmp_path, *overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_bad_layout_is_one_line_and_exit_2(tmp_path):
    proc = _run_cli(*TINY, f"run_dir={tmp_path}", "model.sparse.window_blocks=3", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.sparse.window_blocks=3 is set but model.attention=dense" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_sparse_models_do_not_export_to_hugging_face():
    from recipes.export import ExportError, to_hf
    from moe_lst.models.llama import ModelConfig

    for attention in ("sparse", "nsa"):
        with pytest.raises(ExportError, match=f"model.attention={attention} has no Hugging Face"):
            to_hf({}, ModelConfig(attention=attention))
