"""What tests/integrations/test_composed_loops.py runs on every rank of a tests.multirank pool: a tiny Hugging Face
model of one family (moe_lst.models.hf.coverage.tiny_config) trained by one of the loops (ZeroTrainer, Lightning's
ZeroStrategy, the Accelerate example) at one layout, for a few steps, optionally saved and resumed through the loop's
own checkpoints and exported (ZeroTrainer.save_model); what each run gave comes back from run_tasks.

Every run reads the same global batches: GLOBAL_ROWS rows of SEQ tokens per step, in micro-batches of MICRO_ROWS rows
(data-parallel rank r of dp reads micro-batches r, r + dp, ... of each step), so transformers' balancing loss, computed
per micro-batch, is the same at every layout. Under pp a rank's rows of a step are one batch, split by the pipeline
into micro-batches of MICRO_ROWS rows.
"""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

import zero
from tests.integrations.common import MAX_BYTES

SEQ, MICRO_ROWS, GLOBAL_ROWS, SEED = 16, 2, 8, 1234
LR, BETAS, EPS, CLIP = 1e-2, (0.9, 0.999), 1e-2, 1.0
#: DeepSeek-V3's routing correction bias set in the model before training (zero in a fresh model): other top-2 pairs.
EXPERT_BIAS = (0.0, 0.4, -0.4, 0.3)
BIAS_SUFFIX = "e_score_correction_bias"


def config_dir(root: Path, kind: str) -> Path:
    """A save_pretrained directory of the sweep's tiny config of `kind` (written once, by the caller)."""
    from moe_lst.models.hf.coverage import tiny_config

    directory = root / "configs" / kind
    if not (directory / "config.json").is_file():
        tiny_config(kind, max_position_embeddings=128).save_pretrained(directory)
    return directory


def hf_model(root: Path, kind: str):
    """The tiny model of `kind`, identically initialised on every rank; DeepSeek-V3 with EXPERT_BIAS."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir(root, kind))
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(BIAS_SUFFIX):
                buffer.copy_(torch.tensor(EXPERT_BIAS))
    return model


def rows(steps: int) -> torch.Tensor:
    """Every step's global batch, [steps * GLOBAL_ROWS, SEQ] token ids (the same on every rank)."""
    return torch.randint(0, 256, (steps * GLOBAL_ROWS, SEQ), generator=torch.Generator().manual_seed(SEED))


def degrees(task: dict) -> dict[str, int]:
    return {k: task.get(k, 1) for k in ("tp", "sp", "ep", "pp")}


def data_parallel(task: dict) -> int:
    d = degrees(task)
    return dist.get_world_size() // (d["tp"] * d["sp"] * d["pp"])


def zero_config(task: dict) -> zero.ZeroConfig:
    return zero.ZeroConfig(stage=task.get("stage", 1), dtype=task.get("dtype", "fp32"))


# ---------------------------------------------------------------------------------------------------- the Trainer
class Rows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_args(task: dict, out: Path, steps: int, **extra):
    import transformers

    per_rank = GLOBAL_ROWS // data_parallel(task)
    pp = task.get("pp", 1)
    batch, accum = (per_rank, 1) if pp > 1 else (MICRO_ROWS, per_rank // MICRO_ROWS)
    values = dict(output_dir=str(out), per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                  gradient_accumulation_steps=accum, max_steps=steps, learning_rate=LR, adam_beta1=BETAS[0],
                  adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0, max_grad_norm=CLIP, optim="adamw_torch",
                  lr_scheduler_type="constant", train_sampling_strategy="sequential", save_strategy="no",
                  logging_steps=1, report_to="none", disable_tqdm=True, seed=SEED, use_cpu=True)
    return transformers.TrainingArguments(**{**values, **extra})


def build_trainer(task: dict, root: Path, out: Path, steps: int, **extra):
    from moe_lst.integrations.transformers import ZeroTrainer

    pp = task.get("pp", 1)
    per_rank = GLOBAL_ROWS // data_parallel(task)
    return ZeroTrainer(model=hf_model(root, task["kind"]), args=trainer_args(task, out, steps, **extra),
                       train_dataset=Rows(rows(steps)), zero_config=zero_config(task), **degrees(task),
                       pp_microbatches=per_rank // MICRO_ROWS if pp > 1 else None)


def trainer_run(task: dict, root: Path) -> dict:
    """ZeroTrainer over task["steps"] steps (with "save": checkpoint-2 kept and a second trainer resumed from it for
    the last step; with "export": save_model into <out>/export)."""
    out, steps = root / task["name"], task["steps"]
    save = {"save_strategy": "steps", "save_steps": 2} if task.get("save") else {}
    trainer = build_trainer(task, root, out / "straight", steps, **save)
    trainer.train()
    result = _trainer_logged(trainer, steps)
    result["final"] = trainer.full_state_dict()
    if task.get("export"):
        trainer.save_model(str(out / "export"))
    if task.get("save"):
        resumed = build_trainer(task, root, out / "resumed", steps)
        resumed.train(resume_from_checkpoint=str(out / "straight" / "checkpoint-2"))
        result["resumed"] = _trainer_logged(resumed, steps, first=3)
        result["resumed"]["final"] = resumed.full_state_dict()
    return result


def _trainer_logged(trainer, steps: int, first: int = 1) -> dict:
    """What the Trainer logged at steps first..steps (a resumed Trainer's history holds the checkpoint's steps)."""
    logged = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r][first - 1:]
    assert [r["step"] for r in logged] == list(range(first, steps + 1)), logged
    return {k: [r[k] for r in logged] for k in ("loss", "grad_norm")}


# ------------------------------------------------------------------------------------------------------- Lightning
def _lit_module(task: dict, root: Path):
    import lightning as L

    from recipes.losses import mean_over_dp

    class LitComposed(L.LightningModule):
        """The family's model through hf_parallel.parallelize_hf at the strategy's degrees (at one process too);
        each batch a micro-batch (under pp: the rank's rows of a step, the pipeline's micro-batches)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.micro_losses: list[float] = []
            self.grad_norms: list[float] = []

        def configure_model(self) -> None:
            from moe_lst.integrations.hf_parallel import parallelize_hf

            if self.model is not None:
                return
            strategy = self.trainer.strategy
            self.hf = hf_model(root, task["kind"])
            micro = GLOBAL_ROWS // strategy.dims.dp // MICRO_ROWS if strategy.dims.pp > 1 else None
            self.model, self.plans = parallelize_hf(self.hf, strategy.dims, microbatches=micro)
            strategy.configure_engine(self.model, plans=self.plans)

        def training_step(self, batch, batch_idx):
            from moe_lst.integrations.hf_parallel import next_token_loss, pipeline_loss

            strategy = self.trainer.strategy
            if strategy.pipeline is not None:
                loss = pipeline_loss(strategy.pipeline, strategy.engine, batch, None, strategy.dims)
            else:
                loss = next_token_loss(self.model, batch, None, strategy.dims)
            self.micro_losses.append(loss.item())
            return loss

        def optimizer_step(self, *args, **kwargs):
            super().optimizer_step(*args, **kwargs)
            self.grad_norms.append(self.trainer.strategy.engine.global_grad_norm)

        def train_dataloader(self):
            from tests.integrations.common import EpochSampler

            # one step an epoch: a run resumed from a checkpoint at step k (an epoch boundary) reads on at step k + 1
            # (Lightning restarts the batches of an epoch resumed within it)
            batches = _lit_batches(self.trainer.strategy.dims, task["steps"])
            return torch.utils.data.DataLoader(batches, batch_size=None,
                                               sampler=EpochSampler(len(batches) // task["steps"]))

        def configure_optimizers(self):
            return functools.partial(torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)

        def step_losses(self, accum: int) -> list[float]:
            micro = self.micro_losses
            return [mean_over_dp(sum(micro[i:i + accum]) / accum, self.trainer.strategy.dims)
                    for i in range(0, len(micro), accum)]

    return LitComposed()


def _lit_batches(dims: zero.ParallelDims, steps: int) -> list[torch.Tensor]:
    """This data-parallel rank's batches, in order: its micro-batches of every step (under pp: one batch a step)."""
    ids, dp, out = rows(steps), dims.dp, []
    for step in range(steps):
        block = ids[step * GLOBAL_ROWS:(step + 1) * GLOBAL_ROWS].split(MICRO_ROWS)
        mine = [block[i] for i in range(dims.dp_rank, len(block), dp)]
        out.extend([torch.cat(mine)] if dims.pp > 1 else mine)
    return out


def lightning_fit(task: dict, root: Path, steps: int, ckpt_dir: Path | None = None, resume: str | None = None):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from moe_lst.integrations.lightning import ZeroStrategy

    accum = 1 if task.get("pp", 1) > 1 else GLOBAL_ROWS // data_parallel(task) // MICRO_ROWS
    strategy = ZeroStrategy(zero_config(task), **degrees(task))
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2, save_top_k=-1)] \
        if ckpt_dir else []
    precision = {"fp32": "32-true", "bf16": "bf16-mixed"}[task.get("dtype", "fp32")]
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(ckpt_dir), callbacks=callbacks, accumulate_grad_batches=accum,
                        gradient_clip_val=CLIP, precision=precision, use_distributed_sampler=False)
    module = _lit_module(task, root)
    trainer.fit(module, ckpt_path=resume)
    return module, {"loss": module.step_losses(accum), "grad_norm": module.grad_norms}


def lightning_run(task: dict, root: Path) -> dict:
    from moe_lst.integrations.hf_parallel import full_state_dict, save_pretrained

    out, steps = root / task["name"], task["steps"]
    ckpt = out / "ckpt" if task.get("save") else None
    module, result = lightning_fit(task, root, steps, ckpt_dir=ckpt)
    result["final"] = full_state_dict(module.trainer.strategy.engine, module.plans)
    if task.get("export"):
        save_pretrained(module.hf, module.trainer.strategy.engine, module.plans, str(out / "export"))
    if task.get("save"):
        path = zero.dist.comm.all_gather_object(str(ckpt / "step=2.ckpt"), None)[0]
        resumed, again = lightning_fit(task, root, steps, resume=path)
        again["final"] = full_state_dict(resumed.trainer.strategy.engine, resumed.plans)
        result["resumed"] = again
    return result


# ---------------------------------------------------------------------------------------------- the Accelerate example
def accelerate_run(task: dict, root: Path) -> dict:
    """The example's main() at the task's layout (--stage, --tp/--sp/--ep/--pp, micro-batches of MICRO_ROWS rows, its
    data at SEQ tokens); with "save", a checkpoint at step 2 and a second run resumed from it."""
    import json

    from accelerate.state import PartialState
    from moe_lst.integrations import accelerate_example

    out, steps = root / task["name"], task["steps"]
    dp = data_parallel(task)
    layout = [x for k, v in degrees(task).items() if v > 1 for x in (f"--{k}", str(v))]
    base = ["--steps", str(steps), "--stage", str(task.get("stage", 1)), "--micro-batch-size", str(MICRO_ROWS),
            "--grad-accum", str(GLOBAL_ROWS // dp // MICRO_ROWS), "--seq-len", str(SEQ), "--max-bytes", str(MAX_BYTES),
            "--hf-config", str(config_dir(root, task["kind"])), *layout]

    def run(name: str, *extra: str) -> dict:
        metrics = out / f"{name}.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        # (end_training destroys the process group, which is the pool's here)
        with mock.patch.object(PartialState, "destroy_process_group", lambda self, group=None: None):
            accelerate_example.main([*base, "--ckpt-dir", str(out / name), "--metrics", str(metrics), *extra])
        dist.barrier()
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        final = zero.consolidate(zero.open_checkpoint(str(out / name / f"step_{steps}")))
        return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records], "final": final}

    result = run("straight", *(["--save-every", "2"] if task.get("save") else []),
                 *(["--save-pretrained", str(out / "export")] if task.get("export") else []))
    if task.get("save"):
        result["resumed"] = run("resumed", "--resume", str(out / "straight" / "step_2"))
    return result


LOOPS = {"trainer": trainer_run, "lightning": lightning_run, "accelerate": accelerate_run}


def run_tasks(root: str, tasks: list[dict]) -> dict[str, dict]:
    """Each task ({"name", "loop", "kind", "steps", tp/sp/ep/pp, "stage", "dtype", "save", "export"}) in turn on this
    rank; rank 0's results by name (an exception: its one line, so one failing probe does not hide the others)."""
    results = {}
    for task in tasks:
        try:
            results[task["name"]] = LOOPS[task["loop"]](task, Path(root))
        except Exception as error:  # noqa: BLE001 - reported by the test, per probe
            if dist.get_world_size() > 1:  # (one rank's error would leave the others waiting in a collective)
                raise
            results[task["name"]] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"}
    return results if dist.get_rank() == 0 else {}
