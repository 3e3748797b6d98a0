"""Trains a plain transformers LlamaForCausalLM (tiny config) on the recipe's data, 2 processes under torchrun:
the engine's own loop, then ZeroTrainer 4 steps straight (checkpoints every 2), then ZeroTrainer resumed from
checkpoint-2, then (optionally) ZeroTrainer with Ulysses sp=2 through recipes.models.hf. Rank 0 writes the
per-step losses and gradient norms (the Trainer's: what it logged); every rank the final weights of each run.

torchrun --nproc_per_node 2 tests/integrations/hf_run.py OUT_DIR STAGE OFFLOAD [sp]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from moe_lst.integrations.transformers import ZeroTrainer

import zero
from recipes.losses import mean_over_dp
from tests.integrations.common import ACCUM, BETAS, CLIP, EPS, LR, MICRO, SEED, HFRows, train_stream

STEPS = 4


def hf_model() -> transformers.LlamaForCausalLM:
    """The recipe's tiny shape as a Hugging Face Llama, identically initialised on every rank."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config)


def zero_config(stage: int, offload: str) -> zero.ZeroConfig:
    return zero.ZeroConfig(stage=stage, offload_optimizer=offload, offload_params=offload if stage == 3 else "none")


def schedule(optimizer: torch.optim.Optimizer):
    """TrainingArguments' default: linear decay to 0 over the run, no warmup."""
    return transformers.get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=STEPS)


def own_loop(stage: int, offload: str) -> tuple[dict, dict]:
    """The engine's plain loop over the same model, data, optimizer and schedule."""
    config = zero_config(stage, offload)
    config.grad_accum_steps, config.clip_grad_norm = ACCUM, CLIP
    dims = zero.ParallelDims()
    engine = zero.initialize(hf_model(), lambda p: torch.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
                                                                     fused=True), config, dims, lr_scheduler=schedule)
    stream, out = train_stream(dims.dp), {"loss": [], "grad_norm": []}
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUM):
            tokens, _ = stream.batch(step, micro, dims.dp_rank)
            loss = engine(input_ids=tokens, labels=tokens).loss  # the model shifts its labels itself
            engine.backward(loss)
            total += loss.item() / ACCUM
        engine.step()
        out["loss"].append(mean_over_dp(total, dims))
        out["grad_norm"].append(engine.global_grad_norm)
    return out, engine.full_state_dict()


def trainer_run(out: Path, stage: int, offload: str, resume: str | None = None, sp: int = 1):
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=MICRO * sp, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
        weight_decay=0.0, max_grad_norm=CLIP, optim="adamw_torch_fused", lr_scheduler_type="linear",
        train_sampling_strategy="sequential", save_strategy="steps", save_steps=2, logging_steps=1,
        report_to="none", disable_tqdm=True, seed=SEED, use_cpu=True)
    dims_dp = dist.get_world_size() // sp
    trainer = ZeroTrainer(model=hf_model(), args=args, train_dataset=HFRows(train_stream(2), STEPS),
                               zero_config=zero_config(stage, offload), sp=sp)
    assert dims_dp == trainer.dims.dp
    trainer.train(resume_from_checkpoint=resume)
    # what the Trainer logged at each step it ran (logging_steps=1): the loss over every process, the engine's norm
    logged = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    first = 2 if resume else 0
    assert [r["step"] for r in logged][-STEPS + first:] == list(range(first + 1, STEPS + 1)), logged
    logged = logged[-STEPS + first:]
    return {k: [r[k] for r in logged] for k in ("loss", "grad_norm")}, trainer.engine.full_state_dict()


def main() -> None:
    out, stage, offload = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with_sp = len(sys.argv) > 4 and sys.argv[4] == "sp"
    dist.init_process_group("gloo")  # (the Trainer's Accelerator takes the existing group)
    results, finals = {}, {}
    results["own"], finals["own"] = own_loop(stage, offload)
    results["straight"], finals["straight"] = trainer_run(out / "trainer", stage, offload)
    results["resumed"], finals["resumed"] = trainer_run(out / "resumed", stage, offload,
                                                        resume=str(out / "trainer" / "checkpoint-2"))
    if with_sp:
        results["sp2"], finals["sp2"] = trainer_run(out / "sp2", stage, offload, sp=2)
    torch.save(finals, out / f"final_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
