"""Rank-0 logging: TensorBoard events, W&B offline runs, and silence elsewhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from common.records.loggers import RunLogger


def test_tensorboard_writes_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = RunLogger("tensorboard", tmp_path / "tb", is_main=True, run_name="r")
    logger.log({"train/loss": 1.5, "eval/accuracy": 0.25}, step=3)
    logger.log({"train/loss": 0.5}, step=7)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/accuracy", "train/loss"]
    assert [(event.step, event.value) for event in events.Scalars("train/loss")] == [(3, 1.5), (7, 0.5)]
    assert [(event.step, event.value) for event in events.Scalars("eval/accuracy")] == [(3, 0.25)]


def test_non_main_ranks_write_nothing_and_never_import_wandb(tmp_path: Path) -> None:
    sys.modules.pop("wandb", None)
    logger = RunLogger("wandb", tmp_path / "wandb", is_main=False, run_name="r")
    logger.log({"train/loss": 1.0}, step=1)
    logger.close()
    assert not (tmp_path / "wandb").exists()
    assert "wandb" not in sys.modules


def test_wandb_runs_offline_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = RunLogger("wandb", tmp_path / "wandb", is_main=True, run_name="recipe/name", config={"a": 1})
    logger.log({"train/loss": 1.0}, step=1)
    logger.close()
    assert list((tmp_path / "wandb").rglob("offline-run-*")), "no offline W&B run directory was written"


def test_unknown_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tensorboard, wandb or none"):
        RunLogger("mlflow", tmp_path, is_main=True, run_name="r")


def test_metrics_jsonl_drops_what_a_killed_segment_logged_after_its_checkpoint(tmp_path: Path) -> None:
    logger = RunLogger("none", tmp_path, is_main=True, run_name="r")
    for step in range(1, 11):
        logger.log({"train/loss": 1.0 / step}, step)
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 11, "train/lo')  # the kill came in the middle of a line

    resumed = RunLogger("none", tmp_path, is_main=True, run_name="r", resume_step=6)
    for step in range(7, 9):
        resumed.log({"train/loss": 2.0 / step}, step)
    resumed.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert records[6]["train/loss"] == 2.0 / 7 and records[5]["train/loss"] == 1.0 / 6
    assert all(record["time"] > 0 for record in records)
