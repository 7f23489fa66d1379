"""fashion_mnist end to end on a tiny IDX dataset: outputs, bit-exact resume, signals, errors."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from common.checkpoint.layout import latest_checkpoint
from recipes.fashion_mnist import testing
from tests.conftest import assert_ok, read_summary, run_recipe
from tests.resume import evaluations, kill_signal_resume

RECIPE = "fashion_mnist"
TINY = [
    "trainer.deterministic=true",  # the digest comparisons hold on a GPU too
    *testing.TINY,  # the recipe's tiny settings, dropout on: the resumed runs must draw the same masks
    "logging.backend=none",
    "logging.progress_bar=false",
    "checkpoint.every_seconds=0",
]


def overrides(data: Path, run_dir: Path | None, *extra: str) -> list[str]:
    return [f"data.root={data}", *([f"run_dir={run_dir}"] if run_dir else []), *TINY, *extra]


def test_end_to_end_writes_summary_checkpoints_and_tensorboard(fashion_data: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, overrides(fashion_data, run_dir, "trainer.epochs=3", "logging.backend=tensorboard"))
    assert_ok(result)
    summary = read_summary(run_dir)
    assert summary["steps"] == 3 * (256 // 16)
    assert summary["epochs"] == 3
    assert summary["resumes"] == 0
    assert summary["world_size"] == 1
    assert len(summary["model_digest"]) == 64
    assert summary["metrics"]["eval/top1"] > 0.5, "the tiny dataset is learnable; training did not learn"
    assert summary["wall_time_s"] > 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "AtomicDirectory.latest_checkpoint").is_symlink()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    for line in (f"summary:      {run_dir / 'summary.json'}", f"checkpoints:  {run_dir / 'checkpoints'}",
                 f"tensorboard:  {run_dir / 'tensorboard'}"):
        assert line in result.stdout

    again = run_recipe(RECIPE, overrides(fashion_data, run_dir, "trainer.epochs=3"))  # finished: no step, no evaluation
    assert_ok(again)
    assert "eval/top1" not in again.stdout.split("resumed from", 1)[1].split("done:")[0], "it evaluated again"
    rerun = read_summary(run_dir)
    assert rerun["steps"] == summary["steps"] and rerun["model_digest"] == summary["model_digest"]
    assert rerun["resumes"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "stop_signal", "kill", "cadence"), [
    pytest.param(2, signal.SIGUSR1, "mid-epoch", "trainer.eval_every_steps=2", id="2-SIGUSR1-evaluating-every-2-steps"),
    pytest.param(1, signal.SIGTERM, "after-evaluation", "trainer.eval_every_epochs=1",
                 id="1-SIGTERM-killed-at-an-epoch-end"),
])
def test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact(fashion_data: Path, tmp_path: Path, nproc: int,
                                                                       stop_signal: signal.Signals, kill: str,
                                                                       cadence: str) -> None:
    """The first case evaluates every 2 of an epoch's 4 steps (trainer.eval_every_steps, on 2 ranks):
    the kill lands between two evaluations or right after one, and the signal at the epoch's last
    step, which an evaluation follows, leaves that evaluation to the resumed run. The second kills
    right after an epoch's last checkpoint (the one with its evaluation), so the run resumes at the
    start of the next epoch."""
    settings = ["trainer.epochs=4", "data.random_crop_padding=2", "data.horizontal_flip=true", "seed=5",
                "trainer.batch_size=32", cadence]
    summary = kill_signal_resume(RECIPE, overrides(fashion_data, None, *settings), tmp_path, nproc, stop_signal,
                                 kill=kill)
    steps_per_epoch = summary["steps"] // summary["epochs"]
    evaluated = [step for step, _ in evaluations(tmp_path / "run")]
    assert evaluated == (list(range(2, summary["steps"] + 1, 2)) if nproc == 2 else
                         list(range(steps_per_epoch, summary["steps"] + 1, steps_per_epoch)))


@pytest.mark.slow
def test_a_finished_run_extended_on_another_number_of_ranks_continues(fashion_data: Path, tmp_path: Path) -> None:
    """A run that finished after 3 steps on 2 ranks, started again on 1 rank with room for more,
    trains on with the same global batch (2 micro-batches where 2 ranks had one each), evaluates
    the new weights and writes their final checkpoint. (That the same seed gives the same weights
    is every resume chain's premise; that another seed gives others, tests/test_config_keys.py.)"""
    run_dir = tmp_path / "run"
    settings = ["trainer.epochs=2", "checkpoint.every_steps=1", "trainer.global_batch_size=32"]
    two = run_recipe(RECIPE, overrides(fashion_data, run_dir, *settings, "trainer.max_steps=3"), nproc=2)
    assert_ok(two)
    assert "global batch 32 (16 x 2 ranks x 1 accumulation)" in two.stdout
    first = read_summary(run_dir)
    assert first["steps"] == 3 and first["world_size"] == 2
    result = run_recipe(RECIPE, overrides(fashion_data, run_dir, *settings))
    assert_ok(result)
    assert "global batch 32 (16 x 1 ranks x 2 accumulation)" in result.stdout
    summary = read_summary(run_dir)
    assert summary["world_size"] == 1 and summary["resumes"] == 1
    assert summary["steps"] == 2 * 256 // 32
    assert summary["metrics"] != first["metrics"] and summary["model_digest"] != first["model_digest"]
    final = latest_checkpoint(run_dir / "checkpoints")
    assert final.step == summary["steps"] and final.metrics == summary["metrics"]
    assert torch.load(final.path / "state.pt", weights_only=True)["progress"]["finished"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.nonsense=1", "Key 'nonsense' not in 'TrainerConfig'"),
        ("trainer.epochs=many", "could not be converted to Integer"),
        ("trainer.precision=fp8", "Invalid value 'fp8'"),
        ("data.root=/does/not/exist", "data directory /does/not/exist does not exist"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(fashion_data: Path, tmp_path: Path, override: str, message: str) -> None:
    result = run_recipe(RECIPE, [*overrides(fashion_data, tmp_path / "run"), override])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_a_truncated_idx_file_is_a_one_line_error(fashion_data: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in fashion_data.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    images = broken / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-500])
    result = run_recipe(RECIPE, overrides(broken, tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {images} is truncated or padded: {256 * 28 * 28 + 16 - 500} bytes, its header declares "
        f"{256 * 28 * 28 + 16}"
    ]


def test_cfg_job_prints_the_resolved_config(tmp_path: Path) -> None:
    result = run_recipe(RECIPE, ["--cfg", "job", f"run_dir={tmp_path}/x"])
    assert_ok(result)
    assert f"dir: {tmp_path}/x/checkpoints" in result.stdout
    assert "${" not in result.stdout


def test_fp16_with_its_grad_scaler_runs_and_resumes(fashion_data: Path, tmp_path: Path) -> None:
    """fp16 autocast, its grad scaler's state carried across a resume. (bf16: every recipe's run,
    SIGTERM and resume to the same digest in make gpu-check's sequence, which tests/test_gpu_check.py
    runs on the CPU.)"""
    run_dir = tmp_path / "run"
    settings = ["trainer.precision=fp16", "trainer.epochs=1", "checkpoint.every_steps=2"]
    assert_ok(run_recipe(RECIPE, overrides(fashion_data, run_dir, *settings, "trainer.max_steps=4")))
    result = run_recipe(RECIPE, overrides(fashion_data, run_dir, *settings, "trainer.max_steps=8"))
    assert_ok(result)
    summary = read_summary(run_dir)
    assert summary["steps"] == 8 and summary["resumes"] == 1
    assert summary["metrics"]["eval/loss"] == summary["metrics"]["eval/loss"], "loss is NaN"
