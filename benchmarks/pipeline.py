"""Pipeline and tensor parallelism: schedule bubbles, activation memory, our pipeline against DeepSpeed's
pipeline engine, and tensor parallelism's parameter memory and step time.

Part 1 trains an untied Llama over pp=2 gloo ranks (one thread each: one core per stage) with every
pipeline schedule at several micro-batch counts m and reads the timeline the pipeline records each
step (`Pipeline.timeline`): how long each rank computed, against the theoretical bubble; the most
micro-batches whose activations a stage held (`max_held`); and, in one extra step per case, the peak
bytes of live saved activations (a saved-tensor hook). Part 2 trains the same model with our 1F1B (and,
for reference, our ZBV) against DeepSpeed's `PipelineModule` + pipeline engine (`train_batch`) on the
same micro-batches and initial weights. Part 3 trains it with tp=2 against dp=2 (same two cores) and
against one rank. Every run is a fresh set of processes; variants alternate in rounds so that load from
other jobs on a shared machine reaches all of them.

    python -m benchmarks.pipeline                    # all three parts
    python -m benchmarks.pipeline --parts 1 --ms 4,8
    python -m benchmarks.pipeline --quick            # small model, few steps: a smoke run

Without DeepSpeed (`import deepspeed` fails) part 2 runs ours alone, with a note.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402
from benchmarks.common import fmt, table  # noqa: E402
from benchmarks.offload import ADAMW  # noqa: E402

PP = 2
# Every framework and layout steps torch's AdamW with its fused CPU kernel (the kernel zero.FastAdamW picks).
ADAMW_FUSED = dict(ADAMW, fused=True)
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")
# Stages per rank of each schedule as this benchmark runs it (zero.parallel.pipeline's defaults).
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zb": 2, "zbv": 2,
                   "dualpipev": 2}
# DeepSpeed picks its accelerator at import; name the CPU one rather than rely on detection.
DS_ENV = {"DS_ACCELERATOR": "cpu"}


# ---------------------------------------------------------------------------- model, data, losses
def model_config(args):
    """The Llama of every part: untied head (pipeline stages refuse a head tied across stages).

    The vocabulary is kept small so that the head (on the last stage) costs about a quarter of a block
    and the two stages of 4 blocks each are nearly equal: the bubble theory assumes equal stages."""
    from moe_lst.models.llama import ModelConfig

    if args.quick:
        return ModelConfig(vocab_size=args.vocab, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256,
                           tie_embeddings=False)
    # 8 blocks of 1.57M parameters, embedding and head of 0.39M each (vocab 1024): 13.4M parameters
    return ModelConfig(vocab_size=args.vocab, dim=384, n_layers=8, n_heads=6, n_kv_heads=2, max_seq_len=256,
                       tie_embeddings=False)


def build_model(args):
    import torch

    from moe_lst.models.llama import Transformer

    torch.manual_seed(0)  # every run of every part starts from the same weights
    return Transformer(model_config(args))


def batch(step: int, rows: int, seq: int, vocab: int):
    """Step `step`'s tokens and labels [rows, seq]: the same in every framework and layout."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def mean_cross_entropy(logits, labels):
    """A micro-batch's mean token loss (what the pipeline's loss_fn returns)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class SavedActivations:
    """Live bytes of the tensors autograd saves for backward, and their peak, while installed as the
    saved-tensor hooks (`with torch.autograd.graph.saved_tensors_hooks(c.pack, c.unpack)`).

    Each storage counts once however many saved tensors view it; storages of `params` (weights saved
    by matmuls) are not activations and are left out. A saved tensor is released when autograd frees
    the graph node holding it, which drops the wrapper `pack` returned.
    """

    class _Held:
        __slots__ = ("counter", "key", "tensor")

        def __init__(self, counter, key, tensor):
            self.counter, self.key, self.tensor = counter, key, tensor

        def __del__(self):
            self.counter._release(self.key)

    def __init__(self, params) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, list[int]] = {}  # storage address -> [saved tensors viewing it, bytes]
        self.live = self.peak = 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.exclude:
            return tensor
        entry = self.refs.get(key)
        if entry is None:
            self.refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        # Detached: a saved output of an op would otherwise hold its own grad_fn, whose saved variable holds
        # this wrapper, a cycle through autograd's C++ graph that would keep it (and the count) alive
        # wherever backward retains the graph (the input-gradient step of the zero-bubble schedules).
        return self._Held(self, key, tensor.detach())

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, SavedActivations._Held) else held

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


# ---------------------------------------------------------------------------- part 1 (and ours in part 2)
def _pipeline_case(schedule: str, m: int, args, memory: bool) -> dict:
    """Train the model over pp=2 with `schedule` and m micro-batches on this rank: per measured step the
    timeline's start, end and busy time, step time (train_step + engine.step), the held micro-batches
    and the actions of the last step; with `memory`, one more step under the saved-tensor counter."""
    import torch
    import torch.distributed as dist

    from zero.parallel.pipeline import apply_pipeline

    dims = args.dims
    model = build_model(args)
    pipe = apply_pipeline(model, dims, schedule, microbatches=m, loss_fn=mean_cross_entropy)
    engine = common.initialize(pipe.module, functools.partial(torch.optim.AdamW, **ADAMW_FUSED), dims, plans=[pipe],
                               stage=0, grad_accum_steps=m, clip_grad_norm=None)
    vocab = model.cfg.vocab_size
    pos = torch.arange(args.seq).expand(m * args.rows, args.seq)
    steps, losses = [], []

    def one_step(step: int) -> tuple[float, float, float, float]:
        tokens, labels = batch(step, m * args.rows, args.seq, vocab)
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = pipe.train_step(engine, tokens, labels, position_ids=pos)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        return loss, t2 - t0, t2 - t1, time.process_time() - c0

    for step in range(args.warmup + args.steps):
        loss, elapsed, optimizer_s, cpu_s = one_step(step)
        losses.append(loss)
        if step >= args.warmup:
            tl = pipe.timeline
            steps.append({"start": tl.start, "end": tl.end, "busy": tl.busy, "step_s": elapsed,
                          "optimizer_s": optimizer_s, "cpu_s": cpu_s,
                          "own_idle": tl.idle_fraction, "max_held": tl.max_held,
                          "busy_by_kind": {k: sum(a.end - a.start for a in tl.actions if a.kind == k)
                                           for k in "FBIW"}})
    actions = [(a.kind, a.stage, a.microbatch, a.start, a.end, a.held) for a in pipe.timeline.actions]
    out = {"schedule": schedule, "m": m, "steps": steps, "losses": losses, "actions": actions,
           "stages": [p.index for p in pipe.spans], "layers": [list(p.layers) for p in pipe.spans]}
    if memory:
        counter = SavedActivations(engine.module.parameters())
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            one_step(args.warmup + args.steps)
        held = {}
        for a in pipe.timeline.actions:
            held[a.stage] = max(held.get(a.stage, 0), a.held)
        out.update(saved_peak=counter.peak, saved_left=counter.live, held_by_stage=held,
                   memory_max_held=pipe.timeline.max_held,
                   memory_actions=[(a.kind, a.stage, a.microbatch, a.start, a.end, a.held)
                                   for a in pipe.timeline.actions])
    engine.close()
    return out


def _sweep(schedule: str, ms: list[int], args) -> list[dict]:
    warnings.filterwarnings("ignore")
    args.dims = common.parallel_dims(pp=PP)
    return [_pipeline_case(schedule, m, args, memory=True) for m in ms]


def case_problem(schedule: str, m: int, n_layers: int) -> str | None:
    """Why (schedule, m) cannot run with this model, or None."""
    from zero.dist.topology import LayoutError
    from zero.parallel.pipeline import check_pipeline_layout

    try:
        v = check_pipeline_layout(schedule, PP, None, n_layers, m)
    except LayoutError as e:
        return str(e)
    if schedule == "dualpipev" and m < PP * v:
        # torch's ScheduleDualPipeV refuses it when it builds (zero.parallel.pipeline's layout check lets it through)
        return f"torch's DualPipeV needs m >= {PP * v} (the number of stages)"
    return None


def theory(schedule: str, m: int) -> float | None:
    """The bubble (idle share of each stage) with equal stages and free communication."""
    v = STAGES_PER_RANK[schedule]
    if schedule in ("gpipe", "1f1b"):
        return (PP - 1) / (m + PP - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (PP - 1) / (v * m + PP - 1)
    return None  # the zero-bubble schedules: about 0 once m is large enough


def _summarise_case(rounds: list[list[dict]]) -> dict:
    """Medians over the measured steps of every round of the pipeline-window figures (window = first
    start to last end over both ranks; a rank's idle = 1 - its busy time / window). `rounds` holds one
    list of per-rank results per round; memory and losses come from the first round."""
    per_rank = [{**r, "steps": [s for rnd in rounds for s in rnd[k]["steps"]]} for k, r in enumerate(rounds[0])]
    n = len(per_rank[0]["steps"])
    idle, own, busy, step_s, window = [[] for _ in range(PP)], [[] for _ in range(PP)], [[] for _ in range(PP)], [], []
    kinds = [{k: [] for k in "FBIW"} for _ in range(PP)]
    for i in range(n):
        st = [r["steps"][i] for r in per_rank]
        w = max(s["end"] for s in st) - min(s["start"] for s in st)
        window.append(w)
        step_s.append(max(s["step_s"] for s in st))
        for r, s in enumerate(st):
            idle[r].append(1 - s["busy"] / w)
            own[r].append(s["own_idle"])
            busy[r].append(s["busy"])
            for k in "FBIW":
                kinds[r][k].append(s["busy_by_kind"][k])
    med = statistics.median
    mean_idle = [statistics.fmean(idle[r][i] for r in range(PP)) for i in range(n)]
    r0 = per_rank[0]
    return {
        "schedule": r0["schedule"], "m": r0["m"], "theory": theory(r0["schedule"], r0["m"]),
        "idle": [med(x) for x in idle], "own_idle": [med(x) for x in own], "bubble": med(mean_idle),
        "busy": [med(x) for x in busy], "window": med(window), "step_s": med(step_s),
        "busy_by_kind": [{k: med(v) for k, v in kk.items()} for kk in kinds],
        "max_held": [max(s["max_held"] for s in r["steps"]) for r in per_rank],
        "held_by_stage": {s: h for r in per_rank for s, h in r["held_by_stage"].items()},
        "until_released": {s: h for r in per_rank for s, h in held_until_released(r["memory_actions"]).items()},
        "saved_peak": [r["saved_peak"] for r in per_rank], "saved_left": [r["saved_left"] for r in per_rank],
        "loss0": r0["losses"][0], "stages": [r["stages"] for r in per_rank], "layers": [r["layers"] for r in per_rank],
        "actions": [r["actions"] for r in per_rank],
    }


def held_until_released(actions: list) -> dict[int, int]:
    """Per stage, the most micro-batches forwarded and not yet released, where a full backward (B) or a
    weight-gradient step (W) releases one; an input-gradient step (I) does not, since W still needs
    that micro-batch's saved activations."""
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for kind, stage, _mb, _start, _end, _held in sorted(actions, key=lambda a: a[3]):
        held[stage] = held.get(stage, 0) + (1 if kind == "F" else -1 if kind in "BW" else 0)
        peak[stage] = max(peak.get(stage, 0), held[stage])
    return peak


def gantt(actions_per_rank: list[list], width: int = 96) -> list[str]:
    """One text line per rank of a step: F/B/I/W for the rank's first stage, f/b/i/w for its second,
    '.' idle; each column is 1/width of the pipeline window."""
    t0 = min(a[3] for acts in actions_per_rank for a in acts)
    t1 = max(a[4] for acts in actions_per_rank for a in acts)
    scale = width / (t1 - t0)
    lines = []
    for rank, acts in enumerate(actions_per_rank):
        row = ["."] * width
        first = min(a[1] for a in acts)
        for kind, stage, _mb, start, end, _held in acts:
            c = kind if stage == first else kind.lower()
            lo, hi = int((start - t0) * scale), max(int((start - t0) * scale) + 1, int((end - t0) * scale))
            for x in range(lo, min(hi, width)):
                row[x] = c
        lines.append(f"rank {rank} |{''.join(row)}|")
    return lines


def part1(args) -> dict:
    ms = [int(x) for x in args.ms.split(",")]
    schedules = args.schedules.split(",")
    n_layers = model_config(args).n_layers
    skipped = {(s, m): why for s in schedules for m in ms if (why := case_problem(s, m, n_layers))}
    load = [os.getloadavg()[0]]
    results, failed = _run_sweeps(schedules, ms, skipped, args)
    load.append(os.getloadavg()[0])
    cases = {key: _summarise_case(rounds) for key, rounds in results.items()}
    _print_part1_header(cases, load, args)
    _print_bubbles(cases, schedules, ms, skipped, failed)
    _print_busy_by_kind(cases, schedules, ms)
    _print_timelines(cases, schedules, ms[len(ms) // 2])
    _print_activations(cases, schedules, ms)
    print("\nAgainst the targets:")
    for m in ms:
        _print_targets(cases, m)
    for schedule, why in failed.items():
        print(f"- {schedule}: did not run: {why}")
    for (schedule, m), why in skipped.items():
        print(f"- {schedule} m={m}: not run: {why}")
    return {"skipped": {f"{s}/{m}": w for (s, m), w in skipped.items()}, "load": load,
            "cases": {f"{s}/{m}": {k: v for k, v in c.items() if k != "actions"} for (s, m), c in cases.items()},
            "failed": failed}


def _run_sweeps(schedules: list[str], ms: list[int], skipped: dict, args) -> tuple[dict, dict]:
    """Every schedule's sweep over the micro-batch counts it can run, in fresh processes, round after round.
    Returns ((schedule, m) -> per round, the per-rank results; schedule -> why it failed)."""
    results: dict = defaultdict(list)
    failed = {}
    for r in range(args.rounds):
        for schedule in schedules:
            if schedule in failed:
                continue
            run_ms = [m for m in ms if (schedule, m) not in skipped]
            if not run_ms:
                continue
            t0 = time.perf_counter()
            try:
                ranks = common.spawn(_sweep, schedule, run_ms, args, world=PP, timeout=args.timeout)
            except common.RankFailed as e:
                failed[schedule] = common.last_line(e)
                common.failed(f"part 1: {schedule}", e)
                continue
            for i, m in enumerate(run_ms):
                results[(schedule, m)].append([rk[i] for rk in ranks])
            print(f"round {r + 1}: {schedule}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return results, failed


def _measured(cases: dict, schedules: list[str], ms: list[int]):
    """(schedule, m, its summary) of every case that ran, m outside, schedules inside."""
    for m in ms:
        for schedule in schedules:
            c = cases.get((schedule, m))
            if c is not None:
                yield schedule, m, c


def _print_part1_header(cases: dict, load: list[float], args) -> None:
    cfg = model_config(args)
    print(f"\n## Part 1: pipeline schedules, pp={PP}, Llama {cfg.num_params() / 1e6:.1f}M "
          f"(dim {cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size} untied)")
    print(f"{PP} gloo ranks, 1 thread each; micro-batch {args.rows}x{args.seq} tokens; {args.warmup} warm-up + "
          f"{args.steps} measured steps, medians. Window = first start to last end of the step's schedule over "
          "both ranks; idle r = 1 - busy time of rank r / window; bubble = mean over ranks; own idle = "
          "`timeline.idle_fraction` (the rank's own start to end). Theory: (p-1)/(m+p-1) for gpipe/1f1b, "
          "(p-1)/(v*m+p-1) for interleaved_1f1b/looped_bfs (v = 2 stages per rank). "
          f"{args.rounds} round(s) of every schedule in turn, each in fresh processes; medians over the "
          f"{args.rounds * args.steps} measured steps of all rounds. Load average (1 min) {load[0]:.1f} at the start, "
          f"{load[1]:.1f} at the end.\n")
    if cases:
        some = next(iter(cases.values()))
        print("stage layers per rank: " + "; ".join(
            f"rank {r}: " + ", ".join(f"stage {s} blocks {ls[0]}-{ls[-1]}" for s, ls in zip(st, lay))
            for r, (st, lay) in enumerate(zip(some["stages"], some["layers"]))) + " (for 1-stage schedules)\n")


def _print_bubbles(cases: dict, schedules: list[str], ms: list[int], skipped: dict, failed: dict) -> None:
    """The main table: bubble (measured and theory), idle per rank, step and busy time, against 1f1b."""
    rows = []
    for m in ms:
        base = cases.get(("1f1b", m))
        for schedule in schedules:
            c = cases.get((schedule, m))
            if c is None:
                why = skipped.get((schedule, m)) or f"failed: {failed.get(schedule, '')[:80]}"
                rows.append([schedule, str(m)] + ["-"] * 11 + [why])
                continue
            rows.append([
                schedule, str(m), fmt(c["theory"], ".3f") if c["theory"] is not None else "~0",
                f"{c['idle'][0]:.3f}", f"{c['idle'][1]:.3f}", f"**{c['bubble']:.3f}**",
                f"{c['own_idle'][0]:.3f} / {c['own_idle'][1]:.3f}",
                fmt(c["bubble"] / base["bubble"]) if base and base["bubble"] > 0 else "-",
                f"{c['step_s']:.3f}", fmt(c["step_s"] / base["step_s"]) if base else "-",
                fmt(sum(c["busy"]) / sum(base["busy"])) if base else "-",
                f"{c['busy'][0]:.3f} / {c['busy'][1]:.3f}", f"{c['loss0']:.5f}", ""])
    print(table(["schedule", "m", "theory", "idle rank 0", "idle rank 1", "bubble", "own idle r0 / r1",
                 "bubble vs 1f1b", "step s", "step vs 1f1b", "busy vs 1f1b", "busy s r0 / r1", "loss step 0",
                 "note"], rows))


def _print_busy_by_kind(cases: dict, schedules: list[str], ms: list[int]) -> None:
    print("\nBusy time by kind (s, rank 0 / rank 1; I + W = a full backward split in two):\n")
    krows = [[schedule, str(m)] + [" / ".join(f"{c['busy_by_kind'][r][k]:.3f}" for r in range(PP)) for k in "FBIW"]
             for schedule, m, c in _measured(cases, schedules, ms)]
    print(table(["schedule", "m", "F", "B", "I", "W"], krows))


def _print_timelines(cases: dict, schedules: list[str], show: int) -> None:
    print(f"\nTimelines at m={show} (last measured step; F/B/I/W first stage of the rank, f/b/i/w its "
          "second, '.' idle):\n")
    for schedule in schedules:
        c = cases.get((schedule, show))
        if c is not None:
            print(f"{schedule}")
            print("```")
            print("\n".join(gantt(c["actions"])))
            print("```")


def _print_activations(cases: dict, schedules: list[str], ms: list[int]) -> None:
    """Part 1b: the micro-batches and saved-activation bytes each stage held, against GPipe."""
    print("\n## Part 1b: activations held, 1F1B against GPipe (and the rest)\n")
    print("max held = most micro-batches whose activations one stage held at once (`timeline.max_held`, per "
          "rank; per stage in brackets); saved MiB = peak bytes of live autograd-saved tensors on the rank in "
          "one step (a saved-tensor hook, each storage once, parameters excluded). `held` counts the stage's "
          "forward cache, which torch empties at the input-gradient step (I) of the zero-bubble schedules although "
          "the weight-gradient step (W) still needs the activations; 'held until B or W' counts from the actions "
          "instead (F adds one, B or W releases one).\n")
    mrows = []
    for schedule, m, c in _measured(cases, schedules, ms):
        gp = cases.get(("gpipe", m))
        held = ", ".join(f"s{s}: {h}" for s, h in sorted(c["held_by_stage"].items()))
        until = ", ".join(f"s{s}: {h}" for s, h in sorted(c["until_released"].items()))
        mrows.append([schedule, str(m), f"{c['max_held'][0]} / {c['max_held'][1]} ({held})", until,
                      f"{c['saved_peak'][0] / 2**20:.1f} / {c['saved_peak'][1] / 2**20:.1f}",
                      fmt(max(c["saved_peak"]) / max(gp["saved_peak"])) if gp else "-"])
    print(table(["schedule", "m", "max held r0 / r1 (per stage)", "held until B or W (per stage)", "saved MiB r0 / r1",
                 "largest rank vs gpipe"], mrows))


def _print_targets(cases: dict, m: int) -> None:
    """At m micro-batches: the zero-bubble schedules' bubble against 1f1b, gpipe and 1f1b against theory,
    and the micro-batches 1f1b holds."""
    base = cases.get(("1f1b", m))
    for schedule in ZERO_BUBBLE:
        c = cases.get((schedule, m))
        if c is None or base is None:
            continue
        ratio = c["bubble"] / base["bubble"] if base["bubble"] > 0 else None
        print(f"- m={m} {schedule}: bubble {c['bubble']:.3f} vs 1f1b {base['bubble']:.3f} = {fmt(ratio, '.3f')}x "
              f"(target <= 0.5x: {'met' if ratio is not None and ratio <= 0.5 else 'MISSED'}); step time "
              f"{c['step_s'] / base['step_s']:.2f}x 1f1b, busy {sum(c['busy']) / sum(base['busy']):.2f}x")
        common.print_ratio(f"pp={PP} bubble at m={m}, {schedule} / 1f1b", ratio)
    for schedule in ("gpipe", "1f1b"):
        c = cases.get((schedule, m))
        if c is not None:
            print(f"- m={m} {schedule}: bubble {c['bubble']:.3f}, theory {c['theory']:.3f} "
                  f"(measured - theory {c['bubble'] - c['theory']:+.3f})")
            common.print_ratio(f"pp={PP} bubble at m={m}, {schedule} measured / theory", c["bubble"] / c["theory"])
    c, g = cases.get(("1f1b", m)), cases.get(("gpipe", m))
    if c is not None:
        ok = max(c["held_by_stage"].values()) <= PP
        print(f"- m={m} 1f1b holds at most {max(c['held_by_stage'].values())} micro-batches per stage "
              f"(target <= p={PP}: {'met' if ok else 'MISSED'})"
              + (f"; gpipe {max(g['held_by_stage'].values())} (m={m}); saved-activation peak 1f1b/gpipe "
                 f"{max(c['saved_peak']) / max(g['saved_peak']):.2f}" if g is not None else ""))


# ---------------------------------------------------------------------------- part 2: against DeepSpeed
def _deepspeed_layers(model):
    """The model's own modules as DeepSpeed pipeline layers: embedding, one layer per block (RoPE tables
    from the positions 0..s-1, as our stages get them), final norm + head."""
    import torch
    import torch.nn as nn

    from moe_lst.models.llama import rope_cos_sin

    cfg = model.cfg

    class Embed(nn.Module):
        def __init__(self, embedding):
            super().__init__()
            self.embedding = embedding

        def forward(self, tokens):
            return self.embedding(tokens)

    class Block(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, h):
            pos = torch.arange(h.shape[1]).expand(h.shape[0], -1)
            cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
            return self.block(h, cos, sin)

    class Head(nn.Module):
        def __init__(self, norm, output):
            super().__init__()
            self.norm, self.output = norm, output

        def forward(self, h):
            return self.output(self.norm(h))

    return [Embed(model.tok_embeddings)] + [Block(b) for b in model.layers] + [Head(model.norm, model.output)]


class _Clock:
    """Wall seconds and calls of the functions it wraps (`clock.wrap(fn, key)`), summed per key."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, fn, key: str):
        def run(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1
        return run


def _vs_deepspeed(framework: str, args) -> dict:
    """pp=2 training on this rank by `framework` ("ours <schedule>" or "deepspeed"): step times, their
    breakdown, losses, peak RSS."""
    warnings.filterwarnings("ignore")
    baseline = common.rss_mb()
    if framework.startswith("ours "):
        times, losses, parts = _ours_pipeline_steps(framework.split()[1], args)
    elif framework == "deepspeed":
        times, losses, parts = _deepspeed_pipeline_steps(args)
    else:
        raise ValueError(framework)
    med = {k: statistics.median(p[k] for p in parts) for k in ("compute", "optimizer", "rest", "cpu")}
    return {"times": times, "losses": losses, "parts": med, "peak_rss_mb": common.peak_rss_mb(),
            "baseline_rss_mb": baseline}


def _ours_pipeline_steps(schedule: str, args) -> tuple[list[float], list[float], list[dict]]:
    """Our pipeline (`schedule`, ds_m micro-batches): measured step times, every loss, per-step breakdown."""
    args.dims = common.parallel_dims(pp=PP)
    res = _pipeline_case(schedule, args.ds_m, args, memory=False)
    parts = [{"compute": s["busy"], "optimizer": s["optimizer_s"], "cpu": s["cpu_s"],
              "rest": s["step_s"] - s["busy"] - s["optimizer_s"]} for s in res["steps"]]
    return [s["step_s"] for s in res["steps"]], res["losses"], parts


def _deepspeed_pipeline_steps(args) -> tuple[list[float], list[float], list[dict]]:
    """DeepSpeed's PipelineModule + `train_batch` on the same model, weights and micro-batches: measured
    step times, every loss, per-step breakdown (its instructions timed by kind)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    m = args.ds_m
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group already made
    model = build_model(args)
    vocab = model.cfg.vocab_size
    module = PipelineModule(layers=_deepspeed_layers(model), num_stages=PP, loss_fn=mean_cross_entropy,
                            partition_method="type:Block")
    config = {"train_micro_batch_size_per_gpu": args.rows, "gradient_accumulation_steps": m,
              "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(module.parameters(), **ADAMW_FUSED),
                                      config=config, dist_init_required=False)
    # Time each instruction of DeepSpeed's schedule by kind (its engine runs them from this map).
    clock = _Clock()
    engine._INSTRUCTION_MAP = {cls: clock.wrap(fn, cls.__name__) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
    spent = clock.seconds
    times, losses, parts = [], [], []
    for step in range(args.warmup + args.steps):
        tokens, labels = batch(step, m * args.rows, args.seq, vocab)
        micro = [(tokens[i * args.rows:(i + 1) * args.rows], labels[i * args.rows:(i + 1) * args.rows])
                 for i in range(m)]
        dist.barrier()
        spent.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = engine.train_batch(iter(micro))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        losses.append(float(loss))
        if step >= args.warmup:
            times.append(elapsed)
            compute = spent["ForwardPass"] + spent["BackwardPass"]
            parts.append({"compute": compute, "optimizer": spent["OptimizerStep"], "cpu": cpu,
                          "rest": elapsed - compute - spent["OptimizerStep"]})
    return times, losses, parts


def part2(args) -> dict:
    # "ours 1f1b" is the comparison the target is about; further schedules of ours run alongside for reference.
    variants = common.without_deepspeed([f"ours {sched}" for sched in args.ds_ours.split(",")] + ["deepspeed"],
                                        "part 2: DeepSpeed's pipeline engine")
    load = [os.getloadavg()[0]]
    runs, errors = _part2_rounds(variants, args)
    load.append(os.getloadavg()[0])
    _print_part2(runs, errors, variants, load, args)
    out: dict = {"runs": runs, "errors": errors, "ratio": {}, "cpu_ratio": {}, "loss_diff": {}}
    if not runs.get("deepspeed"):
        return out
    med = {v: statistics.median(x["step_s"] for x in rs) for v, rs in runs.items() if rs}
    cpu = {v: statistics.median(max(p["cpu"] for p in x["parts"]) for x in rs) for v, rs in runs.items() if rs}
    for variant in variants[:-1]:
        if not runs[variant]:
            continue
        ratio = med[variant] / med["deepspeed"]
        diff = [abs(a - b) for a, b in zip(runs[variant][0]["losses"], runs["deepspeed"][0]["losses"])]
        target = f" (target <= 0.9: {'met' if ratio <= 0.9 else 'MISSED'})" if variant == "ours 1f1b" else ""
        print(f"- {variant}: step time median over rounds {med[variant]:.3f} s against DeepSpeed "
              f"{med['deepspeed']:.3f} s: **{ratio:.3f}x**{target}; per round "
              + ", ".join(f"{a['step_s'] / b['step_s']:.2f}" for a, b in zip(runs[variant], runs["deepspeed"]))
              + f"; CPU time per step (larger rank) {cpu[variant]:.3f} s vs {cpu['deepspeed']:.3f} s = "
              f"{cpu[variant] / cpu['deepspeed']:.2f}x; losses: step 0 differs by {diff[0]:.2e}, at most "
              f"{max(diff):.2e} over {len(diff)} steps")
        common.print_ratio(f"pp={PP} step time, {variant} / DeepSpeed", ratio)
        out["ratio"][variant], out["cpu_ratio"][variant] = ratio, cpu[variant] / cpu["deepspeed"]
        out["loss_diff"][variant] = diff
    return out


def _part2_rounds(variants: list[str], args) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Every variant once per round in fresh processes, rounds alternating. Returns (variant -> per round:
    slowest rank's median step time, losses, per-rank breakdown, RSS; variant -> why it failed)."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    errors = {}
    for r in range(args.ds_rounds):
        for variant in variants:
            if variant in errors:
                continue
            try:
                ranks = common.spawn(_vs_deepspeed, variant, args, world=PP, timeout=args.timeout, env=DS_ENV)
            except common.RankFailed as e:
                errors[variant] = str(e)
                if variant == "deepspeed":  # the peer's failure is a result (reported below), ours a bug
                    common.peer_failed("DeepSpeed pipeline", e)
                else:
                    common.failed(f"part 2: {variant}", e)
                continue
            runs[variant].append({"step_s": _slowest_rank_median(ranks), "losses": ranks[-1]["losses"],
                                  "parts": [rk["parts"] for rk in ranks], **common.rss_over_ranks(ranks)})
            print(f"round {r + 1}: {variant} {runs[variant][-1]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    return runs, errors


def _slowest_rank_median(ranks: list[dict]) -> float:
    """The slowest rank per step, then the median over steps."""
    return statistics.median(max(x) for x in zip(*(rk["times"] for rk in ranks)))


def _print_part2(runs: dict, errors: dict, variants: list[str], load: list[float], args) -> None:
    print(f"\n## Part 2: pp={PP}, ours against DeepSpeed's pipeline engine, m={args.ds_m} micro-batches of "
          f"{args.rows}x{args.seq}")
    n_layers = model_config(args).n_layers
    print(f"Same model and initial weights, same micro-batches, torch AdamW {ADAMW} (fused=True), fp32, no clipping "
          "(DeepSpeed `gradient_clipping: 0.0`); ours: `apply_pipeline(..., schedule)` + `zero.initialize` "
          f"(stage 0); DeepSpeed: `PipelineModule` (embedding, {n_layers} block layers, norm+head; partition "
          f"`type:Block`, {n_layers // PP} blocks per stage) + `deepspeed.initialize` + `engine.train_batch` (its "
          "1F1B-style TrainSchedule). Step time = "
          f"slowest rank, median of {args.steps} steps after {args.warmup} warm-up; {args.ds_rounds} alternating "
          f"round(s). Load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end.\n")
    if errors.get("deepspeed"):
        print(f"DeepSpeed did not run: {common.last_line(errors['deepspeed'])}")
    rows = []
    for r in range(args.ds_rounds):
        ds = runs["deepspeed"][r] if r < len(runs.get("deepspeed", [])) else None
        for variant in variants:
            x = runs[variant][r] if r < len(runs[variant]) else None
            if x is None:
                continue
            rows.append([str(r + 1), variant, f"{x['step_s']:.3f}", fmt(x["step_s"] / ds["step_s"]) if ds else "-"]
                        + [" / ".join(f"{p[k]:.3f}" for p in x["parts"])
                           for k in ("compute", "optimizer", "rest", "cpu")]
                        + [f"{x['peak_rss_mb']:.0f}", f"{x['train_rss_mb']:.0f}",
                           " ".join(f"{v:.5f}" for v in x["losses"])])
    print(table(["round", "framework", "step s", "vs DeepSpeed", "compute s r0 / r1", "optimizer s r0 / r1",
                 "rest s r0 / r1", "CPU s r0 / r1", "peak RSS MB", "train RSS MB", "losses"], rows))
    print("\ncompute = forward + backward computations of the rank's stage (ours: `timeline.busy`; DeepSpeed: its "
          "ForwardPass and BackwardPass instructions, timed by wrapping its instruction map); optimizer = "
          "`engine.step()` / its OptimizerStep; rest = the step time less both: waiting on the other stage, "
          "sends and receives, loss, schedule bookkeeping; CPU = the process's CPU time over the step, all threads "
          "(what the step cost the machine, less sensitive to other jobs' load than wall time). Medians per rank.\n")


# ---------------------------------------------------------------------------- part 3: tensor parallelism
def _tp_run(layout: dict, args) -> dict:
    """Train the model (no pipeline) with `layout` for warmup + steps; global batch tp_rows x seq."""
    import torch

    from zero.dist import comm
    from zero.parallel.tensor import apply_tensor_parallel

    warnings.filterwarnings("ignore")
    baseline = common.rss_mb()
    # Time spent inside zero.dist.comm's collectives (tensor parallelism and the engine call them through the module).
    clock = _Clock()
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        setattr(comm, name, clock.wrap(getattr(comm, name), "collectives"))
    dims = common.parallel_dims(**layout)
    coord = dims.coordinate()
    model = build_model(args)
    vocab = model.cfg.vocab_size
    tp = apply_tensor_parallel(model, dims.tp_group)
    engine = common.initialize(model, functools.partial(torch.optim.AdamW, **ADAMW_FUSED), dims, plans=[tp],
                               stage=0, clip_grad_norm=None)
    param_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    breakdown = engine.memory_breakdown()
    steps = [_tp_step(engine, dims, coord["dp"], clock, step, vocab, args) for step in range(args.warmup + args.steps)]
    engine.close()
    measured = steps[args.warmup:]
    return {"times": [s["step_s"] for s in measured], "losses": [s["loss"] for s in steps],
            "comm_s": statistics.median(s["comm_s"] for s in measured),
            "comm_calls": max(s["comm_calls"] for s in measured),
            "cpu_s": statistics.median(s["cpu_s"] for s in measured), "param_bytes": param_bytes,
            "breakdown": breakdown, "peak_rss_mb": common.peak_rss_mb(), "baseline_rss_mb": baseline}


def _tp_step(engine, dims, dp_rank: int, clock: _Clock, step: int, vocab: int, args) -> dict:
    """One step on this rank's rows of step `step`'s batch: its time, CPU time, time and calls in
    collectives, and the loss averaged over the data-parallel ranks."""
    import torch
    import torch.distributed as dist

    from zero.parallel.tensor import vocab_parallel_cross_entropy

    per = args.tp_rows // dims.dp
    tokens, labels = batch(step, args.tp_rows, args.seq, vocab)
    tokens, labels = (t[dp_rank * per:(dp_rank + 1) * per] for t in (tokens, labels))
    pos = torch.arange(args.seq).expand_as(tokens)
    if dims.distributed:
        dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    k0, n0 = clock.seconds["collectives"], clock.calls["collectives"]
    logits = engine(tokens, pos)
    loss_sum, count = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), dims.tp_group)
    loss = loss_sum / count
    engine.backward(loss)
    engine.step()
    elapsed = time.perf_counter() - t0
    cpu, spent, calls = time.process_time() - c0, clock.seconds["collectives"] - k0, clock.calls["collectives"] - n0
    value = torch.tensor([loss.item()], dtype=torch.float64)
    if dims.dp > 1:
        dist.all_reduce(value, group=dims.dp_group)
    return {"step_s": elapsed, "cpu_s": cpu, "comm_s": spent, "comm_calls": calls, "loss": float(value) / dims.dp}


TP_LAYOUTS = {"tp=1, 1 rank": ({"dp": 1}, 1), "dp=2": ({"dp": 2}, 2), "tp=2": ({"tp": 2}, 2)}


def part3(args) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in TP_LAYOUTS}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, (layout, world) in TP_LAYOUTS.items():
            ranks = common.spawn(_tp_run, layout, args, world=world, timeout=args.timeout)
            step_s = _slowest_rank_median(ranks)
            runs[name].append({"step_s": step_s, "losses": ranks[0]["losses"],
                               "comm_s": max(rk["comm_s"] for rk in ranks), "comm_calls": ranks[0]["comm_calls"],
                               "cpu_s": max(rk["cpu_s"] for rk in ranks),
                               "param_bytes": max(rk["param_bytes"] for rk in ranks),
                               "breakdown": ranks[0]["breakdown"], **common.rss_over_ranks(ranks)})
            print(f"round {r + 1}: {name} {step_s:.3f} s/step", file=sys.stderr, flush=True)
    load.append(os.getloadavg()[0])
    med = {name: statistics.median(x["step_s"] for x in v) for name, v in runs.items()}
    first = {name: v[0] for name, v in runs.items()}
    one = first["tp=1, 1 rank"]
    print(f"\n## Part 3: tensor parallelism, global batch {args.tp_rows}x{args.seq} per step (one micro-batch)")
    print("tp=2: 2 ranks, each the whole batch, Megatron-style tensor + sequence parallel, vocab-parallel "
          f"loss; dp=2: 2 ranks, {args.tp_rows // 2} rows each (the same two cores, the fair time comparison); "
          "tp=1, 1 rank: one process, one thread (the memory baseline). Stage 0, fp32, torch AdamW (fused), no "
          "clipping. param MB = sum of numel x itemsize of the engine's parameters on one rank (= "
          f"`memory_breakdown()['params']`); step time = slowest rank, median of {args.steps} steps after "
          f"{args.warmup} warm-up, then the median over {args.rounds} alternating round(s); in collectives = time "
          "inside zero.dist.comm's all-reduce / all-gather / reduce-scatter calls per step (slowest rank; asynchronous "
          "launches count only their launch), CPU = the process's CPU time per step (larger rank). Load average "
          f"(1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end.\n")
    rows = []
    for name, v in runs.items():
        x = first[name]
        rows.append([name, f"{x['param_bytes'] / 2**20:.1f}", f"{x['breakdown']['params'] / 2**20:.1f}",
                     f"**{x['param_bytes'] / one['param_bytes']:.3f}**", f"{med[name]:.3f}",
                     f"{med[name] / med['dp=2']:.2f}", f"{med[name] / med['tp=1, 1 rank']:.2f}",
                     f"{statistics.median(r['comm_s'] for r in v):.3f} ({x['comm_calls']})",
                     f"{statistics.median(r['cpu_s'] for r in v):.3f}",
                     " ".join(f"{r['step_s']:.3f}" for r in v), f"{x['peak_rss_mb']:.0f}", f"{x['train_rss_mb']:.0f}",
                     " ".join(f"{val:.5f}" for val in x["losses"])])
    print(table(["layout", "param MB / rank", "memory_breakdown params MB", "params vs tp=1", "step s",
                 "vs dp=2", "vs tp=1 (1 rank)", "in collectives s (calls)", "CPU s", "per round", "peak RSS MB",
                 "train RSS MB", "losses"], rows))
    ratio = first["tp=2"]["param_bytes"] / one["param_bytes"]
    diff = max(abs(a - b) for name in runs for a, b in zip(first[name]["losses"], one["losses"]))
    print(f"\ntp=2 parameter memory per rank {ratio:.3f}x tp=1 "
          f"(target <= 0.55: {'met' if ratio <= 0.55 else 'MISSED'}); "
          f"step time {med['tp=2'] / med['dp=2']:.2f}x dp=2 on the same cores, "
          f"{med['tp=2'] / med['tp=1, 1 rank']:.2f}x one rank; losses of the layouts differ by at most {diff:.2e}")
    common.print_ratio("tp=2 parameter memory per rank / tp=1", ratio)
    common.print_ratio("tp=2 step time / dp=2 on the same cores", med["tp=2"] / med["dp=2"])
    return {"runs": runs, "param_ratio": ratio, "loss_diff": diff}


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and few steps (smoke run)")
    parser.add_argument("--parts", default="1,2,3")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="part 1: schedules to run")
    parser.add_argument("--ms", default=None, help="part 1: micro-batch counts (default 2,4,8; quick 2,4)")
    parser.add_argument("--ds-m", type=int, default=None, help="part 2: micro-batches per step (default 8; quick 4)")
    parser.add_argument("--rows", type=int, default=2, help="rows (sequences) per micro-batch")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; quick 64)")
    parser.add_argument("--ds-ours", default=None, help="part 2: our schedules to run against DeepSpeed "
                        "(default 1f1b,zbv; quick 1f1b)")
    parser.add_argument("--ds-rounds", type=int, default=None, help="part 2: alternating rounds (default 3; quick 1)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size of the model")
    parser.add_argument("--tp-rows", type=int, default=4, help="part 3: sequences per step")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 2; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 4; quick 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="parts 1, 3: alternating rounds of every variant (default 2; quick 1)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    q = args.quick
    common.quick_mode(q, "zero.engine", "zero.parallel.pipeline", "zero.parallel.tensor", "moe_lst.models.llama")
    args.ds_ours = args.ds_ours or ("1f1b" if q else "1f1b,zbv")
    args.ms = args.ms or ("2,4" if q else "2,4,8")
    args.ds_m = args.ds_m or (4 if q else 8)
    args.seq = args.seq or (64 if q else 128)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 2)
    args.steps = args.steps or (2 if q else 4)
    args.rounds = args.rounds or (1 if q else 2)
    args.ds_rounds = args.ds_rounds or (1 if q else 3)
    common.run_parts("pipeline", (part1, part2, part3), args, argv)
    common.finish()


if __name__ == "__main__":
    main()
