"""The benchmark scripts keep running: every `benchmarks/*.py --quick` in a subprocess (found by a glob, so a
new script is covered without an edit here) must exit 0 and print the figures it promises, and the scripts
share one helper module (benchmarks/common.py) rather than copies of it.

Every quick run prints at least one `ratio <what>: <number>x` line (`benchmarks.common.print_ratio`: ours
against the peer, or the figure the script is about); PROMISES lists what else each one must print. Without
DeepSpeed (it is an optional peer), a script with a DeepSpeed side must say that it skipped it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HELPERS = {"common.py"}  # modules of benchmarks/ that are not benchmarks
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in HELPERS and not p.name.startswith("_"))
# Scripts without a CPU --quick mode, skipped (with this reason) where no CUDA device is visible.
NEEDS_GPU: dict[str, str] = {}
TIMEOUT_S = 240  # a quick run takes seconds; this only turns a hang into a failure

X = r"\d+\.\d+x"  # a ratio's value
RATIO = re.compile(rf"^ratio .+: {X}", re.M)
PROMISES = {
    "gpu_check.py": [rf"^ratio MoE 256 tokens x 4 experts, ours time / GEMM bound: {X}",
                     rf"^ratio attention seq 256 heads 4/2, ours / SDPA time: {X}",
                     rf"^ratio sparse seq 512, dense SDPA / sliding_window time: {X}",
                     rf"^ratio ZeRO-3 step time, offload optimizer \+ params nvme / none: {X}",
                     r"ok\)\n", r"^recipe model=tiny: 4 steps \(exit 0"],
    "long_sequence.py": [rf"^ratio longest step under the cap, ALST on / off: {X}",
                         rf"^ratio Ulysses sp=2 longest step / sp=1: {X}",
                         rf"^ratio sp=2 longest step, sparse / dense attention: {X}"],
    "million_step.py": [rf"^ratio sp=1 peak RSS at \d+ tokens, measured / linear fit: {X}", r"crop check passed"],
    "moe_layer.py": [rf"^ratio \d+ tokens x 8 experts, fresh grads: time naive / ours: {X}",
                     rf"^ratio \d+ tokens x 8 experts, kept grads: time ours / compute bound: {X}"],
    "offload.py": [rf"^ratio host AdamW step time, fastest peer \(.+\) / ours, same round: {X}",
                   rf"^ratio stage 3 step time, ours cpu offload / ours without offload: {X}",
                   rf"^ratio parameters trained under the cap, nvme offload / stage 3 alone \(.+\): {X}",
                   rf"^ratio gpt2 stage 3 step time, ours / the faster FSDP2: {X}"],
    "pipeline.py": [rf"^ratio pp=2 bubble at m=4, 1f1b measured / theory: {X}",
                    rf"^ratio pp=2 bubble at m=4, zbv / 1f1b: {X}",
                    rf"^ratio tp=2 step time / dp=2 on the same cores: {X}",
                    # deterministic: tensor parallelism halves the parameters of each rank (up to norms)
                    r"^ratio tp=2 parameter memory per rank / tp=1: 0\.5\d*x"],
    "recipe_throughput.py": [rf"^ratio recipe tokens/s / plain loop tokens/s: {X}",
                             # the same model, batches and optimizer: the losses agree to rounding
                             r"max \|loss difference\| steps 1-5 = \d\.\d\de-(0[5-9]|[1-9]\d)|= 0\.00e\+00"],
    "sparse_attention.py": [rf"^ratio 1k tokens fwd\+bwd time, dense SDPA / {mode}: {X}"
                            for mode in ("fixed", "bigbird", "longformer", "sliding_window", "variable", "nsa")],
    "ulysses.py": [rf"^ratio MHA h=8 op peak memory per rank, ours sp=2 / sp=1: {X}",
                   rf"^ratio MHA h=8 layer peak memory per rank, ours sp=2 / sp=1: {X}"],
    "zero.py": [rf"^ratio stage 3 step time ours / FSDP2: {X}", r"^\s+1\s+ours\s+\d"],
}
# Scripts that compare against DeepSpeed (skipped, with a note, where it does not import).
DEEPSPEED_SIDE = {"gpu_check.py", "long_sequence.py", "moe_layer.py", "offload.py", "pipeline.py", "ulysses.py",
                  "zero.py"}


def _deepspeed_imports() -> bool:
    if importlib.util.find_spec("deepspeed") is None:
        return False
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode == 0


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_quick_run(script: Path):
    if script.name in NEEDS_GPU:
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"{script.name} has no CPU --quick mode: {NEEDS_GPU[script.name]}")
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    # Its own session: on a timeout the script and every process it started (ranks, their server) are ended.
    proc = subprocess.Popen([sys.executable, str(script), "--quick"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    took = time.monotonic() - start
    shown = f"--- stdout (end) ---\n{out[-4000:]}\n--- stderr (end) ---\n{err[-4000:]}"
    assert took < TIMEOUT_S, f"{script.name} --quick did not finish in {TIMEOUT_S} s\n{shown}"
    assert proc.returncode == 0, f"{script.name} --quick exited {proc.returncode} after {took:.0f} s\n{shown}"
    assert RATIO.search(out), f"{script.name} --quick printed no `ratio <what>: <value>x` line\n{shown}"
    missing = [p for p in PROMISES.get(script.name, []) if not re.search(p, out, re.M)]
    assert not missing, f"{script.name} --quick did not print {missing}\n{shown}"
    if script.name in DEEPSPEED_SIDE and not _deepspeed_imports():
        note = re.search(r"^note: .+ skipped: .*DeepSpeed", out, re.M)
        assert note, f"{script.name} --quick said nothing of its skipped DeepSpeed side\n{shown}"
    print(f"{script.name} --quick: {took:.1f} s")


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(BENCH.glob("*.py"))}


def test_benchmarks_share_helpers_not_tests():
    """benchmarks/ imports nothing from tests/, reads peak memory as VmHWM (never getrusage's peak, which a
    forked process inherits) and starts processes only through benchmarks/common.py."""
    texts = {p.name: p.read_text() for p in sorted(BENCH.iterdir()) if p.suffix in (".py", ".md", ".sh")}
    for name, text in texts.items():
        assert not re.search(r"^\s*(from|import)\s+tests\b", text, re.M), f"{name} imports from tests/"
        assert "ru_maxrss" not in text, f"{name} reads ru_maxrss: use benchmarks.common.peak_rss_mb (VmHWM)"
    for name, text in _sources().items():
        if name not in HELPERS:
            assert not re.search(r"\b(mp|multiprocessing)\.get_context\b|\bProcess\(target=", text), \
                f"{name} starts processes by hand: use benchmarks.common.spawn"
            assert not re.search(r"\bzero\.(initialize|ZeroConfig|ParallelDims|FastAdamW)\(", text), \
                f"{name} calls the engine API directly: go through benchmarks.common (one place to change)"


def test_no_duplicated_blocks():
    """No block of 6+ lines (blank lines, comments and imports aside) appears twice across benchmarks/*.py."""
    skip = re.compile(r"^(#|import |from \S+ import |$)")
    seen: dict[tuple[str, ...], str] = {}
    duplicates = []
    for name, text in _sources().items():
        lines = [(i + 1, x.strip()) for i, x in enumerate(text.splitlines()) if not skip.match(x.strip())]
        for k in range(len(lines) - 5):
            block = tuple(x for _, x in lines[k:k + 6])
            where = f"{name}:{lines[k][0]}"
            if block in seen and not seen[block].startswith(f"{name}:"):
                duplicates.append(f"{seen[block]} and {where}:\n  " + "\n  ".join(block))
            seen.setdefault(block, where)
    assert not duplicates, "duplicated blocks (move them to benchmarks/common.py):\n" + "\n".join(duplicates[:5])
