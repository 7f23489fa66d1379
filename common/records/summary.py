"""``summary.json``: what a finished run reports, and the digest that says two runs ended the same.

``model_digest`` (:func:`state_digest`): the same for two runs with the same config and seed on the same machine,
whether or not one was interrupted and resumed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from common.checkpoint.layout import LATEST
from common.jsonfiles import write_json

SUMMARY_FILE = "summary.json"


def state_digest(state_dict: dict[str, Any]) -> str:
    """sha256 over a state dict: keys in sorted order, each key, dtype, shape and raw bytes."""
    sha = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().to("cpu").contiguous()
        sha.update(key.encode())
        sha.update(str(tensor.dtype).encode())
        sha.update(str(tuple(tensor.shape)).encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def write_summary(
    run_dir: str | Path,
    recipe: str,
    metrics: dict[str, float],
    progress: Any,
    world_size: int,
    model_digest: str,
    **extra: Any,
) -> Path:
    """Write ``run_dir/summary.json`` atomically and return its path.

    - ``progress``: the run's :class:`common.run.training_run.Progress` (steps, epochs, time, resumes).
    - ``extra``: further top-level fields.
    """
    path = Path(run_dir) / SUMMARY_FILE
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
    return write_json(path, summary)


def output_lines(summary: Path, checkpoints: Path, best: Path | None, best_metric: str, log_dir: Path) -> str:
    """The lines a finished run prints so its user finds the summary, checkpoints and logs."""
    lines = [f"  summary:      {summary}", f"  checkpoints:  {checkpoints}  (latest: {checkpoints / LATEST})"]
    if best is not None:
        lines.append(f"  best:         {best}  (by {best_metric})")
    lines.append(f"  tensorboard:  {log_dir}  (tensorboard --logdir {log_dir})")
    return "\n".join(lines)
