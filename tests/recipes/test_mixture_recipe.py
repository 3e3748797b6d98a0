"""`data=mixture` through the recipe: three sources (a prepared directory, one in Megatron's layout, a bare Megatron
prefix), tokens per source and the evaluations in metrics.jsonl, and a resume under another layout that continues
the same samples (in the default suite at another split of the global batch; dp 2 -> 1, 1 -> 4 and another sp under
torchrun in the slow set)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes.config import ConfigError
from recipes.data import DataError
from recipes.pretrain import train
from tests.data.corpora import bpe, prepare, topics
from tests.recipes.test_pretrain import _run_cli

REPO = Path(__file__).resolve().parents[2]
BASE = ["model=tiny", "model.vocab_size=400", "train.seq_len=64", "train.sample_tokens=0", "train.progress=false",
        "optim.warmup_steps=1", "train.eval_batches=1", "train.eval_every=2", "wandb.mode=disabled", "data=mixture"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("recipe_mixture")
    texts = topics()
    tokenizer = bpe(root / "tok.json", texts[:400])
    web = prepare(root, "web", texts[0:600:3], tokenizer)
    code = prepare(root, "code", texts[1:600:3], tokenizer, fmt="megatron-indexed")
    math = prepare(root, "math", texts[2:600:3], tokenizer, fmt="megatron-indexed")
    return (f"data.sources=[{{path: {web}, weight: 0.5}}, {{path: {code}, weight: 0.3}}, "
            f"{{path: {math}/train_text_document, val_path: {math}/val_text_document, weight: 0.2, name: math}}]")


def _cfg(run_dir, *overrides):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=[*BASE, f"run_dir={run_dir}", *overrides])


def _records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, Path(run_dir, "metrics.jsonl").read_text().splitlines())}


def test_mixture_trains_evaluates_and_resumes_under_another_layout(tmp_path, sources):
    evals = ["eval.retrieval.enabled=true", "eval.retrieval.prompts=1", "eval.retrieval.depths=[0.5]",
             "eval.hooks=[tests.recipes.test_evals:sample_hook]"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(_cfg(full, sources, "train.steps=4", "train.micro_batch_size=4", *evals))
    train(_cfg(cut, sources, "train.steps=4", "train.micro_batch_size=4", "train.ckpt_every=2", *evals))
    shutil.rmtree(cut / "checkpoints" / "step_0000004")  # as if it had stopped after step 2
    (cut / "checkpoints" / "latest").write_text("step_0000002")
    # resumed with the global batch split another way (2 micro-batches of 2): the same rows from step 3 on
    train(_cfg(cut, sources, "train.steps=4", "train.micro_batch_size=2", "train.grad_accum=2",
               "train.ckpt_every=2", *evals))
    want, got = _records(full), _records(cut)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5)
        for name in ("web", "code", "math"):
            assert got[step][f"tokens/{name}"] == want[step][f"tokens/{name}"]
    rows = {k: v for k, v in want[4].items() if k.startswith("tokens/")}
    assert sum(rows.values()) == 4 * 4 * 64 and rows["tokens/web"] > rows["tokens/code"] > rows["tokens/math"] > 0
    for step in (2, 4):
        record = want[step]
        assert {"val_loss", "val_loss/web", "val_loss/code", "val_loss/math", "eval/retrieval_accuracy",
                "eval/retrieval_logprob", "eval/retrieval_control_logprob", "eval/answer"} <= set(record)
        assert record["eval/step_seen"] == step and record["eval/retrieval/len64_depth0.5_logprob"] < 0


def test_bad_mixtures_are_refused_before_training(tmp_path, sources):
    run_dir = tmp_path / "r"
    with pytest.raises(ConfigError, match=r"^data.sources\[1\].weight=-2.0 \(nowhere/x\) must be a number > 0 "
                                          r"\(weights are relative: 0.7 and 0.3, or 7 and 3\)$"):
        train(_cfg(run_dir, "train.steps=2", "data.sources=[{path: a/web, weight: 1}, {path: nowhere/x, weight: -2}]"))
    assert not run_dir.exists()  # refused before the run directory, any process group or model
    with pytest.raises(DataError, match=r"^data.sources\[0\].path=.*: .*val.bin has \d+ bytes where meta.json") as e:
        web = sources.split("path: ")[1].split(",")[0]
        damaged = tmp_path / "web"
        shutil.copytree(web, damaged)
        (damaged / "val.bin").write_bytes(b"\0")
        train(_cfg(run_dir, "train.steps=2", f"data.sources=[{{path: {damaged}}}]"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [(("2", []), ("1", ["train.micro_batch_size=8"])),
                                        (("1", ["train.micro_batch_size=8"]), ("4", ["train.micro_batch_size=2"])),
                                        (("2", []), ("2", ["parallel.sp=2", "train.micro_batch_size=8"]))])
def test_torchrun_resume_at_another_dp_or_sp_continues_the_same_samples(tmp_path, sources, first, then):
    """dp 2 -> 1, dp 1 -> 4, and dp 2 -> sp 2 (dp 1): the global batch of 8 rows split another way. The run first
    trains 4 steps uninterrupted (the reference), then resumes from its step-2 checkpoint in the other layout: step
    3's loss is the step-2 model on step 3's rows, so it agrees to the reduction's rounding only if the rows are the
    same; step 4 and the evaluations follow within Adam's amplification of that rounding."""
    # (packing by concatenation: with document packing some labels are ignored, and the logged loss, a mean of the
    # ranks' means, then depends on how rows are dealt to ranks by a few 1e-6)
    common = [*BASE, sources, "train.steps=4", "zero.stage=1", "train.eval_every=4", "eval.retrieval.enabled=true",
              "eval.retrieval.prompts=1", "data.packing=concat"]
    run = tmp_path / "run"
    nproc, extra = first
    done = _run_cli(*common, f"run_dir={run}", "train.ckpt_every=2", *(extra or ["train.micro_batch_size=4"]),
                    nproc=int(nproc))
    assert done.returncode == 0, done.stderr[-3000:]
    want = _records(run)
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    (run / "checkpoints" / "latest").write_text("step_0000002")
    nproc, extra = then
    done = _run_cli(*common, f"run_dir={run}", *extra, nproc=int(nproc))
    assert done.returncode == 0, done.stderr[-3000:]
    got = _records(run)
    assert got[3]["loss"] == pytest.approx(want[3]["loss"], rel=1e-6)
    assert got[4]["loss"] == pytest.approx(want[4]["loss"], rel=1e-4)
    for step in (3, 4):
        assert {k: v for k, v in got[step].items() if k.startswith("tokens/")} == \
            {k: v for k, v in want[step].items() if k.startswith("tokens/")}
    # the evaluations of the resumed layout (retrieval under Ulysses at sp=2) score what the first layout scores
    for key in ("val_loss/web", "val_loss/math", "eval/retrieval_logprob", "eval/retrieval_control_logprob"):
        assert got[4][key] == pytest.approx(want[4][key], rel=1e-4), key
