"""Pretraining recipe: `python -m recipes.pretrain [key=value ...]` or under `torchrun`.

Reads top to bottom: process groups, the learning-rate schedule, the model with its parallelism applied
from outside and the runtime engine, one training step, evaluation and a sample, then the Run that holds
them and its loop. The run directory (lock, identity, config diff, checkpoints, resume) is
recipes/run_dir.py, the graceful stop on a scheduler's signal recipes/preempt.py, the losses
recipes/losses.py, memory and MoE reports recipes/reports.py.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import signal
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from moe_lst.models import spec as families
from moe_lst.models.loading import StreamingWeights, init_with_placements
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import zero
from moe import update_router_biases
from moe.experts import bound_onednn_caches
from recipes.config import (
    ConfigError,
    atomic_write_text,
    check_config,
    check_run_dir,
    data_parallel_degree,
    is_moe,
    model_config,
    num_params,
    optimizer_factory,
    refuse_bad_command_line,
    vocab_size,
    zero_config,
)
from recipes.crop_check import crop_check
from recipes.data import BatchSpec, DataError, build_streams, check_data_identity, stream_metrics, stream_tokenizer
from recipes.evals import Evaluations
from recipes.losses import IGNORE_INDEX, lm_loss, mean_over_dp
from recipes.parallelize import Parallelism, parallelize
from recipes.preempt import Preempted, StopSignals, exit_code
from recipes.reports import expert_load_media, memory_metrics, moe_stats, moe_step_metrics, report_expert_load
from recipes.run_dir import (
    CheckpointWriteError,
    check_resumed_config,
    lock_run_dir,
    read_result,
    resume,
    resumes,
    run_identity,
    save_checkpoint,
    save_config,
    write_result,
)
from recipes.tracking import MetricsLogger
from sequence_parallel import (
    local_attention,
    shard_sequence,
)
from zero.dist import comm
from zero.dist.topology import default_device
from zero.optim.diloco import ReplicaDims
from zero.parallel.pipeline import Pipeline
from zero.parallel.tensor import gather_sequence

#: The backend's own collective timeout is a backstop this long after the watchdog's (zero.dist.comm).
BACKSTOP_TIMEOUT_S = 60.0


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the torchrun process group when launched with several processes. A collective that does not
    complete within `timeout_s` (a rank stopped answering) ends the ranks waiting for it: zero.dist.comm's
    watchdog (started by Run) does that; the backend's timeout, BACKSTOP_TIMEOUT_S later, is a backstop."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s + BACKSTOP_TIMEOUT_S))


class HangError(RuntimeError):
    """A collective did not complete within train.collective_timeout_s."""


class DivergenceError(RuntimeError):
    """Training produced non-finite losses or gradients for too many consecutive steps."""


def lr_at(step: int, cfg: DictConfig) -> float:
    """Linear warmup to optim.lr, then cosine decay to lr * min_lr_ratio at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class ScheduleLR(torch.optim.lr_scheduler.LRScheduler):
    """Sets every group's lr to `lr_at(optimizer step)`: the engine steps it after each optimizer step
    (a skipped fp16 step does not advance it) and saves it in its checkpoints."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: DictConfig) -> None:
        self.cfg = cfg
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [lr_at(self.last_epoch, self.cfg)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "cfg"}


def builds_on_meta(cfg: DictConfig) -> bool:
    """Whether the model is built on the meta device and materialised by the engine (the model's init_parameter
    gives the values an eager build would): at stage 3 unit by unit, under pp only this rank's stages, so no rank
    holds the whole model. Its family's spec says when (moe_lst.models.spec.FamilySpec.builds_on_meta)."""
    return families.get(cfg).builds_on_meta(cfg)


def new_model(cfg: DictConfig, meta: bool, dims: zero.ParallelDims) -> nn.Module:
    """The full model before any parallelism, built by its family's spec (the project's Llama; with model=hf a
    Hugging Face causal LM behind the model contract; a family of model.family's own)."""
    return families.get(cfg).build(cfg, dims, meta)


def build_model(cfg: DictConfig, dims: zero.ParallelDims, initial: dict[str, torch.Tensor] | None = None,
                meta: bool = False) -> tuple[nn.Module, Parallelism]:
    """The full model, identically initialised on every rank (with the `initial` weights when given), then
    parallelised from outside by recipes.parallelize (experts over ep, tensor parallel over tp, heads over sp,
    tiling, checkpointing, then this rank's pipeline stages over pp). Each keeps its slice of the values the full
    model holds, so initial weights need no slicing of their own. With `meta` (the run: builds_on_meta) it is
    built on the meta device and gets its values, or the initial weights, from the engine (see Run); without,
    it holds its values and trains as it is (a reference loop of its own)."""
    model = new_model(cfg, meta, dims)
    if initial is not None and not meta and not isinstance(initial, StreamingWeights):  # (streamed: by the engine)
        load_initial_weights(model, initial)
    parallel = parallelize(model, cfg, dims)
    # One process per device: the model lives on this rank's GPU where there is one (else the CPU); under pp
    # only this rank's stages do (apply_pipeline leaves the other stages' weights on the meta device).
    if parallel.pipe is not None:
        if not meta:
            parallel.pipe.module.to(default_device())
    elif not meta:
        model = model.to(default_device())
    return model, parallel


def build_dims(cfg: DictConfig) -> zero.ParallelDims:
    """The layout of this rank's replica (with parallel.replicas > 1, zero.optim.diloco.ReplicaDims)."""
    degrees = {k: cfg.parallel[k] for k in ("dp", "tp", "pp", "sp", "ep", "cp")}
    return ReplicaDims(replicas=cfg.parallel.replicas, **degrees) if cfg.parallel.replicas > 1 \
        else zero.ParallelDims(**degrees)


def data_rank(dims: zero.ParallelDims) -> int:
    """This rank's data shard: its dp rank, after the shards of the replicas before its own."""
    return dims.coordinate().get("replica", 0) * dims.dp + dims.dp_rank


def build_engine(cfg: DictConfig, model: nn.Module, dims: zero.ParallelDims,
                 parallel: Parallelism) -> zero.Engine:
    """The ZeRO engine over this rank's part of `model` (under pp: its stages only), told by the plans
    what parallelism applied from outside needs from it."""
    return zero.initialize(
        model if parallel.pipe is None else parallel.pipe.module,
        optimizer=optimizer_factory(cfg, dims),
        config=zero_config(cfg),
        dims=dims,
        lr_scheduler=functools.partial(ScheduleLR, cfg=cfg),
        plans=parallel.plans,  # a meta-device model is materialised by the engine through its init_parameter
        param_init=init_with_placements(model, parallel.plans),  # (a split parameter: its slice's values)
    )


def initial_weights(cfg: DictConfig, run_dir: Path, is_rank0: bool) -> dict[str, torch.Tensor] | None:
    """The full weights train.init_from names for a fresh run, read by the model family's spec (the Llama: a
    Hugging Face Llama / Mixtral directory, as recipes.export writes; with model=hf any directory of the run's
    model), refused in one line when they are another model's. None without it, and when the run resumes (its
    checkpoint holds the weights: said once)."""
    source = cfg.train.init_from
    if source is None:
        return None
    if resumes(cfg, run_dir):
        if is_rank0:
            print(f"train.init_from={source} is not used: the run resumes from its checkpoint "
                  f"(train.resume={cfg.train.resume})", flush=True)
        return None
    return families.get(cfg).init_from(cfg, source)


def load_initial_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full weights into the full (not yet parallelised) model; only buffers may be absent (a router's
    expert bias starts at zero)."""
    result = model.load_state_dict(state, strict=False)
    buffers = {name for name, _ in model.named_buffers()}
    absent = [k for k in result.missing_keys if k not in buffers] + list(result.unexpected_keys)
    if absent:
        raise ConfigError(f"train.init_from: the weights do not fit the model (missing or unexpected: "
                          f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''})")


def on_device(batch: tuple[torch.Tensor | None, ...], device) -> tuple[torch.Tensor | None, ...]:
    """A (tokens, labels, position ids or None) batch moved to `device`."""
    return tuple(None if t is None else t.to(device, non_blocking=True) for t in batch)


def stacked_micro_batches(stream, index: int, cfg: DictConfig, dims: zero.ParallelDims,
                          device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The train.grad_accum micro-batches of batch `index` stacked along the batch dimension (a pipeline
    splits them back in order), each shard of the sequence under sp, and the stages' keyword arguments: their
    position ids (and packed=True when the rows hold packed documents)."""
    parts, packed = [], False
    for micro in range(cfg.train.grad_accum):
        x, y, pos = on_device(stream.packed_batch(index, micro, data_rank(dims), IGNORE_INDEX), device)
        packed = pos is not None
        parts.append(shard_sequence(x, y, dims.sp_group, position_ids=pos, ignore_index=IGNORE_INDEX))
    x, y, pos = (torch.cat(t) for t in zip(*parts))
    return x, y, {"position_ids": pos, **({"packed": True} if packed else {})}


def train_step(engine: zero.Engine, stream, step: int, cfg: DictConfig, dims: zero.ParallelDims,
               pipe: Pipeline | None = None) -> float:
    """One optimizer step over `train.grad_accum` micro-batches (the pipeline's micro-batches under pp),
    then the MoE routers' bias update; returns the global-batch mean loss."""
    total = 0.0
    if pipe is not None:
        x, y, stage_kwargs = stacked_micro_batches(stream, step, cfg, dims, engine.device)
        total = pipe.train_step(engine, x, y, **stage_kwargs) * cfg.train.grad_accum
    else:
        for micro in range(cfg.train.grad_accum):
            x, y, pos = on_device(stream.packed_batch(step, micro, data_rank(dims), IGNORE_INDEX), engine.device)
            loss = lm_loss(engine, x, y, cfg, dims, position_ids=pos)
            engine.backward(loss)
            total += loss.item()
    engine.step()
    update_router_biases(engine.module, dims.dp_sp_group)  # (no MoE layers: nothing to update)
    return mean_over_dp(total / cfg.train.grad_accum, dims)


@torch.no_grad()
def evaluate(engine, val_stream, cfg: DictConfig, dims: zero.ParallelDims, pipe: Pipeline | None = None) -> float:
    """Mean loss over `train.eval_batches` fixed held-out global batches (from the last pipeline stage)."""
    engine.module.eval()
    total = 0.0
    for i in range(cfg.train.eval_batches):
        if pipe is not None:
            x, y, stage_kwargs = stacked_micro_batches(val_stream, i, cfg, dims, engine.device)
            total += pipe.eval_step(engine, x, y, **stage_kwargs) * cfg.train.grad_accum
            continue
        for micro in range(cfg.train.grad_accum):
            x, y, pos = on_device(val_stream.packed_batch(i, micro, data_rank(dims), IGNORE_INDEX), engine.device)
            total += lm_loss(engine, x, y, cfg, dims, position_ids=pos).item()
    engine.module.train()
    return mean_over_replicas(mean_over_dp(total / (cfg.train.eval_batches * cfg.train.grad_accum), dims), dims)


def mean_over_replicas(value: float, dims: zero.ParallelDims) -> float:
    """Average a per-replica scalar over DiLoCo's replicas (one replica: `value`). Each replica evaluates its own
    shards of the validation batches, so right after a sync (every replica holds the same model) the mean is that
    model's loss on the same global batches an ordinary data-parallel run evaluates."""
    if not isinstance(dims, ReplicaDims) or dims.replicas == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=default_device())
    comm.all_reduce(t, dims.replica_group)
    return t.item() / dims.replicas


def sample(engine, cfg: DictConfig, dims: zero.ParallelDims, tokenizer=None) -> str:
    """Generate text from the prompt: bytes, or the ids of `tokenizer` (the one that prepared data=tokenized).
    Every rank runs it in lockstep (same generator), so sharded
    experts and parameters take part; under sp the attention runs locally on the full sequence; under
    tp the context is padded at its end to a multiple of tp (causal attention leaves the earlier logits
    unchanged; a capacity-limited MoE counts the padding in its capacity) and the vocabulary slices of
    the logits are gathered."""
    model = engine.module
    text = cfg.train.sample_prompt
    ids = list(text.encode()) if tokenizer is None else tokenizer.encode_batch([text])[0]
    prompt = torch.tensor([ids], dtype=torch.long, device=engine.device)
    gen = torch.Generator(device=engine.device).manual_seed(cfg.train.seed)

    def forward(context: torch.Tensor) -> torch.Tensor:
        n = context.shape[1]
        padded = F.pad(context, (0, -n % dims.tp))
        return gather_sequence(engine(padded), dims.tp_group, dim=-1)[:, :n]

    model.eval()
    try:
        with local_attention(model):
            out = model.generate(prompt, cfg.train.sample_tokens, generator=gen, forward=forward)
    finally:
        model.train()
    if tokenizer is not None:
        return text + tokenizer.decode(out[0].tolist())
    return (text.encode() + bytes(out[0].clamp(max=255).tolist())).decode("utf-8", "replace")


def is_due(done: int, every: int, steps: int) -> bool:
    """Evaluation / checkpoint cadence: every `every` steps (0 = never) and always at the last step."""
    return (every and done % every == 0) or done == steps


def progress_postfix(loss: float, record: dict, val_loss: float | None) -> dict[str, object]:
    """What the progress bar shows after a step: loss, throughput, the last validation loss, and under
    fp16 the loss scale and the steps skipped for overflow."""
    extra = {"val": f"{val_loss:.3f}"} if val_loss is not None else {}
    if "loss_scale" in record:
        extra.update(scale=f"{record['loss_scale']:.0f}", skipped=record["skipped_steps"])
    return {"loss": f"{loss:.3f}", "tok_s": f"{record['tokens_per_s']:.0f}", **extra}


class Run:
    """What one training run holds: config, layout, data, engine and logger, and its loop."""

    def __init__(self, cfg: DictConfig, stop: StopSignals | None = None) -> None:
        check_config(cfg)
        bound_onednn_caches()  # (before the run's first GEMM: moe.experts)
        cfg.parallel.dp = data_parallel_degree(cfg)  # auto: what the processes leave after tp x pp x sp
        init_distributed(cfg.train.collective_timeout_s)
        self.cfg, t = cfg, cfg.train
        self.stop = stop if stop is not None else StopSignals()  # (none: no signal is caught)
        self.run_dir: Path | None = None  # known after the first collective
        if dist.is_initialized():  # every collective from here on is watched (zero.dist.comm's watchdog)
            comm.start_watchdog(t.collective_timeout_s, self.record_hang, setting="train.collective_timeout_s")
        self.dims = build_dims(cfg)
        self.is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
        # Every rank writes to rank 0's run_dir (its timestamp may differ by a second on other ranks).
        self.world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        self.run_dir = check_run_dir(comm.all_gather_object(str(cfg.run_dir), self.world)[0])
        self.lock = lock_run_dir(self.run_dir, self.world)
        self.stop.watch_peers(self.world)
        self.run_id = run_identity(self.run_dir, self.world)
        self.previous_result = read_result(self.run_dir)
        check_resumed_config(cfg, self.run_dir, self.dims, self.is_rank0)
        torch.manual_seed(t.seed)
        self.spec = BatchSpec(t.micro_batch_size, t.grad_accum, self.dims.dp * cfg.parallel.replicas, t.seq_len)
        self.train_stream, self.val_stream = build_streams(cfg.data, self.spec, t.seed, vocab_size(cfg), t.steps,
                                                           print if self.is_rank0 else None, bool(t.eval_batches))
        check_data_identity(self.train_stream, self.run_dir, resumes(cfg, self.run_dir), self.is_rank0)
        self.evals = Evaluations(cfg, self.dims, self.train_stream, self.val_stream, self.is_rank0)  # (eval.*)
        initial = initial_weights(cfg, self.run_dir, self.is_rank0)
        meta = builds_on_meta(cfg)
        self.model, self.parallel = build_model(cfg, self.dims, initial, meta=meta)
        self.pipe = self.parallel.pipe
        self.engine = build_engine(cfg, self.model, self.dims, self.parallel)
        if isinstance(initial, StreamingWeights):  # each rank reads only what it keeps
            initial.load_into(self.engine)
        elif initial is not None and meta:  # built without values: the engine takes them
            self.engine.load_full_state_dict(initial)
        self.start_step = resume(self.engine, self.run_dir, cfg, self.is_rank0)
        # the step of run_dir's newest complete checkpoint (train.resume may have named another directory's)
        self.saved_step = self.start_step if (self.run_dir / "checkpoints" / f"step_{self.start_step:07d}").is_dir() \
            else None
        if self.is_rank0:
            save_config(cfg, self.run_dir)
            for name, text in families.get(cfg).run_files(cfg).items():  # (e.g. the config.json export reads)
                atomic_write_text(self.run_dir / name, text)
        self.logger = MetricsLogger(self.run_dir, self.is_rank0, OmegaConf.to_container(cfg.wandb),
                                    OmegaConf.to_container(cfg, resolve=True), resume_step=self.start_step,
                                    run_id=self.run_id)
        self.expert_loads: dict[str, list[float]] = {}
        self.val_loss: float | None = None
        self.bad_steps = 0  # consecutive steps with a non-finite loss or gradient
        if self.is_rank0:
            self.stop.on_expire = self.record_late_stop
            total = num_params(cfg)
            mine = sum(p.numel() for p in self.engine.module.parameters())
            print(f"{self.dims} | model {total / 1e6:.2f}M params, {mine / 1e6:.2f}M on rank 0 | "
                  f"run_dir {self.run_dir}"
                  + (f" | resumed at step {self.start_step}" if self.start_step else ""), flush=True)

    def loop(self) -> None:
        """Train from start_step to train.steps: each step, its metrics and the divergence guard, then
        evaluation and a checkpoint when due (a progress bar on rank 0 with train.progress). Before each step
        the ranks agree whether a stop signal came (see stop_if_signalled)."""
        t = self.cfg.train
        progress = tqdm(total=t.steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (self.is_rank0 and t.progress))
        try:
            for step in range(self.start_step, t.steps):
                self.stop_if_signalled(step)
                self.stop.phase = f"in step {step + 1}"
                t0 = time.perf_counter()
                lr = self.engine.get_lr()[0]
                with self.collective_watch(step):
                    loss = train_step(self.engine, self.train_stream, step, self.cfg, self.dims, self.pipe)
                    record = self.step_record(step, loss, lr, time.perf_counter() - t0)
                    done = step + 1
                    self.guard_divergence(done, record)
                    if t.eval_batches and is_due(done, t.eval_every, t.steps):
                        self.val_loss = record["val_loss"] = evaluate(self.engine, self.val_stream, self.cfg,
                                                                      self.dims, self.pipe)
                        self.log_load_media(done)
                    if self.evals.due(done, t.steps):
                        record.update(self.evals.run(
                            done, self.engine, lambda s: evaluate(self.engine, s, self.cfg, self.dims, self.pipe),
                            self.logger, self.cfg.wandb.get("mode", "offline") != "disabled"))
                    self.logger.log(done, record)
                    if is_due(done, t.ckpt_every, t.steps):
                        self.save(done)
                progress.set_postfix(progress_postfix(loss, record, self.val_loss))
                progress.update(1)
        finally:
            progress.close()
        self.stop.phase = "finishing (the last checkpoint is saved)"

    def log_load_media(self, done: int) -> None:
        """At an evaluation of an MoE run with W&B on: the expert load so far as a heatmap and a table. Every
        rank takes part in summing the loads over the data-parallel ranks; rank 0 logs them."""
        if self.expert_loads and self.cfg.wandb.get("mode", "offline") != "disabled":
            self.logger.log_media(done, expert_load_media(self.expert_loads, self.dims, self.is_rank0))

    def attach_files(self) -> None:
        """Rank 0: the run's config.yaml, the tokenized data's meta.json and sample.txt, saved with the W&B run."""
        identity = getattr(self.train_stream, "identity", None) or {}
        paths = [self.run_dir / "config.yaml", self.run_dir / "sample.txt"]
        if "path" in identity:
            paths.append(Path(identity["path"]) / "meta.json")
        self.logger.attach(paths)

    def save(self, done: int) -> None:
        """Checkpoint step `done` (under the keep policy); the deadline of a stop names what it interrupts."""
        kept = f"step {self.saved_step}" if self.saved_step else "none"
        self.stop.phase = f"saving the checkpoint of step {done} (the newest complete one, {kept}, is intact)"
        t = self.cfg.train
        try:
            save_checkpoint(self.engine, self.run_dir, done, self.is_rank0, t.keep_checkpoints, self.run_id)
        except CheckpointWriteError as e:
            if self.is_rank0:
                self.record_write_failure(e, done)
            raise
        self.saved_step = done

    def record_write_failure(self, error: CheckpointWriteError, done: int) -> None:
        """Rank 0: result.json says the checkpoint of step `done` could not be written (and for want of space, the
        bytes it needs and those free), and which intact checkpoint the same command resumes from."""
        kept = self.saved_step
        try:
            write_result(self.run_dir, {
                "status": "checkpoint_failed", "step": done, "checkpoint": f"checkpoints/step_{done:07d}",
                "resume_from": f"checkpoints/step_{kept:07d}" if kept else None, "bytes_needed": error.needed,
                "bytes_free": error.free, "message": str(error), "val_loss": self.val_loss})
        except OSError as e:
            error.args = (f"{error}; {self.run_dir / 'result.json'} could not be written either "
                          f"({e.strerror or e})",)

    def stop_if_signalled(self, done: int) -> None:
        """At the boundary after step `done`: when any rank got a stop signal (one collective, every rank
        agrees), checkpoint step `done` unless its checkpoint exists, write result.json (status preempted)
        and raise Preempted with the signal's exit code (128 + its number)."""
        signum = self.stop.agreed(self.world, self.engine.device)
        if not signum:
            return
        name, code = signal.Signals(signum).name, exit_code(signum)
        if done and self.saved_step != done:
            with self.collective_watch(done - 1):
                self.save(done)
        self.stop.phase = f"exiting after the checkpoint of step {done}" if done else "exiting (nothing trained)"
        saved = f"checkpoints/step_{done:07d}" if done else None
        message = (f"stopped by {name} at step {done} of {self.cfg.train.steps}: "
                   + (f"checkpoint {saved} saved" if saved else "nothing trained yet, no checkpoint")
                   + f"; the same command resumes the run (exit code {code})")
        if self.is_rank0:
            write_result(self.run_dir, {"status": "preempted", "step": done, "signal": name, "exit_code": code,
                                        "checkpoint": saved, "message": message, "val_loss": self.val_loss})
        self.logger.finish()
        self.stop.exiting()  # from here a further signal (torchrun's, once a peer has exited) is ignored
        comm.barrier()  # no rank exits (so torchrun ends the others) before result.json is written
        raise Preempted(message, code)

    def record_late_stop(self, signame: str, why: str) -> None:
        """Rank 0, from the stop watcher's thread: result.json says the run was preempted before it could
        finish stopping (`why`), and which checkpoint it resumes from."""
        kept = self.saved_step
        write_result(self.run_dir, {
            "status": "preempted", "step": kept or 0, "signal": signame, "exit_code": exit_code(self.stop.signum),
            "checkpoint": f"checkpoints/step_{kept:07d}" if kept else None,
            "message": f"{why} while the run was {self.stop.phase}"})

    def step_record(self, step: int, loss: float, lr: float, dt: float) -> dict:
        """The metrics of one finished step (validation added by the caller)."""
        engine_metrics = self.engine.metrics()
        record = {"loss": loss, "lr": lr, "grad_norm": float(self.engine.global_grad_norm),
                  "skipped_steps": engine_metrics["skipped_steps"],
                  "tokens_per_s": self.spec.global_batch * self.cfg.train.seq_len / dt, "step_time_s": dt,
                  "comm_bytes": engine_metrics["comm_bytes_per_step"], **memory_metrics(),
                  **stream_metrics(self.train_stream, step + 1)}  # (a mixture: tokens/SOURCE so far)
        if self.cfg.zero.dtype == "fp16":
            record.update(loss_scale=engine_metrics["loss_scale"])
        if is_moe(self.cfg):  # (under pp, moe_stats gathers every stage's: not for a dense model)
            stats = moe_stats(self.engine, self.cfg, self.dims, self.pipe)
            record.update(moe_step_metrics(stats, self.expert_loads))
        return record

    @contextlib.contextmanager
    def collective_watch(self, step: int):
        """Name the step to the collective watchdog, and (its backstop) turn a collective that the backend
        timed out (gloo and NCCL raise RuntimeError naming the timeout) into a HangError naming the step,
        the rank and the setting."""
        comm.set_step(step + 1)
        try:
            yield
        except RuntimeError as e:
            text = str(e).lower()
            if self.dims.world_size == 1 or not ("timed out" in text or "timeout" in text):
                raise
            raise HangError(f"step {step + 1}: a collective did not complete within train.collective_timeout_s="
                            f"{self.cfg.train.collective_timeout_s:g} s on rank {dist.get_rank()} (another rank "
                            f"stopped answering): {str(e).splitlines()[0][:200]}") from None
        finally:
            comm.set_step(None)

    def record_hang(self, hang: comm.Hang) -> None:
        """Called by the watchdog before it ends this rank (exit 4): result.json says the run hung."""
        if self.run_dir is not None:
            write_result(self.run_dir, {"status": "hung", "step": hang.step, "rank": hang.rank, "message": str(hang)})

    def guard_divergence(self, done: int, record: dict) -> None:
        """Count consecutive bad steps (non-finite loss, or a gradient the engine refused; under fp16 only
        once the loss scale is at its minimum); past train.max_nonfinite_steps log, write the result and
        stop (the engine never applied those gradients, and no checkpoint is saved)."""
        finite_grad = math.isfinite(record["grad_norm"])
        if self.cfg.zero.dtype == "fp16":
            finite_grad = finite_grad or self.engine.loss_scale > self.engine.config.min_loss_scale
        self.bad_steps = 0 if math.isfinite(record["loss"]) and finite_grad else self.bad_steps + 1
        if self.bad_steps < self.cfg.train.max_nonfinite_steps:
            return
        message = (f"training diverged: {self.bad_steps} consecutive steps up to step {done} had a non-finite "
                   f"loss ({record['loss']}) or gradient norm ({record['grad_norm']}); the last checkpoint "
                   "holds the last finite state (lower optim.lr or raise optim.warmup_steps)")
        self.logger.log(done, record)
        if self.is_rank0:
            write_result(self.run_dir, {"status": "diverged", "step": done, "message": message,
                                        "val_loss": self.val_loss})
        raise DivergenceError(message)

    def finish(self) -> dict:
        """Sample, expert-load report, crop check, summary and result file."""
        t = self.cfg.train
        trained = t.steps > self.start_step
        result = {"val_loss": self.val_loss, "steps": t.steps, "run_dir": str(self.run_dir)}
        if t.sample_tokens and trained:
            self.write_sample()
        if self.expert_loads:
            report_expert_load(self.expert_loads, self.dims, self.run_dir, self.is_rank0)
        if t.crop_check_tokens and trained:
            result.update(self.run_crop_check())
        if self.is_rank0:
            self.logger.summary({"final_val_loss": self.val_loss})
            write_result(self.run_dir, {"status": "complete", **result})
            self.attach_files()
        self.logger.finish()
        return result

    def write_sample(self) -> None:
        """train.sample_tokens tokens generated from train.sample_prompt, into sample.txt and the log."""
        if self.pipe is not None:
            if self.is_rank0:
                print("sample skipped: generation through pipeline stages is not implemented", flush=True)
            return
        text = sample(self.engine, self.cfg, self.dims, stream_tokenizer(self.train_stream))
        if self.is_rank0:
            atomic_write_text(self.run_dir / "sample.txt", text)
            print("---- sample ----\n" + text + "\n----------------", flush=True)

    def run_crop_check(self) -> dict:
        """train.crop_check_tokens: the last tokens of the first held-out sequence through the trained model
        as training runs it, against a plain forward over their receptive field (recipes.crop_check)."""
        tokens, labels = (t.to(self.engine.device) for t in self.val_stream.batch(0, 0, 0))
        out = crop_check(self.engine, model_config(self.cfg), self.dims, tokens[:1], labels[:1],
                         self.cfg.train.crop_check_tokens)
        if self.is_rank0:
            verdict = "passed" if out["crop_check_passed"] else "FAILED"
            print(f"crop check {verdict}: the last {self.cfg.train.crop_check_tokens} of {tokens.shape[1]} tokens "
                  f"against a plain forward over a {out['crop_check_crop_len']}-token crop: largest per-token loss "
                  f"difference {out['crop_check_max_abs_diff']:.2e} (tolerance 1e-4)", flush=True,
                  file=sys.stdout if out["crop_check_passed"] else sys.stderr)
        return out


def train(cfg: DictConfig, stop: StopSignals | None = None) -> dict:
    """A whole run: build everything, train `train.steps` steps, then sample and report. A run that is
    already complete (resumed at train.steps) keeps its results and says so. train.stop_signals are caught
    for its duration (by `stop` when given, which the caller then closes): such a signal stops the run at the
    next step boundary with a checkpoint (Preempted)."""
    own = stop is None
    try:
        stop = StopSignals.from_config(cfg) if own else stop
        run = Run(cfg, stop)
        done = run.previous_result is not None and run.previous_result.get("status") == "complete"
        if run.start_step >= cfg.train.steps and done:
            if run.is_rank0:
                print(f"run {run.run_dir} is complete ({run.start_step} steps); raise train.steps to continue it",
                      flush=True)
            run.logger.finish()
            return run.previous_result
        run.loop()
        return run.finish()
    finally:
        comm.stop_watchdog()
        if stop is not None:
            stop.on_expire = None  # (it holds the run, and with it run_dir's lock)
            if own:
                stop.close()


def report(error: BaseException, code: int, stop: StopSignals | None = None) -> None:
    """One line on stderr, then exit `code`. Before the process group exists every rank checks the same command
    line, so rank 0 alone reports; the others ignore the stop signals from then on and give it a second to do
    so before they exit (torchrun ends the other ranks, with SIGTERM, as soon as one has exited). A preempted
    run reports once too (every rank stops for the same signal)."""
    once = isinstance(error, Preempted) or not dist.is_initialized()
    rank = int(os.environ.get("RANK", "0"))
    if not once or rank == 0:
        print(f"{'' if isinstance(error, Preempted) else 'error: '}{error}", file=sys.stderr, flush=True)
    if stop is not None and not dist.is_initialized():
        stop.ignore()
        if rank:
            time.sleep(1.0)
    sys.exit(code)


@refuse_bad_command_line  # what Hydra cannot compose (train.stepz=5, train.steps=abc) is one line and exit 2 too
@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    stop = None
    try:
        # Held until the process exits when preempted: the signals stay ignored (StopSignals.exiting).
        stop = StopSignals.from_config(cfg)
        train(cfg, stop)
        stop.close()
    except (ConfigError, DataError, zero.LayoutError, zero.CheckpointError, zero.ReshardError,
            NotImplementedError) as e:
        report(e, 2, stop)
    except DivergenceError as e:
        report(e, 3, stop)
    except CheckpointWriteError as e:  # (a full disk, a quota): the previous checkpoints are intact
        report(e, 5, stop)
    except Preempted as e:
        report(e, e.exit_code)  # 128 + the signal's number: 143 SIGTERM, 130 SIGINT, 138 SIGUSR1
    except HangError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(4)  # do not wait on the process group: its peer is not answering
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
