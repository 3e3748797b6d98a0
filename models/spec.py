"""Model families behind one interface. A family (the project's Llama, a Hugging Face causal LM, a model of your
own) is a `FamilySpec`: how it builds its model on the meta device or a real one, checks a run's config against the
layout, loads and saves weights, exports, and what the planner and the recipe's reports read of it.

`register(name, spec)` adds a family; `get(cfg)` is the spec of a run's config. The run names its family with the
key `model.family`: a registered name, or `package.module:name` for a family that a module registers when imported
(so a family of your own needs no edit to this package or to the recipes). A config without the key is the built-in
family whose own block it holds (`model.hf`: the Hugging Face family), else the project's Llama.
The recipe, its config checks, the planner, export and the integrations ask the spec; none branches on the family.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zero
from zero.config import ConfigError, int_at_least

__all__ = ["DEFAULT_FAMILY", "FAMILY_KEY", "ConfigError", "ExportError", "FamilySpec", "check_tiled_mlp",
           "family_name", "get", "positive_int", "register", "registered"]

#: How the families' refusals name the degrees of zero.dist.topology.ParallelDims (zero.config.key_name): the recipe's
#: `parallel.*` keys (recipes.config.RECIPE_KEYS takes them from here).
PARALLEL_KEYS = {f"ParallelDims.{d}": f"parallel.{d}" for d in ("dp", "tp", "pp", "sp", "ep")}
#: The key of the model section that names the run's family.
FAMILY_KEY = "family"
#: The family of a config that names none and that no family claims.
DEFAULT_FAMILY = "llama"
#: The families this package holds, imported (and so registered) when first asked for.
BUILTIN = {"llama": "moe_lst.models.llama.spec", "hf": "moe_lst.models.hf.spec"}
#: The block of the model section by which a config that names no family names a built-in one (conf/model/hf.yaml's
#: `hf`), read without importing the family (the Hugging Face family imports transformers).
BUILTIN_BLOCKS = {"hf": "hf"}


class ExportError(ValueError):
    """A checkpoint or model that cannot be exported (or imported) as asked; the message says why."""


class FamilySpec:
    """What the recipe, its config checks, the planner and export need of one model family. A family subclasses
    it and overrides what it offers; the defaults are what a plain model behind the model contract
    (zero.contract) gets, and every part a family does not offer raises a one-line NotImplementedError naming it.

    `cfg` is always the run's whole config (an OmegaConf DictConfig with the recipe's sections: `model`, `train`,
    `parallel`, `zero`, ...); the family reads its own `model` section and the keys its rules involve. Refusals
    raise `ConfigError` (zero.config's) in one line naming the key, the rule and the fix."""

    #: The name the family is registered under (set by `register`).
    name: str = ""
    #: The dataclass whose fields are the keys of `model.*` (the recipe refuses a key it does not define) when the
    #: model section is plain yaml; None where the section is a typed node of its own.
    schema: type | None = None

    def _missing(self, part: str) -> NotImplementedError:
        return NotImplementedError(f"model family {self.name!r} does not offer {part} (moe_lst.models.spec."
                                   f"FamilySpec.{part}): implement it in its spec to use this")

    # -- the config: the family's rules, before any process group exists ------------------------------------------
    def check_model(self, cfg: Any) -> None:
        """The model's own rules and those it sets the run (sequence length, ep needs experts, tiling, ...)."""

    def check_layout(self, cfg: Any) -> None:
        """The parallel degrees (tp, sp, pp, ep) against this model; the recipe then checks the degrees against
        the processes and, under pp, the pipeline split against `num_layers`."""
        for key in ("tp", "pp"):
            if cfg.parallel[key] > 1:
                raise ConfigError(f"parallel.{key}={cfg.parallel[key]} with model family {self.name!r} is not "
                                  "supported (its spec offers no such layout); use data, sequence and expert "
                                  "parallelism")

    def model_config(self, cfg: Any) -> Any:
        """The family's own config object of the run's model (what its build and weight adapter take)."""
        raise self._missing("model_config(cfg)")

    def num_layers(self, cfg: Any) -> int:
        """The number of repeated blocks (what a pipeline splits)."""
        raise self._missing("num_layers(cfg)")

    def vocab_size(self, cfg: Any) -> int:
        """The vocabulary size the data is drawn from."""
        raise self._missing("vocab_size(cfg)")

    def is_moe(self, cfg: Any) -> bool:
        """Whether the model has MoE layers (the recipe then applies expert parallelism and reports routing)."""
        return self.num_experts(cfg) > 0

    def num_experts(self, cfg: Any) -> int:
        """Routed experts per MoE layer (0 for a dense model): parallel.ep must divide it."""
        return 0

    def moe_layers(self, cfg: Any) -> list[int]:
        """The indices of the blocks that hold an MoE layer (the reports number MoE layers over the whole model)."""
        return []

    def num_params(self, cfg: Any) -> int:
        """Parameters of the full (unsharded) model, a tied weight counted once."""
        model = self.shape_model(cfg, zero.ParallelDims())
        return sum(p.numel() for p in model.parameters())

    def builds_on_meta(self, cfg: Any) -> bool:
        """Whether the recipe builds the model on the meta device (the engine materialises it through the model's
        init_parameter): dense models at stage 3 or under pipeline parallelism, not under tensor parallelism
        (its parameters are slices of what init_parameter fills) nor MoE models (whose experts take their
        values as they are built)."""
        return (cfg.zero.stage == 3 or cfg.parallel.pp > 1) and not self.is_moe(cfg) and cfg.parallel.tp == 1

    # -- the model -------------------------------------------------------------------------------------------------
    def build(self, cfg: Any, dims: zero.ParallelDims, meta: bool) -> nn.Module:
        """The full model before any parallelism, behind the model contract: on the meta device when `meta`
        (buffers, which the engine does not materialise, on this rank's device), else on the CPU with its
        initial values drawn from torch's generator as seeded by the caller."""
        raise self._missing("build(cfg, dims, meta)")

    def shape_model(self, cfg: Any, dims: zero.ParallelDims) -> nn.Module:
        """The full model on the meta device for counting and planning only (the planner's rank model): shapes
        and structure as `build` gives them, nothing it must leave behind for a run (e.g. torch's generator where
        an eager build would leave it, which for a large model costs as much as drawing its values)."""
        return self.build(cfg, dims, meta=True)

    def plans(self, model: nn.Module, dims: zero.ParallelDims) -> list[zero.Plan]:
        """Plans the model itself hands the engine before any parallelism is applied (e.g. a balancing loss
        attached inside it); recipes.parallelize puts them first."""
        return []

    # -- weights -----------------------------------------------------------------------------------------------------
    def init_from(self, cfg: Any, source: str) -> dict[str, torch.Tensor]:
        """The full weights of `source` (train.init_from) for the run's model, by the model's parameter names;
        ConfigError in one line when they are another model's."""
        raise self._missing("init_from(cfg, source)")

    def run_files(self, cfg: Any) -> dict[str, str]:
        """Files (name -> text) the run writes into its run directory beside config.yaml, which export reads."""
        return {}

    def check_exportable(self, run_cfg: Any, run_dir: Path) -> None:
        """Raise ExportError unless a run of this config exports (checked before any checkpoint is read)."""
        raise ExportError(f"{run_dir}: model family {self.name!r} offers no export (moe_lst.models.spec.FamilySpec."
                          "export)")

    def export(self, run_dir: Path, run_cfg: Any, checkpoint: Path, out_dir: str | Path, experts: str,
               consolidate: Callable[[Path], dict[str, torch.Tensor]]) -> Path:
        """Write the checkpoint's model to `out_dir` in the family's published format; `consolidate(checkpoint)` is
        its full flat state dict (verified)."""
        raise self._missing("export(...)")

    # -- the planner -------------------------------------------------------------------------------------------------
    def check_plannable(self, cfg: Any) -> None:
        """Raise NotImplementedError in one line unless recipes.planner models this family's layers."""
        raise NotImplementedError(f"the planner does not model family {self.name!r} (it models the project's Llama's "
                                  "layers: model.family=llama)")


_registry: dict[str, FamilySpec] = {}


def register(name: str, spec: FamilySpec) -> FamilySpec:
    """Register `spec` as family `name` (again: replaced). Returns it."""
    spec.name = name
    _registry[name] = spec
    return spec


def registered() -> dict[str, FamilySpec]:
    """Every family registered so far (the built-in ones once asked for), by name."""
    return dict(_registry)


def _section(cfg: Any) -> Any:
    """The model section of a run's config (or the section itself: a run's config holds `train` too)."""
    return cfg.model if "train" in cfg.keys() else cfg


def family_name(cfg: Any) -> str:
    """The family a config names (model.family), the built-in one whose block it holds, else the default."""
    model = _section(cfg)
    keys = list(model.keys())  # (not `in`: on a structured config it answers a missing key through an exception)
    if FAMILY_KEY in keys and model[FAMILY_KEY]:
        return str(model[FAMILY_KEY])
    return next((name for block, name in BUILTIN_BLOCKS.items() if block in keys), DEFAULT_FAMILY)


def _lookup(name: str) -> FamilySpec:
    if name in _registry:
        return _registry[name]
    if name in BUILTIN:
        importlib.import_module(BUILTIN[name])  # (it registers itself)
        return _registry[name]
    module, _, registered_as = name.partition(":")
    try:
        importlib.import_module(module)
    except ImportError as e:
        if not registered_as:
            raise ConfigError(f"model.{FAMILY_KEY}={name!r} is not a registered model family ({', '.join(BUILTIN)} or "
                              f"a family registered with moe_lst.models.spec.register; one of your own as "
                              f"model.{FAMILY_KEY}=<package.module>:<name>): {e}") from None
        raise ConfigError(f"model.{FAMILY_KEY}={name!r}: module {module} cannot be imported ({e})") from None
    found = _registry.get(registered_as or name)
    if found is None:
        raise ConfigError(f"model.{FAMILY_KEY}={name!r}: importing {module} registered no family "
                          f"{registered_as or name!r} (it registers {', '.join(_registry) or 'none'}); it must call "
                          f"moe_lst.models.spec.register({(registered_as or name)!r}, spec)")
    _registry[name] = found
    return found


def get(cfg: Any) -> FamilySpec:
    """The spec of the family a run's config (or its model section) names; ConfigError in one line for an unknown
    family."""
    return _lookup(family_name(cfg))


# -- small rules several families share ------------------------------------------------------------------------------
def positive_int(cfg: Any, key: str, minimum: int = 1) -> int:
    """The config's integer at the dotted `key`, refused in one line unless it is >= `minimum` (zero.config's rule)."""
    from omegaconf import OmegaConf

    return int_at_least(key, OmegaConf.select(cfg, key), minimum)


def check_tiled_mlp(cfg: Any, dense_mlps: int, model: str) -> None:
    """train.tiled_mlp tiles the dense MLPs only (MoE layers stay whole: their router statistics are per sequence),
    so a model whose every feed-forward is MoE would tile nothing: refused. `dense_mlps`: its dense MLP layers;
    `model`: how the message names it."""
    if cfg.train.tiled_mlp and not dense_mlps:
        raise ConfigError(f"train.tiled_mlp={cfg.train.tiled_mlp}: {model} has no dense MLP to tile (its MoE layers "
                          "are not tiled: their router statistics are per sequence); set train.tiled_mlp=0")
