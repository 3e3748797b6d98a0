"""The structure the adapter reads off any transformers causal LM: its repeated layers (`_no_split_modules`), its
attention modules (those whose forward dispatches through AttentionInterface) and the layers that mix tokens
otherwise."""

from __future__ import annotations

import inspect

from moe_lst.models.hf.attention import calls_attention_interface
from torch import nn


def decoder_blocks(causal_lm: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated layers: modules of the classes `_no_split_modules` names, outermost ones, in module order."""
    kinds = set(getattr(causal_lm, "_no_split_modules", None) or ())
    found: list[tuple[str, nn.Module]] = []
    for name, m in causal_lm.named_modules():
        if type(m).__name__ in kinds and not any(name.startswith(b + ".") for b, _ in found):
            found.append((name, m))
    return found


def attention_modules(causal_lm: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose forward dispatches through transformers' AttentionInterface, in module order."""
    return [(n, m) for n, m in causal_lm.named_modules() if calls_attention_interface(type(m))]


def blocks_outside_attention(causal_lm: nn.Module) -> list[str]:
    """The repeated layers holding no AttentionInterface module (linear attention, convolutions, state-space
    mixers), or holding a convolution along the sequence beside or inside one (an nn.Conv1d of kernel over 1:
    Falcon-H1's Mamba mixer in parallel with its attention, ZAYA's convolved queries and keys): they mix tokens
    along the sequence themselves, so neither Ulysses shards nor packed documents reach them."""
    sites = [n for n, _ in attention_modules(causal_lm)]
    return [b for b, block in decoder_blocks(causal_lm) if not any(s.startswith(b + ".") for s in sites)
            or any(isinstance(m, nn.Conv1d) and m.kernel_size[0] > 1 for m in block.modules())]


def positions_from_length(causal_lm: nn.Module) -> str | None:
    """The module running the repeated layers where neither it nor a module above it takes `position_ids` in its
    forward (it numbers positions 0..s-1 over the sequence it is given: neither a Ulysses shard nor a packed
    document gets its own positions then), else None."""
    blocks = decoder_blocks(causal_lm)
    if not blocks:
        return None
    parts = blocks[0][0].split(".")
    owner = parts[:-2] if len(parts) > 2 and parts[-1].isdigit() else parts[:-1]
    for depth in range(len(owner), -1, -1):
        module = causal_lm.get_submodule(".".join(owner[:depth])) if depth else causal_lm
        try:
            if "position_ids" in inspect.signature(module.forward).parameters:
                return None
        except (TypeError, ValueError):
            return None
    return f"{'.'.join(owner) or type(causal_lm).__name__} ({type(causal_lm.get_submodule('.'.join(owner))).__name__})"
