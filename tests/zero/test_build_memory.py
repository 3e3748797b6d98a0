"""No rank ever holds the whole model: an accounting of live tensor storages (not RSS) through the recipe's build,
its materialisation by the engine, train.init_from and the first step of the MoE Llama at ZeRO-3 with ep=2, at tp=2
and at pp=2, and of a Hugging Face MoE (qwen3_moe) at ZeRO-3 with ep=2, at tp=2 (its experts split by hidden
units) and at pp=2; and the meta build gives every parameter, and every rank's slice of one, an eager build's values
(both families).

`StorageLedger` sees every CPU storage an op creates or touches (a TorchDispatchMode) and forgets it when torch
frees it (weakref.finalize on the storage, whose Python object torch keeps exactly as long as the storage lives),
re-reading sizes as it goes (stage 3 resizes its gathered buffers in place): live bytes and their peak per phase.
"""

import functools
import gc
import weakref

import pytest
import torch
from moe_lst.models.llama import ModelConfig, MoEConfig, Transformer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.multirank import run_multirank
from tests.recipes.pretrained import RUN_MODEL, pretrained_fixture  # noqa: F401 (the `pretrained` fixture)
from zero.parallel.tensor import TensorSplit
from zero.plan import Placement


class StorageLedger(TorchDispatchMode):
    """Live bytes of the CPU storages that ops created or touched since it started, and their peak per phase."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.total = 0
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self.probe = None  # () -> bytes: a second figure whose peak per phase is kept (the engine's gathered units)
        self.probe_peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}

    def set_phase(self, name: str) -> None:
        gc.collect()  # (storages held only by reference cycles are freed now, not at some later collection)
        self.refresh()
        self.phase = name
        self.starts.setdefault(name, self.total)
        self.peaks[name] = max(self.peaks.get(name, 0), self.total)

    def _forget(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total -= entry[1]

    def _see(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_meta:
            return
        s = t.untyped_storage()
        key, n = s._cdata, s.nbytes()
        if key in self.live:
            self.total += n - self.live[key][1]
            self.live[key] = (self.live[key][0], n)
            return
        self.live[key] = (weakref.ref(s), n)
        self.total += n
        weakref.finalize(s, self._forget, key)

    def refresh(self) -> None:
        """Re-read every live storage's size (a storage resized without an op: a stage-3 unit freed)."""
        for key, (ref, n) in list(self.live.items()):
            s = ref()
            if s is not None and s.nbytes() != n:
                self.total += s.nbytes() - n
                self.live[key] = (ref, s.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((out, args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._see(t)
        self.refresh()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.total)
        if self.probe is not None:
            self.probe_peaks[self.phase] = max(self.probe_peaks.get(self.phase, 0), self.probe())
        return out


#: What a rank keeps besides its parameters, their gradients and buffers: an int32 pair of the run's state.
INTEGER_STATE = 8
STEP = ["train.micro_batch_size=2", "train.steps=1", "optim.warmup_steps=1"]
# (tp2 and pp2 at the default stage: resident buckets, loaded parameter by parameter; and at stage 3)
LAYOUTS = {"ep2_zero3": ["parallel.ep=2", "zero.stage=3"], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2",
           "train.grad_accum=2"], "tp2_zero3": ["parallel.tp=2", "zero.stage=3"],
           "pp2_zero3": ["parallel.pp=2", "train.grad_accum=2", "zero.stage=3"]}


def _unit_bytes(cfg) -> tuple[int, int, int]:
    """(the largest unit's fp32 bytes: a block of the full model, or the root unit of the parameters outside the
    blocks (the embedding, the head, the final norm), as stage 3 groups them; the largest single parameter's; the
    whole model's)."""
    from moe_lst.models import spec as families

    import zero

    model = families.get(cfg).shape_model(cfg, zero.ParallelDims())
    blocks = model.blocks()
    units = [sum(p.numel() for p in block.parameters()) for _, block in blocks]
    inside = {id(p) for _, block in blocks for p in block.parameters()}
    units.append(sum(p.numel() for p in model.parameters() if id(p) not in inside))
    largest = max(p.numel() for p in model.parameters())
    return 4 * max(units), 4 * largest, 4 * sum(p.numel() for p in model.parameters())


def _held(run, buckets) -> dict:
    """What the rank owns once built and loaded, from the engine (not the ledger): the fp32 bytes of its part of
    the parameters (a resident bucket whole, a stage-3 one's shard), the bytes of the engine's storages (those
    values, their gradients where allocated) and of the model's materialised buffers."""
    owned = sum(4 * (b.numel if b.resident else sum(hi - lo for _, lo, hi in b.shard_ranges())) for b in buckets)
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for b in buckets
                for t in (b.full, b.local, b.grad_full, b.grad_acc) if t is not None}
    buffers = {b.untyped_storage()._cdata: b.untyped_storage().nbytes() for b in run.model.buffers()
               if not b.is_meta and b.device.type == "cpu"}
    return {"owned": owned, "engine_bytes": sum(storages.values()), "buffers": sum(buffers.values())}


def _measure(overrides: list[str], run_dir: str, old_path: bool) -> dict:
    """One rank of a recipe run under the ledger: peaks of the build, the engine's materialisation, the load and
    the first step, what the rank keeps once loaded, and the peak of gathered stage-3 units during the step."""
    from moe_lst.models import loading
    from moe_lst.models import spec as families
    from moe_lst.models.spec import FamilySpec

    import recipes.pretrain as pretrain
    from tests.recipes.test_pretrain import _cfg

    ledger = StorageLedger()
    wrapped = {}

    def phase(name, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            ledger.set_phase(name)
            try:
                return fn(*a, **k)
            finally:
                ledger.set_phase(name + " done")
        return run

    for name, owner, attr in (("build", pretrain, "build_model"), ("engine", pretrain, "build_engine"),
                              ("load", loading.StreamingWeights, "load_into")):
        wrapped[(owner, attr)] = getattr(owner, attr)
        setattr(owner, attr, phase(name, getattr(owner, attr)))
    cfg = _cfg(run_dir, *overrides)
    family = type(families.get(cfg))
    old_rule = family.builds_on_meta
    if old_path:  # the rule before meta builds for every model: dense at stage 3 or pp, tp=1
        family.builds_on_meta = FamilySpec.builds_on_meta
    try:
        with ledger:
            run = pretrain.Run(cfg)
            ledger.set_phase("settled")
            base = ledger.starts["build"]  # (live when the build began: the data, the run directory's state)
            kept = ledger.total - base
            buckets = run.engine.buckets
            resident = sum(b.full.untyped_storage().nbytes() for b in buckets if b.resident)
            held = _held(run, buckets)
            ledger.probe = lambda: sum(b.full.untyped_storage().nbytes() for b in buckets if not b.resident)
            ledger.set_phase("step")
            pretrain.train_step(run.engine, run.train_stream, 0, cfg, run.dims, run.pipe)
            ledger.set_phase("end")
        unit, param, whole = _unit_bytes(cfg)
        units: dict = {}
        root = 0  # (the embedding and head: gathered for the whole step)
        for b, spec in zip(buckets, run.engine.layout.buckets):
            if b.resident:
                continue
            if spec.role == "root":
                root += b.padded * b.full.element_size()
            else:
                units[spec.unit] = units.get(spec.unit, 0) + b.padded * b.full.element_size()
        gathered_units = max(units.values(), default=0)  # this rank's largest unit, gathered
        return {"peaks": {k: v - base for k, v in ledger.peaks.items()}, "kept": kept, "unit": unit, "param": param,
                "whole": whole, "resident": resident, "probe": ledger.probe_peaks.get("step", 0),
                "largest_bucket": gathered_units,
                "prefetch": run.engine.config.prefetch_depth, "root": root, **held}
    finally:
        family.builds_on_meta = old_rule
        for (owner, attr), fn in wrapped.items():
            setattr(owner, attr, fn)
        if "run" in locals():
            run.logger.finish()
            if run.lock is not None:
                run.lock.close()


def _check(results: list[dict], layout: str) -> None:
    """During build (nothing owned yet: the model is on the meta device), materialisation and load, live bytes
    never pass what the rank keeps plus the largest unit being materialised and the one-parameter temporary its
    values are drawn or read into; during the first step the gathered stage-3 buffers never pass the root's
    (embedding, head) and (1 + prefetch depth) of the rank's largest unit. What the rank keeps is what it owns,
    counted from the engine: its part of the parameters (under pp its stage's, under tp its slices, at stage 3 its
    shard), their gradients where allocated, the materialised buffers and a few bytes of integer state; and no rank
    owns the whole model (at least a unit's worth lies on the other rank)."""
    for rank, r in enumerate(results):
        for name, owned in (("build", 0), ("engine", r["kept"]), ("load", r["kept"])):
            peak = r["peaks"].get(name, 0)
            assert peak <= owned + r["unit"] + r["param"], (
                f"{layout} rank {rank}: {name} peaked at {peak} bytes of live storages, more than the {owned} it "
                f"owns then plus the largest unit {r['unit']} (whole model {r['whole']}, fp32; peaks {r['peaks']})")
        assert r["kept"] <= r["engine_bytes"] + r["buffers"] + INTEGER_STATE, (
            f"{layout} rank {rank}: keeps {r['kept']} bytes once loaded, more than the engine's {r['engine_bytes']} "
            f"and the buffers' {r['buffers']}")
        assert r["engine_bytes"] <= 2 * r["owned"] and r["owned"] <= r["whole"] - r["unit"], (
            f"{layout} rank {rank}: owns {r['owned']} parameter bytes (the engine holds {r['engine_bytes']}) of the "
            f"whole model's {r['whole']}, more than all but its largest unit {r['unit']}")
        assert r["probe"] <= r["root"] + (1 + r["prefetch"]) * r["largest_bucket"], (layout, rank, r["probe"], r)


# (the Hugging Face MoE's default case is its init_from equivalence in tests/recipes/test_streaming_load.py)
@pytest.mark.parametrize("family,layout", [("llama", "ep2_zero3"),
                                           *(pytest.param("hf", k, marks=pytest.mark.slow) for k in
                                             ("ep2_zero3", "pp2", "tp2")),
                                           *(pytest.param("llama", k, marks=pytest.mark.slow) for k in
                                             ("tp2", "pp2", "tp2_zero3", "pp2_zero3"))])
def test_no_rank_holds_more_than_its_part_plus_one_unit(pretrained, tmp_path, family, layout):
    results = run_multirank(_measure, 2, [*RUN_MODEL[family](pretrained[family]), *STEP, *LAYOUTS[layout]],
                            str(tmp_path / "run"), False, timeout=300)
    _check(results, f"{family} {layout}")


@pytest.mark.parametrize("family,layout", [("llama", "ep2_zero3"),
                                           *(pytest.param("hf", k, marks=pytest.mark.slow) for k in
                                             ("ep2_zero3", "pp2", "tp2"))])
def test_the_eager_build_of_the_old_path_fails_the_same_check(pretrained, tmp_path, family, layout):
    """Built whole on every rank (the rule before: MoE models eagerly, every stage on every pipeline rank), the
    build's peak passes the bound: the accounting sees what it is there to see."""
    results = run_multirank(_measure, 2, [*RUN_MODEL[family](pretrained[family]), *STEP, *LAYOUTS[layout]],
                            str(tmp_path / "run"), True, timeout=300)
    with pytest.raises(AssertionError, match="build peaked at"):
        _check(results, f"{family} {layout} (old path)")


def test_a_meta_build_gives_every_parameter_and_slice_the_eager_values():
    """Dense and MoE parameters (experts, router, shared experts), whole and as any rank's slice (experts along
    dim 0, tensor-parallel rows or columns), equal an eager build's with the same seed bit for bit, and the global
    generator continues where the eager build left it."""
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64,
                      moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=48, num_shared_experts=1, first_dense=0))
    torch.manual_seed(3)
    eager = Transformer(cfg)
    after = torch.empty(8).normal_()
    torch.manual_seed(3)
    meta = Transformer(cfg, device="meta")
    for name, p in eager.named_parameters():
        got = torch.empty_like(p)
        meta.init_parameter(name, got)
        assert torch.equal(got, p), name
        for dim, n in enumerate(p.shape):
            if n % 2:
                continue
            local = p.shape[:dim] + (n // 2,) + p.shape[dim + 1:]
            placement = Placement.along(local, dim, n, [(0, n // 2, n // 2)])
            got = torch.empty(local)
            meta.init_parameter(name, got, placement)
            assert torch.equal(got, p.narrow(dim, n // 2, n // 2)), (name, dim)
    meta.continue_global_generator()
    assert torch.equal(torch.empty(8).normal_(), after)
    assert all(b.device.type == "cpu" and not b.any() for b in meta.buffers())


@pytest.mark.parametrize("kind", ["olmoe", *(pytest.param(k, marks=pytest.mark.slow) for k in ("qwen3_moe",
                                                                                                "mixtral"))])
def test_a_hugging_face_moe_meta_build_gives_the_eager_values(kind):
    """A Hugging Face MoE built on the meta device: every parameter, half of the experts (a rank's slice under
    ep=2) and a tp=2 rank's hidden units of every expert (rows, [gate; up] rows as two halves, down columns: the
    TensorSplits of expert tensor parallelism), equal transformers' eager build with the same seed bit for bit (its
    init's fills replayed, a padding row zeroed after its fill included: olmoe's), as do the buffers, and the global
    generator continues where the eager build left it."""
    from moe_lst.models.hf import build

    from tests.hf.tiny import tiny_config

    config = tiny_config(kind, pad_token_id=1)
    torch.manual_seed(11)
    eager = build(config)
    after = torch.empty(8).normal_()
    torch.manual_seed(11)
    meta = build(config, meta=True)
    assert all(p.is_meta for p in meta.parameters())
    meta.continue_global_generator()
    assert torch.equal(torch.empty(8).normal_(), after)
    for name, p in eager.named_parameters():
        got = torch.empty_like(p)
        meta.init_parameter(name, got)
        assert torch.equal(got, p), name
        if p.dim() == 3:  # (stacked experts)
            half = p.shape[0] // 2
            placement = Placement.along((half, *p.shape[1:]), 0, p.shape[0], [(0, half, half)])
            got = torch.empty(placement.local_shape)
            meta.init_parameter(name, got, placement)
            assert torch.equal(got, p[half:]), name
            for dim, halves in ((1, False), (1, True), (2, False)):  # (tp rank 1's hidden units)
                split = TensorSplit(dim, halves=halves)
                local = p.shape[:dim] + (p.shape[dim] // 2,) + p.shape[dim + 1:]
                got = torch.empty(local)
                meta.init_parameter(name, got, split.placement(local, 1, 2))
                want = [q.chunk(2, dim)[1] for q in p.chunk(2, dim)] if halves else [p.chunk(2, dim)[1]]
                assert torch.equal(got, torch.cat(want, dim)), (name, dim, halves)
    for (name, b), (other, c) in zip(eager.named_buffers(), meta.named_buffers(), strict=True):
        assert name == other and torch.equal(b, c), name
