"""Data preparation: tokens/s of `recipes.prepare_data` against a plain single-process loop over the same tokenizer,
and its peak memory at 1x and 4x the corpus.

The corpus is real text (the topics of Python's own help, cut into documents of ~1.5 KB, repeated with a
numbered prefix each time so that no two documents are equal) as one .jsonl file; the tokenizer a byte-level BPE
trained on the same text (or --tokenizer PATH). The plain loop reads the file line by line, encodes each text with
`tokenizer.encode`, appends EOS and writes uint16 ids: what one writes without a preparation tool. Each variant runs
in its own fresh process, one at a time, alternating over `--rounds`; the figure is the ratio of median tokens/s
(each including its own start: ours starts its worker processes). Both must write the same number of tokens.

Memory: each variant once per corpus size in a fresh process; VmHWM of that process, and its peak above the RSS it
had before preparing. With workers, their RSS is sampled every 20 ms (the largest worker's is shown; a forked
worker's RSS counts the pages it shares with its parent).

    python benchmarks/prepare_data.py            # 16 MB corpus (memory: 16 and 64 MB), 3 rounds
    python benchmarks/prepare_data.py --quick    # 1 MB (memory: 0.5 and 2 MB): a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

EOS = "<|endoftext|>"
ENV = {"TOKENIZERS_PARALLELISM": "false"}  # one thread per process, the plain loop's and each worker's


def documents() -> list[str]:
    import pydoc_data.topics

    docs = []
    for _, text in sorted(pydoc_data.topics.topics.items()):
        piece = ""
        for para in text.split("\n\n"):
            piece += para + "\n\n"
            if len(piece) > 1500:
                docs.append(piece)
                piece = ""
        docs += [piece] if piece else []
    return docs


def write_corpus(path: Path, megabytes: float) -> int:
    """A .jsonl corpus of about `megabytes` MB of text; returns its documents."""
    docs, written, count = documents(), 0, 0
    with open(path, "w") as f:
        while written < megabytes * 2**20:
            line = json.dumps({"text": f"{count // len(docs)}. {docs[count % len(docs)]}"}) + "\n"
            f.write(line)
            written += len(line)
            count += 1
    return count


def train_tokenizer(path: Path, vocab_size: int = 4096) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(documents(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


class WorkerRSS:
    """The largest RSS any child process of this one reaches, sampled every `every_s` (a daemon thread; it reads
    the kernel's list of this process's children, not every process's, so it costs next to nothing)."""

    def __init__(self, every_s: float = 0.02) -> None:
        self.peak_mb, self.running = 0.0, True
        self.thread = threading.Thread(target=self._watch, args=(every_s,), daemon=True)
        self.thread.start()

    @staticmethod
    def children() -> list[str]:
        pids = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/children") as f:
                    pids += f.read().split()
            except OSError:  # a thread that has ended
                continue
        return pids

    def _watch(self, every_s: float) -> None:
        while self.running:
            for pid in self.children():
                self.peak_mb = max(self.peak_mb, common.rss_mb(pid))
            time.sleep(every_s)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return self.peak_mb


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the workers, once their pool is closed)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def plain_loop(tokenizer: str, corpus: str, out: str) -> dict:
    """The baseline: one process, one text at a time."""
    import numpy as np
    from tokenizers import Tokenizer

    start_rss = common.reset_peak_rss()
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    tok = Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id(EOS)
    tokens = 0
    with open(corpus) as f, open(out, "wb") as sink:
        for line in f:
            ids = tok.encode(json.loads(line)["text"], add_special_tokens=False).ids
            ids.append(eos)
            sink.write(np.array(ids, dtype=np.uint16).tobytes())
            tokens += len(ids)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"tokens": tokens, "seconds": seconds, "cpu_s": cpu, "peak_rss_mb": common.peak_rss_mb(),
            "start_rss_mb": start_rss}


def ours(tokenizer: str, corpus: str, out: str, workers: int, chunk_bytes: int) -> dict:
    """recipes.prepare_data.prepare on the same corpus (a small val split, so both write every token)."""
    from recipes.prepare_data import prepare

    start_rss = common.reset_peak_rss()
    watch = WorkerRSS() if workers > 1 else None
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    done = prepare([corpus], tokenizer, out, workers=workers, chunk_bytes=chunk_bytes, val_fraction=0.01,
                   progress=False, force=True, say=lambda *_: None)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"tokens": done.meta["tokens"], "seconds": seconds, "cpu_s": cpu, "peak_rss_mb": common.peak_rss_mb(),
            "start_rss_mb": start_rss, "worker_rss_mb": watch.stop() if watch else None}


def run(variant: str, tokenizer: str, corpus: Path, out: Path, chunk_bytes: int) -> dict:
    if variant == "plain":
        return common.spawn(plain_loop, tokenizer, str(corpus), str(out / "plain.bin"), env=ENV)[0]
    workers = int(variant.split("=")[1])
    return common.spawn(ours, tokenizer, str(corpus), str(out / variant), workers, chunk_bytes, env=ENV)[0]


def throughput(args, tokenizer: str, tmp: Path) -> dict:
    corpus = tmp / "throughput.jsonl"
    docs = write_corpus(corpus, args.megabytes)
    print(f"\n## tokens/s: {args.megabytes:g} MB corpus ({docs:,} documents), {args.rounds} round(s); load "
          f"average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    variants = ("plain", "workers=1", f"workers={args.workers}")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            runs[v].append(run(v, tokenizer, corpus, tmp, args.chunk_bytes))
    tokens = {v: {r["tokens"] for r in rs} for v, rs in runs.items()}
    same = len({t for ts in tokens.values() for t in ts}) == 1
    rate = {v: statistics.median(r["tokens"] / r["seconds"] for r in rs) for v, rs in runs.items()}
    rows = [[v, f"{next(iter(tokens[v])):,}", f"{statistics.median(r['seconds'] for r in runs[v]):.2f}",
             f"{rate[v]:,.0f}", f"{rate[v] / rate['plain']:.2f}",
             f"{statistics.median(r['cpu_s'] for r in runs[v]):.2f}"] for v in variants]
    print(common.table(["variant", "tokens", "median s", "tokens/s", "vs plain", "CPU s (with workers)"], rows))
    load = os.getloadavg()[0]
    skewed = " (more than the cores: the figures are skewed by other work)" if load > (os.cpu_count() or 1) else ""
    print(f"load average after: {load:.1f} on {os.cpu_count()} cores{skewed}")
    print(f"tokens written: {'the same in every variant' if same else 'DIFFER: ' + str(tokens)}")
    if not same:
        common.failed("token counts", f"the variants wrote different numbers of tokens: {tokens}")
    ratio = rate[variants[2]] / rate["plain"]
    common.print_ratio(f"prepare_data {variants[2]} tokens/s / plain loop tokens/s", ratio,
                       f"goal >= 1.8x: {'met' if ratio >= 1.8 else 'MISSED'}")
    return {"rate": rate, "ratio": ratio}


def memory(args, tokenizer: str, tmp: Path) -> dict:
    sizes = (args.memory_megabytes, 4 * args.memory_megabytes)
    print(f"\n## peak memory at {sizes[0]:g} MB and {sizes[1]:g} MB of corpus")
    corpora = {}
    for size in sizes:
        corpora[size] = tmp / f"memory_{size:g}.jsonl"
        write_corpus(corpora[size], size)
    rows, peaks = [], {}
    for variant in ("plain", "workers=1", f"workers={args.workers}"):
        for size in sizes:
            r = run(variant, tokenizer, corpora[size], tmp, args.chunk_bytes)
            peaks[variant, size] = r["peak_rss_mb"]
            rows.append([variant, f"{size:g} MB", f"{r['tokens']:,}", f"{r['peak_rss_mb']:.0f}",
                         f"{r['peak_rss_mb'] - r['start_rss_mb']:.1f}", common.fmt(r.get("worker_rss_mb"), ".0f")])
    print(common.table(["variant", "corpus", "tokens", "VmHWM MB", "above start MB", "largest worker RSS MB"], rows))
    out = {}
    for variant in ("workers=1", f"workers={args.workers}"):
        out[variant] = peaks[variant, sizes[1]] / peaks[variant, sizes[0]]
        common.print_ratio(f"prepare_data {variant} VmHWM at 4x corpus / 1x", out[variant],
                           f"flat within 10%: {common.verdict(out[variant], 1.1)}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small corpora, one round: a smoke run")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json with <|endoftext|> (default: a 4k BPE "
                        "trained on the corpus's text)")
    parser.add_argument("--megabytes", type=float, default=None, help="corpus size for tokens/s (16; quick 1)")
    parser.add_argument("--memory-megabytes", type=float, default=None, help="the 1x corpus for memory (16; quick 0.5)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the tokens/s comparison (3; quick 1)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, default=None, help="prepare_data's unit of work (4; quick 0.25)")
    parser.add_argument("--parts", default="1,2", help="1: tokens/s, 2: memory")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    quick = args.quick
    args.megabytes = args.megabytes or (1 if quick else 16)
    args.memory_megabytes = args.memory_megabytes or (0.5 if quick else 16)
    args.rounds = args.rounds or (1 if quick else 3)
    args.chunk_bytes = int((args.chunk_mb or (0.25 if quick else 4)) * 2**20)
    common.quick_mode(quick, "numpy", "tokenizers", "recipes.prepare_data")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = args.tokenizer
        if tokenizer is None:
            tokenizer = str(tmp / "tokenizer.json")
            train_tokenizer(Path(tokenizer))
        parts = [lambda a: throughput(a, tokenizer, tmp), lambda a: memory(a, tokenizer, tmp)]
        common.run_parts("prepare_data", parts, args, argv)
    common.finish()


if __name__ == "__main__":
    main()
