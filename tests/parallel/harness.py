"""One training loop for every parallel layout (dp, tp, pp, sp, ep, ZeRO stage, pipeline schedule).

`train(layout)` builds the tiny Llama below (or a tiny Hugging Face model) on each rank, applies the layout
from outside with the recipe's own `recipes.parallelize` (expert, tensor, sequence, pipeline parallelism), trains a
few steps on fixed data through the ZeRO engine and returns this rank's record (`tests.equivalence.Recorder`:
global-batch losses, gradient norms, and snapshots of every parameter this rank holds after the first step and at
the end, with placements), in fp32 or bf16, on plain rows or rows of packed documents.
Run with a world of one it is the single-rank reference the parallel runs must equal
(`reference(...)`); `assert_matches` checks every rank of a parallel run against it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from moe_lst.kernels.documents import positions_from_starts
from moe_lst.models.llama import ModelConfig, MoEConfig, Transformer
from omegaconf import DictConfig, OmegaConf

import zero
from moe import update_router_biases
from recipes.parallelize import parallelize
from sequence_parallel import shard_sequence, sp_loss
from tests.equivalence import Recorder, as_reference, assert_equivalent, read_values
from zero.parallel.tensor import vocab_parallel_cross_entropy

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


def parallel_config(family: str, microbatches: int, schedule: str = "1f1b",
                    virtual_stages: int | None = None) -> DictConfig:
    """The recipe-config keys `recipes.parallelize` reads, for the harness's runs: the model's family, no tiling or
    checkpointing, and the pipeline's schedule over `microbatches` micro-batches."""
    return OmegaConf.create({
        "model": {"family": family},
        "train": {"grad_accum": microbatches, "tiled_mlp": 0, "activation_checkpointing": False,
                  "offload_activations": False},
        "parallel": {"pp_schedule": schedule, "pp_virtual_stages": virtual_stages, "pp_split": None}})


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch (ROWS rows) of a step: tokens and shifted labels."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    seq = torch.randint(0, 64, (ROWS, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def packed_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global micro-batch of `batch` as rows of packed documents, as recipes.data.DocumentStream.packed_batch
    gives them: documents of random lengths (one may be cut by the row's end), position ids restarting at each,
    and the label of each document's last token (the next document's first token) ignored."""
    tokens, labels = batch(step, micro)
    starts = torch.rand(ROWS, SEQ + 1, generator=torch.Generator().manual_seed(7 + 1000 * step + micro)) < 0.2
    starts[:, 0] = True
    return tokens, labels.masked_fill(starts[:, 1:], IGNORE), positions_from_starts(starts[:, :-1])


def train(layout: dict, moe: bool | dict = False, model_overrides: dict | None = None, steps: int = STEPS,
          stage: int = 0, schedule: str = "1f1b", virtual_stages: int | None = None,
          dtype: str = "fp32", ckpt_dir: str | None = None, resume_from: str | None = None,
          eval_first: bool = False, zero_options: dict | None = None, optim: str = "sgd",
          save_at: int | None = None, placements: bool = True, lr: float | None = None, packed: bool = False,
          hf: str | None = None, split_rows: int = 1, start_weights: list[dict] | None = None,
          record_read: bool = False) -> dict:
    """Train `steps` steps (from a checkpoint's step with `resume_from`); with `ckpt_dir` save after
    `save_at` steps (default steps - 1). optim="adamw" has per-element state to carry over.

    `lr`: the optimizer's (default LR for SGD, 1e-2 for AdamW). `packed`: the rows hold packed documents
    (`packed_batch`; the model keeps attention inside each, as the recipe runs them). `hf`: a tiny Hugging Face
    model of that type (tests/hf/tiny.py, `model_overrides` its config keys) instead of the Llama; its MoE
    balancing loss joins the gradient. `split_rows`: each micro-batch runs as that many micro-batches of its rows
    in turn (a one-rank reference for dp ranks whose MoE statistics are per rank). `start_weights`: the full
    weights each step starts from, loaded before it (a run that follows another run's weights). `record_read`:
    the record's "read" holds, per step, the full weights that step's forward read (a quantized gather's decoded
    values; tests.equivalence.read_values)."""
    dims = zero.ParallelDims(**layout)
    coord = dims.coordinate() if dims.distributed else {"dp": 0, "sp": 0, "tp": 0, "pp": 0, "ep": 0, "edp": 0}
    if ROWS % (dims.dp * split_rows):
        raise ValueError(f"split_rows={split_rows} x dp={dims.dp} must divide the {ROWS} rows of a micro-batch")
    micro_count = MICRO * split_rows
    torch.manual_seed(0)
    if hf is not None:
        from moe_lst.models.hf import build

        from tests.hf.tiny import tiny_config

        model = build(tiny_config(hf, **(model_overrides or {})), sp_group=dims.sequence_group)
    else:
        model = Transformer(model_config(moe, **(model_overrides or {})))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, count = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), dims.tp_group, IGNORE)
        return sp_loss(loss_sum, count, dims.sequence_group)

    parallel = parallelize(model, parallel_config("llama" if hf is None else "hf", micro_count, schedule,
                                                  virtual_stages), dims, loss_fn=loss_fn)
    plans, pipe = parallel.plans, parallel.pipe
    module = model if pipe is None else pipe.module
    if not placements:  # a run that declares no placements (checkpoints resume only at their own layout)
        for plan in plans:
            if plan is not pipe:
                plan.placements = {}
    # Adam with a large eps: elements with near-zero gradients must not turn layout noise into +-lr steps.
    factory = (functools.partial(torch.optim.SGD, lr=LR if lr is None else lr) if optim == "sgd" else
               functools.partial(torch.optim.AdamW, lr=1e-2 if lr is None else lr, eps=1e-3, weight_decay=0.1))
    engine = zero.initialize(
        module, factory,
        zero.ZeroConfig(stage=stage, grad_accum_steps=micro_count, clip_grad_norm=1.0, dtype=dtype,
                        reduce_bucket_size=2000, **(zero_options or {})),
        dims, plans=plans)
    start = 0
    if resume_from is not None:
        start = engine.load_checkpoint(resume_from)["step"]
    save_at = steps - 1 if save_at is None else save_at
    if ckpt_dir is not None and save_at == start:  # nothing to train: save what was loaded
        engine.save_checkpoint(ckpt_dir, client_state={"step": start})

    def shard(tokens, labels, positions=None):
        per = ROWS // dims.dp // split_rows
        for part in range(split_rows):
            rows = slice((coord["dp"] * split_rows + part) * per, (coord["dp"] * split_rows + part + 1) * per)
            yield shard_sequence(tokens[rows], labels[rows], dims.sp_group,
                                 position_ids=None if positions is None else positions[rows], ignore_index=IGNORE,
                                 cp_group=dims.cp_group)

    def micro_batches(step: int) -> list:
        return [part for i in range(MICRO) for part in shard(*(packed_batch if packed else batch)(step, i))]

    packed_kwargs = {"packed": True} if packed else {}  # (unpacked: the model's call is unchanged, as the recipe's)
    if start_weights is not None:
        engine.load_full_state_dict(start_weights[start])
    record, evaluated, read = Recorder(engine, dims.dp_group if dims.dp > 1 else None), None, []
    if eval_first:  # a forward-only pass before any training (its loss from the last stage)
        evaluated = evaluate(engine, pipe, dims, [p for i in range(MICRO) for p in shard(*batch(99, i))], loss_fn)
    for step in range(start, steps):
        if start_weights is not None and step > start:
            engine.load_full_state_dict(start_weights[step])
        if record_read:
            read.append(read_values(engine))
        micro = micro_batches(step)
        if pipe is not None:
            tokens, labels, pos = (torch.cat(t) for t in zip(*micro))
            loss = pipe.train_step(engine, tokens, labels, position_ids=pos, **packed_kwargs)
        else:
            loss = 0.0
            for tokens, labels, pos in micro:
                logits = engine(tokens, pos, **packed_kwargs)
                value = loss_fn(logits, labels)
                engine.backward(value)
                loss += value.item() / micro_count
        engine.step()
        if moe:
            update_router_biases(engine.module, dims.dp_sp_group)
        record.step(loss)
        if ckpt_dir is not None and step + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, client_state={"step": step + 1})
    return {**record.result(), "eval": evaluated, "read": read,
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
