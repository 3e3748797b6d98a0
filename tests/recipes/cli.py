"""The recipe's command lines without a process start per command line (starting Python, torch and the recipe
costs seconds of CPU per process):

- `run_command_lines`: several `python -m recipes.pretrain <args>` that stop before training (a refused command
  line, a bad layout or value), or of another module of the recipes (`recipes.plan`), in one fresh process
  instead of one process each;
- `train_on_ranks`: what `torchrun --nproc_per_node N -m recipes.pretrain <args>` runs on each rank (the recipe's
  train() in a joined process group), on N ranks of the tests' process pool (tests.multirank).

The process runs each command line as `python -m <module>` would: sys.argv set, the module run as
`__main__` (runpy), what it writes to file descriptors 1 and 2 captured for that command line alone, its exit
status taken from SystemExit (an exception that escapes is printed with its traceback and counts as exit status 1,
as the interpreter does). Between command lines, Hydra's global state is cleared, as a new process would have it.
What the interpreter prints while importing (a warning) is seen by the first command line only: a test that needs
it on every line runs `_run_cli` (tests/recipes/test_pretrain.py) instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_DRIVER = r"""
import importlib.util, json, os, runpy, sys, tempfile, traceback

module, cases = json.loads(sys.stdin.read())
results = []
for argv in cases:
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    sys.argv = [importlib.util.find_spec(module).origin, *argv]
    saved = [os.dup(1), os.dup(2)]
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(files[0].fileno(), 1); os.dup2(files[1].fileno(), 2)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # (as `python -m` runs it)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    results.append({"returncode": code, "stdout": texts[0], "stderr": texts[1]})
print("\n" + json.dumps(results))
"""


def run_command_lines(cases: list[list[str]], module: str = "recipes.pretrain",
                      timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Each of `cases` (the arguments after `python -m <module>`) run in one new process, in order: one
    CompletedProcess per case with its exit status and what it wrote."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps([module, cases]), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"the command-line driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.rstrip().rsplit("\n", 1)[-1])
    return [subprocess.CompletedProcess([sys.executable, "-m", module, *argv], r["returncode"],
                                        r["stdout"], r["stderr"]) for argv, r in zip(cases, results)]


def _train_rank(overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir

    from recipes.pretrain import train

    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        cfg = compose("config", overrides=overrides)
    train(cfg)


def train_on_ranks(world: int, overrides: list[str], timeout: float = 400) -> None:
    """The recipe's train() on the config these overrides compose, on `world` ranks of the tests' process pool
    (one rank: in this process). A run's records are in its run_dir, as after the command line."""
    if world == 1:
        _train_rank(list(overrides))
    else:
        from tests.multirank import run_multirank

        run_multirank(_train_rank, world, list(overrides), timeout=timeout)
