"""Evaluating a checkpoint after training (``make eval``, ``common/after_training/evaluate.py``): every
recipe reports for a checkpoint exactly what its own training reported for it, on the split asked
for, also on another number of ranks (dinov2_fsdp's shards) and from the command line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.after_training.evaluate import main as evaluate_main
from tests.conftest import REPO, assert_ok, recipe_env
from tests.trained_runs import (
    cifar_run,
    dinov2_run,
    evaluate_here,
    fashion_run,
    fungi_run,
    segmentation_run,
    summary,
    timm_run,
)

FUNGI_LEVELS = ("species", "genus", "family", "order", "class", "phylum")


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", *args], cwd=REPO,
                          env=recipe_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("recipe", "trained"), [("fashion_mnist", fashion_run), ("cifar100_resnet50", cifar_run),
                                                 ("timm_imagenet", timm_run)])
def test_the_final_checkpoint_gives_the_metrics_training_reported(
    recipe: str, trained, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = trained(tmp_path_factory)
    report = evaluate_here(recipe, run)
    assert report["metrics"] == summary(run)["metrics"], "the same weights, data and evaluation must agree exactly"
    assert report["recipe"] == recipe and report["which"] == "latest" and report["world_size"] == 1
    assert report["step"] == summary(run)["steps"]
    if recipe != "fashion_mnist":
        assert "eval_ema/top1" in report["metrics"], "the EMA weights are evaluated too"


def test_best_or_a_named_checkpoint_is_the_one_evaluated(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = fashion_run(tmp_path_factory)
    checkpoints = sorted(path for path in (run / "checkpoints").iterdir() if not path.is_symlink())
    first = checkpoints[0]
    saved = json.loads((first / "manifest.json").read_text())
    report = evaluate_here("fashion_mnist", run, which=first.name)
    assert report["checkpoint"] == str(first.resolve()) and report["step"] == saved["step"] < summary(run)["steps"]
    assert report["metrics"] == saved["metrics"]
    best = evaluate_here("fashion_mnist", run, which="best")
    assert Path(best["checkpoint"]).name == summary(run)["best_checkpoint"]
    assert (run / f"eval-test-{first.name}.json").is_file() and (run / "eval-test-best.json").is_file()

    (run / f"eval-test-{first.name}.json").unlink()
    evaluate_main(argv=[str(first)])  # RUN= one checkpoint
    named = json.loads((run / f"eval-test-{first.name}.json").read_text())
    assert named["which"] == first.name and named["metrics"] == saved["metrics"]


def test_fungitastic_reports_val_and_test_per_taxonomic_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = fungi_run(tmp_path_factory)
    trained = summary(run)["metrics"]
    for split in ("val", "test"):
        metrics = evaluate_here("fungitastic", run, split=split)["metrics"]
        assert set(metrics) == {name for name in trained if name.startswith(f"{split}/")}
        assert metrics == {name: value for name, value in trained.items() if name.startswith(f"{split}/")}
        for level in FUNGI_LEVELS:
            assert {f"{split}/{level}/top1", f"{split}/{level}/top3", f"{split}/{level}/f1"} <= set(metrics)
        assert (run / f"eval-{split}-latest.json").is_file()


def test_tv_segmentation_reports_miou_and_pixel_accuracy(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = segmentation_run(tmp_path_factory)
    metrics = evaluate_here("tv_segmentation", run, split="val")["metrics"]
    assert metrics == summary(run)["metrics"]
    assert 0 <= metrics["eval/miou"] <= 1 and 0 < metrics["eval/pixel_accuracy"] <= 1
    assert "eval/iou/background" in metrics


@pytest.mark.slow
def test_dinov2_shards_of_two_ranks_evaluate_on_one_and_on_two(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = dinov2_run(tmp_path_factory)
    latest = json.loads((run / "checkpoints" / "AtomicDirectory.latest_checkpoint" / "manifest.json").read_text())
    assert summary(run)["world_size"] == 2 and (run / "checkpoints" / "AtomicDirectory.latest_checkpoint" /
                                               "sharded").is_dir()

    # One rank, sharded as training shards (FSDP on a group of one): the same numbers exactly.
    on_one_rank = evaluate_here("dinov2_fsdp", run, "fsdp.on_one_rank=true")
    assert on_one_rank["world_size"] == 1 and on_one_rank["metrics"] == latest["metrics"] == summary(run)["metrics"]

    # One rank, the whole model under autocast: the same weights, bf16 rounding in other places.
    whole = evaluate_here("dinov2_fsdp", run)
    assert whole["metrics"]["eval/loss"] == pytest.approx(latest["metrics"]["eval/loss"], rel=1e-2)

    # The command line under torchrun, 2 ranks: each test image counted once, the numbers exactly.
    result = make("eval-dinov2_fsdp", f"RUN={run}", "WHICH=best", "NPROC=2", "ARGS=device=cpu")
    assert_ok(result)
    written = json.loads((run / "eval-test-best.json").read_text())
    assert written["world_size"] == 2 and f"written to {run / 'eval-test-best.json'}" in result.stdout
    best = json.loads((run / "checkpoints" / summary(run)["best_checkpoint"] / "manifest.json").read_text())
    assert written["metrics"] == best["metrics"]


def test_make_eval_reads_the_recipe_from_the_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = cifar_run(tmp_path_factory)
    result = make("eval", f"RUN={run}")
    assert_ok(result)
    report = json.loads((run / "eval-test-latest.json").read_text())
    assert report["recipe"] == "cifar100_resnet50"
    # Another process (one thread per process in tests): counts are exact, a loss is a float sum.
    assert report["metrics"] == pytest.approx(summary(run)["metrics"], rel=1e-5)


def test_a_split_the_data_lacks_is_one_line_and_a_missing_run_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = fashion_run(tmp_path_factory)
    result = make("eval-fashion_mnist", f"RUN={run}", "SPLIT=val")
    assert result.returncode != 0
    assert result.stderr.splitlines()[0] == "error: fashion_mnist has no val split to evaluate: its data has test"
    assert not (run / "eval-val-latest.json").exists()
    missing = make("eval-fashion_mnist", f"RUN={run / 'nowhere'}")
    assert missing.returncode != 0 and missing.stderr.startswith(f"error: {run / 'nowhere'} does not exist")
    assert "Traceback" not in result.stderr + missing.stderr
