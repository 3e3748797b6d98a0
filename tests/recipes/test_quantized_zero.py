"""zero.quantize_weights / quantize_gradients / hpz_partition_size in the recipe: refused where they cannot work,
and a 2-rank stage-3 run with int8 weights and int4 gradients sends at least 3x fewer bytes per step than plain
stage 3, stays close to its losses, and resumes bitwise."""

import shutil

import pytest

from recipes.config import ConfigError, check_config
from tests.recipes.test_optimizers import ONEBIT, _cfg
from tests.recipes.test_pretrain import TINY, _losses, _run_cli

QUANTIZED = ["zero.stage=3", "zero.quantize_weights=int8", "zero.quantize_gradients=int4", "zero.quantize_block=64"]


@pytest.mark.parametrize("overrides, message", [
    (["zero.stage=2", "zero.quantize_weights=int8"], "zero.quantize_weights=int8 needs zero.stage=3"),
    (["zero.stage=0", "zero.quantize_gradients=int4"], "zero.quantize_gradients=int4 needs zero.stage >= 1"),
    ([*ONEBIT, "zero.stage=1", "zero.quantize_gradients=int8"],
     "1-bit Adam with zero.quantize_gradients=int8 is not supported"),
    (["zero.stage=3", "zero.hpz_partition_size=2"],
     "zero.hpz_partition_size=2 does not divide the 1 process(es): set it to the devices per node"),
])
def test_refused_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(_cfg(tmp_path, *overrides))


@pytest.mark.slow  # three 2-rank launches (suite time); the engine-level equivalence tests run by default
def test_torchrun_quantized_stage3_bytes_losses_and_resume(tmp_path):
    common = [*TINY, "train.steps=4", "train.eval_every=0", "parallel.dp=2", "train.micro_batch_size=2"]
    plain = _run_cli(*common, "zero.stage=3", f"run_dir={tmp_path / 'plain'}", nproc=2)
    full = _run_cli(*common, *QUANTIZED, "train.ckpt_every=2", f"run_dir={tmp_path / 'full'}", nproc=2)
    for proc in (plain, full):
        assert proc.returncode == 0, proc.stderr[-3000:]
    # a crash after step 2: a copy of the run with its step-2 checkpoint as the latest, resumed to the end
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "checkpoints" / "step_0000004")
    (cut / "checkpoints" / "latest").write_text("step_0000002")
    again = _run_cli(*common, *QUANTIZED, "train.ckpt_every=2", f"run_dir={cut}", nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 2" in again.stdout, again.stdout[-2000:]
    assert _losses(cut) == _losses(tmp_path / "full")  # exactly (steps 3-4 rewritten by the resumed run)
    sent_plain, sent = _losses(tmp_path / "plain", "comm_bytes"), _losses(tmp_path / "full", "comm_bytes")
    assert all(sent_plain[k] / sent[k] >= 3 for k in sent), (sent_plain, sent)
    plain_losses, losses = _losses(tmp_path / "plain"), _losses(tmp_path / "full")
    assert losses[1] == pytest.approx(plain_losses[1], rel=1e-3)  # the first step's weights: int8 of the same init
    assert all(losses[k] != plain_losses[k] for k in losses)  # but quantized: not the plain run
