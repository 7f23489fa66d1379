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
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.checkpoint.layout import STATE_FILE, best_checkpoint, committed_checkpoints, improves
from common.checkpoint.manager import CheckpointManager
from common.errors import EXIT_DIVERGED
from common.jsonfiles import NON_FINITE_KEY, dumps, write_json
from common.pytorch.metrics import SumMetrics
from common.records.loggers import METRICS_FILE
from common.run.training_run import Progress
from recipes.fashion_mnist.config import OptimConfig
from tests.conftest import REPO, assert_ok, read_summary, recipe_env, run_recipe
from tests.recipe_probe import Configs, Probe, probe, tiny_settings
from tests.resume import PAUSE_HOOK
from tests.test_augmentation_draws import MOSTLY, RECIPES, fraction_differing, one_image_data

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


@pytest.mark.slow
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
    assert base_lrs == [pytest.approx(OptimConfig().lr * 0.5)] * len(base_lrs)
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


# ---- a rollback through each recipe's real loop: it goes on at the run's step --------------------

ROLLBACK_SETTINGS = ["trainer.nonfinite=rollback", "trainer.rollback_lr_factor=0.5", "checkpoint.every_steps=2",
                     "checkpoint.sync_every_steps=1", "checkpoint.every_seconds=0", "trainer.log_every_steps=2",
                     "trainer.epochs=10"]
NAN_AT, BACK_TO, LAST = 5, 4, 9  # step 5 goes NaN, the run goes back to step 4's checkpoint, and trains to step 9
PER_STEP_DRAWS = ("fashion_mnist", "cifar100_resnet50", "dinov2_fsdp")  # augmentation seeded by (seed, step, rank)
DINOV2_PROBE_EPOCHS = 2  # 4 steps an epoch: the probe ends at step 8, after the rollback


_rolled_back: dict[str, tuple[Probe, Configs]] = {}


@pytest.fixture(scope="module", autouse=True)
def _free_the_probes() -> Iterator[None]:
    """Probes hold models and inputs: let them go when this module's tests are done."""
    yield
    _rolled_back.clear()


def rolled_back(recipe: str, factory: pytest.TempPathFactory) -> tuple[Probe, Configs]:
    """``recipe``'s real train() with step 5's output made NaN: it rolls back to step 4's checkpoint
    and trains to step 9 (the recipes that augment by step: on data whose images are all one); and
    the configs it was made with."""
    if recipe not in _rolled_back:
        settings = one_image_data(recipe, factory) if recipe in PER_STEP_DRAWS else tiny_settings(recipe, factory)
        extra = [f"stages.probe_epochs={DINOV2_PROBE_EPOCHS}"] if recipe == "dinov2_fsdp" else []
        configs = Configs(recipe, factory.mktemp(f"{recipe}-rollback"), [*settings, *ROLLBACK_SETTINGS, *extra])
        seen = probe(recipe, configs(), steps=LAST, nonfinite_at=NAN_AT)
        assert seen.error is None, seen.error
        [rollback] = seen.run.progress.rollbacks
        assert (rollback["nonfinite_step"], rollback["back_to_step"]) == (NAN_AT, BACK_TO)
        _rolled_back[recipe] = seen, configs
    return _rolled_back[recipe]


@pytest.mark.parametrize("recipe", RECIPES)
def test_after_a_rollback_train_metrics_are_logged_every_log_every_steps(
        recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    seen, _ = rolled_back(recipe, tmp_path_factory)
    assert seen.logged_at == [2, 4, 6, 8], "the log cadence after the rollback"


def test_the_runs_progress_is_one_object_a_restore_updates_and_nothing_replaces(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    seen, _ = rolled_back("fashion_mnist", tmp_path_factory)
    held = seen.held_progress
    assert held is seen.run.progress and held.step == LAST and held.rollbacks, "what resume() returned moves on"
    with pytest.raises(AttributeError):
        seen.run.progress = Progress()
    assert seen.run.progress is held


@pytest.mark.parametrize("recipe", PER_STEP_DRAWS)
def test_after_a_rollback_each_step_draws_differently_from_the_one_before(
        recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One image everywhere: two steps' inputs alike mean the same augmentation draws."""
    seen, _ = rolled_back(recipe, tmp_path_factory)
    first = [index for index, step in enumerate(seen.steps) if step == NAN_AT][-1]  # step 5 again, after it
    by_step: dict[int, torch.Tensor] = {}
    for step, batch in zip(seen.steps[first:], seen.inputs[first:]):
        by_step[step] = torch.cat([by_step[step], batch]) if step in by_step else batch
    assert sorted(by_step) == list(range(NAN_AT, LAST + 1))
    pairs = [(by_step[step][row], by_step[step + 1][row]) for step in range(NAN_AT, LAST)
             for row in range(min(len(by_step[step]), len(by_step[step + 1])))]
    assert fraction_differing(pairs) >= MOSTLY, "after the rollback each step repeats the draws of the one before"


def test_after_a_rollback_timm_imagenet_takes_the_scheduled_lr_of_each_step_times_the_factor(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Its LR is set per step from the step count (here in the schedule's warmup); an uninterrupted
    run of the same config gives the schedule's values."""
    seen, configs = rolled_back("timm_imagenet", tmp_path_factory)
    scheduled = {step: lr for step, lr, _ in probe("timm_imagenet", configs(), steps=LAST).optimizer_steps}
    after = [(step, lr) for step, lr, _ in seen.optimizer_steps][NAN_AT:]  # past steps 1-5 before the rollback
    assert [step for step, _ in after] == list(range(NAN_AT, LAST + 1))
    assert len({lr for _, lr in after}) == len(after), "the schedule must move from step to step"
    for step, lr in after:
        assert lr == pytest.approx(scheduled[step] * 0.5, rel=1e-9), f"step {step}: {lr}, not {scheduled[step]} / 2"


def test_after_a_rollback_during_the_probe_dinov2_fsdp_switches_stage_when_the_probe_ends(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The fine-tune's optimizer takes the first step of the epoch after the probe's last; the epoch
    whose step the rollback skipped ends a step sooner."""
    seen, _ = rolled_back("dinov2_fsdp", tmp_path_factory)
    [rollback] = seen.run.progress.rollbacks
    probe_ends_at = DINOV2_PROBE_EPOCHS * seen.run.plan.per_epoch - rollback["skipped_steps"]
    first_finetune = next((step for step, _, optimizer in seen.optimizer_steps if optimizer == 1), None)
    first_of_epoch = next(step for step, epoch in zip(seen.steps, seen.epochs) if epoch == DINOV2_PROBE_EPOCHS)
    assert first_finetune == first_of_epoch == probe_ends_at + 1
    assert seen.run.progress.extra["stage"] == "finetune"


def test_a_loop_whose_loss_sum_has_another_name_stops_at_its_first_step_with_one_line(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """fashion_mnist's real loop, its loss summed under another name: ``train_sums.running("loss")``
    is None, and the run must refuse to train unwatched rather than never see a divergence."""
    add = SumMetrics.add
    monkeypatch.setattr(SumMetrics, "add", lambda sums, loss=None, **values: add(sums, **values, loss_sum=loss))
    configs = Configs(RECIPE, tmp_path_factory.mktemp("renamed-loss"), tiny_settings(RECIPE, tmp_path_factory))
    seen = probe(RECIPE, configs(), steps=2)
    assert seen.error is not None and "run.step_done() got loss=None" in seen.error and "\n" not in seen.error
    assert seen.run.progress.step == 0, "no step may be counted unwatched"
    compiled: list[object] = []  # the first step's FLOP counter ran torch.compile eagerly: it must be off again
    torch.compile(lambda x: x + 1, backend=lambda graph, inputs: compiled.append(graph) or graph.forward)(torch.ones(1))
    assert compiled, "the failed step left torch.compile forced eager in this process"


def test_a_rollback_in_dinov2_fsdps_fine_tune_goes_back_to_the_fine_tune(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The fine-tune starts a fresh optimizer; a rollback in its first steps must find a checkpoint of
    the fine-tune to go back to, not the probe's, whose optimizer and stage are others."""
    configs = Configs("dinov2_fsdp", tmp_path_factory.mktemp("dinov2-finetune-rollback"),
                      [*tiny_settings("dinov2_fsdp", tmp_path_factory), *ROLLBACK_SETTINGS, "stages.probe_epochs=1"])
    seen = probe("dinov2_fsdp", configs(), steps=LAST, nonfinite_at=6)
    assert seen.error is None, seen.error
    probe_steps = seen.run.plan.per_epoch
    [rollback] = seen.run.progress.rollbacks
    assert rollback["back_to_step"] == probe_steps and seen.run.progress.extra["stage"] == "finetune"
    assert {optimizer for step, _, optimizer in seen.optimizer_steps if step > probe_steps} == {1}
    assert seen.run.progress.step == LAST
