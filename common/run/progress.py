"""The counters of a run that survive restarts (:class:`Progress`), saved in every checkpoint."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Progress:
    """Counters that survive restarts: ``asdict`` of it is a checkpoint's ``progress``."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    resumes: int = 0  # how many times this run was resumed from a checkpoint
    train_seconds: float = 0.0  # wall time spent in earlier segments of this run
    finished: bool = False  # the final checkpoint: restarting only rewrites the summary
    extra: dict[str, Any] = field(default_factory=dict)  # recipe-specific counters (e.g. stage)
    # Early stopping: the best checkpoint.best_metric evaluated so far, and evaluations since it.
    best_value: float | None = None
    evals_without_improvement: int = 0
    stopped_early: bool = False
    init_from: str = ""  # the weights the run started from (init_from=), kept when it resumes: for the summary
    # distill.teacher: its source and the digest of its weights when the run began; a resume must find the same
    teacher: dict[str, str] = field(default_factory=dict)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # trainer.nonfinite=rollback: one record each
    pruned: dict[str, Any] | None = None  # a search's pruner stopped this trial: {"step", "epoch", "metric", "value"}
    # train/mfu: the model's FLOPs per sample in a training step, counted on the run's first step (again
    # after a new optimizer: dinov2's stage switch); kept, so a resumed run counts nothing.
    flops_per_sample: float | None = None
    # trainer.out_of_memory=halve: the micro-batch in use at the last save (0: trainer.batch_size), the device and
    # number of ranks it was found on (a resume elsewhere tries trainer.batch_size again), and one record per halving.
    micro_batch_size: int = 0
    micro_batch_found_on: str = ""
    out_of_memory: list[dict[str, Any]] = field(default_factory=list)
    # Where the training images are decoded ("cpu", "gpu"; "" in recipes without the choice): a resume under
    # data.decode=auto decodes as the run began, so that it draws the same augmentations.
    decode: str = ""
    # trainer.eval_every_steps: a stop signal came at an evaluation's step, and the run saved and stopped
    # before evaluating (a stop must be quick); the resumed run evaluates there first.
    evaluation_owed: bool = False

    def describe(self) -> str:
        """``step 12, epoch 3`` and the recipe's own counters (``stage finetune``), not its tables
        (dinov2's probe heads)."""
        return ", ".join([f"step {self.step}", f"epoch {self.epoch}",
                          *(f"{k} {v}" for k, v in self.extra.items() if not isinstance(v, (dict, list)))])

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's counters, in place.

        - In place: the loop holds this object from ``TrainingRun.resume`` on.
        - Counters this version lacks are ignored; those the checkpoint lacks take their defaults.
        """
        known = {name: value for name, value in saved.items() if name in _PROGRESS_FIELDS}
        restored = Progress(**copy.deepcopy(known))
        for progress_field in fields(Progress):
            setattr(self, progress_field.name, getattr(restored, progress_field.name))


_PROGRESS_FIELDS = {progress_field.name for progress_field in fields(Progress)}
