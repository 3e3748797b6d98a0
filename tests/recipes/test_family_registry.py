"""A third model family, registered from this file alone (no edit to recipes/ or models/): a small pre-norm transformer
of its own behind the model contract (zero.contract), its spec (moe_lst.models.spec.FamilySpec) registered as "toy",
and a conf/model yaml in a directory of the test's own, which names the family by import path
(`family: tests.recipes.test_family_registry:toy`) and is found through `hydra.searchpath`. The recipe trains it with
`model=toy` at dp=2 ZeRO-3 and at pp=2, each equal to one process: every step's loss and gradient norm, and the
trained weights consolidated from the checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from moe_lst.kernels.attention import attention
from moe_lst.models.spec import ConfigError, FamilySpec, register
from omegaconf import OmegaConf

import zero
from tests.equivalence import RTOL
from tests.multirank import run_multirank
from zero.contract import AttentionSite, ModelContract

FAMILY = "tests.recipes.test_family_registry:toy"


@dataclass
class ToyConfig:
    """`model.*` of model=toy (its schema: the recipe refuses any other key)."""

    vocab_size: int = 256
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 64


class ToyBlock(nn.Module):
    """Pre-norm attention (a swappable function: the contract's attention site) and a GELU MLP."""

    def __init__(self, cfg: ToyConfig, device=None) -> None:
        super().__init__()
        self.heads = cfg.n_heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim, device=device), nn.LayerNorm(cfg.dim, device=device)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False, device=device)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False, device=device)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim, device=device), nn.GELU(),
                                 nn.Linear(2 * cfg.dim, cfg.dim, device=device))
        self.attn_fn = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # [b, s, 3 * dim] -> three [b, s, heads, head_dim]
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(self.attn_fn(q, k, v, causal=True).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class ToyModel(nn.Module, ModelContract):
    """Learned token and position embeddings, ToyBlocks, a final norm and an untied head."""

    def __init__(self, cfg: ToyConfig, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim, device=device)
        self.layers = nn.ModuleList([ToyBlock(cfg, device) for _ in range(cfg.n_layers)])
        self.norm = nn.LayerNorm(cfg.dim, device=device)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return ToyStage(self, range(len(self.layers)), True, True)(tokens, position_ids)

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]

    def attention_sites(self) -> list[AttentionSite]:
        def site(i: int, layer: ToyBlock) -> AttentionSite:
            return AttentionSite(f"layers.{i}", lambda: layer.attn_fn, lambda fn: setattr(layer, "attn_fn", fn))

        return [site(i, layer) for i, layer in enumerate(self.layers)]

    def mlp_sites(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}.mlp", layer.mlp) for i, layer in enumerate(self.layers)]

    def pipeline_stage(self, layers: range, first: bool, last: bool) -> nn.Module:
        return ToyStage(self, layers, first, last)

    def pipeline_shapes(self, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (*tokens_shape, self.cfg.dim), (*tokens_shape, self.cfg.vocab_size)


class ToyStage(nn.Module, ModelContract):
    """Blocks `layers` of a ToyModel under the model's own parameter names (the embeddings on the first stage, the
    norm and head on the last): token ids or hidden states in, hidden states or logits out."""

    def __init__(self, model: ToyModel, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = model.tok, model.pos
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if last:
            self.norm, self.head = model.norm, model.head

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}", layer) for i, layer in self.layers.items()]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device) if position_ids is None else position_ids
            x = self.tok(x) + self.pos(positions)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x)) if self.last else x


def toy_config(cfg: Any) -> ToyConfig:
    """The ToyConfig of a run's model section (less the key that names the family)."""
    return ToyConfig(**{k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k != "family"})


class ToySpec(FamilySpec):
    """Data and pipeline parallelism at any ZeRO stage; no tensor or expert parallelism."""

    schema = ToyConfig

    def model_config(self, cfg: Any) -> ToyConfig:
        return toy_config(cfg)

    def check_model(self, cfg: Any) -> None:
        m = toy_config(cfg)
        if cfg.train.seq_len > m.max_seq_len:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} does not fit model.max_seq_len={m.max_seq_len}")

    def check_layout(self, cfg: Any) -> None:
        for key in ("tp", "ep", "sp"):
            if cfg.parallel[key] > 1:
                raise ConfigError(f"parallel.{key}={cfg.parallel[key]}: model=toy offers data and pipeline "
                                  "parallelism only")

    def num_layers(self, cfg: Any) -> int:
        return toy_config(cfg).n_layers

    def vocab_size(self, cfg: Any) -> int:
        return toy_config(cfg).vocab_size

    def builds_on_meta(self, cfg: Any) -> bool:
        return False  # (no init_parameter: built whole on every rank; under pp the other stages' weights are dropped)

    def build(self, cfg: Any, dims: zero.ParallelDims, meta: bool) -> nn.Module:
        return ToyModel(toy_config(cfg), device="meta" if meta else None)


register("toy", ToySpec())


def _conf(directory: Path) -> Path:
    """A config directory of the test's own holding model/toy.yaml (the recipe's conf/ stays untouched)."""
    (directory / "model").mkdir(parents=True, exist_ok=True)
    (directory / "model" / "toy.yaml").write_text(f"family: {FAMILY}\ndim: 32\nn_layers: 4\n")
    return directory


def _overrides(conf: Path, run_dir: Path, *extra: str) -> list[str]:
    # (a global batch of 8 sequences: two micro-batches of 4 on one process, one per rank at dp=2, two per step
    # through the pipeline at pp=2)
    return [f"hydra.searchpath=[file://{conf}]", "model=toy", "train.steps=2", "train.seq_len=32",
            "train.micro_batch_size=4", "train.grad_accum=2", "train.eval_batches=0", "train.sample_tokens=0",
            "train.progress=false", "wandb.mode=disabled", "optim.warmup_steps=1", f"run_dir={run_dir}", *extra]


def train_in_process(overrides: list[str]) -> None:
    """`python -m recipes.pretrain <overrides>` on this rank (of a tests.multirank process group, or alone)."""
    from recipes.config import compose_command_line
    from recipes.preempt import StopSignals
    from recipes.pretrain import train

    train(compose_command_line(overrides), StopSignals())


def _records(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from recipes.config import checkpoints

    return zero.consolidate(zero.open_checkpoint(checkpoints(run_dir)[0]))


def _assert_same_run(got: Path, want: Path) -> None:
    a, b = _records(got), _records(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert math.isclose(x[key], y[key], rel_tol=RTOL), f"step {x['step']} {key}: {x[key]} != {y[key]}"
    mine, ref = _weights(got), _weights(want)
    assert mine.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(mine[name].reshape(value.shape), value, rtol=RTOL, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The one-process reference run (ZeRO-0, two micro-batches per step) of model=toy."""
    root = tmp_path_factory.mktemp("toy")
    conf = _conf(root / "conf")
    train_in_process(_overrides(conf, root / "one"))
    return root


def test_the_family_comes_from_its_config_key(runs):
    from moe_lst.models import spec as families

    cfg = OmegaConf.load(runs / "one" / "config.yaml")
    assert cfg.model.family == FAMILY and type(families.get(cfg)) is ToySpec
    assert families.get(cfg).num_params(cfg) == sum(p.numel() for p in ToyModel(ToyConfig()).parameters())
    assert _records(runs / "one")[-1]["loss"] < _records(runs / "one")[0]["loss"]  # (it learns)


@pytest.mark.parametrize("layout", [["zero.stage=3", "train.grad_accum=1"], ["parallel.pp=2", "zero.stage=1"]],
                         ids=["dp2_zero3", "pp2"])
def test_two_processes_equal_one(runs, layout):
    run_dir = runs / "_".join(layout).replace("=", "")
    run_multirank(train_in_process, 2, _overrides(runs / "conf", run_dir, *layout), timeout=300)
    _assert_same_run(run_dir, runs / "one")


def test_an_unknown_family_is_one_line(tmp_path):
    from recipes.config import check_config, compose_command_line

    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "nosuch.yaml").write_text("family: tests.recipes.test_family_registry:nosuch\n")
    with pytest.raises(ConfigError, match="registered no family 'nosuch'.*register\\('nosuch', spec\\)"):
        check_config(compose_command_line([f"hydra.searchpath=[file://{conf}]", "model=nosuch"]))
