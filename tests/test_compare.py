"""make compare: the table of finished runs (single runs and a sweep) and the PNG of their curves."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from recipes.fashion_mnist.config import OptimConfig
from tests.conftest import REPO, assert_ok, read_summary, recipe_env, run_recipe

TINY = ["model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16", "trainer.epochs=1",
        "trainer.log_every_steps=4", "logging.backend=none", "logging.progress_bar=false",
        "checkpoint.every_seconds=0"]
# matplotlib's first colours, one per run in the order of the table.
CURVE_COLOURS = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28), (0x94, 0x67, 0xBD)]


def has_colour(image: np.ndarray, rgb: tuple[int, int, int]) -> bool:
    return bool((np.abs(image[..., :3].astype(int) - rgb).max(axis=-1) <= 2).sum() > 20)


@pytest.mark.slow
def test_compare_tabulates_runs_and_sweep_jobs_and_plots_their_curves(fashion_data: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for name, lr in (("slow", "0.001"), ("fast", "0.01")):
        assert_ok(run_recipe("fashion_mnist", [f"data.root={fashion_data}", f"run_dir={runs / name}", *TINY,
                                               f"optim.lr={lr}"]))
    sweep = subprocess.run(
        [sys.executable, "-m", "recipes.fashion_mnist.train", "-m", f"data.root={fashion_data}", *TINY,
         "trainer.max_steps=8", "seed=1,2", f"hydra.sweep.dir={runs / 'sweep'}"],
        cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert_ok(sweep)

    out = tmp_path / "compare"
    result = subprocess.run([sys.executable, "-m", "tools.compare", str(runs / "*"), "--out", str(out)],
                            cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert_ok(result)

    with open(out / "runs.csv") as handle:
        table = list(csv.DictReader(handle))
    labels = [row["run"] for row in table]  # a sweep job by the overrides that set it apart
    assert labels == ["fast", "slow", "sweep/trainer.max_steps=8,seed=1", "sweep/trainer.max_steps=8,seed=2"]
    header = list(table[0])
    assert {"optim.lr", "seed", "trainer.max_steps"} <= set(header), header
    assert "trainer.batch_size" not in header and "model.hidden" not in header, "equal keys are not differences"
    summaries = {(s["metrics"]["eval/top1"], s["steps"]) for s in map(read_summary, {p.parent for p in
                                                                                           runs.rglob("summary.json")})}
    assert {(float(row["eval/top1"]), int(row["steps"])) for row in table} == summaries
    assert [int(row["steps"]) for row in table] == [16, 16, 8, 8]
    assert all(row["recipe"] == "fashion_mnist" and row["world_size"] == "1" and row["resumes"] == "0"
               for row in table)
    default_lr = str(OptimConfig().lr)  # the sweep jobs leave it at the recipe's default
    assert [row["optim.lr"] for row in table] == ["0.01", "0.001", default_lr, default_lr]
    assert [row["seed"] for row in table] == ["0", "0", "1", "2"]

    markdown = (out / "runs.md").read_text().splitlines()
    assert len(markdown) == 2 + 4 and markdown[0].startswith("| recipe | name | run |")
    assert labels[3] in result.stdout and "train time" in result.stdout

    # Two panels (train/loss, eval/top1), one curve per run in each.
    assert "(8 curve(s) of train/loss, eval/top1)" in result.stdout
    image = np.asarray(Image.open(out / "curves.png").convert("RGB"))
    assert image.shape[:2] == (2 * 300 + 125, 800), "two panels of 8 x 3 inches and a legend of 4 runs, 100 dpi"
    assert all(has_colour(image, colour) for colour in CURVE_COLOURS[:4]), "a run's curve is missing"
    assert not has_colour(image, CURVE_COLOURS[4]), "more curves than runs"


def test_compare_without_runs_is_a_one_line_error(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tools.compare", str(tmp_path / "nothing"), "--out",
                             str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: no finished run (a folder with summary.json) under "
                                                  f"{tmp_path / 'nothing'}"]


def test_a_resumed_run_has_each_step_once_in_metrics_jsonl(fashion_data: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    settings = [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY, "trainer.epochs=2",
                "trainer.log_every_steps=1"]
    assert_ok(run_recipe("fashion_mnist", [*settings, "trainer.max_steps=10"]))
    assert_ok(run_recipe("fashion_mnist", settings))
    records = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [record["step"] for record in records if "train/loss" in record]
    assert train_steps == list(range(1, 33))
