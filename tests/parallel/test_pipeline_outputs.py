"""A pipeline's last stage keeps no micro-batch output after a training or evaluation step: torch's schedules
would hold every micro-batch's logits until the next step (memory the size of the step's logits). Evaluation
runs under every schedule, the V-shaped ones included (torch's own eval() of those fails), with the same loss."""

import functools

import torch
import torch.nn.functional as F

import zero
from moe_lst.models.llama import Transformer
from tests.multirank import run_multirank
from tests.parallel.harness import MICRO, batch, model_config
from zero.parallel.pipeline import apply_pipeline


def _kept(schedule: str) -> dict:
    dims = zero.ParallelDims(pp=2)
    torch.manual_seed(0)
    model = Transformer(model_config())

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    pipe = apply_pipeline(model, dims, schedule, microbatches=MICRO, loss_fn=loss_fn)
    engine = zero.initialize(pipe.module, functools.partial(torch.optim.SGD, lr=0.1),
                             zero.ZeroConfig(grad_accum_steps=MICRO), dims, plans=[pipe])
    tokens, labels = (torch.cat(t) for t in zip(*(batch(0, i) for i in range(MICRO))))
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    out = {"train": pipe.train_step(engine, tokens, labels, position_ids=pos)}
    engine.step()
    out["after_train"] = [len(s.output_chunks) for s in pipe._stages]
    out["eval"] = pipe.eval_step(engine, tokens, labels, position_ids=pos)
    out["after_eval"] = [len(s.output_chunks) for s in pipe._stages]
    return out


def _every_schedule(schedules: tuple[str, ...]) -> dict[str, dict]:
    return {schedule: _kept(schedule) for schedule in schedules}


def test_no_stage_keeps_outputs_after_a_step_and_every_schedule_evaluates_alike() -> None:
    schedules = ("1f1b", "interleaved_1f1b", "zbv", "dualpipev")
    for by_schedule in run_multirank(_every_schedule, 2, schedules):
        for r in by_schedule.values():
            assert r["after_train"] == [0] * len(r["after_train"]) and r["after_eval"] == r["after_train"], r
            assert r["train"] > 0 and r["eval"] > 0
        first = by_schedule["1f1b"]
        for schedule, r in by_schedule.items():  # the same model, data and update: the same losses
            assert abs(r["train"] - first["train"]) <= 1e-5 * first["train"], (schedule, r, first)
            assert abs(r["eval"] - first["eval"]) <= 1e-5 * first["eval"], (schedule, r, first)
