"""The recipe's typed config: every section is a dataclass in Hydra's ConfigStore, and a misspelt key (with or
without `+`, at any level) or a value of the wrong type ends the run in one line, exit 2, naming the nearest key."""

from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import zero
from recipes.config import (
    BinDataConfig,
    ConfigError,
    OptimConfig,
    ParallelConfig,
    StdlibDataConfig,
    TrainConfig,
    WandbConfig,
    ZeroSection,
    check_config,
    compose_command_line,
)
from tests.recipes.cli import run_command_lines
from tests.recipes.test_pretrain import TINY

CONF = Path(__file__).resolve().parents[2] / "recipes" / "conf"


def _compose(*overrides):
    with initialize_config_dir(version_base=None, config_dir=str(CONF)):
        return compose("config", overrides=list(overrides))


UNKNOWN_ON_THE_COMMAND_LINE = [("+train.stepz=5", "train.steps"), ("train.stepz=5", "train.steps")]
WRONG_TYPE = "train.steps=abc"


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory):
    """This file's command lines, each as `python -m recipes.pretrain` runs it, all in one process
    (tests.recipes.cli): {arg: (run_dir, CompletedProcess)}."""
    args = [arg for arg, _ in UNKNOWN_ON_THE_COMMAND_LINE] + [WRONG_TYPE]
    run_dirs = [tmp_path_factory.mktemp("cli") for _ in args]
    procs = run_command_lines([[*TINY, f"run_dir={run_dir}", arg] for arg, run_dir in zip(args, run_dirs)])
    return {arg: (run_dir, proc) for arg, run_dir, proc in zip(args, run_dirs, procs)}


@pytest.mark.parametrize("arg, nearest", UNKNOWN_ON_THE_COMMAND_LINE)
def test_cli_unknown_key_is_one_line_naming_the_nearest_key(command_lines, arg, nearest):
    run_dir, proc = command_lines[arg]
    assert proc.returncode == 2, proc.stderr[-2000:]
    key = arg.lstrip("+").split("=")[0]
    assert proc.stderr.strip() == f"error: unknown config key {key}: did you mean {nearest}?", proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # refused before any work


@pytest.mark.parametrize("arg, nearest", [
    ("+train.stepz=5", "train.steps"),
    ("train.stepz=5", "train.steps"),
    ("+optim.lrr=1", "optim.lr"),
    ("+parallel.dpp=2", "parallel.dp"),
    ("+data.pathh=x", "data.val_path (with data=bin)"),
    ("+wandb.modee=x", "wandb.mode"),
    ("+model.moe.topk=2", "model.moe.top_k"),
    ("model.moe.topk=2", "model.moe.top_k"),
    ("+trian.steps=5", "train.steps"),
])
def test_unknown_key_names_the_nearest_key_as_the_command_line_does(tmp_path, arg, nearest):
    """What the command line runs before any work (compose as Hydra would, then check), in this process: the two
    cases above show the command line turns it into one line on stderr and exit 2."""
    key = arg.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError) as info:
        check_config(compose_command_line([*TINY, f"run_dir={tmp_path}", arg]))
    assert str(info.value) == f"unknown config key {key}: did you mean {nearest}?"


def test_cli_wrong_type_is_one_line_and_exit_2(command_lines):
    _, proc = command_lines[WRONG_TYPE]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: train.steps='abc' is refused: ") and "Integer" in proc.stderr


@pytest.mark.parametrize("overrides, message", [
    (["+train.stepz=5"], "unknown config key train.stepz: did you mean train.steps?"),
    (["++zero.stag=1"], "unknown config key zero.stag: did you mean zero.stage?"),
    (["+model.dimm=3"], "unknown config key model.dimm: did you mean model.dim?"),
    (["+train.xyzzy=1"], "unknown config key train.xyzzy: the keys of train are steps, seed,"),
    (["+foo=1"], "unknown config key foo: the keys are model, data, parallel, optim, zero, train, eval, wandb, "
     "run_dir"),
    (["data=bin"], "data.train_path is required (it has no default): set data.train_path=..."),
    (["data.kind=bin"], "data.kind='bin' does not go with data=stdlib"),
    (["model.moe=3"], "model.moe=3 must be a block of keys: set them one by one (model.moe.num_experts=...)"),
    (["data=tokenized", "data.path=x", "data.packing=docs"], "data.packing='docs' must be document (attention and "
     "loss stay inside each document) or concat"),
])
def test_in_process_unknown_and_missing_keys(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        check_config(_compose(f"run_dir={tmp_path}", *overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["train.grad_accum=0"], "train.grad_accum=0 must be an integer >= 1"),
    (["optim.grad_clip=-1.0"], "optim.grad_clip=-1.0 is invalid: it must be a number >= 0.0"),
    (["zero.prefetch_depth=-1"], "zero.prefetch_depth=-1 must be an integer >= 0"),
])
def test_zero_config_rules_name_the_recipe_keys(tmp_path, overrides, message):
    """ZeroConfig's own rules refuse train.grad_accum and optim.grad_clip (its grad_accum_steps and clip_grad_norm),
    named by the recipe's keys (recipes.config.RECIPE_KEYS), not a second copy of the rule in the recipe."""
    with pytest.raises(ConfigError) as info:
        check_config(_compose(f"run_dir={tmp_path}", *overrides))
    assert str(info.value) == message


@pytest.mark.parametrize("overrides, message", [
    (["train.stepz=5"], "unknown config key train.stepz: did you mean train.steps?"),
    (["optim.lr=fast"], "optim.lr='fast' is refused: "),
    (["model=nosuch"], "Could not find 'model/nosuch'"),
    (["train.steps=[1"], "'train.steps=[1' is not a valid override"),
])
def test_what_hydra_cannot_compose_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        compose_command_line(overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_sections_are_typed_by_their_dataclasses():
    cfg = _compose()
    for section, schema in [("train", TrainConfig), ("optim", OptimConfig), ("parallel", ParallelConfig),
                            ("data", StdlibDataConfig), ("wandb", WandbConfig), ("zero", ZeroSection)]:
        assert OmegaConf.get_type(cfg[section]) is schema, section
    assert OmegaConf.get_type(_compose("data=bin", "data.train_path=a", "data.val_path=b").data) is BinDataConfig
    # zero.* is zero.ZeroConfig less what the recipe fills from train.grad_accum and optim.grad_clip
    assert [f.name for f in fields(ZeroSection)] == [
        f.name for f in fields(zero.ZeroConfig) if f.name not in ("grad_accum_steps", "clip_grad_norm")]
    assert zero.ZeroConfig(**OmegaConf.to_container(cfg.zero)) == zero.ZeroConfig()


@pytest.mark.parametrize("path, schema", [
    ("optim/adamw.yaml", OptimConfig), ("parallel/default.yaml", ParallelConfig), ("zero/default.yaml", ZeroSection),
    ("data/stdlib.yaml", StdlibDataConfig), ("data/bin.yaml", BinDataConfig),
])
def test_yaml_files_list_only_what_differs(path, schema):
    listed = {k: v for k, v in yaml.safe_load((CONF / path).read_text()).items() if k != "defaults"}
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    assert not {k for k, v in listed.items() if defaults.get(k) == v}, f"{path} repeats its schema's defaults"
    assert set(listed) <= set(defaults)


@pytest.mark.parametrize("overrides, message", [
    # every feed-forward of moe_tiny is MoE, which a tiled MLP leaves whole: nothing would be tiled
    (["model=moe_tiny", "train.tiled_mlp=2"], "train.tiled_mlp=2: the model (model.moe.num_experts=8, every=1, "
     "first_dense=0) has no dense MLP to tile (its MoE layers are not tiled: their router statistics are per "
     "sequence); set train.tiled_mlp=0"),
    (["train.offload_activations=true"], "train.offload_activations=true offloads the layer inputs that activation "
     "checkpointing saves, and train.activation_checkpointing=false saves none: set "
     "train.activation_checkpointing=true, or train.offload_activations=false"),
])
def test_settings_that_would_do_nothing_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        check_config(_compose(f"run_dir={tmp_path}", *overrides))
    assert str(info.value) == message


@pytest.mark.parametrize("overrides", [
    ["model=moe_tiny", "model.moe.first_dense=1", "train.tiled_mlp=2"],  # layer 0's dense MLP is tiled
    ["train.offload_activations=true", "train.activation_checkpointing=true"],
])
def test_the_same_settings_where_they_work_are_accepted(tmp_path, overrides):
    check_config(_compose(f"run_dir={tmp_path}", *overrides))
