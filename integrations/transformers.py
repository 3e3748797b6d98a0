"""Hugging Face's Trainer on this project's runtime: `ZeroTrainer` runs backward, the optimizer step and checkpoints
through the ZeRO engine, so `ZeroTrainer(model, args, train_dataset=..., zero_config=zero.ZeroConfig(stage=3,
offload_optimizer="cpu")).train()` trains a transformers model with ZeRO 0-3 and offload, and with Ulysses sequence,
tensor, expert and pipeline parallelism (`sp=`, `tp=`, `ep=`, `pp=`) through moe_lst.models.hf's adapter
(moe_lst.integrations.hf_parallel). Under pp each training step runs the whole batch through the 1F1B schedule.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import transformers
from moe_lst.integrations.factories import class_factory, rebuild_factory
from moe_lst.integrations.hf_parallel import (
    check_layout,
    full_state_dict,
    next_token_loss,
    parallelize_hf,
    pipeline_loss,
    pipeline_microbatches,
    pipeline_of,
    trains_balancing_loss,
)
from torch import nn

import zero
from zero.engine import OptimizerFactory

#: Where a checkpoint directory of the Trainer (checkpoint-N) holds the engine's shards.
ENGINE_DIR = "zero"
IGNORE_INDEX = -100


class EngineOptimizer:
    """What the Trainer's loop steps (`trainer.optimizer`): the engine's step, at the accumulation boundary."""

    def __init__(self, engine: zero.Engine) -> None:
        self.engine = engine
        self.last_lr: list[float] | None = None  # the learning rates of the last step taken

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    def step(self) -> bool:
        engine = self.engine
        if not engine.is_accumulation_boundary:
            raise NotImplementedError(
                f"an optimizer step before {engine.config.grad_accum_steps} micro-batches "
                "(gradient_accumulation_steps) had run backward: a partial accumulation cycle (an epoch whose number "
                "of batches is not a multiple of gradient_accumulation_steps) is not implemented; make the batches "
                "per epoch a multiple")
        self.last_lr = engine.get_lr()
        return engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()


class EngineSchedule:
    """What the Trainer's loop sees as `trainer.lr_scheduler`: the engine steps the schedule itself after each
    applied optimizer step (a skipped fp16 step does not advance it) and saves it in its checkpoints, so the
    loop's own `step()` changes nothing; `get_last_lr()` is the rate of the last step taken."""

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.optimizer.last_lr or self.optimizer.engine.get_lr()

    def state_dict(self) -> dict:
        schedule = self.optimizer.engine.lr_scheduler
        return schedule.state_dict() if schedule is not None else {}


class ZeroTrainer(transformers.Trainer):
    """`transformers.Trainer` whose model is wrapped by `zero.initialize`.

    zero_config: the engine's ZeroConfig (stage, dtype, offload, buckets); `grad_accum_steps` and `clip_grad_norm`
        come from TrainingArguments (gradient_accumulation_steps, max_grad_norm).
    sp, tp, ep, pp: Ulysses sequence-, tensor-, expert-parallel and pipeline degrees (data parallelism takes the
        rest of the processes); any of them > 1 runs the model through moe_lst.models.hf.HFCausalLM (its covered
        model types; tp and pp where the config's plans map, ep for MoE models) with the loss over the whole
        sequences and the vocabulary slices. An MoE model whose config adds transformers' balancing loss
        (output_router_logits, router_aux_loss_coef > 0) runs through the adapter at every layout, one process
        included: the Trainer's own loss adds that term undivided to every micro-batch (its weight would grow with
        gradient_accumulation_steps); the adapter scales it as the next-token loss, whose value is what is logged.
    pp_microbatches: under pp, each training step (one batch of per_device_train_batch_size rows) runs forward and
        backward of this many micro-batches of consecutive rows under the 1F1B schedule (default pp), each loss
        scaled by 1/pp_microbatches; the Trainer's own accumulation is then 1 (gradient_accumulation_steps > 1 is
        refused: accumulate with pp_microbatches and a larger batch). Evaluation runs each batch forward through
        the stages (its loss only: prediction_loss_only; the last batch must split into the micro-batches too).
    optimizer_factory: the engine's optimizer (e.g. zero.FastAdamW(lr=..., weight_decay=0.1)); by default the one
        TrainingArguments name, built over the engine's master shards (uniform weight decay only).
    lr_scheduler_factory: optimizer -> scheduler; by default TrainingArguments' schedule over the run's steps.
    """

    def __init__(self, *args: Any, zero_config: zero.ZeroConfig | None = None, sp: int = 1, tp: int = 1,
                 ep: int = 1, pp: int = 1, pp_microbatches: int | None = None,
                 optimizer_factory: OptimizerFactory | None = None, lr_scheduler_factory: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zero_config = zero_config if zero_config is not None else zero.ZeroConfig()
        self._check_arguments()
        if pp > 1:
            self._check_pipeline(pp, pipeline_microbatches(pp, pp_microbatches))
        # (an MoE model's balancing loss goes through the adapter at one process too: scaled as the recipe's)
        adapted = max(sp, tp, ep, pp) > 1 or trains_balancing_loss(self.model)
        if adapted:
            check_layout(self.model, tp=tp, ep=ep, pp=pp, sp=sp, microbatches=pp_microbatches)
        self.dims = zero.ParallelDims(sp=sp, tp=tp, ep=ep, pp=pp)
        self.optimizer_factory, self.lr_scheduler_factory = optimizer_factory, lr_scheduler_factory
        self.engine: zero.Engine | None = None
        self.sequence_model: nn.Module | None = None  # the adapter (see above); this rank's stages under pp
        self.plans: list[zero.Plan] = []
        if adapted:
            self.sequence_model, self.plans = parallelize_hf(self.model, self.dims, microbatches=pp_microbatches)
        self.pipe = pipeline_of(self.plans)
        if self.lr_scheduler is not None:
            raise TypeError("Trainer(optimizers=(..., scheduler)): pass lr_scheduler_factory=optimizer -> scheduler "
                            "instead; the engine builds the optimizer over its master shards")
        if self.optimizer is not None:  # Trainer(optimizers=(optimizer, None)): its class and hyperparameters
            self.optimizer_factory = self.optimizer_factory or rebuild_factory(self.optimizer)
            self.optimizer = None

    def _check_arguments(self) -> None:
        a = self.args
        if a.fp16 or a.bf16:
            raise ValueError("TrainingArguments(fp16/bf16) turn on autocast; the engine holds the compute dtype: pass "
                             "zero_config=zero.ZeroConfig(dtype='bf16' or 'fp16') and leave fp16/bf16 unset")
        if a.fp16_full_eval or a.bf16_full_eval:
            raise ValueError("TrainingArguments(fp16_full_eval/bf16_full_eval) cast the model's parameters, which are "
                             "the engine's buffers; evaluation runs in the engine's dtype: pass "
                             "zero_config=zero.ZeroConfig(dtype='bf16' or 'fp16') and leave them unset")
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if a.world_size != world:
            raise ValueError(f"the Trainer sees {a.world_size} process(es) of the {world} launched, so it would not "
                             "deal the data over them: on CPUs pass TrainingArguments(use_cpu=True) (Accelerate treats "
                             "processes without accelerators as distributed only then)")
        if a.load_best_model_at_end:
            raise NotImplementedError("load_best_model_at_end is not implemented: checkpoints hold the engine's shards "
                                      "(resume from one with train(resume_from_checkpoint=...))")
        if a.torch_compile:
            raise NotImplementedError("torch_compile is not implemented under ZeroTrainer (the engine's hooks run "
                                      "per module)")
        if self.zero_config.grad_accum_steps not in (1, a.gradient_accumulation_steps):
            raise ValueError(f"ZeroConfig(grad_accum_steps={self.zero_config.grad_accum_steps}) differs from "
                             f"gradient_accumulation_steps={a.gradient_accumulation_steps}: set it in "
                             "TrainingArguments")
        if a.max_grad_norm and self.zero_config.clip_grad_norm not in (None, 0, a.max_grad_norm):
            raise ValueError(f"ZeroConfig(clip_grad_norm={self.zero_config.clip_grad_norm}) differs from "
                             f"max_grad_norm={a.max_grad_norm}: set it in TrainingArguments")

    def _check_pipeline(self, pp: int, microbatches: int) -> None:
        """Under pp the pipeline's micro-batches are the accumulation: one batch per step, split."""
        a = self.args
        if a.gradient_accumulation_steps != 1:
            raise ValueError(f"gradient_accumulation_steps={a.gradient_accumulation_steps} with pp={pp}: under pp "
                             "each batch runs as the pipeline's micro-batches in one step; set "
                             "gradient_accumulation_steps=1 and accumulate with pp_microbatches and a larger "
                             "per_device_train_batch_size")
        for key in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if isinstance(microbatches, int) and microbatches > 0 and getattr(a, key) % microbatches:
                raise ValueError(f"{key}={getattr(a, key)} does not split into pp_microbatches={microbatches}: make "
                                 "it a multiple")

    # ------------------------------------------------------------------ the engine
    def _default_optimizer_factory(self) -> OptimizerFactory:
        """TrainingArguments' optimizer (or Trainer(optimizer_cls_and_kwargs=...)) over the master shards."""
        if self.optimizer_cls_and_kwargs is not None:
            cls, hyper = self.optimizer_cls_and_kwargs
        else:
            cls, hyper = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        decay = set(self.get_decay_parameter_names(self.model))
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        excluded = [n for n in trainable if n not in decay]
        if self.args.weight_decay and excluded:
            raise NotImplementedError(
                f"weight_decay={self.args.weight_decay} skips {len(excluded)} parameters (biases and norms, e.g. "
                f"{excluded[0]!r}), and per-parameter weight decay is not implemented by the engine's flat shards: "
                "set weight_decay=0, or pass optimizer_factory= (e.g. zero.FastAdamW(lr=..., weight_decay=0.1), which "
                "decays every parameter)")
        return class_factory(cls, {**hyper, "weight_decay": self.args.weight_decay})

    def _schedule_factory(self, max_steps: int):
        if self.lr_scheduler_factory is not None:
            return self.lr_scheduler_factory
        a = self.args

        def build(optimizer: torch.optim.Optimizer):
            return transformers.get_scheduler(a.lr_scheduler_type, optimizer=optimizer,
                                              num_warmup_steps=a.get_warmup_steps(max_steps),
                                              num_training_steps=max_steps,
                                              scheduler_specific_kwargs=a.lr_scheduler_kwargs)

        return build

    def _build_engine(self, max_steps: int) -> zero.Engine:
        accum = self.pipe.microbatches if self.pipe is not None else self.args.gradient_accumulation_steps
        config = dataclasses.replace(self.zero_config, grad_accum_steps=accum,
                                     clip_grad_norm=self.args.max_grad_norm or self.zero_config.clip_grad_norm)
        module = self.sequence_model if self.sequence_model is not None else self.model
        return zero.initialize(module, self.optimizer_factory or self._default_optimizer_factory(), config,
                               self.dims, lr_scheduler=self._schedule_factory(max_steps), plans=self.plans)

    def _prepare_for_training(self, max_steps: int, train_dataloader, resume_from_checkpoint: str | None):
        """The Trainer's model/optimizer/scheduler preparation, through the engine: no DDP wrapper (the engine
        reduces), the engine's optimizer and schedule, and its checkpoint when resuming."""
        if self.engine is None:
            self.engine = self._build_engine(max_steps)
        else:  # a later train() call: a fresh schedule over its steps, as the Trainer makes one
            self.engine.lr_scheduler = self._schedule_factory(max_steps)(self.engine.optimizer)
        self.optimizer = EngineOptimizer(self.engine)
        self.lr_scheduler = EngineSchedule(self.optimizer)
        self.model_wrapped = self.model
        # Accelerate learns of the model here, where it is, unwrapped. Otherwise evaluate() / predict() prepare it on
        # first use with model.to(accelerator.device), "cpu:0" under several CPU processes where the parameters are
        # on "cpu": a copy of every parameter, which detaches them from the engine's flat buffers (training then
        # updates buffers the model no longer reads) or, at stage 3, reads their freed storage (SIGSEGV).
        self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        if resume_from_checkpoint is not None:
            self.engine.load_checkpoint(os.path.join(resume_from_checkpoint, ENGINE_DIR))
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    # ------------------------------------------------------------------ one micro-batch
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        if self.pipe is not None:  # the batch's micro-batches, forward and backward, under the schedule
            self._check_unpadded(inputs)
            return pipeline_loss(self.pipe, self.engine, inputs["input_ids"], inputs.get("labels"), self.dims,
                                 inputs.get("position_ids"))
        self.engine.before_forward()
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if not self._loss_is_scaled_for_ga(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        # The loss is already scaled for accumulation (and, over num_items_in_batch, for the devices, whose
        # gradients the engine averages): only the fp16 loss scale is left to apply.
        self.engine.before_backward()
        (loss * self.engine.loss_scale).backward()
        self.engine.after_backward()
        return loss.detach()

    def _loss_is_scaled_for_ga(self, num_items_in_batch) -> bool:
        if self.sequence_model is not None:
            return False  # compute_loss gives the mean over this micro-batch's whole sequences
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        if self.sequence_model is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.pipe is not None:
            raise NotImplementedError(f"compute_loss under pp={self.dims.pp}: the stages run a whole batch through "
                                      "the pipeline's schedule (training_step; prediction_step for evaluation)")
        if return_outputs:
            raise NotImplementedError("outputs through the adapter (sp, tp, ep or pp > 1, or an MoE model's balancing "
                                      "loss) are this rank's sequence shards and vocabulary slices: evaluate with "
                                      "prediction_loss_only=True")
        self._check_unpadded(inputs)
        return next_token_loss(self.sequence_model, inputs["input_ids"], inputs.get("labels"), self.dims,
                               inputs.get("position_ids"))

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """Through the adapter (sp, tp, ep or pp > 1, an MoE model's balancing loss): the loss alone (outputs would be
        sequence shards, vocabulary slices or the last stage's), forward only; under pp through the stages."""
        if self.sequence_model is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            raise NotImplementedError("outputs through the adapter (sp, tp, ep or pp > 1, or an MoE model's balancing "
                                      "loss) are this rank's sequence shards, vocabulary slices or the last stage's: "
                                      "evaluate with prediction_loss_only=True and no compute_metrics")
        model.eval()
        inputs = self._prepare_inputs(inputs)
        self._check_unpadded(inputs)
        with torch.no_grad():
            if self.pipe is not None:  # (the batch's micro-batches forward through the stages)
                loss = pipeline_loss(self.pipe, self.engine, inputs["input_ids"], inputs.get("labels"), self.dims,
                                     inputs.get("position_ids"), training=False)
            else:
                self.engine.before_forward()
                loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    @staticmethod
    def _check_unpadded(inputs: dict[str, Any]) -> None:
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise NotImplementedError("padding (an attention_mask with zeros) is not supported under sp, tp, ep or "
                                      "pp > 1: pack sequences to full length")

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the engine clips the global norm in its step (TrainingArguments.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # known after the engine's step: logged from there

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args: Any, **kwargs: Any) -> None:
        norm = self.engine.global_grad_norm if self.engine is not None else None
        super()._maybe_log_save_evaluate(tr_loss, grad_norm if grad_norm is not None else norm, *args, **kwargs)

    # ------------------------------------------------------------------ data under sequence parallelism
    def get_sp_size(self) -> int:
        return self.dims.sp

    def get_train_dataloader(self):
        return self._dealt_over_data_parallel(super().get_train_dataloader(), "train_dataset")

    def get_eval_dataloader(self, eval_dataset=None):
        return self._dealt_over_data_parallel(super().get_eval_dataloader(eval_dataset), "eval_dataset")

    def _dealt_over_data_parallel(self, loader, what: str):
        if self.dims.dp == self.dims.world_size:
            return loader
        # Ranks of one sequence-parallel, tensor-parallel or pipeline group read the same batches: deal them over the
        # data-parallel ranks only.
        shard = getattr(loader, "batch_sampler", None)
        if not hasattr(shard, "process_index"):
            raise NotImplementedError(f"dp={self.dims.dp} of {self.dims.world_size} processes needs a map-style "
                                      f"{what} (batches dealt over the data-parallel ranks); an iterable dataset is "
                                      "not supported")
        shard.num_processes, shard.process_index = self.dims.dp, self.dims.dp_rank
        return loader

    # ------------------------------------------------------------------ checkpoints: the engine's format
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A checkpoint (the Trainer's own call) holds the engine's shards in `<dir>/zero`; a call of yours writes
        the whole model as save_pretrained does, gathered from the shards (collective: every rank calls it)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        if _internal_call:
            self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))
            return
        state = self.full_state_dict()
        if self.args.should_save:
            self._save(output_dir, state_dict=state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 weights, gathered from the engine's shards, tensor-parallel slices and pipeline
        stages (collective: every rank calls it)."""
        return full_state_dict(self.engine, self.plans)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # in the engine's shards (save_model)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Checked here; loaded once the engine exists (the Trainer's preparation)."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_DIR)):
            raise zero.CheckpointError(f"{resume_from_checkpoint} has no {ENGINE_DIR}/ directory: it was not written "
                                       "by ZeroTrainer, whose checkpoints hold the engine's shards")
