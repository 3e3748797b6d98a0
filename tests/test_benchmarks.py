"""The benchmark scripts keep running: every `benchmarks/*.py --quick` in a subprocess (found by a glob, so a
new script is covered without an edit here) must exit 0 and print the figures it promises, and the scripts
share one helper module (benchmarks/common.py) rather than copies of it.

Every quick run prints at least one `ratio <what>: <number>x` line (`benchmarks.common.print_ratio`: ours
against the peer, or the figure the script is about); PROMISES lists what else each one must print. Without
DeepSpeed (it is an optional peer), a script with a DeepSpeed side must say that it skipped it.

The quick runs start when the session's collection ends (tests/conftest.py), in the background at the lowest CPU
priority: the rest of the suite keeps a two-core machine about 60% busy, and the quick runs take what it leaves, so
their tests mostly find them done. A run that shares the cores that way has a wall time that measures the suite, so
what bounds it is its CPU time; a run its test starts (`MOE_LST_QUICK_RUNS_AHEAD=0`, or one test selected alone) is
bounded by its wall time. With cores to spare the runs overlap (AT_ONCE).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HELPERS = {"common.py"}  # modules of benchmarks/ that are not benchmarks
# The quick runs that take longest (20-25 s each on 2 cores; big_model.py's writes and loads a checkpoint on both
# sides, 30-90 s) run with `-m slow`, keeping the default suite short.
SLOW_QUICK_RUNS = {"offload.py", "slow_links.py", "long_sequence.py", "big_model.py"}
SCRIPTS = [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_QUICK_RUNS else p
           for p in sorted(BENCH.glob("*.py")) if p.name not in HELPERS and not p.name.startswith("_")]
# Scripts without a CPU --quick mode, skipped (with this reason) where no CUDA device is visible.
NEEDS_GPU: dict[str, str] = {}
# A quick run's bound, its peers included: a peer that hangs costs it at most common.QUICK_DEADLINE_S (its runs
# are killed then, said in one line, and the script goes on without them).
QUICK_BOUND_S = 90
# A run started ahead shares the cores with the rest of the suite at the lowest priority: its CPU time (its own
# process's and those of the processes it waited for, ranks included, on at most two cores) is bounded instead.
QUICK_CPU_BOUND_S = 2 * QUICK_BOUND_S
TIMEOUT_S = 240  # past this a quick run is killed (a hang of our own becomes a failure, not a stalled suite)
AHEAD_VARIABLE = "MOE_LST_QUICK_RUNS_AHEAD"  # 0: each quick run starts when its test asks for it
_TICKS = os.sysconf("SC_CLK_TCK")

X = r"\d+\.\d+x"  # a ratio's value
RATIO = re.compile(rf"^ratio .+: {X}", re.M)
PROMISES = {
    "gpu_check.py": [rf"^ratio MoE 256 tokens x 4 experts, ours time / GEMM bound: {X}",
                     rf"^ratio attention seq 256 heads 4/2, ours / SDPA time: {X}",
                     rf"^ratio sparse seq 512, dense SDPA / sliding_window time: {X}",
                     rf"^ratio ZeRO-3 step time, offload optimizer \+ params nvme / none: {X}",
                     r"ok\)\n", r"^recipe model=tiny: 4 steps \(exit 0"],
    "hf_models.py": [rf"^ratio llama ours/plain step time: {X}",
                     rf"^ratio qwen3_moe plain loop step time, transformers experts / our grouped experts: {X}",
                     # the same weights, batch and optimizer: every variant's step-1 loss agrees to rounding
                     r"^(llama|qwen3_moe) step-1 loss: .*max difference (\d\.\d\de-(0[5-9]|[1-9]\d)|0\.00e\+00)"],
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
    "packing.py": [rf"^ratio {attention} {what}, packed / one document: {X}"
                   for attention in ("dense", "sparse") for what in ("peak memory", "step time")],
    "prepare_data.py": [rf"^ratio prepare_data workers=2 tokens/s / plain loop tokens/s: {X}",
                        rf"^ratio prepare_data workers=1 VmHWM at 4x corpus / 1x: {X}",
                        r"^tokens written: the same in every variant"],
    "sparse_attention.py": [rf"^ratio 1k tokens fwd\+bwd time, dense SDPA / {mode}: {X}"
                            for mode in ("fixed", "bigbird", "longformer", "sliding_window", "variable", "nsa")],
    "ulysses.py": [rf"^ratio MHA h=8 op peak memory per rank, ours sp=2 / sp=1: {X}",
                   rf"^ratio MHA h=8 layer peak memory per rank, ours sp=2 / sp=1: {X}"],
    "zero.py": [rf"^ratio stage 3 step time ours / FSDP2: {X}", r"^\s+1\s+ours\s+\d"],
}
# Scripts that compare against DeepSpeed (skipped, with a note, where it does not import).
DEEPSPEED_SIDE = {"big_model.py", "gpu_check.py", "hf_models.py", "long_sequence.py", "moe_layer.py", "offload.py",
                  "pipeline.py", "ulysses.py", "zero.py"}


@functools.cache
def _deepspeed_imports() -> bool:
    if importlib.util.find_spec("deepspeed") is None:
        return False
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True).returncode == 0


class QuickRun:
    """`<script> --quick` in a subprocess of its own session (a timeout ends it and every process it started:
    ranks, their server), its output to files (a run started ahead of its test fills no pipe meanwhile). `ahead`:
    started in the background, at the lowest CPU priority (`nice -n 19`, which its processes inherit)."""

    def __init__(self, script: Path, ahead: bool = False) -> None:
        env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.stdout, self.stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.ahead = ahead
        self.start, self.end, self.cpu_s = time.monotonic(), None, None
        self._seen: dict[int, float] = {}
        nice = ["nice", "-n", "19"] if ahead else []
        self.proc = subprocess.Popen([*nice, sys.executable, str(script), "--quick"], cwd=ROOT, env=env, text=True,
                                     stdout=self.stdout, stderr=self.stderr, start_new_session=True)

    def sample(self) -> None:
        """Note the CPU time so far of every process of its session (its ranks and servers included)."""
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[3]) == self.proc.pid:  # (the session id)
                    self._seen[int(entry)] = max(self._seen.get(int(entry), 0.0),
                                                 (int(fields[11]) + int(fields[12])) / _TICKS)

    def running(self) -> bool:
        """Whether it still runs (its end time and CPU time are taken the first time it is seen to have ended:
        the larger of its session's sampled processes and what its own process and those it waited for used)."""
        if self.end is None:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.end = time.monotonic()
                self.cpu_s = max(usage.ru_utime + usage.ru_stime, sum(self._seen.values()))
                self.proc.returncode = os.waitstatus_to_exitcode(status)
        return self.end is None

    def kill(self) -> None:
        if self.running():
            os.killpg(self.proc.pid, signal.SIGKILL)
            while self.running():
                time.sleep(0.01)

    def output(self) -> tuple[str, str]:
        for f in (self.stdout, self.stderr):
            f.seek(0)
        return self.stdout.read(), self.stderr.read()


# Quick runs at a time: one per two cores (a run keeps about one core busy, its ranks mostly waiting on each
# other), at most 4; on a two-core machine one.
AT_ONCE = max(1, min(4, (os.cpu_count() or 1) // 2))


class QuickRuns:
    """The quick runs of the selected tests, in their order, AT_ONCE at a time: started by the tests as they wait
    (while a test waits for its own run, the next ones start) or, `ahead`, by a thread of their own from the end of
    collection on."""

    def __init__(self, order: list[Path], ahead: bool = False) -> None:
        self.order = order
        self.ahead = ahead
        self.runs: dict[Path, QuickRun] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pump = threading.Thread(target=self._pump_ahead, daemon=True, name="quick runs") if ahead else None
        if self._pump is not None:
            self._pump.start()

    def _start_next(self) -> None:
        for script in self.order:
            if sum(run.running() for run in self.runs.values()) >= AT_ONCE:
                return
            if script not in self.runs:
                self.runs[script] = QuickRun(script, ahead=self.ahead)

    def _pump_ahead(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                if self._closed.is_set():
                    return
                for run in self.runs.values():
                    if run.end is None:
                        run.sample()
                self._start_next()
                if len(self.runs) == len(self.order) and not any(run.running() for run in self.runs.values()):
                    return
            self._closed.wait(0.5)

    def wait(self, script: Path) -> QuickRun:
        """Its run, ended (killed when still running TIMEOUT_S after its start or, started ahead, after this call)."""
        asked = time.monotonic()
        with self._lock:
            if script not in self.runs:
                self.runs[script] = QuickRun(script)
            run = self.runs[script]
        limit = (max(run.start, asked) if run.ahead else run.start) + TIMEOUT_S
        while time.monotonic() < limit:
            with self._lock:
                if run.ahead:
                    run.sample()
                if not run.running():
                    break
                if not self.ahead:
                    self._start_next()
            time.sleep(0.1 if not run.ahead else 0.5)
        with self._lock:
            run.kill()
        return run

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for run in self.runs.values():
                run.kill()


def _selected(items) -> list[Path]:
    return [item.callspec.params["script"] for item in items
            if getattr(item, "originalname", None) == "test_quick_run" and item.callspec.params["script"].name
            not in NEEDS_GPU]


_AHEAD: list[QuickRuns] = []  # the runs started ahead (tests/conftest.py), closed at the end of the session


def start_ahead(items) -> None:
    """Start the selected quick runs in the background (tests/conftest.py calls this when collection ends): not
    under pytest-xdist (its workers share the list), nor with MOE_LST_QUICK_RUNS_AHEAD=0, nor for one test alone."""
    order = _selected(items)
    if len(order) > 1 and not os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(AHEAD_VARIABLE) != "0":
        _AHEAD.append(QuickRuns(order, ahead=True))


def close_ahead() -> None:
    while _AHEAD:
        _AHEAD.pop().close()


@pytest.fixture(scope="module")
def quick_runs(request):
    if _AHEAD:
        yield _AHEAD[0]
        return
    # Started while the tests wait: this session's selected quick runs (none under pytest-xdist).
    runs = QuickRuns([] if os.environ.get("PYTEST_XDIST_WORKER") else _selected(request.session.items))
    yield runs
    runs.close()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_quick_run(script: Path, quick_runs: QuickRuns):
    if script.name in NEEDS_GPU:
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"{script.name} has no CPU --quick mode: {NEEDS_GPU[script.name]}")
    run = quick_runs.wait(script)
    out, err = run.output()
    took = run.end - run.start
    shown = f"--- stdout (end) ---\n{out[-4000:]}\n--- stderr (end) ---\n{err[-4000:]}"
    if run.ahead:
        assert run.cpu_s < QUICK_CPU_BOUND_S, \
            f"{script.name} --quick used {run.cpu_s:.0f} CPU-s, over {QUICK_CPU_BOUND_S} s\n{shown}"
    else:
        assert took < QUICK_BOUND_S, f"{script.name} --quick took {took:.0f} s, over {QUICK_BOUND_S} s\n{shown}"
    assert run.proc.returncode == 0, f"{script.name} --quick exited {run.proc.returncode} after {took:.0f} s\n{shown}"
    assert RATIO.search(out), f"{script.name} --quick printed no `ratio <what>: <value>x` line\n{shown}"
    missing = [p for p in PROMISES.get(script.name, []) if not re.search(p, out, re.M)]
    assert not missing, f"{script.name} --quick did not print {missing}\n{shown}"
    if script.name in DEEPSPEED_SIDE and not _deepspeed_imports():
        note = re.search(r"^note: .+ skipped: .*DeepSpeed", out, re.M)
        assert note, f"{script.name} --quick said nothing of its skipped DeepSpeed side\n{shown}"
    print(f"{script.name} --quick: {took:.1f} s" + (f" ({run.cpu_s:.1f} CPU-s, started ahead)" if run.ahead else ""))


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


# ---------------------------------------------------------------------------- deadlines and peers (common.py)
def _sleeping_peer(pid_dir: str) -> None:
    """A peer that hangs: it starts a process that sleeps (as a compiler or a launcher's rank would run), notes both
    pids, and sleeps itself."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_dir, os.environ.get("RANK", "0")).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def _failing_peer() -> None:
    raise RuntimeError("the peer's own error")


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process `pid` ends (or is a zombie nobody reaped yet) within `within_s`."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def forked(monkeypatch):
    """benchmarks.common with its processes forked from a server that has imported torch (as in a quick run), so
    they start at once and a deadline measures the run, not the interpreter's start."""
    from benchmarks import common

    monkeypatch.setattr(common, "_START", "forkserver")
    monkeypatch.setattr(common, "_PRELOAD", ["torch", "torch.distributed"])
    monkeypatch.setattr(common, "_PEERS_FAILED", [])
    common.spawn(os.getpid, timeout=120)  # the server up (its imports are not timed below)
    return common


def test_a_peer_that_hangs_is_killed_with_its_processes_at_its_deadline(forked, tmp_path, monkeypatch, capsys):
    """Two ranks that sleep, each with a sleeping child, in a quick run (whose deadline, 6 s here, cuts the call's
    own 900 s): the call returns at the deadline with one line naming the peer and the time, and no process of
    either rank is left."""
    deadline = 6.0  # (time for both ranks to start and meet in their process group on a busy machine)
    monkeypatch.setattr(forked, "_QUICK", True)
    monkeypatch.setattr(forked, "QUICK_DEADLINE_S", deadline)
    start = time.monotonic()
    assert forked.peer("sleeper", _sleeping_peer, str(tmp_path), world=2, timeout=900) is None
    took = time.monotonic() - start
    assert capsys.readouterr().out == ("peer sleeper did not finish in 6 s (killed with its processes); going on "
                                       "without its figures\n")
    assert deadline <= took < deadline + 5, took
    pids = [int(pid) for rank in ("0", "1") for pid in (tmp_path / rank).read_text().split()]
    assert len(pids) == 4 and all(_gone(pid) for pid in pids), pids
    forked.finish()  # a peer left out: named again, and the exit status stays ours (0)
    assert capsys.readouterr().out == ("peers left out:\n- peer sleeper did not finish in 6 s (killed with its "
                                       "processes)\n")


def test_a_peer_that_fails_is_one_line_and_the_run_goes_on(forked, capsys):
    assert forked.peer("broken", _failing_peer, timeout=30) is None
    assert capsys.readouterr().out == ("peer broken failed: RuntimeError: the peer's own error; going on without its "
                                       "figures\n")
    assert forked.peer("fine", os.getpid, timeout=30) != [os.getpid()]  # (its own process's pid)


def test_a_build_lock_that_no_process_holds_is_removed(tmp_path, capsys):
    """torch's loader waits forever for a JIT extension's lock file to go; one whose builder was killed (nobody holds
    it open) is removed, one being built (held open) is left."""
    from moe_lst.kernels.build import lock_holders

    from benchmarks.common import _clear_stale_lock

    lock = tmp_path / "lock"
    held = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton holds it while it builds
    try:
        assert lock_holders(lock) == [os.getpid()]
        _clear_stale_lock(lock)
        assert lock.exists()
    finally:
        os.close(held)
    _clear_stale_lock(lock)
    assert not lock.exists() and f"note: removed {lock}" in capsys.readouterr().out


@pytest.mark.slow  # (importing DeepSpeed takes a while)
def test_a_quick_run_skips_a_deepspeed_side_whose_ops_are_not_built(tmp_path, monkeypatch, capsys):
    """DeepSpeed compiles FusedAdam's CPU op on first use (minutes): a quick run does not wait for it. Built (its
    library in the extensions directory), it runs, even behind a lock its killed builder left."""
    if not _deepspeed_imports():
        pytest.skip("DeepSpeed does not import here")
    from benchmarks import common

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(common, "_QUICK", True)
    why = common.deepspeed_ops_missing("FusedAdamBuilder")
    assert why.startswith("DeepSpeed's fused_adam op(s) are not built yet") and \
        "python -m benchmarks.common --build-deepspeed-ops" in why
    built = tmp_path / "fused_adam"  # (torch builds an extension in a directory of its name)
    (built / "fused_adam.so").touch()
    (built / "lock").touch()  # left by a builder that was killed
    assert common.deepspeed_ops_missing("FusedAdamBuilder") is None
    assert not (built / "lock").exists()
