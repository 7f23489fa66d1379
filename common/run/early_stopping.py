"""``trainer.early_stopping_patience``: training ends after that many evaluations without a better
``checkpoint.best_metric``."""

from __future__ import annotations

from typing import Any

from common.checkpoint.layout import improves
from common.errors import UserError
from common.run.progress import Progress


class EarlyStopping:
    """Counts evaluations without improvement; its state lives in :class:`Progress` (checkpointed).

    - ``patience``: 0 turns it off; ``metric``, ``mode``: ``checkpoint.best_metric`` and ``best_mode``.
    - The same on every rank: it reads reduced metrics.
    """

    def __init__(self, patience: int, metric: str, mode: str) -> None:
        self.patience, self.metric, self.mode = patience, metric, mode

    def count(self, progress: Progress, metrics: dict[str, float], may_stop: bool) -> str | None:
        """Count this evaluation (NaN never improves); when ``may_stop`` and the patience runs out,
        mark ``progress.stopped_early`` and return the line that says so.

        - Raises :class:`UserError` when the evaluation does not report the metric.
        """
        if self.patience <= 0:
            return None
        name, mode = self.metric, self.mode
        if name not in metrics:
            raise UserError(f"trainer.early_stopping_patience watches checkpoint.best_metric={name}, which the "
                            f"evaluation does not report; it reports {', '.join(sorted(metrics))}")
        value = metrics[name]
        if improves(value, progress.best_value, mode):
            progress.best_value, progress.evals_without_improvement = value, 0
        else:
            progress.evals_without_improvement += 1
        if not may_stop or progress.evals_without_improvement < self.patience:
            return None
        progress.stopped_early = True
        best_text = "no value" if progress.best_value is None else f"{progress.best_value:.4g}"
        return (f"early stopping: {name} has not improved on {best_text} for "
                f"{progress.evals_without_improvement} evaluation(s); stopping at step {progress.step} "
                f"({progress.epoch} epoch(s) done)")

    def summary(self, progress: Progress) -> dict[str, Any]:
        """The summary's ``early_stopping`` entry."""
        stopped = progress.stopped_early
        return {"patience": self.patience, "metric": self.metric, "mode": self.mode, "best_value": progress.best_value,
                "evaluations_without_improvement": progress.evals_without_improvement, "stopped_early": stopped,
                "stopped_at_epoch": progress.epoch if stopped else None,
                "stopped_at_step": progress.step if stopped else None}
