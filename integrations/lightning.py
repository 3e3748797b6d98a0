"""Lightning on this project's runtime: `ZeroStrategy` trains a LightningModule under the ZeRO engine.

`lightning.Trainer(strategy=ZeroStrategy(zero.ZeroConfig(stage=3)), accelerator="cpu", devices=2)` gives
ZeRO stages 0-3 with cpu/nvme offload, the expert / sequence / tensor parallel plans and the pipeline a module
declares from `configure_model`, and checkpoints in the engine's sharded format (saved, resumed, resharded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities import apply_to_collection
from moe_lst.integrations.factories import rebuild_factory
from torch import nn

import zero
from zero.dist import comm
from zero.engine import OptimizerFactory, ParamInit
from zero.parallel.pipeline import Pipeline

# What Lightning calls the precision each engine dtype gives: compute in the dtype, fp32 masters.
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


class ZeroPrecision(Precision):
    """The engine's precision (`ZeroConfig.dtype`): parameters compute in it and fp32 masters step; under
    fp16 the engine's dynamic loss scale. Backward, clipping and the optimizer step are the engine's."""

    def __init__(self, dtype: str = "fp32") -> None:
        if dtype not in LIGHTNING_PRECISION:
            raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(LIGHTNING_PRECISION)}")
        self.dtype = dtype
        self.precision = LIGHTNING_PRECISION[dtype]
        self.engine: zero.Engine | None = None  # set by ZeroStrategy once the engine exists
        self.pipelined = False  # set by ZeroStrategy under a declared pipeline: its schedule runs backward

    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs meet parameters held in the compute dtype."""
        dtype = zero.ZeroConfig(dtype=self.dtype).torch_dtype
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        if self.pipelined:  # the training_step ran the batch's forward and backward under the schedule
            if tensor.requires_grad:
                raise RuntimeError("under a pipeline the training_step runs the batch through its schedule "
                                   "(moe_lst.integrations.hf_parallel.pipeline_loss), which runs backward, and "
                                   "returns that loss without a graph; it returned a loss with one")
            return
        engine = self.engine
        engine.before_backward()
        # Lightning has divided the loss by accumulate_grad_batches already: only the fp16 loss scale is left.
        (tensor * engine.loss_scale).backward(*args, **kwargs)
        engine.after_backward()

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise NotImplementedError("a training_step that returns None (skipping its backward) is not supported "
                                      "by ZeroStrategy: the engine counts every micro-batch of an accumulation cycle")
        engine = self.engine
        if not engine.is_accumulation_boundary:
            raise NotImplementedError(
                f"an optimizer step before {engine.config.grad_accum_steps} micro-batches (accumulate_grad_batches) "
                "had run backward: a partial accumulation cycle (e.g. an epoch whose number of batches is not a "
                "multiple of accumulate_grad_batches) is not implemented; make the batches per epoch a multiple")
        return engine.step()

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """The engine clips the global norm in its step (Trainer(gradient_clip_val) is its clip_grad_norm)."""


@dataclasses.dataclass
class _Declared:
    module: nn.Module
    plans: list[zero.Plan]
    param_init: ParamInit | None


class ZeroStrategy(DDPStrategy):
    """Data parallel processes (Lightning's launcher or torchrun) training through `zero.initialize`.

    config: the engine's ZeroConfig (stage, dtype, offload, buckets); `grad_accum_steps` and `clip_grad_norm`
        come from Trainer(accumulate_grad_batches=..., gradient_clip_val=...) unless set here to the same value.
    tp, sp, ep, pp: parallel degrees (data parallelism takes the rest of the processes); the module applies the
        parallelism in `configure_model` with `self.trainer.strategy.dims` and declares what it applied with
        `self.trainer.strategy.configure_engine(module, plans=[...])`; for a Hugging Face causal LM,
        `module, plans = moe_lst.integrations.hf_parallel.parallelize_hf(model, self.trainer.strategy.dims,
        microbatches=m)` applies ep, tp, sp and pp through moe_lst.models.hf's adapter (train `module`, its loss
        `hf_parallel.next_token_loss`). Under pp the plans end with the pipeline (`strategy.pipeline`) and
        `module` is this rank's stages: each `training_step` runs its whole batch, split into the pipeline's m
        micro-batches, forward and backward under the 1F1B schedule (`hf_parallel.pipeline_loss(
        strategy.pipeline, strategy.engine, ...)`) and returns that loss (no graph: the backward Lightning then
        calls does nothing); the optimizer step is the engine's. Lightning's own accumulation is then 1
        (accumulate_grad_batches > 1 is refused: the micro-batches are the accumulation). A `validation_step`
        evaluates with `pipeline_loss(..., training=False)` (forward only).
    """

    strategy_name = "zero"

    def __init__(self, config: zero.ZeroConfig | None = None, *, tp: int = 1, sp: int = 1, ep: int = 1, pp: int = 1,
                 accelerator: pl.accelerators.Accelerator | None = None, parallel_devices: list | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, start_method: str = "popen") -> None:
        self.config = config if config is not None else zero.ZeroConfig()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=ZeroPrecision(self.config.dtype),
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._degrees = {"tp": tp, "sp": sp, "ep": ep, "pp": pp}
        self._dims: zero.ParallelDims | None = None
        self._declared: _Declared | None = None
        self._engine: zero.Engine | None = None

    # ------------------------------------------------------------------ what the module sees
    @property
    def dims(self) -> zero.ParallelDims:
        """The parallel layout (every process group); available from the module's `setup`/`configure_model` on."""
        if self._dims is None:
            raise RuntimeError("ZeroStrategy.dims exists once the Trainer has started the processes: use it in "
                               "the module's setup or configure_model hooks")
        return self._dims

    @property
    def engine(self) -> zero.Engine:
        """The engine wrapping the module (after the Trainer's setup)."""
        if self._engine is None:
            raise RuntimeError("ZeroStrategy.engine exists once the Trainer has set up the strategy (on_fit_start on)")
        return self._engine

    def configure_engine(self, module: nn.Module, plans: Sequence[zero.Plan] = (),
                         param_init: ParamInit | None = None) -> None:
        """Declare, from `configure_model`, the module the engine wraps (the one the plans' parameter names are
        relative to; every trainable parameter of the LightningModule must be in it), the plans of the parallelism
        applied to it, in order, and `param_init` for a module built on the meta device (a model implementing the
        model contract brings its own). Without it the engine wraps the whole LightningModule, with no plans."""
        self._declared = _Declared(module, list(plans), param_init)

    @property
    def pipeline(self) -> Pipeline | None:
        """The pipeline the module declared among its plans (under pp), else None."""
        plans = self._declared.plans if self._declared is not None else []
        return next((plan for plan in plans if isinstance(plan, Pipeline)), None)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Ranks that split one sequence (sp) or one layer (tp) read the same rows: the sampler splits over dp.
        return {"num_replicas": self.dims.dp, "rank": self.dims.dp_rank}

    # ------------------------------------------------------------------ Lightning's hooks
    def setup_environment(self) -> None:
        pp, module = self._degrees["pp"], self.lightning_module
        accum = module.trainer.accumulate_grad_batches if module is not None and module._trainer else 1
        if pp > 1 and accum != 1:  # (before the process group and the model exist)
            raise ValueError(f"Trainer(accumulate_grad_batches={accum}) with ZeroStrategy(pp={pp}): under pp each "
                             "training_step runs its batch as the pipeline's micro-batches; set "
                             "accumulate_grad_batches=1 and accumulate with the pipeline's micro-batches (a larger "
                             "batch)")
        super().setup_environment()  # the process group
        self._dims = zero.ParallelDims(**self._degrees)

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        _check_precision_flag(trainer, self.precision_plugin.precision)
        declared = self._declared or _Declared(self.lightning_module, [], None)
        if self._engine is not None and self._engine.module is not declared.module:
            raise RuntimeError("configure_model built a new module after the engine wrapped the previous one; "
                               "return early from configure_model when the model exists (it runs on every fit, "
                               "validate, test and predict)")
        if self._engine is None:
            if any(isinstance(plan, Pipeline) for plan in declared.plans):
                declared.module.to(self.root_device)  # (this rank's stages: the others' weights stay on meta)
            elif not any(p.is_meta for p in declared.module.parameters()):
                self.model_to_device()
            self._engine = self._build_engine(trainer, declared)
            self.precision_plugin.engine = self._engine
        self.optimizers = [self._engine.optimizer]  # the engine steps it; Lightning sees its param_groups
        self.lr_scheduler_configs = []  # a scheduler is the engine's (stepped after each applied step)

    def _build_engine(self, trainer: pl.Trainer, declared: _Declared) -> zero.Engine:
        pipe = next((plan for plan in declared.plans if isinstance(plan, Pipeline)), None)
        if (pipe is not None) != (self.dims.pp > 1):
            raise ValueError(f"ZeroStrategy(pp={self.dims.pp}) but configure_engine declared "
                             f"{'a' if pipe else 'no'} pipeline: under pp declare the stages and plans "
                             "parallelize_hf returns (its last plan is the pipeline), else none")
        _check_covered(self.lightning_module, declared.module, released=pipe is not None)
        returned = call._call_lightning_module_hook(trainer, "configure_optimizers", pl_module=self.lightning_module)
        optimizer, scheduler = optimizer_factories(returned)
        config = _engine_config(self.config, trainer)
        if pipe is not None:  # the pipeline's micro-batches are the engine's accumulation cycle
            config = dataclasses.replace(config, grad_accum_steps=pipe.microbatches)
            self.precision_plugin.pipelined = True
        return zero.initialize(declared.module, optimizer, config, self.dims, lr_scheduler=scheduler,
                               plans=declared.plans, param_init=declared.param_init)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.before_forward()  # counts the step's traffic; at stage 3 gathers the root parameters
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.before_forward()
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.before_forward()
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.before_forward()
        return super().predict_step(*args, **kwargs)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning decides when to step; the engine refuses a step inside a cycle

    def teardown(self) -> None:
        # The engine holds the parameters (sharded, maybe offloaded): nothing is moved back, so validate, test
        # and predict after fit run on the same engine.
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ checkpoints: the engine's format
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its shards

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's shards hold the optimizer state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights are in the engine's shards (fp32 masters), not gathered into one file

    def optimizer_state(self, optimizer: Any) -> dict[str, torch.Tensor]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        """Every rank writes its shard into the directory `filepath`; Lightning's own state (loops, callbacks,
        hyperparameters, the module's on_save_checkpoint additions) rides along as the engine's client state."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy writes the engine's sharded checkpoints itself: storage_options is not used")
        path = _rank0_path(filepath)
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(path, client_state=_plain_hparams(state))

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = _rank0_path(checkpoint_path)
        state = self.engine.load_checkpoint(path)  # under any other layout too (resharded)
        if not state:
            raise zero.CheckpointError(f"{path} holds no Lightning state (it was not written by ZeroStrategy); load "
                                       "it with engine.load_checkpoint in your own loop")
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint restored the weights

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint restored the optimizer state


def _plain_hparams(state: dict[str, Any]) -> dict[str, Any]:
    """Lightning's state with its hyperparameters as plain data, which the engine's shards hold (they hold no
    objects): an OmegaConf container (Lightning keeps those as they are) as its dict or list, unresolved, and the
    type Lightning records beside it by name (Lightning's loader reads a name as a plain dict's)."""
    from omegaconf import Container, OmegaConf

    out = dict(state)
    for prefix in ("", "datamodule_"):
        if isinstance(out.get(f"{prefix}hyper_parameters"), Container):
            out[f"{prefix}hyper_parameters"] = OmegaConf.to_container(out[f"{prefix}hyper_parameters"], resolve=False)
        kind = out.get(f"{prefix}hparams_type")
        if isinstance(kind, type):
            out[f"{prefix}hparams_type"] = f"{kind.__module__}.{kind.__qualname__}"
    return out


def _rank0_path(path: _PATH) -> str:
    """Rank 0's path on every rank (a name with a timestamp may differ between them), through zero.dist.comm."""
    world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    return comm.all_gather_object(str(path), world)[0]


def _check_precision_flag(trainer: pl.Trainer, ours: str) -> None:
    """Trainer(precision=...) cannot override the engine's dtype silently."""
    flag = getattr(getattr(trainer, "_accelerator_connector", None), "_precision_flag", "32-true")
    if flag not in ("32-true", ours):
        raise ValueError(f"Trainer(precision={flag!r}) differs from the engine's ZeroConfig dtype ({ours}): set the "
                         "precision through ZeroStrategy(zero.ZeroConfig(dtype='bf16' | 'fp16' | 'fp32'))")


def _check_covered(root: nn.Module, module: nn.Module, released: bool = False) -> None:
    """Every trainable parameter of `root` is in `module` (`released`: those a pipeline left on the meta device,
    the other ranks' stages, excepted)."""
    inside = {id(p) for p in module.parameters()}
    outside = [n for n, p in root.named_parameters()
               if p.requires_grad and id(p) not in inside and not (released and p.is_meta)]
    if outside:
        raise ValueError(f"{len(outside)} trainable parameters lie outside the module given to configure_engine "
                         f"(first: {outside[0]!r}) and would not be trained: declare a module that holds them all")


def _engine_config(config: zero.ZeroConfig, trainer: pl.Trainer) -> zero.ZeroConfig:
    """The strategy's config with the Trainer's accumulation and clipping (refused when they disagree)."""
    accum = trainer.accumulate_grad_batches
    if config.grad_accum_steps not in (1, accum):
        raise ValueError(f"ZeroConfig(grad_accum_steps={config.grad_accum_steps}) differs from "
                         f"Trainer(accumulate_grad_batches={accum}): set it on the Trainer only")
    clip = trainer.gradient_clip_val
    if clip and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise NotImplementedError("gradient_clip_algorithm='value' is not implemented by the engine; it clips the "
                                  "global norm (gradient_clip_algorithm='norm')")
    if clip and config.clip_grad_norm and clip != config.clip_grad_norm:
        raise ValueError(f"ZeroConfig(clip_grad_norm={config.clip_grad_norm}) differs from "
                         f"Trainer(gradient_clip_val={clip}): set one of them")
    return dataclasses.replace(config, grad_accum_steps=accum, clip_grad_norm=clip or config.clip_grad_norm)


def optimizer_factories(returned: Any) -> tuple[OptimizerFactory, Callable | None]:
    """What `configure_optimizers` returned, as the engine's factories (optimizer, lr scheduler).

    The optimizer may be a built torch optimizer (rebuilt over the engine's master shards from its class and
    hyperparameters; every param group must share them) or a factory (`zero.FastAdamW(...)`,
    `functools.partial(torch.optim.AdamW, ...)`); alone, in a one-element list, or in a dict with
    `"lr_scheduler"`: a factory optimizer -> scheduler (or {"scheduler": factory, "interval": "step"}), stepped
    by the engine after each applied optimizer step and saved in its checkpoints."""
    if isinstance(returned, (list, tuple)):
        if len(returned) != 1:
            raise NotImplementedError(f"configure_optimizers returned {len(returned)} items: the engine steps one "
                                      "optimizer over all parameters; return one optimizer (or a dict)")
        returned = returned[0]
    scheduler = None
    if isinstance(returned, Mapping):
        scheduler = returned.get("lr_scheduler")
        returned = returned.get("optimizer")
        if isinstance(scheduler, Mapping):
            if scheduler.get("interval", "step") != "step":
                raise NotImplementedError("the engine steps a scheduler after each optimizer step: interval='step' "
                                          "only")
            scheduler = scheduler.get("scheduler")
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError("configure_optimizers returned a built lr scheduler; return a factory optimizer -> scheduler "
                        "(e.g. functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=...)): the engine "
                        "builds the optimizer over its master shards")
    if isinstance(returned, torch.optim.Optimizer):
        returned = rebuild_factory(returned)
    if returned is None or not callable(returned):
        raise TypeError(f"configure_optimizers returned {type(returned).__name__}; return a torch optimizer or a "
                        "factory (e.g. zero.FastAdamW(lr=3e-4))")
    return returned, scheduler
