"""The config of a run that a test builds a ``TrainingRun`` for by hand: the shared nodes, no recipe."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.config import CheckpointConfig, LogBackend, LoggingConfig, RunConfig, TrainerConfig


@dataclass
class ManualRunConfig(RunConfig):
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model: Any = None


def run_config(run_dir: Path, checkpoints: Path | None = None, *, trainer: dict[str, Any] | None = None,
               checkpoint: dict[str, Any] | None = None, logging: dict[str, Any] | None = None) -> ManualRunConfig:
    """Recipe ``test`` in ``run_dir``: checkpoints in ``checkpoints`` (default ``run_dir/checkpoints``), no
    best metric, a save decided after every step by steps alone; logs in ``run_dir/logs``, no backend.
    ``trainer``, ``checkpoint``, ``logging``: fields that differ from those."""
    checkpoint_node = CheckpointConfig(dir=str(checkpoints or run_dir / "checkpoints"), every_seconds=0,
                                       sync_every_steps=1, best_metric=None)
    logging_node = LoggingConfig(backend=LogBackend.none, dir=str(run_dir / "logs"))
    return ManualRunConfig(recipe="test", run_dir=str(run_dir), trainer=TrainerConfig(**(trainer or {})),
                           checkpoint=replace(checkpoint_node, **(checkpoint or {})),
                           logging=replace(logging_node, **(logging or {})))
