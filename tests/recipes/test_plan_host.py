"""recipes.planner.host: each rank's host memory in the build, the train.init_from load and the step, by hand on a
small layout; `search` refuses layouts that do not fit the host; and (slow) the prediction against the measured
high-water mark of every phase on the host grid of benchmarks/planner.py --host (docs/planner_host.md)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import recipes.plan as plan
from benchmarks.planner import host_grid, host_layout
from recipes.planner import estimate, load_cluster
from recipes.planner.build import bucket_specs, fake_world, rank_model, zero_config
from recipes.planner.host import checkpoint_itemsize, host_fit
from recipes.planner.layouts import resolve_world
from recipes.planner.predict import memory_phases
from recipes.planner.stage3 import backward_windows
from tests.multirank import run_multirank
from tests.recipes.test_plan import TINY, config

REPO = Path(__file__).resolve().parents[2]

# model=tiny at stage 3 on 2 ranks: two blocks of 36,992 elements (units, a shard of 18,496 each) and the root (the
# tied embedding 256 x 64 and the final norm: 16,448 elements, a shard of 8,224); the largest parameter of a block
# is w1 / w3 / w2 (8,192 elements)
BLOCK, ROOT, WIDEST = 4096 + 2 * 2048 + 4096 + 3 * 8192 + 128, 256 * 64 + 64, 8192


def _checkpoint(directory, dtype: str, numel: int) -> str:
    """A safetensors file whose header says `dtype` (nothing but the header is read by the planner)."""
    itemsize = {"F32": 4, "BF16": 2}[dtype]
    header = json.dumps({"w": {"dtype": dtype, "shape": [numel], "data_offsets": [0, numel * itemsize]}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(numel * itemsize))
    return str(directory)


def test_host_phases_of_a_stage3_layout_by_hand(tmp_path):
    (tmp_path / "fp32").mkdir()
    assert checkpoint_itemsize(_checkpoint(tmp_path / "fp32", "F32", 16)) == 4
    source = _checkpoint(tmp_path, "BF16", 16)
    e = estimate(config(TINY + ["zero.stage=3", f"train.init_from={source}"]),
                 load_cluster("cpu", {"host_overhead_mb": 1}), world=2)[0]
    # the cluster's memory beyond tensors is in every phase
    assert all(v.pop("runtime_overhead") == 2**20 for v in e.host_phases.values())
    unit, root = BLOCK // 2, ROOT // 2
    params = (2 * unit + root) * 4
    # build: the shards, and a block's full buffer while it is filled beside the copy of its shard that stays
    assert e.host_phases["build"] == {"parameters": params, "bucket_filling": (BLOCK + unit) * 4}
    # load: the shards, a block's fp32 shard it is read into and the widest parameter's piece in flight (read in
    # the file's bf16, converted to fp32, copied into its fp32 box)
    assert e.host_phases["load"] == {"parameters": params, "read_buffers": unit * 4 + WIDEST * (2 + 4 + 4)}
    # step: device and host are one memory on the cpu preset: the step's largest moment, both together
    assert sum(e.host_phases["step"].values()) == e.peak_total_bytes
    assert e.host_peak_phase == "step" and e.host_peak_bytes == e.peak_total_bytes


def test_offload_and_gpu_host_figures():
    """On a GPU preset only what lives on the host counts: cpu offload's masters, moments, gradient copies and
    parameter shards; nothing without offload (no init_from)."""
    h100 = load_cluster("h100")
    plain = estimate(config(TINY + ["zero.stage=3"]), h100, world=2)[0]
    assert plain.host_peak_bytes == 0 and "load" not in plain.host_phases
    e = estimate(config(TINY + ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu"]), h100,
                 world=2)[0]
    shard = 2 * (BLOCK // 2) + ROOT // 2
    assert e.host_phases["build"] == {"parameters": shard * 4, "master_weights": shard * 4, "gradients": shard * 4}
    assert sum(e.host_phases["step"].values()) == shard * 4 * 5  # + AdamW's two moments


def test_search_refuses_layouts_that_do_not_fit_the_host(monkeypatch):
    """A layout that fits its devices but whose ranks' host peaks exceed cluster.host_memory_gb per node is left
    out of the search, with a line naming the node's need."""
    monkeypatch.setattr(plan, "candidate_overrides", lambda cfg, world: iter([{"zero.stage": 0}, {"zero.stage": 3}]))
    cluster = load_cluster("cpu", {"host_process_mb": 1})
    sharded = estimate(config(TINY + ["zero.stage=3"]), cluster, 2)
    need = sum(e.host_peak_bytes for e in sharded) + 2 * 2**20  # (stage 0 needs more: nothing sharded)
    cluster.host_memory_gb = (need + 0.5) / 1e9
    assert host_fit(sharded, cluster) is None
    refused: list[str] = []
    best = plan.search(config(TINY), cluster, 2, 5, refused)
    assert [o for _, o, _ in best] == [{"zero.stage": 3}]
    assert len(refused) == 1 and refused[0].startswith("zero.stage=0: node 0 needs ")
    assert f"cluster.host_memory_gb={cluster.host_memory_gb:g}" in refused[0]
    cluster.host_memory_gb = (need - 0.5) / 1e9  # one byte short: stage 3 is refused too
    assert host_fit(sharded, cluster) is not None


NVME = ["zero.stage=3", "zero.offload_params=nvme", "zero.offload_optimizer=nvme"]


def _moments(overrides: list[str], unified: bool = True):
    """Rank 0's config, layout, step moments (`memory_phases`, gloo's copies counted: device and host figures) and
    nvme bytes, model=tiny on 2 ranks."""
    cfg = resolve_world(config(TINY + overrides), 2)
    with fake_world(2, 0):
        rm = rank_model(cfg, 0)
        layout = bucket_specs(rm, zero_config(cfg))
        phases, nvme = memory_phases(layout, cfg, rm, 4, 1.0, copies=True, unified=unified)
    return cfg, layout, {k: d for k, (d, _) in phases.items()}, {k: h for k, (_, h) in phases.items()}, nvme


def test_stage3_nvme_parameter_reads_and_files_by_hand(tmp_path):
    """Stage 3 with parameters on nvme: each gathered bucket holds the shard it read from its file (the gather's
    source, kept until the bucket is freed) beside its full buffer: in backward the unit at work, the one prefetched
    before it and the roots; at the end of backward the roots; none at the step. On a GPU the host holds one read
    at a time. nvme bytes: the shards' files and the optimizer's (master, two moments, the spilled gradient)."""
    nvme = NVME + [f"zero.nvme_path={tmp_path}"]
    unit, root = BLOCK // 2, ROOT // 2
    _, _, dev, host, files = _moments(nvme)
    assert dev["backward"]["zero3_gathered"] == (2 * BLOCK + ROOT) * 4
    assert dev["backward"]["nvme_parameter_reads"] == (2 * unit + root) * 4
    assert dev["backward"]["collective_buffers"] == BLOCK * 4  # (the prefetch's gather in flight)
    assert dev["backward gather"]["nvme_parameter_reads"] == (unit + root) * 4
    assert dev["end of backward"]["nvme_parameter_reads"] == root * 4
    assert "nvme_parameter_reads" not in dev["step"]
    assert files == (2 * unit + root) * 4 * (1 + 4)
    _, _, dev, _, _ = _moments(nvme + ["zero.prefetch_depth=0"])
    assert dev["backward"]["nvme_parameter_reads"] == (unit + root) * 4
    _, _, dev, _, _ = _moments(["zero.stage=3"])
    assert not any("nvme_parameter_reads" in d for d in dev.values())
    _, _, dev, host, _ = _moments(nvme, unified=False)
    assert dev["backward"]["nvme_parameter_reads"] == (2 * unit + root) * 4  # (the device's copies)
    assert host["backward"]["nvme_read_buffer"] == unit * 4 and "nvme_read_buffer" not in host["step"]


def test_untied_stage3_windows_and_nvme_gradient_writes(tmp_path):
    """An untied embedding and head are units of their own: backward does not gather the embedding again (its
    backward reads only the indices), so it is in no backward window. nvme's gradient writes: after backward's
    first reduction (the head's shard, queued) its write holds the chunk's float64 copy and square (16 bytes per
    element) beside the head's staging buffer, kept for reuse, while the next units' backward runs; at the end of
    backward the last writes' temporaries count where they exceed the last reduction's collective temporary."""
    cfg, layout, dev, _, _ = _moments(NVME + [f"zero.nvme_path={tmp_path}", "model.tie_embeddings=false"])
    assert [type(m).__name__ for _, m in layout.unit_modules] == ["Embedding", "TransformerBlock",
                                                                  "TransformerBlock", "Linear"]
    assert sorted(backward_windows(layout, cfg, 4, True)) == [1, 2, 3]
    # so its shard is all-gathered once a step, the blocks' and the head's twice, the root's (the final norm) once:
    # what zero.dist.comm counted for this run on 2 ranks
    gathers = estimate(config(TINY + ["zero.stage=3", "model.tie_embeddings=false"]), world=2)[0]
    assert gathers.comm_bytes_by_kind["all_gather"] == (256 * 64 // 2 * 3 + BLOCK // 2 * 2 * 2 + 32) * 4 == 394_368
    head = 256 * 64 // 2  # (its shard; the untied head is the first bucket backward reduces)
    write = dev["first gradient write"]
    assert write["nvme_gradient_writes"] == 16 * head and write["nvme_gradient_queue"] == head * 4
    assert write["gradient_staging"] == 2 * head * 4
    # (then the second block is at work, the first prefetched)
    assert write["zero3_gathered"] == (2 * BLOCK + 64) * 4
    # the end of backward: the embedding's write (16 x 8,192) is smaller than the last reduction's gloo temporary
    end = dev["end of backward"]
    assert end["collective_buffers"] == BLOCK * 4 and "nvme_gradient_writes" not in end
    # a write goes chunk by chunk: a chunk smaller than the shard bounds its temporaries
    _, _, dev, _, _ = _moments(NVME + [f"zero.nvme_path={tmp_path}", "model.tie_embeddings=false",
                                       "zero.offload_chunk_size=1000"])
    assert dev["first gradient write"]["nvme_gradient_writes"] == 16 * 1000


def _fresh(fn, world, *args):
    return run_multirank(fn, world, *args, timeout=600, fresh=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name, _, _ in host_grid()])
def test_host_grid_within_ten_percent(layout, tmp_path, monkeypatch):
    """Every layout of the host grid (dense and MoE; ZeRO 0-3; bf16; cpu and nvme offload; tp, pp, ep; 1-4
    ranks), measured through the recipe with train.init_from: each rank's peak host memory over build, load and
    the first two steps within 10% of the planner's (docs/planner_host.md), and its nvme bytes those of the
    offload files it wrote."""
    monkeypatch.chdir(REPO)  # (the grid's checkpoints and nvme files live under runs/)
    name, world, overrides = next(g for g in host_grid() if g[0] == layout)
    result = host_layout(name, world, overrides, run=_fresh)
    assert result["error"] <= 0.10, result["ranks"]
    assert [r["nvme_bytes"] for r in result["ranks"]] == [r["nvme_measured"] for r in result["ranks"]]
