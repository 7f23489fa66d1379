"""A run that guards itself against divergence (``trainer.nonfinite``): stop with exit code 3 and
the last finite checkpoint as the latest, or roll back past the bad batches; NaN metrics never
the best; every JSON file strict.

The runs are fashion_mnist on its tiny IDX data; ``tests/pause_hook/sitecustomize.py`` makes the
loss of a chosen step NaN (or its gradient infinite), on a chosen rank.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from common.checkpoint import STATE_FILE, CheckpointManager, best_checkpoint, committed_checkpoints, improves
from common.errors import EXIT_DIVERGED
from common.jsonfiles import NON_FINITE_KEY, dumps, write_json
from common.loggers import METRICS_FILE
from tests.conftest import REPO, assert_ok, read_summary, recipe_env, run_recipe
from tests.recipe_probe import Configs, probe, tiny_settings
from tests.resume import PAUSE_HOOK

RECIPE = "fashion_mnist"
TINY = ["model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16", "logging.backend=none",
        "logging.progress_bar=false", "checkpoint.every_seconds=0", "checkpoint.every_steps=2",
        "checkpoint.sync_every_steps=1", "trainer.log_every_steps=1", "trainer.epochs=2"]  # 16 steps an epoch


def nonfinite_env(step: int, **extra: str) -> dict[str, str]:
    return recipe_env(PYTHONPATH=f"{PAUSE_HOOK}{os.pathsep}{REPO}", NONFINITE_AT_STEP=str(step), **extra)


def reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def strict_load(text: str) -> object:
    return json.loads(text, parse_constant=reject_constant)


def assert_every_json_file_is_strict(run_dir: Path) -> int:
    """Parse every JSON file the run wrote with a parser that rejects NaN and Infinity; how many."""
    files = [*run_dir.rglob("*.json")]
    for path in files:
        strict_load(path.read_text())
    for line in (run_dir / "tensorboard" / METRICS_FILE).read_text().splitlines():
        strict_load(line)
    return len(files)


def all_tensors_finite(checkpoint: Path) -> bool:
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    tensors = [*state["model"].values(), *(value for per_param in state["optimizer"]["state"].values()
                                           for value in per_param.values() if torch.is_tensor(value))]
    return all(torch.isfinite(tensor).all() for tensor in tensors if tensor.is_floating_point())


def latest(run_dir: Path):  # noqa: ANN201
    return committed_checkpoints(run_dir / "checkpoints")[-1]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_nan_loss_stops_every_rank_with_code_3_and_the_last_finite_checkpoint_stays_latest(
    fashion_data: Path, tmp_path: Path, nproc: int
) -> None:
    run_dir = tmp_path / "run"
    rank = nproc - 1  # on 2 ranks only rank 1's loss goes NaN; DDP then spreads it to rank 0's weights
    result = run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY], nproc=nproc,
                        env=nonfinite_env(5, NONFINITE_RANK=str(rank)))
    assert result.returncode == EXIT_DIVERGED, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"the training was not finite at step 5 on rank {rank} (" in errors[0]
    assert "AtomicDirectory_checkpoint_1 (step 4), stays the latest" in errors[0]
    assert errors[0].endswith(f"exiting with code {EXIT_DIVERGED}")
    assert latest(run_dir).step == 4
    assert all(found.step <= 4 for found in committed_checkpoints(run_dir / "checkpoints"))
    assert all_tensors_finite(latest(run_dir).path)
    summary = read_summary(run_dir)
    assert summary["diverged"] == {"step": 5, "ranks": [rank], "hosts": summary["diverged"]["hosts"],
                                   "checkpoint": "AtomicDirectory_checkpoint_1"}
    assert summary["model_digest"] is None
    assert assert_every_json_file_is_strict(run_dir) >= 3
    logged = [strict_load(line) for line in (run_dir / "tensorboard" / METRICS_FILE).read_text().splitlines()]
    at_nan = next(record for record in logged if record["step"] == 5)
    assert at_nan["train/loss"] is None and at_nan["train/grad_norm"] is None, "NaN is logged as null"
    assert at_nan[NON_FINITE_KEY] == ["train/loss", "train/grad_norm"]


def test_an_absurd_learning_rate_is_caught_in_the_weights_before_any_checkpoint_holds_them(
    fashion_data: Path, tmp_path: Path
) -> None:
    """lr=1e6 overflows AdamW's moments and the weights before the loss itself is non-finite: the
    state is checked before every save, so no checkpoint of them is ever committed."""
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY, "optim.lr=1e6",
                                 "checkpoint.every_steps=1"])
    assert result.returncode == EXIT_DIVERGED, result.stderr[-2000:]
    assert "the run diverged" in result.stderr
    for found in committed_checkpoints(run_dir / "checkpoints"):
        assert all_tensors_finite(found.path), f"{found.path.name} (step {found.step}) holds non-finite state"
    assert read_summary(run_dir)["diverged"]["checkpoint"] == latest(run_dir).path.name


def test_rollback_goes_back_to_the_last_finite_checkpoint_skips_the_bad_batches_and_finishes(
    fashion_data: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY, "trainer.nonfinite=rollback",
                                 "trainer.rollback_lr_factor=0.5", "checkpoint.keep_last=100"], env=nonfinite_env(5))
    assert_ok(result)
    assert ("rollback 1 of at most 3: the training was not finite at step 5 on rank 0 (" in result.stdout
            and "back to step 4 (AtomicDirectory_checkpoint_" in result.stdout
            and "skipping the batches of steps 5-5, lr x0.5" in result.stdout), result.stdout[-3000:]
    summary = read_summary(run_dir)
    assert "diverged" not in summary
    [rollback] = summary["rollbacks"]
    assert (rollback["nonfinite_step"], rollback["back_to_step"], rollback["skipped_steps"]) == (5, 4, 1)
    assert summary["steps"] == 2 * 16 - 1, "one step's batches are skipped, the rest trained on"
    assert summary["epochs"] == 2 and math.isfinite(summary["metrics"]["eval/loss"])

    # The checkpoint written at the rollback: step 4's state, the sampler past step 5's batch
    # exactly, the LR schedule halved from there on.
    back = [found for found in committed_checkpoints(run_dir / "checkpoints") if found.step == 4][-1]
    state = torch.load(back.path / STATE_FILE, map_location="cpu", weights_only=True)
    assert state["sampler"]["consumed"] == 5 * 16 and state["progress"]["step"] == 4
    base_lrs = state["scheduler"]["base_lrs"]
    assert base_lrs == [pytest.approx(3e-3 * 0.5)] * len(base_lrs)
    assert state["progress"]["rollbacks"] == summary["rollbacks"], "a restart keeps the rollback count"


def test_rollback_gives_up_after_max_rollbacks_and_stops_as_with_stop(fashion_data: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY, "trainer.nonfinite=rollback",
                                 "trainer.max_rollbacks=2"], env=nonfinite_env(5, NONFINITE_TIMES="0"))
    assert result.returncode == EXIT_DIVERGED, result.stderr[-2000:]
    assert result.stdout.count("rollback ") == 2
    assert "the run diverged after 2 rollback(s): the training was not finite at step 5" in result.stderr
    summary = read_summary(run_dir)
    assert len(summary["rollbacks"]) == 2 and summary["diverged"]["step"] == 5
    assert all_tensors_finite(latest(run_dir).path)


def test_fp16_steps_the_grad_scaler_skips_are_not_divergence(fashion_data: Path, tmp_path: Path) -> None:
    """An infinite gradient under fp16 is the grad scaler's to handle: it skips the step and halves
    its scale; the run goes on, and the gradient norm it clipped with is not taken for divergence."""
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY, "trainer.precision=fp16",
                                 "trainer.grad_clip_norm=1.0", "trainer.epochs=1"],
                        env=nonfinite_env(3, NONFINITE_HOW="grad"))
    assert_ok(result)
    summary = read_summary(run_dir)
    assert "diverged" not in summary and "rollbacks" not in summary
    state = torch.load(latest(run_dir).path / STATE_FILE, map_location="cpu", weights_only=True)
    assert state["scaler"]["scale"] < 2.0**16, "the scaler did not skip the step with the infinite gradient"


# ---- the one rule for "better", and strict JSON -----------------------------------------------


def test_a_nan_metric_is_never_the_best() -> None:
    assert improves(0.5, None, "max") and improves(0.4, 0.5, "min") and not improves(0.5, 0.5, "max")
    for bad in (math.nan, math.inf, -math.inf, None):
        assert not improves(bad, None, "max") and not improves(bad, 0.1, "min")


def test_retention_force_and_the_best_checkpoint_follow_the_finite_metrics(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    manager = CheckpointManager(folder, keep_last=10, best_metric="eval/top1", best_mode="max")
    for step, top1 in enumerate([math.nan, 0.2, math.nan, 0.5, 0.3], start=1):
        manager.save(step, {"weights": torch.zeros(1)}, {"eval/top1": top1})
    committed = committed_checkpoints(folder)
    assert [found.step for found in committed if found.force] == [2, 4], \
        "only a metric that beats every earlier one is _force; NaN never is"
    assert best_checkpoint(committed, "eval/top1", "max").step == 4
    for found in committed:
        strict_load((found.path / "manifest.json").read_text())

    again = CheckpointManager(folder, keep_last=1, best_metric="eval/top1", best_mode="max")
    assert again.best().step == 4, "a restarted manager reads the best back (NaN is null in a manifest)"
    again.save(6, {"weights": torch.zeros(1)}, {"eval/top1": math.nan})
    assert [found.step for found in committed_checkpoints(folder)] == [4, 6], "retention keeps the best and the latest"


def test_json_files_hold_null_for_what_is_not_finite_and_say_so(tmp_path: Path) -> None:
    path = write_json(tmp_path / "summary.json", {"metrics": {"eval/loss": math.nan, "eval/top1": 0.5},
                                                  "curve": [1.0, math.inf]})
    data = strict_load(path.read_text())
    assert data["metrics"] == {"eval/loss": None, "eval/top1": 0.5} and data["curve"] == [1.0, None]
    assert data[NON_FINITE_KEY] == ["metrics.eval/loss", "curve[1]"]
    assert strict_load(dumps({"a": 1.0})) == {"a": 1.0}


@pytest.mark.parametrize("recipe", ["fashion_mnist", "cifar100_resnet50", "timm_imagenet", "tv_segmentation",
                                    "fungitastic", "dinov2_fsdp"])
def test_a_fresh_run_that_may_roll_back_checkpoints_step_0_before_its_first_step(
        recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """dinov2_fsdp makes its optimizer after resume() (the stage's): the step-0 save must wait for it."""
    configs = Configs(recipe, tmp_path_factory.mktemp(recipe), tiny_settings(recipe, tmp_path_factory))
    seen = probe(recipe, configs("trainer.nonfinite=rollback"), steps=1)
    assert seen.error is None and seen.losses, "the first step did not run"
    assert [found.step for found in committed_checkpoints(seen.cfg.checkpoint.dir)] == [0]
