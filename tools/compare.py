"""Compare finished runs: one table of what differs between them and how they ended, and their curves.

    python -m tools.compare [RUN ...] [--out DIR] [--metrics GLOB ...] [--plot KEY ...]
    make compare [RUNS="runs/*/*"] [OUT=runs/compare]

A run is a folder with a ``summary.json`` (what a finished run writes). Each RUN is a folder or a
glob; every folder below it is searched, so a Hydra sweep folder (``-m``) contributes one run
per job, and nothing inside a run is searched again (its checkpoints, say).

The table has the recipe, the run's name and folder, every config key whose value differs
between the selected runs (from ``.hydra/config.yaml``), the final metrics, steps, epochs,
training time, resumes and world size, and from the run's newest ``provenance.jsonl`` record (its
last segment) the git commit, whether the checkout had changes, the PyTorch version and the
device (the GPU model, or ``cpu``). It is printed and written as ``runs.csv`` and
``runs.md``; ``curves.png`` plots each run's curves from the ``metrics.jsonl`` its logger wrote
(the training loss and the run's ``checkpoint.best_metric`` unless ``--plot`` names others).
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import glob
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from common.errors import EXIT_USER_ERROR, UserError
from common.records.loggers import METRICS_FILE, read_metrics_file
from common.records.provenance import read_records

DEFAULT_RUNS = "runs/*/*"
DEFAULT_OUT = "runs/compare"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = Path(".hydra") / "config.yaml"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
MULTIRUN_FILE = "multirun.yaml"
# Keys that differ between any two runs by construction, or have a column of their own (the
# trials of a search set their own checkpoint.dir and logging.dir).
NOT_COMPARED = {"run_dir", "name", "checkpoint.dir", "logging.dir"}
SUMMARY_COLUMNS = ("steps", "epochs", "wall_time_s", "resumes", "world_size")
PROVENANCE_COLUMNS = ("git", "dirty", "torch", "device")
COMMIT_SHOWN = 10  # characters of a commit in the printed and markdown tables (runs.csv has all)


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]  # flattened: dotted key -> value as written in the config
    provenance: dict[str, Any] = field(default_factory=dict)  # the newest provenance.jsonl record
    label: str = ""
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.config.get("name", self.path.name))


def find_runs(patterns: Iterable[str]) -> list[Path]:
    """Every run folder at or below the folders the patterns match, in a stable order."""
    found: dict[Path, None] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).exists() else [])
        for match in matches:
            for folder, subfolders, files in os.walk(match):
                if SUMMARY_FILE in files:
                    found[Path(folder).resolve()] = None
                    subfolders.clear()  # a run's checkpoints and logs are not runs
                else:
                    subfolders.sort()
    return list(found)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``; lists stay values."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return flat


def read_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``metrics.jsonl`` as one (step, value) series per metric; a step logged twice keeps its last value."""
    values: dict[str, dict[int, float]] = {}
    for record in read_metrics_file(path):
        step = record.pop("step")
        record.pop("time", None)
        for name, value in record.items():
            values.setdefault(name, {})[step] = value
    return {name: sorted(series.items()) for name, series in values.items()}


def load_run(path: Path) -> Run:
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path / SUMMARY_FILE} is not valid JSON ({error})") from error
    config_path = path / CONFIG_FILE
    config = flatten(OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)) \
        if config_path.is_file() else {}
    records = read_records(path)
    run = Run(path=path, summary=summary, config=config, provenance=records[-1] if records else {})
    metrics_files = sorted(path.rglob(METRICS_FILE))
    if metrics_files:
        run.curves = read_curves(metrics_files[0])
    return run


def sweep_folder(run: Path) -> Path | None:
    """The Hydra sweep (``-m``) folder a job's run folder lies in, if any: it holds ``multirun.yaml``."""
    return next((folder for folder in run.parents if (folder / MULTIRUN_FILE).is_file()), None)


def label_runs(runs: list[Run], keys: list[str]) -> None:
    """Each run's label: its folder relative to the folder all selected runs share; a sweep job's
    folder (named after all its overrides) is shown as the sweep's folder and the job's overrides
    among ``keys``."""
    common = Path(os.path.commonpath([run.path for run in runs])) if len(runs) > 1 else runs[0].path.parent
    for run in runs:
        sweep = sweep_folder(run.path)
        overrides_file = run.path / OVERRIDES_FILE
        if sweep is not None and sweep.is_relative_to(common) and overrides_file.is_file():
            overrides = OmegaConf.to_container(OmegaConf.load(overrides_file))
            own = [item for item in overrides if item.split("=", 1)[0].lstrip("+~") in keys]
            if own:
                run.label = f"{sweep.relative_to(common)}/{','.join(own)}"
                continue
        run.label = str(run.path.relative_to(common))


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose value is not the same in every run (absent counts as a value)."""
    keys = sorted(set().union(*(run.config for run in runs)) - NOT_COMPARED)
    missing = object()
    return [key for key in keys if len({json.dumps(run.config.get(key, missing), default=str) for run in runs}) > 1]


def metric_names(runs: list[Run], patterns: list[str]) -> list[str]:
    names = sorted(set().union(*(run.summary.get("metrics", {}) for run in runs)))
    return [name for name in names if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)]


def provenance_values(record: dict[str, Any]) -> list[Any]:
    """:data:`PROVENANCE_COLUMNS` of a run's newest provenance record ("" where unknown)."""
    if not record:
        return [""] * len(PROVENANCE_COLUMNS)
    device = record.get("gpu") or record.get("device")
    return [record.get("git_commit") or "", "" if record.get("git_dirty") is None else record["git_dirty"],
            record.get("torch") or "", device or ""]


def build_table(runs: list[Run], metric_patterns: list[str]) -> tuple[list[str], list[list[Any]]]:
    """The header and one row per run (plain values; formatting is the writers' job)."""
    keys = differing_keys(runs)
    metrics = metric_names(runs, metric_patterns)
    header = ["recipe", "name", "run", *keys, *metrics, *SUMMARY_COLUMNS, *PROVENANCE_COLUMNS]
    rows = []
    for run in runs:
        config_values = [run.config.get(key, "") for key in keys]
        metric_values = [run.summary.get("metrics", {}).get(name, "") for name in metrics]
        rows.append([run.summary.get("recipe", ""), run.name, run.label, *config_values, *metric_values,
                     *(run.summary.get(column, "") for column in SUMMARY_COLUMNS), *provenance_values(run.provenance)])
    return header, rows


def format_value(value: Any, column: str) -> str:
    if column == "git" and isinstance(value, str):
        return value[:COMMIT_SHOWN]
    if column == "wall_time_s" and isinstance(value, (int, float)):
        minutes, seconds = divmod(round(value), 60)
        return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def as_text(header: list[str], rows: list[list[Any]]) -> str:
    """An aligned table for the terminal (training time as h:mm:ss)."""
    shown = [["train time" if column == "wall_time_s" else column for column in header]]
    shown += [[format_value(value, column) for value, column in zip(row, header)] for row in rows]
    widths = [max(len(line[i]) for line in shown) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in shown]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows([[json.dumps(v) if isinstance(v, list) else v for v in row] for row in rows])


def write_markdown(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    def cells(values: Iterable[str]) -> str:
        return "| " + " | ".join(value.replace("|", "\\|") for value in values) + " |"

    lines = [cells("train time" if column == "wall_time_s" else column for column in header),
             cells("---" for _ in header)]
    lines += [cells(format_value(value, column) for value, column in zip(row, header)) for row in rows]
    path.write_text("\n".join(lines) + "\n")


def plot_keys(runs: list[Run], requested: list[str]) -> list[str]:
    """``--plot`` as given, else the training loss and every run's best-checkpoint metric."""
    if requested:
        return requested
    keys = ["train/loss"]
    for run in runs:
        best = run.config.get("checkpoint.best_metric")
        if isinstance(best, str) and best and best not in keys:
            keys.append(best)
    return keys


def plot_curves(runs: list[Run], keys: list[str], path: Path) -> int:
    """One panel per key, one curve per run that logged it (a run keeps its colour in every panel),
    one legend below the panels; returns the number of curves drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [key for key in keys if any(key in run.curves for run in runs)]
    if not keys:
        return 0
    legend_inches = 0.25 * (len(runs) + 1)
    figure, axes = plt.subplots(len(keys), 1, figsize=(8, 3 * len(keys) + legend_inches), squeeze=False)
    curves, handles = 0, {}
    for ax, key in zip(axes[:, 0], keys):
        for index, run in enumerate(runs):
            if key in run.curves:
                steps, values = zip(*run.curves[key])
                (line,) = ax.plot(steps, values, color=f"C{index % 10}", marker="." if len(steps) < 30 else None)
                handles.setdefault(index, line)
                curves += 1
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    order = sorted(handles)
    figure.legend([handles[i] for i in order], [runs[i].label for i in order], loc="lower center", fontsize="small",
                  frameon=False)
    figure.tight_layout(rect=(0, legend_inches / figure.get_figheight(), 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return curves


def compare(patterns: list[str], out: Path, metric_patterns: list[str], plot: list[str]) -> list[Run]:
    paths = find_runs(patterns)
    if not paths:
        raise UserError(f"no finished run (a folder with {SUMMARY_FILE}) under {' '.join(patterns)}")
    runs = [load_run(path) for path in paths]
    label_runs(runs, differing_keys(runs))
    header, rows = build_table(runs, metric_patterns)
    print(as_text(header, rows))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "runs.csv", header, rows)
    write_markdown(out / "runs.md", header, rows)
    keys = plot_keys(runs, plot)
    curves = plot_curves(runs, keys, out / "curves.png")
    print(f"\n{len(runs)} run(s); table: {out / 'runs.csv'}, {out / 'runs.md'}")
    if curves:
        print(f"curves: {out / 'curves.png'} ({curves} curve(s) of {', '.join(keys)})")
    else:
        print(f"curves: none drawn (no run has {METRICS_FILE} with {', '.join(keys)})")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compare", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=[DEFAULT_RUNS], help=f"run folders or globs (default: "
                        f"{DEFAULT_RUNS!r})")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--metrics", nargs="+", default=["*"], help="globs of the final metrics to show")
    parser.add_argument("--plot", nargs="+", default=[], help="metric names to plot (default: train/loss and "
                        "each run's checkpoint.best_metric)")
    args = parser.parse_args(argv)
    try:
        compare(args.runs, args.out, args.metrics, args.plot)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
