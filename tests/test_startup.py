"""A segment's start-up, phase by phase (common/records/startup.py): every recipe times the same phases
from the process's start to its first step; ``summary.json`` holds those of the segment that wrote it,
the first training log holds them, and they are printed in one line once per segment."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from common.records import startup
from common.records.loggers import read_metrics_file
from tests.recipe_probe import Configs, probe, tiny_settings
from tests.recipe_tables import RECIPES

TIMM = "timm_imagenet"
PHASES = [startup.IMPORTS_CONFIG, startup.DATA, startup.MODEL, startup.RESUME, startup.FIRST_STEP]
DECODING = {TIMM: startup.RESUME, "fungitastic": startup.RESUME}  # the phase data.decode=auto's choice follows


def phases_of(recipe: str) -> list[str]:
    """The phases ``recipe`` times, in the order they run."""
    if recipe not in DECODING:
        return PHASES
    after = PHASES.index(DECODING[recipe]) + 1
    return [*PHASES[:after], startup.DECODE_CHOICE, *PHASES[after:]]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_times_its_start_up_phases_in_order_to_its_first_step(
        recipe: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    configs = Configs(recipe, tmp_path, tiny_settings(recipe, tmp_path_factory))
    began = time.monotonic()
    seen = probe(recipe, configs(), steps=1)
    took = time.monotonic() - began
    assert seen.error is None
    phases = seen.run.startup.phases
    assert list(phases) == phases_of(recipe)
    assert all(seconds >= 0 for seconds in phases.values())
    # imports and config run from the process's start; the others inside train(), which the probe ran
    assert sum(phases.values()) - phases[startup.IMPORTS_CONFIG] <= took
    assert sum(phases.values()) <= time.monotonic() - startup.process_start()


def test_summary_json_and_the_first_log_hold_the_start_up_of_the_segment_that_wrote_them_printed_once(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """timm_imagenet stopped in step 2 and resumed to its end (step 4): each segment prints its line
    once; the summary holds the resumed segment's phases, as its first training log does."""
    configs = Configs(TIMM, tmp_path, [*tiny_settings(TIMM, tmp_path_factory), "trainer.max_steps=4",
                                       "trainer.log_every_steps=1", "checkpoint.every_steps=1"])
    cfg = configs()
    probe(TIMM, cfg, steps=2)
    first = capsys.readouterr().out
    resumed = probe(TIMM, cfg, steps=None)
    second = capsys.readouterr().out
    assert len(start_up_lines(first)) == 1
    assert start_up_lines(second) == [resumed.run.startup.line()]
    summary = resumed.summary["startup"]
    assert summary["segment"] == 1
    assert summary["phases_s"] == [[phase, round(seconds, 3)] for phase, seconds in resumed.run.startup.phases.items()]
    assert [phase for phase, _ in summary["phases_s"]] == phases_of(TIMM)
    logs = read_metrics_file(Path(cfg.run_dir) / "tensorboard" / "metrics.jsonl")
    logged = [{key.removeprefix("startup/").removesuffix("_s"): value for key, value in record.items()
               if key.startswith("startup/")} for record in logs if "train/loss" in record]
    # the probe stops the first segment inside step 2, before its save: the second resumes from step 1
    assert [bool(record) for record in logged] == [True, True, False, False]
    assert logged[1] == resumed.run.startup.phases



def start_up_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("start-up ")]


def test_a_run_that_times_no_start_up_records_none_after_a_run_stopped_before_its_first_step(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """In one process (a notebook, a search's trials, these tests) a recipe stopped before its first step
    leaves its start-up unfinished: a later run that times none must not take it as its own."""
    from tests.test_telemetry import train_tiny

    recipe = "fashion_mnist"
    seen = probe(recipe, Configs(recipe, tmp_path, tiny_settings(recipe, tmp_path_factory))(), steps=0)
    assert seen.error is None and seen.run.progress.step == 0
    records, _ = train_tiny(tmp_path / "untimed")
    assert records and not [key for record in records for key in record if key.startswith("startup/")]
