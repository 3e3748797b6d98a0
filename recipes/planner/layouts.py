"""Layouts as config overrides: the world a config runs on, and every layout of N devices for the search."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from recipes.config import ConfigError, check_config, is_moe


def resolve_world(cfg: DictConfig, world: int | None) -> DictConfig:
    """A copy of `cfg` whose parallel.dp is a number: what `world` processes leave after tp x pp x sp x cp (world
    None: dp must already be a number, or auto means 1)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    par = cfg.parallel
    others = par.tp * par.pp * par.sp * par.get("cp", 1)
    if world is None:
        world = others * (1 if par.dp in (None, "auto") else par.dp)
    if par.dp in (None, "auto"):
        if world % others:
            raise ConfigError(f"tp x pp x sp x cp = {others} does not divide the {world} devices")
        par.dp = world // others
    elif par.dp * others != world:
        raise ConfigError(f"parallel.dp={par.dp} x tp x pp x sp x cp = {par.dp * others} is not the {world} devices")
    return cfg


@contextlib.contextmanager
def world_env(cfg: DictConfig) -> Iterator[None]:
    """WORLD_SIZE as torchrun would set it for this layout (its degrees multiplied; an unset dp counts as 1) while
    the recipe's own checks read it."""
    par = cfg.parallel
    dp = par.dp if isinstance(par.dp, int) and not isinstance(par.dp, bool) else 1
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(par.get("replicas", 1) * dp * par.tp * par.pp * par.sp * par.get("cp", 1))
    try:
        yield
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_overrides(cfg: DictConfig, world: int, max_pp: int = 8) -> Iterator[dict]:
    """Every layout of `world` devices worth trying: degrees, ZeRO stage, offload, schedule, checkpointing."""
    moe = is_moe(cfg)
    for tp, pp, sp, cp in itertools.product(*[_divisors(world)] * 4):
        if world % (tp * pp * sp * cp) or pp > max_pp or (cp > 1 and pp > 1):
            continue  # (ring attention is not wired with pp: the recipe refuses it)
        dp = world // (tp * pp * sp * cp)
        for ep in (_divisors(dp * cp * sp) if moe else [1]):
            for stage, offload, ckpt in itertools.product((0, 1, 2, 3), ("none", "cpu"), (False, True)):
                if offload != "none" and stage == 0:
                    continue
                for schedule in (("1f1b", "interleaved_1f1b", "zbv") if pp > 1 else ("1f1b",)):
                    yield {"parallel.tp": tp, "parallel.pp": pp, "parallel.sp": sp, "parallel.cp": cp,
                           "parallel.ep": ep, "parallel.dp": dp, "parallel.pp_schedule": schedule,
                           "zero.stage": stage, "zero.offload_optimizer": offload,
                           "train.activation_checkpointing": ckpt}


def apply_overrides(cfg: DictConfig, overrides: dict) -> DictConfig:
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def valid(cfg: DictConfig) -> str | None:
    """Why the recipe refuses this layout (its own checks), or None."""
    try:
        with world_env(cfg):
            check_config(cfg)
    except (ConfigError, ValueError) as e:
        return str(e)
    return None
