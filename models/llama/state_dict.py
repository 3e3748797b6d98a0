"""The Hugging Face weight adapter: our Llama (ModelConfig + Transformer state dict) <-> `transformers`'
LlamaForCausalLM (dense) and MixtralForCausalLM (MoE), in both directions: config.json and tensor names and
layouts.

Export (`to_hf`, `save_hf`): dense models as Llama; MoE models (every layer MoE, softmax router renormalised
over the top k, SwiGLU experts, no shared experts or expert bias) as Mixtral, with the experts either

- `per_expert` (default): `model.layers.{i}.block_sparse_moe.gate.weight` and
  `...block_sparse_moe.experts.{e}.w1|w2|w3.weight`, the layout of the published Mixtral checkpoints, which
  `transformers` 5 still writes by default (`save_pretrained`, `save_original_format=True`) and loads through
  its conversion mapping into fused experts, and which `transformers` 4 loads as it is; or
- `fused`: `model.layers.{i}.mlp.gate.weight`, `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up)
  and `...mlp.experts.down_proj` [E, H, I]: the parameters of `transformers` 5's MixtralExperts as they are
  (`save_pretrained(..., save_original_format=False)`), loaded without conversion.

MoE models with the sigmoid router (DeepSeek-style: `model=moe_small`'s expert groups, shared experts, leading dense
layers, aux-loss-free expert bias) export as GLM-4.5 MoE (`glm4_moe`, Glm4MoeForCausalLM), whose router is the same
computation: sigmoid scores, the best `topk_group` of `n_group` groups by the sum of their two best biased scores,
top k by biased score, gate weights the unbiased scores renormalised; the expert bias is its
`mlp.gate.e_score_correction_bias`, the shared experts its `mlp.shared_experts`, the dense layers its first
`first_k_dense_replace` ones; experts per expert (`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`, the
published layout) or fused. (GLM masks the groups it drops with a score of 0 where ours uses -inf: the same choice
while the biased scores of the kept groups' chosen experts stay positive, i.e. biases above -sigmoid(logit).)

Import (`from_hf`, `import_hf`) reads either expert layout (and per-expert tensors under `mlp.` as well as
`block_sparse_moe.`), from our own export or from another Llama / Mixtral directory; a config it cannot
represent (another architecture, rotary scaling, biases, sliding window, another head width) is refused.

Our rotary embedding rotates interleaved pairs (x[2i], x[2i+1]); Hugging Face's rotates the two halves of
each head, so q and k rows are reordered per head on the way out (and back on the way in): the attention
scores are unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from moe_lst.models.llama.model import ModelConfig, MoEConfig, Transformer
from moe_lst.models.spec import ExportError  # (every family's export refuses with it)

EXPERT_LAYOUTS = ("per_expert", "fused")
# The rotary base `transformers` assumes when a config.json names none (its config classes' default_theta).
_DEFAULT_THETA = {"llama": 10000.0, "mixtral": 1000000.0}


def _rope_order(rows: int, head_dim: int, inverse: bool = False) -> torch.Tensor:
    """Row permutation from interleaved rotary pairs to rotate-half (or back), per head."""
    per_head = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    if inverse:
        per_head = torch.argsort(per_head)
    return (torch.arange(0, rows, head_dim)[:, None] + per_head[None, :]).reshape(-1)


def moe_model_type(cfg: ModelConfig) -> str:
    """The transformers model type an MoE model exports as: Mixtral for the softmax router, GLM-4.5 MoE
    (`glm4_moe`: grouped query attention, sigmoid routing over expert groups with a score-correction bias, shared
    experts, leading dense layers) for the sigmoid one."""
    return "glm4_moe" if cfg.moe.router == "sigmoid" else "mixtral"


def check_exportable(cfg: ModelConfig, state: dict[str, torch.Tensor] | None = None) -> None:
    """Raise ExportError unless the model has a Llama / Mixtral / GLM-4.5 MoE equivalent: every rule of the export,
    from the config alone (before a checkpoint is read) and, with `state`, from its values."""
    if cfg.attention != "dense":
        raise ExportError(f"model.attention={cfg.attention} has no Hugging Face Llama / Mixtral / GLM-4.5 MoE "
                          "equivalent (their attention is dense); only dense-attention models export")
    m = cfg.moe
    if not m.num_experts:
        return
    problems = []
    if m.capacity_factor is not None:
        problems.append(f"model.moe.capacity_factor={m.capacity_factor} drops tokens, which transformers' MoE "
                        "does not (dropless: capacity_factor=null)")
    if moe_model_type(cfg) == "glm4_moe":
        if m.every != 1:
            problems.append(f"model.moe.every={m.every}: every layer after the first_dense ones must be MoE")
        if m.activation != "swiglu":
            problems.append("experts must be SwiGLU")
        if problems:
            raise ExportError("this MoE model has no GLM-4.5 MoE (glm4_moe) equivalent: " + "; ".join(problems))
        return
    if m.every != 1 or m.first_dense:
        problems.append("every layer must be MoE (model.moe.every=1, first_dense=0)")
    if m.router != "softmax" or not m.renormalize or m.num_groups > 1:
        problems.append("the router must be softmax renormalised over the top k, without groups")
    if m.activation != "swiglu" or m.num_shared_experts:
        problems.append("experts must be SwiGLU, without shared experts")
    if m.bias_update_rate:  # (its training moves the bias off zero at the first step whose loads differ)
        problems.append(f"model.moe.bias_update_rate={m.bias_update_rate} trains a per-expert selection bias "
                        "(aux-loss-free balancing), which Mixtral's router does not have")
    for i in range(cfg.n_layers) if state is not None else ():
        bias = state.get(f"layers.{i}.feed_forward.router.expert_bias")
        if cfg.is_moe_layer(i) and bias is not None and bias.abs().max() > 0:
            problems.append(f"layer {i}'s router has a non-zero expert bias (aux-loss-free balancing), which "
                            "Mixtral's router does not have")
            break
    if problems:
        raise ExportError("this MoE model has no Mixtral equivalent: " + "; ".join(problems) + " (a sigmoid "
                          "router exports as GLM-4.5 MoE, with groups, shared experts, dense layers and the bias)")


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for `transformers` (LlamaForCausalLM or MixtralForCausalLM); `moe_lst` keeps our own fields.

    The rotary base is written both as `rope_parameters` (transformers 5) and as `rope_theta` (4.x readers)."""
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "initializer_range": cfg.init_std, "dtype": "float32", "moe_lst": asdict(cfg),
    }
    m = cfg.moe
    if m.num_experts and moe_model_type(cfg) == "glm4_moe":
        # partial_rotary_factor 1: every head dimension rotates, as ours does (GLM-4.5's default rotates half)
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0}
        return {**common, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "rope_parameters": rope,
                "intermediate_size": cfg.ffn_dim, "moe_intermediate_size": m.ffn_dim or cfg.ffn_dim,
                "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "n_shared_experts": m.num_shared_experts, "first_k_dense_replace": m.first_dense,
                "n_group": m.num_groups, "topk_group": m.topk_groups, "norm_topk_prob": m.renormalize,
                "routed_scaling_factor": 1.0, "use_qk_norm": False, "num_nextn_predict_layers": 0}
    if m.num_experts:
        return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": m.ffn_dim or cfg.ffn_dim, "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef,
                "output_router_logits": False, "sliding_window": None}
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "intermediate_size": cfg.ffn_dim, "mlp_bias": False}


def model_config_from_hf(config: dict) -> ModelConfig:
    """Our ModelConfig from a config.json: ours (its `moe_lst` fields), or another Llama / Mixtral's."""
    if "moe_lst" in config:
        return ModelConfig(**config["moe_lst"])  # written by hf_config: our own fields (moe as a dict)
    kind = config.get("model_type")
    if kind not in _DEFAULT_THETA:
        raise ExportError(f"model_type={kind!r}: only Llama and Mixtral (model_type llama / mixtral) import")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    heads, dim = config["num_attention_heads"], config["hidden_size"]
    problems = []
    if rope_type != "default":
        problems.append(f"rope_type={rope_type} (ours is the plain rotary embedding)")
    if config.get("head_dim") not in (None, dim // heads):
        problems.append(f"head_dim={config['head_dim']} is not hidden_size / num_attention_heads = {dim // heads}")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']} (ours is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            problems.append(f"{key}=true (ours has no biases)")
    if config.get("sliding_window") is not None:
        problems.append(f"sliding_window={config['sliding_window']} (ours attends to the whole causal prefix)")
    if problems:
        raise ExportError(f"this {kind} config has no equivalent here: " + "; ".join(problems))
    moe = MoEConfig()
    if kind == "mixtral":
        moe = MoEConfig(num_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                        ffn_dim=config["intermediate_size"])
    try:
        return ModelConfig(vocab_size=config["vocab_size"], dim=dim, n_layers=config["num_hidden_layers"],
                           n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
                           ffn_dim=config["intermediate_size"], max_seq_len=config["max_position_embeddings"],
                           rope_theta=float(rope.get("rope_theta", config.get("rope_theta", _DEFAULT_THETA[kind]))),
                           norm_eps=config["rms_norm_eps"], tie_embeddings=config.get("tie_word_embeddings", False),
                           init_std=config.get("initializer_range", 0.02), moe=moe)
    except ValueError as e:
        raise ExportError(f"this {kind} config has no equivalent here: {e}") from None


# The one table of names (ours, theirs): model-level, per layer, the dense MLP's, and the attention projections whose
# rows are reordered per head (rotary pairs). Export, import and the streaming loads all read it through
# weight_sources.
_TOP = (("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"))
_HEAD = ("output.weight", "lm_head.weight")
_LAYER = (("attention.wv.weight", "self_attn.v_proj.weight"), ("attention.wo.weight", "self_attn.o_proj.weight"),
          ("attention_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"))
_ROTARY = (("attention.wq.weight", "self_attn.q_proj.weight"), ("attention.wk.weight", "self_attn.k_proj.weight"))
_MLP = (("feed_forward.w1.weight", "mlp.gate_proj.weight"), ("feed_forward.w3.weight", "mlp.up_proj.weight"),
        ("feed_forward.w2.weight", "mlp.down_proj.weight"))
# Per-expert tensor names (gate, up, down) under `{block}experts.{e}.`: Mixtral's published ones, GLM-4.5 MoE's.
_PER_EXPERT = {"mixtral": ("w1", "w3", "w2"), "glm4_moe": ("gate_proj", "up_proj", "down_proj")}


def _experts_layout(cfg: ModelConfig, q: str, names, experts: str) -> tuple[str, bool]:
    """Where one MoE layer's experts lie: (the block prefix of its router and experts, whether they are fused).
    Export (`names` None): from `experts`; import: from the tensor names the directory holds (fused, else per expert
    under Mixtral's `block_sparse_moe.` or under `mlp.`)."""
    glm = moe_model_type(cfg) == "glm4_moe"
    if names is None:
        fused = experts == "fused"
        return ("mlp." if fused or glm else "block_sparse_moe."), fused
    if q + "mlp.experts.gate_up_proj" in names:
        return "mlp.", True
    if glm:
        return "mlp.", False
    return next((b for b in ("block_sparse_moe.", "mlp.") if f"{q}{b}gate.weight" in names), "block_sparse_moe."), False


def _whole(name: str, shape: tuple[int, ...]):
    """The file tensor `name` is the parameter, as it is."""
    from moe_lst.models.loading import Source

    return [Source(name, (0,) * len(shape), shape, tuple(range(len(shape))))]


def weight_sources(cfg: ModelConfig, names=None, experts: str = "per_expert") -> dict[str, list]:
    """How each tensor of our model (parameters, and the expert bias a GLM-4.5 MoE export carries) lies in a Hugging
    Face directory's tensors (moe_lst.models.loading.Source): renamed as they are, q / k with their rows reordered
    per head, experts fused ([E, 2I, H] gate | up, [E, H, I]) or per expert, transposed; GLM-4.5 MoE's router bias
    and shared experts. The one description of the layout: `to_hf` writes by it (`names` None: the layout
    `experts` asks), `from_hf` and the streaming loads read by it (`names`: the tensors the directory holds, whose
    expert layout it detects). A GLM-4.5 MoE model without shared experts has entries for their empty tensors."""
    from moe_lst.models.loading import Source

    shapes = {n: tuple(t.shape) for n, t in Transformer(cfg, device="meta").state_dict().items()}
    pairs = list(_TOP) + ([] if cfg.tie_embeddings else [_HEAD])
    out = {ours: _whole(theirs, shapes[ours]) for ours, theirs in pairs}
    kind = moe_model_type(cfg)
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER + (() if cfg.is_moe_layer(i) else _MLP):
            out[p + ours] = _whole(q + theirs, shapes[p + ours])
        for ours, theirs in _ROTARY:
            shape = shapes[p + ours]
            rows = tuple(_rope_order(shape[0], cfg.head_dim, inverse=True).tolist())
            out[p + ours] = [Source(q + theirs, (0, 0), shape, (0, 1), rows)]
        if not cfg.is_moe_layer(i):
            continue
        f = p + "feed_forward."
        (n, dim, _), ffn = shapes[f + "experts.w_in"], shapes[f + "experts.w_out"][1]
        block, fused = _experts_layout(cfg, q, names, experts)
        out[f + "router.weight"] = _whole(f"{q}{block}gate.weight", shapes[f + "router.weight"])
        if fused:
            out[f + "experts.w_in"] = [Source(q + "mlp.experts.gate_up_proj", (0, 0, 0), (n, dim, 2 * ffn), (0, 2, 1))]
            out[f + "experts.w_out"] = [Source(q + "mlp.experts.down_proj", (0, 0, 0), (n, ffn, dim), (0, 2, 1))]
        else:
            gate, up, down = _PER_EXPERT[kind]
            x = f"{q}{block}experts."
            out[f + "experts.w_in"] = [Source(f"{x}{e}.{w}.weight", (e, 0, half * ffn), (1, dim, ffn), (None, 1, 0))
                                       for e in range(n) for half, w in enumerate((gate, up))]
            out[f + "experts.w_out"] = [Source(f"{x}{e}.{down}.weight", (e, 0, 0), (1, ffn, dim), (None, 1, 0))
                                        for e in range(n)]
        if kind == "glm4_moe":
            out[f + "router.expert_bias"] = _whole(q + "mlp.gate.e_score_correction_bias", (n,))
            shared, s = q + "mlp.shared_experts.", cfg.moe.num_shared_experts * (cfg.moe.ffn_dim or cfg.ffn_dim)
            out[f + "shared_experts.w_in.weight"] = [Source(shared + "gate_proj.weight", (0, 0), (s, dim), (0, 1)),
                                                     Source(shared + "up_proj.weight", (s, 0), (s, dim), (0, 1))]
            out[f + "shared_experts.w_out.weight"] = _whole(shared + "down_proj.weight", (dim, s))
    return out


def _box(sources: list) -> tuple[int, ...]:
    """The shape of the tensor `sources` make up together."""
    return tuple(max(s.start[d] + s.size[d] for s in sources) for d in range(len(sources[0].size)))


def _part(tensor: torch.Tensor, s) -> torch.Tensor:
    """The file tensor of Source `s`, cut from our `tensor` (export)."""
    box = tensor[tuple(slice(a, a + n) for a, n in zip(s.start, s.size))]
    if s.rows is not None:
        reordered = torch.empty_like(box)
        reordered[list(s.rows)] = box
        box = reordered
    kept = [d for d, a in enumerate(s.axes) if a is not None]
    box = box.reshape([box.shape[d] for d in kept])
    return box.permute([kept.index(d) for d in sorted(kept, key=lambda d: s.axes[d])])


def _assembled(hf: dict[str, torch.Tensor], sources: list) -> torch.Tensor:
    """Our tensor made of the file tensors `hf` holds, as `sources` place them (import)."""
    parts = []
    for s in sources:
        kept = [d for d, a in enumerate(s.axes) if a is not None]
        t = hf[s.name].permute([s.axes[d] for d in kept]).reshape(s.size)
        parts.append(t[list(s.rows)] if s.rows is not None else t)
    if len(sources) == 1:
        return parts[0]
    out = torch.empty(_box(sources), dtype=parts[0].dtype)
    for s, t in zip(sources, parts):
        out[tuple(slice(a, a + n) for a, n in zip(s.start, s.size))] = t
    return out


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, experts: str = "per_expert") -> dict[str, torch.Tensor]:
    """Our full state dict -> Hugging Face tensor names and layouts (experts: one of EXPERT_LAYOUTS), by
    weight_sources. A GLM-4.5 MoE export writes zeros for what our model lacks (an expert bias not in `state`, the
    empty shared experts of a model without them); any other tensor missing from `state` is a KeyError."""
    check_exportable(cfg, state)
    if experts not in EXPERT_LAYOUTS:
        raise ExportError(f"experts={experts!r} must be one of {', '.join(EXPERT_LAYOUTS)}")
    out = {}
    for name, sources in weight_sources(cfg, experts=experts).items():
        if name not in state and (name.endswith("router.expert_bias") or 0 in _box(sources)):
            tensor = torch.zeros(_box(sources))  # (GLM's bias at zero, its empty shared experts)
        else:
            tensor = state[name]
        out.update({s.name: _part(tensor, s) for s in sources})
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (as written by to_hf, `save_pretrained` or another Llama / Mixtral) -> our state dict,
    by weight_sources (the expert layout detected from the tensors' names)."""
    ours = Transformer(cfg, device="meta").state_dict()
    return {name: _assembled(hf, sources).contiguous() for name, sources in weight_sources(cfg, set(hf)).items()
            if name in ours}


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
            experts: str = "per_expert") -> Path:
    """Write `model.safetensors` and `config.json` for our full state dict into out_dir."""
    from moe_lst.models.files import save_safetensors

    tensors = to_hf(state, cfg, experts)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    return out_dir


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the model: those the shard index names, model.safetensors, or all of them."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    return sorted(directory.glob("*.safetensors"))


def import_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Our ModelConfig and state dict from a Hugging Face Llama / Mixtral directory (safetensors)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    files = _weight_files(directory)
    if not (directory / "config.json").is_file() or not files:
        raise ExportError(f"{directory} is not a Hugging Face model directory: it needs config.json and "
                          "*.safetensors (as `python -m recipes.export` writes)")
    cfg = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(str(f)))
    try:
        state = from_hf(hf, cfg)
    except KeyError as e:
        raise ExportError(f"{directory} lacks the tensor {e} that its config.json implies") from None
    shapes = {n: t.shape for n, t in Transformer(cfg, device="meta").state_dict().items()}
    for name, tensor in state.items():
        if tensor.shape != shapes[name]:
            raise ExportError(f"{directory}: {name} has shape {tuple(tensor.shape)} where its config.json implies "
                              f"{tuple(shapes[name])}")
    return cfg, state


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


def hf_sources(cfg: ModelConfig, names: set[str] | dict) -> tuple[dict[str, list], dict[str, list]]:
    """How each tensor of our model is made of the tensors of a Hugging Face directory holding `names`
    (weight_sources), for streaming loads that read only a rank's slices: (the parameters' sources, the persistent
    buffers' sources). The buffers are GLM-4.5 MoE's expert biases (`mlp.gate.e_score_correction_bias` of each MoE
    layer), read whole on every rank that holds the layer (moe_lst.models.loading.StreamingWeights.buffers); a
    Llama / Mixtral directory has none."""
    model = Transformer(cfg, device="meta")
    params, tensors = dict(model.named_parameters()), model.state_dict()
    table = {n: sources for n, sources in weight_sources(cfg, names).items() if n in tensors}
    return ({n: s for n, s in table.items() if n in params}, {n: s for n, s in table.items() if n not in params})


def open_hf_checkpoint(directory: str | Path, ours: ModelConfig):
    """A Hugging Face Llama / Mixtral / GLM-4.5 MoE directory checked against the run's model without reading any
    weight: its config.json (every weight-shaping key that differs is named), its shards and every tensor's shape
    and dtype, the expert biases' as the parameters'. Returns the moe_lst.models.loading.StreamingWeights (its
    Checkpoint, the sources of each parameter and of each expert bias); raises ExportError for a config that
    differs and CheckpointError for the files."""
    from moe_lst.models.loading import Checkpoint, StreamingWeights

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ExportError(f"{directory} is not a Hugging Face model directory: it needs config.json and "
                          "*.safetensors (as `python -m recipes.export` writes)")
    theirs = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    differ = weight_mismatches(ours, theirs)
    if differ:
        raise ExportError("holds another model: " + ", ".join(f"{k}={a} here but {b} there" for k, (a, b) in
                                                             differ.items())
                          + "; set those keys to the directory's values or choose another directory")
    checkpoint = Checkpoint.open(directory)
    sources, buffers = hf_sources(ours, checkpoint.where)
    checkpoint.check(sources)
    checkpoint.check(buffers)
    return StreamingWeights(checkpoint, sources, buffers)
