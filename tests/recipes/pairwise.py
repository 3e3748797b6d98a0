"""The pairwise runs of recipes.compat (`pairwise_runs`) as command lines of `python -m recipes.pretrain`: each run
on its processes, and its reference, the same run on one process without its layout settings."""

from __future__ import annotations

import hashlib
import json
import math
import pydoc_data.topics
from dataclasses import dataclass
from pathlib import Path

from recipes import compat

#: What every run and reference sets: the tiny model's short runs (4 steps of 2-row micro-batches of 128 tokens, no
#: evaluation, sample or W&B), a learning rate high enough that each step moves the loss.
COMMON = {"train.steps": "4", "train.seq_len": "128", "train.micro_batch_size": "2", "train.eval_batches": "0",
          "train.sample_tokens": "0", "train.progress": "false", "wandb.mode": "disabled", "optim.lr": "3e-3",
          "optim.warmup_steps": "1"}
#: The byte-level default corpus, capped (only data=stdlib has the key).
STDLIB = {"data.max_bytes": "2000000"}
#: What makes a feature act within such a run (set with the feature, in the run and its reference alike): the delayed
#: update from the second step (by default after 100); sparse layouts that leave blocks out of 128 tokens (by
#: default a window of 4 blocks of 64 tokens, and NSA's 16 selected blocks and 8-block window, see every token).
EXERCISE = {
    "delayed": {"zero.offload_delayed_warmup_steps": "1"},
    "sparse": {"model.sparse.block_size": "16", "model.sparse.window_blocks": "3"},
    "nsa": {"model.nsa.block_size": "16", "model.nsa.compress_block": "16", "model.nsa.compress_stride": "8",
            "model.nsa.select_blocks": "3", "model.nsa.window_blocks": "2"},
    # the million-token preset at the runs' 128 tokens: its sliding window of 3 blocks of 16 tokens leaves blocks
    # out (its own 4 blocks of 64 would see every token), no crop check (its 1000 tokens exceed the sequence)
    "million": {"model.sparse.block_size": "16", "model.sparse.window_blocks": "3", "train.crop_check_tokens": "0"},
    # 1-bit Adam's AdamW warm-up for 3 of the 4 steps: the last step freezes the variance and compresses
    "onebit": {"optim.onebit.warmup_steps": "3"},
}
#: The features of recipes.compat.LAYOUT_DEPENDENT that a one-process reference keeps (tests/recipes/
#: test_layout_features.py): the million-token preset is a model (sparse attention, tiled MLP and loss,
#: checkpointing) whose numbers depend on the layout only by rounding at the runs' small size; 1-bit Adam's warm-up is
#: AdamW over the averaged gradient, which one process computes (its compressed steps it does not).
KEPT_IN_REFERENCE = frozenset({"million", "onebit"})
#: The quantized ZeRO collectives: a run holding them is compared with the same run without them.
QUANTIZED = ("qwz", "qgz")
#: The unit roundoff of each compute dtype: half the distance from 1 to the next number (bf16 keeps 8 significant
#: bits, fp16 11).
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def _settings(overrides: tuple[str, ...]) -> dict[str, str]:
    """key (or group) -> value, the last of each key winning, as on a command line."""
    return dict(compat._settings(overrides))


def _features(run: tuple[str, ...]) -> list[compat.Feature]:
    return [f for f in compat.FEATURES if f.name in run]


def run_settings(run: tuple[str, ...]) -> dict[str, str]:
    """The run's overrides as recipes.compat composes them, what makes each feature act, and COMMON."""
    settings = _settings(compat.command_line(run))
    for f in _features(run):
        settings.update(EXERCISE.get(f.name, {}))
    return {**settings, **COMMON}


def processes(settings: dict[str, str]) -> int:
    return math.prod(int(settings.get(f"parallel.{k}", 1)) for k in ("replicas", "dp", "tp", "pp", "sp"))


def reference_settings(run: tuple[str, ...], without: tuple[str, ...] = ()) -> dict[str, str]:
    """The same run, less the features `without` (their settings and needs), on one process: every setting of a
    layout-only feature (recipes.compat.layout_only) on a LAYOUT_KEYS key left out, the other features' settings and
    needs kept (the delayed update keeps its ZeRO stage 1 and CPU offload, ep2 its MoE model; the features of
    KEPT_IN_REFERENCE too, the other layout-dependent ones refused), and train.grad_accum times dp: the reference's
    micro-batches are the rows each data-parallel rank trains on, in the recipe's global row order (micro-step major,
    then dp rank), so each micro-batch's mean loss (over its own tokens, and an MoE layer's balancing loss over its
    own tokens) is the same as on that rank."""
    run = tuple(name for name in run if name not in without)
    features = _features(run)
    for f in features:
        if f.name in compat.LAYOUT_DEPENDENT and f.name not in KEPT_IN_REFERENCE:
            raise ValueError(f"{f.name} has no one-process reference: {compat.LAYOUT_DEPENDENT[f.name]}")
    kept = [o for f in features for o in f.needs
            if not (compat.layout_only(f) and compat._key(compat._parse_one(o)) in compat.LAYOUT_KEYS)]
    kept += [o for f in features if not compat.layout_only(f) for o in f.overrides]
    settings = _settings(compat.BASE + tuple(kept))
    for f in features:
        settings.update(EXERCISE.get(f.name, {}))
    settings.update(COMMON)
    run = run_settings(run)
    settings["train.grad_accum"] = str(int(run.get("train.grad_accum", 1)) * int(run["parallel.dp"]))
    assert processes(settings) == 1, settings
    return settings


def tolerance(settings: dict[str, str]) -> dict[str, float]:
    """The relative distance allowed between a run's and its reference's loss, and gradient norm, at every step.

    fp32: 1e-5 for both, the recipe's equivalence tolerance (tests/multirank.py): the layouts add the same terms in
    another order (per rank, per sequence shard, per tile), a few ulps (1.2e-7) of the sums.

    bf16 and fp16 (zero.dtype: forward, backward and gradient reductions in that dtype, fp32 masters; fp16 with its
    loss scale), from u, the dtype's unit roundoff (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4): gradient norm 2u, loss
    u/4. A layout rounds other partial sums than one process does (per rank, per sequence shard, per micro-batch
    accumulated in a low-precision buffer, tp's all-reduced activations; tests/parallel/test_bf16_layouts.py), which
    moves step 1's gradient norm by a fraction of u and its loss hardly at all (the same weights). AdamW's first steps
    are m / sqrt(v) ~ sign(g): an element whose gradient is within rounding of zero can take the other sign, a whole
    lr step, so later steps start from weights that differ in such elements (and an MoE token near a top-k tie may
    take another expert), and the gradient norms drift further than the losses, which average over every token.
    Measured over the pairwise runs: gradient norms up to 0.77u (fp16, MoE under dp x tp x ep; bf16 0.33u), losses
    up to 0.1u (fp16, MoE under tp x pp; bf16 0.022u). The tolerances leave 2.6x and 2.5x room. Outside them: a
    gradient scaled by 2% (bf16) or 0.5% (fp16), from step 1; a reference on half the global batch (bf16: gradient
    norms 28% and losses 0.43u away). (bf16 with an MoE model under tp drifted further: recipes.compat.APART.)"""
    u = UNIT_ROUNDOFF.get(settings.get("zero.dtype", "fp32"))
    return {"loss": 1e-5, "grad_norm": 1e-5} if u is None else {"loss": u / 4, "grad_norm": 2 * u}


@dataclass(frozen=True)
class Paths:
    """Where the placeholders of recipes.compat's features point in a test: the Hugging Face configs
    (model.hf.config=hf_llama), the prepared corpus (data.path=prepared), the NVMe directory (zero.nvme_path=nvme)."""

    hf_configs: Path
    corpus: Path
    nvme: Path

    def value(self, key: str, value: str) -> str:
        if key == "model.hf.config" and value in compat.HF_CONFIGS:
            return str(self.hf_configs / value)
        if key == "data.path" and value == "prepared":
            return str(self.corpus)
        if key == "zero.nvme_path" and value == "nvme":
            return str(self.nvme)
        return value


def command(settings: dict[str, str], paths: Paths, run_dir: Path) -> list[str]:
    """The overrides of `python -m recipes.pretrain` for these settings, groups first."""
    settings = {**settings, **({} if settings.get("data") == "tokenized" else STDLIB)}
    groups = [k for k in settings if "." not in k]
    keys = [k for k in settings if "." in k]
    return [f"{k}={paths.value(k, settings[k])}" for k in groups + keys] + [f"run_dir={run_dir}"]


def reference_key(settings: dict[str, str]) -> str:
    """A name for a reference's settings (runs with equal references share one)."""
    return hashlib.sha256(json.dumps(sorted(settings.items())).encode()).hexdigest()[:16]


def write_hf_configs(root: Path) -> Path:
    for name, values in compat.HF_CONFIGS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(values))
    return root


def prepare_corpus(root: Path) -> Path:
    """A prepared corpus (recipes.prepare_data) the byte-vocabulary models can read: Python's help topics, one
    document per paragraph (most shorter than a 128-token row, so rows hold several), tokenized by a 200-token
    character BPE with an end-of-document token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from recipes import prepare_data

    paragraphs = [p.strip() for _, text in sorted(pydoc_data.topics.topics.items()) for p in text.split("\n\n")]
    docs = [p for p in paragraphs if len(p) > 40][:1500]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "</s>"],
                                                      show_progress=False))
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare_data.prepare([str(root / "docs.jsonl")], str(root / "tokenizer.json"), root / "corpus",
                         val_fraction=0.1, workers=1, progress=False, say=lambda *_: None)
    return root / "corpus"


def metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl: step -> its record."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def distances(run_dir: Path, reference_dir: Path, keys=("loss", "grad_norm")) -> dict[tuple[str, int], float]:
    """Per (key, step) of the reference the relative distance |run - reference| / |reference| (inf where the run
    lacks the step or the key)."""
    got, want = metrics(run_dir), metrics(reference_dir)
    out = {}
    for step, record in sorted(want.items()):
        for key in keys:
            if key in record:
                value = got.get(step, {}).get(key)
                out[(key, step)] = math.inf if value is None else abs(value - record[key]) / abs(record[key])
    return out
