"""Llama-style decoder: RMSNorm, RoPE with explicit position ids, GQA, SwiGLU or MoE feed-forward.

Plain PyTorch with no parallel logic: it states its parts in the model contract (`zero.contract`: blocks,
attention sites, MLP sites, per-parameter init; its tensor-parallel styles and pipeline stages are in
parallelize.py), and sequence, expert, tensor and pipeline parallelism and the runtime apply from outside.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from moe_lst.kernels.attention import attention
from moe_lst.kernels.documents import Documents, attend
from moe_lst.kernels.nsa import Compressor, NativeSparseAttention, NSAConfig
from moe_lst.kernels.positions import position_ids_for
from moe_lst.kernels.sparse import LAYOUT_FIELDS, SparseAttention, SparseConfig
from moe_lst.models import init_replay
from moe_lst.models.llama import parallelize

from zero.contract import AttentionSite, ModelContract
from zero.plan import Placement

ATTENTIONS = ("dense", "sparse", "nsa")


@dataclass
class MoEConfig:
    """Mixture-of-Experts feed-forward settings (used when `num_experts > 0`)."""

    num_experts: int = 0
    top_k: int = 2
    ffn_dim: int = 0  # per-expert hidden width; 0 means the dense ffn_dim
    every: int = 1  # an MoE FFN on every k-th layer ...
    first_dense: int = 0  # ... after the first n layers, which stay dense
    capacity_factor: float | None = None  # None = dropless
    router: str = "softmax"
    renormalize: bool = True
    activation: str = "swiglu"
    aux_loss_coef: float = 1e-2
    seq_aux: bool = False
    z_loss_coef: float = 1e-3
    jitter_eps: float = 0.0
    num_groups: int = 1
    topk_groups: int = 1
    bias_update_rate: float = 0.0  # > 0 turns on aux-loss-free balancing
    num_shared_experts: int = 0


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 0  # 0 = round(8/3 * dim) up to a multiple of 64, the SwiGLU width of Llama
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)
    attention: str = "dense"  # dense | sparse (block-sparse layout of `sparse`) | nsa (native sparse attention)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    nsa: NSAConfig = field(default_factory=NSAConfig)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.sparse, dict):
            self.sparse = SparseConfig(**self.sparse)
        if isinstance(self.nsa, dict):
            self.nsa = NSAConfig(**self.nsa)
        self._check_attention()
        if self.ffn_dim == 0:
            self.ffn_dim = 64 * math.ceil(8 * self.dim / 3 / 64)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads} (GQA)"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for rotary embeddings")

    def _check_attention(self) -> None:
        """A sparse or NSA key that would be ignored is refused, naming the switch that makes it count."""
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention={self.attention!r} must be one of {', '.join(ATTENTIONS)}")
        for group, config in (("sparse", self.sparse), ("nsa", self.nsa)):
            default = type(config)()
            changed = [f.name for f in fields(config) if getattr(config, f.name) != getattr(default, f.name)]
            if changed and self.attention != group:
                key = changed[0]
                raise ValueError(f"model.{group}.{key}={_show(getattr(config, key))} is set but model.attention="
                                 f"{self.attention}; it applies only with model.attention={group}: set that, or "
                                 f"drop the key")
        if self.attention == "sparse" and self.sparse.unused_fields():
            key = self.sparse.unused_fields()[0]
            readers = [name for name, keys in LAYOUT_FIELDS.items() if key in keys]
            raise ValueError(f"model.sparse.{key}={_show(getattr(self.sparse, key))} has no effect with "
                             f"model.sparse.layout={self.sparse.layout} (layouts that read it: {', '.join(readers)}); "
                             "drop the key or choose one of those layouts")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        m = self.moe
        return m.num_experts > 0 and layer_id >= m.first_dense and (layer_id - m.first_dense) % m.every == 0

    def num_params(self) -> int:
        """Parameters of the full (unsharded) model, counting a tied embedding once."""
        return sum(p.numel() for p in Transformer(self, device="meta").parameters())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class _RMSNormFunction(torch.autograd.Function):
    """y = normalise(x) * w, normalised in fp32 (bf16 sums of squares lose precision over wide dims).

    Saves only x and the per-token scale: the normalised activations (as large as x) are recomputed in
    backward instead of being kept, which matters at long sequence lengths."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return (xf * scale).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, scale = ctx.saved_tensors
        normed = x.float() * scale
        g = grad.float()
        grad_w = (g * normed.to(x.dtype).float()).flatten(0, -2).sum(0).to(weight.dtype) \
            if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None
        gn = g * weight.float()
        grad_x = scale * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for explicit positions: [b, s] -> [b, s, 1, head_dim/2] each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    angles = position_ids.float()[..., None] * inv_freq  # [b, s, head_dim/2]
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float().unflatten(-1, (-1, 2))  # [b, s, h, head_dim/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.empty_like(xf)
    o0, o1 = out[..., 0], out[..., 1]
    torch.mul(x0, cos, out=o0).addcmul_(x1, sin, value=-1)
    torch.mul(x0, sin, out=o1).addcmul_(x1, cos)
    return out.flatten(-2).to(x.dtype)


class _RoPEFunction(torch.autograd.Function):
    """The rotation is linear and orthogonal: its backward rotates the gradient back by the same angles,
    so nothing the size of x is saved (only the shared cos/sin tables)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [b, s, h, head_dim] by the position's angles."""
    return _RoPEFunction.apply(x, cos, sin)


def _show(value) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


class Attention(nn.Module):
    """Dense or block-sparse attention: the two differ only in `attn_fn`."""

    def __init__(self, cfg: ModelConfig, device=None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, device=device)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, device=device)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, device=device)
        # The seam for sequence parallelism: UlyssesAttention replaces this callable. A block-sparse layout
        # applies to the whole sequence of each head, which is what every Ulysses rank holds.
        self.attn_fn = SparseAttention(cfg.sparse) if cfg.attention == "sparse" else attention

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [b, s, h, head_dim] and k, v [b, s, h_kv, head_dim], q and k rotated."""
        # Head counts come from the projections' widths: tensor parallelism leaves each rank a slice of heads.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def site(self, name: str) -> AttentionSite:
        """This layer's attention call as a site of the model contract (Ulysses and sparse swap it)."""
        return AttentionSite(name, lambda: self.attn_fn, self._set_attn_fn)

    def _set_attn_fn(self, fn) -> None:
        # A module-valued function (UlyssesAttention) is registered as a child, and nn.Module refuses a
        # plain function under a child's name: drop the old binding first.
        del self.attn_fn
        self.attn_fn = fn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = attend(self.attn_fn, q, k, v, causal=True, documents=documents)  # [b, s, h, head_dim]
        return self.wo(out.flatten(-2))


class NSAAttention(Attention):
    """Native sparse attention (moe_lst.kernels.nsa): the same projections, plus per-head gates of the three branches
    (a sigmoid of a projection of the token's hidden state) and the key and value compressors."""

    def __init__(self, cfg: ModelConfig, device=None) -> None:
        super().__init__(cfg, device=device)
        n = cfg.nsa
        self.wg = nn.Linear(cfg.dim, cfg.n_heads * 3, bias=False, device=device)
        self.compress_k = Compressor(cfg.head_dim, n.compress_block, n.compress_stride, device=device)
        self.compress_v = Compressor(cfg.head_dim, n.compress_block, n.compress_stride, device=device)
        self.attn_fn = NativeSparseAttention(n, self.compress_k, self.compress_v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        gates = torch.sigmoid(self.wg(x)).unflatten(-1, (-1, 3))  # [b, s, h, 3]: compressed, selected, window
        out = attend(self.attn_fn, q, k, v, causal=True, documents=documents, gates=gates)
        return self.wo(out.flatten(-2))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int, device=None) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False, device=device)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False, device=device)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def build_moe(cfg: ModelConfig, device=None) -> nn.Module:
    """The MoE feed-forward. On the meta device it allocates and draws nothing (a recorder notes the fills an
    eager build would draw: see Transformer); elsewhere it is built on the CPU, drawing from the global generator,
    and moved."""
    from moe import MoELayer

    m = cfg.moe
    on_meta = device is not None and torch.device(device).type == "meta"
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        layer = MoELayer(
            cfg.dim, m.ffn_dim or cfg.ffn_dim, m.num_experts, top_k=m.top_k, capacity_factor=m.capacity_factor,
            router=m.router, aux_loss_coef=m.aux_loss_coef, z_loss_coef=m.z_loss_coef,
            num_shared_experts=m.num_shared_experts, activation=m.activation, renormalize=m.renormalize,
            jitter_eps=m.jitter_eps, num_groups=m.num_groups, topk_groups=m.topk_groups,
            bias_update_rate=m.bias_update_rate, seq_aux=m.seq_aux, init_std=cfg.init_std,
        )
    return layer if on_meta else layer.to(device)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, device=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.attention = (NSAAttention if cfg.attention == "nsa" else Attention)(cfg, device=device)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        if cfg.is_moe_layer(layer_id):
            with init_replay.scope(f"layers.{layer_id}.feed_forward"):
                self.feed_forward = build_moe(cfg, device=device)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module, ModelContract):
    """The model. Built on the meta device (`device="meta"`) it holds no values: `init_parameter` gives any
    parameter, or any rank's slice of one, the values an eager build with the same seed gives (MoE layers' fills
    from the global generator replayed: moe_lst.models.init_replay), and its buffers (the routers' zero
    statistics) are made on `buffer_device`."""

    def __init__(self, cfg: ModelConfig, device=None, buffer_device=None) -> None:
        super().__init__()
        on_meta = device is not None and torch.device(device).type == "meta"
        self._replay: init_replay.Replay | None = None
        if on_meta:
            _, self._replay = init_replay.recorded_build(lambda: self._build(cfg, device))
        else:
            self._build(cfg, device)
        if on_meta:
            for module in self.modules():
                for name, b in list(module._buffers.items()):
                    if b is not None and b.is_meta:  # (MoE statistics and the selection bias start at zero)
                        module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=buffer_device)
        elif not self.tok_embeddings.weight.is_meta:  # (built under a meta device context: no values either)
            self.reset_parameters()

    def _build(self, cfg: ModelConfig, device) -> None:
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i, device=device) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)
        # Every parameter's init is seeded by this and its name: the same values in any order, so a
        # meta-device model materialised piece by piece (zero.initialize(param_init=...)) equals this one.
        self.init_seed = torch.initial_seed()
        self._moe_params = {f"layers.{i}.feed_forward.{n}": tuple(p.shape) for i, layer in enumerate(self.layers)
                            if cfg.is_moe_layer(i) for n, p in layer.feed_forward.named_parameters()}

    def continue_global_generator(self) -> None:
        """Leave torch's global generator where an eager build of this (meta-built) model would have left it, so
        whatever draws from it next draws the same numbers."""
        if self._replay is not None:
            torch.default_generator.set_state(self._replay.end_state())

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init (see init_parameter); MoE feed-forwards (built by build_moe) keep their own."""
        for name, p in self.named_parameters():
            if name not in self._moe_params:
                self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor, placement: Placement | None = None) -> None:
        """Fill `tensor` with the initial values of parameter `name`, or with its slice `placement` (a tensor- or
        expert-parallel rank's local part of the whole parameter): N(0, init_std), output projections of
        residual branches scaled by 1/sqrt(2L) so the residual stream's variance does not grow with depth,
        RMSNorm gains 1. Seeded by (init_seed, name), so the order of calls does not matter; drawn on the CPU
        wherever `tensor` lives, as an eager build draws them before the model moves to its device. MoE layers'
        values are those their eager build drew from the global generator (replayed for a meta-built model)."""
        if name in self._moe_params:
            if self._replay is None:
                raise NotImplementedError(f"{name}: this model was built eagerly, its MoE layers drew their values "
                                          "as they were built; build it on the meta device to initialise them "
                                          "per parameter")
            scope_name = name.split(".feed_forward.")[0] + ".feed_forward"
            index = self._replay.find(scope_name, self._moe_params[name])
            self._replay.values(index, tensor, placement)
            return
        if placement is not None and not placement.is_whole:
            placement.fill_from_whole(tensor, lambda whole: self.init_parameter(name, whole))
            return
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        std = self.cfg.init_std
        if name.endswith(("wo.weight", "w2.weight")):
            std /= math.sqrt(2 * self.cfg.n_layers)
        seed = (self.init_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        gen = torch.Generator().manual_seed(seed)
        if tensor.device.type == "cpu":
            nn.init.normal_(tensor, 0.0, std, generator=gen)
        else:  # (a CUDA generator would draw other values)
            tensor.copy_(nn.init.normal_(torch.empty(tensor.shape, dtype=tensor.dtype), 0.0, std, generator=gen))

    # ------------------------------------------------------------------ the model contract (zero.contract)
    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]

    def attention_sites(self) -> list[AttentionSite]:
        return [layer.attention.site(f"layers.{i}.attention") for i, layer in enumerate(self.layers)]

    def mlp_sites(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}.feed_forward", layer.feed_forward) for i, layer in enumerate(self.layers)]

    def tensor_parallel_styles(self, tp: int) -> dict:
        """How this model splits over tp ranks: see parallelize.tensor_parallel_styles."""
        return parallelize.tensor_parallel_styles(self, tp)

    def stage3_edge_units(self) -> list[tuple[str, nn.Module]]:
        """The modules outside the blocks that ZeRO-3 may gather on their own (zero.sharding.stage3.edge_units): the
        untied embedding and head, each of whose weights the forward uses only through the module's own call. A
        tied weight serves both, so it stays in the root (gathered for the whole forward and backward)."""
        if self.output is None:
            return []
        return [("tok_embeddings", self.tok_embeddings), ("output", self.output)]

    def pipeline_stage(self, layers: range, first: bool, last: bool) -> nn.Module:
        """A pipeline stage holding `layers` (the embedding when `first`; final norm and head when `last`),
        sharing this model's modules and parameter names (see zero.parallel.pipeline)."""
        return parallelize.PipelineStageModule(self, layers, first, last)

    def pipeline_shapes(self, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return parallelize.pipeline_shapes(self, tokens_shape)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, sin) for position ids [b, s]."""
        return rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta)

    def forward_hidden(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                       packed: bool = False) -> torch.Tensor:
        """tokens [b, s] -> final-normed hidden states [b, s, dim]. `packed`: the rows hold packed documents whose
        position ids restart at each one (moe_lst.kernels.documents), and no token attends across their boundaries."""
        positions = position_ids_for(tokens, position_ids)
        cos, sin = self.rotary(positions)
        documents = Documents(positions) if packed else None
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, documents)
        return self.norm(h)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                return_hidden: bool = False, packed: bool = False) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab] (or the final-normed hidden [b, s, dim] with
        return_hidden, for losses that apply the output projection themselves, e.g. tiled). `packed`: see
        forward_hidden."""
        hidden = self.forward_hidden(tokens, position_ids, packed)
        if return_hidden:
            return hidden
        # The untied head is called as its module (ZeRO-3 gathers it around this call: stage3_edge_units).
        return F.linear(hidden, self.tok_embeddings.weight) if self.output is None else self.output(hidden)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None,
                 forward=None) -> torch.Tensor:
        """Sample continuation tokens for prompt [b, s] (no KV cache: for short samples at the end of a run).

        `forward` replaces `self` as the logits function, e.g. a runtime engine wrapping this model.
        """
        forward = forward or self
        tokens = prompt
        for _ in range(max_new_tokens):
            context = tokens[:, -self.cfg.max_seq_len:]
            logits = forward(context)[:, -1, :].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens[:, prompt.shape[1]:]
