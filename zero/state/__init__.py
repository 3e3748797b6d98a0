"""Sharded atomic checkpoints, their verification, and resharding across layouts, through a narrow engine view."""
