"""Longest trainable sequence under a memory cap: ALST off vs on, Ulysses sp=1/2/4, ours vs DeepSpeed ALST.

Each probe is one training step (forward + backward + AdamW step) of a small Llama (dim 256, 2 layers,
32k vocabulary, so logits matter) in a fresh process; a watchdog ends the probe as soon as its RSS
passes the cap, so "fits" means peak RSS <= cap. The longest length is found by doubling, then
refining between the last fit and the first failure.

    python benchmarks/long_sequence.py                # cap 1.5 GiB, ALST search up to 16k tokens
    python benchmarks/long_sequence.py --cap-gib 8 --max-seq 1048576   # the 8 GiB cap (hours on 2 cores)
    python benchmarks/long_sequence.py --quick        # cap 0.65 GiB, up to 1k tokens, no bisection
    python benchmarks/long_sequence.py --skip alst,sp,deepspeed --sparse-budget-s 60   # dense vs sparse only
    python benchmarks/long_sequence.py --skip alst,sp,deepspeed,sparse   # ring / Ulysses x ring / Ulysses only
    python benchmarks/long_sequence.py --skip alst,sp,deepspeed,sparse,ring --ring-steps 262144 2097152
        # steps of the +experiment=two_million_cp preset (torchrun, 4 processes) at those lengths

The dense vs sparse section (on by default; `--skip sparse` leaves it out) runs the million-token preset's
model with ALST, dense or sliding-window sparse attention, sp 1 and 2 (quick: 2), doubling from 8k x sp tokens up to
1,048,576 under a per-rank RSS cap (`--sparse-cap-gib`, 6) and a step-time budget (`--sparse-budget-s`, 120).

Caps include the process itself (Python, torch, the model and AdamW state: about 0.55 GiB). On CPU the
ALST-on length is bounded by compute time (attention is quadratic) long before memory, so the default
cap is chosen small enough for the whole run to take ~15 minutes; --max-seq bounds the doubling.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402


# ------------------------------------------------------------------------------------ one probe
def _use_deepspeed_tiled_mlp(model, tile_size: int) -> None:
    import math

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP as DSTiledMLP

    for name, module in model.named_modules():
        if name.endswith("feed_forward"):
            original = module.forward
            params = list(module.parameters())

            def forward(x, _module=module, _original=original, _params=params):
                shards = max(1, math.ceil(x.shape[-2] / tile_size))
                return DSTiledMLP.apply(lambda self, t: _original(t), _module, x, shards, _params)

            module.forward = forward


def _deepspeed_tiled_loss(hidden, weight, labels, tile_size: int):
    import math

    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    class Head:  # TiledFusedLogitsLoss calls fn(self, x, y) with the object it is given
        pass

    head = Head()
    head.weight = weight

    def loss_fn(self, x, y):
        logits = F.linear(x, self.weight).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")

    shards = max(1, math.ceil(hidden.shape[1] / tile_size))
    loss_sum = TiledFusedLogitsLoss.apply(loss_fn, head, hidden, labels, None, shards, [weight], "sum")
    return loss_sum, (labels != -100).sum()


def probe_rank(seq: int, mode: str, cap_bytes: int, sp: int, model_name: str = "bench") -> dict:
    """One training step on this rank; returns peak RSS and step time. model_name "million": the model of
    `+experiment=million` (dim 128, 2 layers, byte vocabulary); mode "alst-sparse": ALST with its
    sliding-window block-sparse attention (64-token blocks, 4-block window)."""
    import torch
    import torch.distributed as dist
    from moe_lst.models.llama import Transformer

    from sequence_parallel import shard_sequence, sp_loss
    from zero.dist import comm

    torch.set_num_threads(1)
    group = dist.new_group(list(range(sp))) if sp > 1 else None
    common.watch_rss(cap_bytes / 2**20)  # the probe ends (exit OVER_CAP) as soon as its RSS passes the cap
    cfg = _probe_model_config(seq, mode, model_name)
    torch.manual_seed(0)
    model = Transformer(cfg)
    mode, loss_tile = _apply_probe_mode(model, cfg, seq, mode, sp, group, model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)
    tok, lab, pos = shard_sequence(tokens[:, :-1], tokens[:, 1:], group)
    t0 = time.perf_counter()
    hidden = model.forward_hidden(tok, pos)
    loss_sum, count = _probe_loss(hidden, model.output_weight, lab, mode, loss_tile)
    loss = sp_loss(loss_sum, count, group)
    del hidden
    loss.backward()
    for p in model.parameters():  # what the runtime does with SP-partial gradients
        comm.all_reduce(p.grad, group)
    opt.step()
    seconds = time.perf_counter() - t0
    return {"peak_bytes": common.peak_rss_mb() * 2**20, "seconds": seconds, "loss": loss.item()}


def _probe_model_config(seq: int, mode: str, model_name: str):
    """The probe's Llama: "bench" (32k vocabulary, so logits matter) or the million-token preset's model,
    with its sliding-window sparse attention in mode alst-sparse."""
    from moe_lst.models.llama import ModelConfig

    if model_name == "million":
        from moe_lst.kernels.sparse import SparseConfig

        attention = {"attention": "sparse", "sparse": SparseConfig(layout="sliding_window", block_size=64,
                                                                    window_blocks=4)} if mode == "alst-sparse" else {}
        return ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=384,
                           max_seq_len=seq, **attention)
    if mode == "alst-sparse":
        raise ValueError("mode alst-sparse runs on the million-token preset's model (--model million)")
    return ModelConfig(vocab_size=32768, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=seq)


def _apply_probe_mode(model, cfg, seq: int, mode: str, sp: int, group, model_name: str) -> tuple[str, int]:
    """Ulysses over `group` (sp > 1) and the mode's tiled MLP and checkpointing on `model`. Returns the mode
    as far as the loss is concerned (alst-sparse is alst) and the loss tile."""
    from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp, apply_ulysses

    if sp > 1:
        apply_ulysses(model, group)
    mlp_tile, loss_tile = cfg.dim, (16 * 2**20) // cfg.vocab_size
    if model_name == "million":  # the preset's tiles: 64 MLP tiles (16k tokens at 1M), 64k-token loss tiles
        mlp_tile = max(cfg.dim, seq // sp // 64)
    mode = "alst" if mode == "alst-sparse" else mode
    if mode == "alst":
        apply_tiled_mlp(model, tile_size=mlp_tile)
    if mode == "alst-deepspeed":
        _use_deepspeed_tiled_mlp(model, mlp_tile)
    if mode in ("alst", "alst-deepspeed"):
        apply_activation_checkpointing(model, offload=model_name != "million")  # the preset: no offload on CPU
    return mode, loss_tile


def _probe_loss(hidden, weight, labels, mode: str, loss_tile: int):
    """(loss sum, token count) of the step: tiled (ours or DeepSpeed's) under ALST, else whole logits."""
    import torch.nn.functional as F

    from sequence_parallel import cross_entropy_sum, tiled_cross_entropy

    if mode == "alst":
        return tiled_cross_entropy(hidden, weight, labels, tile_size=loss_tile)
    if mode == "alst-deepspeed":
        return _deepspeed_tiled_loss(hidden, weight, labels, loss_tile)
    return cross_entropy_sum(F.linear(hidden, weight), labels)


# ------------------------------------------------------------------------------------ search
_PROBED: dict[tuple, dict | None] = {}  # a probe asked again (same length, mode, cap, sp, model) is not rerun


def run_probe(seq: int, mode: str, cap_bytes: int, sp: int, timeout: float, model_name: str = "bench",
              budget: float | None = None) -> dict | None:
    """One probe in fresh processes (sp ranks): its result (largest rank's peak, slowest rank's time), None
    over the cap, {"timeout": True} past the time limit (or a step slower than `budget` seconds)."""
    key = (seq, mode, cap_bytes, sp, model_name)
    if key not in _PROBED:
        env = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024), "PYTHONWARNINGS": "ignore"}
        try:
            ranks = common.spawn(probe_rank, *key, world=sp, timeout=timeout, env=env)
            _PROBED[key] = {"peak_bytes": max(r["peak_bytes"] for r in ranks),
                            "seconds": max(r["seconds"] for r in ranks), "loss": ranks[0]["loss"]}
        except common.OverMemory:
            _PROBED[key] = None
        except common.RankTimeout:
            return {"timeout": True}
    info = _PROBED[key]
    if info is not None and budget is not None and info["seconds"] > budget:
        return {**info, "timeout": True}
    return info


def longest(mode: str, cap_bytes: int, sp: int, start: int, max_seq: int, timeout: float,
            log: list, model_name: str = "bench", budget: float | None = None,
            refine: int = 2) -> tuple[int, dict | None, str]:
    """Doubling from `start`, then up to `refine` bisection steps between the last fit and the first failure."""
    step = 256 * sp  # lengths stay multiples of sp
    if model_name == "million":
        step = 64 * 64 * sp  # whole sparse blocks and MLP tiles on every rank

    def probe(seq: int) -> dict | None:
        """One probe, logged and printed; None when it went over the cap or hit the time limit."""
        info = run_probe(seq, mode, cap_bytes, sp, timeout, model_name, budget)
        log.append((mode, sp, seq, info))
        _print_probe(mode, sp, seq, info)
        return info

    best, best_info, fail, note = 0, None, None, ""
    seq = start
    while seq <= max_seq:
        info = probe(seq)
        if info is None or "timeout" in info:
            fail = seq
            if info is not None:
                note = "time budget"
            break
        best, best_info = seq, info
        seq *= 2
    else:
        return best, best_info, f"reached --max-seq {max_seq}"
    if best and fail:
        for _ in range(refine):
            mid = (best + fail) // 2 // step * step
            if mid <= best or mid >= fail:
                break
            info = probe(mid)
            if info is None or "timeout" in info:
                fail = mid
            else:
                best, best_info = mid, info
    return best, best_info, note


def _print_probe(mode: str, sp: int, seq: int, info: dict | None) -> None:
    """A probe's line: its peak and step time, or over cap, or timeout."""
    shown = "over cap" if info is None else ("timeout" if "timeout" in info else _fmt(info))
    print(f"  probe mode={mode:<15} sp={sp} seq={seq:>7}: {shown}", flush=True)


def _fmt(info: dict) -> str:
    return f"peak {info['peak_bytes'] / 2**30:.2f} GiB, step {info['seconds']:.1f}s"


def sparse_section(args, rows: list, log: list) -> None:
    """Dense vs sliding-window sparse attention, both with ALST, on the million-token preset's model: the
    longest step under a per-rank RSS cap and a step-time budget, sp 1 and 2."""
    cap, budget = int(args.sparse_cap_gib * 2**30), args.sparse_budget_s
    print(f"dense vs sparse attention (ALST on, the +experiment=million model), per-rank RSS cap "
          f"{args.sparse_cap_gib:.1f} GiB, step budget {budget:.0f} s")
    found = {}
    sps = (2,) if args.quick else (1, 2)  # quick: sp=1 of this model is what million_step.py --quick runs
    for sp in sps:
        for mode in ("alst", "alst-sparse"):
            start = args.sparse_start * sp
            best, info, note = longest(mode, cap, sp, start, max(start, args.sparse_max_seq), 4 * budget + 120, log,
                                       "million", budget, args.refine)
            rows.append((f"sp={sp}", mode, cap, best, info, note or "reached 1,048,576"))
            found[(sp, mode)] = best
    for sp in sps:
        dense, sparse = found[(sp, "alst")], found[(sp, "alst-sparse")]
        if dense:
            print(f"sp={sp}: sparse / dense longest step under the cap and budget: {sparse / dense:.1f}x")
            common.print_ratio(f"sp={sp} longest step, sparse / dense attention", sparse / dense)


def main() -> None:
    args = _parse_args()
    quick = args.quick
    common.quick_mode(quick, "moe_lst.models.llama", "sequence_parallel")
    # quick: ALST off fits at 512 tokens and not at 1024, ALST on fits at 1024 (the --max-seq)
    cap = int((args.cap_gib or (0.65 if quick else 1.5)) * 2**30)
    sp_cap = int((args.sp_cap_gib or (0.65 if quick else 1.2)) * 2**30)  # quick: the sp=1 probe is the one above
    start = 512 if quick else 1024
    max_seq = args.max_seq or (1024 if quick else 16384)
    args.refine = args.refine if args.refine is not None else (0 if quick else 2)
    # quick: one probe per sparse-section case, at 2048 tokens per rank (a whole number of sparse blocks)
    args.sparse_start, args.sparse_max_seq = (2048, 0) if quick else (8192, 1 << 20)
    skip = set(filter(None, args.skip.split(",")))
    log: list = []
    rows = []
    t_start = time.time()
    if "alst" not in skip:
        rows += alst_section(args, cap, start, max_seq, log, with_deepspeed="deepspeed" not in skip)
    sps = []
    if "sp" not in skip:
        sps = sp_section(args, sp_cap, start, max_seq, log)
        rows += sps
    if "sparse" not in skip:
        sparse_section(args, rows, log)
    if "ring" not in skip and not quick:  # (six 4-process spawns: longer than a quick run's budget)
        ring_section(args)
    if args.ring_steps:
        ring_steps_section(args)
    _print_summary(rows, sps, cap)
    print(f"total {time.time() - t_start:.0f}s")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small caps and lengths, one probe per length")
    parser.add_argument("--cap-gib", type=float, default=None, help="RSS cap for the sp=1 ALST comparison")
    parser.add_argument("--sp-cap-gib", type=float, default=None, help="per-rank RSS cap for the sp scan")
    parser.add_argument("--max-seq", type=int, default=None, help="stop doubling here (CPU time bound)")
    parser.add_argument("--refine", type=int, default=None, help="bisection probes after the doubling "
                        "(default 2; quick 0)")
    parser.add_argument("--probe-timeout", type=float, default=600.0)
    parser.add_argument("--skip", default="", help="comma list of sections to skip: alst,sp,deepspeed,sparse,ring")
    parser.add_argument("--ring-seq", type=int, default=32768, help="tokens of the ring vs Ulysses section")
    parser.add_argument("--ring-steps", type=int, nargs="*", default=[],
                        help="lengths of +experiment=two_million_cp steps to run (4 processes, torchrun)")
    parser.add_argument("--ring-threads", type=int, default=1, help="threads per process of those runs")
    parser.add_argument("--sparse-cap-gib", type=float, default=6.0,
                        help="per-rank RSS cap of the dense vs sparse section")
    parser.add_argument("--sparse-budget-s", type=float, default=120.0,
                        help="step-time budget of the dense vs sparse section")
    return parser.parse_args()


def alst_section(args, cap: int, start: int, max_seq: int, log: list, with_deepspeed: bool) -> list[tuple]:
    """ALST off vs on at sp=1 under `cap`; with DeepSpeed, its tiled MLP and loss at our longest length."""
    rows = []
    print(f"ALST off vs on, sp=1, RSS cap {cap / 2**30:.1f} GiB")
    for mode in ("baseline", "alst"):
        best, info, note = longest(mode, cap, 1, start, max_seq, args.probe_timeout, log, refine=args.refine)
        rows.append(("sp=1", mode, cap, best, info, note))
    if with_deepspeed and best and common.deepspeed_runs("DeepSpeed's TiledMLP + TiledFusedLogitsLoss"):
        # DeepSpeed's TiledMLP + TiledFusedLogitsLoss (with our checkpointing) at our longest length.
        info = run_probe(best, "alst-deepspeed", cap, 1, args.probe_timeout)
        _print_probe("alst-deepspeed", 1, best, info)
        ok = info is not None and "timeout" not in info
        rows.append(("sp=1", "alst-deepspeed", cap, best if ok else 0, info if ok else None,
                     "single probe at the ALST length"))
    return rows


def sp_section(args, sp_cap: int, start: int, max_seq: int, log: list) -> list[tuple]:
    """The longest step without ALST at sp 1, 2 and 4 (quick: 1 and 2) under a per-rank cap."""
    sps = []
    print(f"Ulysses sp scan (ALST off), per-rank RSS cap {sp_cap / 2**30:.1f} GiB")
    for sp in ((1, 2) if args.quick else (1, 2, 4)):
        # quick: one probe per sp, at 512 tokens per rank
        best, info, note = longest("baseline", sp_cap, sp, start * sp, start * sp if args.quick else max_seq,
                                   args.probe_timeout, log, refine=args.refine)
        sps.append((f"sp={sp}", "baseline", sp_cap, best, info, note))
    return sps


def ring_rank(seq: int, sp: int, cp: int, attention: str, head_dim: int) -> dict:
    """One attention forward + backward over `seq` tokens split over sp x cp ranks (Ulysses inside the ring), 4
    query / 2 kv heads: wall time, bytes this rank sent by kind (zero.dist.comm), peak RSS."""
    import torch
    from moe_lst.kernels.attention import attention as dense
    from moe_lst.kernels.sparse import SparseAttention, SparseConfig

    from sequence_parallel.data import shard_context_parallel
    from sequence_parallel.ring import RingAttention
    from sequence_parallel.ulysses import UlyssesAttention
    from zero.dist import comm

    dims = common.parallel_dims(sp=sp, cp=cp)
    fn = dense if attention == "dense" else SparseAttention(
        SparseConfig(layout="sliding_window", block_size=64, window_blocks=4))
    inner = RingAttention(dims.cp_group, fn, ulysses=sp) if cp > 1 else fn
    module = UlyssesAttention(dims.sp_group, inner) if sp > 1 else inner
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, n, head_dim, generator=gen) for n in (4, 2, 2))
    if cp > 1:
        q, k, v = (shard_context_parallel(x, dims.sp_group, dims.cp_group) for x in (q, k, v))
    else:
        q, k, v = (x.chunk(sp, dim=1)[dims.coordinate()["sp"]].contiguous() for x in (q, k, v))  # Ulysses: in order
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    common.reset_peak_rss()
    comm.barrier(dims.world_group)
    with comm.counting() as stats:
        t0 = time.perf_counter()
        out = module(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        seconds = time.perf_counter() - t0
        sent = dict(stats.bytes)
    return {"seconds": seconds, "bytes": sent, "peak_mb": common.peak_rss_mb()}


def ring_section(args) -> None:
    """Ulysses alone (sp=4 = the query heads), ring attention alone (cp=4) and Ulysses x ring (sp=2 x cp=2) on 4
    processes at the same length: time and bytes per rank, dense causal and sliding-window attention."""
    seq = 2048 if args.quick else args.ring_seq
    print(f"ring attention vs Ulysses, {seq} tokens on 4 processes, 4 query / 2 kv heads, head dim 64, one attention "
          "forward + backward")
    table, found = [], {}
    for attention in ("dense", "sliding_window"):
        for sp, cp in ((4, 1), (1, 4), (2, 2)):
            ranks = None
            for attempt in range(2):  # (a second try: another job may take the rendezvous port first)
                try:
                    ranks = common.spawn(ring_rank, seq, sp, cp, attention, 64, world=4, timeout=args.probe_timeout)
                    break
                except Exception as e:  # noqa: BLE001 - one line per failed layout, the others go on
                    if attempt:
                        common.failed(f"sp={sp} x cp={cp} {attention}", e)
            if ranks is None:
                continue
            seconds = max(r["seconds"] for r in ranks)
            sent = [sum(r["bytes"].values()) for r in ranks]
            found[(attention, sp, cp)] = (seconds, max(sent))
            kinds = sorted({k for r in ranks for k in r["bytes"]})
            table.append([attention, f"sp={sp} x cp={cp}", f"{seconds:.2f}", f"{max(sent) / 2**20:.1f}",
                          f"{sum(sent) / 2**20:.1f}", ", ".join(kinds), f"{max(r['peak_mb'] for r in ranks):.0f}"])
    print(common.table(["attention", "layout", "time s", "max MiB sent by a rank", "MiB sent, all ranks", "kinds",
                        "peak RSS MiB"], table))
    for attention in ("dense", "sliding_window"):
        base = found.get((attention, 4, 1))
        for sp, cp in ((1, 4), (2, 2)):
            mine = found.get((attention, sp, cp))
            if base and mine:
                common.print_ratio(f"{attention} sp={sp} x cp={cp} / Ulysses sp=4 time at {seq} tokens",
                                   mine[0] / base[0])
                common.print_ratio(f"{attention} sp={sp} x cp={cp} / Ulysses sp=4 bytes at {seq} tokens",
                                   mine[1] / base[1])


# Tokens of the default byte-level corpus's held-out split (data=stdlib): a crop check reads one sequence of it.
STDLIB_VAL_TOKENS = 1_833_761


def ring_steps_section(args) -> None:
    """One training step of the 2M-token ring preset (`+experiment=two_million_cp`, cp=4) through the recipe under
    torchrun at each of `--ring-steps` lengths: wall time of the step, per-rank peak RSS, loss, crop check."""
    import json
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    table = []
    for seq in args.ring_steps:
        out = tempfile.mkdtemp(prefix=f"ring-{seq}-")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m",
               "recipes.pretrain", "+experiment=two_million_cp", f"train.seq_len={seq}", f"run_dir={out}",
               "wandb.mode=disabled", "train.progress=false"]
        if seq > STDLIB_VAL_TOKENS - 2:  # the default corpus's held-out split is shorter: random bytes instead
            import numpy as np

            rng = np.random.default_rng(0)
            for split in ("train", "val"):
                rng.integers(0, 256, 2 * seq, dtype=np.uint8).tofile(os.path.join(out, f"{split}.bin"))
            cmd += ["data=bin", f"data.train_path={out}/train.bin", f"data.val_path={out}/val.bin", "data.dtype=uint8"]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.ring_threads), WANDB_MODE="disabled")
        start = time.time()
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        wall = time.time() - start
        if proc.returncode != 0:
            common.failed(f"two_million_cp at {seq} tokens", f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
            table.append([f"{seq:,}", "-", "-", "-", "-", f"failed (exit {proc.returncode}) after {wall:.0f} s"])
            continue
        record = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")).read().splitlines()][-1]
        result = json.loads(open(os.path.join(out, "result.json")).read())
        per_rank = [v for k, v in sorted(record.items()) if k.startswith("peak_rss_mb/rank")] or [record["peak_rss_mb"]]
        step_s = record.get("step_time_s", record.get("step_s", float("nan")))
        table.append([f"{seq:,}", f"{step_s:.1f}", " / ".join(f"{p / 1024:.2f}" for p in per_rank),
                      f"{record['loss']:.4f}", f"{result.get('crop_check_max_abs_diff', float('nan')):.1e}",
                      f"whole run {wall:.0f} s"])
        print(f"  {seq} tokens: step {step_s:.1f} s, peak RSS per rank {[round(p / 1024, 2) for p in per_rank]} GiB, "
              f"loss {record['loss']:.4f}", flush=True)
    print(common.table(["tokens", "step s", "peak RSS per rank GiB", "loss", "crop check diff", "note"], table))


def _print_summary(rows: list[tuple], sps: list[tuple], cap: int) -> None:
    print()
    print(f"{'layout':<6} {'mode':<15} {'cap GiB':>7} {'longest seq':>11} {'peak GiB':>8} {'step s':>7}  note")
    for layout, mode, c, best, info, note in rows:
        peak = f"{info['peak_bytes'] / 2**30:.2f}" if info else "-"
        secs = f"{info['seconds']:.1f}" if info else "-"
        print(f"{layout:<6} {mode:<15} {c / 2**30:>7.1f} {best:>11} {peak:>8} {secs:>7}  {note}")
    base = {(r[0], r[1], r[2]): r[3] for r in rows}
    off, on = base.get(("sp=1", "baseline", cap)), base.get(("sp=1", "alst", cap))
    if off and on:
        bound = any(r[1] == "alst" and r[5] for r in rows)
        print(f"ALST on / off: {on / off:.1f}x longer"
              + (" (ALST-on bound by --max-seq or the time limit, so at least this)" if bound else ""))
        common.print_ratio("longest step under the cap, ALST on / off", on / off, "at least" if bound else "")
    if sps and sps[0][3]:
        print("sp scan (longest / sp=1 longest): " + ", ".join(f"{r[0]}: {r[3] / sps[0][3]:.2f}x" for r in sps))
        for r in sps[1:]:
            common.print_ratio(f"Ulysses {r[0]} longest step / sp=1", r[3] / sps[0][3])


if __name__ == "__main__":
    main()
