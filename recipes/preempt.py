"""Graceful stop on a scheduler's signal (`train.stop_signals`: SIGTERM, SIGINT and SIGUSR1 by default).

SLURM, Kubernetes and spot instances send a signal, then kill the process once a grace period has passed.
The handler only notes the signal (which one, and when: no exception lands inside a step or a collective);
at each step boundary every rank learns in one all_reduce (MAX) whether any rank got one, and the loop
then saves a checkpoint, writes result.json (`"status": "preempted"`) and exits with 128 + the signal's
number (143 SIGTERM, 130 SIGINT, 138 SIGUSR1; the highest number any rank got). A watcher thread holds the
deadline, `train.stop_grace_s` after the first signal on any rank: past it the process says on stderr
what it was doing and exits with the same code without finishing. Checkpoints are written atomically
(zero.state.checkpoint: every shard into `<dir>.tmp`, then one rename), so an exit during a save leaves
the previous checkpoint the newest complete one. Further signals while stopping are noted and change
nothing.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from recipes.config import check_stop, stop_signal
from zero.dist import comm


def _alive(pid: int) -> bool:
    """Whether process `pid` is running (an exited process not yet reaped by its parent is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Preempted(Exception):
    """The run stopped for a signal at a step boundary, its checkpoint saved: exit with `exit_code`."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code(signum: int) -> int:
    """The documented exit code of a run stopped by signal `signum`: 128 + its number, as a shell reports it."""
    return 128 + signum


class StopSignals:
    """`with StopSignals(names, grace_s) as stop:` catches the named signals for the block's duration and
    restores the previous handlers after it (from the main thread only: elsewhere it catches none).

    `phase` says what the run is doing (named if the stop cannot complete); `on_expire(signame, why)` runs
    before such an exit (e.g. to write result.json)."""

    def __init__(self, names=(), grace_s: float = 120.0) -> None:
        self.grace_s = grace_s
        self.signum = 0  # the first signal this process got (0: none)
        self.deadline: float | None = None  # time.monotonic() by which the process must have exited
        self.phase = "starting"
        self.on_expire: Callable[[str, str], None] | None = None
        self.previous: dict[signal.Signals, object] = {}
        self.rank = os.environ.get("RANK")
        self.peers: list[int] = []  # pids of this node's other ranks (see watch_peers)
        self.complete = False  # checkpoint and result written: nothing left to cut short
        self.closed = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for name in names:
                sig = stop_signal(name)
                self.previous[sig] = signal.signal(sig, self._handle)
                # The handler only notes the signal: system calls under way in any thread (a collective's
                # socket reads) restart rather than fail with EINTR.
                signal.siginterrupt(sig, False)
        self.watcher = threading.Thread(target=self._watch, name="stop-deadline", daemon=True)
        if self.previous:
            self.watcher.start()

    @classmethod
    def from_config(cls, cfg) -> StopSignals:
        """The signals and grace period of the run's `train.*` (checked first: one-line ConfigError)."""
        check_stop(cfg)
        return cls(list(cfg.train.stop_signals), float(cfg.train.stop_grace_s))

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Restore the previous handlers and stop the watcher."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()
        self.closed.set()
        if self.watcher.is_alive():
            self.watcher.join()

    def _say(self, text: str) -> None:
        # os.write, not print: a handler may run while the main thread is inside a print to the same stream
        who = f"rank {self.rank}: " if self.rank is not None else ""
        os.write(2, f"{who}{text}\n".encode())

    def watch_peers(self, group) -> None:
        """Collective: note the pids of the ranks started beside this one (same host, same launcher). A stop
        signal that comes once one of them has exited is torchrun (or srun) ending the job after a failure: no
        checkpoint can be agreed on without that rank, so this process then exits at once (with the signal's
        code) rather than wait for a step boundary it may never reach."""
        me = (socket.gethostname(), os.getppid())
        everyone = comm.all_gather_object((me, os.getpid()), group)
        self.peers = [pid for key, pid in everyone if key == me and pid != os.getpid()]

    def exiting(self) -> None:
        """The stop is complete (checkpoint and result written) and the process is about to exit with its code:
        a further signal, such as torchrun's SIGTERM once another rank has exited, is ignored from now on, also
        while the interpreter shuts down (which would restore the default handlers of caught signals and let
        that SIGTERM end the process as killed rather than with the code). The deadline still holds."""
        self.phase = "exiting (the stop is complete)"
        self.complete = True
        self.ignore()

    def ignore(self) -> None:
        """Ignore the caught signals from now on (the process is about to exit with a code of its own)."""
        for sig in self.previous:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            self._say(f"{name} received again: ignored, the run is already stopping ({self.phase})")
            return
        self.deadline = time.monotonic() + self.grace_s  # (before signum: the watcher reads both)
        self.signum = signum
        self._say(f"{name} received: stopping at the next step boundary with a checkpoint, then exit "
                  f"{exit_code(signum)} (within train.stop_grace_s={self.grace_s:g} s)")

    def agreed(self, group, device) -> int:
        """Collective over `group` (None: this process alone), at a step boundary: the signal every rank stops
        for (the highest number any rank got), or 0. Every rank's deadline becomes the earliest of any."""
        now = time.monotonic()
        left = math.inf if self.deadline is None else self.deadline - now
        signum = self.signum
        if comm.group_size(group) > 1:
            flags = torch.tensor([float(signum), -left], dtype=torch.float64, device=device)
            comm.all_reduce(flags, group, op=dist.ReduceOp.MAX)
            signum, left = int(flags[0].item()), -float(flags[1].item())
        if signum:
            self.deadline = now + left
            self.signum = signum  # (the exit code every rank uses)
            if not self.watcher.is_alive() and not self.closed.is_set():
                self.watcher.start()
        return signum

    def _watch(self) -> None:
        while not self.closed.wait(0.25):
            if not self.signum:
                continue
            name = signal.Signals(self.signum).name
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._expire(f"{name} came train.stop_grace_s={self.grace_s:g} s ago")
            gone = None if self.complete else next((pid for pid in self.peers if not _alive(pid)), None)
            if gone is not None:  # (the job ends for that rank's reason, which it records: not on_expire)
                self._expire(f"{name} came after the rank with pid {gone} on this node exited (no checkpoint can "
                             "be agreed on without it)", record=False)

    def _expire(self, why: str, record: bool = True) -> None:
        """The stop cannot complete: say what was left undone, record it (on_expire), and end the process now."""
        name, code = signal.Signals(self.signum).name, exit_code(self.signum)
        self._say(f"error: {why} and the run is still {self.phase}: exiting with code {code} now")
        threading.Timer(10.0, os._exit, (code,)).start()  # a callback that blocks must not keep the process
        try:
            if record and self.on_expire is not None:
                self.on_expire(name, why)
        except BaseException as e:
            self._say(f"(recording the stop failed: {e!r})")
        finally:
            os._exit(code)

