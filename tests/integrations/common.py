"""Shared by the integration tests and the scripts they launch: the recipe's data as other frameworks' datasets,
one training setting for every comparison, launching processes and reading their results."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from moe_lst.models.llama import ModelConfig

from recipes.data import BatchSpec, TokenStream, build_streams

REPO = Path(__file__).resolve().parents[2]

# One setting for every comparison: 2 data-parallel ranks, 2 micro-batches of 4 sequences of 64 bytes per step,
# constant lr (the recipe's schedule with warmup 0 and min_lr_ratio 1), AdamW as the recipe's, clip 1.0; the first
# 2 MB of the standard library's source (the whole of it takes every process ~3 s to read).
SEED, MICRO, ACCUM, SEQ, LR, BETAS, EPS, WD, CLIP = 1234, 4, 2, 64, 2e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
MAX_BYTES = 2_000_000
RECIPE_ARGS = [f"data.max_bytes={MAX_BYTES}", f"train.micro_batch_size={MICRO}", f"train.grad_accum={ACCUM}",
               f"train.seq_len={SEQ}",
               f"train.seed={SEED}", f"optim.lr={LR}", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
               f"optim.weight_decay={WD}", f"optim.grad_clip={CLIP}", "train.eval_batches=0", "train.sample_tokens=0",
               "wandb.mode=disabled"]


def model_config(moe: bool = False) -> ModelConfig:
    """The recipe's model=tiny (moe=False) or model=moe_tiny."""
    from moe_lst.models.llama import MoEConfig

    return ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=512,
                       moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=64) if moe else MoEConfig())


@functools.lru_cache
def train_stream(dp: int, micro: int = MICRO) -> TokenStream:
    """The recipe's training stream for this setting on `dp` data-parallel ranks (stdlib bytes, seed SEED)."""
    data = {"kind": "stdlib", "max_bytes": MAX_BYTES}
    train, _ = build_streams(data, BatchSpec(micro, ACCUM, dp, SEQ), seed=SEED, vocab_size=256)
    return train


class MicroBatches(torch.utils.data.Dataset):
    """Micro-batch i of one data-parallel rank: the recipe's batch(step i // accum, micro i % accum, dp_rank)."""

    def __init__(self, stream: TokenStream, dp_rank: int, count: int) -> None:
        self.stream, self.dp_rank, self.count = stream, dp_rank, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        accum = self.stream.spec.grad_accum
        return self.stream.batch(i // accum, i % accum, self.dp_rank)


class EpochSampler(torch.utils.data.Sampler):
    """Epoch e reads items [e * n, (e + 1) * n): a run resumed at an epoch boundary reads on where it stopped."""

    def __init__(self, per_epoch: int) -> None:
        self.per_epoch, self.epoch = per_epoch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self):
        # A generator: the epoch is read at the first item, so an iterator made before set_epoch (Lightning makes
        # one while setting up the data, before it sets the epoch of a resumed run) still reads the right epoch.
        yield from range(self.epoch * self.per_epoch, (self.epoch + 1) * self.per_epoch)


class HFRows(torch.utils.data.Dataset):
    """The Accelerate example's StreamRows (the recipe's sequences in global order) as a Hugging Face causal LM's
    items: its inputs are its labels (it shifts them itself). Batches of MICRO rows dealt round-robin over the
    ranks (the Trainer's sequential sampler through Accelerate) are the recipe's per-rank batches."""

    def __init__(self, stream: TokenStream, steps: int) -> None:
        from moe_lst.integrations.accelerate_example import StreamRows

        self.rows = StreamRows(stream, steps)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        tokens, _ = self.rows[g]
        return {"input_ids": tokens, "labels": tokens}


def launch(args: list[str], cwd: Path = REPO, timeout: float = 240.0, env: dict | None = None) -> str:
    """Run a command with the repo importable and one thread per process; its stdout (fails with its output)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO),
                TOKENIZERS_PARALLELISM="false", **(env or {}))
    proc = subprocess.run(args, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc.stdout


def torchrun(script_args: list[str], nproc: int = 2, **kw) -> str:
    from tests.multirank import free_port

    return launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_port", str(free_port()), *script_args], **kw)


def recipe_run(run_dir: Path, extra: list[str], steps: int = 4) -> dict[str, list[float]]:
    """`python -m recipes.pretrain` on 2 ranks with this setting (the recipe's train() on the tests' process pool,
    tests.recipes.cli.train_on_ranks: what torchrun's ranks run, without a process start per rank): its per-step
    losses and gradient norms, and the final checkpoint's whole model ("final": fp32 masters, consolidated from the
    shards)."""
    import zero
    from tests.recipes.cli import train_on_ranks

    train_on_ranks(2, [f"train.steps={steps}", f"run_dir={run_dir}", *RECIPE_ARGS, *extra])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    final = zero.consolidate(zero.open_checkpoint(str(run_dir / "checkpoints" / f"step_{steps:07d}")))
    return {"loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics], "final": final}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 0.0,
                      atol: float = 0.0) -> None:
    """The same tensors under the same names: bit for bit, or within the tolerances."""
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=f"{name} differs")
