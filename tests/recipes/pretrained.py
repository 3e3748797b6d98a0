"""The pretrained model directories the streaming tests start from (train.init_from): the project's MoE Llama as
a Mixtral-layout directory (recipes.export's format) and a Hugging Face MoE as save_pretrained writes it, each with
weights of another seed than a run's own init. `pretrained` is the one fixture of both test modules that use them
(tests/zero/test_build_memory.py, tests/recipes/test_streaming_load.py): they import `pretrained_fixture`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: The MoE Llama: four blocks (so one is a small part of the model), four experts; no balancing losses (theirs are
#: over each data-parallel rank's tokens, a known difference from one process).
LLAMA = ["model=moe_tiny", "model.n_layers=4", "model.dim=64", "model.moe.num_experts=4", "model.moe.ffn_dim=64",
         "model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0", "train.seq_len=32"]
#: The Hugging Face MoE (tests.hf.tiny's qwen3_moe: a dense block among MoE ones), four blocks; without the
#: balancing loss, which sums its statistics over the sequence's ranks only.
HF_KIND, HF_CONFIG = "qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[2], output_router_logits=False)
#: A run's overrides for each directory `d` (model=hf takes the directory's own config).
RUN_MODEL = {"llama": lambda d: [*LLAMA, f"train.init_from={d}"],
             "hf": lambda d: ["model=hf", "train.seq_len=32", f"train.init_from={d}"]}
SEED = 98765  # (not a run's train.seed)


def write_llama(out: Path, seed: int = SEED) -> Path:
    from moe_lst.models.llama import Transformer
    from moe_lst.models.llama.state_dict import save_hf

    from recipes.config import model_config
    from tests.recipes.test_pretrain import _cfg

    model_cfg = model_config(_cfg(out / "unused", *LLAMA))
    torch.manual_seed(seed)
    return save_hf(Transformer(model_cfg).state_dict(), model_cfg, out / "llama")


def write_hf(out: Path, seed: int = SEED, original_format: bool = True) -> Path:
    """save_pretrained's directory (experts per expert, the published layout, unless not `original_format`)."""
    from tests.hf.tiny import plain_model

    model = plain_model(HF_KIND, seed=seed, **HF_CONFIG)
    model.save_pretrained(out / "hf", save_original_format=original_format)
    return out / "hf"


@pytest.fixture(scope="session", name="pretrained")
def pretrained_fixture(tmp_path_factory) -> dict[str, Path]:
    """{"llama": its directory, "hf": its directory}."""
    out = tmp_path_factory.mktemp("pretrained")
    return {"llama": write_llama(out), "hf": write_hf(out)}
