"""Early stopping (``trainer.early_stopping_patience``, ``common/run/training_run.py``): training ends after that
many evaluations in a row without a better ``checkpoint.best_metric``, the summary says so, and
a run resumed in between keeps its count (it stops where the uninterrupted run stops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.after_training.trained import open_run
from tests.trained_runs import fashion_data, train_here

# lr 0 and no conv blocks, so no BatchNorm whose running statistics would move: the weights never
# change, so eval/top1 never improves on the first evaluation's value.
STALLED = ["optim.lr=0", "model.channels=[]", "optim.warmup_epochs=0", "trainer.epochs=8",
           "trainer.early_stopping_patience=2", "trainer.deterministic=true"]
STEPS_PER_EPOCH = 256 // 16


def test_training_stops_after_patience_evaluations_without_improvement(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    summary = train_here("fashion_mnist", tmp_path / "run", f"data.root={fashion_data(tmp_path_factory)}", *STALLED)
    assert summary["epochs"] == 3 and summary["steps"] == 3 * STEPS_PER_EPOCH, "epoch 1 sets the best, 2 and 3 do not"
    assert summary["early_stopping"] == {
        "patience": 2, "metric": "eval/top1", "mode": "max", "best_value": summary["metrics"]["eval/top1"],
        "evaluations_without_improvement": 2, "stopped_early": True, "stopped_at_epoch": 3,
        "stopped_at_step": 3 * STEPS_PER_EPOCH}
    assert "early stopping: eval/top1 has not improved" in capsys.readouterr().out

    again = train_here("fashion_mnist", tmp_path / "run", f"data.root={fashion_data(tmp_path_factory)}", *STALLED)
    assert again["steps"] == summary["steps"] and again["early_stopping"]["stopped_early"], "it stays stopped"


def test_a_resumed_run_keeps_its_patience_count(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    data = fashion_data(tmp_path_factory)
    uninterrupted = train_here("fashion_mnist", tmp_path / "whole", f"data.root={data}", *STALLED)

    run = tmp_path / "cut"
    first = train_here("fashion_mnist", run, f"data.root={data}", *STALLED, f"trainer.max_steps={2 * STEPS_PER_EPOCH}")
    early = first["early_stopping"]
    assert early["evaluations_without_improvement"] == 1 and not early["stopped_early"]
    saved = torch.load(open_run(run).checkpoint / "state.pt", weights_only=True)["progress"]
    assert saved["evals_without_improvement"] == 1 and saved["best_value"] == first["metrics"]["eval/top1"]

    resumed = train_here("fashion_mnist", run, f"data.root={data}", *STALLED)
    assert resumed["resumes"] == 1
    assert resumed["steps"] == uninterrupted["steps"] == 3 * STEPS_PER_EPOCH, "a fresh count would run 2 epochs more"
    assert resumed["early_stopping"] == uninterrupted["early_stopping"]
    assert resumed["model_digest"] == uninterrupted["model_digest"]
