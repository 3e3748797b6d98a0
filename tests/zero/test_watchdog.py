"""zero.dist.comm's hang watchdog: a collective in flight past the timeout ends the process (exit 4) with one
line naming the rank, the step and the collective, whatever the backend's own timeout does."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.multirank import free_port

REPO = Path(__file__).resolve().parents[2]

# Both ranks complete one all-reduce; then rank 1 stops answering and rank 0 waits on an asynchronous one.
TWO_RANKS = """
import sys, time, datetime, torch, torch.distributed as dist
from zero.dist import comm
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=300))  # far beyond the watchdog's
comm.start_watchdog(1.0, on_hang=lambda hang: print(f"recorded {hang.kind} at step {hang.step}", flush=True))
comm.set_step(7)
t = torch.ones(4)
comm.all_reduce(t, dist.group.WORLD)
assert t.tolist() == [2.0] * 4
if rank == 1:
    time.sleep(120)
print(f"waiting from {time.time():.3f}", flush=True)
comm.all_reduce(t, dist.group.WORLD, async_op=True).wait()
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_rank_waiting_on_a_silent_peer_exits_within_the_timeout():
    port = str(free_port())
    ranks = [_python(TWO_RANKS, str(r), port) for r in range(2)]
    try:
        out, err = ranks[0].communicate(timeout=60)
        ended = time.time()
        assert ranks[0].returncode == 4, err
        assert ranks[1].poll() is None  # the silent rank is still asleep: only the waiting one noticed
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    waited = ended - float(re.search(r"waiting from ([\d.]+)", out).group(1))
    print(f"rank 0 ended {waited:.2f} s after it began waiting")
    assert 1.0 <= waited < 2.5, waited  # 1 s timeout, checked every 0.25 s, plus the process's exit
    assert "recorded all_reduce at step 7" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: rank 0, step 7: all_reduce over 2 ranks did not complete within timeout_s=1 s"), err


def test_local_computation_inside_a_watched_section_is_not_waiting():
    code = """
import time
from zero.dist import comm
comm.start_watchdog(0.5, setting="pipeline_timeout")
with comm.watched("pipeline send/recv", None):
    with comm.unwatched():
        time.sleep(1.5)  # a stage computing: three timeouts long, not a hang
    print("computed", flush=True)
    time.sleep(30)  # waiting on the other stages: a hang
"""
    proc = _python(code)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4 and out == "computed\n", (out, err)
    assert err.startswith("error: rank 0, outside the training steps: pipeline send/recv over 1 rank did not "
                          "complete within pipeline_timeout=0.5 s"), err
