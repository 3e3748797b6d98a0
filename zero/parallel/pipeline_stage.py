"""The pipeline's stage on torch's `PipelineStage`: kept apart from `zero.parallel.pipeline` because importing
torch.distributed.pipelining (and DTensor with it) adds to every process's start-up, which a run without pipeline
parallelism never needs; `Pipeline` imports this module when it builds its stages."""

from __future__ import annotations

import inspect
import time

from torch.distributed import pipelining as pl

from zero.dist import comm

# Ask torch's schedules not to keep and merge the last stage's outputs, where their step() takes the argument.
NO_OUTPUTS = ({"return_outputs": False}
              if "return_outputs" in inspect.signature(pl.schedules.PipelineScheduleSingle.step).parameters else {})


class EngineStage(pl.PipelineStage):
    """A PipelineStage that tells the pipeline when gradients are produced, so the ZeRO engine can
    scale attached losses before and reduce gradients after each backward (full or weight-only)."""

    def __init__(self, *args, runner, **kwargs) -> None:  # runner: the zero.parallel.pipeline.Pipeline
        super().__init__(*args, **kwargs)
        self.runner = runner

    def _held(self) -> int:
        """Micro-batches whose activations this stage holds: awaiting backward, or (zero-bubble schedules)
        their weight-gradient pass after the input-gradient one."""
        return len(self.fwd_cache) + len(self.backward_state)

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        start = time.perf_counter()
        with comm.unwatched():
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.runner._record("F", self.stage_index, fwd_chunk_id, start, self._held())
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if not self.has_backward:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        start = time.perf_counter()
        with comm.unwatched():
            self.runner._before_grads(self.stage_index, full_backward)
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            if full_backward:
                self.runner._after_grads(self.stage_index)
        self.runner._record("B" if full_backward else "I", self.stage_index, bwd_chunk_id, start, self._held())

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if not self.has_backward:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        start = time.perf_counter()
        with comm.unwatched():
            self.runner._before_grads(self.stage_index, True, weight_pass=True)
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
            self.runner._after_grads(self.stage_index)
        self.runner._record("W", self.stage_index, bwd_chunk_id, start, self._held())
