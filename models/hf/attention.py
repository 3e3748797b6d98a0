"""Hugging Face attention through transformers' AttentionInterface, run by this runtime's attention functions.

`hf_attention` is registered as `ATTENTION` ("moe_lst"): an adapted model's attention modules call it with
q [b, h, s, d], k/v [b, h_kv, s, d] and their keyword arguments; it calls the module's own swappable contract
function (`attention_fn`: dense attention, Ulysses around it, block-sparse layouts) in the contract's layout
[b, s, h, d]. What the modules pass is honoured exactly or refused by name:

- `sliding_window` (a key window of that many tokens: key j is seen by query i when i - window < j <= i, as
  transformers' masks say) and attention sinks (`s_aux` / `sinks`: one logit per head that joins every query's
  softmax and takes no value) go to the site function as `window=` and `sinks=` ([b, s, h, 1] per token and head,
  so Ulysses hands each rank its heads' sinks and sums their gradients back); `hf_dense_attention` computes them;
- `softcap` (attention logit softcapping, Gemma 2: scaled scores -> softcap * tanh(scores / softcap), before the
  mask, as transformers' eager attention does) goes on as `softcap=`, one number per layer;
- chunked attention (Llama 4: a layer whose `config.layer_types[layer_idx]` is "chunked_attention" attends causally
  within fixed chunks of `config.attention_chunk_size` positions; transformers builds that mask, which this
  attention never receives) goes on as `chunk=`: chunks count from each row's first token, or from each packed
  document's first token (transformers numbers a packed row's chunks by its position ids, which restart there);
- Llama 4's attention temperature tuning numbers the positions of the tokens it is given from 0: exact only while the
  sequence is shorter than its floor_scale under Ulysses shards and packed documents, refused beyond;
- only the dense attention computes these, and a wrapper (Ulysses, ring attention) must take the argument to pass
  it on: anything else refuses it by name (ring attention and block-sparse layouts take no softcap or chunks);
- a value head width other than the query's (multi-head latent attention) is padded with zeros and cut back;
- `scaling` is the softmax scale; `dropout` must be 0 (not trained here), `is_causal` True, an attention mask,
  `position_bias` and any other tensor argument are refused with their names, as are keys that are not
  the queries' tokens (more or fewer of them: compressed KV slots appended to the keys).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from moe_lst.kernels.attention import attention
from moe_lst.kernels.documents import Documents, attend, per_document
from torch import nn
from transformers import AttentionInterface

#: The name the adapter's attention is registered under (config._attn_implementation of an adapted model).
ATTENTION = "moe_lst"
#: Whether the adapter's forward in progress runs packed documents: every attention call must then receive them.
PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("moe_lst_hf_packed", default=False)
#: Keyword arguments of transformers' attention calls that carry nothing this attention needs (positions: the
#: adapter passes `documents`, read from them once per forward; cache and output switches).
_IGNORED = ("position_ids", "output_attentions", "use_cache", "cache_position", "past_key_values",
            "output_hidden_states", "return_dict", "output_router_logits", "deterministic")


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
            window: int | None, sinks: torch.Tensor | None, softcap: float | None = None,
            chunk: int | None = None) -> torch.Tensor:
    """softmax(mask(cap(q k^T * scale)) [, sink]) v on [b, s, h, d] (k/v with h_kv heads): the scaled scores
    softcapped (softcap * tanh(scores / softcap)), then causal, keys limited to the last `window` positions and to
    the query's own chunk of `chunk` positions (counted from the first token), each query's softmax joined by its
    head's sink logit. Scores are materialised ([b, h, s, s]): these are computed exactly, not fast."""
    b, s, h, d = q.shape
    if k.shape[2] != h:
        k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    scale = d ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:  # (transformers' order: divide, tanh, multiply; before the mask)
        scores = torch.tanh(scores / softcap) * softcap
    qi = torch.arange(s, device=q.device)[:, None]
    ki = torch.arange(k.shape[1], device=q.device)[None, :]
    allowed = torch.ones(s, k.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        allowed &= ki <= qi
    if window is not None:
        allowed &= ki > qi - window
    if chunk is not None:
        allowed &= ki // chunk == qi // chunk
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks[..., 0].permute(0, 2, 1).unsqueeze(-1).to(scores.dtype)  # [b, s, h, 1] -> [b, h, s, 1]
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1]
    else:
        # (at least fp32: a float64 model keeps its precision)
        probs = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1).to(scores.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)


def hf_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                       scale: float | None = None, documents: Documents | None = None, window: int | None = None,
                       sinks: torch.Tensor | None = None, softcap: float | None = None,
                       chunk: int | None = None) -> torch.Tensor:
    """The dense attention of adapted models (moe_lst.kernels.attention), with sliding windows, attention sinks,
    logit softcapping and chunks computed exactly where a layer has them (per packed document, like the rest)."""
    if window is None and sinks is None and softcap is None and chunk is None:
        return attention(q, k, v, causal=causal, scale=scale, documents=documents)
    if documents is not None and not documents.single:
        if chunk is not None:
            _check_chunk_origins(documents, chunk)
        return per_document(hf_dense_attention, q, k, v, documents, causal=causal, scale=scale, window=window,
                            sinks=sinks, softcap=softcap, chunk=chunk)
    return _banded(q, k, v, causal, scale, window, sinks, softcap, chunk)


hf_dense_attention.handles_documents = True
hf_dense_attention.takes_window_and_sinks = True
hf_dense_attention.takes_softcap_and_chunks = True


def _check_chunk_origins(documents: Documents, chunk: int) -> None:
    """Chunks run per packed document count from its first token; transformers numbers them by position ids
    (position // chunk), the same only where every document's positions start at 0."""
    positions = documents.position_ids
    for row, bounds in enumerate(documents.bounds()):
        firsts = positions[row, list(bounds[:-1])]
        if bool((firsts != 0).any()):
            at = bounds[int((firsts != 0).nonzero()[0, 0])]
            raise NotImplementedError(f"chunked attention (chunk={chunk}) over packed documents needs each document's "
                                      f"position ids to start at 0 (transformers counts chunks by position), but row "
                                      f"{row}'s document at token {at} starts at position {int(positions[row, at])}")


def _innermost(fn: Callable) -> Callable:
    """The attention function under wrappers (Ulysses: `attn_fn`)."""
    while isinstance(fn, nn.Module) and hasattr(fn, "attn_fn"):
        fn = fn.attn_fn
    return fn


def attention_of(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The contract attention function an attention module calls (None: not adapted)."""
    return module._modules.get("attention_fn") or vars(module).get("attention_fn")


def set_attention(module: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
    # A module-valued function (UlyssesAttention) is registered as a child, and nn.Module refuses a plain
    # function under a child's name: drop the old binding first.
    if "attention_fn" in vars(module) or "attention_fn" in module._modules:
        delattr(module, "attention_fn")
    module.attention_fn = fn


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, documents: Documents | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface -> the module's contract attention: q [b, h, s, d] and k/v [b, h_kv, s, d]
    -> ([b, s, h, d_v], no weights); see the module docstring for what each argument does."""
    name = type(module).__name__
    if attention_mask is not None:
        raise NotImplementedError(f"{name}: the Hugging Face adapter's attention is causal over whole sequences "
                                  "(packed documents through position ids): an attention mask is not supported")
    if dropout:
        raise NotImplementedError(f"{name}: attention dropout={dropout} is not supported by the Hugging Face adapter")
    sinks = kwargs.pop("s_aux", None)
    if sinks is None:
        sinks = kwargs.pop("sinks", None)
    softcap = kwargs.pop("softcap", None)
    if kwargs.pop("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"{name}: bidirectional attention (is_causal=False) is not supported")
    for key_name, value_ in kwargs.items():  # varlen metadata, position biases, ...: not computed here
        if key_name not in _IGNORED and value_ is not None and value_ is not False:
            raise NotImplementedError(f"{name}: attention argument {key_name}={_show(value_)} is not supported by "
                                      "the Hugging Face adapter")
    if documents is None and PACKED.get():
        raise NotImplementedError(f"{name}: its layer does not pass the attention arguments on (packed documents "
                                  "would attend across each other): packed data is not supported for this model")
    fn = attention_of(module)
    if fn is None:
        raise RuntimeError(f"{name} runs attn_implementation={ATTENTION!r} but was not adapted: build the model "
                           "with moe_lst.models.hf.HFCausalLM")
    chunk = chunk_size_of(module)
    _check_temperature_positions(module, fn, query.shape[2])
    extra = {}
    if sliding_window is not None:
        extra["window"] = int(sliding_window)
    if sinks is not None:  # one logit per head -> [b, s, h, 1], per token like q (Ulysses splits its heads)
        b, h, s, _ = query.shape
        extra["sinks"] = sinks.reshape(1, 1, h, 1).expand(b, s, h, 1)
    if softcap is not None:
        extra["softcap"] = float(softcap)
    if chunk is not None:
        extra["chunk"] = chunk
    _check_arguments(name, fn, extra)
    if key.shape[2] != query.shape[2]:  # (no cache in training: every key is one of the queries' tokens)
        raise NotImplementedError(f"{name}: {key.shape[2]} keys for {query.shape[2]} tokens (keys that are not the "
                                  "tokens, e.g. compressed KV slots): not supported")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [b, s, heads, d] views
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # multi-head latent attention: values narrower than queries and keys
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = attend(fn, q, k, v, causal=True, scale=scaling, documents=documents, **extra)
    return (out[..., :dv] if dv != out.shape[-1] else out).contiguous(), None  # (callers .view() it)


#: What each argument the dense attention computes is, for refusals.
_WHAT = {"window": "sliding_window", "sinks": "attention sinks", "softcap": "attention logit softcapping",
         "chunk": "chunked attention"}


def _check_arguments(name: str, fn: Callable, extra: dict) -> None:
    """Refuse, by name, an argument the site's attention does not compute: every wrapper on the way (Ulysses, ring
    attention) must take it, and the innermost function must compute it (only the dense attention does)."""
    if not extra:
        return
    wrapper = fn
    while isinstance(wrapper, nn.Module) and hasattr(wrapper, "attn_fn"):
        params = inspect.signature(wrapper.forward).parameters
        passes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key in extra:
            if key not in params and not passes_any:
                raise NotImplementedError(f"{name}: {_WHAT[key]} ({key}={_show(extra[key])}) with "
                                          f"{type(wrapper).__name__}, which does not take it (ring attention, "
                                          "parallel.cp, computes no softcap or chunks); use parallel.sp (Ulysses) "
                                          "with the dense attention for this model")
        wrapper = wrapper.attn_fn
    inner = _innermost(fn)
    for key in extra:
        flag = "takes_window_and_sinks" if key in ("window", "sinks") else "takes_softcap_and_chunks"
        if not getattr(inner, flag, False):
            raise NotImplementedError(f"{name}: {_WHAT[key]} with attention function {inner!r}: only the dense "
                                      f"attention (model.attention=dense) computes {_WHAT[key]}")


def chunk_size_of(module: nn.Module) -> int | None:
    """The chunk size of an attention module's layer where its config makes it a chunked-attention layer
    (`config.layer_types[module.layer_idx] == "chunked_attention"`, of `config.attention_chunk_size` positions)."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(index, int) or not isinstance(types, (list, tuple)) or index >= len(types):
        return None
    if types[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def softcap_of(module: nn.Module) -> float | None:
    """The attention logit softcap an attention module passes (`softcap=`), read from its own attributes (Gemma 2:
    `attn_logit_softcapping`, from its config): None where it has none set."""
    for key, value in vars(module).items():
        if "softcap" in key and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            return float(value)
    return None


def temperature_floor_of(module: nn.Module) -> int | None:
    """The floor_scale of an attention module that scales its queries by the positions it numbers itself (Llama 4's
    attention temperature tuning on NoPE layers: log1p(floor((i + 1) / floor_scale)), i = 0.. over the tokens it is
    given), None for any other."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    floor_scale = getattr(module, "floor_scale", None)
    return int(floor_scale) if isinstance(floor_scale, (int, float)) else None


def _check_temperature_positions(module: nn.Module, fn: Callable, tokens: int) -> None:
    """Temperature tuning (temperature_floor_of) sees other positions under Ulysses shards (a shard's own) and packed
    documents (the row's, where a document alone counts its own): its scales are all 1, the same, only while the
    sequence is shorter than floor_scale."""
    floor_scale = temperature_floor_of(module)
    sp = getattr(fn, "sp", 1)
    seq_len = tokens * sp
    if floor_scale is not None and (sp > 1 or PACKED.get()) and seq_len >= floor_scale:
        what = f"Ulysses sequence shards (sp={sp})" if sp > 1 else "packed documents"
        raise NotImplementedError(f"{type(module).__name__}: attention temperature tuning numbers positions from 0 "
                                  f"over the tokens it is given, so {what} of a {seq_len}-token sequence (at least "
                                  f"floor_scale={floor_scale}) would get other query scales; train sequences shorter "
                                  "than floor_scale, or set attn_temperature_tuning=false")


def _show(value) -> str:
    return f"tensor{tuple(value.shape)}" if torch.is_tensor(value) else repr(value)


AttentionInterface.register(ATTENTION, hf_attention)


@functools.cache
def calls_attention_interface(cls: type) -> bool:
    """Whether the forward of module class `cls` dispatches through transformers' AttentionInterface."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source
