"""Export to the Hugging Face Llama / Mixtral layout and back: same logits in `transformers` and in ours."""

import json

import pytest
import torch

from recipes.export import ExportError, export, import_hf, save_hf
from recipes.models.llama import ModelConfig, MoEConfig, Transformer
from tests.recipes.test_pretrain import _cfg

transformers = pytest.importorskip("transformers")


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


@pytest.mark.parametrize("moe, tie", [(False, True), (False, False), (True, False)])
def test_export_loads_in_transformers_with_the_same_logits_and_imports_back(tmp_path, moe, tie):
    model = _model(moe, tie)
    state = {k: v for k, v in model.state_dict().items() if not (tie and k == "output.weight")}
    save_hf(state, model.cfg, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    assert type(theirs).__name__ == ("MixtralForCausalLM" if moe else "LlamaForCausalLM")
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits, their_logits = model(tokens), theirs(tokens).logits
    torch.testing.assert_close(their_logits, ours_logits, rtol=1e-4, atol=1e-4)
    cfg, imported = import_hf(tmp_path)
    again = Transformer(cfg)
    again.load_state_dict(imported, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(tokens), ours_logits, rtol=0, atol=0)


def test_export_cli_from_a_run_directory(tmp_path):
    from recipes.pretrain import train

    run = tmp_path / "run"
    train(_cfg(run, "train.steps=2", "model.tie_embeddings=false"))
    out = export(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
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
