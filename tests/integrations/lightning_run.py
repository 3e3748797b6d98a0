"""Trains the project's Llama with lightning.Trainer(strategy=ZeroStrategy(...), devices=2) on the recipe's data:
4 steps straight, then 2 steps saved by ModelCheckpoint and resumed for 2 more. Lightning's launcher starts
the second process (this script again). Rank 0 writes the per-step losses; every rank its final weights.
Optionally (STAGES: fit, validate and test at each ZeRO stage; hf_pp: a plain transformers Llama through the
Hugging Face adapter with pipeline stages, pp=2, against the engine's own loop over it) in the same processes after.

python tests/integrations/lightning_run.py OUT_DIR '{"name": {"stage": 3, "offload": "cpu", "moe": true, "ep": 2,
                                                          "tp": 1, "sp": 1, "meta": false, "micro": 4}, ...}' \
    [STAGES] [hf_pp]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from moe_lst.integrations.lightning import ZeroStrategy
from moe_lst.models.llama import Transformer

import zero
from moe import apply_expert_parallel, update_router_biases
from recipes.losses import logits_loss, mean_over_dp
from sequence_parallel import apply_ulysses, shard_sequence
from tests.integrations.common import (
    ACCUM,
    BETAS,
    CLIP,
    EPS,
    LR,
    MICRO,
    SEED,
    WD,
    EpochSampler,
    MicroBatches,
    model_config,
    train_stream,
)
from zero.parallel.tensor import apply_tensor_parallel

STEPS_PER_EPOCH = 2


class LitLlama(L.LightningModule):
    """The recipe's model, loss and optimizer as a LightningModule; parallelism applied in configure_model."""

    def __init__(self, moe: bool, meta: bool, micro: int) -> None:
        super().__init__()
        self.cfg, self.meta, self.micro = model_config(moe), meta, micro
        self.model: Transformer | None = None
        self.micro_losses: list[float] = []
        self.grad_norms: list[float] = []  # the engine's global norm at each step

    def configure_model(self) -> None:
        if self.model is not None:
            return
        strategy, dims = self.trainer.strategy, self.trainer.strategy.dims
        torch.manual_seed(SEED)  # the recipe's init; a meta-built model is filled by its init_parameter
        self.model = Transformer(self.cfg, device="meta" if self.meta else None)
        plans = [apply_expert_parallel(self.model, dims)] if self.cfg.moe.num_experts else []
        plans.append(apply_tensor_parallel(self.model, dims.tp_group))  # (tp=1: changes nothing)
        apply_ulysses(self.model, dims.sp_group)
        strategy.configure_engine(self.model, plans=plans)

    def training_step(self, batch, batch_idx):
        dims = self.trainer.strategy.dims
        tokens, labels, positions = shard_sequence(*batch, dims.sp_group)
        loss = logits_loss(self.model(tokens, positions), labels, dims)
        self.micro_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        dims = self.trainer.strategy.dims
        tokens, labels, positions = shard_sequence(*batch, dims.sp_group)
        self.log("val_loss", logits_loss(self.model(tokens, positions), labels, dims), sync_dist=True)

    def test_step(self, batch, batch_idx):
        dims = self.trainer.strategy.dims
        tokens, labels, positions = shard_sequence(*batch, dims.sp_group)
        self.log("test_loss", logits_loss(self.model(tokens, positions), labels, dims), sync_dist=True)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.grad_norms.append(self.trainer.strategy.engine.global_grad_norm)
        update_router_biases(self.model, self.trainer.strategy.dims.dp_sp_group)  # (a dense model: nothing)

    def configure_optimizers(self):
        return zero.FastAdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def train_dataloader(self):
        dims = self.trainer.strategy.dims
        count = 2 * STEPS_PER_EPOCH * ACCUM
        stream = train_stream(dims.dp, self.micro)
        return torch.utils.data.DataLoader(MicroBatches(stream, dims.dp_rank, count), batch_size=None,
                                           sampler=EpochSampler(STEPS_PER_EPOCH * ACCUM))


def fit(run: dict, epochs: int, ckpt_dir: Path | None = None, resume: str | None = None) -> tuple[dict, LitLlama]:
    """Train `run` ({"stage", "offload", "moe", "ep", "tp", "sp", "meta", "micro"}) for `epochs`; the per-step global
    losses and gradient norms."""
    offload = run.get("offload", "none")
    config = zero.ZeroConfig(stage=run["stage"], offload_optimizer=offload,
                             offload_params=offload if run["stage"] == 3 else "none")
    strategy = ZeroStrategy(config, tp=run.get("tp", 1), sp=run.get("sp", 1), ep=run.get("ep", 1))
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", save_top_k=-1)] if ckpt_dir else []
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(ckpt_dir),
                        callbacks=callbacks, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP,
                        use_distributed_sampler=False)  # the dataset takes this rank's rows itself
    module = LitLlama(run.get("moe", False), run.get("meta", False), run.get("micro", MICRO))
    trainer.fit(module, ckpt_path=resume)
    micro = module.micro_losses
    steps = [sum(micro[i:i + ACCUM]) / ACCUM for i in range(0, len(micro), ACCUM)]
    return {"loss": [mean_over_dp(s, strategy.dims) for s in steps], "grad_norm": module.grad_norms}, module


def straight_and_resumed(run: dict, out: Path) -> dict:
    """4 steps straight; 2 steps with a checkpoint, resumed for 2 more. Saves every rank's final weights of both."""
    straight, module = fit(run, epochs=2)
    final_straight = module.trainer.strategy.engine.full_state_dict()
    # validate after fit, on the same engine: the first training micro-batches again
    dims = module.trainer.strategy.dims
    rows = MicroBatches(train_stream(dims.dp, run.get("micro", MICRO)), dims.dp_rank, ACCUM)
    straight["val_loss"] = module.trainer.validate(module, torch.utils.data.DataLoader(rows, batch_size=None),
                                                   verbose=False)[0]["val_loss"]
    first, _ = fit(run, epochs=1, ckpt_dir=out / "ckpt")
    resumed, module = fit(run, epochs=2, resume=str(out / "ckpt" / f"step={STEPS_PER_EPOCH}.ckpt"))
    torch.save({"straight": final_straight, "resumed": module.trainer.strategy.engine.full_state_dict()},
               out / f"final_rank{dist.get_rank()}.pt")
    return {"straight": straight, "first": first, "resumed": resumed}


# ---------------------------------------------------------------------------- fit, validate, test at each stage

# rows of the recipe's stream in global order: 4 steps of training, then 2 steps' worth each to validate and test
SWEEP_TRAIN, SWEEP_VAL, SWEEP_TEST = range(0, 64), range(64, 96), range(96, 128)


class LitLlamaRows(LitLlama):
    """LitLlama reading plain batched DataLoaders, which Lightning splits over the data-parallel ranks with its
    DistributedSampler (ZeroStrategy.distributed_sampler_kwargs)."""

    def _rows(self, indices: range) -> torch.utils.data.DataLoader:
        from moe_lst.integrations.accelerate_example import StreamRows

        rows = StreamRows(train_stream(2), len(SWEEP_TRAIN) + len(SWEEP_VAL) + len(SWEEP_TEST))
        return torch.utils.data.DataLoader(torch.utils.data.Subset(rows, indices), batch_size=MICRO)

    def train_dataloader(self):
        return self._rows(SWEEP_TRAIN)

    def val_dataloader(self):
        return self._rows(SWEEP_VAL)

    def test_dataloader(self):
        return self._rows(SWEEP_TEST)


def plain_losses(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """The mean next-token loss of the validation and test rows under `weights`, in this process alone: a plain
    model and one forward over each whole set."""
    model = Transformer(model_config())
    model.load_state_dict(weights)
    loader = LitLlamaRows(moe=False, meta=False, micro=MICRO)._rows
    out = {}
    with torch.no_grad():
        for name, indices in (("val_loss", SWEEP_VAL), ("test_loss", SWEEP_TEST)):
            tokens, labels = (torch.cat(t) for t in zip(*loader(indices)))
            out[name] = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).item()
    return out


def fit_validate_test(stages: list[int], out: Path) -> dict:
    """At each ZeRO stage: fit 4 steps, then trainer.validate and trainer.test on the same engine; the per-step
    losses, gradient norms, validation and test losses, and the same two losses of the trained model evaluated in
    one process. Rank 0 saves each stage's trained model (sweep_stage<k>.pt)."""
    results = {}
    for stage in stages:
        strategy = ZeroStrategy(zero.ZeroConfig(stage=stage))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
        module = LitLlamaRows(moe=False, meta=False, micro=MICRO)
        trainer.fit(module)
        micro = module.micro_losses
        steps = [sum(micro[i:i + ACCUM]) / ACCUM for i in range(0, len(micro), ACCUM)]
        result = {"loss": [mean_over_dp(s, strategy.dims) for s in steps], "grad_norm": module.grad_norms,
                  **trainer.validate(module, verbose=False)[0], **trainer.test(module, verbose=False)[0]}
        weights = strategy.engine.full_state_dict()
        result["plain"] = plain_losses(weights)
        if dist.get_rank() == 0:
            torch.save(weights, out / f"sweep_stage{stage}.pt")
        results[str(stage)] = result
    return results


# ---------------------------------------------------------------------------- a Hugging Face model under pp


class LitHF(L.LightningModule):
    """tests/integrations/hf_run.py's plain transformers Llama through moe_lst.integrations.hf_parallel's adapter at
    the strategy's degrees, trained as hf_run.own_loop trains it (labels the inputs, shifted; AdamW without weight
    decay; the linear schedule). Under pp each training_step (and validation_step, forward only) runs one step's
    batch through the pipeline."""

    def __init__(self, microbatches: int) -> None:
        super().__init__()
        self.microbatches = microbatches
        self.model: torch.nn.Module | None = None
        self.step_losses: list[float] = []
        self.grad_norms: list[float] = []

    def configure_model(self) -> None:
        from moe_lst.integrations.hf_parallel import parallelize_hf

        from tests.integrations.hf_run import hf_model

        if self.model is not None:
            return
        strategy = self.trainer.strategy
        self.hf = hf_model()  # (seeded: the own loop's initial weights)
        self.model, plans = parallelize_hf(self.hf, strategy.dims, microbatches=self.microbatches)
        strategy.configure_engine(self.model, plans=plans)

    def training_step(self, batch, batch_idx):
        from moe_lst.integrations.hf_parallel import next_token_loss, pipeline_loss

        strategy = self.trainer.strategy
        if strategy.pipeline is not None:  # forward and backward of the batch's micro-batches
            loss = pipeline_loss(strategy.pipeline, strategy.engine, batch, None, strategy.dims)
        else:
            loss = next_token_loss(self.model, batch, None, strategy.dims)
        self.step_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        from moe_lst.integrations.hf_parallel import next_token_loss, pipeline_loss

        strategy = self.trainer.strategy
        if strategy.pipeline is not None:  # forward only, through the stages
            loss = pipeline_loss(strategy.pipeline, strategy.engine, batch, None, strategy.dims, training=False)
        else:
            loss = next_token_loss(self.model, batch, None, strategy.dims)
        self.log("val_loss", loss, sync_dist=True)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.grad_norms.append(self.trainer.strategy.engine.global_grad_norm)

    def configure_optimizers(self):
        from tests.integrations.hf_run import schedule

        return {"optimizer": lambda p: torch.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
                                                         fused=True), "lr_scheduler": schedule}

    def train_dataloader(self):
        from tests.integrations.hf_run import STEPS

        # batch i: step i of the own loop, the micro-batches of both of its data-parallel ranks (4 rows each)
        stream = train_stream(2)
        steps = [torch.cat([stream.batch(step, micro, rank)[0] for micro in range(ACCUM) for rank in (0, 1)])
                 for step in range(STEPS)]
        return torch.utils.data.DataLoader(steps, batch_size=None)


def hf_pipeline(out: Path, stage: int = 2) -> dict:
    """LitHF under ZeroStrategy(pp=2) (1F1B over each batch's 4 micro-batches: the own loop's) and the engine's own
    loop over the same model (hf_run.own_loop: dp=2, 2 micro-batches accumulated); per-step losses (of each rank)
    and gradient norms, every rank's final weights of both (the pipeline's gathered over its stages)."""
    from moe_lst.integrations.hf_parallel import full_state_dict

    from tests.integrations.hf_run import own_loop, plain_loss

    strategy = ZeroStrategy(zero.ZeroConfig(stage=stage), pp=2)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        gradient_clip_val=CLIP, use_distributed_sampler=False)  # (every stage reads the batch)
    module = LitHF(microbatches=2 * ACCUM)
    trainer.fit(module)
    # (what each rank's training_step returned: the loss Lightning logs there)
    losses = [None, None]
    dist.all_gather_object(losses, module.step_losses)
    pp = {"loss": losses, "grad_norm": module.grad_norms}
    # validate through the stages after fit: the first step's batch, forward only (16 rows, 4 micro-batches)
    first = torch.utils.data.DataLoader(module.train_dataloader().dataset[:1], batch_size=None)
    pp["val_loss"] = trainer.validate(module, first, verbose=False)[0]["val_loss"]
    final_pp = full_state_dict(strategy.engine, strategy._declared.plans)
    pp["plain_val_loss"] = plain_loss(final_pp, first.dataset[0])  # (the trained model, one forward here)
    own, final_own = own_loop(stage, "none")
    torch.save({"pp2": final_pp, "own": final_own}, out / f"hf_final_rank{dist.get_rank()}.pt")
    return {"pp2": pp, "own": own}


def main() -> None:
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])  # {name: run}
    results = {}
    for name, run in runs.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        results[name] = straight_and_resumed(run, out / name)
    if len(sys.argv) > 3 and sys.argv[3]:  # the stages of fit_validate_test, comma separated; what each rank saw
        sweep = fit_validate_test([int(s) for s in sys.argv[3].split(",")], out)
        (out / f"sweep_rank{dist.get_rank()}.json").write_text(json.dumps(sweep))
    if "hf_pp" in sys.argv[4:]:
        hf = hf_pipeline(out)
        if dist.get_rank() == 0:
            (out / "hf_pp.json").write_text(json.dumps(hf))
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
