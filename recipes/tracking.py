"""Run records: one JSON line per step in `<run_dir>/metrics.jsonl` and the same metrics in W&B.

Only rank 0 writes. W&B defaults to offline mode (no network; `wandb sync <run_dir>/wandb/...`
uploads later); `wandb.mode=disabled` turns it off.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, wandb_cfg: dict | None = None, config: dict | None = None,
                 resume_step: int = 0) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.run = None
        if not enabled:
            return
        if resume_step > 0 and self.path.exists():
            self._truncate_after(resume_step)
        if wandb_cfg and wandb_cfg.get("mode", "offline") != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"), name=wandb_cfg.get("name"),
                mode=wandb_cfg.get("mode", "offline"), dir=str(run_dir), config=config,
                settings=wandb.Settings(console="off", x_disable_stats=True),
            )

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records of steps past the checkpoint so the file holds one line per step."""
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                         step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = _clean(v)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
