"""Ulysses attention at sp=2 against DeepSpeed's DistributedAttention, plus per-rank memory vs sp=1.

Both wrap the same local attention (moe_lst.kernels.attention.attention) on the same sharded inputs; we time
forward+backward (interleaved rounds, median) and measure peak RSS per rank in fresh processes.

    python benchmarks/ulysses.py            # full run (seq 8192, MHA and GQA)
    python benchmarks/ulysses.py --quick    # smoke run (seq 1024, MHA)

Without DeepSpeed (`import deepspeed` fails) its side is skipped with a note; ours runs against sp=1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import common  # noqa: E402


def _make_impl(name: str, group):
    from moe_lst.kernels.attention import attention

    if name == "ours":
        from sequence_parallel import UlyssesAttention

        return UlyssesAttention(group, attn_fn=attention)
    if name == "deepspeed":
        from deepspeed.sequence.layer import DistributedAttention

        def local_attn(q, k, v, *args, **kwargs):
            return attention(q, k, v, causal=True)

        # [b, s/P, h, d]: scatter heads (dim 2), gather sequence (dim 1), batch is dim 0
        ds = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=1)
        return lambda q, k, v, causal=True: ds(q, k, v, 0)
    if name == "sp1":
        return attention
    raise ValueError(name)


def _inputs(b: int, s: int, h: int, hkv: int, d: int, P: int, rank: int):
    gen = torch.Generator().manual_seed(0)
    sl = s // P
    # Each rank generates only its own shard (rows rank*sl ... of the same global tensors).
    q = torch.randn(b, s, h, d, generator=gen)[:, rank * sl:(rank + 1) * sl].clone().requires_grad_()
    k = torch.randn(b, s, hkv, d, generator=gen)[:, rank * sl:(rank + 1) * sl].clone().requires_grad_()
    v = torch.randn(b, s, hkv, d, generator=gen)[:, rank * sl:(rank + 1) * sl].clone().requires_grad_()
    g = torch.randn(b, sl, h, d, generator=gen)
    return q, k, v, g


def _step(fn, q, k, v, g) -> None:
    out = fn(q, k, v, causal=True)
    out.backward(g)
    q.grad = k.grad = v.grad = None


def _layer_step(fn, shape: tuple, P: int, rank: int) -> None:
    """Forward+backward of a Llama attention layer (projections, RoPE, attention, output) on this rank's shard."""
    from moe_lst.models.llama import Attention, ModelConfig, rope_cos_sin

    b, s, h, hkv, d = shape
    torch.manual_seed(0)
    layer = Attention(ModelConfig(dim=h * d, n_heads=h, n_kv_heads=hkv, n_layers=1))
    layer.attn_fn = fn
    sl = s // P
    x = torch.randn(b, sl, h * d, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(rank * sl, (rank + 1) * sl).expand(b, sl), d, 10000.0)
    layer(x, cos, sin).backward(torch.randn(b, sl, h * d))


def _case(mode: str, impls: list[str], shape: tuple, iters: int) -> dict:
    """One rank of a run (`mode` time, memory or layer_memory) of `impls` over the spawned ranks."""
    P = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if P > 1 else 0
    group = None
    if P > 1:
        group = dist.new_group(list(range(P)))
        if "deepspeed" in impls:
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    fns = {name: _make_impl(name, group) for name in impls}
    b, s, h, hkv, d = shape
    for name in impls:
        # A tiny step first loads kernels and allocator arenas, which are not this step's memory.
        _step(fns[name], *_inputs(b, 16 * P, h, hkv, d, P, rank))
    rss0 = common.reset_peak_rss()  # before the inputs: the peak counts inputs, grads and every buffer
    q, k, v, g = _inputs(b, s, h, hkv, d, P, rank)
    result = {}
    if mode == "memory":
        (name,) = impls
        _step(fns[name], q, k, v, g)
        result["peak_mib"] = common.peak_rss_mb() - rss0
    elif mode == "layer_memory":
        (name,) = impls
        del q, k, v, g
        _layer_step(fns[name], (b, 16 * P, h, hkv, d), P, rank)  # warm-up at a tiny length
        rss0 = common.reset_peak_rss()
        _layer_step(fns[name], shape, P, rank)
        result["peak_mib"] = common.peak_rss_mb() - rss0
    else:
        for name in impls:  # warm-up
            _step(fns[name], q, k, v, g)
        times = {name: [] for name in impls}
        for _ in range(iters):
            for name in impls:  # interleaved, so background load hits both alike
                if group is not None:
                    dist.barrier(group)
                t0 = time.perf_counter()
                _step(fns[name], q, k, v, g)
                times[name].append(time.perf_counter() - t0)
        result["times"] = times
    return result


def _run(P: int, mode: str, impls: list[str], shape: tuple, iters: int = 0, peers: list[str] | None = None
         ) -> list[dict] | None:
    """`impls` on P fresh ranks. With `peers` (the implementations still compared, DeepSpeed's among them): when a
    run with DeepSpeed fails or does not finish in time, it is said in one line and DeepSpeed is dropped from
    `peers`; the same run without it comes back (None when it was DeepSpeed's alone)."""
    if peers is None or "deepspeed" not in impls:
        return common.spawn(_case, mode, impls, shape, iters, world=P, timeout=900)
    try:
        return common.spawn(_case, mode, impls, shape, iters, world=P, timeout=900)
    except common.RankFailed as e:
        common.peer_failed("DeepSpeed's DistributedAttention", e)
    peers.remove("deepspeed")
    ours = [n for n in impls if n != "deepspeed"]
    return _run(P, mode, ours, shape, iters) if ours else None


def main() -> None:
    # Fixed mmap threshold: large tensors get their own mappings and return to the OS when freed, so
    # peak RSS tracks live tensor memory instead of glibc heap growth (spawned ranks inherit this).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sequence, few iterations")
    parser.add_argument("--seq", type=int, default=None, help="global sequence length")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    common.quick_mode(args.quick, "moe_lst.models.llama", "sequence_parallel")
    seq = args.seq or (1024 if args.quick else 8192)
    iters = args.iters or (2 if args.quick else 4)
    P = 2
    cases = {"MHA h=8": (1, seq, 8, 8, 64), "GQA h=8 kv=2": (1, seq, 8, 2, 64)}
    if args.quick:
        cases.pop("GQA h=8 kv=2")
    impls = common.without_deepspeed(["ours", "deepspeed"], "DeepSpeed's DistributedAttention")
    print(f"Ulysses attention forward+backward, sp={P} gloo ranks on CPU, seq={seq}, head_dim=64, "
          f"{iters} interleaved rounds (median)")
    header = (f"{'case':<14} {'ours ms':>8} {'DS ms':>8} {'ours/DS':>7} | {'level':<5} {'sp1 MiB':>7} "
              f"{'ours MiB':>8} {'DS MiB':>7} {'ours/sp1':>8} {'DS/sp1':>6}")
    print(header)
    print("-" * len(header))
    ratios = []
    for case, shape in cases.items():
        timing = _run(P, "time", list(impls), shape, iters, peers=impls)
        med = {n: max(statistics.median(r["times"][n]) for r in timing) * 1e3 for n in impls}
        med.setdefault("deepspeed", None)
        for level, mode in (("op", "memory"), ("layer", "layer_memory")):
            sp1 = _run(1, mode, ["sp1"], shape)[0]["peak_mib"]
            mem = {n: max(r["peak_mib"] for r in ranks) for n in list(impls)
                   if (ranks := _run(P, mode, [n], shape, peers=impls)) is not None}
            mem.setdefault("deepspeed", None)
            vs_ds = med["ours"] / med["deepspeed"] if med["deepspeed"] else None
            times = (f"{med['ours']:>8.1f} {common.fmt(med['deepspeed'], '.1f'):>8} {common.fmt(vs_ds):>7}"
                     if level == "op" else " " * 25)
            ds_sp1 = mem["deepspeed"] / sp1 if mem["deepspeed"] is not None else None
            print(f"{case if level == 'op' else '':<14} {times} | {level:<5} {sp1:>7.1f} {mem['ours']:>8.1f} "
                  f"{common.fmt(mem['deepspeed'], '.1f'):>7} {mem['ours'] / sp1:>8.2f} {common.fmt(ds_sp1):>6}",
                  flush=True)
            if level == "op" and vs_ds is not None:
                ratios.append((f"{case} attention fwd+bwd time, ours / DeepSpeed", vs_ds))
            ratios.append((f"{case} {level} peak memory per rank, ours sp={P} / sp=1", mem["ours"] / sp1))
    print("ms: slowest rank's median forward+backward of the attention op. MiB: peak RSS growth of one rank "
          "(largest over ranks) from before the inputs were made; op = q, k, v in, attention, grads out; "
          "layer = a Llama attention layer (q/k/v/o projections + RoPE + attention) on the rank's shard. "
          "sp1 = the same global batch in one process.")
    for what, value in ratios:
        common.print_ratio(what, value)
    common.finish()


if __name__ == "__main__":
    main()
