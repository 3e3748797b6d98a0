"""Typed, validated configuration of the ZeRO runtime (stage, precision, accumulation, buckets).

Every field is checked at construction so a bad value fails with a message naming the field, the rule
and the fix before any process group or buffer is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, fields

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
WEIGHT_CODECS = ("none", "int8")
GRADIENT_CODECS = ("none", "int8", "int4")


class ConfigError(ValueError):
    """A configuration value that cannot work (a ZeroConfig field, or a recipe key: recipes.config raises this
    class too); the message names the key, the rule and the fix."""


def key_name(keys: Mapping[str, str] | None, owner: str, name: str) -> str:
    """How a refusal names the value `name` of `owner` (a ZeroConfig field, a degree of ParallelDims, an argument of
    OneBitAdam, DiLoCo, MoELayer...): the caller's own key for "<owner>.<name>" in `keys` where it has one (the
    recipe passes recipes.config.RECIPE_KEYS, e.g. ZeroConfig.clip_grad_norm -> optim.grad_clip), else the
    library's name (zero.<field> for a ZeroConfig field). A rule is written once, in the library, and its text
    names whatever the caller calls the value."""
    default = f"zero.{name}" if owner == "ZeroConfig" else name
    return keys.get(f"{owner}.{name}", default) if keys else default


def key_namer(keys: Mapping[str, str] | None, owner: str) -> Callable[[str], str]:
    """key_name for one owner: `name -> the key a refusal prints`."""
    return lambda name: key_name(keys, owner, name)


def int_at_least(key: str, value: object, low: int, why: str = "", error: type[ConfigError] = ConfigError) -> int:
    """`value`, or `error` (a ConfigError, e.g. a LayoutError) unless it is an int (not a bool) >= low; `key` is how
    the text names it, `why` (e.g. " (0: off)") follows the rule."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise error(f"{key}={value!r} must be an integer >= {low}{why}")
    return value


def _number_at_least(key: str, value: object, low: float, strict: bool = False) -> None:
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value > low if strict else value >= low)
    )
    if not ok:
        rule = ">" if strict else ">="
        raise ConfigError(f"{key}={value!r} is invalid: it must be a number {rule} {low}")


@dataclass
class ZeroConfig:
    """How the runtime shards, reduces and steps.

    stage: 0 plain data parallel; 1 optimizer state + fp32 master weights sharded; 2 also gradients
        sharded (reduce-scattered during backward); 3 also parameters sharded (gathered per unit).
    dtype: compute/parameter dtype, "fp32", "bf16" or "fp16" (fp16 uses dynamic loss scaling); the
        master weights and optimizer state are always fp32.
    grad_accum_steps: micro-batches per optimizer step; `backward` scales the loss by 1/grad_accum_steps.
    clip_grad_norm: max global gradient L2 norm; 0 or None disables clipping (the norm is still reported).
    reduce_bucket_size / allgather_bucket_size: elements per flat gradient-reduction / parameter
        all-gather bucket (stages 0-2; stage 3 reduces and gathers one unit at a time).
    overlap_comm: launch gradient reductions asynchronously during backward (stages 2-3) and wait at
        its end; False reduces synchronously as buckets fill.
    prefetch_depth: stage 3, how many units ahead (forward order, reversed in backward) to gather early.
    param_persistence_threshold: stage 3, parameters with at most this many elements stay replicated
        (gathered once after each step) instead of being gathered per unit.
    stage3_unit_classes: stage 3, class names of the modules that form a gather unit; None means the
        children of every nn.ModuleList (e.g. each transformer block). Parameters outside every unit,
        or shared between units, belong to the root unit, which stays gathered from the first forward
        use until the end of backward.
    initial_loss_scale, loss_scale_window, min_loss_scale, loss_scale_hysteresis: fp16 dynamic loss
        scaling; the scale halves after `hysteresis` consecutive overflowing steps and doubles after
        `window` steps without overflow.
    offload_optimizer: where the fp32 master shards and the optimizer state live and the step runs:
        "none" (the device), "cpu" (host memory, pinned on CUDA; ZeRO-Offload) or "nvme" (per-rank files
        under `nvme_path`, streamed through bounded buffers; ZeRO-Infinity). Stages 1-3.
    offload_params: stage 3 only: where each unit's parameter shard waits between uses, "none",
        "cpu" or "nvme" (read just before its all-gather, dropped after).
    nvme_path: directory for the nvme files (required when either offload is "nvme"); each rank writes
        its own files there, removed at exit.
    offload_chunk_size: elements per streamed chunk of the nvme optimizer step (each chunk holds the
        master, the optimizer state and the gradient of that many elements).
    offload_buffer_count: chunks in flight at once (read ahead / being stepped / written behind); the
        resident memory of the nvme step is about buffer_count x chunk_size x (2 + state tensors) x 4 bytes.
    offload_io_threads: background threads doing the file reads and writes.
    offload_delayed_update: offload_optimizer="cpu" only: after `offload_delayed_warmup_steps` ordinary steps,
        step t's host update reaches the device parameters at step t+1, so the host step runs beside the next
        forward and backward (ZeRO-Offload's delayed parameter update). Each gradient is then computed one
        update late (a stale-by-one gradient, as in asynchronous SGD with delay 1). It costs convergence: on
        the tiny recipe model (lr 2e-3, 300 steps) validation loss ended 0.31 higher with a 20-step warm-up
        and 0.14 higher with 100 (docs/gpu_paths.md); off by default, check it on your model. Checkpoints and
        full_state_dict hold the newest (pending update applied) values.
    offload_delayed_warmup_steps: ordinary steps before the delayed update starts (at least 1; the first
        steps, where the parameters move fastest, are not delayed).
    host_mmap_threshold: at stage 3 on a CPU device and with offload_params="nvme", glibc's mmap threshold
        is pinned to this many bytes when the engine is built (process-wide; 0 leaves the allocator alone).
        glibc raises the threshold to the size of each large block it frees, after which the gather/free
        cycle of stage 3 is served from heaps that keep freed pages, and resident memory creeps up step
        after step; a fixed threshold returns every larger block at once. It costs time (fresh pages for
        every large block: 1.3x the step of a 75M MoE on a quiet 2-core CPU, benchmarks/hf_models.md) and
        saves about a third of the peak there; stages 0-2 on a CPU leave the allocator alone.
    release_host_memory: after each backward and each optimizer step, hand the host memory the C allocator
        holds free back to the operating system (glibc's malloc_trim; nothing elsewhere). On a CPU device the
        activations, gathered stage-3 units and gradient buffers of a step are freed into glibc's heaps,
        which keep the pages: resident memory then grows to the sum of what different steps needed. Off by
        default; on a 56M Llama at stage 3 it lowers peak RSS (benchmarks/hf_models.md).
    quantize_weights: stage 3, the codec of the parameter all-gathers ("none" or "int8": ZeRO++'s qwZ): each rank
        sends its shard as int8 with one fp32 scale per `quantize_block` elements (absmax / 127), about 1/4 of fp32's
        bytes and 1/2 of bf16's, and every rank, the shard's owner too, computes forward and backward with the same
        decoded weights. The fp32 masters, the optimizer step, checkpoints and full_state_dict stay exact; only
        the weights a step computes with carry the rounding. Small parameters kept replicated
        (param_persistence_threshold) are gathered exactly.
    quantize_gradients: stages 1-3, the codec of the gradient reduce-scatter ("none", "int8" or "int4": ZeRO++'s
        qgZ, in one hop): each rank encodes its whole gradient, chunk j for rank j, one all-to-all hands rank j
        every rank's chunk j, which it decodes and sums in fp32. int8 sends about 1/4 of fp32's bytes, int4 about
        1/8. Nearest rounding, no error feedback; stage 0 (an all-reduce) is refused.
    quantize_block: elements per quantization block (one fp32 scale each), a multiple of 8.
    hpz_partition_size: stage 3, ZeRO++'s hpZ, set to the devices per node (nodes are blocks of that many
        consecutive global ranks; it must divide the world size): after a unit's forward all-gather each rank keeps a
        secondary copy of its share of the unit's (decoded) parameters among the ranks of its gather group on its
        node, and backward gathers the unit from these copies inside the node instead of from the shards over the
        whole group. Costs that copy per unit from forward to the end of backward; backward computes with exactly
        the forward's values. A group all on one node, or with one rank per node (e.g. expert-data-parallel groups
        when ep ranks fill a node), keeps no copy and gathers as before. 1 (default) is off.
    """

    stage: int = 0
    dtype: str = "fp32"
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    reduce_bucket_size: int = 25_000_000
    allgather_bucket_size: int = 25_000_000
    overlap_comm: bool = True
    prefetch_depth: int = 1
    param_persistence_threshold: int = 0
    stage3_unit_classes: tuple[str, ...] | None = None
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    loss_scale_hysteresis: int = 2
    offload_optimizer: str = "none"
    offload_params: str = "none"
    nvme_path: str | None = None
    offload_chunk_size: int = 1 << 20
    offload_buffer_count: int = 4
    offload_io_threads: int = 2
    offload_delayed_update: bool = False
    offload_delayed_warmup_steps: int = 100
    host_mmap_threshold: int = 1 << 20
    release_host_memory: bool = False
    quantize_weights: str = "none"
    quantize_gradients: str = "none"
    quantize_block: int = 256
    hpz_partition_size: int = 1
    #: How the refusals name the fields (not a field: see key_name); None: zero.<field>.
    keys: InitVar[Mapping[str, str] | None] = None

    def __post_init__(self, keys: Mapping[str, str] | None = None) -> None:
        k = key_namer(keys, "ZeroConfig")
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ConfigError(f"zero.stage={self.stage!r} is invalid: it must be one of 0, 1, 2, 3")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"zero.dtype={self.dtype!r} is invalid: use one of {sorted(_DTYPES)}")
        int_at_least(k("grad_accum_steps"), self.grad_accum_steps, 1)
        if self.clip_grad_norm is not None:
            _number_at_least(k("clip_grad_norm"), self.clip_grad_norm, 0.0)
        int_at_least(k("reduce_bucket_size"), self.reduce_bucket_size, 1)
        int_at_least(k("allgather_bucket_size"), self.allgather_bucket_size, 1)
        if not isinstance(self.overlap_comm, bool):
            raise ConfigError(f"zero.overlap_comm={self.overlap_comm!r} is invalid: it must be true or false")
        int_at_least(k("prefetch_depth"), self.prefetch_depth, 0)
        int_at_least(k("param_persistence_threshold"), self.param_persistence_threshold, 0)
        if self.stage3_unit_classes is not None:
            if isinstance(self.stage3_unit_classes, str):
                self.stage3_unit_classes = (self.stage3_unit_classes,)
            self.stage3_unit_classes = tuple(self.stage3_unit_classes)
            if not self.stage3_unit_classes or not all(isinstance(c, str) for c in self.stage3_unit_classes):
                raise ConfigError(
                    f"zero.stage3_unit_classes={self.stage3_unit_classes!r} is invalid: give a non-empty "
                    "list of module class names (e.g. ['TransformerBlock']) or None for the ModuleList "
                    "children"
                )
        _number_at_least(k("initial_loss_scale"), self.initial_loss_scale, 0.0, strict=True)
        int_at_least(k("loss_scale_window"), self.loss_scale_window, 1)
        _number_at_least(k("min_loss_scale"), self.min_loss_scale, 0.0, strict=True)
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(
                f"zero.min_loss_scale={self.min_loss_scale} exceeds zero.initial_loss_scale="
                f"{self.initial_loss_scale}: the minimum must not be above the starting scale"
            )
        int_at_least(k("loss_scale_hysteresis"), self.loss_scale_hysteresis, 1)
        self._check_offload(k)
        self._check_quantization(k)

    def _check_offload(self, k: Callable[[str], str]) -> None:
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if value not in OFFLOAD_TARGETS:
                raise ConfigError(f"zero.{name}={value!r} is invalid: use one of {list(OFFLOAD_TARGETS)}")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ConfigError(
                f"zero.offload_optimizer={self.offload_optimizer!r} needs zero.stage >= 1 (the offloaded "
                "optimizer steps the rank's shard of the fp32 masters); set zero.stage=1, 2 or 3"
            )
        if self.offload_params != "none" and self.stage != 3:
            raise ConfigError(
                f"zero.offload_params={self.offload_params!r} needs zero.stage=3 (only stage 3 partitions the "
                f"parameters; zero.stage={self.stage}); set zero.stage=3 or zero.offload_params=none"
            )
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ConfigError(
                "zero.nvme_path is missing: nvme offload writes per-rank files there; set it to a directory "
                "on a fast local disk (e.g. zero.nvme_path=/local_nvme)"
            )
        if self.nvme_path is not None and not isinstance(self.nvme_path, str):
            raise ConfigError(f"zero.nvme_path={self.nvme_path!r} is invalid: give a directory path")
        int_at_least(k("offload_chunk_size"), self.offload_chunk_size, 1)
        int_at_least(k("offload_buffer_count"), self.offload_buffer_count, 2)
        int_at_least(k("offload_io_threads"), self.offload_io_threads, 1)
        if not isinstance(self.offload_delayed_update, bool):
            raise ConfigError(f"zero.offload_delayed_update={self.offload_delayed_update!r} is invalid: it must be "
                              "true or false")
        if self.offload_delayed_update and self.offload_optimizer != "cpu":
            raise ConfigError(f"zero.offload_delayed_update=true needs zero.offload_optimizer=cpu (the host step is "
                              f"what it delays; zero.offload_optimizer={self.offload_optimizer!r})")
        int_at_least(k("offload_delayed_warmup_steps"), self.offload_delayed_warmup_steps, 1)
        int_at_least(k("host_mmap_threshold"), self.host_mmap_threshold, 0)

    def _check_quantization(self, k: Callable[[str], str]) -> None:
        if self.quantize_weights not in WEIGHT_CODECS:
            raise ConfigError(f"zero.quantize_weights={self.quantize_weights!r} is invalid: use one of "
                              f"{list(WEIGHT_CODECS)}")
        if self.quantize_gradients not in GRADIENT_CODECS:
            raise ConfigError(f"zero.quantize_gradients={self.quantize_gradients!r} is invalid: use one of "
                              f"{list(GRADIENT_CODECS)}")
        if self.quantize_weights != "none" and self.stage != 3:
            raise ConfigError(f"zero.quantize_weights={self.quantize_weights} needs zero.stage=3 (only stage 3 gathers "
                              f"parameters during forward and backward; zero.stage={self.stage})")
        if self.quantize_gradients != "none" and self.stage == 0:
            raise ConfigError(f"zero.quantize_gradients={self.quantize_gradients} needs zero.stage >= 1 (it replaces the "
                              "reduce-scatter of the sharded stages; stage 0 all-reduces)")
        int_at_least(k("quantize_block"), self.quantize_block, 8)
        if self.quantize_block % 8:
            raise ConfigError(f"zero.quantize_block={self.quantize_block} is invalid: it must be a multiple of 8")
        int_at_least(k("hpz_partition_size"), self.hpz_partition_size, 1)
        if self.hpz_partition_size > 1 and self.stage != 3:
            raise ConfigError(f"zero.hpz_partition_size={self.hpz_partition_size} needs zero.stage=3 (the secondary "
                              f"partition holds stage-3 parameters; zero.stage={self.stage})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def clipping(self) -> bool:
        return bool(self.clip_grad_norm)

    @classmethod
    def from_dict(cls, values: dict) -> ZeroConfig:
        """Build from a plain mapping (e.g. a Hydra node), rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown zero config keys {unknown}: valid keys are {sorted(known)}")
        return cls(**values)
