"""Hugging Face `transformers` causal LMs under this runtime, through transformers' own interfaces: config.py (the
model types covered, from the coverage sweep; a config.json with typed overrides), attention.py (AttentionInterface:
the runtime's attention with windows and sinks), experts.py (ExpertsInterface: the runtime's dispatch, grouped
experts and expert parallelism behind the model's router), balance.py (the model's balancing loss), model.py (the
adapter implementing the model contract), state_dict.py (weights from and to Hugging Face model directories),
coverage.py (the sweep over every causal LM of the installed transformers). moe.py keeps the hand-written swap of
three sparse-MoE block types for moe.MoELayer, for plain transformers models outside the adapter."""

from moe_lst.models.hf.config import (  # noqa: F401
    MODEL_TYPES,
    HFConfigError,
    dense_mlp_layers,
    is_moe,
    load_config,
    num_experts,
    rope_type,
    sliding_window,
)
from moe_lst.models.hf.model import ATTENTION, HFCausalLM, build, hf_attention, moe_supported  # noqa: F401
from moe_lst.models.hf.state_dict import (  # noqa: F401
    check_model_directory,
    num_params,
    parameter_shapes,
    save_weights,
    weight_mismatches,
)
