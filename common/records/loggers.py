"""Rank-0 output: console lines, a progress bar, ``metrics.jsonl``, and TensorBoard or W&B.

- Every logged value also goes to ``metrics.jsonl`` (one JSON object per line, with the step), which
  ``make compare`` and plain scripts read without TensorBoard.
- W&B is imported only when chosen and runs offline by default, so a node without internet never
  blocks on it; its run id comes from the run directory, so a restarted job continues its own run.
- The progress bar is drawn only on a terminal; in a SLURM or ISC log each report is a plain line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common import jsonfiles
from common.config import plain_config

METRICS_FILE = "metrics.jsonl"
_BACKENDS = ("tensorboard", "wandb", "none")


def read_metrics_file(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line cut short by a kill is left out."""
    records = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsFile:
    """``metrics.jsonl``: ``{"step": s, "time": unix seconds, "<name>": value, ...}`` per line.

    Opening it drops lines after ``resume_step`` (written by a killed segment after its last checkpoint), as
    TensorBoard's ``purge_step`` does, so each step is logged once."""

    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            kept = [record for record in read_metrics_file(path) if record["step"] <= resume_step]
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(jsonfiles.dumps(record) + "\n" for record in kept))
            os.replace(tmp, path)
        self._handle = open(path, "a")

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        self._handle.write(jsonfiles.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def wandb_run_id(run_dir: str | Path) -> str:
    """The W&B run id of a run directory, the same for every restart of the run.

    Its last part and a hash of its absolute path (W&B ids take letters, digits, ``-`` and ``_``, at most 64).
    """
    path = os.path.abspath(run_dir)
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(path).name)[:40].strip("-") or "run"
    return f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


class ProgressLines:
    """The progress bar where stdout is not a terminal: one plain line per report, readable in a log file."""

    def __init__(self, total: int, initial: int, description: str) -> None:
        self.total = total
        self.n = initial
        self.description = description

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, values: Mapping[str, Any]) -> None:
        shown = ", ".join(f"{name} {value}" for name, value in values.items())
        print(f"{self.description}: step {self.n}/{self.total}, {shown}", file=sys.stdout, flush=True)

    def close(self) -> None:
        pass


class RunLogger:
    """Where a run's metrics and console lines go; everything but rank 0 (``is_main``) stays silent.

    - ``backend``: ``tensorboard``, ``wandb`` or ``none`` (``ValueError`` otherwise); ``metrics.jsonl``
      is written in ``log_dir`` whatever it is.
    - ``resume_step``: the checkpoint's step; later records from a killed segment are dropped.
    """

    def __init__(
        self,
        backend: str,
        log_dir: str | Path,
        is_main: bool,
        run_name: str,
        config: Mapping[str, Any] | None = None,
        resume_step: int = 0,
        wandb_project: str = "training-recipes",
        wandb_mode: str = "offline",
        progress_bar: bool = True,
        wandb_id: str | None = None,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"logging backend must be tensorboard, wandb or none, not {backend!r}")
        self.is_main = is_main
        self.progress_bar = progress_bar and is_main
        self.backend = backend if is_main else "none"
        self._writer: Any = None
        self._wandb: Any = None
        self.log_dir = Path(log_dir)
        self._metrics_file = MetricsFile(self.log_dir / METRICS_FILE, resume_step) if is_main else None
        if self.backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a killed segment logged after its last checkpoint.
            self._writer = SummaryWriter(str(self.log_dir), purge_step=resume_step or None)
        elif self.backend == "wandb":
            import wandb

            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name,
                id=wandb_id or wandb_run_id(self.log_dir),
                resume="allow",
                dir=str(self.log_dir),
                mode=wandb_mode,
                config=dict(config or {}),
            )

    @classmethod
    def from_config(cls, cfg: Any, is_main: bool, resume_step: int = 0) -> RunLogger:
        """From a recipe's whole config (its ``logging`` node, name, recipe and run directory)."""
        run_name = f"{cfg.recipe}/{cfg.name}"
        if Path(cfg.run_dir).name != cfg.name:  # a sweep's job: its directory is named by its overrides
            run_name += f"/{Path(cfg.run_dir).name}"
        return cls(
            cfg.logging.backend,
            cfg.logging.dir,
            is_main,
            run_name=run_name,
            config=plain_config(cfg),
            resume_step=resume_step,
            wandb_project=cfg.logging.wandb_project,
            wandb_mode=cfg.logging.wandb_mode,
            progress_bar=cfg.logging.progress_bar,
            wandb_id=wandb_run_id(cfg.run_dir),
        )

    def console(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._metrics_file is not None:
            self._metrics_file.write(metrics, step)
        if self._writer is not None:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, step)
        elif self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def progress(self, total: int, initial: int, description: str) -> tqdm | ProgressLines:
        """A progress bar on rank 0 (silent elsewhere or when disabled); plain lines when stdout is no terminal."""
        if self.progress_bar and not sys.stdout.isatty():
            return ProgressLines(total, initial, description)
        return tqdm(
            total=total,
            initial=initial,
            desc=description,
            disable=not self.progress_bar,
            dynamic_ncols=True,
            leave=False,
            file=sys.stderr,
        )

    def close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
