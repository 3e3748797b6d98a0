import pytest
import torch

from moe_lst.models.llama import ModelConfig, Transformer, apply_rope, rope_cos_sin


def _tiny(**kw):
    cfg = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    cfg.update(kw)
    return ModelConfig(**cfg)


def test_shapes_and_tied_weights():
    torch.manual_seed(0)
    model = Transformer(_tiny())
    tokens = torch.randint(0, 64, (3, 10))
    assert model(tokens).shape == (3, 10, 64)
    assert model.forward_hidden(tokens).shape == (3, 10, 32)
    assert model.output_weight is model.tok_embeddings.weight
    untied = Transformer(_tiny(tie_embeddings=False))
    assert untied.output_weight is untied.output.weight
    n = sum(p.numel() for p in untied.parameters())
    assert n - sum(p.numel() for p in model.parameters()) == 64 * 32
    assert _tiny().num_params() == sum(p.numel() for p in model.parameters())


def test_rope_is_relative():
    # Rotating q and k by positions p and p+c gives the same dot products for every shift c.
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    dots = []
    for shift in (0, 5, 100):
        cq, sq = rope_cos_sin(torch.tensor([[3 + shift]]), 16, 10000.0)
        ck, sk = rope_cos_sin(torch.tensor([[7 + shift]]), 16, 10000.0)
        dots.append((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())
    torch.testing.assert_close(dots[0], dots[1])
    torch.testing.assert_close(dots[0], dots[2])
    # position 0 is the identity rotation
    c0, s0 = rope_cos_sin(torch.tensor([[0]]), 16, 10000.0)
    torch.testing.assert_close(apply_rope(q, c0, s0), q)


def test_explicit_position_ids_match_default_and_slice_consistency():
    torch.manual_seed(2)
    model = Transformer(_tiny(init_std=0.5))  # large weights: attention far from uniform
    tokens = torch.randint(0, 64, (2, 12))
    default = model(tokens)
    explicit = model(tokens, torch.arange(12).expand(2, 12))
    torch.testing.assert_close(default, explicit)
    # Causality: the first 5 positions do not depend on later tokens.
    torch.testing.assert_close(model(tokens[:, :5])[:, :5], default[:, :5], atol=1e-5, rtol=1e-5)
    # A uniform shift of positions leaves attention unchanged (RoPE is relative) ...
    torch.testing.assert_close(model(tokens, torch.arange(12).expand(2, 12) + 3), default, atol=1e-4, rtol=1e-4)
    # ... while positions that restart mid-sequence (packed documents) change it.
    restarted = model(tokens, torch.cat([torch.arange(6), torch.arange(6)]).expand(2, 12))
    torch.testing.assert_close(restarted[:, :6], default[:, :6])
    assert not torch.allclose(restarted[:, 6:], default[:, 6:], atol=1e-3)


def test_config_errors():
    with pytest.raises(ValueError, match="divisible by model.n_heads"):
        _tiny(dim=30)
    with pytest.raises(ValueError, match="multiple of model.n_kv_heads"):
        _tiny(n_kv_heads=3)
    with pytest.raises(ValueError, match="position_ids"):
        Transformer(_tiny())(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


def test_generate_is_seeded():
    torch.manual_seed(3)
    model = Transformer(_tiny())
    prompt = torch.randint(0, 64, (1, 4))
    a = model.generate(prompt, 6, generator=torch.Generator().manual_seed(0))
    b = model.generate(prompt, 6, generator=torch.Generator().manual_seed(0))
    assert a.shape == (1, 6) and torch.equal(a, b)


SPARSE = {"layout": "bigbird", "block_size": 4, "window_blocks": 2, "global_blocks": 1, "random_blocks": 1}
NSA = {"block_size": 4, "select_blocks": 3, "compress_block": 4, "compress_stride": 2, "window_blocks": 2}


def test_sparse_attention_model_uses_its_layout():
    torch.manual_seed(4)
    dense = Transformer(_tiny(init_std=0.5))
    sparse = Transformer(_tiny(init_std=0.5, attention="sparse", sparse=SPARSE))
    sparse.load_state_dict(dense.state_dict())  # the same parameters: only attn_fn differs
    tokens = torch.randint(0, 64, (2, 24))
    # 8 tokens are 2 blocks: every layout covers them whole, so sparse equals dense there ...
    torch.testing.assert_close(sparse(tokens[:, :8]), dense(tokens[:, :8]), atol=5e-5, rtol=5e-5)
    # ... while over 6 blocks the layout leaves blocks out, and later tokens change nothing before them.
    out = sparse(tokens)
    assert not torch.allclose(out, dense(tokens), atol=1e-3)
    torch.testing.assert_close(sparse(tokens[:, :13])[:, :13], out[:, :13], atol=1e-5, rtol=1e-5)


def test_nsa_model_trains_its_own_parameters_and_meta_init_matches():
    cfg = _tiny(attention="nsa", nsa=NSA)
    torch.manual_seed(5)
    model = Transformer(cfg)
    names = {n for n, _ in model.named_parameters() if n.startswith("layers.0.attention.")}
    assert {"layers.0.attention.wg.weight", "layers.0.attention.compress_k.w1.weight",
            "layers.0.attention.compress_v.pos"} <= names
    tokens = torch.randint(0, 64, (2, 20))
    out = model(tokens)
    torch.testing.assert_close(model(tokens[:, :9])[:, :9], out[:, :9], atol=1e-5, rtol=1e-5)  # causal
    out.square().mean().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    meta = Transformer(cfg, device="meta")
    meta.init_seed = model.init_seed
    for name, p in model.named_parameters():
        value = torch.empty_like(p)
        meta.init_parameter(name, value)
        torch.testing.assert_close(value, p.detach())


def test_attention_config_errors():
    with pytest.raises(ValueError, match="model.attention='flash' must be one of dense, sparse, nsa"):
        _tiny(attention="flash")
    with pytest.raises(ValueError, match="model.sparse.window_blocks=8 is set but model.attention=dense"):
        _tiny(sparse={"window_blocks": 8})
    with pytest.raises(ValueError, match="model.nsa.select_blocks=4 is set but model.attention=sparse"):
        _tiny(attention="sparse", nsa={"select_blocks": 4})
    with pytest.raises(ValueError, match="random_blocks=3 has no effect with model.sparse.layout=fixed"):
        _tiny(attention="sparse", sparse={"random_blocks": 3})
    with pytest.raises(ValueError, match="model.attention=nsa with tp=2 is not supported"):
        from moe_lst.models.llama import check_tensor_parallel

        check_tensor_parallel(_tiny(attention="nsa"), 2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rmsnorm_and_rope_functions_match_plain_autograd(dtype, tol):
    """The memory-lean autograd functions (they save nothing sequence-sized they can recompute) give the
    values and gradients of the plain formulas, also with a weight that does not require grad."""
    from moe_lst.models.llama import RMSNorm, apply_rope, rope_cos_sin

    torch.manual_seed(0)
    x = torch.randn(2, 40, 3, 8).to(dtype).requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(40).expand(2, 40), 8, 10000.0)
    xf = x.float().unflatten(-1, (-1, 2))
    plain = torch.stack((xf[..., 0] * cos - xf[..., 1] * sin, xf[..., 0] * sin + xf[..., 1] * cos), -1).flatten(-2)
    g = torch.randn_like(plain)
    ours = apply_rope(x, cos, sin)
    torch.testing.assert_close(ours.float(), plain.to(dtype).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(torch.autograd.grad(ours, x, g.to(dtype))[0].float(),
                               torch.autograd.grad(plain, x, g)[0].float(), atol=tol, rtol=tol)
    for trainable in (True, False):
        norm = RMSNorm(8).to(dtype)
        norm.weight.data.uniform_(0.5, 1.5)
        norm.weight.requires_grad_(trainable)
        y = torch.randn(2, 40, 8).to(dtype).requires_grad_()
        yf = y.float()
        ref = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
        g = torch.randn_like(ref)
        wanted = (y, norm.weight) if trainable else (y,)
        mine = torch.autograd.grad(norm(y), wanted, g.to(dtype))
        theirs = torch.autograd.grad(ref, wanted, g)
        torch.testing.assert_close(norm(y).float(), ref, atol=tol, rtol=tol)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a.float(), b.float(), atol=tol * 10, rtol=tol)
