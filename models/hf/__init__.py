"""Hugging Face `transformers` causal LMs under this runtime: config.py (the model types covered, a config.json
with typed overrides, the features refused), model.py (the adapter implementing the model contract),
state_dict.py (weights from and to Hugging Face model directories); moe.py swaps sparse-MoE blocks for this
project's MoE layer."""

from moe_lst.models.hf.config import (  # noqa: F401
    MODEL_TYPES,
    HFConfigError,
    dense_mlp_layers,
    is_moe,
    load_config,
    rope_type,
    sliding_window,
)
from moe_lst.models.hf.model import ATTENTION, HFCausalLM, build, hf_attention, moe_supported  # noqa: F401
from moe_lst.models.hf.state_dict import (  # noqa: F401
    load_weights,
    num_params,
    parameter_shapes,
    save_weights,
    weight_mismatches,
)
