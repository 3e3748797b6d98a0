import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import multirank
from tests.multirank import MultiRankError, run_multirank


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item()}


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError(f"boom from rank one (pid {os.getpid()}, {torch.get_num_threads()} threads)")
    return dist.get_rank()


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(60)


def _pid() -> int:
    return os.getpid()


def _getenv(name: str) -> str | None:
    return os.environ.get(name)


def _threads_and_pid() -> tuple[int, int]:
    return torch.get_num_threads(), os.getpid()


def _leave_state_behind() -> int:
    """Change what a later task could see: environment, torch's settings and generator, the project's counters,
    a module setting, a class attribute, a process group."""
    from moe_lst.kernels import sparse

    from moe import dispatch
    from zero.dist import comm

    os.environ["MULTIRANK_LEFT"] = "left"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    comm.stats.record("all_reduce", 1024)
    comm.set_step(7)
    sparse.CPU_IMPL = "eager"
    dispatch.AllToAllDispatcher.dispatch = None
    dist.new_group([0, 1])
    return os.getpid()


def _what_is_left() -> dict:
    from moe_lst.kernels import sparse
    from torch.distributed import distributed_c10d

    from moe import dispatch
    from zero.dist import comm

    return {"pid": os.getpid(), "left": os.environ.get("MULTIRANK_LEFT"), "probe": os.environ.get("MULTIRANK_PROBE"),
            "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(), "threads": torch.get_num_threads(),
            "seed": torch.initial_seed(), "comm_bytes": comm.stats.total_bytes, "step": comm._step,
            "cpu_impl": sparse.CPU_IMPL, "dispatch": callable(dispatch.AllToAllDispatcher.dispatch),
            "groups": len(distributed_c10d._world.pg_map)}


@pytest.fixture
def pool(monkeypatch):
    """The pool on, whatever the default."""
    monkeypatch.setenv(multirank.POOL_VARIABLE, "1")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_results_in_rank_order():
    # (2 ranks: the size most tests use, so the pool this starts serves the tests after it)
    out = run_multirank(_rank_and_sum, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["sum"] == 3.0 for o in out)


def test_timeout_instead_of_hang():
    start = time.monotonic()
    with pytest.raises(MultiRankError, match="timed out after 3s"):
        run_multirank(_hang_on_rank_0, 2, timeout=3, fresh=True)
    assert time.monotonic() - start < 30


def test_pool_reuses_its_processes(pool):
    first = run_multirank(_pid, 2)
    assert run_multirank(_pid, 2) == first and len(set(first)) == 2 and os.getpid() not in first


def test_a_task_leaves_no_state_to_the_next(pool):
    left = run_multirank(_leave_state_behind, 2, env={"MULTIRANK_PROBE": "set for the first task"})
    seen = run_multirank(_what_is_left, 2)
    for rank, s in enumerate(seen):
        assert s["pid"] == left[rank]  # the same process ran both tasks
        assert s["left"] is None and s["probe"] is None
        assert s["dtype"] == torch.float32 and s["grad"] and not s["deterministic"] and s["threads"] == 1
        assert s["seed"] != 0  # (a fresh process's seed comes from the operating system)
        assert s["comm_bytes"] == 0 and s["step"] is None
        assert s["cpu_impl"] == "auto" and s["dispatch"]
        assert s["groups"] == 1  # the default group only


def test_a_task_sees_its_env_and_the_callers_environment(pool, monkeypatch):
    monkeypatch.setenv("MULTIRANK_CALLER", "when the pool started")
    multirank.close_pools()
    assert run_multirank(_getenv, 2, "MULTIRANK_CALLER") == ["when the pool started"] * 2
    monkeypatch.setenv("MULTIRANK_CALLER", "changed")
    assert run_multirank(_getenv, 2, "MULTIRANK_CALLER") == ["changed"] * 2
    monkeypatch.delenv("MULTIRANK_CALLER")
    assert run_multirank(_getenv, 2, "MULTIRANK_CALLER") == [None, None]
    assert run_multirank(_getenv, 2, "MULTIRANK_PROBE", env={"MULTIRANK_PROBE": "p"}) == ["p", "p"]
    assert run_multirank(_getenv, 2, "MULTIRANK_PROBE") == [None, None]


def test_a_raising_rank_or_a_timeout_ends_the_pool_and_the_next_call_starts_a_new_one(pool):
    before = run_multirank(_pid, 2)
    with pytest.raises(MultiRankError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom from rank one"):
        run_multirank(_fail_on_rank_1, 2)
    assert not any(_alive(pid) for pid in before)  # killed, the one still waiting on a collective too
    after = run_multirank(_pid, 2)
    assert not set(after) & set(before)
    start = time.monotonic()
    timed_out = r"_hang_on_rank_0 on 2 ranks timed out after 3s; ranks still running: \[0\]"
    with pytest.raises(MultiRankError, match=timed_out):
        run_multirank(_hang_on_rank_0, 2, timeout=3)
    assert time.monotonic() - start < 10
    assert not any(_alive(pid) for pid in after)
    assert run_multirank(_rank_and_sum, 2)[1]["sum"] == 3.0


def test_fresh_processes_for_fresh_calls_start_time_env_and_a_disabled_pool(pool, monkeypatch):
    pooled = run_multirank(_pid, 2)
    # One spawn checks a start-time variable's call (fresh processes that honour it) and a failing rank's report
    # from fresh processes; which calls spawn at all is checked on the routing below (a spawn costs seconds).
    with pytest.raises(MultiRankError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom from rank one") as failed:
        run_multirank(_fail_on_rank_1, 2, env={"OMP_NUM_THREADS": "2"})
    pid, threads = str(failed.value).rsplit("(pid ", 1)[1].split(")")[0].split(", ")
    assert int(pid) not in pooled
    assert threads == "2 threads"  # (read when the process starts: only a new process can honour it)
    spawned = []

    def run_fresh(fn, world_size, args, kwargs, timeout, env):
        spawned.append((fn, env))
        return ["fresh"] * world_size

    monkeypatch.setattr(multirank, "_run_fresh", run_fresh)
    assert run_multirank(_pid, 2, fresh=True) == ["fresh"] * 2
    assert run_multirank(_threads_and_pid, 2, env={"MALLOC_ARENA_MAX": "2"}) == ["fresh"] * 2
    assert run_multirank(_getenv, 2, "MULTIRANK_PROBE", env={"MULTIRANK_PROBE": "read at use"}) == ["read at use"] * 2
    monkeypatch.setenv(multirank.POOL_VARIABLE, "0")
    assert run_multirank(_pid, 2) == ["fresh"] * 2
    assert spawned == [(_pid, {}), (_threads_and_pid, {"MALLOC_ARENA_MAX": "2"}), (_pid, {})]
    monkeypatch.setenv(multirank.POOL_VARIABLE, "1")
    assert run_multirank(_pid, 2) == pooled  # the pool kept its processes meanwhile (a fresh call is no task)


def test_a_pool_past_its_resource_bounds_is_replaced(pool, monkeypatch):
    first = run_multirank(_pid, 2)
    monkeypatch.setattr(multirank, "RECYCLE_AT", {"open_files": 0})
    assert run_multirank(_pid, 2) == first  # served, then replaced
    monkeypatch.setattr(multirank, "RECYCLE_AT", {"open_files": 10**6})
    assert not set(run_multirank(_pid, 2)) & set(first)


def test_a_bad_pool_setting_is_refused(monkeypatch):
    monkeypatch.setenv(multirank.POOL_VARIABLE, "yes")
    with pytest.raises(ValueError, match="MOE_LST_TEST_POOL='yes': must be 0"):
        run_multirank(_pid, 2)
