"""What every benchmark script shares: fresh processes (gloo ranks), peak memory, peers that may be missing,
and the few calls of our engine's API.

- `spawn(fn, *args, world=N)` runs `fn(*args)` on N fresh processes (a gloo group on a free port when
  N > 1) and returns their results in rank order; a rank that raises fails the call with its traceback
  (`RankFailed`), one over the memory cap or out of memory with `OverMemory`, a run past `timeout` with
  `RankTimeout`; a run that is abandoned is killed with every process it started (a compiler, a launcher's
  ranks). Every process starts from a fresh interpreter (spawn), so its memory is its own; a --quick run
  (`quick_mode`) forks them from a server that has imported torch instead (`fast_start`), and no run of it lasts
  longer than QUICK_DEADLINE_S.
- `peer(name, fn, *args, ...)` is `spawn` for a peer's side: a peer that fails or does not finish in time is
  said in one line (`peer X did not finish in N s`) and the benchmark goes on without its figures.
- `peak_rss_mb()` is this process's own high-water mark (VmHWM, `zero.dist.topology.peak_rss_bytes`),
  not getrusage's, which in a forked child starts at the parent's peak; `rss_over_ranks` takes the
  largest rank's peak (and its training's own share) of a run.
- `deepspeed_runs(what, ops)` says whether DeepSpeed runs here (`deepspeed_missing()`: None when it imports) with
  the ops its side loads; a benchmark otherwise skips its DeepSpeed side with `skip_note`. DeepSpeed compiles some
  ops from C++ on first use (`deepspeed_ops_missing`: minutes on a few cores): a full run builds them first, a
  quick run skips a side whose ops are not built (`python -m benchmarks.common --build-deepspeed-ops` builds them
  once). `deepspeed_moe` is its MoE layer on one rank.
- `failed`, `finish`, `last_line`: a variant that failed is reported (its error's last line) and the run
  exits 1 at the end; `print_ratio` prints the headline figures.
- `initialize`, `parallel_dims`, `fast_adamw`: the engine's API, called from here only, so that a change
  of its signature touches this file.

Scripts run as files (`python benchmarks/zero.py`) put the repository root first on sys.path before
importing this module (benchmarks/zero.py would otherwise shadow the `zero` package).
"""

from __future__ import annotations

import functools
import glob
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVER_CAP = 3  # exit code of a process whose RSS passed its cap (watch_rss)
# The longest a run of a --quick benchmark may take (spawn's timeout is cut to it), so that a peer that hangs
# costs a quick run at most this long: a quick run's own runs take seconds.
QUICK_DEADLINE_S = 45.0
# Phrases of a traceback that mean the run ended for lack of memory (host or disk), not a bug.
_OUT_OF_MEMORY = ("MemoryError", "out of memory", "OffloadError", "No space left")


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries its traceback."""


class OverMemory(RankFailed):
    """A rank went over its RSS cap, was killed (e.g. by the kernel's OOM killer) or ran out of memory."""


class RankTimeout(RankFailed, TimeoutError):
    """The ranks did not all finish within the time limit (they are killed, with what they started)."""

    def __init__(self, message: str, timeout: float | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout


# ---------------------------------------------------------------------------- memory
def peak_rss_mb() -> float:
    """This process's own peak resident memory in MiB (VmHWM)."""
    from zero.dist.topology import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of this process (or of `pid`) now, in MiB; 0 when it has gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def reset_peak_rss() -> float:
    """Set the kernel's peak-RSS mark (VmHWM) back to the current RSS and return that RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_mb()


def rss_over_ranks(ranks: list[dict]) -> dict[str, float]:
    """The largest rank's figures of a run whose ranks each returned `peak_rss_mb` and `baseline_rss_mb` (its
    RSS before the model): peak RSS, and the training's own RSS (peak less that rank's baseline)."""
    return {"peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "train_rss_mb": max(r["peak_rss_mb"] - r["baseline_rss_mb"] for r in ranks)}


def watch_rss(cap_mb: float, every_s: float = 0.002) -> None:
    """End this process with exit code OVER_CAP as soon as its RSS passes `cap_mb` (a daemon thread)."""

    def watch() -> None:
        while rss_mb() <= cap_mb:
            time.sleep(every_s)
        os._exit(OVER_CAP)

    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------------------- processes
def free_port() -> int:
    """A port for a process group's store: zero.dist.topology.free_port (below the kernel's ephemeral range),
    imported on use (this module imports no torch of its own)."""
    from zero.dist.topology import free_port as pick

    return pick()


def _worker(fn, args, kwargs, rank: int, world: int, port: int, threads: int, timeout: float, environ: dict | None,
            results) -> None:
    if environ is not None:  # forked from the server: its environment, not the caller's; set this one's
        os.environ.clear()
        os.environ.update(environ)
        _startup_settings(environ)
    if world > 1:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        value = fn(*args, **kwargs)
        # Plain pickle (not torch's shared-memory reducers): the payload outlives this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer that is gone already: nothing left to tear down
                pass


# glibc reads these at process start; a forked process sets them with mallopt(3) instead.
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3,
            "MALLOC_MMAP_MAX_": -4, "MALLOC_ARENA_MAX": -8}


def _startup_settings(environ: dict) -> None:
    """What a fresh interpreter would have read from `environ` at start: glibc's allocator settings
    and Python's warning filters."""
    import ctypes
    import warnings

    libc = ctypes.CDLL(None)
    for name, param in _MALLOPT.items():
        if name in environ:
            libc.mallopt(param, int(environ[name]))
    for spec in filter(None, environ.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(spec)


_START = "spawn"
# torch._dynamo: every optimizer imports it on construction (a second or more per process otherwise)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def fast_start(*modules: str) -> None:
    """Start the processes of later `spawn` calls by forking a server that has imported torch (and
    `modules`): ~0.1 s a process instead of the 1-3 s of a fresh interpreter. For quick runs: a forked
    process's memory starts from the server's pages, so its RSS figures do not compare with spawned ones."""
    global _START
    _START = "forkserver"
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    _context()  # the server imports while this process goes on with its own work


def _context():
    ctx = mp.get_context(_START)
    if _START == "forkserver":
        from multiprocessing import forkserver

        # Last, so that its exit hook runs first: the server skips the teardown of what it imported.
        ctx.set_forkserver_preload([*_PRELOAD, "benchmarks._fork_server"])
        # The server (started once) passes its environment on: no allocator settings of one call in it.
        malloc = {k: os.environ.pop(k) for k in list(os.environ) if k in _MALLOPT}
        try:
            forkserver.ensure_running()
        finally:
            os.environ.update(malloc)
    return ctx


def _name(fn, args) -> str:
    shown = ", ".join(repr(a) for a in args[:3] if isinstance(a, (str, int, float)))
    return f"{getattr(fn, '__name__', fn)}({shown})"


def spawn(fn: Callable[..., Any], *args: Any, world: int = 1, timeout: float = 900.0, threads: int = 1,
          env: dict[str, str | None] | None = None, rss_cap_mb: float | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world` fresh processes and return each one's result, in rank order.

    World > 1: a gloo process group over the ranks (rank from torch.distributed). `fn` must be importable
    at module level. `threads`: OMP_NUM_THREADS and torch threads of each process. `env` is in the
    processes' environment from their start (e.g. C allocator settings; a None value removes one).
    `rss_cap_mb`: a rank seen above it ends the run at once with OverMemory (the caller's probe has failed
    anyway, and this keeps an oversized run from taking the machine's memory); so does a rank that exits
    with OVER_CAP (watch_rss). `timeout` (in a quick run at most QUICK_DEADLINE_S): ranks still running then
    are killed with every process they started, and the call raises RankTimeout."""
    if _QUICK:
        timeout = min(timeout, QUICK_DEADLINE_S)
    ctx = _context()
    results = ctx.Queue()
    port = free_port() if world > 1 else 0
    start_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env or {})}
    environ = ({k: v for k, v in {**os.environ, **start_env}.items() if v is not None}
               if _START == "forkserver" else None)
    procs = [ctx.Process(target=_worker, args=(fn, args, kwargs, r, world, port, threads, timeout, environ, results))
             for r in range(world)]
    saved = {k: os.environ.get(k) for k in start_env}
    _set_environ(start_env)  # read by the C runtimes (OpenMP, malloc) once, as each process starts
    try:
        for p in procs:
            p.start()
    finally:
        _set_environ(saved)
    what = f"{_name(fn, args)} on {world} rank(s)"
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                _check_running(procs, out, results, rss_cap_mb, deadline, timeout, what)
                continue
            if not ok:
                if any(k in payload for k in _OUT_OF_MEMORY):
                    raise OverMemory(f"{what}: rank {rank}: {payload.strip().splitlines()[-1]}")
                raise RankFailed(f"{what}: rank {rank} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
    finally:
        done = len(out) == world
        for p in procs:
            if not done and p.is_alive():  # abandoned or stuck: it and every process it started (only our own)
                _kill_tree(p.pid)  # (alive: its pid is its own, no other process's)
            p.join(timeout=10 if done else None)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]


def _kill_tree(pid: int) -> None:
    """Kill process `pid` and every process it started (a compiler, a launcher's ranks, theirs): all are stopped
    first, so none starts another meanwhile, then killed. (They stay in the caller's process group: a signal to
    the whole job, Ctrl-C or a harness's kill, still reaches them.)"""
    found: list[int] = []
    for _ in range(2):  # (the second pass finds what was started while the first one looked)
        for victim in [pid, *_descendants(pid)]:
            if victim not in found:
                found.append(victim)
                _signal(victim, signal.SIGSTOP)
    for victim in found:
        _signal(victim, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # gone already


def _descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, from /proc (parents before their children)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # (the command in parentheses may hold spaces)
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _set_environ(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _check_running(procs: list, out: dict, results, rss_cap_mb: float | None, deadline: float, timeout: float,
                   what: str) -> None:
    """Raise when a run waited on must end: a rank over the RSS cap, a rank dead, or the time is up."""
    if rss_cap_mb is not None:
        seen = max(rss_mb(p.pid) for p in procs)
        if seen > rss_cap_mb:
            raise OverMemory(f"{what}: RSS {seen:.0f} MB passed the {rss_cap_mb:.0f} MB cap, killed")
    for r, p in enumerate(procs):
        if r in out or p.exitcode in (None, 0):
            continue
        if p.exitcode == OVER_CAP:
            raise OverMemory(f"{what}: rank {r} passed its RSS cap")
        if p.exitcode == -9:
            raise OverMemory(f"{what}: rank {r} was killed (exit -9, e.g. out of memory)")
        time.sleep(1.0)  # a crashing rank's traceback may still be on its way
        if not results.empty():
            return
        raise RankFailed(f"{what}: rank {r} died with exit code {p.exitcode}")
    if time.monotonic() > deadline:
        missing = [r for r in range(len(procs)) if r not in out]
        raise RankTimeout(f"{what} did not finish in {timeout:.0f} s (ranks {missing} still running: killed with "
                          "the processes they started)", timeout)


# ---------------------------------------------------------------------------- output
_QUICK = False  # a --quick run (quick_mode): every spawn ends within QUICK_DEADLINE_S, DeepSpeed builds nothing


def quick_limits() -> None:
    """A quick run's bounds (quick_mode sets them): every run ends within QUICK_DEADLINE_S, and a DeepSpeed side
    whose ops are not built is skipped rather than compiled (deepspeed_ops_missing)."""
    global _QUICK
    _QUICK = True


def quick_mode(quick: bool, *preload: str) -> None:
    """A --quick run: processes fork from a preloaded server (`fast_start`), said once in the output, within the
    bounds of quick_limits."""
    if quick:
        quick_limits()
        fast_start(*preload)
        print("quick run: small sizes, processes forked from a preloaded server; a smoke run, not a measurement",
              flush=True)


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(value: float | None, limit: float) -> str:
    """`value <= limit: met` (or MISSED, or not measured)."""
    if value is None:
        return "not measured"
    return f"{value:.2f} <= {limit}: met" if value <= limit else f"{value:.2f} > {limit}: MISSED"


def run_parts(name: str, parts, args, argv: list[str] | None) -> dict:
    """Run the selected parts (`args.parts`, e.g. "1,3") in order, print their times and the command,
    and write the results to `args.json` if given."""
    import json

    chosen = {int(p) for p in args.parts.split(",")}
    out = {}
    t0 = time.perf_counter()
    for part, fn in enumerate(parts, start=1):
        if part in chosen:
            start = time.perf_counter()
            try:
                out[f"part{part}"] = fn(args)
            except RankFailed as e:  # (a run of ours: failed, and the next part goes on)
                failed(f"part {part}", e)
            print(f"\n(part {part} took {(time.perf_counter() - start) / 60:.1f} min)", flush=True)
    print(f"\ntotal {(time.perf_counter() - t0) / 60:.1f} min; command: python -m benchmarks.{name} "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


_FAILED: list[str] = []
_PEERS_FAILED: list[str] = []


def last_line(error: BaseException | str) -> str:
    """The last non-blank line of an error's message (a rank's traceback ends with the exception)."""
    lines = [x for x in str(error).strip().splitlines() if x.strip()]
    return lines[-1] if lines else repr(error)


def failed(what: str, error: BaseException | str) -> None:
    """A variant that failed: said now, and again by `finish`, which then ends the run with exit status 1
    (the other variants still run and print their figures)."""
    _FAILED.append(f"{what}: {last_line(error)}")
    print(f"{what}: FAILED:\n{error}", file=sys.stderr, flush=True)


def finish() -> None:
    """End of a benchmark: the peers that failed named again, and exit status 1 if any variant of ours failed."""
    if _PEERS_FAILED:
        print("peers left out:\n" + "\n".join(f"- {x}" for x in _PEERS_FAILED), flush=True)
    if _FAILED:
        sys.exit("benchmark variants failed:\n" + "\n".join(f"- {x}" for x in _FAILED))


def peer(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any] | None:
    """`spawn(fn, *args, **kwargs)` for a peer's side of a comparison: a peer that fails, or does not finish in
    time (killed with its processes), is said in one line and named again at the end, and None comes back: the
    benchmark goes on without its figures (its exit status is ours alone)."""
    try:
        return spawn(fn, *args, **kwargs)
    except RankFailed as e:
        peer_failed(name, e)
        return None


def peer_failed(name: str, error: BaseException) -> None:
    """One line for a peer that did not give its figures: `peer X did not finish in N s` or its error's last line."""
    if isinstance(error, RankTimeout) and error.timeout is not None:
        line = f"peer {name} did not finish in {error.timeout:.0f} s (killed with its processes)"
    else:
        line = f"peer {name} failed: {last_line(error)}"
    _PEERS_FAILED.append(line)
    print(f"{line}; going on without its figures", flush=True)


def print_ratio(what: str, value: float | None, detail: str = "") -> None:
    """A headline figure as `ratio <what>: <value>x`, the line every benchmark prints (and its test reads)."""
    shown = "-" if value is None else f"{value:.3f}"
    print(f"ratio {what}: {shown}x{f'  ({detail})' if detail else ''}", flush=True)


# ---------------------------------------------------------------------------- peers
@functools.cache
def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot run here (not installed, or its import fails), or None when it imports."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed"
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no DeepSpeed here
        return f"`import deepspeed` fails: {type(e).__name__}: {e}"
    return None


def skip_note(what: str, why: str | None) -> None:
    """The printed line of a skipped comparison."""
    print(f"note: {what} skipped: {why}", flush=True)


#: The op every DeepSpeed side with a process group loads (deepspeed.init_distributed on CPU: its shared-memory
#: collectives).
DEEPSPEED_COMM = ("ShareMemCommBuilder",)


def deepspeed_runs(what: str = "the DeepSpeed side", ops: tuple[str, ...] = DEEPSPEED_COMM) -> bool:
    """Whether DeepSpeed imports here and loads the ops `ops` at once (op builder names, e.g. "FusedAdamBuilder":
    see deepspeed_ops_missing); if not, a note that `what` is skipped."""
    why = deepspeed_missing() or (deepspeed_ops_missing(*ops) if ops else None)
    if why is not None:
        skip_note(what, why)
    return why is None


# DeepSpeed compiles some of its ops from C++ the first time they load (torch's JIT extensions), in a directory of
# TORCH_EXTENSIONS_DIR under a lock file: 7-8 minutes each measured on 2 busy cores, with every rank idle meanwhile.
# A builder killed mid-build leaves its lock file, and torch's loader then waits for it to go forever.
DEEPSPEED_BUILD_TIMEOUT_S = 3600.0
#: The ops the benchmarks load on CPU: collectives (every run), FusedAdam, DeepSpeedCPUAdam, async IO (nvme).
DEEPSPEED_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def deepspeed_ops_missing(*builders: str) -> str | None:
    """Why DeepSpeed cannot load the ops of `builders` at once: in a quick run, those it would compile first (not
    installed prebuilt, not built in the extensions directory); in a full run, those that do not build within
    DEEPSPEED_BUILD_TIMEOUT_S (built here first, in a process of their own, once per machine). None when all load.
    A build lock that no process holds (its builder was killed) is removed on the way, saying so."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    unbuilt = []
    for name in builders:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or installed_ops.get(builder.name) or not builder.is_compatible(verbose=False):
            continue  # prebuilt, or DeepSpeed goes without it here
        directory = Path(_get_build_directory(builder.name, False))
        _clear_stale_lock(directory / "lock")
        if (directory / "lock").exists() or not (directory / f"{builder.name}.so").exists():
            unbuilt.append((name, builder.name))
    if not unbuilt:
        return None
    ops = ", ".join(op for _, op in unbuilt)
    if _QUICK:
        return (f"DeepSpeed's {ops} op(s) are not built yet (it compiles them on first use, for minutes): build them "
                "once with `python -m benchmarks.common --build-deepspeed-ops`, or run without --quick")
    print(f"building DeepSpeed's {ops} op(s) (once per machine; minutes of C++) ...", flush=True)
    try:
        spawn(_build_deepspeed_ops, [name for name, _ in unbuilt], timeout=DEEPSPEED_BUILD_TIMEOUT_S)
    except RankFailed as e:
        return f"DeepSpeed's {ops} op(s) did not build: {last_line(e)}"
    return None


def _build_deepspeed_ops(builders: list[str]) -> None:
    from deepspeed.accelerator import get_accelerator

    for name in builders:
        get_accelerator().create_op_builder(name).load(verbose=False)


def _clear_stale_lock(lock: Path) -> None:
    """Remove torch's build lock of a JIT extension that no process on this machine holds open (torch's builder
    keeps it open while it builds): its builder was killed, and every load of the op would wait for it forever."""
    from moe_lst.kernels.build import clear_stale_lock

    if clear_stale_lock(lock):
        print(f"note: removed {lock}, a build lock left by a builder that was killed (no process holds it)",
              flush=True)


def deepspeed_moe(dim: int, ffn: int, num_experts: int, top_k: int, backend: str = "gloo"):
    """DeepSpeed's MoE layer: GELU experts (dim -> ffn -> dim, no biases), capacity factor 1.25, every expert on
    this rank. Its expert-parallel groups need a process group: a one-rank one (`backend`) when there is none."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE
    from torch import nn

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    expert = nn.Sequential(nn.Linear(dim, ffn, bias=False), nn.GELU(), nn.Linear(ffn, dim, bias=False))
    layer = MoE(dim, expert, num_experts=num_experts, ep_size=1, k=top_k, capacity_factor=1.25)
    layer.set_deepspeed_parallelism()
    return layer


def without_deepspeed(names, what: str = "the DeepSpeed side") -> list:
    """`names` less those naming DeepSpeed (containing "deepspeed") when it cannot run here, with a note."""
    names = list(names)
    if any("deepspeed" in n for n in names) and not deepspeed_runs(what):
        return [n for n in names if "deepspeed" not in n]
    return names


# ---------------------------------------------------------------------------- our engine's API
def parallel_dims(**sizes):
    """zero.ParallelDims(dp=..., tp=..., pp=...): the process layout."""
    import zero

    return zero.ParallelDims(**sizes)


def fast_adamw(**hyper):
    """zero.FastAdamW: the optimizer factory the recipe uses (fused torch AdamW over the engine's masters)."""
    import zero

    return zero.FastAdamW(**hyper)


def initialize(model, optimizer, dims=None, *, plans=(), param_init=None, **config):
    """Our engine around `model`: zero.initialize(model, optimizer, zero.ZeroConfig(**config), dims, ...).

    `plans`: what parallelism applied from outside returned (apply_tensor_parallel, apply_pipeline);
    `param_init` materialises a meta-built model."""
    import zero

    extra = {"param_init": param_init} if param_init is not None else {}
    if plans:
        extra["plans"] = list(plans)
    return zero.initialize(model, optimizer, zero.ZeroConfig(**config), dims, **extra)


def engine_step(engine):
    """One training step through an engine with the DeepSpeed-style API (ours and DeepSpeed share it)."""
    import torch.nn.functional as F

    def train_step(x, y):
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        return loss

    return train_step


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Helpers of the benchmark scripts.")
    parser.add_argument("--build-deepspeed-ops", action="store_true",
                        help=f"build DeepSpeed's ops that the benchmarks load ({', '.join(DEEPSPEED_OPS)}), once per "
                             "machine, so that quick runs compare against DeepSpeed too")
    args = parser.parse_args(argv)
    if not args.build_deepspeed_ops:
        parser.error("nothing to do: pass --build-deepspeed-ops")
    why = deepspeed_missing() or deepspeed_ops_missing(*DEEPSPEED_OPS)
    print(f"DeepSpeed's ops: {why}" if why else "DeepSpeed's ops are built")
    sys.exit(1 if why else 0)


if __name__ == "__main__":
    main()
