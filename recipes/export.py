"""Consolidated export and import in the Hugging Face Llama / Mixtral layout (safetensors + config.json).

    python -m recipes.export <run_dir or checkpoint directory> <out_dir>

writes `model.safetensors` and `config.json` that `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`
loads, giving the same logits as our model on the same tokens: dense models as `LlamaForCausalLM`, MoE
models (every layer MoE, softmax router renormalised over the top k, SwiGLU experts, no shared experts
or expert bias) as `MixtralForCausalLM`. `import_hf(directory)` reads such a directory back into our
ModelConfig and state dict (`engine.load_full_state_dict` or `Transformer.load_state_dict` take it);
the recipe's `train.init_from=<directory>` starts a run from it, checked with `weight_mismatches`.

Our rotary embedding rotates interleaved pairs (x[2i], x[2i+1]); Hugging Face's rotates the two halves
of each head, so q and k rows are reordered per head on the way out (and back on the way in): the
attention scores are unchanged. Checkpoints of every layout (dp, ZeRO stage, tp, pp, ep, sp) are
verified and consolidated from their shards (`zero.open_checkpoint`, `zero.consolidate`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

import zero
from recipes.config import checkpoints, model_config
from recipes.models.llama import ModelConfig, MoEConfig, Transformer


class ExportError(ValueError):
    """A model or checkpoint that cannot be exported in the requested layout."""


def _rope_order(rows: int, head_dim: int, inverse: bool = False) -> torch.Tensor:
    """Row permutation from interleaved rotary pairs to rotate-half (or back), per head."""
    per_head = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    if inverse:
        per_head = torch.argsort(per_head)
    return (torch.arange(0, rows, head_dim)[:, None] + per_head[None, :]).reshape(-1)


def _check_exportable(cfg: ModelConfig) -> None:
    if cfg.attention != "dense":
        raise ExportError(f"model.attention={cfg.attention} has no Hugging Face Llama / Mixtral equivalent (their "
                          "attention is dense); only dense-attention models export")
    m = cfg.moe
    if not m.num_experts:
        return
    problems = []
    if m.every != 1 or m.first_dense:
        problems.append("every layer must be MoE (model.moe.every=1, first_dense=0)")
    if m.router != "softmax" or not m.renormalize or m.num_groups > 1:
        problems.append("the router must be softmax renormalised over the top k, without groups")
    if m.activation != "swiglu" or m.num_shared_experts:
        problems.append("experts must be SwiGLU, without shared experts")
    if problems:
        raise ExportError("this MoE model has no Mixtral equivalent: " + "; ".join(problems))


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for `transformers` (LlamaForCausalLM or MixtralForCausalLM)."""
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "initializer_range": cfg.init_std, "torch_dtype": "float32", "moe_lst": asdict(cfg),
    }
    if cfg.moe.num_experts:
        m = cfg.moe
        return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": m.ffn_dim or cfg.ffn_dim, "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef,
                "output_router_logits": False}
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "intermediate_size": cfg.ffn_dim, "mlp_bias": False}


# Names that only change (ours, theirs): model-level, per layer, and the dense MLP's.
_TOP = (("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"))
_LAYER = (("attention.wv.weight", "self_attn.v_proj.weight"), ("attention.wo.weight", "self_attn.o_proj.weight"),
          ("attention_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"))
_MLP = (("feed_forward.w1.weight", "mlp.gate_proj.weight"), ("feed_forward.w3.weight", "mlp.up_proj.weight"),
        ("feed_forward.w2.weight", "mlp.down_proj.weight"))


def _renamed(src: dict[str, torch.Tensor], cfg: ModelConfig, to_hf: bool) -> dict[str, torch.Tensor]:
    """Every tensor that only changes name, in the requested direction (q/k and experts are not here)."""
    pairs = list(_TOP) + ([] if cfg.tie_embeddings else [("output.weight", "lm_head.weight")])
    for i in range(cfg.n_layers):
        layer = _LAYER if cfg.is_moe_layer(i) else _LAYER + _MLP
        pairs += [(f"layers.{i}.{a}", f"model.layers.{i}.{b}") for a, b in layer]
    return {b: src[a] for a, b in pairs} if to_hf else {a: src[b] for a, b in pairs}


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state dict -> Hugging Face tensor names and layouts."""
    _check_exportable(cfg)
    hd = cfg.head_dim
    out = _renamed(state, cfg, to_hf=True)
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wq, wk = state[p + "attention.wq.weight"], state[p + "attention.wk.weight"]
        out[q + "self_attn.q_proj.weight"] = wq[_rope_order(wq.shape[0], hd)]
        out[q + "self_attn.k_proj.weight"] = wk[_rope_order(wk.shape[0], hd)]
        if cfg.is_moe_layer(i):
            bias = state.get(p + "feed_forward.router.expert_bias")
            if bias is not None and bias.abs().max() > 0:
                raise ExportError(f"layer {i}'s router has a non-zero expert bias (aux-loss-free balancing), "
                                  "which Mixtral's router does not have")
            out[q + "block_sparse_moe.gate.weight"] = state[p + "feed_forward.router.weight"]
            w_in, w_out = state[p + "feed_forward.experts.w_in"], state[p + "feed_forward.experts.w_out"]
            ffn = w_out.shape[1]
            for e in range(w_in.shape[0]):
                x = f"{q}block_sparse_moe.experts.{e}."
                out[x + "w1.weight"] = w_in[e, :, :ffn].t()
                out[x + "w3.weight"] = w_in[e, :, ffn:].t()
                out[x + "w2.weight"] = w_out[e].t()
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (as written by to_hf or another Llama / Mixtral) -> our state dict."""
    hd = cfg.head_dim
    out = _renamed(hf, cfg, to_hf=False)
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wq, wk = hf[q + "self_attn.q_proj.weight"], hf[q + "self_attn.k_proj.weight"]
        out[p + "attention.wq.weight"] = wq[_rope_order(wq.shape[0], hd, inverse=True)]
        out[p + "attention.wk.weight"] = wk[_rope_order(wk.shape[0], hd, inverse=True)]
        if cfg.is_moe_layer(i):
            out[p + "feed_forward.router.weight"] = hf[q + "block_sparse_moe.gate.weight"]
            experts = range(cfg.moe.num_experts)
            x = f"{q}block_sparse_moe.experts."
            out[p + "feed_forward.experts.w_in"] = torch.stack(
                [torch.cat([hf[f"{x}{e}.w1.weight"].t(), hf[f"{x}{e}.w3.weight"].t()], dim=1) for e in experts])
            out[p + "feed_forward.experts.w_out"] = torch.stack([hf[f"{x}{e}.w2.weight"].t() for e in experts])
    return {k: v.contiguous() for k, v in out.items()}


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write `model.safetensors` and `config.json` for our full state dict into out_dir."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(state, cfg), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    return out_dir


def import_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Our ModelConfig and state dict from a Hugging Face Llama / Mixtral directory (safetensors)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not (directory / "config.json").is_file() or not files:
        raise ExportError(f"{directory} is not a Hugging Face model directory: it needs config.json and "
                          "*.safetensors (as `python -m recipes.export` writes)")
    config = json.loads((directory / "config.json").read_text())
    if "moe_lst" in config:
        cfg = ModelConfig(**config["moe_lst"])  # written by hf_config: our own fields (moe as a dict)
    else:
        moe = MoEConfig()
        if config.get("model_type") == "mixtral":
            moe = MoEConfig(num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                            ffn_dim=config["intermediate_size"])
        cfg = ModelConfig(vocab_size=config["vocab_size"], dim=config["hidden_size"],
                          n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
                          n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
                          ffn_dim=config["intermediate_size"], max_seq_len=config["max_position_embeddings"],
                          rope_theta=config.get("rope_theta", 10000.0), norm_eps=config["rms_norm_eps"],
                          tie_embeddings=config.get("tie_word_embeddings", False), moe=moe)
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(str(f)))
    try:
        return cfg, from_hf(hf, cfg)
    except KeyError as e:
        raise ExportError(f"{directory} lacks the tensor {e} that its config.json implies") from None


def weight_keys(cfg: ModelConfig) -> dict[str, object]:
    """The model settings that fix the weights' names and shapes (as `model.<key>` config names)."""
    m = cfg.moe
    keys: dict[str, object] = {"model.vocab_size": cfg.vocab_size, "model.dim": cfg.dim,
                               "model.n_layers": cfg.n_layers, "model.n_heads": cfg.n_heads,
                               "model.n_kv_heads": cfg.n_kv_heads, "model.tie_embeddings": cfg.tie_embeddings,
                               "model.moe.num_experts": m.num_experts}
    if not all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        keys["model.ffn_dim"] = cfg.ffn_dim  # the width of the dense layers' MLP
    if m.num_experts:
        keys.update({"model.moe.ffn_dim": m.ffn_dim or cfg.ffn_dim, "model.moe.every": m.every,
                     "model.moe.first_dense": m.first_dense, "model.moe.num_shared_experts": m.num_shared_experts})
    return keys


def weight_mismatches(ours: ModelConfig, theirs: ModelConfig) -> dict[str, tuple[object, object]]:
    """Key -> (ours, theirs) for every weight-shaping setting on which two model configs differ."""
    a, b = weight_keys(ours), weight_keys(theirs)
    return {k: (a.get(k), b.get(k)) for k in list(a) + [k for k in b if k not in a] if a.get(k) != b.get(k)}


def consolidate(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Our full state dict from a checkpoint of any layout (dp, ZeRO stage, tp, pp, ep, sp), verified."""
    try:
        return zero.consolidate(zero.open_checkpoint(checkpoint))
    except (zero.CheckpointError, zero.ReshardError) as e:
        raise ExportError(str(e)) from e


def export(source: str | Path, out_dir: str | Path) -> Path:
    """Export a run directory (its newest checkpoint) or one checkpoint directory to out_dir."""
    source = Path(source)
    if (source / "checkpoints").is_dir():
        found = checkpoints(source)
        if not found:
            raise ExportError(f"{source} has no checkpoint to export")
        run_dir, checkpoint = source, found[0]
    elif (source / "meta.json").exists():
        run_dir, checkpoint = source.parent.parent, source
    else:
        raise ExportError(f"{source} is neither a run directory nor a checkpoint directory")
    cfg = model_config(OmegaConf.load(run_dir / "config.yaml"))
    flat = consolidate(checkpoint)
    shapes = {n: p.shape for n, p in Transformer(cfg, device="meta").state_dict().items()}
    state = {n: (v.reshape(shapes[n]) if n in shapes else v) for n, v in flat.items()}
    if cfg.tie_embeddings:
        state.pop("output.weight", None)
    return save_hf(state, cfg, out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint directory")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    try:
        out = export(args.source, args.out_dir)
    except (ExportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}")


if __name__ == "__main__":
    main()
