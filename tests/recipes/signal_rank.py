"""The pretraining recipe with one rank that receives a signal mid-run (for the preemption tests):

    torchrun --nproc_per_node 2 -m tests.recipes.signal_rank <rank> <step> <signal> <save_s> [key=value ...]
    python -m tests.recipes.signal_rank 0 <step> <signal> <save_s> [key=value ...]

Rank <rank> sends itself <signal> (SIGTERM, SIGINT, SIGUSR1, ...) at the start of step <step> (counted from
1), as a scheduler would while that step runs; it prints when (time.time()), so a test can measure how long
the run took to stop. With <save_s> > 0, every shard written after that moment takes <save_s> seconds more
(after its bytes are written, inside the save), and rank <rank> gets <signal> once more meanwhile: a save
that outlasts train.stop_grace_s, with a second signal during it.
"""

import os
import signal
import sys
import time
from pathlib import Path

import recipes.pretrain as pretrain
import zero.state.checkpoint as checkpoint


def main() -> None:
    rank, step, signame, save_s = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    sig = getattr(signal, signame)
    me = int(os.environ.get("RANK", "0"))
    # The rest are the recipe's overrides; Hydra finds its config beside the recipe, not beside this file.
    sys.argv[1:5] = [f"--config-path={Path(pretrain.__file__).parent / 'conf'}"]
    original_step, original_write = pretrain.train_step, checkpoint._write
    signalled = []

    def signalling_train_step(engine, stream, index, *args, **kwargs):
        if index + 1 == step:
            signalled.append(True)
            if me == rank:
                print(f"rank {rank} sends {signame} at step {step} at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), sig)
        return original_step(engine, stream, index, *args, **kwargs)

    def slow_write(obj, target):
        original_write(obj, target)
        if signalled and save_s > 0:
            print(f"rank {me} writes {target.name} slowly from {time.time():.3f}", flush=True)
            if me == rank:
                os.kill(os.getpid(), sig)
            time.sleep(save_s)

    pretrain.train_step = signalling_train_step
    checkpoint._write = slow_write
    pretrain.main()


if __name__ == "__main__":
    main()
