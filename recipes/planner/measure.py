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

    def counted(self, x, assignment, weights):
        out, state = original(self, x, assignment, weights)
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


# Blocks at least this large are mapped on their own and unmapped when freed (glibc's M_MMAP_THRESHOLD, pinned:
# left alone, glibc raises it to the size of each large block it frees and serves the next ones from heaps that
# keep freed pages, so resident memory would be the sum of what different moments of the step needed). With it
# pinned, the process's high-water mark follows the live tensors, as a GPU allocator's peak does.
MMAP_THRESHOLD = 1 << 16


def _follow_live_tensors() -> bool:
    """Pin glibc's mmap and trim thresholds (False where the C library is not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD)) and bool(libc.mallopt(-1, MMAP_THRESHOLD))  # -1: M_TRIM
    except (OSError, AttributeError):
        return False


def _reset_peak() -> bool:
    """Restart this process's high-water mark (VmHWM) at its current resident memory (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(overrides: list[str], steps: int = 3) -> dict:
    """Train `steps` steps of the recipe with `overrides` on this rank; the last step's comm bytes per kind (the
    engine's count), its expert all-to-all rows, the step times, the engine's memory and the peak RSS of the
    training steps (the high-water mark restarted once the run is built; glibc's thresholds pinned first)."""
    from hydra import compose, initialize_config_dir

    from recipes.config import CONFIG_DIR
    from recipes.pretrain import Run
    from zero.dist.topology import peak_rss_bytes

    _follow_live_tensors()
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
    # The high-water mark restarts here, so building (a full-size model before it is flattened and sharded) does
    # not count: the peak is training's.
    from zero.dist.topology import release_free_host_memory

    release_free_host_memory()
    state = run.engine.memory_breakdown()
    if cfg.zero.offload_optimizer == "nvme":
        state.pop("optimizer_state")  # (nvme offload's chunk buffers: allocated, not yet resident)
    built = _rss_bytes() - sum(state.values())
    reset = _reset_peak()
    times, rows = [], []
    from recipes.pretrain import train_step

    for step in range(steps):
        counter["rows"] = 0
        t0 = time.perf_counter()
        train_step(run.engine, run.train_stream, step, cfg, run.dims, run.pipe)
        times.append(time.perf_counter() - t0)
        rows.append(counter["rows"])
    # what the run keeps resident beyond its state once its steps are done (no activation alive): allocator heaps
    # of small blocks, buffers of the libraries, Python objects; part of every later peak
    state = run.engine.memory_breakdown()
    if cfg.zero.offload_optimizer == "nvme":
        state.pop("optimizer_state")
    retained = _rss_bytes() - built - sum(state.values())
    out = {"comm": dict(run.engine._last_step_comm), "retained": retained, "a2a_rows": rows[-1], "step_times": times,
           "memory": run.engine.memory_breakdown(), "peak_rss": peak_rss_bytes(), "base_rss": base,
           "runtime_baseline": built, "peak_reset": reset, "mmap_threshold": MMAP_THRESHOLD,
           "params": sum(p.numel() for p in run.engine.module.parameters())}
    run.logger.finish()
    run.engine.close()
    return out
