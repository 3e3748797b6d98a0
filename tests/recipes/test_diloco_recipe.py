"""DiLoCo through the recipe: two replicas that are themselves data-parallel (dp=2, ZeRO-2) train under torchrun as
tests/zero/test_diloco.py's reference does: the replicas simulated in one process, here with the recipe's own model,
data, AdamW, learning-rate schedule and gradient clipping (at each replica's own gradient norm)."""

import copy
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

import zero
from recipes.config import vocab_size
from recipes.data import BatchSpec, build_streams
from recipes.losses import lm_loss
from recipes.pretrain import ScheduleLR, build_model
from tests.recipes.test_pretrain import REPO, TINY, _losses, _run_cli
from tests.zero.test_diloco import outer_step

# 2 replicas x dp=2 on 4 processes, a sync after steps 2 and 4; validation after the sync at 4 (every replica holds
# the same model) and at the last step 5 (each replica its own model, evaluated on its own shards).
REPLICAS_OF_DP2 = [*TINY, "parallel.replicas=2", "parallel.dp=2", "zero.stage=2", "train.micro_batch_size=2",
                   "optim.diloco.inner_steps=2", "train.steps=5", "train.eval_every=4"]


def _cfg(*overrides):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=[*overrides, "wandb.mode=disabled"])


def simulate_replicas(cfg) -> dict:
    """The run `cfg` describes, its replicas simulated in one process: replica r trains on the rows of its data ranks
    r * dp .. r * dp + dp - 1 (each rank's mean loss, averaged over the replica's ranks, as the recipe reduces
    them). Returns replica 0's loss and pre-clip gradient norm per step (what rank 0 logs) and the validation loss
    (the mean over every data rank's shards, each replica's model on its own) at the recipe's evaluation steps."""
    t, o, d, par = cfg.train, cfg.optim, cfg.optim.diloco, cfg.parallel
    assert t.grad_accum == 1 and par.tp == par.pp == par.sp == 1 and d.warmup_steps == 0
    one = zero.ParallelDims()
    torch.manual_seed(t.seed)  # in the recipe's order: seed, data, model
    train_stream, val_stream = build_streams(cfg.data, BatchSpec(t.micro_batch_size, 1, par.dp * par.replicas,
                                                                 t.seq_len), t.seed, vocab_size(cfg))
    first, _ = build_model(cfg, one)
    models = [first] + [copy.deepcopy(first) for _ in range(par.replicas - 1)]
    hyper = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    opts = [zero.FastAdamW(**hyper)(m.parameters()) for m in models]
    schedules = [ScheduleLR(opt, cfg) for opt in opts]
    anchor = [p.detach().clone() for p in first.parameters()]
    momentum = [torch.zeros_like(a) for a in anchor]
    out = {"loss": {}, "grad_norm": {}, "val_loss": {}}

    def shards(r: int):
        return range(r * par.dp, (r + 1) * par.dp)

    for step in range(t.steps):
        for r, (model, opt, schedule) in enumerate(zip(models, opts, schedules)):
            losses = [lm_loss(model, *train_stream.batch(step, 0, k), cfg, one) for k in shards(r)]
            (sum(losses) / par.dp).backward()
            params = [p for p in model.parameters() if p.grad is not None]
            norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
            if o.grad_clip:
                torch._foreach_mul_([p.grad for p in params], min(1.0, o.grad_clip / (norm + 1e-6)))
            opt.step()
            opt.zero_grad()
            schedule.step()
            if r == 0:
                out["loss"][step + 1] = sum(x.item() for x in losses) / par.dp
                out["grad_norm"][step + 1] = norm
        if (step + 1) % d.inner_steps == 0:
            outer_step(models, anchor, momentum, d.outer_lr, d.outer_momentum)
        done = step + 1
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            with torch.no_grad():
                out["val_loss"][done] = sum(
                    lm_loss(model, *val_stream.batch(i, 0, k), cfg, one).item()
                    for r, model in enumerate(models) for k in shards(r) for i in range(t.eval_batches)
                ) / (par.replicas * par.dp * t.eval_batches)
    return out


def test_torchrun_replicas_of_dp2_zero2_equal_simulated_replicas(tmp_path):
    """The README's layout shrunk (there 4 replicas of dp=2 on 8 processes): every step's loss and gradient norm
    of replica 0, and the validation loss right after a sync and at the end, equal the one-process simulation."""
    proc = _run_cli(*REPLICAS_OF_DP2, f"run_dir={tmp_path}", nproc=4, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = simulate_replicas(_cfg(*REPLICAS_OF_DP2, f"run_dir={tmp_path / 'unused'}"))
    for key in ("loss", "grad_norm", "val_loss"):
        got = _losses(tmp_path, key)
        assert sorted(got) == sorted(want[key]) == ([4, 5] if key == "val_loss" else [1, 2, 3, 4, 5]), key
        for step, value in want[key].items():
            assert got[step] == pytest.approx(value, rel=1e-5, abs=0), (key, step, got, want[key])
    # the syncs happened where the simulation has them: only steps 2 and 4 send deltas across replicas
    sent = _losses(tmp_path, "comm_bytes")
    assert sent[2] == sent[4] > sent[1] == sent[3] == sent[5] > 0, sent
