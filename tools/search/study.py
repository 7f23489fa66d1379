"""One search's study: its folder, its Optuna storage and the settings every worker must share.

The study folder holds the journal (Optuna's journal file storage: no database server, only a
filesystem every worker sees), ``study.json``, the plots, ``claims/`` (which worker holds which
trial, see ``tools/search/worker.py``) and one run directory per trial, ``trial_<n>/``. A
database URL (``--storage``) replaces the journal; the folder still holds the rest.

The first worker records the search's settings (recipe, overrides, parameters, objective, pruner)
in the study; a worker started with other settings is refused in one line, since its trials
would not be comparable with the others'.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import UserError
from common.run.search_trial import SearchTrial, make_pruner, open_storage
from tools.search.space import DIRECTIONS, Param, Space

JOURNAL = "journal.log"
CLAIMS = "claims"
SETTINGS_ATTR = "search"  # the study's user attribute that records the settings


@dataclass(frozen=True)
class Settings:
    """What every worker of a study shares; each trial runs ``recipe`` with ``overrides`` and its
    parameters."""

    recipe: str
    overrides: tuple[str, ...]
    params: tuple[Param, ...]
    objective: dict[str, str]  # {"metric", "direction": "max" | "min"}
    pruner: dict[str, Any]

    @classmethod
    def from_space(cls, recipe: str, overrides: list[str], space: Space, objective: dict[str, str]) -> Settings:
        return cls(recipe, tuple(overrides), space.params, objective, space.pruner)

    def record(self) -> dict[str, Any]:
        """The settings as plain JSON data, as the study stores them."""
        return json.loads(json.dumps({
            "recipe": self.recipe, "overrides": list(self.overrides),
            "params": {param.key: param.describe() for param in self.params},
            "objective": self.objective, "pruner": self.pruner}))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Settings:
        params = []
        for key, spec in record["params"].items():
            spec = dict(spec)
            if "values" in spec:
                spec["values"] = tuple(spec["values"])
            params.append(Param(key, **spec))
        return cls(record["recipe"], tuple(record["overrides"]), tuple(params), record["objective"],
                   record["pruner"])


def storage_spec(study_dir: Path, storage: str | None) -> str:
    """The storage a worker and its trials open: ``storage`` (a database URL) or the study's journal."""
    return storage or str(study_dir / JOURNAL)


def repair_journal(path: Path, say: Callable[[str], None]) -> None:
    """Cut an incomplete last line from the journal before anything appends to it. A copy taken in
    the middle of a write (the ISC's Lossy sync) or a node that crashed can leave one; Optuna would
    join it to the next entry and could no longer read the journal."""
    from optuna.storages.journal import JournalFileSymlinkLock

    if not path.is_file() or path.stat().st_size == 0:
        return
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            kept = data.rfind(b"\n") + 1
            with open(path, "rb+") as journal:
                journal.truncate(kept)
            say(f"cut an incomplete last entry ({len(data) - kept} bytes) from {path}")
    finally:
        lock.release()


class Search:
    """An open study and its settings."""

    def __init__(self, study_dir: Path, storage: str, optuna_storage: Any, study: Any, settings: Settings) -> None:
        self.study_dir = study_dir
        self.storage = storage  # a journal file or a database URL, as common.run.search_trial.open_storage takes it
        self.optuna_storage = optuna_storage
        self.study = study
        self.settings = settings

    @property
    def name(self) -> str:
        return self.study.study_name

    @property
    def metric(self) -> str:
        return self.settings.objective["metric"]

    def run_dir(self, number: int) -> Path:
        """Trial ``number``'s run directory: an ordinary run directory of the recipe."""
        return self.study_dir / f"trial_{number}"

    def claim_folder(self, name: str) -> Path:
        """The folder of one claim lock (``tools/search/worker.py``): ``trial_<n>``, or ``queue``."""
        return self.study_dir / CLAIMS / name

    def trial_id(self, number: int) -> int:
        storage = self.optuna_storage
        return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(self.name), number)

    def search_trial(self, number: int) -> SearchTrial:
        """What trial ``number``'s run needs to report to this study (common/run/search_trial.py)."""
        return SearchTrial(self.storage, self.name, number, self.metric, self.settings.pruner)

    def trials(self) -> list[Any]:
        return self.study.get_trials(deepcopy=False)


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def start_search(study_dir: Path, storage: str | None, settings: Settings, say: Callable[[str], None]) -> Search:
    """Create the study, or join it when another worker did; settings that differ from those it
    recorded are a one-line error."""
    import optuna

    _quiet_optuna()
    study_dir.mkdir(parents=True, exist_ok=True)
    spec = storage_spec(study_dir, storage)
    if storage is None:
        repair_journal(Path(spec), say)
    optuna_storage = open_storage(spec)
    study = optuna.create_study(storage=optuna_storage, study_name=study_dir.name,
                                direction=DIRECTIONS[settings.objective["direction"]],
                                pruner=make_pruner(settings.pruner), load_if_exists=True)
    record = settings.record()
    recorded = study.user_attrs.get(SETTINGS_ATTR)
    if recorded is None:
        study.set_user_attr(SETTINGS_ATTR, record)
        recorded = study.user_attrs.get(SETTINGS_ATTR, record)  # a worker that started at the same time may win
    if recorded != record:
        differences = [f"{key}: {recorded.get(key)!r} there, {record[key]!r} here" for key in record
                       if recorded.get(key) != record[key]]
        raise UserError(f"the study in {study_dir} was started with other settings ({'; '.join(differences)}): "
                        f"use the same space and overrides, or another STUDY=")
    return Search(study_dir, spec, optuna_storage, study, settings)


def open_search(study_dir: Path, storage: str | None, recipe: str) -> Search:
    """An existing study, with the settings its first worker recorded (for a report)."""
    import optuna

    _quiet_optuna()
    spec = storage_spec(study_dir, storage)
    if storage is None and not Path(spec).is_file():
        raise UserError(f"there is no study in {study_dir} ({spec} does not exist)")
    optuna_storage = open_storage(spec)
    try:
        study = optuna.load_study(study_name=study_dir.name, storage=optuna_storage)
    except KeyError as error:
        raise UserError(f"there is no study named {study_dir.name} in {spec}") from error
    record = study.user_attrs.get(SETTINGS_ATTR)
    if record is None:
        raise UserError(f"the study in {study_dir} records no search settings: it was not made by tools.search")
    settings = Settings.from_record(record)
    if settings.recipe != recipe:
        raise UserError(f"the study in {study_dir} searches {settings.recipe}, not {recipe}")
    return Search(study_dir, spec, optuna_storage, study, settings)
