"""A hyperparameter search's trial: each evaluation reported to the study, the run stopped when its pruner says.

- ``python -m tools.search`` starts each trial as an ordinary run, with :data:`_TRIAL_VARIABLE` naming
  the storage, the trial and the objective; without the variable nothing changes.
- The run contract (``common/run/training_run.py``) calls :meth:`SearchTrial.report` after each
  evaluation before the finish, so every recipe can be pruned without code of its own.
- Rank 0 alone talks to the study (a journal file or a database); one broadcast shares its answer.
- Reported by epoch (Optuna's ``step``): epochs line up across trials whatever their batch size; a
  resumed trial reports the same epochs again, and Optuna ignores the repeats. With
  ``trainer.eval_every_steps`` by optimizer step instead: several evaluations in one epoch each count.
- Optuna is imported only by a trial, so other runs start no slower.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from common.errors import UserError
from common.pytorch import distributed

_TRIAL_VARIABLE = "RECIPES_SEARCH_TRIAL"
# Optuna's pruners by the names a search space uses; "none" never prunes.
PRUNERS = {
    "median": "MedianPruner",
    "halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
    "none": "NopPruner",
}


def open_storage(storage: str) -> Any:
    """Optuna's storage for ``storage``: a database URL, or a journal file's path (no server, a shared filesystem)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if "://" in storage:
        return optuna.storages.RDBStorage(storage)
    return JournalStorage(JournalFileBackend(str(storage)))


def make_pruner(spec: dict[str, Any]) -> Any:
    """The Optuna pruner ``{"name": <one of PRUNERS>, <its options>...}`` describes.

    Raises a one-line :class:`UserError` for a bad name or option."""
    import optuna

    options = dict(spec)
    name = options.pop("name", None)
    if name not in PRUNERS:
        raise UserError(f"pruner {name!r} is not one of {', '.join(PRUNERS)}")
    pruner_class = getattr(optuna.pruners, PRUNERS[name])
    known = [option for option in inspect.signature(pruner_class).parameters if option != "self"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        accepted = ", ".join(known) or "none"
        raise UserError(f"pruner {name} has no option {', '.join(unknown)} (its options: {accepted})")
    try:
        return pruner_class(**options)
    except (TypeError, ValueError) as error:
        raise UserError(f"pruner {name}: {error}") from error


@dataclass
class SearchTrial:
    """Which trial of which study this run is, and what it reports (see the module)."""

    storage: str  # a journal file or a database URL (open_storage)
    study: str
    number: int
    metric: str  # the objective, a metric the evaluation returns
    pruner: dict[str, Any]  # make_pruner's spec
    _trial: Any = field(default=None, init=False, repr=False, compare=False)

    def to_environment(self) -> dict[str, str]:
        """The variable a search worker sets for its trial's run."""
        fields = {name: value for name, value in asdict(self).items() if not name.startswith("_")}
        return {_TRIAL_VARIABLE: json.dumps(fields)}

    @classmethod
    def from_environment(cls) -> SearchTrial | None:
        """The trial this process runs, or None when no search started it."""
        text = os.environ.get(_TRIAL_VARIABLE)
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as error:
            raise UserError(f"{_TRIAL_VARIABLE} is not what tools.search writes: {error}") from error

    def report(self, metrics: dict[str, float], at: int, is_main: bool) -> bool:
        """Report the objective among ``metrics`` at ``at`` (Optuna's step: the epoch, or the optimizer
        step under ``trainer.eval_every_steps``); True when the pruner stops this trial.

        Collective: every rank calls it, rank 0 decides. ``UserError`` when the objective is missing."""
        if self.metric not in metrics:
            raise UserError(f"the search's objective {self.metric} is not among this evaluation's metrics "
                            f"({', '.join(sorted(metrics))}); set objective.metric in the search space")
        prune = None
        if is_main:
            trial = self._open()
            trial.report(float(metrics[self.metric]), at)
            prune = trial.should_prune()
        return bool(distributed.broadcast_object(prune))

    def _open(self) -> Any:
        """The Optuna trial, opened once (rank 0 only)."""
        if self._trial is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            storage = open_storage(self.storage)
            study = optuna.load_study(study_name=self.study, storage=storage, pruner=make_pruner(self.pruner))
            study_id = storage.get_study_id_from_name(self.study)
            self._trial = optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id,
                                                                                                   self.number))
        return self._trial
