"""ZeroTrainer (transformers.Trainer through the engine) on a plain Hugging Face LlamaForCausalLM, 2 processes under
torchrun with ZeRO-3 and cpu offload: the same per-step losses and final weights as the engine's own loop over the
same model and data, a resume from the Trainer's own checkpoint that continues bit for bit, and Ulysses sp=2
through recipes.models.hf's adapter."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integrations.common import REPO, assert_same_state, torchrun


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    torchrun([str(REPO / "tests/integrations/hf_run.py"), str(out), "3", "cpu", "sp"])
    finals = [torch.load(out / f"final_rank{rank}.pt") for rank in (0, 1)]
    return json.loads((out / "losses.json").read_text()), finals


def test_trainer_equals_the_engines_own_loop(hf_runs):
    runs, finals = hf_runs
    for key in ("loss", "grad_norm"):
        assert runs["straight"][key] == pytest.approx(runs["own"][key], rel=1e-5, abs=0), key
    assert runs["own"]["loss"][-1] < runs["own"]["loss"][0] - 0.3  # it trains
    for final in finals:
        for name, value in final["own"].items():
            torch.testing.assert_close(final["straight"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_resumes_from_its_checkpoint_bit_for_bit(hf_runs):
    runs, finals = hf_runs
    for key in ("loss", "grad_norm"):
        assert runs["resumed"][key] == runs["straight"][key][2:], key
    for final in finals:
        assert_same_state(final["straight"], final["resumed"])


def test_sequence_parallel_through_the_adapter(hf_runs):
    runs, finals = hf_runs
    # one data-parallel rank reading both ranks' rows (batch 8): the same global batches as the own loop
    for key in ("loss", "grad_norm"):
        assert runs["sp2"][key] == pytest.approx(runs["own"][key], rel=1e-5, abs=0), key
    for final in finals:
        for name, value in final["own"].items():
            torch.testing.assert_close(final["sp2"][name], value, rtol=1e-4, atol=1e-5, msg=name)
