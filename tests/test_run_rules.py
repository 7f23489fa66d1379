"""The rules that follow a run's evaluations, driven through the run contract with made-up metrics
that rise, fall, plateau and are NaN: early stopping's patience (which restarts after every
improvement), the best checkpoint (``_force`` for every new best, not only the first value; the
one ``summary.json`` names), retention (the ``keep_last`` newest steps and the best), and the
evaluation cadence. One rule decides "better" for all of them (``common.checkpoint.layout.improves``):
strictly better in the metric's direction, and never NaN.

Each test trains a tiny run of one step per epoch through :class:`~common.run.training_run.TrainingRun` as a
recipe's loop does (``steps``, ``step_done``, ``end_epoch``, ``finish``), evaluating to the next
made-up value each time the contract asks for an evaluation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from common.checkpoint.layout import committed_checkpoints
from common.data.sampler import ResumableDistributedSampler
from common.pytorch.distributed import DistInfo
from common.pytorch.metrics import SumMetrics
from common.run.steps import StepPlan
from common.run.training_run import TrainingRun
from tests.run_config import run_config

NAN = math.nan
METRIC = "eval/top1"


class Trained:
    """What a made-up run did: the epochs after which it evaluated, its summary, its checkpoints."""

    def __init__(self, folder: Path, evaluated_after: list[int]) -> None:
        self.summary = json.loads((folder / "summary.json").read_text())
        self.evaluated_after = evaluated_after
        self.checkpoints = committed_checkpoints(folder / "checkpoints")

    @property
    def epochs(self) -> int:
        return self.summary["epochs"]

    @property
    def forced_steps(self) -> list[int]:
        return [found.step for found in self.checkpoints if found.force]

    @property
    def kept_steps(self) -> list[int]:
        return [found.step for found in self.checkpoints]

    @property
    def best_step(self) -> int | None:
        best = self.summary["best_checkpoint"]
        return next((found.step for found in self.checkpoints if found.path.name == best), None)


def train(folder: Path, values: list[float], *, patience: int = 0, mode: str = "max", keep_last: int = 100,
          eval_every: int = 1, epochs: int | None = None) -> Trained:
    """One step per epoch for ``epochs`` epochs (``len(values)`` by default; fewer if it stops early),
    the evaluations giving ``values`` in turn (the finish evaluates too, also after stopping early)."""
    model = torch.nn.Linear(1, 1)
    sampler = ResumableDistributedSampler(2, seed=0)
    plan = StepPlan(sampler, micro_batch=2, accumulate=1, world_size=1, epochs=epochs or len(values))
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="test")
    cfg = run_config(folder, trainer={"eval_every_epochs": eval_every, "early_stopping_patience": patience},
                     checkpoint={"keep_last": keep_last, "best_metric": METRIC, "best_mode": mode})
    run = TrainingRun(cfg, info, plan, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                      sampler=sampler, train_sums=SumMetrics(torch.device("cpu")))
    remaining, evaluated_after = iter(values), []

    def evaluate() -> dict[str, float]:
        evaluated_after.append(run.progress.epoch)
        return {METRIC: next(remaining)}

    run.resume()
    while not run.training_done():
        for group in run.steps(sampler.index_batches(plan.micro_batch)):
            for _ in group:
                pass
            run.step_done(group.samples, loss=torch.zeros(()))
        run.end_epoch(evaluate)
    run.finish(evaluate)
    return Trained(folder, evaluated_after)


# ---- early stopping: trainer.early_stopping_patience ------------------------------------------------


def test_early_stopping_waits_for_patience_evaluations_in_a_row_without_a_better_value(tmp_path: Path) -> None:
    run = train(tmp_path, [0.1, 0.3, 0.3, 0.2, 0.9, 0.9, 0.9], patience=2)
    assert run.epochs == 4, "0.3 then two evaluations no better (a plateau, a fall): it stops after epoch 4"
    assert run.summary["early_stopping"]["stopped_at_epoch"] == 4
    assert run.summary["early_stopping"]["best_value"] == 0.3


def test_the_patience_count_restarts_after_every_improvement(tmp_path: Path) -> None:
    run = train(tmp_path, [0.1, 0.1, 0.2, 0.2, 0.1, 0.9, 0.9], patience=2)
    assert run.epochs == 5, "1 without improvement, then 0.2 restarts the count: 2 more are needed, epoch 5"
    assert run.summary["early_stopping"]["evaluations_without_improvement"] == 2


def test_falling_is_improving_when_the_metric_is_minimised(tmp_path: Path) -> None:
    run = train(tmp_path, [0.5, 0.4, 0.3, 0.45, 0.6, 0.1], patience=2, mode="min")
    assert run.epochs == 5 and run.summary["early_stopping"]["best_value"] == 0.3


def test_a_nan_evaluation_never_improves_not_even_the_first(tmp_path: Path) -> None:
    run = train(tmp_path, [NAN, NAN, 0.2, 0.1, 0.1, 0.3], patience=3)
    assert run.epochs == 6 and not run.summary["early_stopping"]["stopped_early"], \
        "two NaN count as two evaluations without improvement; 0.2 is the first best and restarts the count"
    stopped = train(tmp_path / "nan_after_best", [0.3, NAN, NAN, 0.9], patience=2)
    assert stopped.epochs == 3 and stopped.summary["early_stopping"]["best_value"] == 0.3


def test_no_patience_never_stops(tmp_path: Path) -> None:
    run = train(tmp_path, [0.5, 0.4, 0.3, 0.2], patience=0)
    assert run.epochs == 4 and "early_stopping" not in run.summary


# ---- the best checkpoint and retention: checkpoint.best_metric, best_mode, keep_last ------------------


@pytest.mark.parametrize(("mode", "values", "forced", "best"), [
    ("max", [0.2, 0.5, 0.3, NAN, 0.6, 0.4], [1, 2, 5], 5),
    ("min", [0.5, 0.2, 0.3, NAN, 0.1, 0.4], [1, 2, 5], 5),
    ("max", [0.3, 0.3, 0.1, 0.3], [1], 1),  # a plateau is not better: the first of equals stays the best
    ("max", [NAN, 0.2, NAN, 0.1], [2], 2),  # NaN first is not a best to beat
], ids=["rising", "falling-min", "plateau", "nan"])
def test_every_new_best_is_force_and_the_summary_names_the_last_of_them(tmp_path: Path, mode: str,
                                                                        values: list[float], forced: list[int],
                                                                        best: int) -> None:
    run = train(tmp_path, values, mode=mode)
    assert run.forced_steps == forced
    assert run.best_step == best


def test_retention_keeps_the_newest_steps_and_the_best_as_it_moves(tmp_path: Path) -> None:
    run = train(tmp_path, [0.2, 0.5, 0.3, NAN, 0.6, 0.4, 0.1], keep_last=2)
    assert run.kept_steps == [5, 6, 7], "the best (step 5) and the 2 newest; earlier bests are pruned"
    assert run.best_step == 5
    older_best = train(tmp_path / "older_best", [0.2, 0.9, 0.3, NAN, 0.6, 0.4, 0.1], keep_last=3)
    assert older_best.kept_steps == [2, 5, 6, 7], "the best (step 2), older than the 3 newest, stays"


# ---- the evaluation cadence: trainer.eval_every_epochs -----------------------------------------------


def test_evaluations_come_every_eval_every_epochs_and_at_the_end(tmp_path: Path) -> None:
    run = train(tmp_path, [0.1, 0.2, 0.3], eval_every=2, epochs=5)
    assert run.evaluated_after == [2, 4, 5]
    assert [found.step for found in run.checkpoints if found.metrics] == [2, 4, 5]
