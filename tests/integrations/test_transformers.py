"""ZeroTrainer (transformers.Trainer through the engine) on a plain Hugging Face LlamaForCausalLM, 2 processes under
torchrun with ZeRO-3 and cpu offload: the same per-step losses and final weights as the engine's own loop over the
same model and data, a resume from the Trainer's own checkpoint that continues bit for bit, Ulysses sp=2 and
pipeline stages pp=2 (1F1B over each batch's micro-batches) through moe_lst.models.hf's adapter, and the same
per-step losses and gradient norms as `python -m recipes.pretrain model=hf` from the same save_pretrained weights on
the recipe's own batches."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

import zero
from tests.integrations.common import REPO, assert_same_state, recipe_run, torchrun

# optional frameworks (pyproject's test extra): without them these tests are skipped
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


# run_clm.py's calls at these ZeRO stages, in the same process pair (with datasets installed)
CLM_STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    clm = [f"clm={','.join(map(str, CLM_STAGES))}"] if importlib.util.find_spec("datasets") else []
    torchrun([str(REPO / "tests/integrations/hf_run.py"), str(out), "3", "cpu", "sp", "pp", *clm])
    finals = [torch.load(out / f"final_rank{rank}.pt") for rank in (0, 1)]
    return json.loads((out / "losses.json").read_text()), finals, out


def test_trainer_equals_the_engines_own_loop(hf_runs):
    runs, finals, _ = hf_runs
    for key in ("loss", "grad_norm"):
        assert runs["straight"][key] == pytest.approx(runs["own"][key], rel=1e-5, abs=0), key
    assert runs["own"]["loss"][-1] < runs["own"]["loss"][0] - 0.3  # it trains
    for final in finals:
        for name, value in final["own"].items():
            torch.testing.assert_close(final["straight"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_resumes_from_its_checkpoint_bit_for_bit(hf_runs):
    runs, finals, _ = hf_runs
    for key in ("loss", "grad_norm"):
        assert runs["resumed"][key] == runs["straight"][key][2:], key
    for final in finals:
        assert_same_state(final["straight"], final["resumed"])


def test_sequence_parallel_through_the_adapter(hf_runs):
    runs, finals, _ = hf_runs
    # one data-parallel rank reading both ranks' rows (batch 8): the same global batches as the own loop
    for key in ("loss", "grad_norm"):
        assert runs["sp2"][key] == pytest.approx(runs["own"][key], rel=1e-5, abs=0), key
    for final in finals:
        for name, value in final["own"].items():
            torch.testing.assert_close(final["sp2"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    # evaluate() through the adapter (the loss only): the trained model's, evaluated in one forward
    assert runs["sp2"]["eval_loss"] == pytest.approx(runs["sp2"]["plain_eval_loss"], rel=1e-5)


def test_pipeline_stages_through_the_adapter(hf_runs):
    runs, finals, _ = hf_runs
    # pp=2 (dp=1): one batch of the step's 16 rows per training_step, its 4 micro-batches the own loop's (2 ranks x
    # 2 accumulated); the loss each rank logged is the last stage's, so the Trainer's mean over ranks is it
    for key in ("loss", "grad_norm"):
        assert runs["pp2"][key] == pytest.approx(runs["own"][key], rel=1e-5, abs=0), key
    for final in finals:  # every stage's weights, gathered over the pipeline (Trainer.full_state_dict)
        assert sorted(final["pp2"]) == sorted(final["own"])
        for name, value in final["own"].items():
            torch.testing.assert_close(final["pp2"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    # evaluate() through the stages: the trained model's loss over the first rows, evaluated in one forward
    assert runs["pp2"]["eval_loss"] == pytest.approx(runs["pp2"]["plain_eval_loss"], rel=1e-5)


def test_run_clm_example_at_every_zero_stage(hf_runs):
    """Transformers' run_clm.py, its Trainer a ZeroTrainer, on 2 processes at each stage: training with checkpoints
    and an evaluation every 2 steps, save_model, save_state, evaluate with compute_metrics and
    preprocess_logits_for_metrics, the model card, then a new trainer resumed from checkpoint-2."""
    pytest.importorskip("datasets")
    from safetensors.torch import load_file

    out = hf_runs[2] / "clm"
    ranks = [json.loads((out / f"results_rank{rank}.json").read_text()) for rank in (0, 1)]
    runs, reference = ranks[0], ranks[0]["0"]
    assert reference["loss"][-1] < reference["loss"][0] - 0.3  # it trains
    weights = load_file(out / "stage0" / "model.safetensors")
    # evaluate() against stage 0's saved model evaluated in one process by a plain forward (rank 0 ran it)
    plain, one_token = runs["plain_eval"], 1 / runs["plain_eval"]["tokens"]
    for stage in CLM_STAGES:
        straight, resumed = runs[str(stage)], runs[f"{stage}_resumed"]
        for run in (straight, resumed):
            assert run["steps"] == [1, 2, 3, 4] and run["global_step"] == run["engine_steps"] == 4, (stage, run)
            assert math.isfinite(run["eval"]["eval_loss"])
        for key in (str(stage), f"{stage}_resumed"):  # the metrics are gathered over both ranks: the same on each
            assert ranks[1][key]["eval"]["eval_loss"] == ranks[0][key]["eval"]["eval_loss"], key
            assert ranks[1][key]["eval"]["eval_accuracy"] == ranks[0][key]["eval"]["eval_accuracy"], key
        # stage k trains and evaluates as stage 0 (fp32), and evaluates what it trained
        # (a gradient norm summed from shards in another order: within 1e-5 of stage 0's, 2e-5 after clipping)
        assert straight["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=0), stage
        assert straight["grad_norm"] == pytest.approx(reference["grad_norm"], rel=5e-5, abs=0), stage
        assert straight["eval"]["eval_loss"] == pytest.approx(plain["loss"], rel=1e-5), stage
        assert straight["eval"]["eval_accuracy"] == pytest.approx(plain["accuracy"], abs=one_token), stage
        assert straight["evals_in_training"][0][0] == 2  # evaluated at step 2, then trained on
        saved = load_file(out / f"stage{stage}" / "model.safetensors")
        assert_same_state(saved, weights, rtol=1e-5, atol=1e-6)
        # the resumed trainer continues the same steps bit for bit: losses, evaluations, the final model
        for key in ("loss", "grad_norm", "evals_in_training"):
            assert resumed[key] == straight[key], (stage, key)
        assert resumed["eval"]["eval_loss"] == straight["eval"]["eval_loss"], stage
        assert_same_state(load_file(out / f"stage{stage}_resumed" / "model.safetensors"), saved)
        # what run_clm.py leaves in output_dir
        stage_dir = out / f"stage{stage}"
        for name in ("config.json", "tokenizer.json", "all_results.json", "eval_results.json", "README.md",
                     "checkpoint-2/zero", "checkpoint-4/zero"):
            assert (stage_dir / name).exists(), (stage, name)
        assert json.loads((stage_dir / "trainer_state.json").read_text())["global_step"] == 4


def test_trainer_equals_the_recipe_on_a_hugging_face_model(tmp_path):
    import transformers

    # a tiny Llama written as save_pretrained does: the recipe's model.hf.config and train.init_from, the
    # Trainer's from_pretrained
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.05)
    torch.manual_seed(4)
    pretrained = tmp_path / "pretrained"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(pretrained)
    # constant lr, AdamW without weight decay (the Trainer refuses a decay that skips the norms), clip 1.0
    recipe = recipe_run(tmp_path / "recipe", ["model=hf", f"model.hf.config={pretrained}",
                                              f"train.init_from={pretrained}", "zero.stage=3", "parallel.dp=2",
                                              "optim.weight_decay=0.0"])
    torchrun([str(REPO / "tests/integrations/hf_recipe_run.py"), str(pretrained), str(tmp_path / "trainer")])
    trainer = json.loads((tmp_path / "trainer" / "losses.json").read_text())
    for key in ("loss", "grad_norm"):
        assert trainer[key] == pytest.approx(recipe[key], rel=1e-5, abs=0), key
    assert recipe["loss"][-1] < recipe["loss"][0] - 0.3  # it trains


# ---------------------------------------------------------------------------- one process: what is refused


def _trainer(tmp_path, rows: int = 16, stage: int = 1, extra: dict | None = None, **overrides):
    import transformers
    from moe_lst.integrations.transformers import ZeroTrainer

    from tests.integrations.common import HFRows, train_stream
    from tests.integrations.hf_run import hf_model

    settings = {"output_dir": str(tmp_path), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                "report_to": "none", "disable_tqdm": True, "use_cpu": True, "save_strategy": "no", **overrides}
    dataset = torch.utils.data.Subset(HFRows(train_stream(1), 2), range(rows))
    return ZeroTrainer(model=hf_model(), args=transformers.TrainingArguments(**settings), train_dataset=dataset,
                       zero_config=zero.ZeroConfig(stage=stage), **(extra or {}))


def test_one_process_trains_evaluates_saves_and_refuses_a_partial_accumulation_cycle(tmp_path):
    trainer = _trainer(tmp_path, rows=8, stage=3, max_steps=2)  # 4 batches of 2: two whole cycles
    trainer.train()
    assert trainer.engine.global_steps == 2 and trainer.state.global_step == 2
    metrics = trainer.evaluate(torch.utils.data.Subset(trainer.train_dataset, range(4)))  # the trained shards
    assert 0 < metrics["eval_loss"] < 6.0
    trainer.save_model(str(tmp_path / "final"))  # the whole model from the shards, as save_pretrained writes it
    saved = type(trainer.model).from_pretrained(str(tmp_path / "final")).state_dict()
    trained = trainer.engine.full_state_dict()
    assert_same_state(saved, trained)
    with pytest.raises(NotImplementedError, match="partial accumulation cycle"):
        _trainer(tmp_path, rows=6, num_train_epochs=1).train()  # 3 batches: the last cycle has one


def test_refusals(tmp_path):
    with pytest.raises(NotImplementedError, match="weight decay"):
        _trainer(tmp_path, weight_decay=0.1).train()  # Llama's norms are excluded from decay
    with pytest.raises(ValueError, match="dtype"):
        _trainer(tmp_path, bf16=True)
    with pytest.raises(ValueError, match="bf16_full_eval"):
        _trainer(tmp_path, bf16_full_eval=True)  # it would cast the engine's buffers
    # under pp the pipeline's micro-batches are the accumulation (refused before any group or stage exists)
    with pytest.raises(ValueError, match=r"^gradient_accumulation_steps=2 with pp=2: under pp each batch runs"):
        _trainer(tmp_path, extra={"pp": 2})
    with pytest.raises(ValueError, match=r"^per_device_train_batch_size=2 does not split into pp_microbatches=4"):
        _trainer(tmp_path, extra={"pp": 2, "pp_microbatches": 4}, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match=r"^per_device_eval_batch_size=3 does not split into pp_microbatches=2"):
        _trainer(tmp_path, extra={"pp": 2}, gradient_accumulation_steps=1, per_device_eval_batch_size=3)
    trainer = _trainer(tmp_path, max_steps=2)
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(zero.CheckpointError, match="not written by ZeroTrainer"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
