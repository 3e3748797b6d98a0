"""Evaluations inside the training loop (`eval.*`), every `eval.every` steps and at the end, each into metrics.jsonl
and W&B:

- the validation loss of each source of a mixture (`val_loss/NAME`);
- long-context retrieval: pass-key prompts built from validation text at several lengths and depths, scored by the
  model's likelihood of the key under the training layout (Ulysses sequence parallelism, no packing):
  `eval/retrieval_accuracy` (every key token the model's top choice), `eval/retrieval_logprob` (mean log-probability
  per key token), the same for control prompts whose needle is replaced by more text, a value per (length, depth)
  and a W&B heatmap of the accuracy;
- your own: `eval.hooks` names functions `fn(model, step) -> {name: number}` (`model` is the engine, called as the
  model is; every rank calls each hook, so hooks may use collectives), logged as `eval/NAME`.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from moe_lst.data.mixture import MixtureStream, per_source_streams
from omegaconf import DictConfig, OmegaConf

from recipes.config import ConfigError, EvalConfig
from recipes.data import stream_tokenizer
from recipes.losses import IGNORE_INDEX
from sequence_parallel import shard_sequence
from zero.dist import comm
from zero.parallel.tensor import gather_sequence

NEEDLE = " The pass key is {key}. Remember it. "
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


@dataclass
class Prompt:
    """One retrieval prompt: `tokens` [length] ending with the key, which starts at `answer_start`."""

    tokens: np.ndarray
    answer_start: int
    length: int
    depth: float


def retrieval_prompts(haystack: np.ndarray, encode: Callable[[str], list[int]], lengths: list[int],
                      depths: list[float], prompts: int, digits: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(prompts, controls): per length, depth and index a stretch of `haystack` (validation text) with the needle
    (a pass key of `digits` digits) at that depth, then the question and the key; its control is the same prompt
    with the needle replaced by the text that follows the stretch (same length, the key only in the answer)."""
    out, controls = [], []
    question = encode(QUESTION)
    for length in lengths:
        for depth in depths:
            for i in range(prompts):
                rng = np.random.Generator(np.random.PCG64([seed, length, round(depth * 1000), i]))
                key = str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))
                needle, answer = encode(NEEDLE.format(key=key)), encode(ANSWER.format(key=key))
                filler = length - len(needle) - len(question) - len(answer)
                if filler < 1 or len(haystack) < filler + len(needle) + 1:
                    raise ConfigError(f"eval.retrieval.lengths has {length}: the needle, question and key take "
                                      f"{length - filler} tokens, leaving no text around them (or the validation "
                                      "text is shorter than the prompt): use longer lengths")
                start = int(rng.integers(0, len(haystack) - filler - len(needle)))
                text = np.asarray(haystack[start:start + filler + len(needle)], dtype=np.int64)
                at = round(depth * filler)
                tail = np.concatenate([question, answer]).astype(np.int64)
                out.append(Prompt(np.concatenate([text[:at], needle, text[at:filler], tail]).astype(np.int64),
                                  length - len(answer), length, depth))
                controls.append(Prompt(np.concatenate([text[:at], text[filler:], text[at:filler], tail]),
                                       length - len(answer), length, depth))
    return out, controls


@torch.no_grad()
def score_prompts(forward, prompts: list[Prompt], sp_group, tp_group, device) -> np.ndarray:
    """[prompts, 3]: per prompt the summed log-probability of its key, the key tokens the model ranks first and
    the key's length. Prompts of one length run as one batch, each rank its shard of the sequence (Ulysses;
    `forward(tokens, position_ids)` is the model as training runs it); the sums are over the sp ranks."""
    out = np.zeros((len(prompts), 3))
    for length in sorted({p.length for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if p.length == length]
        tokens = torch.from_numpy(np.stack([prompts[i].tokens for i in rows]))
        x, y = tokens[:, :-1], tokens[:, 1:].clone()
        for r, i in enumerate(rows):
            y[r, :prompts[i].answer_start - 1] = IGNORE_INDEX  # only the key's tokens are scored
        x, y, pos = shard_sequence(x, y, sp_group, ignore_index=IGNORE_INDEX)
        logits = gather_sequence(forward(x.to(device), pos.to(device)), tp_group, dim=-1).float()
        y = y.to(device)
        scored = y != IGNORE_INDEX
        logp = F.log_softmax(logits, dim=-1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
        top = (logits.argmax(-1) == y) & scored
        stats = torch.stack([(logp * scored).sum(1), top.sum(1).float(), scored.sum(1).float()], 1).double()
        comm.all_reduce(stats, sp_group)
        out[rows] = stats.cpu().numpy()
    return out


def summarize(stats: np.ndarray, prompts: list[Prompt]) -> dict[str, float]:
    """Exact-match accuracy (every key token ranked first) and mean log-probability per key token."""
    exact = stats[:, 1] == stats[:, 2]
    return {"accuracy": float(exact.mean()), "logprob": float((stats[:, 0] / stats[:, 2]).mean())}


def heatmap_media(cells: dict[tuple[int, float], float]) -> dict:
    """The retrieval accuracy by length and depth as W&B media: a heatmap image and a table."""
    import wandb
    from PIL import Image

    from recipes.reports import pyplot

    plt = pyplot()

    lengths, depths = sorted({k[0] for k in cells}), sorted({k[1] for k in cells})
    grid = [[cells[(n, d)] for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.6 * len(depths) + 1.5))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title("pass-key retrieval accuracy")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    plt.close(fig)
    buf.seek(0)
    table = wandb.Table(columns=["length", "depth", "accuracy"])
    for (n, d), acc in sorted(cells.items()):
        table.add_data(n, d, acc)
    with Image.open(buf) as png:
        image = wandb.Image(png.convert("RGB"), caption="exact-match accuracy by prompt length and needle depth")
    return {"eval/retrieval_heatmap": image, "eval/retrieval_table": table}


def tokens_table(stream: MixtureStream, done: int) -> dict:
    """W&B table of the input tokens each source of a mixture gave to the first `done` steps."""
    import wandb

    seen = stream.tokens_seen(done)
    total = max(sum(seen.values()), 1)
    table = wandb.Table(columns=["source", "path", "weight", "tokens", "fraction"])
    for s in stream.sources:
        table.add_data(s.name, s.path, s.weight, seen[s.name], seen[s.name] / total)
    return {"data/tokens_per_source": table}


def load_hook(name: str):
    """`package.module:function` imported now (before training), refused in one line when it cannot be."""
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"eval.hooks has {name!r}, which cannot be loaded ({type(e).__name__}: {e}); name an "
                          "importable package.module:function") from None
    if not callable(fn):
        raise ConfigError(f"eval.hooks has {name!r}, which is not a function")
    return fn


def default_lengths(encode, seq_len: int, digits: int) -> list[int]:
    """seq_len / 4, / 2 and seq_len, less those that leave less text than the needle, question and key take."""
    key = "9" * digits
    overhead = sum(len(encode(t.format(key=key))) for t in (NEEDLE, QUESTION, ANSWER))
    return sorted({n for n in (seq_len // 4, seq_len // 2, seq_len) if n >= 2 * overhead}) or [seq_len]


def byte_encode(text: str) -> list[int]:
    return list(text.encode())


class Evaluations:
    """The run's in-loop evaluations, set up before training (hooks imported, prompts built)."""

    def __init__(self, cfg: DictConfig, dims, train_stream, val_stream, is_rank0: bool) -> None:
        e, t = cfg.get("eval") or OmegaConf.structured(EvalConfig), cfg.train  # (a config composed without eval.*)
        self.dims, self.is_rank0, self.train_stream = dims, is_rank0, train_stream
        self.every = t.eval_every if e.every is None else e.every
        self.per_source = per_source_streams(val_stream) \
            if e.per_source and t.eval_batches and isinstance(val_stream, MixtureStream) else {}
        self.hooks = {name: load_hook(name) for name in e.hooks}
        self.prompts = self.controls = None
        if e.retrieval.enabled:
            self.prompts, self.controls = self.build_prompts(cfg, train_stream, val_stream)

    @staticmethod
    def build_prompts(cfg: DictConfig, train_stream, val_stream) -> tuple[list[Prompt], list[Prompt]]:
        r, seq = (cfg.get("eval") or OmegaConf.structured(EvalConfig)).retrieval, cfg.train.seq_len
        if cfg.data.kind == "stdlib":
            encode = byte_encode
        elif train_stream.identity is not None:
            tokenizer = stream_tokenizer(train_stream)
            encode = lambda text: tokenizer.encode_batch([text])[0]  # noqa: E731
        else:
            raise ConfigError(f"eval.retrieval.enabled=true needs the data's tokenizer to write the prompts, and "
                              f"data.kind={cfg.data.kind} has none recorded (data=stdlib, tokenized, or a mixture "
                              "with a prepared source have one); set eval.retrieval.enabled=false")
        if val_stream is None:
            raise ConfigError("eval.retrieval.enabled=true builds its prompts from validation text, and no source "
                              "has a validation split; give one (val_path) or set eval.retrieval.enabled=false")
        haystack = val_stream.sources[0].corpus.tokens if isinstance(val_stream, MixtureStream) else val_stream.tokens
        lengths = list(r.lengths) if r.lengths else default_lengths(encode, seq, r.digits)
        return retrieval_prompts(haystack, encode, lengths, list(r.depths), r.prompts, r.digits, cfg.train.seed)

    def due(self, done: int, steps: int) -> bool:
        wanted = self.per_source or self.hooks or self.prompts or isinstance(self.train_stream, MixtureStream)
        return bool(wanted) and ((self.every and done % self.every == 0) or done == steps)

    def run(self, done: int, engine, val_loss_of, logger, wandb_on: bool) -> dict[str, float]:
        """Every evaluation due at step `done`: its metrics; W&B media logged through `logger` (rank 0)."""
        record: dict[str, float] = {}
        if wandb_on and self.is_rank0 and isinstance(self.train_stream, MixtureStream):
            logger.log_media(done, tokens_table(self.train_stream, done))
        for name, stream in self.per_source.items():
            record[f"val_loss/{name}"] = val_loss_of(stream)
        if self.prompts:
            record.update(self.retrieval(engine, logger if wandb_on else None, done))
        for name, fn in self.hooks.items():
            values = fn(engine, done)
            for key, value in dict(values).items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise TypeError(f"eval hook {name} returned {key}={value!r}: hooks return numbers")
                record[f"eval/{key}"] = float(value)
        return record

    def retrieval(self, engine, logger, done: int) -> dict[str, float]:
        module = engine.module
        module.eval()
        try:
            found = score_prompts(engine, self.prompts, self.dims.sp_group, self.dims.tp_group, engine.device)
            control = score_prompts(engine, self.controls, self.dims.sp_group, self.dims.tp_group, engine.device)
        finally:
            module.train()
        mine, theirs = summarize(found, self.prompts), summarize(control, self.controls)
        record = {"eval/retrieval_accuracy": mine["accuracy"], "eval/retrieval_logprob": mine["logprob"],
                  "eval/retrieval_control_accuracy": theirs["accuracy"],
                  "eval/retrieval_control_logprob": theirs["logprob"]}
        cells = {}
        for length, depth in sorted({(p.length, p.depth) for p in self.prompts}):
            rows = [i for i, p in enumerate(self.prompts) if (p.length, p.depth) == (length, depth)]
            cell = summarize(found[rows], [self.prompts[i] for i in rows])
            cells[(length, depth)] = cell["accuracy"]
            record[f"eval/retrieval/len{length}_depth{depth:g}_accuracy"] = cell["accuracy"]
            record[f"eval/retrieval/len{length}_depth{depth:g}_logprob"] = cell["logprob"]
        if logger is not None and self.is_rank0:
            logger.log_media(done, heatmap_media(cells))
        return record
