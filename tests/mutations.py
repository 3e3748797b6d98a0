"""Deliberate breaks that the default test suite must catch, applied one at a time in a scratch copy.

    python tests/mutations.py            # every break, then a table: break, caught?, first failing test
    python tests/mutations.py --list     # the breaks and the tests each one runs
    python tests/mutations.py NAME ...   # some of them (names as --list prints them, or a prefix)
    python tests/mutations.py --clean    # first check that the selected tests pass without any break

Each break is an exact text replacement in one source file (the text must occur exactly once, so a
break that no longer applies is reported, not silently skipped). The repository's files are copied
once into a temporary directory; each break is written there, the tests it names run with `pytest -x`
from that copy, and the file is restored. A break is caught when pytest fails. Exit status: 0 when
every break was caught, 1 otherwise. Not part of the default suite (it runs the multi-rank tests once
per break: about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # exact text, occurring once
    new: str
    tests: tuple[str, ...]  # pytest node ids or files


# ---------------------------------------------------------------- the reduced gradient scaled by 0.999 at dp > 1
_STAGE1_REDUCE = ("            b.grad_acc = out if out.dtype == torch.float32 else out.float()\n",
                  "            b.grad_acc = (out if out.dtype == torch.float32 else out.float()) * "
                  "(0.999 if b.world > 1 else 1.0)\n")
_STAGE23_REDUCE = ("        out = out.float()\n        b = progress.bucket\n",
                   "        out = out.float() * (0.999 if progress.bucket.world > 1 else 1.0)\n"
                   "        b = progress.bucket\n")
# the same, on expert buckets only (reduced over the expert-data-parallel group)
_STAGE1_EXPERT = (_STAGE1_REDUCE[0],
                  "            b.grad_acc = (out if out.dtype == torch.float32 else out.float()) * "
                  "(0.999 if b.world > 1 and b.reduce_group != 'dense' else 1.0)\n")
_STAGE23_EXPERT = (_STAGE23_REDUCE[0],
                   "        out = out.float() * (0.999 if progress.bucket.world > 1 and "
                   "progress.bucket.reduce_group != 'dense' else 1.0)\n        b = progress.bucket\n")
STAGES = "tests/zero/test_stages.py"
FOUR = f"{STAGES}::test_all_stages_four_ranks"
OPTIMIZER = "zero/sharding/optimizer.py"
MOE = "tests/zero/test_moe.py"
OFFLOAD = "tests/zero/test_offload.py::test_offload_trains_as_no_offload_at_every_stage"

MUTATIONS: list[Mutation] = [
    Mutation("grad-scale/stage1", OPTIMIZER, *_STAGE1_REDUCE, (FOUR,)),
    Mutation("grad-scale/stage2-3", OPTIMIZER, *_STAGE23_REDUCE, (FOUR,)),
    Mutation("grad-scale/moe/stage1", OPTIMIZER, *_STAGE1_REDUCE, (MOE,)),
    Mutation("grad-scale/moe/stage2-3", OPTIMIZER, *_STAGE23_REDUCE, (MOE,)),
    Mutation("grad-scale/moe-experts/stage1", OPTIMIZER, *_STAGE1_EXPERT,
             (f"{MOE}::test_moe_ep2_four_ranks_sharded_experts_with_checkpointing",)),
    Mutation("grad-scale/moe-experts/stage2-3", OPTIMIZER, *_STAGE23_EXPERT,
             (f"{MOE}::test_moe_ep2_four_ranks_sharded_experts_with_checkpointing",)),
    Mutation("grad-scale/offload/stage1", OPTIMIZER, *_STAGE1_REDUCE, (OFFLOAD,)),
    Mutation("grad-scale/offload/stage2-3", OPTIMIZER, *_STAGE23_REDUCE, (OFFLOAD,)),
    # inside the offloaded stores themselves: the host copy (cpu) and the spilled file (nvme)
    Mutation("grad-scale/offload-cpu-store", "zero/offload/masters.py",
             "        self.staged = [False] * len(grads)\n        return self.host_grads\n",
             "        self.staged = [False] * len(grads)\n        return [g.mul_(0.999) for g in self.host_grads]\n",
             (OFFLOAD,)),
    Mutation("grad-scale/offload-nvme-store", "zero/offload/masters.py",
             '        host = grad.to("cpu") if grad.is_cuda else grad  # the caller drops its reference\n',
             '        host = (grad.to("cpu") if grad.is_cuda else grad) * 0.999\n', (OFFLOAD,)),
    # ---------------------------------------------------------------- compute-dtype weights left stale after a step
    Mutation("stale-compute-weights/device", "zero/offload/masters.py", "    def _publish_shards(self) -> None:\n",
             "    def _publish_shards(self) -> None:\n        return\n",
             ("tests/zero/test_features.py::test_mixed_precision_weights_are_rounded_masters_and_change_every_step",)),
    Mutation("stale-compute-weights/cpu-offload", "zero/offload/masters.py", '    kind = "cpu"\n',
             '    kind = "cpu"\n\n    def _publish_shards(self) -> None:\n        pass\n',
             ("tests/zero/test_features.py::test_mixed_precision_weights_are_rounded_masters_and_change_every_step",)),
    Mutation("stale-compute-weights/nvme-offload", "zero/offload/masters.py",
             '        self.buckets[i].write_shard(slot.fields["master"][:n], start)\n', "",
             ("tests/zero/test_features.py::test_mixed_precision_weights_are_rounded_masters_and_change_every_step",)),
    # ---------------------------------------------------------------- the runtime skips the SP reduction
    Mutation("sp-reduction-skipped", "zero/sharding/policy.py",
             "    groups = [(DEFAULT_REDUCE_GROUP, dims.dp_sp_group)]",
             "    groups = [(DEFAULT_REDUCE_GROUP, dims.dp_group)]",
             ("tests/sequence_parallel/test_sp_multirank.py::test_sharded_model_loss_and_grads_match_sp1",)),
    # ---------------------------------------------------------------- a replicated parameter updated on one rank
    # Rank 1 drops the gradient of buckets held by several ranks (stage-0 data-parallel copies,
    # tensor-parallel replicas such as the norms), so under SGD its copy keeps the old values.
    Mutation("replica-updated-on-one-rank", OPTIMIZER,
             "        self.masters.step(grads, scale, coef)  # updates",
             "        if grads and torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:\n"
             "            [g.zero_() for g, b in zip(grads, self.trainable) if b.replicas > 1]\n"
             "        self.masters.step(grads, scale, coef)  # updates",
             ("tests/parallel/test_layouts.py::test_tp2_tied_and_untied",)),
]


def _sparse(name: str, old: str, new: str) -> Mutation:
    layout = name.split("/")[1]
    return Mutation(name, "kernels/sparse/layouts.py", old, new,
                    (f"tests/kernels/test_sparse.py::test_layout_mask_equals_independent_reference[True-{layout}]",
                     f"tests/kernels/test_sparse.py::test_layout_mask_equals_independent_reference[False-{layout}]"))


_WINDOW = '    if cfg.layout == "sliding_window":\n        mask = window\n'
_FIXED = "(j % w >= w - cfg.global_blocks)"
_TOPK = "top = scores.topk(min(cfg.random_blocks, n), dim=1)"
_LONGFORMER = "mask = window | torch.isin(j, g) | torch.isin(i, g)"
_VARIABLE = "g = torch.tensor(cfg.global_block_indices, dtype=torch.long)"
MUTATIONS += [
    _sparse("layout/sliding_window/extra-block", _WINDOW, _WINDOW.replace("= window", "= (i - j).abs() <= w")),
    _sparse("layout/sliding_window/dropped-block", _WINDOW, _WINDOW.replace("= window", "= (i - j).abs() < w - 1")),
    _sparse("layout/fixed/extra-block", _FIXED, "(j % w >= w - cfg.global_blocks - 1)"),
    _sparse("layout/fixed/dropped-block", _FIXED, "(j % w >= w - cfg.global_blocks + 1)"),
    _sparse("layout/bigbird/extra-block", _TOPK, _TOPK.replace("cfg.random_blocks,", "cfg.random_blocks + 1,")),
    _sparse("layout/bigbird/dropped-block", _TOPK, _TOPK.replace("cfg.random_blocks,", "cfg.random_blocks - 1,")),
    _sparse("layout/longformer/extra-block", _LONGFORMER, _LONGFORMER.replace("window", "((i - j).abs() <= w)")),
    _sparse("layout/longformer/dropped-block", _LONGFORMER, _LONGFORMER.replace("window", "((i - j).abs() < w - 1)")),
    _sparse("layout/variable/extra-block", _VARIABLE,
            _VARIABLE.replace("cfg.global_block_indices", "cfg.global_block_indices + (n // 2,)")),
    _sparse("layout/variable/dropped-block", _VARIABLE,
            _VARIABLE.replace("cfg.global_block_indices", "cfg.global_block_indices[:-1]")),
]


def _copy_tree(dest: str) -> None:
    """The repository's tracked and untracked-but-not-ignored files, as they are now; `moe_lst/kernels`
    links to the copy's kernels/ (installed under that name), so the tests import the broken copy."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    os.makedirs(os.path.join(dest, "moe_lst"), exist_ok=True)
    os.symlink(os.path.join("..", "kernels"), os.path.join(dest, "moe_lst", "kernels"))


def _check_imports_from(copy: str) -> None:
    """Every mutated package is imported from the copy (not from an installed or editable one)."""
    code = ("import zero.engine, moe, sequence_parallel, moe_lst.kernels.sparse as s; "
            "print(zero.engine.__file__, moe.__file__, sequence_parallel.__file__, s.__file__)")
    env = dict(os.environ, PYTHONPATH=copy)
    files = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    outside = [f for f in files if not os.path.realpath(f).startswith(os.path.realpath(copy))]
    if len(files) != 4 or outside:
        raise RuntimeError(f"the scratch copy's tests would import {outside or files} from outside the copy")


def _pytest(copy: str, tests: tuple[str, ...], timeout: float) -> tuple[bool, str, float]:
    """(passed, first failing test or reason, seconds) of `pytest -x tests` run from the copy."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=copy)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    if proc.returncode == 0:
        return True, "", seconds
    # the first error line of the report says why (an assertion, not e.g. a syntax error in the break)
    reason = next(iter(re.findall(r"^E +(\S.*)", proc.stdout, re.M)), "")[:160]
    return False, f"{failed[0]}  [{reason}]" if failed else proc.stdout[-300:].strip(), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="breaks to apply (names or name prefixes); default all")
    parser.add_argument("--list", action="store_true", help="list the breaks and their tests")
    parser.add_argument("--clean", action="store_true", help="first run the selected tests without any break")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or any(m.name.startswith(n) for n in args.names)]
    if not chosen:
        parser.error(f"no break matches {args.names}; see --list")
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.path}\n    " + "\n    ".join(m.tests))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutations-") as copy:
        _copy_tree(copy)
        _check_imports_from(copy)
        if args.clean:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            ok, why, seconds = _pytest(copy, tests, args.timeout * 2)
            print(f"without breaks: {'pass' if ok else 'FAIL ' + why} ({seconds:.0f} s)", flush=True)
            if not ok:
                return 1
        for m in chosen:
            target = os.path.join(copy, m.path)
            with open(target) as f:
                original = f.read()
            if original.count(m.old) != 1:
                rows.append((m.name, "NOT APPLIED", f"text found {original.count(m.old)} times in {m.path}", 0.0))
            else:
                try:
                    with open(target, "w") as f:
                        f.write(original.replace(m.old, m.new))
                    ok, why, seconds = _pytest(copy, m.tests, args.timeout)
                finally:
                    with open(target, "w") as f:
                        f.write(original)
                rows.append((m.name, "survived" if ok else "caught", why, seconds))
            print(f"{rows[-1][0]:<40} {rows[-1][1]:<11} {rows[-1][3]:6.0f} s  {rows[-1][2]}", flush=True)
    caught = sum(r[1] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} breaks caught")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
