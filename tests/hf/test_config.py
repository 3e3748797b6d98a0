"""model=hf configs the recipe refuses, each in one line naming the key, the rule and the fix (exit 2 from the
command line), before any process group or model exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes.config import ConfigError, check_config
from tests.hf.tiny import NEEDS_MOE, write_config

REPO = Path(__file__).resolve().parents[2]
BASE = ["model=hf", "train.seq_len=32", "wandb.mode=disabled"]


def _config_dir(tmp_path: Path, kind: str = "llama", **overrides) -> Path:
    return write_config(tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}", kind, **overrides)


def _check(tmp_path: Path, *overrides: str) -> None:
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        check_config(compose("config", overrides=[*BASE, f"run_dir={tmp_path / 'run'}", *overrides]))


def test_a_tiny_config_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # (as torchrun would set it for parallel.sp=2)
    _check(tmp_path, f"model.hf.config={_config_dir(tmp_path)}", "parallel.sp=2", "train.tiled_mlp=2",
           "model.hf.overrides={hidden_size: 64, num_hidden_layers: 3, rms_norm_eps: 1}",
           "model.attention=sparse", "model.sparse.layout=sliding_window", "model.sparse.block_size=8")


CASES = [  # (config.json kind and keys, overrides, the message)
    (("llama", {}), ["model.hf.overrides={hidden_sise: 64}"],
     r"model.hf.overrides.hidden_sise is not a key of the llama config .*: did you mean hidden_size\?"),
    (("llama", {}), ["model.hf.overrides={hidden_size: big}"],
     r"model.hf.overrides.hidden_size='big' must be an int like the config's hidden_size=32"),
    (("llama", {}), ["model.hf.overrides={hidden_size: 30}"],
     r"with model.hf.overrides: The hidden size \(30\) is not a multiple of the number of attention heads \(4\)"),
    (("llama", {}), ["model.hf.overrides={model_type: qwen3}"], r"cannot change the model type"),
    (("llama", {}), ["model.hf.overrides=64"], r"model.hf.overrides=64 must be a mapping of config.json keys"),
    (("qwen3", {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True,
                "sliding_window": 64, "max_window_layers": 1}), ["model.hf.overrides={num_hidden_layers: 3}"],
     r"lists mixed layer_types .*: override layer_types too"),
    (("llama", {}), ["train.seq_len=128"],
     r"train.seq_len=128 does not fit the model: its max_position_embeddings=64; lower train.seq_len or set "
     r"model.hf.overrides.max_position_embeddings"),
    (("llama", {"attention_dropout": 0.1}), [], r"attention_dropout=0.1 \(the adapter's attention has no dropout"),
    (("llama", {}), ["parallel.tp=2", "model.hf.overrides={intermediate_size: 47}"],
     r"parallel.tp=2 with model=hf is refused: tp=2 does not divide intermediate_size=47"),
    (("llama", {}), ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
     r"parallel.pp_schedule=interleaved_1f1b places several stages on a rank, which model=hf does not offer"),
    (("qwen3_moe", {"moe_intermediate_size": 25}), ["parallel.tp=2"],
     r"parallel.tp=2 with model=hf is refused: MoE block model.layers.0.mlp: tp=2 does not divide its experts' 25 "
     r"hidden units"),
    (("olmoe", {}), ["parallel.pp=2"], r"parallel.pp=2 with model=hf is refused: the coverage sweep's pp2 check "
                                       r"of model_type olmoe: refused: there is no plan to map"),
    (("llama", {}), ["parallel.sp=8"], r"parallel.sp=8 cannot exceed the number of query heads \(4\): the rule is sp "
                                       r"<= n_heads / tp; use parallel.sp <= 4 and put"),
    (("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
     ["parallel.sp=2"], r"rope_type=dynamic .* differs per rank under parallel.sp=2"),
    (("llama", {}), ["model.attention=nsa"], r"model.attention='nsa' with model=hf must be dense or sparse"),
    (("llama", {}), ["model.sparse.layout=bigbird"], r"model.sparse.layout is set but model.attention=dense"),
    (("llama", {}), ["parallel.ep=2"], r"parallel.ep=2 needs an MoE model \(model_type llama is dense\)"),
    (("llama", {}), ["train.crop_check_tokens=8"], r"train.crop_check_tokens needs the project's Llama"),
    (("mixtral", {}), ["train.tiled_mlp=2"], r"model_type mixtral has no dense MLP to tile"),
]


@pytest.mark.parametrize("config,overrides,message",
                         [pytest.param(*case, marks=NEEDS_MOE) if case[0][0] == "mixtral" else case for case in CASES])
def test_bad_model_is_one_line(tmp_path, config, overrides, message):
    kind, keys = config
    with pytest.raises(ConfigError, match=message) as error:
        _check(tmp_path, f"model.hf.config={_config_dir(tmp_path, kind, **keys)}", *overrides)
    assert "\n" not in str(error.value)


def test_bad_sources_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model=hf needs model.hf.config=<a config.json or a model directory>"):
        _check(tmp_path)
    with pytest.raises(ConfigError, match=r"model.hf.config=.*nowhere is neither a config.json nor a directory"):
        _check(tmp_path, f"model.hf.config={tmp_path / 'nowhere'}")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(ConfigError, match=r"model_type='bert' .* is not covered by the Hugging Face adapter: "
                                          r"logits: .*bidirectional attention \(is_causal=False\) is not supported "
                                          r"\(docs/hf_coverage.md lists the model types it builds\)"):
        _check(tmp_path, f"model.hf.config={tmp_path / 'bert'}")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"broken.json is not a readable JSON config"):
        _check(tmp_path, f"model.hf.config={tmp_path / 'broken.json'}")


def test_command_line_exits_2_in_one_line(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    run = subprocess.run([sys.executable, "-m", "recipes.pretrain", "model=hf", f"model.hf.config={tmp_path / 'bert'}",
                          f"run_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: model.hf.config=") and \
        "model_type='bert'" in run.stderr and "is not covered by the Hugging Face adapter" in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()


def test_configs_with_tagged_floats_and_other_position_keys_are_read(tmp_path):
    # transformers writes floats JSON has no literal for as tagged objects (bamba's time_step_limit [0, Infinity]),
    # and bounds some decoders' positions under another key (whisper's max_target_positions)
    from moe_lst.models.hf.coverage import tiny_config

    tiny_config("bamba").save_pretrained(tmp_path / "bamba")
    assert '"__float__": "Infinity"' in (tmp_path / "bamba" / "config.json").read_text()
    _check(tmp_path, f"model.hf.config={tmp_path / 'bamba'}", "train.seq_len=16")
    tiny_config("whisper").save_pretrained(tmp_path / "whisper")
    _check(tmp_path, f"model.hf.config={tmp_path / 'whisper'}", "train.seq_len=16")
    with pytest.raises(ConfigError, match=r"train.seq_len=4096 does not fit the model: its max_target_positions=\d+; "
                                          r"lower train.seq_len or set model.hf.overrides.max_target_positions"):
        _check(tmp_path, f"model.hf.config={tmp_path / 'whisper'}", "train.seq_len=4096")
