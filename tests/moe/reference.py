"""Naive per-token reference for MoE layers: every token through its chosen experts, one at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_routing(x, weight, top_k, score_func="softmax", renormalize=True, bias=None):
    """Route x [N, d] with router weight [E, d] the textbook way; returns (gates, indices, logits, probs)."""
    logits = x.float() @ weight.float().t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    select = scores.detach() if bias is None else scores.detach() + bias
    indices = select.topk(top_k, dim=-1).indices
    gates = scores.gather(1, indices)
    if renormalize:
        gates = gates / gates.sum(-1, keepdim=True)
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    return gates, indices, logits, probs


def expert_mlp(x, w_in, w_out, activation):
    h = x @ w_in
    if activation == "swiglu":
        g, u = h.chunk(2, dim=-1)
        h = F.silu(g) * u
    else:
        h = F.gelu(h)
    return h @ w_out


def reference_moe(x, gates, indices, w_in, w_out, activation, keep=None):
    """y_t = sum_j gates[t, j] * expert_{indices[t, j]}(x_t); slots with keep[t, j] False add nothing."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(indices.shape[1]):
            if keep is not None and not keep[t, j]:
                continue
            e = int(indices[t, j])
            acc = acc + gates[t, j].to(x.dtype) * expert_mlp(x[t:t + 1], w_in[e], w_out[e], activation)[0]
        rows.append(acc)
    return torch.stack(rows)


def reference_aux_loss(probs, indices, num_experts):
    """E * sum_i f_i * P_i over all tokens."""
    n, k = indices.shape
    f = torch.stack([(indices == i).sum() for i in range(num_experts)]).float() / (n * k)
    p = probs.mean(0)
    return num_experts * (f * p).sum()


def reference_z_loss(logits):
    return torch.logsumexp(logits, -1).pow(2).mean()
