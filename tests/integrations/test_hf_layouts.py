"""A Hugging Face model through the integrations' loops at the adapter's layouts (moe_lst.integrations.hf_parallel):
the Accelerate example with tensor parallelism (a dense model, tp=2) and expert parallelism (an MoE model, dp=2 x
ep=2) equals one process of `python -m recipes.pretrain model=hf` with the same config and setting (per-step losses
and gradient norms, final weights); ZeroTrainer at tp=2 equals the engine's own loop over the plain model. Under
pipeline stages (pp=2, 1F1B over the step's micro-batches) the example equals one process of the recipe for a dense
and an MoE model; what the adapter does not map is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zero
from tests.equivalence import RTOL
from tests.integrations.common import MAX_BYTES, RECIPE_ARGS, REPO, torchrun

pytest.importorskip("accelerate")

STEPS = 3


def _config(directory: Path, kind: str) -> Path:
    from moe_lst.models.hf.coverage import tiny_config

    tiny_config(kind, max_position_embeddings=128).save_pretrained(directory)
    return directory


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _recipe_one_process(run_dir: Path, config: Path, grad_accum: int) -> Path:
    from tests.recipes.cli import train_on_ranks

    args = [a for a in RECIPE_ARGS if not a.startswith("train.grad_accum=")]
    train_on_ranks(1, ["model=hf", f"model.hf.config={config}", f"train.steps={STEPS}", f"run_dir={run_dir}",
                       "train.progress=false", f"train.grad_accum={grad_accum}", *args])
    return run_dir


def _assert_same(got: list[dict], want: list[dict], got_final: dict, want_final: dict, label: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1)), label
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=RTOL, abs=0), (label, a["step"], key)
    assert sorted(got_final) == sorted(want_final), label
    for name, value in want_final.items():
        torch.testing.assert_close(got_final[name].reshape(value.shape), value, rtol=RTOL, atol=1e-6,
                                   msg=lambda m, n=name: f"{label} {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,accum,nproc", [
    ("llama", ["--tp", "2"], 2, 2), ("qwen3_moe", ["--ep", "2"], 4, 2),
    ("llama", ["--pp", "2"], 2, 2), ("qwen3_moe", ["--pp", "2"], 2, 2),
    # 4 processes: pipeline stages over 2 data-parallel ranks, the MoE's experts over those 2 ranks of each stage;
    # stages of 2 tensor-parallel ranks each
    ("llama", ["--pp", "2"], 4, 4), ("qwen3_moe", ["--pp", "2", "--ep", "2"], 4, 4),
    ("llama", ["--pp", "2", "--tp", "2"], 2, 4)],
    ids=["tp2", "dp2_ep2", "pp2", "pp2_moe", "pp2_dp2", "pp2_dp2_ep2_moe", "pp2_tp2"])
def test_accelerate_example_at_the_adapters_layouts_equals_the_recipe(tmp_path, kind, layout, accum, nproc):
    config = _config(tmp_path / "config", kind)
    torchrun(["-m", "moe_lst.integrations.accelerate_example", "--stage", "1", "--steps", str(STEPS),
              "--max-bytes", str(MAX_BYTES), "--hf-config", str(config), *layout, "--ckpt-dir", str(tmp_path / "acc"),
              "--metrics", str(tmp_path / "acc.jsonl")], nproc=nproc)
    # one process reads the global batch of both data-parallel ranks (dp2_*) as twice the micro-batches
    recipe = _recipe_one_process(tmp_path / "recipe", config, accum)
    final = zero.consolidate(zero.open_checkpoint(str(tmp_path / "acc" / f"step_{STEPS}")))
    want = zero.consolidate(zero.open_checkpoint(str(recipe / "checkpoints" / f"step_{STEPS:07d}")))
    _assert_same(_metrics(tmp_path / "acc.jsonl"), _metrics(recipe / "metrics.jsonl"), final, want, kind)


@pytest.mark.slow
def test_trainer_at_tp2_equals_the_engines_own_loop(tmp_path):
    torchrun([str(REPO / "tests/integrations/hf_run.py"), str(tmp_path), "1", "none", "tp"])
    runs = json.loads((tmp_path / "losses.json").read_text())
    for key in ("loss", "grad_norm"):
        assert runs["tp2"][key] == pytest.approx(runs["own"][key], rel=1e-5, abs=0), key
    for rank in (0, 1):
        final = torch.load(tmp_path / f"final_rank{rank}.pt")
        for name, value in final["own"].items():
            torch.testing.assert_close(final["tp2"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_unmapped_plans_experts_of_a_dense_model_and_short_pipelines_are_refused_in_one_line():
    from moe_lst.integrations.hf_parallel import check_layout
    from transformers import LlamaConfig, OlmoeConfig, StableLmConfig

    with pytest.raises(ValueError, match=r"^ep=2 needs an MoE model \(model_type llama is dense\)"):
        check_layout(LlamaConfig(), ep=2)
    with pytest.raises(NotImplementedError, match=r"^tp=2 with model_type stablelm is refused: the coverage sweep's "
                                                  r"tp2 check of model_type stablelm: refused: there is no plan"):
        check_layout(StableLmConfig(), tp=2)
    with pytest.raises(NotImplementedError, match=r"^pp=2 with model_type olmoe is refused: the coverage sweep's "
                                                  r"pp2 check of model_type olmoe: refused: there is no plan to map"):
        check_layout(OlmoeConfig(), pp=2)
    with pytest.raises(ValueError, match=r"^pp=4 stages but model_type llama has 2 layers"):
        check_layout(LlamaConfig(num_hidden_layers=2), pp=4)
    with pytest.raises(ValueError, match=r"^pp=2 with 1 micro-batches per batch: a 1F1B schedule needs at least pp"):
        check_layout(LlamaConfig(), pp=2, microbatches=1)
    check_layout(LlamaConfig(), pp=2)  # (the fewest micro-batches by default: pp)
