"""ZeroTrainer on 2 processes under torchrun, set up as `python -m recipes.pretrain model=hf` is in the comparison
test: the Hugging Face model from a save_pretrained directory (the recipe's train.init_from), the recipe's own
per-rank micro-batches (the Accelerate example's StreamRows order) with the recipe's targets over all positions,
AdamW at a constant lr without weight decay, clipping and accumulation as the recipe's. Rank 0 writes the losses
and gradient norms the Trainer logged at each step.

torchrun --nproc_per_node 2 tests/integrations/hf_recipe_run.py PRETRAINED_DIR OUT_DIR
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
from tests.integrations.common import ACCUM, BETAS, CLIP, EPS, LR, MICRO, SEED, train_stream

STEPS = 4


class RecipeRows(torch.utils.data.Dataset):
    """The recipe's sequences in global order (StreamRows), each with the recipe's targets: the next token at every
    position, given as `shift_labels` so the model's loss takes them as they are (no shift, no lost position)."""

    def __init__(self, steps: int) -> None:
        from moe_lst.integrations.accelerate_example import StreamRows

        self.rows = StreamRows(train_stream(2), steps)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        tokens, targets = self.rows[g]
        return {"input_ids": tokens, "labels": targets, "shift_labels": targets}


def main() -> None:
    pretrained, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")  # (the Trainer's Accelerator takes the existing group)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
        weight_decay=0.0, max_grad_norm=CLIP, optim="adamw_torch_fused", lr_scheduler_type="constant",
        train_sampling_strategy="sequential", remove_unused_columns=False, save_strategy="no", logging_steps=1,
        report_to="none", disable_tqdm=True, seed=SEED, use_cpu=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained), dtype=torch.float32)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=RecipeRows(STEPS), zero_config=zero.ZeroConfig(stage=3))
    assert trainer.dims.dp == 2
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)), logged
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps({k: [r[k] for r in logged] for k in ("loss", "grad_norm")}))


if __name__ == "__main__":
    main()
