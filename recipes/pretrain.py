"""Pretraining recipe: `python -m recipes.pretrain [key=value ...]` or under `torchrun`.

Reads top to bottom: config checks, process groups, data, model, parallelism applied from outside,
the runtime engine, then the training loop with evaluation, checkpoints, metrics and a final sample.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import json
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

import zero
from moe import MoELayer, apply_expert_parallel
from recipes.config import (
    ConfigError,
    atomic_write_text,
    check_config,
    check_run_dir,
    checkpoints,
    model_config,
    refuse_bad_command_line,
)
from recipes.data import BatchSpec, DataError, build_streams
from recipes.models.llama import Transformer
from recipes.tracking import MetricsLogger
from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp, apply_ulysses
from zero.dist import comm
from zero.dist.topology import default_device
from zero.parallel.pipeline import Pipeline, apply_pipeline
from zero.parallel.tensor import apply_tensor_parallel, gather_sequence, vocab_parallel_cross_entropy

IGNORE_INDEX = -100


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
    """Stage 3 dense models are built on the meta device and materialised by the engine unit by unit
    (Transformer.init_parameter gives the values an eager build would), so no rank holds the whole model.
    (Not under tensor parallelism: its parameters are slices of what init_parameter fills.)"""
    return cfg.zero.stage == 3 and not cfg.model.moe.num_experts and cfg.parallel.tp == 1


@dataclass
class Parallelism:
    """What was applied to the model from outside: the plans the engine takes, in the order they were
    applied, and this rank's pipeline (one of the plans) when there is one."""

    plans: list[zero.Plan] = field(default_factory=list)
    pipe: Pipeline | None = None


def build_model(cfg: DictConfig, dims: zero.ParallelDims,
                initial: dict[str, torch.Tensor] | None = None) -> tuple[Transformer, Parallelism]:
    """The full model, identically initialised on every rank (with the `initial` weights when given), then
    parallelised from outside: experts over ep, tensor parallel over tp, heads over sp (Ulysses), then this
    rank's pipeline stages over pp. Each keeps its slice of the values the full model holds, so initial
    weights need no slicing of their own (a meta-built model gets them from the engine: see Run)."""
    meta = builds_on_meta(cfg)
    model = Transformer(model_config(cfg), device="meta" if meta else None)
    if initial is not None and not meta:
        load_initial_weights(model, initial)
    parallel = Parallelism()
    if cfg.model.moe.num_experts:
        parallel.plans.append(apply_expert_parallel(model, dims))
    parallel.plans.append(apply_tensor_parallel(model, dims.tp_group))  # slices heads; Ulysses splits the rest
    apply_ulysses(model, dims.sp_group)
    if cfg.train.tiled_mlp:
        # MoE layers stay untiled: tiling would make router statistics per tile (see TiledMLP)
        apply_tiled_mlp(model, num_tiles=cfg.train.tiled_mlp, exclude=(MoELayer,))
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model, offload=cfg.train.offload_activations)
    # One process per device: the model lives on this rank's GPU where there is one (else the CPU).
    model = model if meta else model.to(default_device())
    if dims.pp > 1:
        p = cfg.parallel
        parallel.pipe = apply_pipeline(model, dims, p.pp_schedule, microbatches=cfg.train.grad_accum,
                                       loss_fn=functools.partial(logits_loss, dims=dims),
                                       virtual_stages=p.pp_virtual_stages,
                                       split=None if p.pp_split is None else list(p.pp_split))
        parallel.plans.append(parallel.pipe)
    return model, parallel


def build_engine(cfg: DictConfig, model: Transformer, dims: zero.ParallelDims,
                 parallel: Parallelism) -> zero.Engine:
    """The ZeRO engine over this rank's part of `model` (under pp: its stages only), told by the plans
    what parallelism applied from outside needs from it."""
    o = cfg.optim
    return zero.initialize(
        model if parallel.pipe is None else parallel.pipe.module,
        # The fastest AdamW where the step runs (fused on CPU and CUDA), offloaded or not.
        optimizer=zero.FastAdamW(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay),
        config=zero.ZeroConfig(grad_accum_steps=cfg.train.grad_accum, clip_grad_norm=o.grad_clip,
                               **OmegaConf.to_container(cfg.zero, resolve=True)),
        dims=dims,
        lr_scheduler=functools.partial(ScheduleLR, cfg=cfg),
        plans=parallel.plans,  # a meta-device model is materialised by the engine through its init_parameter
    )


def initial_weights(cfg: DictConfig, run_dir: Path, is_rank0: bool) -> dict[str, torch.Tensor] | None:
    """The full weights train.init_from names (a Hugging Face Llama / Mixtral directory, as recipes.export
    writes) for a fresh run, refused in one line naming every model key on which they differ from the
    run's model. None without it, and when the run resumes (its checkpoint holds the weights: said once)."""
    source, mode = cfg.train.init_from, cfg.train.resume
    if source is None:
        return None
    if mode not in (False, "false") and (mode not in (True, "true", "auto") or checkpoints(run_dir)):
        if is_rank0:
            print(f"train.init_from={source} is not used: the run resumes from its checkpoint "
                  f"(train.resume={mode})", flush=True)
        return None
    from recipes.export import ExportError, import_hf, weight_mismatches

    try:
        theirs, state = import_hf(source)
    except ExportError as e:
        raise ConfigError(f"train.init_from={source}: {e}") from None
    differ = weight_mismatches(model_config(cfg), theirs)
    if differ:
        raise ConfigError(f"train.init_from={source} holds another model: "
                          + ", ".join(f"{k}={a} here but {b} there" for k, (a, b) in differ.items())
                          + "; set those keys to the directory's values or choose another directory")
    return state


def load_initial_weights(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Copy full weights into the full (not yet parallelised) model; only buffers may be absent (a router's
    expert bias starts at zero)."""
    result = model.load_state_dict(state, strict=False)
    buffers = {name for name, _ in model.named_buffers()}
    absent = [k for k in result.missing_keys if k not in buffers] + list(result.unexpected_keys)
    if absent:
        raise ConfigError(f"train.init_from: the weights do not fit the model (missing or unexpected: "
                          f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''})")


def lm_loss(engine, tokens: torch.Tensor, labels: torch.Tensor, cfg: DictConfig,
            dims: zero.ParallelDims) -> torch.Tensor:
    """Mean next-token cross-entropy of this data shard (over the whole sequence when sp > 1).

    The model runs through the engine (`engine(...)`), which gathers sharded parameters when needed.
    """
    position_ids = None
    if dims.sp > 1:
        from sequence_parallel import shard_sequence

        tokens, labels, position_ids = shard_sequence(tokens, labels, dims.sp_group, ignore_index=IGNORE_INDEX)
    if cfg.train.tiled_loss:
        from sequence_parallel import tiled_cross_entropy

        hidden = engine(tokens, position_ids, return_hidden=True)
        loss_sum, count = tiled_cross_entropy(hidden.flatten(0, 1), engine.module.output_weight,
                                              labels.flatten(), ignore_index=IGNORE_INDEX)
        if dims.sp > 1:
            from sequence_parallel import sp_loss

            return sp_loss(loss_sum, count, dims.sp_group)
        return loss_sum / count.clamp(min=1)
    return logits_loss(engine(tokens, position_ids), labels, dims)


def logits_loss(logits: torch.Tensor, labels: torch.Tensor, dims: zero.ParallelDims) -> torch.Tensor:
    """Mean next-token cross-entropy from logits [b, s, vocab] (vocabulary-sliced under tp, never gathered)
    over the whole sequence (sp) of this data shard. Also the last pipeline stage's loss function."""
    loss_sum, count = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), dims.tp_group,
                                                   IGNORE_INDEX)
    if dims.sp > 1:
        from sequence_parallel import sp_loss

        return sp_loss(loss_sum, count, dims.sp_group)
    return loss_sum / count.clamp(min=1)


def stacked_micro_batches(stream, index: int, cfg: DictConfig, dims: zero.ParallelDims,
                          device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The train.grad_accum micro-batches of batch `index` stacked along the batch dimension (a pipeline
    splits them back in order), each shard of the sequence under sp, with their position ids."""
    parts = []
    for micro in range(cfg.train.grad_accum):
        x, y = (t.to(device, non_blocking=True) for t in stream.batch(index, micro, dims.dp_rank))
        if dims.sp > 1:
            from sequence_parallel import shard_sequence

            parts.append(shard_sequence(x, y, dims.sp_group, ignore_index=IGNORE_INDEX))
        else:
            parts.append((x, y, torch.arange(x.shape[1], device=device).expand_as(x)))
    return tuple(torch.cat(t) for t in zip(*parts))


def mean_over_dp(value: float, dims: zero.ParallelDims) -> float:
    """Average a per-data-shard scalar over data-parallel ranks (for logging the global-batch loss)."""
    if dims.dp == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=default_device())  # NCCL reduces device tensors
    comm.all_reduce(t, dims.dp_group)
    return t.item() / dims.dp


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (and the CUDA allocator's peak on GPUs)."""
    from zero.dist.topology import peak_rss_bytes

    peak = peak_rss_bytes() / 2**20
    if torch.cuda.is_available():
        peak = max(peak, torch.cuda.max_memory_allocated() / 2**20)
    return peak


def per_rank(value: float, dims: zero.ParallelDims) -> list[float]:
    """`value` of every rank, in rank order (one small all-reduce)."""
    if dims.world_size == 1:
        return [value]
    t = torch.zeros(dims.world_size, dtype=torch.float64, device=default_device())
    t[dist.get_rank()] = value
    comm.all_reduce(t, dist.group.WORLD)
    return t.tolist()


def memory_metrics(dims: zero.ParallelDims) -> dict[str, float]:
    """Peak memory: the largest over ranks as `peak_rss_mb`, and each rank's as `peak_rss_mb/rank<r>`."""
    peaks = per_rank(peak_rss_mb(), dims)
    out = {"peak_rss_mb": max(peaks)}
    if len(peaks) > 1:
        out.update({f"peak_rss_mb/rank{r}": p for r, p in enumerate(peaks)})
    return out


@torch.no_grad()
def evaluate(engine, val_stream, cfg: DictConfig, dims: zero.ParallelDims, pipe: Pipeline | None = None) -> float:
    """Mean loss over `train.eval_batches` fixed held-out global batches (from the last pipeline stage)."""
    engine.module.eval()
    total = 0.0
    for i in range(cfg.train.eval_batches):
        if pipe is not None:
            x, y, pos = stacked_micro_batches(val_stream, i, cfg, dims, engine.device)
            total += pipe.eval_step(engine, x, y, position_ids=pos) * cfg.train.grad_accum
            continue
        for micro in range(cfg.train.grad_accum):
            x, y = (t.to(engine.device, non_blocking=True) for t in val_stream.batch(i, micro, dims.dp_rank))
            total += lm_loss(engine, x, y, cfg, dims).item()
    engine.module.train()
    return mean_over_dp(total / (cfg.train.eval_batches * cfg.train.grad_accum), dims)


class DivergenceError(RuntimeError):
    """Training produced non-finite losses or gradients for too many consecutive steps."""


def save_checkpoint(engine, run_dir: Path, step: int, is_rank0: bool, keep: int = 0,
                    run_id: str | None = None) -> None:
    """Save step `step`, point `latest` at it, and keep only the newest `keep` checkpoints (0: all)."""
    name = f"step_{step:07d}"
    engine.save_checkpoint(run_dir / "checkpoints" / name,
                           client_state={"step": step, "rng": torch.get_rng_state()}, run_id=run_id)
    if is_rank0:  # the pointer moves only after the checkpoint is complete
        atomic_write_text(run_dir / "checkpoints" / "latest", name)
        for old in checkpoints(run_dir)[keep:] if keep else []:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def moe_stats(engine, cfg: DictConfig, dims: zero.ParallelDims, pipe: Pipeline | None) -> dict:
    """Per-layer MoE statistics numbered over the whole model: under pp each stage numbers its layers
    after the MoE layers of the stages before it, and every rank gets every stage's (one gather)."""
    from moe import collect_moe_stats

    if pipe is None:
        return collect_moe_stats(engine.module)
    model_cfg = model_config(cfg)
    mine = {}
    for plan, stage in zip(pipe.plans, pipe.stage_modules):
        before = sum(model_cfg.is_moe_layer(i) for i in range(plan.layers.start))
        mine.update(collect_moe_stats(stage, start=before))
    out = {}
    for part in comm.all_gather_object(mine, dims.pp_group):
        out.update(part)
    return dict(sorted(out.items()))


def moe_step_metrics(stats: dict, loads: dict[str, list[float]]) -> dict:
    """Scalar per-layer MoE metrics of the step; tokens per expert are summed into `loads`."""
    out = {}
    for key, value in stats.items():
        if isinstance(value, list):
            loads[key] = [a + b for a, b in zip(loads.get(key, [0.0] * len(value)), value)]
        else:
            out[key] = value
    return out


def expert_load_report(loads: dict[str, list[float]], run_dir: Path) -> str:
    """A per-layer table of expert load fractions over the run, and the same as a heatmap PNG."""
    rows = [(key.split("/")[1], [v / max(sum(counts), 1) for v in counts]) for key, counts in sorted(loads.items())]
    width = len(rows[0][1])
    lines = ["expert load (fraction of routed tokens over the run; uniform = %.3f)" % (1 / width),
             "layer    " + " ".join(f"e{e:<5d}" for e in range(width)) + "  max/min"]
    for name, frac in rows:
        ratio = max(frac) / max(min(frac), 1e-9)
        lines.append(f"{name:<8s} " + " ".join(f"{f:.3f} " for f in frac) + f" {ratio:6.2f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 0.5 * width + 2), 0.5 * len(rows) + 1.5))
    im = ax.imshow([frac for _, frac in rows], aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_title("expert load fraction over the run")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(run_dir / "expert_load.png", dpi=100)
    plt.close(fig)
    return "\n".join(lines)


def sample(engine, cfg: DictConfig, dims: zero.ParallelDims) -> str:
    """Generate bytes from the prompt. Every rank runs it in lockstep (same generator), so sharded
    experts and parameters take part; under sp the attention runs locally on the full sequence; under
    tp the context is padded at its end to a multiple of tp (causal attention leaves the earlier logits
    unchanged; a capacity-limited MoE counts the padding in its capacity) and the vocabulary slices of
    the logits are gathered."""
    from sequence_parallel import local_attention

    model = engine.module
    prompt = torch.tensor([list(cfg.train.sample_prompt.encode())], dtype=torch.long, device=engine.device)
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
    return (cfg.train.sample_prompt.encode() + bytes(out[0].clamp(max=255).tolist())).decode("utf-8", "replace")


def train_step(engine: zero.Engine, stream, step: int, cfg: DictConfig, dims: zero.ParallelDims,
               pipe: Pipeline | None = None) -> float:
    """One optimizer step over `train.grad_accum` micro-batches (the pipeline's micro-batches under pp);
    returns the global-batch mean loss."""
    total = 0.0
    if pipe is not None:
        x, y, pos = stacked_micro_batches(stream, step, cfg, dims, engine.device)
        total = pipe.train_step(engine, x, y, position_ids=pos) * cfg.train.grad_accum
    else:
        for micro in range(cfg.train.grad_accum):
            x, y = (t.to(engine.device, non_blocking=True) for t in stream.batch(step, micro, dims.dp_rank))
            loss = lm_loss(engine, x, y, cfg, dims)
            engine.backward(loss)
            total += loss.item()
    engine.step()
    if cfg.model.moe.num_experts:
        from moe import update_router_biases

        update_router_biases(engine.module, dims.dp_sp_group)
    return mean_over_dp(total / cfg.train.grad_accum, dims)


def resume(engine: zero.Engine, run_dir: Path, cfg: DictConfig, is_rank0: bool) -> int:
    """Load the checkpoint train.resume selects and return the step to start from.

    auto / true: the newest checkpoint of run_dir that verifies, saying which newer ones were skipped and
    why; if checkpoints exist but none verifies it is an error, never a silent restart. false: start
    from step 0, refused when run_dir already has checkpoints. A path: that checkpoint, verified."""
    mode, found = cfg.train.resume, checkpoints(run_dir)
    if mode in (False, "false"):
        if found:
            raise ConfigError(f"run_dir {run_dir} has {len(found)} checkpoint(s) (newest {found[0].name}) and "
                              "train.resume=false would train over them: choose another run_dir or train.resume=auto")
        return 0
    explicit = mode not in (True, "true", "auto")
    skipped: list[str] = []
    for path in [Path(mode)] if explicit else found:
        try:
            client_state = engine.load_checkpoint(path)
        except zero.CheckpointError as e:
            if explicit:
                raise
            skipped.append(str(e))
            continue
        if is_rank0:
            note = f" (skipped {len(skipped)} newer: {'; '.join(skipped)})" if skipped else ""
            written = engine.loaded_checkpoint["resharded_from"]
            if written is not None:
                note += f" (resharded: written with {written}, now {engine.dims} at ZeRO stage {engine.config.stage})"
            print(f"resuming from {path}{note}", flush=True)
        torch.set_rng_state(client_state["rng"])
        return client_state["step"]
    if found:
        raise zero.CheckpointError(f"none of the {len(found)} checkpoints in {run_dir / 'checkpoints'} can be "
                                   f"loaded (newest: {skipped[0]}); repair or remove them, or choose another run_dir")
    return 0


RESUME_KEYS = ("model", "data", "train.seed", "train.seq_len")


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def check_resumed_config(cfg: DictConfig, run_dir: Path, dims: zero.ParallelDims, is_rank0: bool) -> None:
    """Compare the config of a run that will resume with the one its run_dir was started with: a change
    that breaks resume (model, data, seed, sequence length, global batch) is refused by name; other changes
    (steps, cadences, ...) are reported and appended to config_changes.jsonl."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.exists():
        return
    old = _flat(OmegaConf.to_container(OmegaConf.load(saved_file), resolve=True))
    new = _flat(OmegaConf.to_container(cfg, resolve=True))
    changed = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and k != "run_dir"}
    t_old = {k: old.get(f"train.{k}") for k in ("micro_batch_size", "grad_accum")}
    old_batch = t_old["micro_batch_size"] * t_old["grad_accum"] * (old.get("parallel.dp") or dims.dp)
    new_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * dims.dp
    breaking = [k for k in changed if k.startswith(RESUME_KEYS)]
    if old_batch != new_batch:
        breaking.append(f"global batch ({old_batch} -> {new_batch} sequences)")
    if breaking:
        raise ConfigError(f"run_dir {run_dir} was started with another {', '.join(breaking)}; resuming would not "
                          "continue that run: restore those values or choose another run_dir")
    if changed and is_rank0:
        print("config changed since this run started: " + ", ".join(f"{k}: {a!r} -> {b!r}"
                                                                    for k, (a, b) in changed.items()), flush=True)
        with open(run_dir / "config_changes.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "changes": {k: list(v) for k, v in changed.items()}}) + "\n")


def finite_or_none(value):
    """JSON-safe: non-finite floats become null (result files stay valid JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    return value


def lock_run_dir(run_dir: Path, world) -> object:
    """Hold an exclusive lock on run_dir for this process's lifetime (rank 0); a second run on the same
    directory is refused on every rank with the holder's pid."""
    handle, problem = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        handle = open(run_dir / ".lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
        except BlockingIOError:
            handle.seek(0)
            problem = (f"run_dir {run_dir} is in use by another run (pid {handle.read().strip() or '?'}); "
                       "wait for it to finish or choose another run_dir")
            handle.close()
    problem = comm.all_gather_object(problem, world)[0]
    if problem is not None:
        raise ConfigError(problem)
    return handle


def run_identity(run_dir: Path, world) -> str:
    """The run's identity (created with its run_dir, kept across resumes), recorded in every checkpoint shard."""
    run_id = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = run_dir / "run_id"
        if not path.exists():
            atomic_write_text(path, uuid.uuid4().hex + "\n")
        run_id = path.read_text().strip()
    return comm.all_gather_object(run_id, world)[0]


def is_due(done: int, every: int, steps: int) -> bool:
    """Evaluation / checkpoint cadence: every `every` steps (0 = never) and always at the last step."""
    return (every and done % every == 0) or done == steps


def report_expert_load(expert_loads: dict[str, list[float]], dims: zero.ParallelDims, run_dir: Path,
                       is_rank0: bool) -> None:
    """Sum each rank's expert loads over the data-parallel ranks; rank 0 writes the table and heatmap."""
    for key, counts in expert_loads.items():
        t_counts = torch.tensor(counts, dtype=torch.float64, device=default_device())
        comm.all_reduce(t_counts, dims.dp_sp_group)
        expert_loads[key] = t_counts.tolist()
    if is_rank0:
        report = expert_load_report(expert_loads, run_dir)
        atomic_write_text(run_dir / "expert_load.txt", report + "\n")
        print(report, flush=True)


class Run:
    """What one training run holds: config, layout, data, engine and logger, and its loop."""

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg)
        init_distributed(cfg.train.collective_timeout_s)
        self.cfg, t = cfg, cfg.train
        self.run_dir: Path | None = None  # known after the first collective
        if dist.is_initialized():  # every collective from here on is watched (zero.dist.comm's watchdog)
            comm.start_watchdog(t.collective_timeout_s, self.record_hang, setting="train.collective_timeout_s")
        self.dims = zero.ParallelDims(**{k: cfg.parallel[k] for k in ("dp", "tp", "pp", "sp", "ep")})
        self.is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
        # Every rank writes to rank 0's run_dir (its timestamp may differ by a second on other ranks).
        world = None if self.dims.world_size == 1 else dist.group.WORLD
        self.run_dir = check_run_dir(comm.all_gather_object(str(cfg.run_dir), world)[0])
        self.lock = lock_run_dir(self.run_dir, world)
        self.run_id = run_identity(self.run_dir, world)
        if checkpoints(self.run_dir) and cfg.train.resume not in (False, "false"):
            check_resumed_config(cfg, self.run_dir, self.dims, self.is_rank0)
        torch.manual_seed(t.seed)
        self.spec = BatchSpec(t.micro_batch_size, t.grad_accum, self.dims.dp, t.seq_len)
        self.train_stream, self.val_stream = build_streams(cfg.data, self.spec, t.seed, cfg.model.vocab_size)
        initial = initial_weights(cfg, self.run_dir, self.is_rank0)
        self.model, self.parallel = build_model(cfg, self.dims, initial)
        self.pipe = self.parallel.pipe
        self.engine = build_engine(cfg, self.model, self.dims, self.parallel)
        if initial is not None and builds_on_meta(cfg):  # built without values: the engine takes them
            self.engine.load_full_state_dict(initial)
        self.start_step = resume(self.engine, self.run_dir, cfg, self.is_rank0)
        if self.is_rank0:
            atomic_write_text(self.run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        self.logger = MetricsLogger(self.run_dir, self.is_rank0, OmegaConf.to_container(cfg.wandb),
                                    OmegaConf.to_container(cfg, resolve=True), resume_step=self.start_step)
        self.expert_loads: dict[str, list[float]] = {}
        self.val_loss: float | None = None
        self.bad_steps = 0  # consecutive steps with a non-finite loss or gradient
        if self.is_rank0:
            total = model_config(cfg).num_params()
            mine = sum(p.numel() for p in self.engine.module.parameters())
            print(f"{self.dims} | model {total / 1e6:.2f}M params, {mine / 1e6:.2f}M on rank 0 | "
                  f"run_dir {self.run_dir}"
                  + (f" | resumed at step {self.start_step}" if self.start_step else ""), flush=True)

    def step_record(self, step: int, loss: float, lr: float, dt: float) -> dict:
        """The metrics of one finished step (validation added by the caller)."""
        engine_metrics = self.engine.metrics()
        record = {"loss": loss, "lr": lr, "grad_norm": float(self.engine.global_grad_norm),
                  "skipped_steps": engine_metrics["skipped_steps"],
                  "tokens_per_s": self.spec.global_batch * self.cfg.train.seq_len / dt, "step_time_s": dt,
                  "comm_bytes": engine_metrics["comm_bytes_per_step"], **memory_metrics(self.dims)}
        if self.cfg.zero.dtype == "fp16":
            record.update(loss_scale=engine_metrics["loss_scale"])
        if self.cfg.model.moe.num_experts:
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
            result = {"status": "hung", "step": hang.step, "rank": hang.rank, "message": str(hang)}
            atomic_write_text(self.run_dir / "result.json", json.dumps(result))

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
            result = {"status": "diverged", "step": done, "message": message, "val_loss": self.val_loss}
            atomic_write_text(self.run_dir / "result.json", json.dumps(finite_or_none(result)))
        raise DivergenceError(message)

    def loop(self) -> None:
        t = self.cfg.train
        progress = None
        if self.is_rank0 and t.progress:
            from tqdm import tqdm

            progress = tqdm(total=t.steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True)
        for step in range(self.start_step, t.steps):
            t0 = time.perf_counter()
            lr = self.engine.get_lr()[0]
            with self.collective_watch(step):
                loss = train_step(self.engine, self.train_stream, step, self.cfg, self.dims, self.pipe)
                record = self.step_record(step, loss, lr, time.perf_counter() - t0)
                done = step + 1
                self.guard_divergence(done, record)
                if t.eval_batches and is_due(done, t.eval_every, t.steps):
                    self.val_loss = record["val_loss"] = evaluate(self.engine, self.val_stream, self.cfg, self.dims,
                                                                  self.pipe)
                self.logger.log(done, record)
                if is_due(done, t.ckpt_every, t.steps):
                    save_checkpoint(self.engine, self.run_dir, done, self.is_rank0, t.keep_checkpoints, self.run_id)
            if progress is not None:
                extra = {"val": f"{self.val_loss:.3f}"} if self.val_loss is not None else {}
                if "loss_scale" in record:  # fp16: the scale and the steps skipped for overflow
                    extra.update(scale=f"{record['loss_scale']:.0f}", skipped=record["skipped_steps"])
                progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", **extra)
                progress.update(1)
        if progress is not None:
            progress.close()

    def crop_check(self) -> dict:
        """train.crop_check_tokens: the last tokens of the first held-out sequence through the trained model
        as training runs it, against a plain forward over their receptive field (recipes.crop_check)."""
        from recipes.crop_check import crop_check

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

    def finish(self) -> dict:
        """Sample, expert-load report, summary and result file."""
        t = self.cfg.train
        result = {"val_loss": self.val_loss, "steps": t.steps, "run_dir": str(self.run_dir)}
        if t.sample_tokens and t.steps > self.start_step and self.pipe is not None:
            if self.is_rank0:
                print("sample skipped: generation through pipeline stages is not implemented", flush=True)
        elif t.sample_tokens and t.steps > self.start_step:
            text = sample(self.engine, self.cfg, self.dims)
            if self.is_rank0:
                atomic_write_text(self.run_dir / "sample.txt", text)
                print("---- sample ----\n" + text + "\n----------------", flush=True)
        if self.expert_loads:
            report_expert_load(self.expert_loads, self.dims, self.run_dir, self.is_rank0)
        if t.crop_check_tokens and t.steps > self.start_step:
            result.update(self.crop_check())
        if self.is_rank0:
            self.logger.summary({"final_val_loss": self.val_loss})
            atomic_write_text(self.run_dir / "result.json", json.dumps(finite_or_none({"status": "complete",
                                                                                        **result})))
        self.logger.finish()
        return result


def train(cfg: DictConfig) -> dict:
    """A whole run: build everything, train `train.steps` steps, then sample and report. A run that is
    already complete (resumed at train.steps) keeps its results and says so."""
    try:
        run = Run(cfg)
        result_file = run.run_dir / "result.json"
        if run.start_step >= cfg.train.steps and result_file.exists():
            if run.is_rank0:
                print(f"run {run.run_dir} is complete ({run.start_step} steps); raise train.steps to continue it",
                      flush=True)
            run.logger.finish()
            return json.loads(result_file.read_text())
        run.loop()
        return run.finish()
    finally:
        comm.stop_watchdog()


@refuse_bad_command_line  # what Hydra cannot compose (train.stepz=5, train.steps=abc) is one line and exit 2 too
@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except (ConfigError, zero.ConfigError, DataError, zero.LayoutError, zero.CheckpointError, zero.ReshardError,
            NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except DivergenceError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except HangError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(4)  # do not wait on the process group: its peer is not answering
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
