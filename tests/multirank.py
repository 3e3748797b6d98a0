"""Run a function on N gloo processes: the one helper every multi-rank test uses.

`run_multirank(fn, world_size, *args)` runs `fn(*args)` on `world_size` gloo ranks (it reads its rank from
torch.distributed) and returns the list of per-rank return values. A rank that raises fails the call with that
rank's traceback; a run that does not finish within `timeout` seconds is killed and reported instead of hanging.

Where the ranks run:
- A pool (the default): per world size, `world_size` persistent processes, started on first use, each with the
  default gloo process group initialised once; every call of that size is a task for them. Starting a process
  (Python, torch, the project) costs seconds on a loaded machine; a task costs what `fn` costs. After each task
  every rank puts back what a fresh process would have (`_Baseline.restore`): the environment, torch's global
  settings and random generators, the project's process-wide state (`_reset_project_state`), module and class
  attributes of the project and the tests rebound by the task, the process groups it created, the working
  directory, `sys.argv`/`sys.path`, warning filters, logging's root and the signal handlers; then the ranks meet
  at a barrier. A rank that raises, dies or times out ends the whole pool of that size (its processes are
  killed) and is reported as before; the next call starts a fresh pool, as does one after a task that leaves a
  rank past `RECYCLE_AT` (memory, open files, threads). `MOE_LST_TEST_POOL=0` turns the pool off (every call
  spawns), e.g. to tell a pool problem from a test's own.
- Fresh processes, spawned for this call alone: with `fresh=True` (tests that measure the process: resident
  memory, peak RSS, live objects through `gc`, glibc's malloc settings), and for a call whose environment differs
  from the pool's in a variable read when a process or a module starts (`read_at_start`: thread counts,
  allocator and oneDNN settings, torch/Triton/CUDA switches, the project's `MOE_LST_*`), since setting those in
  a running process changes nothing.
"""

from __future__ import annotations

import atexit
import collections
import gc
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: Set to 0 to spawn fresh processes for every call (1: reuse a pool of processes per world size).
POOL_VARIABLE = "MOE_LST_TEST_POOL"
POOL_DEFAULT = "1"
#: What every rank's environment adds to the caller's (one thread each: the ranks share few cores).
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: Variables read once, when a process or a module starts (a running process ignores a change): a call that
#: sets one differently from the pool gets fresh processes.
START_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "ONEDNN_", "DNNL_", "LRU_CACHE_CAPACITY", "MALLOC_",
                  "LD_", "PYTHON", "TORCH", "PYTORCH_", "TRITON_", "CUDA_", "NCCL_", "GLOO_", "NVIDIA_", "HF_",
                  "TRANSFORMERS_", "TOKENIZERS_", "MOE_LST_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                  "LOCAL_WORLD_SIZE")
#: Imported by every pool process before its base state is taken: their import-time effects (moe sets oneDNN's
#: cache bounds in the environment) belong to the base, as in a fresh process that imports them first.
PRELOAD = ("moe", "zero", "sequence_parallel")
#: Packages whose module and class attributes are put back after each task (monkeypatched settings, methods).
STATE_ROOTS = ("moe", "zero", "sequence_parallel", "recipes", "moe_lst", "integrations", "tests")
#: Pools alive at once (each holds world_size processes); the least recently used one goes first.
MAX_POOLS = 2
#: The pool's process groups wait this long inside a collective; a call's own timeout ends it much sooner.
_POOL_PG_TIMEOUT_S = 3600.0
#: How long the ranks may take to clean up after a task before the pool is dropped (the results still count).
_CLEANUP_S = 60.0
#: A pool whose rank holds more than this after a task is replaced by a new one. What a task leaves alive stays:
#: an engine that is not closed is never freed (its parameters' gradient hooks hold it), nor are the gloo groups it
#: holds (3 threads and 5 descriptors each); resident memory grows with every module imported.
RECYCLE_AT = {"rss_bytes": 2 << 30, "open_files": 1000, "threads": 600}


class MultiRankError(RuntimeError):
    """A rank raised, died or timed out."""


def free_port() -> int:
    """A port for a process group's store: zero.dist.topology.free_port (below the kernel's ephemeral range),
    imported on use (this module imports no torch of its own)."""
    from zero.dist.topology import free_port as pick

    return pick()


def read_at_start(name: str) -> bool:
    """Whether environment variable `name` is read when a process or module starts (see START_PREFIXES)."""
    return name != POOL_VARIABLE and name.startswith(START_PREFIXES)


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", repr(fn))


# ---------------------------------------------------------------------------- fresh processes, one call each
def _worker(fn, rank, world_size, port, results, args, kwargs, timeout, env) -> None:
    os.environ.update(env)
    os.environ.update(_rank_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        value = fn(*args, **kwargs)
        # Plain pickle (not torch's shared-memory reducers): the payload outlives this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _run_fresh(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float,
               env: dict[str, str]) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    child_env = {**CHILD_ENV, **env}
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args, kwargs, timeout, child_env))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise MultiRankError(
                        f"{_name(fn)} on {world_size} ranks timed out after {timeout:.0f}s; "
                        f"ranks still running: {missing}"
                    ) from None
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode not in (None, 0):
                        # Give a crashing rank's traceback a moment to arrive before blaming the exit code.
                        try:
                            rank, ok, payload = results.get(timeout=2.0)
                            break
                        except queue.Empty:
                            raise MultiRankError(f"rank {r} died with exit code {p.exitcode}") from None
                else:
                    continue
            if not ok:
                raise MultiRankError(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


# ---------------------------------------------------------------------------- pool: inside a rank
_MISSING = object()
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                 if hasattr(signal, n))


def _reset_project_state() -> None:
    """The project's process-wide state that a task may leave behind, as a fresh process has it (for the modules
    already imported). The probes cached per device or shape (moe.experts._GROUPED_MM_OK,
    zero.sharding.optimizer._FUSED_OK, zero.optim.compression._SIGN_TABLES, the lru caches of pure functions)
    give what a fresh process would compute, so they stay."""
    comm = sys.modules.get("zero.dist.comm")
    if comm is not None:
        comm.stop_watchdog()  # (its thread would end the process on a later task's slow collective)
        comm.set_step(None)
        comm.stats.reset()
        comm.stats.enabled = True
        comm._waiting.clear()
    cpu = sys.modules.get("moe_lst.kernels.sparse.cpu")
    if cpu is not None:
        cpu._native_state.pop("warned", None)  # (a fresh process warns once about a kernel that cannot build)
    global_hydra = sys.modules.get("hydra.core.global_hydra")
    if global_hydra is not None:
        global_hydra.GlobalHydra.instance().clear()
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


class _Baseline:
    """What a rank of the pool looks like before any task: taken once, put back after each task."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv, self.path = list(sys.argv), list(sys.path)
        self.filters = list(warnings.filters)
        self.log_handlers, self.log_level = list(logging.root.handlers), logging.root.level
        self.log_disable = logging.root.manager.disable
        self.signals = {s: signal.getsignal(s) for s in _SIGNALS}
        self.torch = {
            "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "threads": torch.get_num_threads(), "matmul": torch.get_float32_matmul_precision(),
            "anomaly": torch.is_anomaly_enabled(), "mkldnn": torch.backends.mkldnn.enabled,
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        }
        self.modules: dict[str, tuple[Any, dict, dict]] = {}
        self.snapshot_new_modules()
        gc.collect()
        gc.freeze()

    # -- module and class attributes
    @staticmethod
    def _tracked(name: str) -> bool:
        return name.split(".", 1)[0] in STATE_ROOTS or name == "torch.distributed"

    def record(self, name: str, module: Any) -> None:
        """Record the attributes of a tracked module (and of the classes it defines) if not yet recorded."""
        if name in self.modules or not self._tracked(name):
            return
        attrs = dict(vars(module))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a deprecated attribute warns when its type is asked)
            classes = {k: (v, dict(vars(v))) for k, v in attrs.items()
                       if isinstance(v, type) and getattr(v, "__module__", None) == name}
        self.modules[name] = (module, attrs, classes)

    def snapshot_new_modules(self) -> None:
        """Record the tracked modules imported but not recorded (those `_RecordOnImport` did not see load)."""
        for name, module in list(sys.modules.items()):
            if module is not None:
                self.record(name, module)

    def restore_modules(self) -> None:
        """Put back every recorded module or class attribute that a task rebound or deleted (names it added stay:
        a submodule imported since is one)."""
        for module, attrs, classes in self.modules.values():
            now = vars(module)
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v:
                    setattr(module, k, v)
            for cls, saved in classes.values():
                current = vars(cls)
                for k, v in saved.items():
                    if current.get(k, _MISSING) is not v:
                        try:
                            setattr(cls, k, v)
                        except (AttributeError, TypeError):  # (a read-only entry: an Enum's member)
                            pass

    # -- the whole reset
    def apply_env(self, set_: dict[str, str], unset: list[str]) -> None:
        """The task's environment: the base one with the caller's differences."""
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(set_)
        for k in unset:
            os.environ.pop(k, None)

    def restore(self) -> None:
        import random

        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        _reset_project_state()
        dist.barrier()  # (every rank is past the task's last collective before its groups go)
        world = distributed_c10d._get_default_group()
        for pg in list(distributed_c10d._world.pg_map):
            if pg is not world:
                dist.destroy_process_group(pg)
        device_mesh = sys.modules.get("torch.distributed.device_mesh")
        resources = getattr(device_mesh, "_mesh_resources", None)
        if resources is not None and hasattr(resources, "mesh_stack"):
            resources.mesh_stack.clear()
        self.restore_modules()
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()

        t = self.torch
        torch.set_default_dtype(t["dtype"])
        torch.set_grad_enabled(t["grad"])
        deterministic = (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled())
        if deterministic != t["deterministic"]:  # (the call imports seconds' worth of modules the first time)
            torch.use_deterministic_algorithms(t["deterministic"][0], warn_only=t["deterministic"][1])
        torch.set_num_threads(t["threads"])
        torch.set_float32_matmul_precision(t["matmul"])
        torch.autograd.set_detect_anomaly(t["anomaly"])
        torch.backends.mkldnn.enabled = t["mkldnn"]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = t["cudnn"]
        torch.set_default_device(None)  # (a fresh process has no default-device mode: tensors go to the CPU)
        # A fresh process seeds its generators from the operating system's entropy (torch too): so does each task.
        torch.seed()
        random.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()

        self.apply_env({}, [])
        os.chdir(self.cwd)
        sys.argv[:], sys.path[:] = self.argv, self.path
        warnings.filters[:] = self.filters
        warnings._filters_mutated()
        logging.root.handlers[:] = self.log_handlers
        logging.root.setLevel(self.log_level)
        logging.disable(self.log_disable)
        for s, handler in self.signals.items():
            if signal.getsignal(s) is not handler and handler is not None:
                signal.signal(s, handler)
        # A fresh process holds none of the task's garbage cycles. What is alive now stays out of later collections
        # (a full one over torch's and the project's objects costs ~0.3 s a task; these cost milliseconds).
        gc.collect()
        gc.freeze()


class _RecordingLoader:
    """A module's loader, unchanged but for recording the module's attributes once its code has run."""

    def __init__(self, loader: Any, record: Callable[[str, Any], None]) -> None:
        self._loader, self._record = loader, record

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._record(module.__name__, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _RecordOnImport:
    """First on sys.meta_path in a pool process: a tracked module a task imports is recorded as imported, before
    the task can change it (recording it after the task would take the task's changes for the module's own)."""

    def __init__(self, baseline: _Baseline) -> None:
        self.baseline = baseline

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if not _Baseline._tracked(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RecordingLoader(spec.loader, self.baseline.record)
        return spec


def _usage() -> dict[str, int]:
    """What this process holds now, in RECYCLE_AT's terms (Linux's /proc; nothing where it is missing)."""
    try:
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return {"rss_bytes": rss, "open_files": len(os.listdir("/proc/self/fd")),
                "threads": len(os.listdir("/proc/self/task"))}
    except (OSError, StopIteration):
        return {}


def _send(conn, kind: str, data: Any) -> None:
    conn.send_bytes(pickle.dumps((kind, data)))  # plain pickle, not torch's shared-memory reducers


def _pool_worker(rank: int, world_size: int, port: int, store: str, conn, base_env: dict[str, str]) -> None:
    """One rank of a pool: initialise the process group once, then run tasks until the pool closes."""
    os.environ.clear()
    os.environ.update(base_env)
    os.environ.update(_rank_env(rank, world_size, port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # Rendezvous through a file of the pool's own: no free port to lose to another process before rank 0
        # binds it (MASTER_ADDR/PORT stay set, as torchrun sets them, for code that reads them).
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=_POOL_PG_TIMEOUT_S))
        for name in PRELOAD:
            importlib.import_module(name)
        baseline = _Baseline()
        sys.meta_path.insert(0, _RecordOnImport(baseline))
        _send(conn, "ready", os.getpid())
    except BaseException:
        _send(conn, "failed", traceback.format_exc())
        conn.close()
        return
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):  # the pool closed (or the test runner is gone)
            os._exit(0)
        try:
            fn, args, kwargs, env_set, env_unset = pickle.loads(blob)
            baseline.apply_env(env_set, env_unset)
            payload = pickle.dumps(fn(*args, **kwargs))
        except BaseException:
            _send(conn, "failed", traceback.format_exc())
            continue  # the caller ends the pool
        _send(conn, "result", payload)
        if not dist.is_initialized():  # the task ended the default group: this process has served
            _send(conn, "retire", "the task destroyed the default process group")
            os._exit(0)
        try:
            baseline.snapshot_new_modules()  # (any the import hook missed: as the task left them, the best known)
            baseline.restore()
            dist.barrier()
            _send(conn, "idle", _usage())
        except BaseException:
            _send(conn, "retire", traceback.format_exc())
            os._exit(1)


# ---------------------------------------------------------------------------- pool: the caller's side
class _Pool:
    """`world_size` pool processes and a pipe to each."""

    def __init__(self, world_size: int, base_env: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.world_size, self.base_env = world_size, base_env
        self.procs, self.conns = [], []
        self.ready = False
        port = free_port()
        self.store_dir = tempfile.mkdtemp(prefix=f"multirank-pool-{world_size}-")
        try:
            for rank in range(world_size):
                mine, theirs = ctx.Pipe(duplex=True)
                self.conns.append(mine)
                p = ctx.Process(target=_pool_worker,
                                args=(rank, world_size, port, os.path.join(self.store_dir, "store"), theirs, base_env),
                                name=f"multirank-pool-{world_size}-{rank}")
                p.start()
                self.procs.append(p)
                theirs.close()  # (the rank sees end-of-file once this process closes its end or exits)
        except BaseException:
            self.close(kill=True)
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def gather(self, kinds: tuple[str, ...], deadline: float, what: str, timeout: float) -> dict[int, tuple]:
        """One message of `kinds` from every rank, by `deadline`; a failure, a death or the deadline raises."""
        got: dict[int, tuple] = {}
        while len(got) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in got]
            left = deadline - time.monotonic()
            if left <= 0:
                raise MultiRankError(f"{what} on {self.world_size} ranks timed out after {timeout:.0f}s; "
                                     f"ranks still running: {pending}")
            multiprocessing.connection.wait([self.conns[r] for r in pending] +
                                            [self.procs[r].sentinel for r in pending], timeout=min(left, 1.0))
            for r in pending:
                if self.conns[r].poll():
                    try:
                        kind, data = pickle.loads(self.conns[r].recv_bytes())
                    except (EOFError, OSError):  # (its end closed: the process is gone or going)
                        self.procs[r].join(timeout=2.0)
                        raise MultiRankError(f"rank {r} died with exit code {self.procs[r].exitcode}") from None
                    if kind == "failed":
                        raise MultiRankError(f"rank {r} of {self.world_size} failed:\n{data}")
                    if kind in kinds:
                        got[r] = (kind, data)
                        continue
                    raise MultiRankError(f"rank {r} of {self.world_size} sent {kind!r} where {kinds} was due")
                if not self.procs[r].is_alive():
                    self.procs[r].join(timeout=1.0)
                    raise MultiRankError(f"rank {r} died with exit code {self.procs[r].exitcode}")
        return got

    def run(self, blob: bytes, name: str, timeout: float, deadline: float) -> list[Any]:
        if not self.ready:
            self.gather(("ready",), deadline, name, timeout)
            self.ready = True
        for r, conn in enumerate(self.conns):
            try:
                conn.send_bytes(blob)
            except OSError:
                self.procs[r].join(timeout=1.0)
                raise MultiRankError(f"rank {r} died with exit code {self.procs[r].exitcode}") from None
        results = self.gather(("result",), deadline, name, timeout)
        return [pickle.loads(results[r][1]) for r in range(self.world_size)]

    def settle(self) -> tuple[bool, str | None]:
        """Wait for every rank to be clean again: whether the pool can serve another task, and if not because
        something went wrong, what."""
        try:
            done = self.gather(("idle", "retire"), time.monotonic() + _CLEANUP_S, "cleaning up", _CLEANUP_S)
        except MultiRankError as e:
            return False, str(e)
        retired = [f"rank {r}: {data}" for r, (kind, data) in sorted(done.items()) if kind == "retire"]
        if retired:
            return False, "; ".join(retired)
        full = any(usage.get(k, 0) > limit for _, usage in done.values() for k, limit in RECYCLE_AT.items())
        return not full, None

    def close(self, kill: bool = False) -> None:
        for conn in self.conns:
            conn.close()  # (an idle rank exits at end-of-file)
        for p in self.procs:
            if kill:
                p.kill()
            p.join(timeout=0.1 if kill else 5.0)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.store_dir, ignore_errors=True)


_pools: collections.OrderedDict[int, _Pool] = collections.OrderedDict()


def close_pools(kill: bool = False) -> None:
    """End every pool (at the end of the test session; `kill` ends busy ranks too)."""
    while _pools:
        _pools.popitem(last=False)[1].close(kill=kill)


atexit.register(close_pools, True)


def pool_enabled() -> bool:
    value = os.environ.get(POOL_VARIABLE, POOL_DEFAULT)
    if value not in ("0", "1"):
        raise ValueError(f"{POOL_VARIABLE}={value!r}: must be 0 (spawn fresh processes for every multi-rank call) "
                         "or 1 (reuse a pool of processes per world size)")
    return value == "1"


def _drop(world_size: int, kill: bool = True) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close(kill=kill)


def _pool_for(world_size: int, base_env: dict[str, str]) -> _Pool:
    """The pool of `world_size` ranks whose processes started with `base_env`'s start-time variables."""
    pool = _pools.get(world_size)
    if pool is not None:
        stale = any(pool.base_env.get(k) != base_env.get(k)
                    for k in {*pool.base_env, *base_env} if read_at_start(k))
        if stale or not pool.alive():
            _drop(world_size)
            pool = None
    if pool is None:
        while len(_pools) >= MAX_POOLS:
            _pools.popitem(last=False)[1].close()
        pool = _pools[world_size] = _Pool(world_size, base_env)
    _pools.move_to_end(world_size)
    return pool


def run_multirank(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                  env: dict[str, str] | None = None, fresh: bool = False, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks and return each rank's result, rank order.

    `fn` must be importable at module level (processes are spawned, not forked). `env` is added to the ranks'
    environment for this call. `fresh=True` runs on processes started for this call alone (for measurements of
    the process itself); so does an `env` that sets a variable read at start (`read_at_start`).
    """
    env = dict(env or {})
    if fresh or not pool_enabled() or any(read_at_start(k) for k in env):
        return _run_fresh(fn, world_size, args, kwargs, timeout, env)
    deadline = time.monotonic() + timeout
    base_env = {**os.environ, **CHILD_ENV}
    pool = _pool_for(world_size, base_env)
    # What a fresh process would start with, as differences from the pool's start: the caller's environment may
    # have changed since (in variables read at use; else the pool would be new) and `env` adds to it.
    target = {**base_env, **env}
    env_set = {k: v for k, v in target.items() if pool.base_env.get(k) != v}
    env_unset = [k for k in pool.base_env if k not in target]
    blob = pickle.dumps((fn, args, kwargs, env_set, env_unset))
    try:
        results = pool.run(blob, _name(fn), timeout, deadline)
    except BaseException:
        _drop(world_size)
        raise
    reusable, problem = pool.settle()
    if not reusable:
        _drop(world_size, kill=problem is not None)
    if problem is not None:
        warnings.warn(f"the {world_size}-rank test pool was restarted after {_name(fn)}: {problem}", RuntimeWarning,
                      stacklevel=2)
    return results
