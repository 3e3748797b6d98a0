"""What a run reports beside its loss: peak memory per rank, per-layer MoE statistics of each step, and the
expert load over the whole run (a table in expert_load.txt and a heatmap in expert_load.png)."""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist
from moe_lst.models import spec as families
from omegaconf import DictConfig

import zero
from moe import collect_moe_stats
from recipes.config import atomic_write_text
from zero.dist import comm
from zero.dist.topology import default_device, peak_rss_bytes
from zero.parallel.pipeline import Pipeline


def pyplot():
    """matplotlib's pyplot on the Agg backend (figures are written to files, never shown), imported on first use
    (most runs never draw)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (and the CUDA allocator's peak on GPUs)."""
    peak = peak_rss_bytes() / 2**20
    if torch.cuda.is_available():
        peak = max(peak, torch.cuda.max_memory_allocated() / 2**20)
    return peak


def per_rank(value: float) -> list[float]:
    """`value` of every process, in global rank order (one small all-reduce over all of them: under DiLoCo that is
    every replica's ranks, more than one replica's layout, `dims.world_size`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [value]
    t = torch.zeros(world, dtype=torch.float64, device=default_device())
    t[dist.get_rank()] = value
    comm.all_reduce(t, dist.group.WORLD)
    return t.tolist()


def memory_metrics() -> dict[str, float]:
    """Peak memory: the largest over ranks as `peak_rss_mb`, and each rank's as `peak_rss_mb/rank<r>`."""
    peaks = per_rank(peak_rss_mb())
    out = {"peak_rss_mb": max(peaks)}
    if len(peaks) > 1:
        out.update({f"peak_rss_mb/rank{r}": p for r, p in enumerate(peaks)})
    return out


def moe_stats(engine, cfg: DictConfig, dims: zero.ParallelDims, pipe: Pipeline | None) -> dict:
    """Per-layer MoE statistics numbered over the whole model: under pp each stage numbers its layers
    after the MoE layers of the stages before it, and every rank gets every stage's (one gather)."""
    if pipe is None:
        return collect_moe_stats(engine.module)
    moe_layers = families.get(cfg).moe_layers(cfg)
    mine = {}
    for span, stage in zip(pipe.spans, pipe.stage_modules):
        before = sum(i < span.layers.start for i in moe_layers)
        mine.update(collect_moe_stats(stage, start=before))
    out = {}
    for part in comm.all_gather_object(mine, dims.pp_group):
        out.update(part)
    return dict(sorted(out.items()))


def moe_step_metrics(stats: dict, loads: dict[str, list[float]]) -> dict:
    """Scalar per-layer MoE metrics of the step; tokens per expert are summed into `loads`."""
    out = {}
    for key, value in stats.items():
        if isinstance(value, list):
            loads[key] = [a + b for a, b in zip(loads.get(key, [0.0] * len(value)), value)]
        else:
            out[key] = value
    return out


def load_fractions(loads: dict[str, list[float]]) -> list[tuple[str, list[float]]]:
    """(layer name, each expert's fraction of the layer's routed tokens) per MoE layer, in layer order."""
    return [(key.split("/")[1], [v / max(sum(counts), 1) for v in counts]) for key, counts in sorted(loads.items())]


def draw_heatmap(rows: list[tuple[str, list[float]]], out) -> None:
    """The expert-load heatmap of `rows` (load_fractions) as a PNG into `out` (a path or a binary file)."""
    width = len(rows[0][1])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * width + 2), 0.5 * len(rows) + 1.5))
    im = ax.imshow([frac for _, frac in rows], aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_title("expert load fraction over the run")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=100, format="png")
    plt.close(fig)


def expert_load_report(loads: dict[str, list[float]], run_dir: Path) -> str:
    """A per-layer table of expert load fractions over the run, and the same as a heatmap PNG."""
    rows = load_fractions(loads)
    width = len(rows[0][1])
    lines = ["expert load (fraction of routed tokens over the run; uniform = %.3f)" % (1 / width),
             "layer    " + " ".join(f"e{e:<5d}" for e in range(width)) + "  max/min"]
    for name, frac in rows:
        ratio = max(frac) / max(min(frac), 1e-9)
        lines.append(f"{name:<8s} " + " ".join(f"{f:.3f} " for f in frac) + f" {ratio:6.2f}")
    draw_heatmap(rows, run_dir / "expert_load.png")
    return "\n".join(lines)


def reduce_expert_loads(expert_loads: dict[str, list[float]], dims: zero.ParallelDims) -> dict[str, list[float]]:
    """Each layer's expert loads summed over the data-parallel ranks (one all-reduce per layer, in key order;
    every rank calls it)."""
    out = {}
    for key, counts in expert_loads.items():
        t_counts = torch.tensor(counts, dtype=torch.float64, device=default_device())
        comm.all_reduce(t_counts, dims.dp_sp_group)
        out[key] = t_counts.tolist()
    return out


def expert_load_media(expert_loads: dict[str, list[float]], dims: zero.ParallelDims, is_rank0: bool) -> dict:
    """The expert load so far (summed over the data-parallel ranks, as report_expert_load sums it) as W&B
    media: `expert_load/heatmap` (an Image) and `expert_load/table` (layer, expert, tokens, fraction).
    Every rank calls it (the sum is a collective); rank 0 gets the media, the others an empty dict."""
    loads = reduce_expert_loads(expert_loads, dims)
    if not is_rank0:
        return {}
    import wandb
    from PIL import Image

    rows = load_fractions(loads)
    table = wandb.Table(columns=["layer", "expert", "tokens", "fraction"])
    for (name, frac), (_, counts) in zip(rows, sorted(loads.items())):
        for expert, (f, n) in enumerate(zip(frac, counts)):
            table.add_data(name, expert, n, f)
    buf = io.BytesIO()
    draw_heatmap(rows, buf)
    buf.seek(0)
    with Image.open(buf) as png:
        image = wandb.Image(png.convert("RGB"), caption="expert load fraction since the start of the run")
    return {"expert_load/heatmap": image, "expert_load/table": table}


def report_expert_load(expert_loads: dict[str, list[float]], dims: zero.ParallelDims, run_dir: Path,
                       is_rank0: bool) -> None:
    """Sum each rank's expert loads over the data-parallel ranks; rank 0 writes the table and heatmap."""
    expert_loads.update(reduce_expert_loads(expert_loads, dims))
    if is_rank0:
        report = expert_load_report(expert_loads, run_dir)
        atomic_write_text(run_dir / "expert_load.txt", report + "\n")
        print(report, flush=True)
