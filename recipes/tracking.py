"""Run records: one JSON line per step in `<run_dir>/metrics.jsonl` and the same metrics in W&B.

Only rank 0 writes. W&B defaults to offline mode (no network; `wandb sync <run_dir>/wandb/...`
uploads later); `wandb.mode=online` that cannot reach W&B (no key, no network) logs offline instead, said in
one line; `wandb.mode=disabled` turns it off.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value


def read_lines(path: Path) -> list[str]:
    """The non-empty lines of a text file, undecodable bytes replaced (a torn write may end mid-character)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _ranges(steps: list[int]) -> str:
    """1, 2, 3, 7, 8 -> '1-3, 7-8'."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def start_wandb(run_dir: Path, wandb_cfg: dict, config: dict | None, run_id: str | None):
    """The W&B run of `wandb_cfg`'s mode (offline or online) under run_dir. Online that cannot start, for want of a
    W&B key or of a server that answers within wandb.init_timeout_s (a cluster node without internet), starts
    offline instead, saying so in one line with the command that uploads the run later."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")

    def init(mode: str):
        return wandb.init(
            project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"), name=wandb_cfg.get("name"),
            mode=mode, dir=str(run_dir), config=config, id=run_id, resume="allow" if run_id else None,
            settings=wandb.Settings(console="off", x_disable_stats=True,
                                    init_timeout=float(wandb_cfg.get("init_timeout_s", 30))),
        )

    mode = wandb_cfg.get("mode", "offline")
    if mode != "online":
        return init(mode)
    try:
        return init("online")
    except (wandb.errors.Error, OSError) as e:  # no key (UsageError), no server (CommError), a key it refuses
        why = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        if not isinstance(e, wandb.errors.UsageError):
            server = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
            why = f"no answer from {server} within wandb.init_timeout_s={wandb_cfg.get('init_timeout_s', 30)} s: {why}"
    wandb.teardown()  # (its service still holds the run's id after a timed-out start)
    run = init("offline")
    sync_dir = run.settings.sync_dir
    warn(f"warning: wandb.mode=online could not start ({why}): the run logs offline to {sync_dir}; upload it "
         f"later with `wandb sync {sync_dir}`")
    return run


class MetricsLogger:
    """`metrics.jsonl` and W&B for one run. It holds one record per step: on every start, records past the
    step the run starts from (its checkpoint's, 0 without one) are dropped, and said so, since those steps
    are trained again; a line cut short by a kill is dropped with a warning. W&B resumes the run's own id
    (`run_id`, kept in run_dir) rather than starting a second run."""

    def __init__(self, run_dir: Path, enabled: bool, wandb_cfg: dict | None = None, config: dict | None = None,
                 resume_step: int = 0, run_id: str | None = None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.run = None
        if not enabled:
            return
        if self.path.exists():
            self._truncate_after(resume_step)
        if wandb_cfg and wandb_cfg.get("mode", "offline") != "disabled":
            self.run = start_wandb(run_dir, wandb_cfg, config, run_id)

    def _truncate_after(self, step: int) -> None:
        """Keep the records of steps up to `step` (the file then holds one line per step), saying which were
        dropped: those past the checkpoint the run starts from, and any line that is not a whole record."""
        kept, dropped, torn = [], [], []
        for number, line in enumerate(read_lines(self.path), start=1):
            try:
                record = json.loads(line)
                done = int(record["step"])
            except (ValueError, TypeError, KeyError):
                torn.append(number)
                continue
            (kept if done <= step else dropped).append((line, done))
        for number in torn:
            warn(f"warning: {self.path} line {number} is not a whole record (a write cut short): dropped")
        if dropped:
            steps = sorted(done for _, done in dropped)
            since = f"past the checkpoint of step {step}" if step else "no checkpoint holds them"
            print(f"{self.path}: dropped the records of step{'s' if len(steps) > 1 else ''} {_ranges(steps)} "
                  f"({since}; they are trained again)", flush=True)
        if dropped or torn:
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(line + "\n" for line, _ in kept))
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

    def log_media(self, step: int, media: dict[str, Any]) -> None:
        """W&B media (images, tables) at `step`; metrics.jsonl holds scalars only."""
        if self.run is not None and media:
            self.run.log(media, step=step)

    def attach(self, paths: list[Path]) -> None:
        """Copies of `paths` (the existing ones) in the W&B run's files, under `recipe/`, saved with it."""
        if self.run is None:
            return
        folder = Path(self.run.dir) / "recipe"
        folder.mkdir(parents=True, exist_ok=True)
        for path in paths:
            if path.is_file():
                shutil.copyfile(path, folder / path.name)
                self.run.save(str(folder / path.name), base_path=self.run.dir, policy="now")

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = _clean(v)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
