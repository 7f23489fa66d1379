"""``summary.json``: what a finished run reports (the run contract's last step)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from common.checkpoint import LATEST, best_checkpoint, committed_checkpoints
from common.train_state import Progress


def write_summary(
    run_dir: str | Path,
    recipe: str,
    metrics: dict[str, float],
    progress: Progress,
    world_size: int,
    model_digest: str,
    **extra: Any,
) -> Path:
    """Write ``run_dir/summary.json`` atomically and return its path."""
    path = Path(run_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "recipe": recipe,
        "metrics": metrics,
        "steps": progress.step,
        "epochs": progress.epoch,
        "wall_time_s": round(progress.train_seconds, 3),
        "resumes": progress.resumes,
        "world_size": world_size,
        "model_digest": model_digest,
        **extra,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def where_outputs_are(cfg: Any, summary: Path) -> str:
    """The lines a finished run prints so its user finds the summary, checkpoints and logs."""
    checkpoints = Path(cfg.checkpoint.dir)
    lines = [f"  summary:      {summary}", f"  checkpoints:  {checkpoints}  (latest: {checkpoints / LATEST})"]
    if cfg.checkpoint.keep_best:
        best = best_checkpoint(committed_checkpoints(checkpoints), cfg.checkpoint.best_metric, cfg.checkpoint.best_mode)
        if best is not None:
            lines.append(f"  best:         {best.path}  (by {cfg.checkpoint.best_metric})")
    lines.append(f"  tensorboard:  {Path(cfg.logging.dir)}  (tensorboard --logdir {cfg.logging.dir})")
    return "\n".join(lines)
