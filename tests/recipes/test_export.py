"""Export to the Hugging Face Llama / Mixtral layout and back: same logits in `transformers` (5.x, whose Mixtral holds
its experts fused) and in ours; import of what `transformers` itself saves, in either expert layout."""

import json
import os

import pytest
import torch
from moe_lst.models.llama import ModelConfig, MoEConfig, Transformer

from recipes.export import ExportError, export, import_hf, save_hf
from tests.multirank import run_multirank
from tests.recipes.test_pretrain import TINY, _cfg, _losses, _run_cli

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))


def _model(moe: bool, tie: bool) -> Transformer:
    torch.manual_seed(0)
    m = MoEConfig(num_experts=4, top_k=2, ffn_dim=48) if moe else MoEConfig()
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64,
                      tie_embeddings=tie, moe=m)
    model = Transformer(cfg)
    with torch.no_grad():  # non-trivial norm gains, so a misplaced norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _expert_keys(directory) -> set[str]:
    """The layer-0 MoE tensor names of a saved directory, without the layer prefix."""
    names = safetensors_torch.load_file(str(directory / "model.safetensors"))
    return {k.removeprefix("model.layers.0.") for k in names if k.startswith("model.layers.0.") and
            ("experts" in k or ".gate." in k)}


PER_EXPERT = {"block_sparse_moe.gate.weight", *(f"block_sparse_moe.experts.{e}.w{w}.weight" for e in range(4)
                                                 for w in (1, 2, 3))}
FUSED = {"mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}


@pytest.mark.parametrize("moe, tie, experts", [(False, True, "per_expert"), (False, False, "per_expert"),
                                               (True, False, "per_expert"), (True, False, "fused")])
def test_export_loads_in_transformers_with_the_same_logits_and_imports_back(tmp_path, moe, tie, experts):
    model = _model(moe, tie)
    state = {k: v for k, v in model.state_dict().items() if not (tie and k == "output.weight")}
    save_hf(state, model.cfg, tmp_path, experts=experts)
    if moe:  # Mixtral's published per-expert names (transformers 5 converts them on load), or its fused parameters
        assert _expert_keys(tmp_path) == (PER_EXPERT if experts == "per_expert" else FUSED)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == ("MixtralForCausalLM" if moe else "LlamaForCausalLM")
    with torch.no_grad():
        ours_logits, their_logits = model(TOKENS), theirs(TOKENS).logits
    torch.testing.assert_close(their_logits, ours_logits, rtol=1e-4, atol=1e-4)
    cfg, imported = import_hf(tmp_path)
    again = Transformer(cfg)
    again.load_state_dict(imported, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(TOKENS), ours_logits, rtol=0, atol=0)


def _hf_model(moe: bool, tie: bool):
    """A transformers Llama / Mixtral built from a config (no download), with non-trivial norm gains."""
    torch.manual_seed(3)
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if moe:  # rope_theta: Mixtral's default, 1e6
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.LlamaConfig(intermediate_size=96, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 500.0}, **common)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("moe, tie, original_format", [(False, True, True), (False, False, True), (True, False, True),
                                                       (True, False, False)])
def test_import_of_what_transformers_saves(tmp_path, moe, tie, original_format):
    """`save_pretrained` writes Mixtral's experts per expert by default (save_original_format=True) and as its fused
    parameters otherwise: both import to a model with transformers' logits."""
    theirs = _hf_model(moe, tie)
    theirs.save_pretrained(tmp_path, save_original_format=original_format)
    if moe:
        assert _expert_keys(tmp_path) == (PER_EXPERT if original_format else FUSED)
    cfg, state = import_hf(tmp_path)
    assert (cfg.moe.num_experts, cfg.tie_embeddings) == (4 if moe else 0, tie)
    ours = Transformer(cfg)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("expert_bias") or (tie and k == "output.weight") for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(TOKENS), theirs(TOKENS).logits, rtol=1e-4, atol=1e-4)


def test_import_refuses_a_config_it_cannot_represent(tmp_path):
    theirs = _hf_model(False, False)
    theirs.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}
    config["attention_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="no equivalent here: rope_type=llama3.*; attention_bias=true"):
        import_hf(tmp_path)
    config.update(model_type="qwen3_moe")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="model_type='qwen3_moe': only Llama and Mixtral"):
        import_hf(tmp_path)


def test_export_cli_from_a_run_directory(tmp_path):
    from recipes.pretrain import train

    run = tmp_path / "run"
    train(_cfg(run, "train.steps=2", "model.tie_embeddings=false"))
    out = export(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg, state = import_hf(out)
    ours = Transformer(cfg)
    ours.load_state_dict(state, strict=False)
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), rtol=1e-4, atol=1e-4)


def test_moe_without_a_mixtral_equivalent_is_refused(tmp_path):
    model = _model(True, False)
    model.cfg.moe.num_shared_experts = 1
    with pytest.raises(ExportError, match="no Mixtral equivalent.*shared experts"):
        save_hf(model.state_dict(), model.cfg, tmp_path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Short runs (dense with untied head, MoE as Mixtral and as GLM-4.5 MoE) exported with recipes.export: model
    args, val loss, dir."""
    from recipes.pretrain import train

    out = {}
    # glm: model=moe_small shrunk, exported as GLM-4.5 MoE; three steps of aux-loss-free balancing at a high rate
    # (each a sign step: an odd number leaves every expert's bias off zero) move its biases far enough to change the
    # experts chosen
    for name, args, steps in [("dense", ["model.tie_embeddings=false"], 2), ("moe", ["model=moe_tiny"], 2),
                              ("glm", [*MOE_SMALL_SHRUNK, "model.moe.bias_update_rate=0.05"], 3)]:
        run = tmp_path_factory.mktemp(name)
        result = train(_cfg(run, f"train.steps={steps}", *args))
        out[name] = (args, result["val_loss"], export(run, run / "hf"))
    return out


@pytest.mark.parametrize("name, layout", [("dense", ["zero.stage=3"]), ("moe", ["zero.stage=2"]),
                                          ("glm", ["zero.stage=3"])])
def test_a_fresh_run_initialised_from_an_export_starts_with_its_weights(exported, tmp_path, name, layout):
    """Its validation loss before any step is the exported run's last one, bit for bit (the model is built on the
    meta device and the engine streams the weights in; GLM-4.5 MoE's expert biases too, which change the experts
    chosen)."""
    from recipes.pretrain import Run, evaluate

    args, val_loss, hf = exported[name]
    run = Run(_cfg(tmp_path, "train.steps=2", f"train.init_from={hf}", *args, *layout))
    try:
        assert evaluate(run.engine, run.val_stream, run.cfg, run.dims, run.pipe) == val_loss
    finally:
        run.logger.finish()
        run.lock.close()


def test_init_from_is_refused_for_another_model_and_ignored_on_resume(exported, tmp_path, capsys):
    from recipes.config import ConfigError
    from recipes.pretrain import train

    args, _, hf = exported["moe"]
    with pytest.raises(ConfigError) as refused:
        train(_cfg(tmp_path / "other", f"train.init_from={hf}", "model=moe_tiny", "model.dim=32",
                   "model.moe.num_experts=4", "model.moe.top_k=1"))
    message = str(refused.value)
    assert message.startswith(f"train.init_from={hf} holds another model: model.dim=32 here but 64 there, "
                              "model.moe.num_experts=4 here but 8 there;") and "\n" not in message
    run = tmp_path / "run"
    train(_cfg(run, "train.steps=1", f"train.init_from={hf}", *args))
    capsys.readouterr()
    train(_cfg(run, "train.steps=2", f"train.init_from={hf}", *args))  # resumes: the checkpoint wins
    assert f"train.init_from={hf} is not used: the run resumes from its checkpoint" in capsys.readouterr().out


def test_init_from_under_tensor_parallelism_matches_one_rank(exported, tmp_path):
    """Weights are loaded into the full model before parallelism is applied, so every rank keeps its slice
    (heads, vocabulary rows, expert weight columns; expert parallel ranks their experts) as it would of a
    random init: the first step's loss equals the one-process run's, and is far from the random init's."""
    from recipes.pretrain import train

    args, _, hf = exported["moe"]
    one, many = tmp_path / "one", tmp_path / "many"
    train(_cfg(one, "train.steps=1", f"train.init_from={hf}", *args))
    proc = _run_cli(*args, *TINY[1:], f"run_dir={many}", "train.steps=1", f"train.init_from={hf}", "parallel.tp=2",
                    nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(many)[1] == pytest.approx(_losses(one)[1], rel=1e-5)
    assert abs(_losses(one)[1] - _losses(exported["moe"][2].parent)[1]) > 0.01  # (the source run's first step)
    # The tensor-parallel checkpoint consolidates offline to the same model as the one-process one.
    from safetensors.torch import load_file

    ours, theirs = (load_file(export(run, tmp_path / f"hf_{run.name}") / "model.safetensors") for run in (one, many))
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        torch.testing.assert_close(theirs[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _run_dir_of(tmp_path, *overrides):
    """A run directory as the recipe leaves it (its config.yaml, a checkpoint directory) for a config that the export
    must refuse from the config alone: the checkpoint is empty, so only a refusal before any shard is read passes."""
    from omegaconf import OmegaConf

    from tests.recipes.test_pretrain import _cfg

    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000002").mkdir(parents=True)
    OmegaConf.save(_cfg(run, *overrides), run / "config.yaml", resolve=True)
    return run


@pytest.mark.parametrize("overrides, message", [
    # a Hugging Face model trained with block-sparse attention: transformers would load it as a dense one
    (["model=hf", "model.hf.config=unused", "model.attention=sparse", "model.sparse.layout=sliding_window"],
     "{run} was trained with model.attention=sparse (layout sliding_window): transformers has no block-sparse "
     "attention to express it, so the export would be a dense-attention model with other outputs; only model=hf "
     "runs with model.attention=dense export"),
    # aux-loss-free balancing trains a router bias Mixtral lacks: refused before the shards are consolidated
    (["model=moe_tiny", "model.moe.bias_update_rate=1e-3"],
     "this MoE model has no Mixtral equivalent: model.moe.bias_update_rate=0.001 trains a per-expert selection bias "
     "(aux-loss-free balancing), which Mixtral's router does not have (a sigmoid router exports as GLM-4.5 MoE, "
     "with groups, shared experts, dense layers and the bias)"),
])
def test_export_refuses_from_the_run_config_before_reading_a_checkpoint(tmp_path, capsys, overrides, message):
    from recipes.export import main

    run = _run_dir_of(tmp_path, *overrides)
    with pytest.raises(SystemExit) as exited:
        main([str(run), str(tmp_path / "hf")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"error: {message.format(run=run)}\n"
    assert not (tmp_path / "hf").exists()


def test_the_recipe_trains_what_its_export_would_refuse(tmp_path):
    """Export is its own command (the recipe never exports), so a run is not refused for what its export would be."""
    from omegaconf import OmegaConf

    from recipes.config import check_config

    run = _run_dir_of(tmp_path, "model=moe_tiny", "model.moe.bias_update_rate=1e-3")
    check_config(OmegaConf.load(run / "config.yaml"))


def test_a_non_zero_expert_bias_in_the_weights_is_refused_by_the_same_rule(tmp_path):
    model = _model(True, False)
    model.layers[1].feed_forward.router.expert_bias[2] = 0.5
    with pytest.raises(ExportError, match="no Mixtral equivalent: layer 1's router has a non-zero expert bias"):
        save_hf(model.state_dict(), model.cfg, tmp_path)


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_exported_files_follow_the_umask(tmp_path, mask):
    """model.safetensors (written by safetensors as a 0600 temporary file renamed into place) gets the mode every
    other file gets, 0666 less the umask, beside config.json: from our Llama's export and through save_pretrained."""
    from moe_lst.models.hf import save_weights

    theirs = _hf_model(True, False)
    old = os.umask(mask)
    try:
        save_hf(_model(True, False).state_dict(), _model(True, False).cfg, tmp_path / "ours")
        save_weights(theirs.state_dict(), theirs.config, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in sorted(tmp_path.glob("*/*"))}
    assert {"ours/model.safetensors", "ours/config.json", "hf/model.safetensors", "hf/config.json"} <= set(modes)
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes


# ------------------------------------------------------------------- sigmoid routing: GLM-4.5 MoE (glm4_moe)
def _sigmoid_model(bias: float = 0.1) -> Transformer:
    """DeepSeek-style routing as model=moe_small has it (sigmoid over 4 groups, 2 kept, a shared expert, a leading
    dense layer), with a non-zero expert bias that changes the choices."""
    torch.manual_seed(0)
    m = MoEConfig(num_experts=8, top_k=2, ffn_dim=32, first_dense=1, router="sigmoid", num_groups=4, topk_groups=2,
                  num_shared_experts=1, bias_update_rate=1e-3)
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64, moe=m)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.uniform_(-bias, bias)
    return model.eval()


@pytest.mark.parametrize("experts", ["per_expert", "fused"])
def test_sigmoid_routing_exports_as_glm4_moe_with_its_bias_and_the_same_logits(tmp_path, experts):
    model = _sigmoid_model()
    save_hf(model.state_dict(), model.cfg, tmp_path, experts=experts)
    names = set(safetensors_torch.load_file(str(tmp_path / "model.safetensors")))
    assert ("model.layers.1.mlp.experts.0.gate_proj.weight" in names) == (experts == "per_expert")
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"} <= names
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Glm4MoeForCausalLM"
    for i in (1, 2):  # the expert bias is GLM's score-correction bias
        bias = model.layers[i].feed_forward.router.expert_bias
        assert bias.abs().min() > 0
        assert torch.equal(theirs.model.layers[i].mlp.gate.e_score_correction_bias, bias)
    with torch.no_grad():
        ours_logits = model(TOKENS)
        torch.testing.assert_close(theirs(TOKENS).logits, ours_logits, rtol=1e-4, atol=1e-4)
        for i in (1, 2):  # (the bias changes the choices: without it the logits differ)
            theirs.model.layers[i].mlp.gate.e_score_correction_bias.zero_()
        assert (theirs(TOKENS).logits - ours_logits).abs().max() > 1e-3
    cfg, imported = import_hf(tmp_path)
    again = Transformer(cfg)
    assert not again.load_state_dict(imported, strict=False).unexpected_keys
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(TOKENS), ours_logits, rtol=0, atol=0)


def test_a_glm4_moe_directory_streams_its_expert_bias_and_one_of_another_length_is_refused(tmp_path):
    """The streaming load reads GLM-4.5 MoE's expert biases (buffers, each MoE layer's own) with the parameters:
    the loaded model holds the directory's weights and biases exactly; a bias of another length is refused in one
    line naming the tensor and the file, before any weight is read."""
    from moe_lst.models.llama.state_dict import open_hf_checkpoint
    from moe_lst.models.loading import CheckpointError

    import zero

    model = _sigmoid_model()
    save_hf(model.state_dict(), model.cfg, tmp_path / "glm")
    weights = open_hf_checkpoint(tmp_path / "glm", model.cfg)
    assert sorted(weights.buffers) == [f"layers.{i}.feed_forward.router.expert_bias" for i in (1, 2)]
    fresh = Transformer(model.cfg)
    engine = zero.initialize(fresh, lambda params: torch.optim.SGD(params, lr=0.1), zero.ZeroConfig(stage=0),
                             zero.ParallelDims(dp=1))
    weights.load_into(engine)
    loaded = engine.full_state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value), name
    bad, name = tmp_path / "bad", "model.layers.2.mlp.gate.e_score_correction_bias"
    bad.mkdir()
    tensors = safetensors_torch.load_file(str(tmp_path / "glm" / "model.safetensors"))
    safetensors_torch.save_file({**tensors, name: tensors[name][:-1].clone()}, str(bad / "model.safetensors"),
                                metadata={"format": "pt"})
    (bad / "config.json").write_text((tmp_path / "glm" / "config.json").read_text())
    with pytest.raises(CheckpointError) as refused:
        open_hf_checkpoint(bad, model.cfg)
    assert str(refused.value) == (f"{bad / 'model.safetensors'}: tensor {name} has shape [7] where the run's model "
                                  "needs [8] (for layers.2.feed_forward.router.expert_bias); the directory holds "
                                  "another model")


def test_sigmoid_routing_that_glm4_moe_cannot_express_is_refused(tmp_path):
    model = _sigmoid_model()
    model.cfg.moe.every = 2
    with pytest.raises(ExportError, match=r"no GLM-4.5 MoE \(glm4_moe\) equivalent: model.moe.every=2"):
        save_hf(model.state_dict(), model.cfg, tmp_path)


MOE_SMALL_SHRUNK = ["model=moe_small", "model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
                    "model.ffn_dim=96", "model.moe.num_experts=8", "model.moe.ffn_dim=32", "model.moe.top_k=2"]


def _trained_and_exported(tmp_path, *args: str):
    """A short run of the recipe, its export loaded in transformers, and the run's own model with the trained
    weights."""
    from recipes.config import model_config
    from recipes.export import consolidate
    from recipes.pretrain import train

    run = tmp_path / "run"
    train(_cfg(run, "train.steps=3", "train.ckpt_every=3", *args))
    out = export(run, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from omegaconf import OmegaConf

    cfg = model_config(OmegaConf.load(run / "config.yaml"))
    ours = Transformer(cfg)
    shapes = {n: t.shape for n, t in ours.state_dict().items()}
    state = {n: t.reshape(shapes[n]) for n, t in consolidate(run / "checkpoints" / "step_0000003").items()
             if n in shapes}
    ours.load_state_dict(state, strict=False)
    return theirs, ours.eval(), state


@pytest.mark.parametrize("preset", ["moe_small", "moe_tiny"])
def test_the_moe_presets_export_with_the_recipes_logits(tmp_path, preset):
    """model=moe_small (shrunk to test size; its routing, groups, shared expert, dense layer and trained bias kept)
    exports as glm4_moe, model=moe_tiny as Mixtral: transformers' logits within 1e-4 of the trained model's."""
    args = MOE_SMALL_SHRUNK if preset == "moe_small" else ["model=moe_tiny"]
    theirs, ours, state = _trained_and_exported(tmp_path, *args)
    assert type(theirs).__name__ == ("Glm4MoeForCausalLM" if preset == "moe_small" else "MixtralForCausalLM")
    if preset == "moe_small":  # aux-loss-free balancing moved the bias off zero: it is exported
        bias = state["layers.1.feed_forward.router.expert_bias"]
        assert bias.abs().max() > 0
        assert torch.equal(theirs.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_full_size_moe_small_exports_with_the_recipes_logits(tmp_path):
    theirs, ours, _ = _trained_and_exported(tmp_path, "model=moe_small", "train.micro_batch_size=1",
                                            "train.eval_batches=1")
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


# ------------------------------------------------ train.init_from of a GLM-4.5 MoE export: streamed, under any layout
# One step from the directory (tests.recipes.test_streaming_load's STEP: AdamW whose first update is the gradient),
# the bias frozen (bias_update_rate=0: the re-export below must give it back as it was) and no balancing losses
# (over each data-parallel rank's tokens: a known difference from one process).
GLM_STEP = ["model.moe.bias_update_rate=0", "model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0",
            "train.steps=1", "optim.warmup_steps=1", "optim.lr=1.0", "optim.eps=1.0", "optim.weight_decay=0",
            "optim.grad_clip=0", "train.micro_batch_size=2", "train.eval_batches=0"]
# (ep=2 borrows its ranks from dp=2: one row per rank; pp=2 runs its two micro-batches of one row)
GLM_LAYOUTS = {"ep2_zero3": ["parallel.ep=2", "zero.stage=3", "train.micro_batch_size=1"],
               "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "train.micro_batch_size=1", "train.grad_accum=2"],
               "dp2_zero3": ["zero.stage=3", "train.micro_batch_size=1"]}
BIAS = "router.expert_bias"


def _first_step(overrides: list[str], run_dir: str, whole: bool = False, save: bool = False) -> dict:
    """One rank of a one-step recipe run initialised from train.init_from (streamed); with `whole`, of a run without
    it whose engine then takes the directory's weights and biases as import_hf reads them whole (the non-streaming
    import). Its equivalence record (tests.equivalence.Recorder: the initial state, buffers included); with `save`,
    its checkpoint after the step, in run_dir."""
    from omegaconf import open_dict

    from recipes.pretrain import Run, train_step
    from tests.equivalence import Recorder

    cfg = _cfg(run_dir, *overrides)
    source = cfg.train.init_from
    if whole:
        with open_dict(cfg):
            cfg.train.init_from = None
    run = Run(cfg)
    try:
        if whole:
            run.engine.load_full_state_dict(import_hf(source)[1])
        recorder = Recorder(run.engine)
        recorder.step(train_step(run.engine, run.train_stream, 0, cfg, run.dims, run.pipe))
        if save:
            run.save(1)
        return recorder.result()
    finally:
        run.logger.finish()
        if run.lock is not None:  # (rank 0's)
            run.lock.close()


@pytest.mark.parametrize("layout", ["ep2_zero3", *(pytest.param(k, marks=pytest.mark.slow)
                                                   for k in ("tp2", "pp2", "dp2_zero3"))])
def test_a_glm4_moe_export_initialises_a_layout_with_its_weights_and_expert_bias(exported, tmp_path, layout):
    """A model=moe_small run initialised from its GLM-4.5 MoE export streams the weights and each MoE layer's expert
    bias: one process starts from the directory's weights and biases exactly, and its first step (loss, gradient
    norm, every parameter's update) is the one of a process that took them through the non-streaming import_hf; two
    ranks (ep x ZeRO-3, tp, pp, ZeRO-3) each hold the directory's biases for their layers and train as one process
    does. The ep x ZeRO-3 run's checkpoint exports again with the same biases (export -> init_from -> export)."""
    from tests.equivalence import as_reference, assert_equivalent

    args, _, hf = exported["glm"]
    run = [*args, *GLM_STEP, f"train.init_from={hf}"]
    want = import_hf(hf)[1]
    biases = {n for n in want if n.endswith(BIAS)}
    assert len(biases) == 2 and all(want[n].abs().max() > 0 for n in biases)  # (MoE layers 1, 2; trained off zero)
    streamed = _first_step(run, str(tmp_path / "one"))
    whole = _first_step(run, str(tmp_path / "whole"), whole=True)
    assert streamed["first"]["initial"].keys() == want.keys()
    for name, value in streamed["first"]["initial"].items():
        assert torch.equal(value, want[name].reshape(value.shape)), name
    assert_equivalent([streamed], as_reference(whole), rtol=0, atol=0, label="streamed, one process")
    save = layout == "ep2_zero3"
    results = run_multirank(_first_step, 2, [*run, *GLM_LAYOUTS[layout]], str(tmp_path / "many"), False, save)
    assert_equivalent(results, as_reference(streamed), label=f"glm4_moe {layout}")
    held = [n for r in results for n in r["first"]["initial"] if n.endswith(BIAS)]
    assert set(held) == biases, held  # (under pp each on the rank holding its layer)
    for rank, r in enumerate(results):
        for name in biases & r["first"]["initial"].keys():
            assert torch.equal(r["first"]["initial"][name], want[name]), (layout, rank, name)
    if save:
        again = safetensors_torch.load_file(str(export(tmp_path / "many", tmp_path / "again") / "model.safetensors"))
        first = safetensors_torch.load_file(str(hf / "model.safetensors"))
        assert again.keys() == first.keys()
        moved = [n for n in first if not torch.equal(again[n], first[n])]
        assert not [n for n in moved if n.endswith("e_score_correction_bias")], moved  # the biases as they were
        assert len(moved) > len(first) // 2, moved  # (the weights the step moved: an expert no token chose did not)
