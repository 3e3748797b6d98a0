"""The measurements of benchmarks/gpu_check.sh on one CUDA GPU: MoE layer vs its GEMM bound (and DeepSpeed),
Ulysses attention at sp=1 vs plain SDPA, block-sparse attention (FlexAttention) against its PyTorch path and
against SDPA, and a recipe run's tokens/s and MFU.

Each subcommand prints its figures and appends them to --results. `--smoke` shrinks every size so that
the code paths run in seconds on a CPU (`--device cpu --dtype float32 --smoke`); its figures mean nothing.
`--quick` (no subcommand) runs every part that way, the recipe on its tiny model: the CPU smoke run of
this script.

    python benchmarks/gpu_check.py --quick
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import runpy
import signal
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402

# Dense (no sparsity) bf16 tensor-core peak by GPU name, from NVIDIA's data sheets (half the
# "with sparsity" figure). First match wins, so the PCIe / NVL variants precede their family.
PEAK_BF16_FLOPS = (("H100 PCIE", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12),
                   ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
TOP_K = 2
# (tokens, dim, ffn, experts): a few wide experts (Mixtral-like) and many narrow ones (DeepSeek-like).
MOE_CASES = ((16384, 2048, 4096, 8), (16384, 2048, 1024, 64))
MOE_SMOKE = ((256, 64, 128, 4),)
# (batch, seq, heads, kv_heads, head_dim): multi-head and grouped-query attention at a long sequence.
ATTN_CASES = ((1, 32768, 16, 16, 128), (1, 32768, 16, 4, 128))
ATTN_SMOKE = ((1, 256, 4, 4, 16), (1, 256, 4, 2, 16))

_results: Path | None = None
_json: Path | None = None  # the machine-readable figures (--json), one flat object


class _TimeLimit(BaseException):
    """SIGTERM from `timeout`: not an Exception, so the recipe's handlers let it through to our report."""


def emit(line: str = "") -> None:
    """A figure: to stdout and appended to the results file."""
    print(line, flush=True)
    if _results is not None:
        with _results.open("a") as f:
            f.write(line + "\n")


def record(**values) -> None:
    """Machine-readable figures: merged into the --json file (a flat object) when one is given."""
    if _json is None:
        return
    data = json.loads(_json.read_text()) if _json.exists() else {}
    data.update(values)
    _json.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s or None, GPU name); $GPU_PEAK_FLOPS overrides the table."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    if os.environ.get("GPU_PEAK_FLOPS"):
        return float(os.environ["GPU_PEAK_FLOPS"]), name
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name.upper()), None), name


def mfu_text(flops_per_s: float, peak: float | None) -> str:
    return f"{100 * flops_per_s / peak:.1f}%" if peak else "unknown peak"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of fn() in seconds, the device synchronised around every call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- env
def cmd_env(args) -> None:
    device = torch.device(args.device)
    emit(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    peak, name = peak_flops(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        emit(f"GPU: {name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}, "
             f"dense bf16 peak {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown peak'}")
    for dist in ("flash-attn", "deepspeed", "triton"):
        emit(f"{dist}: {_version(dist) or 'not installed'}")
    if _json is not None:  # the first part of a check: a fresh file
        _json.write_text("{}\n")
        record(gpu=name, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch=torch.__version__,
               cuda=torch.version.cuda, peak_bf16_flops=peak, smoke=bool(args.smoke))


# ---------------------------------------------------------------------------- MoE layer
def moe_flops(tokens: int, dim: int, ffn: int, experts: int) -> int:
    """Matmul FLOPs of one GELU MoE layer's forward (two expert GEMMs per token-slot + the router), x3 for
    forward+backward."""
    return 3 * (2 * 2 * tokens * TOP_K * dim * ffn + 2 * tokens * dim * experts)


def gemm_rate(tokens: int, dim: int, ffn: int, experts: int, device, dtype, warmup: int, iters: int) -> float:
    """FLOP/s of the expert GEMMs at perfect balance as batched dense GEMMs ([E, T*k/E, ...] @ [E, ...]):
    the forward pair and the four backward ones (input and weight gradients)."""
    m = max(1, tokens * TOP_K // experts)

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    x, w1, h, w2, gy, gh = r(experts, m, dim), r(experts, dim, ffn), r(experts, m, ffn), r(experts, ffn, dim), \
        r(experts, m, dim), r(experts, m, ffn)

    def run() -> None:
        torch.bmm(x, w1)
        torch.bmm(h, w2)
        torch.bmm(gy, w2.transpose(1, 2))  # d h
        torch.bmm(h.transpose(1, 2), gy)  # d w2
        torch.bmm(gh, w1.transpose(1, 2))  # d x
        torch.bmm(x.transpose(1, 2), gh)  # d w1

    return experts * 6 * 2 * m * dim * ffn / median_time(run, device, warmup, iters)


def _deepspeed_moe(dim: int, ffn: int, experts: int, device, dtype):
    backend = "nccl" if device.type == "cuda" else "gloo"
    return common.deepspeed_moe(dim, ffn, experts, TOP_K, backend).to(device, dtype)


def _moe_step(layer, x: torch.Tensor, g: torch.Tensor, deepspeed: bool):
    def step() -> None:
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        out = layer(x)
        if deepspeed:  # (y, aux loss, counts): its aux loss is returned; ours rides on the output
            y, aux, _ = out
            torch.autograd.backward([y, aux], [g, torch.full_like(aux, 1e-2)])
        else:
            out.backward(g)

    return step


def _moe_layer(name: str, dim: int, ffn: int, experts: int, device, dtype):
    """"ours" (local_path auto: the device path on CUDA, the host path on a CPU), "ours (<path> path)" (that
    path explicitly) or "deepspeed"."""
    from moe import MoELayer

    with torch.device(device):  # weights made and initialised on the device
        if name == "deepspeed":
            return _deepspeed_moe(dim, ffn, experts, device, dtype).to(dtype)
        path = name.split("(")[1].split()[0] if "(" in name else "auto"
        return MoELayer(dim, ffn, experts, top_k=TOP_K, activation="gelu", local_path=path).to(dtype)


def _moe_row(name: str, case: tuple, bound: float, device, dtype, warmup: int, iters: int) -> None:
    tokens, dim, ffn, experts = case
    flops = moe_flops(tokens, dim, ffn, experts)
    peak, _ = peak_flops(device)
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    layer = None
    try:
        layer = _moe_layer(name, dim, ffn, experts, device, dtype)
        t = median_time(_moe_step(layer, x, g, name == "deepspeed"), device, warmup, iters)
    except Exception as e:  # noqa: BLE001 - a failing peer is a result, not the end of the check
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        emit(f"| {tokens} | {dim} | {ffn} | {experts} | {name} | failed: {why} | | | |")
        return
    finally:
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    emit(f"| {tokens} | {dim} | {ffn} | {experts} | {name} | {t * 1e3:.2f} | {flops / t / 1e12:.1f} | "
         f"{t / bound:.2f} | {mfu_text(flops / t, peak)} |")
    common.print_ratio(f"MoE {tokens} tokens x {experts} experts, {name} time / GEMM bound", t / bound)
    key = {"ours": "", "ours (host path)": "_host", "ours (device path)": "_device"}.get(name, "_deepspeed")
    record(**{f"moe_e{experts}{key}_over_bound": round(t / bound, 4), f"moe_e{experts}{key}_ms": t * 1e3})


def cmd_moe(args) -> None:
    from moe.experts import grouped_mm_supported

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    peak, _ = peak_flops(device)
    warmup, iters = (1, 2) if args.smoke else (3, 10)
    have_ds = common.deepspeed_runs("DeepSpeed MoE")
    other = "ours (host path)" if device.type == "cuda" else "ours (device path)"
    emit(f"MoE layer fwd+bwd on {device.type}, {args.dtype}, top-{TOP_K}, GELU experts; ours dropless (its default "
         f"path here: {'device' if device.type == 'cuda' else 'host'}; then {other}), DeepSpeed capacity 1.25; "
         f"median of {iters} passes after {warmup} warm-up")
    emit("| tokens | dim | ffn | E | impl | ms | TFLOP/s | time / bound | MFU |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for case in MOE_SMOKE if args.smoke else MOE_CASES:
        tokens, dim, ffn, experts = case
        rate = gemm_rate(tokens, dim, ffn, experts, device, dtype, warmup, iters)
        bound = moe_flops(tokens, dim, ffn, experts) / rate
        for name in ("ours", other, *(("deepspeed",) if have_ds else ())):
            _moe_row(name, case, bound, device, dtype, warmup, iters)
        emit(f"| {tokens} | {dim} | {ffn} | {experts} | GEMM bound (batched bmm) | "
             f"{bound * 1e3:.2f} | {rate / 1e12:.1f} | 1.00 | {mfu_text(rate, peak)} |")
    path = "torch._grouped_mm" if grouped_mm_supported(device, dtype, dim, ffn) else "a per-expert loop"
    emit(f"expert GEMMs ran as: {path}; DeepSpeed: {_version('deepspeed') or 'not installed'}")


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor ops that read values on the host (each a device-to-host synchronisation on a GPU)."""

    NAMES = {"tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "bincount",
             "nonzero", "masked_select", "unique"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        bool_index = name == "__getitem__" and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool
        self.count += name in self.NAMES or bool_index or (
            name == "repeat_interleave" and "output_size" not in kwargs and len(args) > 1
            and isinstance(args[1], torch.Tensor))
        return func(*args, **kwargs)


def _profile_moe(layer, x, g, device, passes: int):
    """(profiler key averages, device-to-host copies, synchronising runtime calls) over `passes` fwd+bwd."""
    from torch.profiler import ProfilerActivity, profile

    step = _moe_step(layer, x, g, False)
    step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(passes):
            step()
        _sync(device)
    events = prof.events()
    d2h = sum(1 for e in events if "DtoH" in e.name or "Device -> Pageable" in e.name or "Device -> Pinned" in e.name)
    syncs = sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                "cudaEventSynchronize"))
    return prof.key_averages(), d2h, syncs - 1  # the one _sync after the passes is ours


def cmd_moe_profile(args) -> None:
    """The device path of the MoE layer profiled: its top kernels by time and the device-to-host syncs per pass."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokens, dim, ffn, experts = MOE_SMOKE[0] if args.smoke else MOE_CASES[1]
    passes = 2 if args.smoke else 3
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    for path in ("device", "host"):
        layer = _moe_layer(f"ours ({path} path)", dim, ffn, experts, device, dtype)
        with _HostReads() as reads:
            layer(x)
        averages, d2h, syncs = _profile_moe(layer, x, g, device, passes)
        time_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        top = sorted((a for a in averages if getattr(a, time_key, 0) > 0), key=lambda a: -getattr(a, time_key))
        total = sum(getattr(a, time_key) for a in top) or 1.0
        emit(f"MoE {path} path, {tokens} tokens x {experts} experts (ffn {ffn}), {args.dtype}, {passes} fwd+bwd: "
             f"host-reading ops in forward {reads.count}; per pass {d2h / passes:.1f} device-to-host copies, "
             f"{max(syncs, 0) / passes:.1f} synchronising CUDA calls")
        emit(f"| top {'kernels' if device.type == 'cuda' else 'ops'} by self time | calls | ms per pass | share |")
        emit("|---|---|---|---|")
        for a in top[:10]:
            emit(f"| {a.key[:90]} | {a.count // passes} | {getattr(a, time_key) / passes / 1e3:.3f} | "
                 f"{getattr(a, time_key) / total:.1%} |")
        record(**{f"moe_{path}_forward_host_reads": reads.count, f"moe_{path}_d2h_per_pass": d2h / passes,
                  f"moe_{path}_syncs_per_pass": max(syncs, 0) / passes})
        del layer


# ---------------------------------------------------------------------------- Ulysses attention
def attention_times(ours, b: int, s: int, h: int, hkv: int, d: int, device, dtype, warmup: int,
                    iters: int) -> dict[str, float]:
    """Median fwd+bwd seconds of `ours` on [b, s, heads, d] and of SDPA on the same data as [b, heads, s, d]."""
    import torch.nn.functional as F
    from moe_lst.kernels.attention import flash_available

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v, grad_out = leaf(b, s, h, d), leaf(b, s, hkv, d), leaf(b, s, hkv, d), leaf(b, s, h, d).detach()
    # [b, s, heads, d] -> [b, heads, s, d], the layout SDPA takes, made before the clock starts
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    grad_out_t = grad_out.transpose(1, 2)

    def run_ours() -> None:
        q.grad = k.grad = v.grad = None
        ours(q, k, v, causal=True).backward(grad_out)

    def run_sdpa() -> None:
        qt.grad = kt.grad = vt.grad = None
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=h != hkv).backward(grad_out_t)

    return {"sdpa": median_time(run_sdpa, device, warmup, iters), "ours": median_time(run_ours, device, warmup, iters),
            "flash": flash_available(q)}


def cmd_ulysses(args) -> None:
    from sequence_parallel import UlyssesAttention

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    peak, _ = peak_flops(device)
    warmup, iters = (1, 2) if args.smoke else (3, 10)
    ours = UlyssesAttention(None)  # sp=1 (one process): the wrapper's checks around moe_lst.kernels.attention
    emit(f"Attention fwd+bwd on {device.type}, {args.dtype}, causal: UlyssesAttention(None) (sp=1) around "
         "moe_lst.kernels.attention vs F.scaled_dot_product_attention; "
         f"median of {iters} passes after {warmup} warm-up")
    emit("| batch | seq | heads | kv heads | head_dim | impl | ms | TFLOP/s | ours / sdpa | MFU |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for b, s, h, hkv, d in ATTN_SMOKE if args.smoke else ATTN_CASES:
        # Causal: half the 4*b*s^2*h*d of QK^T and PV forward; backward does 2.5x the forward.
        flops = 3.5 * 2 * b * s * s * h * d
        times = attention_times(ours, b, s, h, hkv, d, device, dtype, warmup, iters)
        rows = ((f"ours ({'flash-attn' if times['flash'] else 'SDPA'})", times["ours"],
                 f"{times['ours'] / times['sdpa']:.2f}"), ("plain SDPA", times["sdpa"], "1.00"))
        for label, t, ratio in rows:
            emit(f"| {b} | {s} | {h} | {hkv} | {d} | {label} | {t * 1e3:.2f} | {flops / t / 1e12:.1f} | {ratio} | "
                 f"{mfu_text(flops / t, peak)} |")
        common.print_ratio(f"attention seq {s} heads {h}/{hkv}, ours / SDPA time", times["ours"] / times["sdpa"])
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- sparse attention
SPARSE_CASES = (16384, 32768)  # sequence lengths; batch 1, 16 heads, 4 kv heads, head_dim 128
SPARSE_SMOKE = (512,)


def cmd_sparse(args) -> None:
    """The block-sparse CUDA path (FlexAttention) against the PyTorch path, then its speed against SDPA."""
    from moe_lst.kernels.sparse import SparseConfig, block_layout, block_sparse_attention, cpu_block_sparse_attention

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    warmup, iters = (1, 2) if args.smoke else (2, 5)
    # 1. agreement with the CPU path: fp32, 2048 tokens, GQA, ragged last block
    s, h, hkv, d = (200, 4, 2, 16) if args.smoke else (2000, 8, 2, 64)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(1, s, n, d, generator=gen) for n in (h, hkv, hkv, h))
    emit(f"Block-sparse attention on {device.type} vs the PyTorch (CPU) path, fp32, seq {s}, heads {h}/{hkv}:")
    for name in ("fixed", "bigbird", "sliding_window"):
        layout = block_layout(SparseConfig(layout=name, block_size=64, window_blocks=2, global_blocks=1), s, True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = cpu_block_sparse_attention(*leaves, layout, d ** -0.5)
        ref_grads = torch.autograd.grad(ref, leaves, g)
        dev = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = block_sparse_attention(*dev, layout)
        grads = torch.autograd.grad(out, dev, g.to(device))
        err = max((out.cpu() - ref).abs().max().item(), *((a.cpu() - b).abs().max().item()
                                                           for a, b in zip(grads, ref_grads)))
        emit(f"- {name}: max |difference| of output and q/k/v gradients {err:.2e} ({'ok' if err < 1e-2 else 'FAIL'})")
        record(**{f"sparse_{name}_max_err_vs_cpu": err})
    # 2. speed at long sequences, causal, bf16 on GPU
    h, hkv, d = (4, 2, 16) if args.smoke else (16, 4, 128)
    emit(f"Forward+backward on {device.type}, {args.dtype}, batch 1, {h} heads / {hkv} kv heads, head_dim {d}, "
         f"64-token blocks; median of {iters} after {warmup} warm-up")
    emit("| seq | impl | ms | dense / impl |")
    emit("|---|---|---|---|")
    for s in SPARSE_SMOKE if args.smoke else SPARSE_CASES:
        times = _sparse_speed(s, h, hkv, d, device, dtype, warmup, iters)
        size = f"{s // 1024}k" if s >= 1024 else str(s)
        if "dense SDPA" in times:
            record(**{f"sparse_{name.replace('_window', '')}_{size}_speedup": round(times["dense SDPA"] / t, 4)
                      for name, t in times.items() if name != "dense SDPA"})
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _sparse_speed(s: int, h: int, hkv: int, d: int, device, dtype, warmup: int, iters: int) -> dict[str, float]:
    from moe_lst.kernels.nsa import Compressor, NativeSparseAttention, NSAConfig
    from moe_lst.kernels.sparse import SparseConfig, block_layout, block_sparse_attention

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v, gates = leaf(1, s, h, d), leaf(1, s, hkv, d), leaf(1, s, hkv, d), leaf(1, s, h, 3)
    grad = torch.randn(1, s, h, d, device=device, dtype=dtype)
    cfg = NSAConfig()
    ck, cv = (Compressor(d, cfg.compress_block, cfg.compress_stride, device=device).to(dtype) for _ in range(2))
    nsa = NativeSparseAttention(cfg, ck, cv)

    def dense():
        t = (x.transpose(1, 2) for x in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True).transpose(1, 2)

    fns = {"dense SDPA": dense}
    for name, kw in (("fixed", dict(window_blocks=4, global_blocks=1)), ("sliding_window", dict(window_blocks=4)),
                     ("bigbird", dict(window_blocks=4, global_blocks=1, random_blocks=1))):
        layout = block_layout(SparseConfig(layout=name, block_size=64, **kw), s, True)
        fns[name] = functools.partial(block_sparse_attention, q, k, v, layout)
    fns["nsa"] = lambda: nsa(q, k, v, gates=torch.sigmoid(gates))
    times = {}
    for name, fn in fns.items():
        def step(fn=fn):
            q.grad = k.grad = v.grad = gates.grad = None
            fn().backward(grad)

        try:
            times[name] = median_time(step, device, warmup, iters)
        except Exception as e:  # noqa: BLE001 - report and go on to the next implementation
            emit(f"| {s} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | |")
            continue
        ratio = times["dense SDPA"] / times[name] if "dense SDPA" in times else float("nan")
        emit(f"| {s} | {name} | {times[name] * 1e3:.2f} | {ratio:.2f} |")
        if name != "dense SDPA":
            common.print_ratio(f"sparse seq {s}, dense SDPA / {name} time", ratio)
    return times


# ---------------------------------------------------------------------------- recipe
# ---------------------------------------------------------------------------- offload
OFFLOAD_MODES = (("none", {}), ("optimizer cpu", {"offload_optimizer": "cpu"}),
                 ("optimizer + params cpu", {"offload_optimizer": "cpu", "offload_params": "cpu"}),
                 ("optimizer + params nvme", {"offload_optimizer": "nvme", "offload_params": "nvme"}))


def _offload_run(model_cfg, offload: dict, device, batch: int, seq: int, steps: int, nvme: str,
                 accum: int = 1) -> dict:
    """Median step time (steps after the first two: the delayed update starts after one ordinary step) and
    the losses of ZeRO-3 on a Llama with `offload`, `accum` micro-batches of batch x seq per step."""
    import torch.nn.functional as F

    from moe_lst.models.llama import Transformer

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(model_cfg)
    engine = common.initialize(model, common.fast_adamw(lr=1e-4, weight_decay=0.1), stage=3,
                               dtype="bf16" if device.type == "cuda" else "fp32", grad_accum_steps=accum,
                               **offload, **({"nvme_path": nvme} if "nvme" in offload.values() else {}))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the step's peak, not the fp32 model built before sharding
    gen = torch.Generator(device="cpu").manual_seed(1)
    times, losses = [], []
    try:
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            total = 0.0
            for _ in range(accum):
                x = torch.randint(0, model_cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
                loss = F.cross_entropy(engine(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
                engine.backward(loss)
                total += loss.detach() / accum
            engine.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(total.item())
    finally:
        engine.close()
    return {"step_s": statistics.median(times[2:] or times[1:]), "losses": losses}


def _offload_table(cfg, modes, device, batch: int, seq: int, steps: int, accum: int, nvme: str) -> dict:
    """One row per offload mode (the first is no offload, the base of the ratios); {label: run}."""
    import psutil

    emit("| offload | step s | / none | peak GPU GiB | host RSS GiB | loss first -> last |")
    emit("|---|---|---|---|---|---|")
    base, runs = None, {}
    for label, offload in modes:
        try:
            r = _offload_run(cfg, offload, device, batch, seq, steps, nvme, accum)
        except Exception as e:  # noqa: BLE001 - one failing mode is a result, not the end of the check
            emit(f"| {label} | failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]} | | | | |")
            continue
        base = base or (r["step_s"] if not offload else None)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        rss = psutil.Process().memory_info().rss / 2**30
        ratio = f"{r['step_s'] / base:.2f}" if base else "-"
        emit(f"| {label} | {r['step_s']:.3f} | {ratio} | {peak:.2f} | {rss:.2f} | "
             f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
        if base and offload:
            common.print_ratio(f"ZeRO-3 step time{f' at {accum} micro-batches' if accum > 1 else ''}, "
                               f"offload {label} / none", r["step_s"] / base)
        r["over_none"] = r["step_s"] / base if base else None
        runs[label] = r
    return runs


DELAYED_MODES = (("none", {}), ("optimizer cpu", {"offload_optimizer": "cpu"}),
                 ("optimizer cpu, delayed update", {"offload_optimizer": "cpu", "offload_delayed_update": True,
                                                    "offload_delayed_warmup_steps": 1}))


def cmd_offload(args) -> None:
    import tempfile

    from moe_lst.models.llama import ModelConfig, Transformer

    device = torch.device(args.device)
    if args.smoke:
        cfg, batch, seq, steps = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, max_seq_len=64), 2, 64, 4
    else:  # ~0.45B parameters
        cfg = ModelConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, max_seq_len=1024)
        batch, seq, steps = 4, 1024, 4
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Transformer(cfg).parameters())
    emit(f"ZeRO-3 offload on one {device.type} rank, {'bf16' if device.type == 'cuda' else 'fp32'}, "
         f"Llama {n_params / 1e6:.1f}M (dim {cfg.dim} x {cfg.n_layers} layers), batch {batch} x seq {seq}, FastAdamW; "
         f"median step of steps 3..{steps}")
    with tempfile.TemporaryDirectory(prefix="gpu_check_nvme_") as nvme:
        runs = _offload_table(cfg, OFFLOAD_MODES, device, batch, seq, steps, 1, nvme)
        if "none" not in runs or "optimizer cpu" not in runs:
            return
        # A batch at which forward + backward outlast the host step: enough micro-batches per step to cover it
        # one and a half times (the host step is what optimizer cpu adds to a step of one micro-batch).
        host_s = max(runs["optimizer cpu"]["step_s"] - runs["none"]["step_s"], 0.0)
        accum = 2 if args.smoke else int(min(32, max(2, math.ceil(1.5 * host_s / runs["none"]["step_s"]))))
        emit(f"host step ~{host_s:.3f} s, forward + backward of one micro-batch ~{runs['none']['step_s']:.3f} s: "
             f"the same at {accum} micro-batches per step ({accum * batch * seq} tokens), with the delayed update")
        runs = _offload_table(cfg, DELAYED_MODES, device, batch, seq, steps + 1, accum, nvme)
    if {label for label, _ in DELAYED_MODES} <= set(runs):
        record(offload_accum=accum, offload_host_step_s=host_s,
               offload_cpu_over_none=round(runs["optimizer cpu"]["over_none"], 4),
               offload_delayed_over_none=round(runs["optimizer cpu, delayed update"]["over_none"], 4),
               offload_cpu_same_losses=runs["optimizer cpu"]["losses"] == runs["none"]["losses"],
               offload_losses={label: r["losses"] for label, r in runs.items()})


def model_flops_per_token(model: dict, seq_len: int) -> tuple[int, int]:
    """(active matmul parameters, attention FLOPs per token for forward+backward) of a recipe model config.

    Active parameters: the weights a token is multiplied with (attention projections, the dense FFN or
    the router + its top-k routed experts + the shared experts, the output projection); the embedding
    lookup is no matmul. Attention: QK^T and PV over on average seq/2 keys (causal), x3 for fwd+bwd.
    """
    dim, layers, heads, kv_heads = model["dim"], model["n_layers"], model["n_heads"], model["n_kv_heads"]
    head_dim = dim // heads
    ffn = model["ffn_dim"] or 64 * math.ceil(8 * dim / 3 / 64)  # 0 = ModelConfig's SwiGLU default
    moe = model.get("moe") or {}
    experts = moe.get("num_experts") or 0
    first_dense, every = moe.get("first_dense", 0), moe.get("every", 1)
    expert_ffn = moe.get("ffn_dim") or ffn
    mats = 3 if moe.get("activation", "swiglu") == "swiglu" else 2
    attn = 2 * dim * heads * head_dim + 2 * dim * kv_heads * head_dim  # wq, wo; wk, wv
    active = model["vocab_size"] * dim
    for layer in range(layers):
        active += attn
        if experts and layer >= first_dense and (layer - first_dense) % every == 0:
            routed = moe.get("top_k", 2) + moe.get("num_shared_experts", 0)
            active += dim * experts + routed * mats * dim * expert_ffn
        else:
            active += 3 * dim * ffn
    return active, 6 * layers * seq_len * heads * head_dim


def report_recipe(run_dir: Path, label: str, exit_code, stopped: bool, on_gpu: bool, wall_s: float) -> dict:
    """Prints the run's figures; returns them (tokens/s, step time, MFU as a fraction of peak or None)."""
    from omegaconf import OmegaConf

    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []
    how = "stopped by the time limit" if stopped else f"exit {exit_code}"
    where = "on the GPU" if on_gpu else "on the CPU (no CUDA memory was allocated)"
    if not records:
        emit(f"recipe {label}: no steps recorded ({how}, {wall_s:.0f} s); see the log above")
        return {}
    warm = min(5, len(records) // 3)  # first steps: allocator growth, kernel selection
    steady = records[warm:]
    tok_s = statistics.median(r["tokens_per_s"] for r in steady)
    step_s = statistics.median(r["step_time_s"] for r in steady)
    cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    active, attn = model_flops_per_token(cfg["model"], cfg["train"]["seq_len"])
    flops_per_token = 6 * active + attn
    emit(f"recipe {label}: {len(records)} steps ({how}, {wall_s:.0f} s wall) ran {where}; "
         f"median of steps {warm + 1}-{len(records)}: {tok_s:,.0f} tokens/s, {step_s * 1e3:.1f} ms/step; "
         f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    peak, _ = peak_flops(torch.device("cuda")) if torch.cuda.is_available() else (None, "")
    if not on_gpu:
        mfu = "not computed (the run used the CPU)"
    else:
        mfu = mfu_text(flops_per_token * tok_s, peak)
    emit(f"recipe {label}: {active / 1e6:.1f}M active matmul params, {flops_per_token / 1e6:.1f} MFLOP/token "
         f"(6 x params + {attn / 1e6:.1f}M attention), {flops_per_token * tok_s / 1e12:.2f} TFLOP/s, MFU {mfu}")
    return {"tokens_per_s": tok_s, "step_s": step_s, "steps": len(records), "active_params": active,
            "mfu": flops_per_token * tok_s / peak if on_gpu and peak else None}


def cmd_recipe(args) -> int:
    """`python -m recipes.pretrain <overrides> run_dir=<run_dir>` in this process, then its report."""
    run_dir = Path(args.run_dir).resolve()

    def on_term(signum, frame):
        raise _TimeLimit

    signal.signal(signal.SIGTERM, on_term)
    sys.argv = ["recipes.pretrain", *args.overrides, f"run_dir='{run_dir}'"]
    code, stopped, t0 = 0, False, time.perf_counter()
    try:
        runpy.run_module("recipes.pretrain", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except _TimeLimit:
        stopped = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    wall = time.perf_counter() - t0
    # The recipe places its tensors itself; a GPU run leaves a CUDA high-water mark, a CPU run none.
    on_gpu = torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 2**20
    figures = report_recipe(run_dir, args.label, code, stopped, on_gpu, wall)
    if on_gpu:
        figures["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        emit(f"recipe {args.label}: peak GPU memory {figures['peak_gib']:.1f} GiB (allocated)")
    if args.key:
        record(**{f"{name}_{args.key}": value for name, value in figures.items()})
    (run_dir / "gpu_check.json").write_text(json.dumps({"on_gpu": on_gpu, "exit": code, "stopped": stopped}))
    return 124 if stopped else code


PARTS = {"env": cmd_env, "moe": cmd_moe, "moe_profile": cmd_moe_profile, "ulysses": cmd_ulysses, "sparse": cmd_sparse,
         "offload": cmd_offload}
# --quick's recipe: the tiny dense model, a few short steps
QUICK_RECIPE = ["model=tiny", "train.steps=4", "train.seq_len=64", "train.micro_batch_size=2",
                "data.max_bytes=2000000", "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0",
                "train.progress=false", "wandb.mode=disabled"]


def main() -> int:
    global _results, _json
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", choices=(*PARTS, "recipe"))
    ap.add_argument("overrides", nargs="*", help="recipe: hydra overrides, e.g. zero.dtype=bf16 model=moe_small")
    ap.add_argument("--results", help="file the figures are appended to (besides stdout)")
    ap.add_argument("--json", help="file the headline figures are merged into (a flat JSON object; env starts it)")
    ap.add_argument("--key", help="recipe: the suffix of its figures in --json (e.g. dense: mfu_dense)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to exercise the code on a CPU")
    ap.add_argument("--quick", action="store_true", help="every part on the CPU at --smoke sizes (no subcommand)")
    ap.add_argument("--run-dir", help="recipe: its run_dir")
    ap.add_argument("--label", default="run", help="recipe: the name its figures carry")
    args = ap.parse_intermixed_args()  # recipe overrides may follow the options
    _results = Path(args.results) if args.results else None
    _json = Path(args.json) if args.json else None
    if args.quick:
        if args.part:
            ap.error("--quick runs every part: no subcommand")
        return quick(args)
    if args.part is None:
        ap.error("a subcommand (or --quick)")
    if args.part == "recipe":
        if not args.run_dir:
            ap.error("recipe needs --run-dir")
        return cmd_recipe(args)
    PARTS[args.part](args)
    return 0


def quick(args) -> int:
    """Every part on the CPU at the smoke sizes, in this process: the code paths of a GPU check, no figures."""
    import tempfile

    args.device, args.dtype, args.smoke = "cpu", "float32", True
    common.quick_limits()  # (a DeepSpeed side whose ops are not built yet is skipped, not compiled)
    for name, fn in PARTS.items():
        emit(f"== {name} (CPU smoke sizes)")
        fn(args)
    with tempfile.TemporaryDirectory() as run_dir:
        emit("== recipe (CPU, tiny model)")
        args.run_dir, args.label, args.overrides = run_dir, "model=tiny", [*QUICK_RECIPE, *args.overrides]
        code = cmd_recipe(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
