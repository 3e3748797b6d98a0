"""A 2B-parameter MoE from a Hugging Face checkpoint on 2 ranks: ZeRO-3 with nvme offload, ours against DeepSpeed.

Run by hand (not in the test suite):

    python -m benchmarks.big_model              # the 2.19B Qwen3-MoE-shaped model (minutes; ~40 GB of disk)
    python -m benchmarks.big_model --quick      # a tiny model of the same layout: a smoke run

1. Writes a Hugging Face checkpoint (bf16 safetensors in ~1 GB shards with their index, config.json) of an MoE
   shaped like Qwen3-30B-A3B scaled down to ~2.2B parameters: 128 fine-grained experts, top 8, softmax router
   renormalised over the top k, grouped-query attention, untied 151936-token vocabulary. Qwen3-MoE's
   attention also normalises q and k per head, which the project's Llama has not, so the directory is written as
   `model_type: mixtral` (the same routing and experts; transformers' fused expert layout `mlp.experts.gate_up_proj`
   / `down_proj`): the model the project's Llama imports exactly. Tensors are drawn and written one shard at a
   time: the writer never holds more than a shard.
2. Ours: the recipe itself (`recipes.pretrain.Run`: the Llama MoE built on the meta device, `train.init_from` of
   the directory read per rank slice, ZeRO-3 with `offload_params=nvme` and `offload_optimizer=nvme`), 2 steps on
   2 gloo ranks.
3. DeepSpeed's route for the same directory: `HfDeepSpeedConfig` (ZeRO-3, nvme offload of parameters and optimizer
   state) before `AutoModelForCausalLM.from_pretrained`, so the model is built under `deepspeed.zero.Init`, then
   `deepspeed.initialize` and 2 steps on the same batches; or its failure, in one line.

Per rank: peak RSS (VmHWM: the process's own high-water mark, file-backed pages of mapped checkpoint files
included), that peak when the model was built and loaded, the bytes of its nvme files (largest seen, sampled),
time to the first step (from the rank's start, imports included, to the end of its first step) and the second
step's time. Every process of a run is killed when the machine's available memory falls under --min-available-gb.
The checkpoint and nvme files live in a temporary directory under --work-dir, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

REPO = Path(common.ROOT)
WORLD = 2
#: Qwen3-30B-A3B's layout (fine-grained experts, top 8 of 128, GQA, untied 151936-token vocabulary) at ~2.2B.
SHAPES = {
    "qwen3-moe-2b": {"vocab_size": 151936, "dim": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 4,
                     "num_experts": 128, "top_k": 8, "moe_ffn_dim": 192, "max_seq_len": 4096,
                     "rope_theta": 1000000.0, "norm_eps": 1e-6},
    "quick": {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "num_experts": 8,
              "top_k": 2, "moe_ffn_dim": 32, "max_seq_len": 256, "rope_theta": 1000000.0, "norm_eps": 1e-6},
}
#: DeepSpeed's ops its route loads here: collectives, DeepSpeedCPUAdam, and for nvme offload its async IO (which
#: needs libaio) and pinned-buffer ops.
DEEPSPEED_OPS = (*common.DEEPSPEED_COMM, "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")
ADAMW = {"lr": 1e-5, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


# ---------------------------------------------------------------------------- the checkpoint
def hf_config(s: dict) -> dict:
    """config.json of the checkpoint: a Mixtral (see the module docstring for why not qwen3_moe)."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": s["vocab_size"],
            "hidden_size": s["dim"], "intermediate_size": s["moe_ffn_dim"], "num_hidden_layers": s["n_layers"],
            "num_attention_heads": s["n_heads"], "num_key_value_heads": s["n_kv_heads"],
            "head_dim": s["dim"] // s["n_heads"], "max_position_embeddings": s["max_seq_len"],
            "rope_theta": s["rope_theta"], "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_theta"]},
            "rms_norm_eps": s["norm_eps"], "tie_word_embeddings": False, "hidden_act": "silu",
            "num_local_experts": s["num_experts"], "num_experts_per_tok": s["top_k"], "router_aux_loss_coef": 0.001,
            "output_router_logits": False, "sliding_window": None, "attention_dropout": 0.0,
            "initializer_range": 0.02, "dtype": "bfloat16"}


def tensors(s: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint (name, shape), in file order."""
    d, hd, e, f = s["dim"], s["dim"] // s["n_heads"], s["num_experts"], s["moe_ffn_dim"]
    kv = s["n_kv_heads"] * hd
    out = [("model.embed_tokens.weight", (s["vocab_size"], d))]
    for i in range(s["n_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (d, d)),
                (p + "self_attn.k_proj.weight", (kv, d)), (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, d)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate.weight", (e, d)), (p + "mlp.experts.gate_up_proj", (e, 2 * f, d)),
                (p + "mlp.experts.down_proj", (e, d, f))]
    return out + [("model.norm.weight", (d,)), ("lm_head.weight", (s["vocab_size"], d))]


def n_params(s: dict) -> int:
    return sum(math.prod(shape) for _, shape in tensors(s))


def write_checkpoint(directory: Path, s: dict, shard_bytes: int, seed: int = 0) -> dict:
    """Write the model's config.json, bf16 shards and index into `directory`, one shard in memory at a time:
    norms 1, every other tensor N(0, 0.02) from a generator seeded per tensor."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    specs = tensors(s)
    groups: list[list[tuple[int, str, tuple[int, ...]]]] = [[]]
    size = 0
    for i, (name, shape) in enumerate(specs):
        nbytes = 2 * math.prod(shape)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((i, name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for i, name, shape in group:
            if name.endswith("norm.weight"):
                shard[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                g = torch.Generator().manual_seed(seed * 100003 + i)
                shard[name] = torch.randn(shape, generator=g, dtype=torch.bfloat16).mul_(0.02)
            weight_map[name] = file
            total += shard[name].numel() * 2
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        del shard
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (directory / "config.json").write_text(json.dumps(hf_config(s), indent=1))
    return {"files": len(groups), "bytes": total}


# ---------------------------------------------------------------------------- what each rank measures
class Watch:
    """A rank's watchers (a daemon thread every 0.2 s): the bytes its nvme files take on disk (largest seen), and
    the machine's available memory (under `min_available_mb` the rank exits at once with common.OVER_CAP, saying
    so: the parent then ends the whole run)."""

    def __init__(self, rank: int, nvme_dir: str, prefix: str, min_available_mb: float) -> None:
        self.rank, self.nvme_dir, self.prefix, self.min_available_mb = rank, nvme_dir, prefix, min_available_mb
        self.nvme_bytes = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def disk_bytes(self) -> int:
        total = 0
        for root, _, files in os.walk(self.nvme_dir):
            for f in files:
                if self.prefix in f:
                    try:
                        total += os.stat(os.path.join(root, f)).st_blocks * 512
                    except OSError:  # (removed meanwhile)
                        pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.nvme_bytes = max(self.nvme_bytes, self.disk_bytes())
            if available_mb() < self.min_available_mb:
                print(f"rank {self.rank}: the machine's available memory fell under {self.min_available_mb:.0f} MB "
                      f"at {common.rss_mb():.0f} MB of RSS here: exiting", file=sys.stderr, flush=True)
                os._exit(common.OVER_CAP)
            self._stop.wait(0.2)

    def stop(self) -> int:
        self.nvme_bytes = max(self.nvme_bytes, self.disk_bytes())
        self._stop.set()
        return self.nvme_bytes


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def overrides(s: dict, ckpt: str, run_dir: str, nvme_dir: str, seq_len: int) -> list[str]:
    """The recipe's command line for the run (Hydra overrides)."""
    return ["model=moe_tiny", f"model.vocab_size={s['vocab_size']}", f"model.dim={s['dim']}",
            f"model.n_layers={s['n_layers']}", f"model.n_heads={s['n_heads']}", f"model.n_kv_heads={s['n_kv_heads']}",
            f"model.ffn_dim={s['moe_ffn_dim']}", f"model.max_seq_len={s['max_seq_len']}",
            f"model.rope_theta={s['rope_theta']}", f"model.norm_eps={s['norm_eps']}", "model.tie_embeddings=false",
            f"model.moe.num_experts={s['num_experts']}", f"model.moe.top_k={s['top_k']}",
            f"model.moe.ffn_dim={s['moe_ffn_dim']}",
            "zero.stage=3", "zero.offload_params=nvme", "zero.offload_optimizer=nvme", f"zero.nvme_path={nvme_dir}",
            f"optim.lr={ADAMW['lr']}", f"optim.weight_decay={ADAMW['weight_decay']}",
            f"train.init_from={ckpt}", "train.steps=2", f"train.seq_len={seq_len}", "train.micro_batch_size=1",
            "train.grad_accum=1", "train.eval_every=0", "train.eval_batches=1", "train.ckpt_every=0",
            "train.sample_tokens=0", "train.progress=false", "data.max_bytes=2000000", "wandb.mode=disabled",
            f"run_dir={run_dir}"]


def compose(args: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import recipes.config  # noqa: F401 - registers the typed config sections

    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return hydra_compose("config", overrides=args)


def ours_rank(cli: list[str], nvme_dir: str, min_available_mb: float) -> dict:
    """The recipe on this rank: `recipes.pretrain.Run` builds the model on the meta device and loads
    train.init_from into the engine, then its `train_step` trains 2 steps (the recipe's loop would also write its
    final checkpoint, which is not what this measures); its figures."""
    t0 = time.perf_counter()
    import torch.distributed as dist

    rank = dist.get_rank()
    watch = Watch(rank, nvme_dir, f"rank{rank}-", min_available_mb)
    baseline = common.rss_mb()
    os.chdir(REPO)  # (the stdlib data's cache lives under the repository)
    from recipes.pretrain import Run, train_step

    cfg = compose(cli)
    run = Run(cfg)
    built_s, built_rss = time.perf_counter() - t0, common.peak_rss_mb()
    params_here = sum(p.numel() for p in run.engine.module.parameters())
    times, losses = [], []
    for step in range(cfg.train.steps):
        s0 = time.perf_counter()
        losses.append(train_step(run.engine, run.train_stream, step, cfg, run.dims, run.pipe))
        times.append(time.perf_counter() - s0)
    peak = common.peak_rss_mb()
    nvme = watch.stop()
    run.engine.close()
    run.logger.finish()
    return {"rank": rank, "baseline_rss_mb": baseline, "built_rss_mb": built_rss, "train_peak_rss_mb": peak,
            "peak_rss_mb": peak, "nvme_bytes": nvme, "built_s": built_s, "first_step_s": built_s + times[0],
            "step_s": times[1], "losses": losses, "params_on_rank": params_here}


def _deepspeed_config(nvme_dir: str, largest: int) -> dict:
    buffer = int(math.ceil(largest / 2**20) * 2**20)  # a parameter buffer holds the largest parameter
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False, "buffer_count": 5,
                              "buffer_size": buffer, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False, "buffer_count": 4,
                                  "fast_init": False},
        },
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }


def deepspeed_rank(cli: list[str], ckpt: str, nvme_dir: str, largest: int, min_available_mb: float) -> dict:
    """DeepSpeed's transformers route: HfDeepSpeedConfig, from_pretrained, deepspeed.initialize, 2 steps on the
    batches the recipe's ranks train on."""
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    rank_dir = os.path.join(nvme_dir, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    watch = Watch(rank, rank_dir, "", min_available_mb)
    baseline = common.rss_mb()
    os.chdir(REPO)
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from recipes.data import BatchSpec, build_streams

    cfg = compose(cli)
    t = cfg.train
    stream, _ = build_streams(cfg.data, BatchSpec(t.micro_batch_size, t.grad_accum, WORLD, t.seq_len), t.seed,
                              cfg.model.vocab_size, t.steps, None, False)
    config = _deepspeed_config(rank_dir, largest)
    hf_ds = HfDeepSpeedConfig(config)  # noqa: F841 - kept alive: from_pretrained reads it (zero.Init)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      dist_init_required=False)
    built_s, built_rss = time.perf_counter() - t0, common.peak_rss_mb()
    times, losses = [], []
    for step in range(t.steps):
        s0 = time.perf_counter()
        x, y = stream.batch(step, 0, rank)
        loss = F.cross_entropy(engine(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - s0)
        losses.append(loss.item())
    peak = common.peak_rss_mb()
    nvme = watch.stop()
    engine.destroy()
    return {"rank": rank, "baseline_rss_mb": baseline, "built_rss_mb": built_rss, "train_peak_rss_mb": peak,
            "peak_rss_mb": peak, "nvme_bytes": nvme, "built_s": built_s, "first_step_s": built_s + times[0],
            "step_s": times[1], "losses": losses}


# ---------------------------------------------------------------------------- the run
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model of the same layout (a smoke run)")
    parser.add_argument("--work-dir", default=None,
                        help="where the checkpoint and nvme files go (a temporary directory under it, removed at "
                             "the end; default: the system's temporary directory)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per rank and step")
    parser.add_argument("--shard-mb", type=int, default=1024, help="size of the checkpoint's shards")
    parser.add_argument("--min-available-gb", type=float, default=2.0,
                        help="every process is killed when the machine's available memory falls under this")
    parser.add_argument("--only", choices=("ours", "deepspeed"), default=None, help="run one side only")
    parser.add_argument("--checkpoint", default=None,
                        help="an existing directory this script wrote (same shape) to train from instead of writing "
                             "one; it is kept")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a run may take before it is killed (default 300 quick, 3600 full)")
    parser.add_argument("--json", default=None, help="write the figures here")
    return parser.parse_args(argv)


def checkpoint_for(args: argparse.Namespace, shape: dict, work: Path, timeout: float) -> tuple[Path, dict]:
    """The directory to train from: --checkpoint's, or one written under `work`; said in one line."""
    t0 = time.perf_counter()
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        info = {"files": len(list(ckpt.glob("*.safetensors"))),
                "bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")), "reused": str(ckpt)}
    else:
        ckpt = work / "checkpoint"
        info = common.spawn(write_checkpoint, ckpt, shape, args.shard_mb * 2**20, timeout=timeout)[0]
    total = n_params(shape)
    print(f"checkpoint: {total / 1e9:.3f}B parameters ({4 * total / 2**30:.2f} GiB in fp32), {info['files']} bf16 "
          f"shards, {info['bytes'] / 2**30:.2f} GiB, " + (f"reused from {ckpt}" if args.checkpoint else
                                                          f"written in {time.perf_counter() - t0:.0f} s (one shard "
                                                          "in memory at a time)"), flush=True)
    return ckpt, info


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = SHAPES["quick" if args.quick else "qwen3-moe-2b"]
    fp32 = 4 * n_params(shape)
    largest = max(math.prod(sh) for _, sh in tensors(shape))
    work = Path(tempfile.mkdtemp(prefix="big-model-", dir=args.work_dir))
    min_mb = args.min_available_gb * 1024
    timeout = args.timeout or (300.0 if args.quick else 3600.0)
    out: dict = {"params": n_params(shape), "fp32_bytes": fp32, "shape": shape, "seq_len": args.seq_len}
    try:
        ckpt, out["checkpoint"] = checkpoint_for(args, shape, work, timeout)
        runs = [("ours", ours_rank), ("deepspeed", deepspeed_rank)]
        if args.only:
            runs = [r for r in runs if r[0] == args.only]
        if runs[-1][0] == "deepspeed" and not common.deepspeed_runs("DeepSpeed's route", ops=DEEPSPEED_OPS):
            runs = runs[:-1]
        for name, fn in runs:
            nvme_dir = work / f"nvme-{name}"
            nvme_dir.mkdir()
            cli = overrides(shape, str(ckpt), str(work / f"run-{name}"), str(nvme_dir), args.seq_len)
            extra = (str(ckpt), str(nvme_dir), largest) if name == "deepspeed" else (str(nvme_dir),)
            try:
                ranks = common.spawn(fn, cli, *extra, min_mb, world=WORLD, timeout=timeout,
                                     env={"WANDB_MODE": "disabled"})
            except common.RankFailed as e:  # (OverMemory and RankTimeout too)
                if name == "ours":
                    common.failed("ours", e)
                else:
                    common.peer_failed("DeepSpeed (HfDeepSpeedConfig + from_pretrained, ZeRO-3 nvme)", e)
                out[name] = {"error": common.last_line(e)}
                continue
            finally:
                shutil.rmtree(nvme_dir, ignore_errors=True)
            out[name] = ranks
            report_run(name, ranks, fp32)
        summary(out, fp32)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    common.finish()


def report_run(name: str, ranks: list[dict], fp32: int) -> None:
    rows = [[name, str(r["rank"]), f"{r['train_peak_rss_mb']:.0f}", f"{r['built_rss_mb']:.0f}",
             f"{r['train_peak_rss_mb'] * 2**20 / fp32:.3f}", f"{r['nvme_bytes'] / 2**20:.0f}",
             f"{r['first_step_s']:.1f}", f"{r['step_s']:.1f}", " ".join(f"{x:.4f}" for x in r["losses"])]
            for r in ranks]
    print(common.table(["run", "rank", "peak RSS MB (through 2 steps)", "peak RSS after build+load MB",
                        "peak / fp32 model", "nvme MB", "to first step s", "step 2 s", "losses"], rows), flush=True)


def summary(out: dict, fp32: int) -> None:
    ours, ds = out.get("ours"), out.get("deepspeed")
    if isinstance(ours, list):
        worst = max(r["train_peak_rss_mb"] for r in ours)
        print(f"target peak RSS per rank <= 1/4 of the fp32 model ({fp32 / 4 / 2**20:.0f} MB): "
              f"{common.verdict(worst * 2**20 / fp32, 0.25)}", flush=True)
        common.print_ratio("ours peak RSS / fp32 model size", worst * 2**20 / fp32)
        if isinstance(ds, list):
            ratio = worst / max(r["train_peak_rss_mb"] for r in ds)
            print(f"target ours <= 0.5x DeepSpeed's peak RSS (largest rank each): {common.verdict(ratio, 0.5)}",
                  flush=True)
            common.print_ratio("peak RSS ours / DeepSpeed", ratio)
            common.print_ratio("time to first step ours / DeepSpeed",
                               max(r["first_step_s"] for r in ours) / max(r["first_step_s"] for r in ds))
            common.print_ratio("step time ours / DeepSpeed",
                               max(r["step_s"] for r in ours) / max(r["step_s"] for r in ds))
        elif isinstance(ds, dict):
            print(f"DeepSpeed's route failed: {ds['error']}", flush=True)


if __name__ == "__main__":
    main()
