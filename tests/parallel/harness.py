"""One training loop for every parallel layout (dp, tp, pp, sp, ep, ZeRO stage, pipeline schedule).

`train(layout)` builds the tiny Llama below on each rank, applies the layout from outside (expert,
tensor, sequence, pipeline parallelism), trains a few steps on fixed data through the ZeRO engine and
returns this rank's record (`tests.equivalence.Recorder`: global-batch losses, gradient norms, and
snapshots of every parameter this rank holds after the first step and at the end, with placements).
Run with a world of one it is the single-rank reference the parallel runs must equal
(`reference(...)`); `assert_matches` checks every rank of a parallel run against it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import zero
from moe import apply_expert_parallel, update_router_biases
from recipes.models.llama import ModelConfig, MoEConfig, Transformer
from sequence_parallel import apply_ulysses, shard_sequence, sp_loss
from tests.equivalence import Recorder, as_reference, assert_equivalent
from zero.parallel.pipeline import apply_pipeline
from zero.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

SEQ, ROWS, MICRO, STEPS, LR = 16, 4, 4, 3, 0.5
IGNORE = -100


def model_config(moe: bool | dict = False, **overrides) -> ModelConfig:
    """The tiny model; `moe` True (or a dict of MoEConfig overrides) makes layers 1-3 MoE layers."""
    base = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                tie_embeddings=True)
    base.update(overrides)
    if moe:
        settings = dict(num_experts=4, top_k=2, ffn_dim=32, first_dense=1, aux_loss_coef=1e-2, z_loss_coef=1e-3)
        settings.update(moe if isinstance(moe, dict) else {})
        base["moe"] = MoEConfig(**settings)
    return ModelConfig(**base)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch (ROWS rows) of a step: tokens and shifted labels."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    seq = torch.randint(0, 64, (ROWS, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def train(layout: dict, moe: bool | dict = False, model_overrides: dict | None = None, steps: int = STEPS,
          stage: int = 0, schedule: str = "1f1b", virtual_stages: int | None = None,
          dtype: str = "fp32", ckpt_dir: str | None = None, resume_from: str | None = None,
          eval_first: bool = False, zero_options: dict | None = None, optim: str = "sgd",
          save_at: int | None = None, placements: bool = True) -> dict:
    """Train `steps` steps (from a checkpoint's step with `resume_from`); with `ckpt_dir` save after
    `save_at` steps (default steps - 1). optim="adamw" has per-element state to carry over."""
    dims = zero.ParallelDims(**layout)
    coord = dims.coordinate() if dims.distributed else {"dp": 0, "sp": 0, "tp": 0, "pp": 0, "ep": 0, "edp": 0}
    torch.manual_seed(0)
    model = Transformer(model_config(moe, **(model_overrides or {})))
    plans: list[zero.Plan] = []
    if moe:
        plans.append(apply_expert_parallel(model, dims))
    tp = apply_tensor_parallel(model, dims.tp_group)
    plans.append(tp)
    apply_ulysses(model, dims.sp_group)
    if not placements:  # a run that declares no placements (checkpoints resume only at their own layout)
        for plan in plans:
            plan.placements = {}

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, count = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), dims.tp_group, IGNORE)
        return sp_loss(loss_sum, count, dims.sp_group)

    pipe = None
    module = model
    if dims.pp > 1:
        pipe = apply_pipeline(model, dims, schedule, microbatches=MICRO, loss_fn=loss_fn,
                              virtual_stages=virtual_stages)
        module = pipe.module
        plans.append(pipe)
    # Adam with a large eps: elements with near-zero gradients must not turn layout noise into +-lr steps.
    factory = (functools.partial(torch.optim.SGD, lr=LR) if optim == "sgd" else
               functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-3, weight_decay=0.1))
    engine = zero.initialize(
        module, factory,
        zero.ZeroConfig(stage=stage, grad_accum_steps=MICRO, clip_grad_norm=1.0, dtype=dtype,
                        reduce_bucket_size=2000, **(zero_options or {})),
        dims, plans=plans)
    start = 0
    if resume_from is not None:
        start = engine.load_checkpoint(resume_from)["step"]
    save_at = steps - 1 if save_at is None else save_at
    if ckpt_dir is not None and save_at == start:  # nothing to train: save what was loaded
        engine.save_checkpoint(ckpt_dir, client_state={"step": start})

    def shard(tokens, labels):
        per = ROWS // dims.dp
        tokens, labels = (t[coord["dp"] * per:(coord["dp"] + 1) * per] for t in (tokens, labels))
        return shard_sequence(tokens, labels, dims.sp_group, ignore_index=IGNORE)

    record, evaluated = Recorder(engine, dims.dp_group if dims.dp > 1 else None), None
    if eval_first:  # a forward-only pass before any training (its loss from the last stage)
        evaluated = evaluate(engine, pipe, dims, [shard(*batch(99, i)) for i in range(MICRO)], loss_fn)
    for step in range(start, steps):
        micro = [shard(*batch(step, i)) for i in range(MICRO)]
        if pipe is not None:
            tokens, labels, pos = (torch.cat(t) for t in zip(*micro))
            loss = pipe.train_step(engine, tokens, labels, position_ids=pos)
        else:
            loss = 0.0
            for tokens, labels, pos in micro:
                logits = engine(tokens, pos)
                value = loss_fn(logits, labels)
                engine.backward(value)
                loss += value.item() / MICRO
        engine.step()
        if moe:
            update_router_biases(engine.module, dims.dp_sp_group)
        record.step(loss)
        if ckpt_dir is not None and step + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, client_state={"step": step + 1})
    return {**record.result(), "eval": evaluated,
            "resharded_from": (engine.loaded_checkpoint or {}).get("resharded_from")}


@torch.no_grad()
def evaluate(engine, pipe, dims: zero.ParallelDims, micro: list, loss_fn) -> float:
    engine.eval()
    if pipe is not None:
        tokens, labels, pos = (torch.cat(t) for t in zip(*micro))
        value = pipe.eval_step(engine, tokens, labels, position_ids=pos)
    else:
        value = sum(loss_fn(engine(t, p), y).item() for t, y, p in micro) / len(micro)
    engine.train()
    t = torch.tensor([value], dtype=torch.float64)
    if dims.dp > 1:
        dist.all_reduce(t, group=dims.dp_group)
    return float(t) / dims.dp


def reference(**options) -> dict:
    """The one-rank run of `train` as a reference trajectory (with its evaluation loss)."""
    record = train({}, **options)
    return {**as_reference(record), "eval": record["eval"]}


def assert_matches(results: list[dict], reference: dict, rtol: float = 1e-5, atol: float = 2e-6,
                   label: str = "") -> None:
    """Every rank's losses, gradient norms and parameters (after the first step: the gradient) equal the
    reference's; every replica and slice of every parameter is checked (`tests.equivalence`)."""
    assert_equivalent(results, reference, rtol=rtol, atol=atol, label=label)
    for rank, result in enumerate(results):
        assert (result["eval"] is None) == (reference["eval"] is None), f"{label} rank {rank}: eval"
        if result["eval"] is not None:
            assert abs(result["eval"] - reference["eval"]) <= atol + rtol * abs(reference["eval"]), (
                f"{label} rank {rank}: eval loss {result['eval']} != {reference['eval']}")
