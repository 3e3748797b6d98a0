"""Consolidated export in the Hugging Face Llama / Mixtral layout (safetensors + config.json).

    python -m recipes.export <run_dir or checkpoint directory> <out_dir> [--experts per_expert|fused]

writes `model.safetensors` and `config.json` that `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`
loads, giving the same logits as our model on the same tokens: dense models as `LlamaForCausalLM`, MoE
models (every layer MoE, softmax router renormalised over the top k, SwiGLU experts, no shared experts
or expert bias) as `MixtralForCausalLM`, their experts per expert (the published Mixtral layout, default) or
fused as transformers 5 holds them. Checkpoints of every layout (dp, ZeRO stage, tp, pp, ep, sp) are
verified and consolidated from their shards (`zero.open_checkpoint`, `zero.consolidate`).

A run of a Hugging Face model (`model=hf`) is written by transformers' own `save_pretrained` from the model's
config.json (the run directory's hf_config.json) and the consolidated weights, which already carry Hugging Face's
names: any model type the adapter trains (moe_lst.models.hf) exports, loading back to the same logits, with its dense
attention (a run with model.attention=sparse is refused: no transformers config expresses block-sparse attention).

The run's model family (moe_lst.models.spec) writes it: its spec's `check_exportable` checks every rule from the
run's config before a checkpoint is read (an MoE Llama trained with aux-loss-free balancing, model.moe.bias_update_rate
> 0, has a router bias Mixtral lacks and is refused there), its `export` writes the directory. The recipe itself never
exports (export is this separate command), so a run is not refused for what its export would refuse; the families'
specs are the one place such a rule is written.

The weight adapter itself (config.json and tensor names / layouts, both directions) is
`moe_lst.models.llama.state_dict`; its names are importable from here as well: `import_hf(directory)` reads
a Hugging Face directory back into our ModelConfig and state dict (`engine.load_full_state_dict` or
`Transformer.load_state_dict` take it); the recipe's `train.init_from=<directory>` starts a run from it,
checked with `weight_mismatches`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from moe_lst.models import spec as families
from moe_lst.models.llama.state_dict import (
    EXPERT_LAYOUTS,
    check_exportable,
    from_hf,
    hf_config,
    import_hf,
    model_config_from_hf,
    save_hf,
    to_hf,
    weight_keys,
    weight_mismatches,
)
from moe_lst.models.spec import ExportError
from omegaconf import OmegaConf

import zero
from recipes.config import checkpoints

__all__ = ["EXPERT_LAYOUTS", "ExportError", "check_exportable", "consolidate", "export", "from_hf", "hf_config",
           "import_hf", "main", "model_config_from_hf", "save_hf", "to_hf", "weight_keys", "weight_mismatches"]


def consolidate(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Our full state dict from a checkpoint of any layout (dp, ZeRO stage, tp, pp, ep, sp), verified."""
    try:
        return zero.consolidate(zero.open_checkpoint(checkpoint))
    except (zero.CheckpointError, zero.ReshardError) as e:
        raise ExportError(str(e)) from e


def export(source: str | Path, out_dir: str | Path, experts: str = "per_expert",
           max_shard_bytes: int | None = None) -> Path:
    """Export a run directory (its newest checkpoint) or one checkpoint directory to out_dir (MoE experts in
    one of EXPERT_LAYOUTS: per_expert, the published Mixtral layout, or fused, transformers 5's own). The built-in
    families stream it: parameter by parameter from the checkpoint's shards into safetensors shards of at most
    `max_shard_bytes` (default 5 GiB; more than one: with model.safetensors.index.json), so no process holds the
    whole model."""
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
    run_cfg = OmegaConf.load(run_dir / "config.yaml")
    try:
        family = families.get(run_cfg)
    except zero.ConfigError as e:
        raise ExportError(f"{run_dir}: {e}") from None
    family.check_exportable(run_cfg, run_dir)  # before the consolidation, which reads every shard
    if max_shard_bytes is None:
        return family.export(run_dir, run_cfg, checkpoint, out_dir, experts, consolidate)
    if max_shard_bytes <= 0:
        raise ExportError(f"--max-shard-bytes={max_shard_bytes} must be positive")
    return family.export(run_dir, run_cfg, checkpoint, out_dir, experts, consolidate, max_shard_bytes=max_shard_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint directory")
    parser.add_argument("out_dir")
    parser.add_argument("--experts", choices=EXPERT_LAYOUTS, default="per_expert",
                        help="MoE experts per expert (Mixtral's published layout; transformers 4 and 5 load it) "
                             "or fused [E, 2I, H] / [E, H, I] (transformers 5's parameters)")
    parser.add_argument("--max-shard-bytes", type=int, default=None,
                        help="the largest safetensors shard written (default 5 GiB); the model is streamed into "
                             "shards parameter by parameter, never held whole")
    args = parser.parse_args(argv)
    try:
        out = export(args.source, args.out_dir, args.experts, args.max_shard_bytes)
    except (ExportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {', '.join(str(p) for p in sorted(out.glob('*.safetensors')))} and {out / 'config.json'}")


if __name__ == "__main__":
    main()
