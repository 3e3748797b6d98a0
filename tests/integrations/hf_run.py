"""Trains a plain transformers LlamaForCausalLM (tiny config) on the recipe's data, 2 processes under torchrun:
the engine's own loop, then ZeroTrainer 4 steps straight (checkpoints every 2), then ZeroTrainer resumed from
checkpoint-2, then (optionally) ZeroTrainer with Ulysses sp=2, tensor parallel tp=2 or pipeline stages pp=2 (1F1B over
each batch's 4 micro-batches, which are the own loop's) through moe_lst.models.hf, each then evaluate().
Rank 0 writes the per-step losses and gradient norms (the Trainer's: what it logged); every rank the final weights of
each run.

With clm=STAGES (e.g. clm=0,2,3), the same processes then run the calls of Transformers' own example
examples/pytorch/language-modeling/run_clm.py, its Trainer a ZeroTrainer, at each ZeRO stage in turn (datasets'
text loader, a byte tokenizer built here), each followed by a new trainer resumed from its checkpoint-2; every
rank writes what it saw (clm/results_rank<r>.json).

torchrun --nproc_per_node 2 tests/integrations/hf_run.py OUT_DIR STAGE OFFLOAD [sp] [tp] [pp] [clm=STAGES]
"""

from __future__ import annotations

import json
import math
import os
import sys
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from moe_lst.integrations.transformers import ZeroTrainer

import zero
from recipes.losses import mean_over_dp
from tests.integrations.common import ACCUM, BETAS, CLIP, EPS, LR, MICRO, SEED, HFRows, train_stream

STEPS = 4
EVAL_ROWS = range(16)  # the rows evaluate() reads after training under sp or pp (2 batches of 8 at dp=1)


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


def trainer_run(out: Path, stage: int, offload: str, resume: str | None = None, sp: int = 1, tp: int = 1,
                pp: int = 1):
    # (under pp the Trainer's accumulation is the pipeline's: a batch of the whole step, split in its micro-batches)
    batch, accum = (MICRO * sp * tp, ACCUM) if pp == 1 else (MICRO * ACCUM * pp, 1)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
        max_steps=STEPS, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
        weight_decay=0.0, max_grad_norm=CLIP, optim="adamw_torch_fused", lr_scheduler_type="linear",
        train_sampling_strategy="sequential", save_strategy="steps", save_steps=2, logging_steps=1,
        report_to="none", disable_tqdm=True, seed=SEED, use_cpu=True)
    dims_dp = dist.get_world_size() // (sp * tp * pp)
    trainer = ZeroTrainer(model=hf_model(), args=args, train_dataset=HFRows(train_stream(2), STEPS),
                          zero_config=zero_config(stage, offload), sp=sp, tp=tp, pp=pp,
                          pp_microbatches=ACCUM * pp if pp > 1 else None)
    assert dims_dp == trainer.dims.dp
    trainer.train(resume_from_checkpoint=resume)
    # what the Trainer logged at each step it ran (logging_steps=1): the loss over every process, the engine's norm
    logged = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    first = 2 if resume else 0
    assert [r["step"] for r in logged][-STEPS + first:] == list(range(first + 1, STEPS + 1)), logged
    logged = logged[-STEPS + first:]
    result = {k: [r[k] for r in logged] for k in ("loss", "grad_norm")}
    final = trainer.full_state_dict()
    if pp > 1 or sp > 1:  # evaluation through the adapter (under pp the stages: batches of 8 rows, each 4
        # micro-batches): the trained model's loss over the first rows, and the same in one forward here
        rows = torch.utils.data.Subset(trainer.train_dataset, EVAL_ROWS)
        result["eval_loss"] = trainer.evaluate(rows)["eval_loss"]
        result["plain_eval_loss"] = plain_loss(final, torch.stack([row["input_ids"] for row in rows]))
    return result, final


def plain_loss(weights: dict[str, torch.Tensor], ids: torch.Tensor) -> float:
    """The loss of the plain model with `weights` over the rows `ids`, in one forward in this process alone."""
    model = hf_model()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


# ---------------------------------------------------------------------------- run_clm.py under ZeroTrainer

CLM_BLOCK, CLM_MICRO, CLM_STEPS, CLM_EVAL_ROWS = 32, 4, 4, 16


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer built here (nothing downloaded): each of the 256 bytes is one token, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=512)


def clm_datasets(data_dir: Path, args: transformers.TrainingArguments, tokenizer) -> tuple:
    """run_clm.py's data: datasets' text loader over local files, tokenized, then grouped into blocks whose labels
    are their inputs (the model shifts them), under `main_process_first` as the example does."""
    from datasets import load_dataset

    files = {"train": str(data_dir / "train.txt"), "validation": str(data_dir / "validation.txt")}
    raw = load_dataset("text", data_files=files, cache_dir=str(data_dir / "cache"))
    columns = list(raw["train"].features)

    def tokenize(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // CLM_BLOCK * CLM_BLOCK
        blocks = {k: [t[i:i + CLM_BLOCK] for i in range(0, total, CLM_BLOCK)] for k, t in joined.items()}
        blocks["labels"] = blocks["input_ids"].copy()
        return blocks

    with args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=columns)
    with args.main_process_first(desc="grouping texts together"):
        blocks = tokenized.map(group_texts, batched=True)
    rows = CLM_MICRO * args.gradient_accumulation_steps * args.world_size * CLM_STEPS  # one epoch of CLM_STEPS
    return blocks["train"].select(range(rows)), blocks["validation"].select(range(CLM_EVAL_ROWS))


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds) -> dict[str, float]:
    """run_clm.py's next-token accuracy (its `evaluate.load("accuracy")`, computed here: nothing downloaded)."""
    preds, labels = eval_preds
    labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
    return {"accuracy": float((preds == labels).mean())}


def run_clm(out: Path, data_dir: Path, stage: int, resume: str | None = None) -> dict:
    """run_clm.py's calls (train with checkpoints and an evaluation every 2 steps, save_model, the train metrics,
    save_state, evaluate, the model card) under ZeroTrainer(zero_config=ZeroConfig(stage)); what this rank saw."""
    args = transformers.TrainingArguments(
        output_dir=str(out), do_train=True, do_eval=True, per_device_train_batch_size=CLM_MICRO,
        per_device_eval_batch_size=CLM_MICRO, gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=LR,
        save_steps=2, eval_strategy="steps", eval_steps=2, logging_steps=1, report_to="none", disable_tqdm=True,
        seed=SEED, use_cpu=True)
    tokenizer = byte_tokenizer()
    train_dataset, eval_dataset = clm_datasets(data_dir, args, tokenizer)
    trainer = ZeroTrainer(model=hf_model(), args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                          processing_class=tokenizer, data_collator=transformers.default_data_collator,
                          compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                          zero_config=zero.ZeroConfig(stage=stage))
    train_result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()  # the whole model (and the tokenizer) in output_dir
    metrics = {**train_result.metrics, "train_samples": len(train_dataset)}
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    metrics = trainer.evaluate()
    metrics["eval_samples"] = len(eval_dataset)
    metrics["perplexity"] = math.exp(metrics["eval_loss"])
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.create_model_card(finetuned_from="tiny-llama", tasks="text-generation")
    history = trainer.state.log_history
    logged = [r for r in history if "loss" in r and "train_loss" not in r]
    return {"steps": [r["step"] for r in logged], "loss": [r["loss"] for r in logged],
            "grad_norm": [r["grad_norm"] for r in logged], "global_step": trainer.state.global_step,
            "engine_steps": trainer.engine.global_steps, "eval": metrics,
            "evals_in_training": [[r["step"], r["eval_loss"]] for r in history if "eval_loss" in r],
            "eval_input_ids": eval_dataset["input_ids"]}


def plain_eval(model_dir: Path, input_ids: list[list[int]]) -> dict[str, float]:
    """The saved model's loss and run_clm.py's accuracy over the evaluation blocks in one forward, in this process
    alone: what evaluate() on 2 processes must give."""
    from safetensors.torch import load_file

    model = hf_model()
    model.load_state_dict(load_file(model_dir / "model.safetensors"))
    ids = torch.tensor(input_ids)
    with torch.no_grad():
        output = model(input_ids=ids, labels=ids)
    accuracy = compute_metrics((output.logits.argmax(-1).numpy(), ids.numpy()))["accuracy"]
    return {"loss": output.loss.item(), "accuracy": accuracy, "tokens": ids[:, 1:].numel()}


def run_clm_stages(out: str, stages: list[int]) -> dict:
    """run_clm.py at each ZeRO stage in turn (each in its own output directory), then a new trainer resumed from
    the stage's checkpoint-2; this rank's results, by "<stage>" and "<stage>_resumed", and "plain_eval": the first
    stage's saved model evaluated in this process alone."""
    out = Path(out)
    if dist.get_rank() == 0:
        source = Path(os.__file__).read_text()  # some of the standard library's source as the corpus
        (out / "data").mkdir(parents=True, exist_ok=True)
        (out / "data" / "train.txt").write_text(source[:4000])
        (out / "data" / "validation.txt").write_text(source[4000:5000])
    dist.barrier()
    results = {}
    for stage in stages:
        results[str(stage)] = run_clm(out / f"stage{stage}", out / "data", stage)
        results[f"{stage}_resumed"] = run_clm(out / f"stage{stage}_resumed", out / "data", stage,
                                              resume=str(out / f"stage{stage}" / "checkpoint-2"))
    eval_ids = [run.pop("eval_input_ids") for run in results.values()][0]
    results["plain_eval"] = plain_eval(out / f"stage{stages[0]}", eval_ids)
    return results


def main() -> None:
    out, stage, offload = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    flags = dict(f.partition("=")[::2] for f in sys.argv[4:])  # sp, clm=STAGES (comma separated)
    dist.init_process_group("gloo")  # (the Trainer's Accelerator takes the existing group)
    results, finals = {}, {}
    results["own"], finals["own"] = own_loop(stage, offload)
    results["straight"], finals["straight"] = trainer_run(out / "trainer", stage, offload)
    results["resumed"], finals["resumed"] = trainer_run(out / "resumed", stage, offload,
                                                        resume=str(out / "trainer" / "checkpoint-2"))
    if "sp" in flags:
        results["sp2"], finals["sp2"] = trainer_run(out / "sp2", stage, offload, sp=2)
    if "tp" in flags:
        results["tp2"], finals["tp2"] = trainer_run(out / "tp2", stage, offload, tp=2)
    if "pp" in flags:
        results["pp2"], finals["pp2"] = trainer_run(out / "pp2", stage, offload, pp=2)
    torch.save(finals, out / f"final_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps(results))
    if flags.get("clm"):
        clm = run_clm_stages(str(out / "clm"), [int(s) for s in flags["clm"].split(",")])
        (out / "clm" / f"results_rank{dist.get_rank()}.json").write_text(json.dumps(clm))


if __name__ == "__main__":
    main()
