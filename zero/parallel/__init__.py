"""Tensor parallelism (styles, plans, vocab-parallel loss) and pipeline parallelism over torch's schedules."""
