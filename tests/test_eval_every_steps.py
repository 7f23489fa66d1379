"""``trainer.eval_every_steps`` (``common/run/cadence.py``, ``common/run/training_run.py``): an evaluation,
and the checkpoint that follows it, every N optimizer steps, mid-epoch included, in every recipe
without code of its own; a run stopped or killed between two evaluations resumes, evaluates at
the same steps and ends as an uninterrupted run does.

The runs are probes (``tests/recipe_probe.py``): a recipe's real ``train()`` in this process, stopped
after a chosen step as a kill would stop it (nothing saved after the last checkpoint)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from common.checkpoint.layout import committed_checkpoints
from common.errors import Preempted
from common.run.cadence import CheckpointCadence
from common.run.search_trial import SearchTrial
from common.run.steps import EpochBatches
from tests.recipe_probe import Configs, Probe, probe, tiny_settings
from tests.resume import evaluations as logged_evaluations
from tools.compare import load_run

FASHION_STEPS_PER_EPOCH = 256 // 16  # the tiny data's 256 images in micro-batches of 16
# Evaluations at steps 8 (mid-epoch), 16 (an epoch's last step), 24 (mid-epoch) and 32 (the finish);
# checkpoints only where an evaluation or an epoch's end asks for one.
FASHION = ["trainer.epochs=2", "trainer.eval_every_steps=8", "checkpoint.keep_last=10"]


def evaluations(seen: Probe) -> list[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` of each evaluation the probed run logged, in order."""
    return logged_evaluations(Path(seen.cfg.run_dir))


def evaluated_checkpoints(cfg: Any) -> list[int]:
    """The steps of the run's committed checkpoints that hold an evaluation's metrics."""
    return [found.step for found in committed_checkpoints(Path(cfg.checkpoint.dir)) if found.metrics]


class StopSignalAt:
    """SIGUSR1 as the run's stop-signal handler records it, during optimizer step ``step``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, step: int) -> None:
        original = CheckpointCadence.after_step

        def after_step(cadence: CheckpointCadence, done: int, *args: Any) -> Any:
            if done == step:
                cadence.stop_signals._handle(signal.SIGUSR1, None)
            return original(cadence, done, *args)

        monkeypatch.setattr(CheckpointCadence, "after_step", after_step)


class ReportedToSearch:
    """A search's trial that records what the run reports to it and never prunes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.at: list[int] = []
        monkeypatch.setattr(SearchTrial, "from_environment", classmethod(lambda cls: self))

    def report(self, metrics: dict[str, float], at: int, is_main: bool) -> bool:
        self.at.append(at)
        return False


def test_a_run_killed_and_stopped_between_evaluations_evaluates_at_the_same_steps_and_ends_the_same(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    configs = Configs("fashion_mnist", tmp_path, [*tiny_settings("fashion_mnist", tmp_path_factory), *FASHION])
    search = ReportedToSearch(monkeypatch)
    uninterrupted = probe("fashion_mnist", configs(), steps=None)
    assert uninterrupted.error is None, uninterrupted.error
    assert [step for step, _ in evaluations(uninterrupted)] == [8, 16, 24, 32]
    for epoch in (0, 1):  # the evaluations mid-epoch left each epoch's samples as they were: each trained once
        trained = [i for e, batch in zip(uninterrupted.epochs, uninterrupted.samples()) if e == epoch for i in batch]
        assert sorted(trained) == list(range(256)), epoch
    assert evaluated_checkpoints(uninterrupted.cfg) == [8, 16, 24, 32], "each evaluation is followed by its checkpoint"
    assert search.at == [8, 16, 24], "the search hears every evaluation before the finish, by step"
    curve = load_run(Path(uninterrupted.cfg.run_dir)).curves["eval/top1"]  # what make compare plots
    assert [step for step, _ in curve] == [8, 16, 24, 32]
    assert uninterrupted.summary["metrics"]["eval/top1"] == curve[-1][1]
    best = uninterrupted.summary["best_checkpoint"]
    assert best.endswith("_force") and best in {found.path.name for found in
                                                committed_checkpoints(Path(uninterrupted.cfg.checkpoint.dir))}

    interrupted = configs()
    probe("fashion_mnist", interrupted, steps=13)  # killed between the evaluations of steps 8 and 16
    assert evaluated_checkpoints(interrupted) == [8]
    with monkeypatch.context() as signalled:
        StopSignalAt(signalled, 24)  # during the step an evaluation follows: saved and stopped at once
        with pytest.raises(Preempted, match="checkpoint saved at step 24"):
            probe("fashion_mnist", interrupted, steps=None)
    assert evaluated_checkpoints(interrupted) == [8, 16], "step 24's checkpoint owes its evaluation to the resume"
    finished = probe("fashion_mnist", interrupted, steps=None)
    assert finished.summary["resumes"] == 2
    assert evaluations(finished) == evaluations(uninterrupted)
    assert finished.summary["model_digest"] == uninterrupted.summary["model_digest"]
    assert evaluated_checkpoints(interrupted) == [8, 16, 24, 32]


def test_timm_imagenet_evaluates_every_n_steps_across_an_epochs_end_and_trains_each_sample_once_an_epoch(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """3 steps an epoch (24 images, 8 a step): evaluations after steps 2 and 4 (each mid-epoch) and at the finish
    (6), none at the end of epoch 1 (step 3); the loader's iterator goes on after each evaluation."""
    iterators, batches = [], EpochBatches.__iter__
    monkeypatch.setattr(EpochBatches, "__iter__", lambda self: iterators.append(self) or batches(self))
    configs = Configs("timm_imagenet", tmp_path, tiny_settings("timm_imagenet", tmp_path_factory))
    seen = probe("timm_imagenet", configs("trainer.epochs=2", "trainer.eval_every_steps=2",
                                          "checkpoint.keep_last=10"), steps=None)
    assert seen.error is None, seen.error
    assert [step for step, _ in evaluations(seen)] == [2, 4, 6]
    assert evaluated_checkpoints(seen.cfg) == [2, 4, 6]
    assert len(iterators) == 1, "one loader iterator for the run: none started again after an evaluation"
    images = 24
    trained = [key for batch in seen.samples() for key in batch]
    assert sorted(trained[:images]) == sorted(trained[images:]) == list(range(images)), \
        "each image once an epoch, none lost or repeated where an evaluation broke the epoch"


def test_early_stopping_counts_evaluations_every_n_steps(tmp_path: Path,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """At lr 0 nothing improves on the first evaluation (step 4): patience 1 stops at the second, mid-epoch."""
    configs = Configs("fashion_mnist", tmp_path, tiny_settings("fashion_mnist", tmp_path_factory))
    seen = probe("fashion_mnist", configs("optim.lr=0", "optim.warmup_epochs=0", "trainer.eval_every_steps=4",
                                          "trainer.early_stopping_patience=1"), steps=None)
    assert seen.error is None, seen.error
    stopped = seen.summary["early_stopping"]
    assert stopped["stopped_early"] and stopped["stopped_at_step"] == 8 and stopped["stopped_at_epoch"] == 0
    assert seen.summary["steps"] == 8 < FASHION_STEPS_PER_EPOCH


@pytest.mark.parametrize(("overrides", "line"), [
    (("trainer.eval_every_steps=-1",), "trainer.eval_every_steps=-1 is negative"),
    (("trainer.eval_every_steps=5", "trainer.eval_every_epochs=2"), "are both set: keep one"),
    (("trainer.eval_every_epochs=0",), "trainer.eval_every_epochs=0 is below 1"),
], ids=["negative", "both-cadences", "no-epochs"])
def test_a_bad_evaluation_cadence_is_refused_in_one_line(overrides: tuple[str, ...], line: str, tmp_path: Path,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    configs = Configs("fashion_mnist", tmp_path, tiny_settings("fashion_mnist", tmp_path_factory))
    seen = probe("fashion_mnist", configs(*overrides))
    assert seen.error is not None and line in seen.error and "\n" not in seen.error
