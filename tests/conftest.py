import os

# Ranks of multi-process tests share two cores: one thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
