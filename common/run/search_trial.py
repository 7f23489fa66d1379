"""A run that is a trial of a hyperparameter search: reports each evaluation, stops when pruned.

- ``python -m tools.search`` starts each trial as an ordinary run with :data:`_TRIAL_VARIABLE`
  naming the study's storage, the trial and the objective; without it nothing changes.
- :meth:`SearchTrial.report` runs after each epoch's evaluation (``TrainingRun.end_epoch``).
- Rank 0 alone talks to the study; the ranks agree on its answer through one broadcast.
- Values are reported by epoch (Optuna's ``step``), which lines up across batch sizes; a resumed
  trial reports the same epochs (Optuna keeps a step's first value).
- Optuna is imported only by a run that is a trial.
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
    """Optuna's storage for ``storage``: a database URL (``sqlite:///...``, ``postgresql://...``),
    or the path of a journal file, which needs no server (only a filesystem every worker sees)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if "://" in storage:
        return optuna.storages.RDBStorage(storage)
    return JournalStorage(JournalFileBackend(str(storage)))


def make_pruner(spec: dict[str, Any]) -> Any:
    """The Optuna pruner ``{"name": <one of PRUNERS>, <its options>...}`` describes; a bad name or
    option is a one-line :class:`UserError`."""
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

    def report(self, metrics: dict[str, float], epoch: int, is_main: bool) -> bool:
        """Report the objective of the evaluation ``metrics`` at the end of epoch ``epoch``; True
        when the study's pruner stops this trial. Collective: every rank calls it, rank 0 decides."""
        if self.metric not in metrics:
            raise UserError(f"the search's objective {self.metric} is not among this evaluation's metrics "
                            f"({', '.join(sorted(metrics))}); set objective.metric in the search space")
        prune = None
        if is_main:
            trial = self._open()
            trial.report(float(metrics[self.metric]), epoch)
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
