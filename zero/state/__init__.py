"""Sharded atomic checkpoints (safetensors and JSON, never pickles), their verification, resharding across layouts
through a narrow engine view, and the conversion of the old pickle format (`python -m zero.state.convert`)."""
