"""train.init_from streams a safetensors model directory (moe_lst.models.loading): each rank reads only the bytes of
the slices it keeps, the run starts from the directory's weights under every layout (the same losses as one
process), and a directory that does not fit the run's model is refused in one line before any model exists."""

import json
import random
import struct
from pathlib import Path

import pytest
import torch
from moe_lst.models.llama import ModelConfig, MoEConfig, Transformer
from moe_lst.models.llama.state_dict import import_hf, open_hf_checkpoint, save_hf
from moe_lst.models.loading import Checkpoint, flat_boxes

from tests.equivalence import Recorder, as_reference, assert_equivalent
from tests.multirank import run_multirank
from tests.recipes.pretrained import RUN_MODEL as PRETRAINED_RUN
from tests.recipes.pretrained import pretrained_fixture  # noqa: F401 (the `pretrained` fixture)
from tests.recipes.test_pretrain import _cfg
from tests.zero.test_build_memory import StorageLedger
from zero.plan import Placement

pytest.importorskip("safetensors")

def _tiny(experts: int = 4) -> ModelConfig:
    return ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64,
                       tie_embeddings=False, moe=MoEConfig(num_experts=experts, top_k=2, ffn_dim=48))


def _placements(shape: tuple[int, ...]) -> list[Placement]:
    """The whole tensor, each half along every even dim, and two separated quarters (a SwiGLU tp slice's two
    halves) along every dim divisible by 4."""
    out = [Placement.whole(shape)]
    for dim, n in enumerate(shape):
        if n % 2 == 0:
            out.append(Placement.along(shape[:dim] + (n // 2,) + shape[dim + 1:], dim, n, [(0, n // 2, n // 2)]))
        if n % 4 == 0:
            q = n // 4
            out.append(Placement.along(shape[:dim] + (2 * q,) + shape[dim + 1:], dim, n, [(0, q, q), (q, 3 * q, q)]))
    return out


@pytest.mark.parametrize("experts", ["per_expert", "fused"])
def test_a_slice_read_is_the_imported_slice_and_reads_only_its_bytes(tmp_path, experts):
    """Any flat range of any slice (expert, tensor-parallel rows or columns, SwiGLU halves) of any parameter,
    q / k rows reordered and experts transposed from per-expert or fused tensors, equals the same range cut from
    the whole imported state dict; the bytes read are exactly the range's elements (fp32 files) beyond the headers."""
    cfg = _tiny()
    torch.manual_seed(0)
    save_hf(Transformer(cfg).state_dict(), cfg, tmp_path, experts=experts)
    _, state = import_hf(tmp_path)
    weights = open_hf_checkpoint(tmp_path, cfg)
    checkpoint, sources = weights.checkpoint, weights.sources
    shapes = {n: tuple(v.shape) for n, v in state.items()}
    rng = random.Random(0)
    for name, whole in state.items():
        for placement in _placements(shapes[name]):
            read = checkpoint.reader(sources, {name: placement}, shapes)
            local = placement.take(whole).reshape(-1)
            for _ in range(3):
                start = rng.randrange(local.numel())
                stop = rng.randrange(start, local.numel() + 1)
                before = checkpoint.data_bytes_read
                got = read(name, start, stop)
                assert torch.equal(got, local[start:stop]), (name, placement, start, stop)
                assert checkpoint.data_bytes_read - before == 4 * (stop - start), (name, placement, start, stop)
    assert checkpoint.bytes_read == checkpoint.data_bytes_read + checkpoint.header_bytes()


@pytest.mark.parametrize("original_format", [True, False])
def test_a_hugging_face_tensor_parallel_slice_read_is_its_hidden_units(tmp_path, original_format):
    """A Hugging Face MoE directory, experts per expert (the published layout: the stacked [gate; up] made of two
    tensors per expert) or fused: each tp=2 rank's slice of every stacked expert weight as a TensorSplit places it
    (its hidden units by its rows or, [gate; up], as two halves sliced alike; the down projection's by its columns;
    and along any other dim: experts) read by the streaming reader equals that slice of the weights transformers
    loads, and reads exactly the slice's bytes (fp32 files) beyond the headers."""
    from moe_lst.models.hf import load_config
    from moe_lst.models.hf.streaming import open_streaming

    from tests.recipes.pretrained import write_hf
    from zero.parallel.tensor import TensorSplit

    directory = write_hf(tmp_path, original_format=original_format)
    weights = open_streaming(directory, load_config(directory))
    checkpoint = weights.checkpoint
    whole = _directory_weights("hf", directory)
    assert any(n.endswith("experts.gate_up_proj") for n in weights.sources)
    for name, value in whole.items():
        if value.dim() != 3:  # (the other parameters' slices: the same reader, the Llama's test above)
            continue
        for dim, n in enumerate(value.shape):
            for split in [TensorSplit(dim)] * (n % 2 == 0) + [TensorSplit(dim, halves=True)] * (n % 4 == 0):
                local = value.shape[:dim] + (n // 2,) + value.shape[dim + 1:]
                for rank in range(2):
                    placement = split.placement(local, rank, 2)
                    read = checkpoint.reader(weights.sources, {name: placement}, {})
                    before = checkpoint.data_bytes_read
                    want = placement.take(value).reshape(-1)
                    got = read(name, 0, want.numel())
                    assert torch.equal(got, want), (name, split, rank)
                    assert checkpoint.data_bytes_read - before == 4 * want.numel(), (name, split, rank)
    assert checkpoint.bytes_read == checkpoint.data_bytes_read + checkpoint.header_bytes()
    checkpoint.close()


def test_flat_boxes_cover_a_range_in_order():
    shape = (3, 4, 5)
    flat = torch.arange(60).reshape(shape)
    for start in range(60):
        for stop in range(start, 61):
            got = [flat[tuple(slice(a, a + n) for a, n in zip(s, z))].reshape(-1)
                   for s, z in flat_boxes(shape, start, stop)]
            want = flat.reshape(-1)[start:stop]
            assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=torch.long), want)


# ------------------------------------------------------------------------------------------- refusals, one line each
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny MoE exported into two shards with an index (what save_pretrained writes for a large model)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("sharded")
    cfg = _tiny()
    torch.manual_seed(1)
    save_hf(Transformer(cfg).state_dict(), cfg, out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(out / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out, cfg


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _refusal(cfg_overrides, directory) -> str:
    from moe_lst.models import spec as families

    from recipes.config import ConfigError

    cfg = _cfg(directory.parent / "run", *cfg_overrides, f"train.init_from={directory}")
    with pytest.raises(ConfigError) as e:
        families.get(cfg).init_from(cfg, str(directory))
    message = str(e.value)
    assert "\n" not in message, message
    return message


RUN_MODEL = ["model=moe_tiny", "model.vocab_size=96", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
             "model.moe.num_experts=4", "model.moe.ffn_dim=48", "model.ffn_dim=96", "model.tie_embeddings=false",
             "model.max_seq_len=64", "train.seq_len=32"]


def test_a_sharded_directory_streams_and_each_bad_one_is_refused_in_one_line(sharded, tmp_path):
    src, cfg = sharded
    weights = _refusal_free(src)
    assert len(weights.checkpoint.files) == 2
    # a config that differs: every weight-shaping key named
    message = _refusal([*RUN_MODEL[:-2], "model.dim=32", "model.moe.num_experts=8", "model.max_seq_len=64",
                        "train.seq_len=32"], src)
    assert "holds another model: model.dim=32 here but 64 there, model.moe.num_experts=8 here but 4 there" in message
    # a shard the index names, missing
    gone = _copy(src, tmp_path / "gone")
    (gone / "model-00002-of-00002.safetensors").unlink()
    assert "shard model-00002-of-00002.safetensors named by" in _refusal(RUN_MODEL, gone)
    # a truncated shard
    cut = _copy(src, tmp_path / "cut")
    data = (cut / "model-00001-of-00002.safetensors").read_bytes()
    (cut / "model-00001-of-00002.safetensors").write_bytes(data[:-100])
    message = _refusal(RUN_MODEL, cut)
    assert "model-00001-of-00002.safetensors is truncated" in message and f"holds {len(data) - 100} bytes" in message
    # a tensor the model needs, missing from the index (and its shard)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    lost = _copy(src, tmp_path / "lost")
    name = "model.layers.1.self_attn.o_proj.weight"
    file = index["weight_map"].pop(name)
    (lost / "model.safetensors.index.json").write_text(json.dumps(index))
    _rewrite(lost / file, drop=name)
    message = _refusal(RUN_MODEL, lost)
    assert f"tensor {name} (for layers.1.attention.wo.weight) is missing from model.safetensors.index.json" in message
    # a tensor of another shape, and one of an integer dtype: each named with its file
    for what, change in (("shape", lambda t: t[:, :-1]), ("dtype", lambda t: t.to(torch.int32))):
        bad = _copy(src, tmp_path / what)
        file = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
        _rewrite(bad / file, change={name: change})
        message = _refusal(RUN_MODEL, bad)
        assert f"{bad / file}: tensor {name}" in message
        assert ("has shape [64, 63] where the run's model needs [64, 64]" if what == "shape"
                else "is I32, not a floating dtype") in message


def _refusal_free(directory):
    from moe_lst.models import spec as families

    cfg = _cfg(directory.parent / "run", *RUN_MODEL, f"train.init_from={directory}")
    return families.get(cfg).init_from(cfg, str(directory))


def _rewrite(path: Path, drop: str | None = None, change: dict | None = None) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors.pop(drop, None)
    for k, fn in (change or {}).items():
        tensors[k] = fn(tensors[k]).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.slow  # (the Hugging Face family's default case: the init_from equivalence below)
def test_a_hugging_face_directory_missing_an_expert_or_of_another_shape_is_refused_in_one_line(pretrained,
                                                                                                tmp_path):
    """model=hf: a per-expert tensor absent from the save_pretrained directory, or one of another shape, is refused
    before any model exists, in one line naming the tensor (and the file)."""
    from moe_lst.models import spec as families

    from recipes.config import ConfigError

    def refusal(directory: Path) -> str:
        cfg = _cfg(tmp_path / "run", *PRETRAINED_RUN["hf"](directory))
        with pytest.raises(ConfigError) as e:
            families.get(cfg).init_from(cfg, str(directory))
        assert "\n" not in str(e.value), e.value
        return str(e.value)

    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    gone = _copy(pretrained["hf"], tmp_path / "gone")
    _rewrite(gone / "model.safetensors", drop=name)
    assert f"tensor {name} (expert 3 of model.layers.0.mlp.experts.gate_up_proj) is missing" in refusal(gone)
    cut = _copy(pretrained["hf"], tmp_path / "cut")
    _rewrite(cut / "model.safetensors", change={name: lambda t: t[:-1]})
    assert f"{cut / 'model.safetensors'}: tensor {name} has shape" in refusal(cut)


def test_header_parsing_refuses_a_file_shorter_than_its_header(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(Exception, match="truncated: its header needs 1008 bytes but the file holds 10"):
        Checkpoint.open(d)


# ------------------------------------------------------------------------------------------ the recipe, any layout
# One step of AdamW with eps=1 (far above |g|): its update is lr * g / (|g| + 1), the gradient itself to a
# fraction of |g|, so the helper's per-element first-update check compares gradients as under SGD; no weight decay
# or clipping. A global batch of two rows.
STEP = ["train.steps=1", "optim.warmup_steps=1", "optim.lr=1.0", "optim.eps=1.0", "optim.weight_decay=0",
        "optim.grad_clip=0", "train.micro_batch_size=2", "train.eval_batches=0"]
# (ep=2 borrows its ranks from dp=2: one row per rank; pp=2 runs its two micro-batches of one row)
LAYOUTS = {"ep2_zero3": ["parallel.ep=2", "zero.stage=3", "train.micro_batch_size=1"], "tp2": ["parallel.tp=2"],
           "pp2": ["parallel.pp=2", "train.micro_batch_size=1", "train.grad_accum=2"]}


# The runs whose checkpoint is exported too (streaming export): the Hugging Face MoE's ZeRO-3 expert-parallel one,
# and the Llama's tensor-parallel one (slow).
EXPORTED = {("hf", "ep2_zero3"), ("llama", "tp2")}


def _train_rank(overrides: list[str], run_dir: str, steps: int, save: bool = False) -> dict:
    """One rank of a recipe run initialised from a directory: its equivalence record, the bytes it read from the
    files and the bytes of the slices it keeps (elements the engine asked for, fp32) plus the headers; with `save`,
    its checkpoint after the steps, in run_dir."""
    from moe_lst.models import loading

    from recipes.config import num_params
    from recipes.pretrain import Run, train_step

    counted: dict = {}
    original = loading.StreamingWeights.load_into

    def load_into(self, engine):
        original(self, engine)
        counted.update(read=self.checkpoint.bytes_read, headers=self.checkpoint.header_bytes())

    loading.StreamingWeights.load_into = load_into
    try:
        cfg = _cfg(run_dir, *overrides)
        run = Run(cfg)
    finally:
        loading.StreamingWeights.load_into = original
    try:
        mine = 0
        for b in run.engine.buckets:
            mine += b.numel if b.resident else sum(hi - lo for _, lo, hi in b.shard_ranges())
        recorder = Recorder(run.engine)
        for step in range(steps):
            recorder.step(train_step(run.engine, run.train_stream, step, cfg, run.dims, run.pipe))
        if save:
            run.save(steps)
        return {**recorder.result(), **counted, "slices": 4 * mine, "total": 4 * num_params(cfg)}
    finally:
        run.logger.finish()
        if run.lock is not None:
            run.lock.close()


def _directory_weights(family: str, directory: Path) -> dict[str, torch.Tensor]:
    """The directory's weights under the run's parameter names, read whole by the families' other readers."""
    if family == "llama":
        return import_hf(directory)[1]
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).named_parameters())


@pytest.mark.parametrize("family,layout", [("llama", "ep2_zero3"), ("hf", "ep2_zero3"),
                                           *(pytest.param("llama", k, marks=pytest.mark.slow) for k in ("tp2", "pp2")),
                                           *(pytest.param("hf", k, marks=pytest.mark.slow) for k in ("pp2", "tp2"))])
def test_init_from_under_a_layout_equals_one_process_and_reads_only_its_slices(pretrained, tmp_path, family, layout):
    """Two ranks initialised from the directory train as one process does (tests.equivalence: losses, gradient
    norms, every parameter's first update, which is its gradient here, on every rank), each reading from the files
    exactly the bytes of the slices it keeps plus the headers: less than the whole model. The one process
    starts from the directory's weights exactly (not the run's own init)."""
    run = [*PRETRAINED_RUN[family](pretrained[family]), *STEP]
    reference = _train_rank(run, str(tmp_path / "one"), 1)  # (one process: this one; the two ranks: the pool's)
    assert reference["read"] == reference["slices"] + reference["headers"]  # (one rank keeps the whole model)
    want = _directory_weights(family, pretrained[family])
    for name, value in reference["first"]["initial"].items():  # (a router's expert bias, not in the file: zeros)
        assert torch.equal(value, want[name].reshape(value.shape)) if name in want else not value.any(), name
    exports = (family, layout) in EXPORTED
    results = run_multirank(_train_rank, 2, [*run, *LAYOUTS[layout]], str(tmp_path / "many"), 1, exports)
    assert_equivalent(results, as_reference(reference), label=f"{family} {layout}")
    for rank, r in enumerate(results):
        assert r["read"] == r["slices"] + r["headers"], (layout, rank, r["read"], r["slices"], r["headers"])
        assert r["read"] - r["headers"] < 0.75 * r["total"], (layout, rank, r["read"], r["total"])
    if exports:
        _check_streaming_export(family, tmp_path / "many", tmp_path / "exported")


# ------------------------------------------------------------------------------------------------ streaming export
class _HeapLedger(StorageLedger):
    """The ledger, leaving out storages that map a file (the checkpoint's shards, read in place)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = str(directory.resolve())
        self.mapped: list[tuple[int, int]] = []

    def _refresh_maps(self) -> None:
        self.mapped = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(self.directory):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                self.mapped.append((lo, hi))

    def map_files(self) -> None:
        """Read the process's file mappings (call once the shards are opened) and drop the storages seen in them."""
        self._refresh_maps()
        for key, (ref, _) in list(self.live.items()):
            s = ref()
            if s is not None and any(lo <= s.data_ptr() < hi for lo, hi in self.mapped):
                self._forget(key)

    def _see(self, t: torch.Tensor) -> None:
        if t.device.type == "cpu" and not t.is_meta:
            ptr = t.untyped_storage().data_ptr()
            if not any(lo <= ptr < hi for lo, hi in self.mapped):
                super()._see(t)


def _check_streaming_export(family: str, run_dir: Path, out: Path) -> dict:
    """recipes.export of the run's checkpoint into shards of about a tenth of the model: the live tensor storages
    of the export (not the checkpoint's shards, which are mapped from their files) never pass one shard plus four
    of the largest parameter (read whole, assembled from its pieces, cut into its Hugging Face tensors), less than
    the model; the directory has an index and several shards, and transformers loads it to the logits of our model
    with the checkpoint's weights."""
    import gc

    import transformers
    from moe_lst.models import spec as families
    from omegaconf import OmegaConf

    import zero
    from recipes.config import checkpoints
    from recipes.export import export

    cfg = OmegaConf.load(run_dir / "config.yaml")
    spec = families.get(cfg)
    state = zero.consolidate(zero.open_checkpoint(checkpoints(run_dir)[0]))
    ours = spec.build(cfg, zero.ParallelDims(), meta=False)
    shapes = {n: p.shape for n, p in ours.named_parameters()}
    ours.load_state_dict({n: v.reshape(shapes[n]) if n in shapes else v for n, v in state.items()}, strict=False)
    whole = 4 * sum(p.numel() for p in ours.parameters())
    largest = 4 * max(p.numel() for p in ours.parameters())
    shard = whole // 10
    gc.collect()
    ledger = _HeapLedger(run_dir)
    opened = zero.open_checkpoint

    def open_checkpoint(path):  # (opened, i.e. its shards mapped and checked, outside the ledger: then mapped)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            reader = opened(path)
        ledger.map_files()
        return reader

    zero.open_checkpoint = open_checkpoint
    try:
        with ledger:
            ledger.set_phase("export")
            export(run_dir, out, "per_expert", max_shard_bytes=shard)
            ledger.set_phase("end")
    finally:
        zero.open_checkpoint = opened
    peak = ledger.peaks["export"] - ledger.starts["export"]
    assert peak <= shard + 4 * largest < whole, (family, peak, shard, largest, whole)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2 and (out / "model.safetensors.index.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, spec.vocab_size(cfg), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), rtol=1e-4, atol=1e-4)
    return {"peak": peak, "shard": shard, "largest": largest, "whole": whole}


def test_a_hugging_face_directory_s_persistent_buffers_load(tmp_path):
    """A router's correction bias (DeepSeek-V3's e_score_correction_bias: a persistent buffer, not a parameter)
    comes from the directory, not from the build (zeros), read from the file like the parameters."""
    from moe_lst.models.hf import build, load_config
    from moe_lst.models.hf.coverage import tiny_config
    from moe_lst.models.hf.streaming import open_streaming
    from transformers import AutoModelForCausalLM

    import zero

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"), dtype=torch.float32)
    bias = torch.tensor([0.0, 0.4, -0.4, 0.3])
    names = [n for n, b in source.named_buffers() if n.endswith("e_score_correction_bias")]
    assert names
    for name in names:
        source.get_buffer(name).copy_(bias)
    source.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    weights = open_streaming(tmp_path, config)
    assert set(weights.buffers) == set(names)
    model = build(config)
    engine = zero.initialize(model, lambda params: torch.optim.SGD(params, lr=0.1), zero.ZeroConfig(stage=0),
                             zero.ParallelDims(dp=1), plans=[model.loss_plan()])
    assert not any(torch.equal(engine.module.get_buffer(n), bias) for n in names)
    weights.load_into(engine)
    for name in names:
        assert torch.equal(engine.module.get_buffer(name), bias), name
