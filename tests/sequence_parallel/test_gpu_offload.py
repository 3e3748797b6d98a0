"""Activation offload on a CUDA device: checkpointed layer inputs wait in pinned host memory."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_lst.models.llama import ModelConfig, Transformer
from sequence_parallel import ActivationOffload, apply_activation_checkpointing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _Recording(ActivationOffload):
    """Also records where each packed tensor went."""

    def __init__(self) -> None:
        super().__init__()
        self.placements: list[tuple[str, bool]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        host = super().pack(t)
        self.placements.append((host.device.type, host.is_pinned()))
        return host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_checkpoints_live_in_pinned_host_memory_and_give_the_same_gradients(dtype):
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=128)
    torch.manual_seed(0)
    model = Transformer(cfg).to("cuda", dtype)
    ckpt = copy.deepcopy(model)
    offload = _Recording()
    apply_activation_checkpointing(ckpt, offload=offload)
    tokens = torch.randint(0, 128, (2, 96), device="cuda")
    grads = []
    for m in (model, ckpt):
        logits = m(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten()).backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    assert offload.placements == [("cpu", True)] * cfg.n_layers
    assert offload.packed_tensors == offload.restored_tensors == cfg.n_layers
    assert offload.held_bytes == 0
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-6 if dtype == torch.float32 else 2e-3)
