"""The project's Llama (dense or MoE): model.py (the plain model), parallelize.py (its tensor-parallel plan and
pipeline stages: the model contract's parallel parts), state_dict.py (the Hugging Face weight adapter)."""

from moe_lst.models.llama.model import (  # noqa: F401
    Attention,
    FeedForward,
    ModelConfig,
    MoEConfig,
    NSAAttention,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rope,
    build_moe,
    rope_cos_sin,
)
from moe_lst.models.llama.parallelize import PipelineStageModule, check_tensor_parallel  # noqa: F401
