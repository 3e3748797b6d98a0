"""Accelerate launches the processes and deals the data; this project's engine holds the model and the optimizer.

Accelerate has no plugin interface for another runtime, so the pattern is: `Accelerator()` for the process group,
the device and the prepared dataloader (each process's share of every global batch, moved to its device), and
`zero.initialize` instead of `accelerator.prepare(model, optimizer)` and `engine.backward` / `engine.step` instead
of `accelerator.backward` / `optimizer.step`. Trains the recipe's tiny Llama on its default data (the Python
standard library's source, bytes), so its losses equal `python -m recipes.pretrain` with the same settings.
With `--hf-config` it trains a Hugging Face causal LM of that config.json instead (built as `model=hf` builds it,
moe_lst.models.hf), with tensor, Ulysses sequence, expert and pipeline parallelism (`--tp`, `--sp`, `--ep`, `--pp`)
through the adapter (moe_lst.integrations.hf_parallel); the ranks of a tensor-, sequence-parallel or pipeline group
read the same rows. Under `--pp` a step's `--grad-accum` micro-batches are the pipeline's: stacked into one batch,
they run forward and backward under the 1F1B schedule in one call (hf_parallel.pipeline_loss).

    accelerate launch --cpu --num_processes 2 -m moe_lst.integrations.accelerate_example --stage 3 \\
        --offload cpu --steps 4 --save-every 2 --ckpt-dir runs/acc
    accelerate launch --cpu --num_processes 2 -m moe_lst.integrations.accelerate_example --stage 3 \\
        --offload cpu --steps 4 --resume runs/acc/step_2 --ckpt-dir runs/acc_resumed
    accelerate launch --cpu --num_processes 2 -m moe_lst.integrations.accelerate_example --stage 1 \\
        --hf-config path/to/config.json --tp 2
    accelerate launch --cpu --num_processes 2 -m moe_lst.integrations.accelerate_example --stage 1 \\
        --hf-config path/to/config.json --pp 2 --grad-accum 2

(drop --cpu on GPUs; `torchrun --nproc_per_node 2 -m moe_lst.integrations.accelerate_example ...` works as well).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Run as a file path, this folder would come first on sys.path and its lightning.py / transformers.py would
# shadow those packages (which Accelerate looks up): keep it off the path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from moe_lst.data.build import build_streams  # noqa: E402
from moe_lst.data.streams import BatchSpec, TokenStream  # noqa: E402
from moe_lst.models.llama import ModelConfig, Transformer  # noqa: E402
from torch import nn  # noqa: E402

import zero  # noqa: E402
from zero.parallel.pipeline import Pipeline  # noqa: E402


class StreamRows(torch.utils.data.Dataset):
    """The recipe's training sequences in global order: step, micro-batch, data-parallel rank, row. Batches of
    `micro_batch_size` rows dealt round-robin over the processes (what Accelerate's prepared dataloader does) are
    exactly the recipe's per-rank micro-batches, so the data do not depend on the launcher."""

    def __init__(self, stream: TokenStream, steps: int) -> None:
        self.stream, self.steps = stream, steps

    def __len__(self) -> int:
        return self.steps * self.stream.spec.global_batch

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.stream.spec
        step, within = divmod(g, spec.global_batch)
        block, row = divmod(within, spec.micro_batch_size)  # block = micro * dp + dp_rank
        tokens, labels = self.stream.batch(step, block // spec.dp_size, block % spec.dp_size)
        return tokens[row], labels[row]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage 0-3")
    p.add_argument("--offload", default="none", choices=["none", "cpu"], help="optimizer (and at stage 3 parameters)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-bytes", type=int, default=None, help="read only this much of the corpus (default: all)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every k steps and at the end (0: at the end)")
    p.add_argument("--ckpt-dir", type=Path, default=None)
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint directory this script wrote")
    p.add_argument("--metrics", type=Path, default=None, help="append one JSON line per step (main process)")
    p.add_argument("--hf-config", type=Path, default=None, help="a Hugging Face config.json (or a directory with one)")
    p.add_argument("--save-pretrained", type=Path, default=None,
                   help="with --hf-config: write the trained model there at the end, for transformers' from_pretrained")
    for key, what in (("tp", "tensor"), ("sp", "Ulysses sequence"), ("ep", "expert"), ("pp", "pipeline (1F1B)")):
        p.add_argument(f"--{key}", type=int, default=1, help=f"{what}-parallel degree (with --hf-config)")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace,
                 dims: zero.ParallelDims) -> tuple[zero.Engine, Pipeline | None, nn.Module, list[zero.Plan]]:
    """The recipe's model=tiny (or, with --hf-config, model=hf of that config, parallelised through the adapter),
    AdamW as the recipe's (lr constant), clipping at 1.0; and this rank's pipeline under --pp, the model as built
    and the plans."""
    torch.manual_seed(args.seed)  # the same model on every process
    plans: list[zero.Plan] = []
    if args.hf_config is not None:
        from moe_lst.integrations.hf_parallel import parallelize_hf
        from moe_lst.models.hf import build, load_config

        # (under pp: this rank's stages, the pipeline's micro-batches the step's grad_accum ones)
        built = build(load_config(args.hf_config), sp_group=dims.sequence_group)
        model, plans = parallelize_hf(built, dims, microbatches=args.grad_accum)
    else:
        model = built = Transformer(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                ffn_dim=128, max_seq_len=512))
    config = zero.ZeroConfig(stage=args.stage, grad_accum_steps=args.grad_accum, clip_grad_norm=1.0,
                             offload_optimizer=args.offload, offload_params=args.offload if args.stage == 3 else "none")
    optimizer = zero.FastAdamW(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    pipe = next((plan for plan in plans if isinstance(plan, Pipeline)), None)
    return zero.initialize(model, optimizer, config, dims, plans=plans), pipe, built, plans


def loss_of(engine: zero.Engine, tokens: torch.Tensor, labels: torch.Tensor, dims: zero.ParallelDims,
            hf: bool) -> torch.Tensor:
    """The micro-batch's mean next-token loss (labels: the targets); a Hugging Face model's over its sequence shards
    and vocabulary slices."""
    if not hf:
        return F.cross_entropy(engine(tokens).flatten(0, 1), labels.flatten())
    from moe_lst.integrations.hf_parallel import next_token_loss

    return next_token_loss(engine, tokens, labels, dims, shift=False)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.hf_config is None and (max(args.tp, args.sp, args.ep, args.pp) > 1 or args.save_pretrained):
        raise SystemExit("--tp, --sp, --ep, --pp and --save-pretrained apply with --hf-config (the Llama here trains "
                         "data parallel, and its checkpoints are the whole model)")
    if args.hf_config is not None:  # (refused before the processes join)
        from moe_lst.integrations.hf_parallel import check_layout
        from moe_lst.models.hf import load_config

        check_layout(load_config(args.hf_config), tp=args.tp, ep=args.ep, pp=args.pp, sp=args.sp,
                     microbatches=args.grad_accum)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # joins the launcher's processes (gloo on CPUs)
    dims = zero.ParallelDims(tp=args.tp, sp=args.sp, ep=args.ep, pp=args.pp)  # data parallel over the rest
    engine, pipe, built, plans = build_engine(args, dims)
    spec = BatchSpec(args.micro_batch_size, args.grad_accum, dims.dp, args.seq_len)
    stream, _ = build_streams({"kind": "stdlib", "max_bytes": args.max_bytes}, spec, seed=args.seed, vocab_size=256)
    loader = accelerator.prepare(torch.utils.data.DataLoader(StreamRows(stream, args.steps), spec.micro_batch_size))
    start = 0
    if args.resume is not None:
        start = engine.load_checkpoint(str(args.resume))["step"]  # weights, optimizer, RNG: bit for bit
        accelerator.print(f"resumed from {args.resume} at step {start}")
    if dims.dp == dims.world_size:
        batches = iter(accelerator.skip_first_batches(loader, start * args.grad_accum))
    else:  # (the ranks of a tensor- or sequence-parallel group read their data-parallel rank's rows)
        batches = (tuple(t.to(accelerator.device) for t in stream.batch(step, micro, dims.dp_rank))
                   for step in range(start, args.steps) for micro in range(args.grad_accum))
    for step in range(start, args.steps):
        total = 0.0
        if pipe is not None:  # the step's micro-batches stacked: the pipeline splits them back, in order
            from moe_lst.integrations.hf_parallel import pipeline_loss

            tokens, labels = (torch.cat(t) for t in zip(*(next(batches) for _ in range(args.grad_accum))))
            total = pipeline_loss(pipe, engine, tokens, labels, dims, shift=False).item()
        for _ in range(args.grad_accum if pipe is None else 0):
            tokens, labels = next(batches)  # this process's micro-batch, on its device
            loss = loss_of(engine, tokens, labels, dims, args.hf_config is not None)
            engine.backward(loss)  # scaled by 1/grad_accum; gradients reduced as they are ready
            total += loss.item() / args.grad_accum
        engine.step()
        loss = accelerator.reduce(torch.tensor(total, dtype=torch.float64, device=accelerator.device), "mean").item()
        record = {"step": step + 1, "loss": loss, "grad_norm": engine.global_grad_norm}
        accelerator.print(json.dumps(record))
        if args.metrics is not None and accelerator.is_main_process:
            with open(args.metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
        done = step + 1
        if args.ckpt_dir is not None and ((args.save_every and done % args.save_every == 0) or done == args.steps):
            engine.save_checkpoint(str(args.ckpt_dir / f"step_{done}"), client_state={"step": done})
    if args.save_pretrained is not None:  # (every shard, expert, slice and stage gathered; the first rank writes)
        from moe_lst.integrations.hf_parallel import save_pretrained

        save_pretrained(built, engine, plans, str(args.save_pretrained))
    accelerator.end_training()


if __name__ == "__main__":
    main()
