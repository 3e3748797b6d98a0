"""The measured side of a plan: run the recipe for a few steps on this process's rank (torch.distributed already
initialised, e.g. by tests/multirank.py) and report what the planner predicts, as the runtime counted it."""

from __future__ import annotations

import os
import tempfile
import time

import torch


def _count_a2a_rows(counter: dict) -> None:
    """Count the token rows the expert all-to-alls send (the routing histogram's part of the bytes)."""
    from moe import dispatch
    from zero.dist.comm import group_rank

    original = dispatch.AllToAllDispatcher.dispatch

    def counted(self, x, plan, weights):
        out, state = original(self, x, plan, weights)
        me = group_rank(self.group)
        sent = sum(state.input_splits) - state.input_splits[me]
        received = sum(state.output_splits) - state.output_splits[me]
        # dispatch and combine forward; their backward sends as many rows the other way (not in a recompute)
        counter["rows"] += (sent + received) * (1 if torch._C._current_graph_task_id() != -1 else 2)
        return out, state

    dispatch.AllToAllDispatcher.dispatch = counted


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure(overrides: list[str], steps: int = 3) -> dict:
    """Train `steps` steps of the recipe with `overrides` on this rank; the last step's comm bytes per kind (the
    engine's count), its expert all-to-all rows, the step times, the engine's memory and the peak RSS."""
    from hydra import compose, initialize_config_dir

    from recipes.config import CONFIG_DIR
    from recipes.pretrain import Run
    from zero.dist.topology import peak_rss_bytes

    base = peak_rss_bytes()
    counter = {"rows": 0}
    _count_a2a_rows(counter)
    run_dir = tempfile.mkdtemp(prefix="plan-measure-") if int(os.environ.get("RANK", "0")) == 0 else "unused"
    fixed = [f"run_dir={run_dir}", f"train.steps={steps}", "train.eval_batches=0", "train.sample_tokens=0",
             "wandb.mode=disabled", "train.progress=false", "train.ckpt_every=1000000"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("config", overrides=fixed + list(overrides))
    run = Run(cfg)
    # The runtime's baseline: what is resident once everything is built, less the engine's own state (imports,
    # the corpus, module objects); training's peak above it is what the planner's categories predict.
    built = _rss_bytes() - sum(run.engine.memory_breakdown().values())
    times, rows = [], []
    from recipes.pretrain import train_step

    for step in range(steps):
        counter["rows"] = 0
        t0 = time.perf_counter()
        train_step(run.engine, run.train_stream, step, cfg, run.dims, run.pipe)
        times.append(time.perf_counter() - t0)
        rows.append(counter["rows"])
    out = {"comm": dict(run.engine._last_step_comm), "a2a_rows": rows[-1], "step_times": times,
           "memory": run.engine.memory_breakdown(), "peak_rss": peak_rss_bytes(), "base_rss": base,
           "runtime_baseline": built,
           "params": sum(p.numel() for p in run.engine.module.parameters())}
    run.logger.finish()
    run.engine.close()
    return out
