"""train.init_from of a Hugging Face model directory, streamed (moe_lst.models.loading): each of the model's
parameters is described as boxes of the directory's tensors, so each rank reads only the slices it keeps.

A directory holds a parameter under its own name (transformers' names, as the adapter's are), or in the published
layout that transformers converts as it loads (`transformers.conversion_mapping`): renamed modules
(WeightRenaming) and per-expert tensors merged into the fused expert weights (WeightConverter with MergeModulelist
along dim 0, then Concatenate of the gate and up projections). Other conversions are refused in one line naming the
parameter and the operation.
"""

from __future__ import annotations

import re
from pathlib import Path

from moe_lst.models.loading import Checkpoint, CheckpointError, Source, StreamingWeights
from transformers import PreTrainedConfig


def _conversions(model_type: str) -> tuple[list, list]:
    """(renamings as (compiled source, target), converters) transformers applies to `model_type`'s checkpoints."""
    from transformers.conversion_mapping import WeightConverter, WeightRenaming, get_checkpoint_conversion_mapping

    renames, converters = [], []
    for t in get_checkpoint_conversion_mapping(model_type) or []:
        if isinstance(t, WeightRenaming):
            for src, dst in zip(t.source_patterns, t.target_patterns * len(t.source_patterns)):
                renames.append((re.compile(src), dst))
        elif isinstance(t, WeightConverter):
            converters.append(t)
    return renames, converters


def _expert_sources(name: str, shape: tuple[int, ...], converter, found: dict[str, str]) -> list[Source] | None:
    """The per-expert tensors that make the fused expert weight `name` under `converter` (None: it does not)."""
    target = converter.target_patterns[0]
    if not name.endswith(target.lstrip("^").rstrip("$")) or len(converter.target_patterns) != 1:
        return None
    prefix = name[: len(name) - len(target.lstrip("^").rstrip("$"))]
    ops = [type(op).__name__ for op in converter.operations]
    concat = [op for op in converter.operations if type(op).__name__ == "Concatenate"]
    if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]) or \
            converter.operations[0].dim != 0 or (concat and concat[0].dim != 1):
        raise CheckpointError(f"{name}: its checkpoint layout is made by {', '.join(ops)} (transformers' conversion "
                              "for this model type), which streaming loads do not implement; point train.init_from "
                              "at a directory saved with the fused layout (save_pretrained(save_original_format="
                              "False))")
    parts = len(converter.source_patterns)
    if shape[1] % parts:
        return None
    rows = shape[1] // parts
    sources = []
    for e in range(shape[0]):
        for k, pattern in enumerate(converter.source_patterns):
            wanted = prefix + pattern.replace("*", str(e))
            if wanted not in found:
                raise CheckpointError(f"tensor {wanted} (expert {e} of {name}) is missing from the directory; it "
                                      "does not hold the run's model")
            sources.append(Source(found[wanted], (e, k * rows) + (0,) * (len(shape) - 2), (1, rows) + shape[2:],
                                  (None, *range(len(shape) - 1))))
    return sources


def _renamed(checkpoint: Checkpoint, config: PreTrainedConfig) -> dict[str, str]:
    """The name transformers gives each file tensor of `checkpoint` (its checkpoint renamings applied) -> its name in
    the file."""
    renames, _ = _conversions(config.model_type)
    found: dict[str, str] = {}
    for t in checkpoint.where:
        renamed = t
        for pattern, dst in renames:
            renamed = pattern.sub(dst, renamed)
        found[renamed] = t
    return found


def hf_sources(checkpoint: Checkpoint, config: PreTrainedConfig,
               shapes: dict[str, tuple[int, ...]]) -> dict[str, list[Source]]:
    """How each parameter of `shapes` is made of the checkpoint's tensors (checked: Checkpoint.check)."""
    _, converters = _conversions(config.model_type)
    found = _renamed(checkpoint, config)
    sources: dict[str, list[Source]] = {}
    for name, shape in shapes.items():
        if name in found:
            sources[name] = [Source(found[name], (0,) * len(shape), tuple(shape), tuple(range(len(shape))))]
            continue
        for converter in converters:
            made = _expert_sources(name, tuple(shape), converter, found)
            if made is not None:
                sources[name] = made
                break
        else:
            raise CheckpointError(f"{checkpoint.directory}: tensor {name} is missing (neither under its name nor "
                                  "in a layout transformers converts); the directory does not hold the run's model")
    checkpoint.check(sources)
    return sources


def open_streaming(directory: str | Path, config: PreTrainedConfig) -> StreamingWeights:
    """train.init_from's weights of a directory of `config`'s model, not yet read: its headers read and checked
    against the model's parameters (CheckpointError in one line naming the tensor and file)."""
    from moe_lst.models.hf.state_dict import parameter_shapes

    checkpoint = Checkpoint.open(directory)
    meta = parameter_shapes(config)
    parameters = _parameter_names(config)
    shapes = {n: s for n, s in meta.items() if n in parameters}
    buffers = {n: s for n, s in meta.items() if n not in parameters}
    return StreamingWeights(checkpoint, hf_sources(checkpoint, config, shapes),
                            buffer_sources(checkpoint, config, buffers))


def buffer_sources(checkpoint: Checkpoint, config: PreTrainedConfig,
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, list[Source]]:
    """The file tensors of the model's persistent buffers (`shapes`: DeepSeek-V3's routing correction bias, ...),
    under their names or transformers' renamings, checked like the parameters' (shape, floating dtype). A buffer
    the directory does not hold keeps the value the build gave it, as transformers' from_pretrained does."""
    found = _renamed(checkpoint, config)
    sources = {name: [Source(found[name], (0,) * len(shape), tuple(shape), tuple(range(len(shape))))]
               for name, shape in shapes.items() if name in found}
    checkpoint.check(sources)
    return sources


def _parameter_names(config: PreTrainedConfig) -> set[str]:
    """The names of the model's parameters (a tied head counted under the embedding's name)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    return {n for n, _ in model.named_parameters()}


def _literal(pattern: str, model_type: str) -> str:
    """A renaming pattern as the plain text it matches (transformers' are plain names with dots)."""
    text = pattern.lstrip("^").rstrip("$")
    if re.escape(text).replace("\\.", ".") != text:
        raise NotImplementedError(f"model_type={model_type}: the checkpoint renaming {pattern!r} is a regular "
                                  "expression, which the streaming export does not invert; export with experts=fused")
    return text


def export_parts(name: str, tensor, config: PreTrainedConfig, original_format: bool):
    """The (file name, tensor) pairs parameter `name` (whole, Hugging Face's name) is written as: itself, or with
    `original_format` the per-expert tensors of a fused expert weight, under the checkpoint names transformers'
    conversion mapping gives them (save_pretrained(save_original_format=True)'s layout)."""
    if not original_format:
        return [(name, tensor)]
    renames, converters = _conversions(config.model_type)
    for converter in converters:
        target = converter.target_patterns[0].lstrip("^").rstrip("$")
        if len(converter.target_patterns) != 1 or not name.endswith(target):
            continue
        ops = [type(op).__name__ for op in converter.operations]
        if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            raise NotImplementedError(f"{name}: its published layout is made by {', '.join(ops)}, which the "
                                      "streaming export does not invert; export with experts=fused")
        prefix, parts = name[: len(name) - len(target)], len(converter.source_patterns)
        rows = tensor.shape[1] // parts
        out = []
        for e in range(tensor.shape[0]):
            for k, pattern in enumerate(converter.source_patterns):
                file_name = prefix + pattern.replace("*", str(e))
                for src, dst in reversed(renames):
                    file_name = file_name.replace(dst, _literal(src.pattern, config.model_type))
                out.append((file_name, tensor[e, k * rows: (k + 1) * rows] if parts > 1 else tensor[e]))
        return out
    for src, dst in reversed(renames):
        name = name.replace(dst, _literal(src.pattern, config.model_type))
    return [(name, tensor)]
