"""Run a function on N gloo processes: the one helper every multi-rank test uses.

`run_multirank(fn, world_size, *args)` spawns `world_size` processes on a free port, initialises a
gloo process group in each, calls `fn(*args)` (it reads its rank from torch.distributed) and returns
the list of per-rank return values. A rank that raises fails the call with that rank's traceback; a
run that does not finish within `timeout` seconds is killed and reported instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class MultiRankError(RuntimeError):
    """A rank raised, died or timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, results, args, kwargs, timeout, env) -> None:
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
    })
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


def run_multirank(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                  env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks and return each rank's result, rank order.

    `fn` must be importable at module level (processes are spawned, not forked).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    child_env.update(env or {})
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
                        f"{getattr(fn, '__name__', fn)} on {world_size} ranks timed out after {timeout:.0f}s; "
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
