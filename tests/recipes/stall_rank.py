"""The pretraining recipe with one rank that stops answering inside a step (for the hang tests):

    torchrun --nproc_per_node 2 -m tests.recipes.stall_rank <rank> <step> <seconds> [key=value ...]

Rank <rank> sleeps <seconds> at the start of step <step> (counted from 1), before any collective of that
step, so the other ranks wait for it inside their first collective of the step. It prints when it
starts sleeping (time.time()), so a test can measure how long the others took to notice.
"""

import os
import sys
import time
from pathlib import Path

import recipes.pretrain as pretrain


def main() -> None:
    rank, step, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    # The rest are the recipe's overrides; Hydra finds its config beside the recipe, not beside this file.
    sys.argv[1:4] = [f"--config-path={Path(pretrain.__file__).parent / 'conf'}"]
    original = pretrain.train_step

    def stalling_train_step(engine, stream, index, *args, **kwargs):
        if index + 1 == step and int(os.environ.get("RANK", "0")) == rank:
            print(f"rank {rank} stalls at step {step} from {time.time():.3f}", flush=True)
            time.sleep(seconds)
        return original(engine, stream, index, *args, **kwargs)

    pretrain.train_step = stalling_train_step
    pretrain.main()


if __name__ == "__main__":
    main()
