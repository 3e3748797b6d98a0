"""`python -m recipes.pretrain model=hf`: short runs of tiny Hugging Face configs, the runtime's switches, resuming
under another layout, train.init_from a save_pretrained directory, export back to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from moe_lst.models.hf import build, load_config
from transformers import AutoModelForCausalLM

from recipes.config import ConfigError
from recipes.export import consolidate, export
from recipes.pretrain import Run, evaluate, train
from tests.hf.tiny import MAIN, MOE, NEEDS_MOE, plain_model, write_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["model=hf", "train.seq_len=32", "train.micro_batch_size=4", "train.eval_batches=2", "train.eval_every=0",
        "train.sample_tokens=0", "train.progress=false", "optim.warmup_steps=2", "data.max_bytes=1000000",
        "wandb.mode=disabled"]


def _cfg(run_dir: Path, *overrides: str):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=[*TINY, f"run_dir={run_dir}", *overrides])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", MAIN)
def test_run_exports_to_the_same_logits(tmp_path, kind):
    config_dir = write_config(tmp_path / "config", kind)
    run_dir = tmp_path / "run"
    train(_cfg(run_dir, f"model.hf.config={config_dir}", "train.steps=3"))
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3]
    experts = "fused" if kind == "qwen3_moe" else "per_expert"
    out = export(run_dir, tmp_path / "export", experts)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == kind and "moe_lst" not in json.dumps(written)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # the trained weights, as the run's model computes with them
    trained = build(load_config(run_dir / "hf_config.json"))
    shapes = {n: p.shape for n, p in trained.named_parameters()}
    state = {n: t.reshape(shapes[n]) for n, t in consolidate(run_dir / "checkpoints" / "step_0000003").items()
             if n in shapes}
    assert state.keys() == shapes.keys()
    trained.load_state_dict(state, strict=False)
    assert not torch.equal(trained.state_dict()["model.norm.weight"], torch.ones(32)), "it trained"
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, trained.eval()(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", pytest.param("qwen3_moe", marks=NEEDS_MOE)])
def test_zero3_offloaded_tiled_checkpointed_run_and_a_resharded_resume_equal_the_plain_run(tmp_path, kind):
    config_dir = write_config(tmp_path / "config", kind)
    common = [f"model.hf.config={config_dir}", "train.steps=4"]
    plain, switched, resumed = tmp_path / "plain", tmp_path / "switched", tmp_path / "resumed"
    train(_cfg(plain, *common, "train.ckpt_every=2"))
    # ZeRO-3 (a dense model built on the meta device) with parameters and optimizer offloaded to host memory,
    # tiled MLP, tiled loss over the model's head, activation checkpointing
    train(_cfg(switched, *common, "zero.stage=3", "zero.offload_params=cpu", "zero.offload_optimizer=cpu",
               "train.tiled_mlp=3", "train.tiled_loss=true", "train.activation_checkpointing=true"))
    want = _records(plain)
    for key in ("loss", "grad_norm"):
        _close([r[key] for r in _records(switched)], [r[key] for r in want])
    # the plain run's step-2 checkpoint resumed at ZeRO-3 (resharded) continues it
    train(_cfg(resumed, *common, "zero.stage=3", f"train.resume={plain / 'checkpoints' / 'step_0000002'}"))
    got = _records(resumed)
    assert [r["step"] for r in got] == [3, 4]
    _close([r["loss"] for r in got], [r["loss"] for r in want[2:]])
    _close([got[-1]["val_loss"]], [want[-1]["val_loss"]])


@pytest.mark.parametrize("kind,stage", [("qwen3", 3), ("llama", 0),
                                        *(pytest.param(k, 0, marks=NEEDS_MOE) for k in MOE)])
def test_init_from_a_save_pretrained_directory_starts_at_the_models_loss(tmp_path, kind, stage):
    model = plain_model(kind, seed=4).eval()
    model.save_pretrained(tmp_path / "pretrained")
    cfg = _cfg(tmp_path / "run", f"train.init_from={tmp_path / 'pretrained'}", f"zero.stage={stage}")
    run = Run(cfg)  # model.hf.config unset: the directory's own config
    try:
        first = evaluate(run.engine, run.val_stream, cfg, run.dims)
        losses = []
        with torch.no_grad():
            for i in range(cfg.train.eval_batches):
                x, y = run.val_stream.batch(i, 0, 0)
                losses.append(F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item())
    finally:
        run.logger.finish()
    assert first == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert abs(first - 5.545) > 0.01  # (the pretrained weights, not a fresh init near log 256)


def test_init_from_another_model_is_refused(tmp_path):
    plain_model("llama").save_pretrained(tmp_path / "pretrained")
    config_dir = write_config(tmp_path / "config", "llama", hidden_size=64)
    cfg = _cfg(tmp_path / "run", f"model.hf.config={config_dir}", f"train.init_from={tmp_path / 'pretrained'}")
    with pytest.raises(ConfigError, match=r"holds another model: hidden_size=64 here but 32 there"):
        Run(cfg)
