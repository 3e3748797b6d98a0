import pytest
import torch
from moe_lst.kernels.attention import attention, check_qkv, flash_available, reference_attention


def _naive(q, k, v, causal):
    """Per-head loop, written independently of the reference's einsum formulation."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            scores = q[bi, :, hi] @ k[bi, :, hi // rep].T / d**0.5
            if causal:
                scores = scores + torch.full((s, s), float("-inf")).triu(1)
            out[bi, :, hi] = scores.softmax(-1) @ v[bi, :, hi // rep]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_attention_matches_naive(causal, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 12, 8, 16)
    k = torch.randn(2, 12, kv_heads, 16)
    v = torch.randn(2, 12, kv_heads, 16)
    expected = _naive(q, k, v, causal)
    torch.testing.assert_close(reference_attention(q, k, v, causal=causal), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention(q, k, v, causal=causal), expected, atol=1e-5, rtol=1e-5)


def test_gradients_match_reference():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 10, 4, 8, requires_grad=True) for _ in range(3))
    k2, v2 = (torch.randn(1, 10, 2, 8, requires_grad=True) for _ in range(2))
    for kk, vv in ((k, v), (k2, v2)):
        g = torch.randn(1, 10, 4, 8)
        grads_sdpa = torch.autograd.grad((attention(q, kk, vv) * g).sum(), (q, kk, vv))
        grads_ref = torch.autograd.grad((reference_attention(q, kk, vv) * g).sum(), (q, kk, vv))
        for a, b in zip(grads_sdpa, grads_ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_causal_with_fewer_queries_is_bottom_right_aligned():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
    full = reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(attention(q[:, -3:], k, v, causal=True), full[:, -3:], atol=1e-5, rtol=1e-5)


def test_bad_shapes_and_backend():
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(q, torch.randn(1, 4, 4, 8), torch.randn(1, 4, 4, 8))
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, q, q, backend="magic")


def test_flash_backend_refuses_without_cuda():
    q = torch.randn(1, 4, 2, 8)
    assert not flash_available(q)
    with pytest.raises(RuntimeError, match="flash-attn backend needs"):
        attention(q, q, q, backend="flash")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_matches_reference_on_gpu():
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 64, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v).float(), reference_attention(q, k, v).float(), atol=2e-2, rtol=2e-2)


def test_check_qkv_messages_name_the_rule():
    q = torch.randn(2, 5, 4, 8)
    check_qkv(q, torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8))  # kv may be longer (bottom-right causal)
    with pytest.raises(ValueError, match=r"differ in batch or head_dim.*only the sequence length \(seq\)"):
        check_qkv(q, torch.randn(2, 5, 2, 4), torch.randn(2, 5, 2, 4))
    with pytest.raises(ValueError, match=r"^mine: q\(2, 5, 4, 8\) and k\(2, 6, 2, 8\) must agree in batch, shard"):
        check_qkv(q, torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8), same_seq=True, what="mine", seq="shard")
    half = torch.randn(2, 5, 2, 8, dtype=torch.float16)
    check_qkv(q, half, half)  # dtypes are the backend's business unless asked
    with pytest.raises(ValueError, match="dtypes differ"):
        check_qkv(q, half, half, same_dtype=True)
