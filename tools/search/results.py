"""What a search found: ``study.json``, a table, and the plots (optimisation history, parameter
importances) as PNG files.

``<study>/study.json`` (strict JSON, ``common.jsonfiles``) holds the best trial (its number, value,
parameters and run directory) and every trial's state, value, parameters and run directory, the
reason a failed trial gives, the epoch and step a pruned one stopped at, and the values reported
at each epoch. Workers rewrite it after every trial they finish; ``REPORT=1`` rewrites it at any time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from common.jsonfiles import write_json
from common.run_lock import LOCK_FILE, Holder
from tools.search.study import Search

STUDY_FILE = "study.json"
HISTORY_PLOT = "optimization_history.png"
IMPORTANCE_PLOT = "param_importances.png"


def _when(moment: Any) -> str | None:
    return moment.isoformat(timespec="seconds") if moment is not None else None


def trial_record(search: Search, trial: Any) -> dict[str, Any]:
    """One trial as ``study.json`` lists it."""
    record = {"trial": trial.number, "state": trial.state.name.lower(), "value": trial.value,
              "params": trial.params, "run_dir": str(search.run_dir(trial.number)),
              "intermediate_values": {str(step): value for step, value in sorted(trial.intermediate_values.items())},
              "started": _when(trial.datetime_start), "finished": _when(trial.datetime_complete)}
    for key in ("reason", "pruned_at_epoch", "pruned_at_step"):
        if key in trial.user_attrs:
            record[key] = trial.user_attrs[key]
    return record


def best_record(search: Search) -> dict[str, Any] | None:
    """The study's best trial (Optuna's ``best_trial``: the best value among complete trials, the
    first of equals), or None before any trial completes."""
    try:
        best = search.study.best_trial
    except ValueError:
        return None
    return {"trial": best.number, "value": best.value, "params": best.params,
            "run_dir": str(search.run_dir(best.number))}


def write_study_json(search: Search) -> Path:
    trials = search.trials()
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    return write_json(search.study_dir / STUDY_FILE, {
        "study": search.name, "recipe": search.settings.recipe, "objective": search.settings.objective,
        "overrides": list(search.settings.overrides), "pruner": search.settings.pruner, "counts": counts,
        "best": best_record(search), "trials": [trial_record(search, trial) for trial in trials]})


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def running_note(search: Search, number: int) -> str:
    """Who holds a running trial's claim, or that none does: an interrupted trial, which the next
    worker to start resumes."""
    try:
        holder = Holder(**json.loads((search.claim_folder(f"trial_{number}") / LOCK_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return "interrupted: the next worker resumes it"
    return f"held by {holder.describe()}"


def table(search: Search) -> str:
    """Every trial in a row: state, objective, parameters, run directory, and what happened."""
    best = best_record(search)
    keys = [param.key for param in search.settings.params]
    header = ["trial", "state", search.metric, *keys, "run dir", "note"]
    rows = []
    for trial in search.trials():
        attrs = trial.user_attrs
        note = attrs.get("reason", "")
        if "pruned_at_step" in attrs:
            note = f"pruned after epoch {attrs['pruned_at_epoch']} (step {attrs['pruned_at_step']})"
        if trial.state == TrialState.RUNNING:
            note = running_note(search, trial.number)
        if best is not None and trial.number == best["trial"]:
            note = "best"
        rows.append([str(trial.number), trial.state.name.lower(), _cell(trial.value),
                     *(_cell(trial.params.get(key)) for key in keys), str(search.run_dir(trial.number)), note])
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header) - 1)]
    lines = ["  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]).rstrip()
             for row in [header, *rows]]
    direction = search.settings.objective["direction"]
    return "\n".join([f"study {search.name} in {search.study_dir}: {search.settings.recipe}, "
                      f"{direction} {search.metric}", *lines])


def write_plots(search: Search) -> list[str]:
    """The optimisation history and parameter importances as PNG files in the study folder; a line
    for each, saying where it is or why it could not be drawn yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances

    complete = [trial for trial in search.trials() if trial.state == TrialState.COMPLETE]
    lines = []
    for name, plot, needed in ((HISTORY_PLOT, plot_optimization_history, 1),
                               (IMPORTANCE_PLOT, plot_param_importances, 2)):
        path = search.study_dir / name
        if len(complete) < needed:
            lines.append(f"{name}: not drawn yet (needs {needed} complete trial{'s' if needed > 1 else ''})")
            continue
        axes = plot(search.study)
        figure = axes.figure
        figure.tight_layout()
        partial = path.with_name(f".{name}.{os.getpid()}.png")
        figure.savefig(partial, dpi=120)
        plt.close(figure)
        os.replace(partial, path)
        lines.append(f"{name}: {path}")
    return lines
