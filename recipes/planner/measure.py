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
             "wandb.mode=disabled", "train.progress=false", "train.ckpt_every=1000000",
             f"zero.host_mmap_threshold={MMAP_THRESHOLD}"]  # (the engine pins it at stage 3 on the host: ours kept)
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


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


# Libraries a run imports on first use, somewhere in its build or its first step (torch's compiler stack, about
# 76 MiB with sympy; the pipelining package): imported before measure_host's baseline, so that their memory counts
# in the process's own (the cluster's host_process_mb), not in the phase that happens to import them first.
WARM_IMPORTS = ("torch._dynamo", "torch.distributed.pipelining")


def _host_run_config(overrides: list[str]):
    """The run `measure_host` measures: `overrides` for two steps, no evaluation, sample, W&B or checkpoint."""
    from hydra import compose, initialize_config_dir

    from recipes.config import CONFIG_DIR

    run_dir = tempfile.mkdtemp(prefix="plan-host-") if int(os.environ.get("RANK", "0")) == 0 else "unused"
    fixed = [f"run_dir={run_dir}", "train.steps=2", "train.eval_batches=0", "train.sample_tokens=0",
             "wandb.mode=disabled", "train.progress=false", "train.ckpt_every=1000000",
             f"zero.host_mmap_threshold={MMAP_THRESHOLD}"]  # (the engine pins it at stage 3 on the host: ours kept)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("config", overrides=fixed + list(overrides))


def nvme_file_bytes(engine) -> int:
    """The sizes of this rank's offload files as written: its stage-3 parameter shards' and its nvme optimizer
    state's (what the planner's nvme_bytes predicts)."""
    masters = engine.zero_optimizer.masters
    files = [b.file for b in engine.buckets if b.file is not None] + (masters.files if masters.kind == "nvme" else [])
    return sum(f.size_bytes() for f in files)


def measure_host(overrides: list[str]) -> dict:
    """The host-memory side of a plan on this rank: the recipe's `Run` built (with its `train.init_from`, if any)
    and two training steps taken, with the process's high-water mark (VmHWM) read at the end of each phase and
    restarted at its start. Phases: "build" (the model on the meta device, the engine's buffers and their values),
    "load" (train.init_from streamed into the engine, and the rest of the run's setup), "step" (the first two
    training steps: the second is the steady state, the optimizer state alive from its start). Each figure is
    the phase's peak less `baseline`: what was resident just before the build (the interpreter, torch, the
    project, the corpus, the process groups, `WARM_IMPORTS`), after glibc's free memory went back to the system.
    glibc's mmap and trim thresholds are pinned first (as `measure` does), so resident memory follows the live
    tensors. `nvme_bytes`: the rank's offload files once the steps are done (`nvme_file_bytes`)."""
    import gc
    import importlib

    import recipes.pretrain as pretrain
    from zero.dist.topology import release_free_host_memory

    pinned = _follow_live_tensors()
    for name in WARM_IMPORTS:  # (their memory is the process's, whichever phase first imports them)
        importlib.import_module(name)
    marks: dict[str, int] = {}

    def start() -> None:
        gc.collect()
        release_free_host_memory()
        marks["baseline"] = _rss_bytes()
        marks["peak_reset"] = _reset_peak()

    def end(phase: str) -> None:
        marks[phase] = _status_bytes("VmHWM") - marks["baseline"]
        _reset_peak()

    original_weights, original_engine = pretrain.initial_weights, pretrain.build_engine

    def initial_weights(*args, **kwargs):  # (the Run calls it right before it builds the model)
        start()
        return original_weights(*args, **kwargs)

    def build_engine(*args, **kwargs):
        engine = original_engine(*args, **kwargs)
        end("build")
        return engine

    cfg = _host_run_config(overrides)
    pretrain.initial_weights, pretrain.build_engine = initial_weights, build_engine
    try:
        run = pretrain.Run(cfg)
    finally:
        pretrain.initial_weights, pretrain.build_engine = original_weights, original_engine
    end("load")
    for step in range(2):  # (the second step holds the optimizer state from its start: the steady state)
        pretrain.train_step(run.engine, run.train_stream, step, cfg, run.dims, run.pipe)
    end("step")
    out = {"phases": {k: marks[k] for k in ("build", "load", "step")}, "baseline": marks["baseline"],
           "peak_reset": marks["peak_reset"], "pinned": pinned, "memory": run.engine.memory_breakdown(),
           "nvme_bytes": nvme_file_bytes(run.engine)}
    run.logger.finish()
    run.engine.close()
    return out
