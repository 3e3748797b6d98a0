"""The recipe's data: its `data` config group served through moe_lst.data (the shard format, the readers, mixtures
and packing live there), and what only a run needs: the data's identity recorded in run_dir, its tokenizer for the
sample, the per-source metrics and what a mixture's sources will run out of, said before training."""

from __future__ import annotations

import json
from pathlib import Path

from moe_lst.data.build import build_streams as _library_streams
from moe_lst.data.format import DataError
from moe_lst.data.mixture import MixtureStream
from moe_lst.data.prepared import load_prepared
from moe_lst.data.streams import (
    PACKINGS,
    VAL_SEED_OFFSET,
    BatchSpec,
    DocumentStream,
    TokenStream,
    check_token_ids,
    load_bin,
    stdlib_corpus,
    tokenized_streams,
)

from recipes.config import atomic_write_text
from recipes.prepare_data import PrepareError, TextTokenizer, TokenizerSpec, tokenizer_sha256

__all__ = ["BatchSpec", "DataError", "DocumentStream", "TokenStream", "MixtureStream", "PACKINGS", "VAL_SEED_OFFSET",
           "build_streams", "check_data_identity", "check_token_ids", "load_bin", "load_tokenized", "stdlib_corpus",
           "stream_metrics", "stream_tokenizer", "tokenized_streams"]


def load_tokenized(path: str):
    """A prepared corpus's meta.json and per split its (tokens, document starts) (moe_lst.data.load_prepared)."""
    return load_prepared(path)


def build_streams(data_cfg, spec: BatchSpec, seed: int, vocab_size: int, steps: int | None = None,
                  say=None, needs_val: bool = False) -> tuple:
    """(train, val) streams for the recipe's `data` config group. For a mixture and `steps` (train.steps), what
    the run will read of each source is checked now: past a source's limit the run is refused in one line (before
    any training), and a source read more than once (data.on_exhausted=repeat) is said once through `say`.
    `needs_val`: a mixture none of whose sources has a validation split is refused."""
    train, val = _library_streams(data_cfg, spec, seed, vocab_size)
    if val is None and needs_val:
        raise DataError("no source of data.sources has a validation split (a bare Megatron prefix has one only with "
                        "val_path): give one a val_path, or set train.eval_batches=0")
    if isinstance(train, MixtureStream) and steps is not None:
        for k, epochs, allowed in train.exhaustion(steps):
            s = train.sources[k]
            if epochs > allowed:
                rule = "data.on_exhausted=stop reads each source at most once" if train.on_exhausted == "stop" \
                    else f"data.sources[{k}].max_epochs={s.max_epochs}"
                raise DataError(f"data source {s.name} ({s.path}) would be read {epochs:.2f} times by train.steps="
                                f"{steps} ({train.windows[k]:,} sequences of {spec.seq_len} tokens), past {rule}: "
                                "lower its weight or train.steps, or allow more (data.on_exhausted=repeat with a "
                                "larger max_epochs)")
            if say is not None:
                limit = "no limit" if allowed == float("inf") else f"max_epochs={s.max_epochs}"
                say(f"data source {s.name} ({s.path}) repeats: train.steps={steps} reads it {epochs:.2f} times "
                    f"({limit})")
    return train, val


def stream_metrics(stream, done: int) -> dict[str, int]:
    """Per-step metrics of the data: for a mixture the input tokens each source gave so far (`tokens/NAME`)."""
    if not isinstance(stream, MixtureStream):
        return {}
    return {f"tokens/{name}": n for name, n in stream.tokens_seen(done).items()}


def stream_tokenizer(stream) -> TextTokenizer | None:
    """The tokenizer that prepared a stream's data (to encode a prompt and decode a sample), or None for data
    without one (stdlib, bin). Refused in one line when the tokenizer at its recorded path is gone or has changed."""
    mine = stream.identity
    if mine is None:
        return None
    spec = TokenizerSpec(mine["tokenizer_kind"], mine["tokenizer_path"])
    try:
        if tokenizer_sha256(spec) != mine["tokenizer_sha256"]:
            raise PrepareError("it is another tokenizer now (its sha256 differs from meta.json's)")
        return TextTokenizer(spec)
    except (OSError, PrepareError) as e:
        raise DataError(f"the tokenizer of data.path={mine['path']} ({mine['tokenizer_path']}) cannot decode its "
                        f"ids: {getattr(e, 'strerror', None) or e}") from None


DATA_IDENTITY = "data_identity.json"


def check_data_identity(stream, run_dir: Path, resuming: bool, is_rank0: bool) -> None:
    """A run records the tokenizer of its data in run_dir (data_identity.json) when it starts; a resumed run whose
    data.path was since prepared with another tokenizer (its hash differs) is refused in one line, since its ids
    would mean other text. Data without a tokenizer (stdlib, bin) records nothing."""
    mine = stream.identity
    if mine is None:
        return
    path = Path(run_dir) / DATA_IDENTITY
    if resuming and path.exists():
        try:
            started = json.loads(path.read_text())
            sha256 = started["tokenizer_sha256"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path} is damaged ({type(e).__name__}): restore it, or remove it to resume without "
                            "checking the data's tokenizer") from None
        if sha256 != mine["tokenizer_sha256"]:
            raise DataError(f"data.path={mine['path']} is now tokenized by {mine['tokenizer']} (sha256 "
                            f"{mine['tokenizer_sha256'][:12]}), but this run started with {started.get('tokenizer')} "
                            f"(sha256 {sha256[:12]}): resume on data of that tokenizer, or start a new run_dir")
        return
    if is_rank0:
        atomic_write_text(path, json.dumps(mine, indent=1, sort_keys=True) + "\n")
