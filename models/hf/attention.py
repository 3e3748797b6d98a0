"""Hugging Face attention through transformers' AttentionInterface, run by this runtime's attention functions.

`hf_attention` is registered as `ATTENTION` ("moe_lst"): an adapted model's attention modules call it with
q [b, h, s, d], k/v [b, h_kv, s, d] and their keyword arguments; it calls the module's own swappable contract
function (`attention_fn`: dense attention, Ulysses around it, block-sparse layouts) in the contract's layout
[b, s, h, d]. What the modules pass is honoured exactly or refused by name:

- `sliding_window` (a key window of that many tokens: key j is seen by query i when i - window < j <= i, as
  transformers' masks say) and attention sinks (`s_aux` / `sinks`: one logit per head that joins every query's
  softmax and takes no value) go to the site function as `window=` and `sinks=` ([b, s, h, 1] per token and head,
  so Ulysses hands each rank its heads' sinks and sums their gradients back); `hf_dense_attention` computes them;
- a value head width other than the query's (multi-head latent attention) is padded with zeros and cut back;
- `scaling` is the softmax scale; `dropout` must be 0 (not trained here), `is_causal` True, an attention mask,
  `softcap`, `position_bias` and any other tensor argument are refused with their names, as are keys that are not
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
            window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T * scale + mask [, sink]) v on [b, s, h, d] (k/v with h_kv heads): causal, keys limited to
    the last `window` positions, each query's softmax joined by its head's sink logit. Scores are materialised
    ([b, h, s, s]): windows and sinks are computed exactly, not fast."""
    b, s, h, d = q.shape
    if k.shape[2] != h:
        k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    scale = d ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    qi = torch.arange(s, device=q.device)[:, None]
    ki = torch.arange(k.shape[1], device=q.device)[None, :]
    allowed = torch.ones(s, k.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        allowed &= ki <= qi
    if window is not None:
        allowed &= ki > qi - window
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
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The dense attention of adapted models (moe_lst.kernels.attention), with sliding windows and attention
    sinks computed exactly where a layer has them (per packed document, like the rest)."""
    if window is None and sinks is None:
        return attention(q, k, v, causal=causal, scale=scale, documents=documents)
    if documents is not None and not documents.single:
        return per_document(hf_dense_attention, q, k, v, documents, causal=causal, scale=scale, window=window,
                            sinks=sinks)
    return _banded(q, k, v, causal, scale, window, sinks)


hf_dense_attention.handles_documents = True
hf_dense_attention.takes_window_and_sinks = True


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
    if kwargs.pop("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"{name}: bidirectional attention (is_causal=False) is not supported")
    for key_name, value_ in kwargs.items():  # varlen metadata, softcap, position biases, ...: not computed here
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
    extra = {}
    if sliding_window is not None or sinks is not None:
        if not getattr(_innermost(fn), "takes_window_and_sinks", False):
            what = "sliding_window" if sliding_window is not None else "attention sinks"
            raise NotImplementedError(f"{name}: {what} with attention function {_innermost(fn)!r}: only the dense "
                                      "attention (model.attention=dense) computes windows and sinks")
        if sliding_window is not None:
            extra["window"] = int(sliding_window)
        if sinks is not None:  # one logit per head -> [b, s, h, 1], per token like q (Ulysses splits its heads)
            b, h, s, _ = query.shape
            extra["sinks"] = sinks.reshape(1, 1, h, 1).expand(b, s, h, 1)
    if key.shape[2] != query.shape[2]:  # (no cache in training: every key is one of the queries' tokens)
        raise NotImplementedError(f"{name}: {key.shape[2]} keys for {query.shape[2]} tokens (keys that are not the "
                                  "tokens, e.g. compressed KV slots): not supported")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [b, s, heads, d] views
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # multi-head latent attention: values narrower than queries and keys
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = attend(fn, q, k, v, causal=True, scale=scaling, documents=documents, **extra)
    return (out[..., :dv] if dv != out.shape[-1] else out).contiguous(), None  # (callers .view() it)


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
