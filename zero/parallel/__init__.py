"""Tensor parallelism (styles, vocab-parallel loss) and pipeline parallelism over torch's schedules."""
