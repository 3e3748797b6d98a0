"""The adapter: a transformers causal LM behind the model contract (zero.contract), with its own module and
parameter names (`model.layers.{i}...`, `lm_head.weight`), so its state dict is Hugging Face's.

Its attention runs through one function registered with transformers' AttentionInterface (`ATTENTION`), which
calls the layer's own swappable attention function in the contract's convention (q [b, s, h, d], k/v
[b, s, h_kv, d], causal): Ulysses and block-sparse attention replace that function per layer. Hugging Face's
rotary embedding is applied before it, from the position ids the forward is given (global ones under Ulysses).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import zlib
from collections.abc import Callable

import torch
import torch.nn as nn
from moe_lst.kernels.attention import attention
from moe_lst.kernels.documents import Documents, attend
from moe_lst.kernels.positions import position_ids_for
from torch.distributed import ProcessGroup
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

import zero
from moe_lst.models.hf.balance import BalancingLoss
from moe_lst.models.hf.config import MODEL_TYPES, is_moe
from zero.contract import AttentionSite, ModelContract

#: The name the adapter's attention is registered under (config._attn_implementation of an adapted model).
ATTENTION = "moe_lst"


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, documents: Documents | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface -> the layer's contract attention: q [b, h, s, d] and k/v [b, h_kv, s, d]
    -> ([b, s, h, d], no weights). The attention is causal over each packed document (`documents`, which the
    adapter's forward reads from the position ids and passes down), else over the whole sequence; a padding
    mask, dropout and a window shorter than the keys are refused (the adapter gives transformers no mask to
    build)."""
    if attention_mask is not None:
        raise NotImplementedError("the Hugging Face adapter's attention is causal over whole sequences: an attention "
                                  "mask (padding, packed documents) is not supported")
    if dropout:
        raise NotImplementedError(f"attention dropout={dropout} is not supported by the Hugging Face adapter")
    if sliding_window is not None and sliding_window < key.shape[2]:
        raise NotImplementedError(f"sliding_window={sliding_window} is shorter than the {key.shape[2]} keys: the "
                                  "Hugging Face adapter's attention is full causal attention")
    fn = _attention_of(module)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} runs attn_implementation={ATTENTION!r} but was not adapted: "
                           "build the model with moe_lst.models.hf.HFCausalLM")
    # [b, heads, s, d] -> [b, s, heads, d] (views: the attention functions take any strides)
    out = attend(fn, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True, scale=scaling,
                 documents=documents)
    return out, None


AttentionInterface.register(ATTENTION, hf_attention)


def _moe_adopter() -> Callable[[nn.Module], list[str]] | None:
    """moe_lst.models.hf.moe.adopt_moe_blocks, or None where that module is not there."""
    if importlib.util.find_spec("moe_lst.models.hf.moe") is None:
        return None
    from moe_lst.models.hf.moe import adopt_moe_blocks

    return adopt_moe_blocks


def moe_supported() -> bool:
    """Whether MoE configs (Mixtral, Qwen3-MoE) can be built: their blocks are swapped for this project's MoE."""
    return _moe_adopter() is not None


class HFCausalLM(nn.Module, ModelContract):
    """A transformers causal LM (`PreTrainedModel`, a model type of moe_lst.models.hf.config.MODEL_TYPES) under the
    model contract: blocks are its decoder layers, attention sites their self-attention, MLP sites their dense
    MLPs; `init_parameter` is the model's own `_init_weights`, seeded per parameter name. Sparse-MoE blocks are
    replaced by this project's MoE (models/hf/moe.py), keeping their names. Tensor-parallel plans and
    pipeline stages are not offered (the contract's defaults raise ContractError).

    An MoE config with `output_router_logits` trains with transformers' balancing loss, as its CausalLM forward
    adds it with labels (`router_aux_loss_coef * load_balancing_loss_func(...)`; moe_lst.models.hf.balance):
    its gradient joins the main loss's in training, scaled like it through `loss_plan()`'s hook, its statistics
    summed over `sp_group` (the ranks holding shards of the same sequences).

    forward(tokens [b, s], position_ids=None, return_hidden=False, packed=False) -> logits [b, s, vocab] (or the final-normed
    hidden states [b, s, dim], for losses that apply `output_weight` themselves, e.g. tiled)."""

    def __init__(self, causal_lm: PreTrainedModel, attention_fn: Callable[..., torch.Tensor] = attention,
                 init_seed: int | None = None, sp_group: ProcessGroup | None = None) -> None:
        super().__init__()
        config = causal_lm.config
        if config.model_type not in MODEL_TYPES:
            raise NotImplementedError(f"model_type={config.model_type!r} is not covered by the Hugging Face adapter "
                                      f"(it covers {', '.join(MODEL_TYPES)})")
        self.__dict__["causal_lm"] = causal_lm  # not a child: its children are ours, under the same names
        self.config = config
        self.model = causal_lm.model  # embeddings, decoder layers, final norm, rotary embedding
        self.lm_head = causal_lm.lm_head
        self.init_seed = torch.initial_seed() if init_seed is None else init_seed
        self.moe_blocks: tuple[str, ...] = ()
        if is_moe(config):
            self.moe_blocks = tuple(self._adopt_moe())
        self.balance: BalancingLoss | None = None
        if self.moe_blocks and config.output_router_logits and config.router_aux_loss_coef > 0:
            gates = [self.get_submodule(f"{block}.gate") for block in self.moe_blocks]
            self.balance = BalancingLoss(gates, config.num_local_experts, config.num_experts_per_tok,
                                         config.router_aux_loss_coef, sp_group)
        causal_lm.set_attn_implementation(ATTENTION)
        for layer in self.model.layers:
            _set_attention(layer.self_attn, attention_fn)

    def _adopt_moe(self) -> list[str]:
        adopt = _moe_adopter()
        if adopt is None:
            raise NotImplementedError(f"model_type={self.config.model_type} has sparse-MoE blocks and "
                                      "moe_lst.models.hf.moe (adopt_moe_blocks) is not available to swap them")
        if any(p.is_meta for p in self.parameters()):
            raise NotImplementedError(f"model_type={self.config.model_type}: MoE models are built on a real device "
                                      "(per-parameter init of their experts is not implemented)")
        return adopt(self.causal_lm)

    def loss_plan(self) -> zero.Plan:
        """For zero.initialize(plans=[...]): the balancing loss's gradient scaled like the main loss."""
        return zero.Plan("hf_balancing_loss", loss_scale_hooks=[self.balance.scale] if self.balance else [])

    @property
    def output_weight(self) -> torch.Tensor:
        """The head's weight [vocab, dim] (the embedding's when they are tied)."""
        return self.lm_head.weight

    # ------------------------------------------------------------------ the model contract (zero.contract)
    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"model.layers.{i}", layer) for i, layer in enumerate(self.model.layers)]

    def attention_sites(self) -> list[AttentionSite]:
        return [_site(f"model.layers.{i}.self_attn", layer.self_attn) for i, layer in enumerate(self.model.layers)]

    def mlp_sites(self) -> list[tuple[str, nn.Module]]:
        """The dense MLPs (the MoE blocks are not token-wise in the TiledMLP sense: their router statistics)."""
        sites = [(f"model.layers.{i}.mlp", layer.mlp) for i, layer in enumerate(self.model.layers)]
        return [(name, module) for name, module in sites if name not in self.moe_blocks]

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill `tensor` with parameter `name`'s initial values: the model's `_init_weights` applied to a stand-in
        of the parameter's module that holds `tensor` (its other parameters on the meta device), on the CPU with
        the random generator seeded by (init_seed, name), so the order of calls and the device do not matter."""
        if any(name.startswith(block + ".") for block in self.moe_blocks):
            raise NotImplementedError(f"{name}: per-parameter (meta-device) init of MoE blocks is not implemented; "
                                      "build MoE models on a real device")
        owner, _, leaf = name.rpartition(".")
        module = self.get_submodule(owner)
        values = torch.full(tensor.shape, math.nan, dtype=torch.float32)
        stand_in = copy.copy(module)  # the same class and settings, its own parameter table
        stand_in._parameters = {k: None if p is None else values if k == leaf else torch.empty_like(p, device="meta")
                                for k, p in module._parameters.items()}
        seed = (self.init_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.causal_lm._init_weights(stand_in)
        if values.isnan().any():
            raise NotImplementedError(f"{name}: {type(self.causal_lm).__name__}._init_weights does not initialise "
                                      f"{type(module).__name__}.{leaf}; build this model on a real device")
        tensor.copy_(values)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter but those of MoE blocks through init_parameter (what a meta-device build gets)."""
        for name, p in self.named_parameters():
            if not any(name.startswith(block + ".") for block in self.moe_blocks):
                self.init_parameter(name, p)

    @torch.no_grad()
    def materialise_buffers(self, device: torch.device | str | None = None) -> None:
        """Give meta-device buffers (the rotary embedding's frequencies) their values on `device`, through the
        model's `_init_weights` of their module."""
        for module in self.modules():
            meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta:
                continue
            if module._parameters:
                raise NotImplementedError(f"{type(module).__name__} holds parameters and meta-device buffers: build "
                                          "this model on a real device")
            for n in meta:
                module._buffers[n] = torch.full(module._buffers[n].shape, math.nan, dtype=module._buffers[n].dtype,
                                                device=device)
            self.causal_lm._init_weights(module)
            if any(module._buffers[n].isnan().any() for n in meta):
                raise NotImplementedError(f"{type(module).__name__}: its buffers have no init in "
                                          f"{type(self.causal_lm).__name__}._init_weights; build it on a real device")

    @torch.no_grad()
    def materialise_parameters(self, device: torch.device | str | None = None) -> None:
        """Replace meta-device parameters by uninitialised ones on `device` (tied ones stay tied)."""
        made: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for n, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                               requires_grad=p.requires_grad)
                module._parameters[n] = made[id(p)]

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                return_hidden: bool = False, packed: bool = False) -> torch.Tensor:
        positions = position_ids_for(tokens, position_ids)
        if self.balance is not None:
            self.balance.begin(self.training and torch.is_grad_enabled())
        # packed: the position ids restart at each packed document, and attention stays inside each of them.
        documents = Documents(positions) if packed else None
        hidden = self.model(input_ids=tokens, position_ids=positions, use_cache=False,
                            documents=documents).last_hidden_state
        if self.balance is not None:
            self.balance.finish()
        return hidden if return_hidden else self.lm_head(hidden)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None, forward=None) -> torch.Tensor:
        """Sample continuation tokens for prompt [b, s] (no KV cache: for short samples at the end of a run);
        `forward` replaces `self` as the logits function, e.g. a runtime engine wrapping this model."""
        forward = forward or self
        tokens = prompt
        for _ in range(max_new_tokens):
            context = tokens[:, -self.config.max_position_embeddings:]
            logits = forward(context)[:, -1, :].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
        return tokens[:, prompt.shape[1]:]


def _attention_of(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The contract attention function a self-attention module calls (None: not adapted)."""
    return module._modules.get("attention_fn") or vars(module).get("attention_fn")


def _set_attention(module: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
    # A module-valued function (UlyssesAttention) is registered as a child, and nn.Module refuses a plain
    # function under a child's name: drop the old binding first.
    if "attention_fn" in vars(module) or "attention_fn" in module._modules:
        delattr(module, "attention_fn")
    module.attention_fn = fn


def _site(name: str, module: nn.Module) -> AttentionSite:
    return AttentionSite(name, lambda: _attention_of(module), lambda fn: _set_attention(module, fn))


def build(config: PreTrainedConfig, meta: bool = False, device: torch.device | str | None = None,
          attention_fn: Callable[..., torch.Tensor] = attention, sp_group: ProcessGroup | None = None) -> HFCausalLM:
    """The adapted model of `config`, in fp32. Dense models are built on the meta device; with `meta` their
    parameters stay there (the engine materialises them through init_parameter), else they are made on the CPU
    and initialised by name (the same values); buffers get their values on `device` (default: the CPU). MoE
    models are built whole on the CPU with transformers' own init, then their MoE blocks are swapped."""
    config = copy.deepcopy(config)
    if is_moe(config):
        if meta:
            raise NotImplementedError(f"model_type={config.model_type}: MoE models are not built on the meta device")
        causal_lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return HFCausalLM(causal_lm, attention_fn, sp_group=sp_group)
    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = HFCausalLM(causal_lm, attention_fn, sp_group=sp_group)
    model.materialise_buffers(device)
    if not meta:
        model.materialise_parameters("cpu")
        model.reset_parameters()
    return model
