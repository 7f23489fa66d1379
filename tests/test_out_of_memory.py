"""``trainer.out_of_memory=halve``: a step that runs out of memory is done again with half the micro-batch,
and the run goes on as if it had used the smaller micro-batch from that step on.

On a CPU, ``tests/recipe_probe.py`` raises ``torch.OutOfMemoryError`` (CUDA's error) where a GPU
would: in the backward pass of step 2's first micro-batch (or its forward pass). Each recipe's real
loop then redoes step 2 with micro-batches of ``b/2`` out of the same batches of ``b``, and from
there on the run is, bit for bit, the run that took step 1 with ``b`` (a checkpoint of it) and was
resumed with ``trainer.batch_size=b/2``: the same gradients at every step, the same weights,
BatchNorm statistics and metric sums at the end. So the redone step took the same samples and drew
the same random numbers (augmentation, dropout, drop path, Mixup) as that run, and the failed
attempt left nothing behind. Also: an error that is not memory is not retried; a micro-batch of one
sample that still runs out is one line; on 2 gloo ranks the rank that ran out redoes its step alone
(DDP) and the other takes its size where they next agree, or both run out and redo it together
(FSDP2); a resume keeps the size on the same device and tries ``trainer.batch_size`` elsewhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from common.checkpoint.layout import LATEST, committed_checkpoints
from common.pytorch.distributed import DistInfo
from tests.conftest import spawn_ranks
from tests.recipe_probe import Configs, Probe, probe, tiny_settings

HALVE = ["trainer.out_of_memory=halve", "trainer.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=10"]
# recipe: (b, settings): dropout, drop path and Mixup draw where the recipe has them; epochs of whole steps.
CASES: dict[str, tuple[int, list[str]]] = {
    "fashion_mnist": (16, ["data.random_crop_padding=2", "data.horizontal_flip=true"]),
    "cifar100_resnet50": (4, ["model.drop_path_rate=0.2", "mixup.mixup_alpha=0.8"]),
    "timm_imagenet": (4, ["model.drop_path_rate=0.2", "mixup.mixup_alpha=0.8", "trainer.channels_last=false"]),
    "tv_segmentation": (4, []),
    "fungitastic": (4, ["model.drop_path_rate=0.2", "model.head_dropout=0.2"]),
    "dinov2_fsdp": (4, ["stages.probe_epochs=0"]),
}


def configs_of(recipe: str, factory: pytest.TempPathFactory) -> Configs:
    b, settings = CASES[recipe]
    return Configs(recipe, factory.mktemp(f"{recipe}-oom"),
                   [*tiny_settings(recipe, factory), f"trainer.batch_size={b}", f"trainer.global_batch_size={2 * b}",
                    *HALVE, *settings])


def resumed_with_half(recipe: str, configs: Configs, plain: Probe, tmp_path: Path) -> Probe:
    """The run that took ``plain``'s step 1 (its checkpoint) and went on with micro-batches of b/2."""
    checkpoints = tmp_path / "resumed" / "checkpoints"
    checkpoints.mkdir(parents=True)
    kept = [found for found in committed_checkpoints(Path(plain.cfg.checkpoint.dir)) if found.step <= 1]
    for found in kept:
        shutil.copytree(found.path, checkpoints / found.path.name)
    (checkpoints / LATEST).symlink_to(checkpoints / kept[-1].path.name)
    seen = probe(recipe, configs(f"trainer.batch_size={CASES[recipe][0] // 2}", f"run_dir={tmp_path / 'resumed'}"),
                 steps=None)
    assert seen.error is None, seen.error
    return seen


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{what}: {name} differs"


@pytest.mark.parametrize("recipe", list(CASES))
def test_a_step_that_runs_out_of_memory_is_redone_with_half_the_micro_batch_bit_for_bit(
        recipe: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    b = CASES[recipe][0]
    configs = configs_of(recipe, tmp_path_factory)
    halved = probe(recipe, configs(), steps=None, error_at=2)
    assert halved.error is None, halved.error
    assert halved.errors_raised == [2] and halved.run.micro_batch == b // 2
    step_two = [(attempt, len(x)) for x, step, attempt in zip(halved.inputs, halved.steps, halved.attempts)
                if step == 2]
    assert step_two[0] == (1, b) and {size for attempt, size in step_two if attempt == 2} == {b // 2}, step_two
    plain = probe(recipe, configs(), steps=None)
    resumed = resumed_with_half(recipe, configs, plain, tmp_path)

    assert_same(halved.gradients[0], plain.gradients[0], f"{recipe}, step 1")
    assert len(halved.gradients) == 1 + len(resumed.gradients)
    for step, (got, expected) in enumerate(zip(halved.gradients[1:], resumed.gradients), start=2):
        assert_same(got, expected, f"{recipe}, step {step}")
    assert_same(halved.run.model.state_dict(), resumed.run.model.state_dict(), f"{recipe}, the model at the end")
    assert halved.summary["model_digest"] == resumed.summary["model_digest"]
    assert halved.summary["metrics"] == resumed.summary["metrics"]
    assert halved.summary["micro_batch_size"] == b // 2
    assert halved.summary["out_of_memory"] == [{"step": 2, "ranks": [0], "micro_batch_size": b // 2,
                                                "found_on": "cpu x 1 rank"}]


def test_a_run_that_runs_out_in_its_first_step_is_the_run_started_with_half(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Out of memory in the first step's forward pass (not its backward): the whole run is the run
    started with trainer.batch_size=b/2, logged micro-batch included."""
    configs = configs_of("fashion_mnist", tmp_path_factory)
    halved = probe("fashion_mnist", configs("trainer.log_every_steps=1"), steps=None, error_at=1, error_in="forward")
    started = probe("fashion_mnist", configs("trainer.log_every_steps=1", "trainer.batch_size=8"), steps=None)
    assert halved.summary["model_digest"] == started.summary["model_digest"]
    assert halved.summary["micro_batch_size"] == started.summary["micro_batch_size"] == 8
    logged = [json.loads(line) for line in (Path(halved.cfg.run_dir) / "tensorboard" / "metrics.jsonl").read_text()
              .splitlines()]
    assert [line["train/micro_batch_size"] for line in logged if "train/loss" in line] == [8.0] * len(halved.logged_at)


def test_an_error_that_is_not_memory_is_not_retried(tmp_path_factory: pytest.TempPathFactory) -> None:
    configs = configs_of("fashion_mnist", tmp_path_factory)
    with pytest.raises(RuntimeError, match="raised by the test"):
        probe("fashion_mnist", configs(), steps=None, error_at=2, error=RuntimeError)


def test_micro_batches_of_one_sample_that_still_run_out_end_in_one_line(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    configs = configs_of("fashion_mnist", tmp_path_factory)
    seen = probe("fashion_mnist", configs("trainer.batch_size=1", "trainer.global_batch_size=2"), steps=None,
                 error_at=2)
    assert "trainer.out_of_memory=halve cut trainer.batch_size=1 down to micro-batches of 1 sample(s), which do " \
           "not fit either" in seen.error
    assert "\n" not in seen.error


def test_the_size_is_kept_on_the_same_device_and_tried_again_on_another(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that halved at step 2 and stopped at step 3, resumed: on the same device it goes on
    with the halved micro-batch, to the digest of the uninterrupted halved run; on another (here
    a pretended bigger GPU) it starts again from trainer.batch_size."""
    configs = configs_of("fashion_mnist", tmp_path_factory)
    uninterrupted = probe("fashion_mnist", configs(), steps=None, error_at=2)
    interrupted = configs()
    probe("fashion_mnist", interrupted, steps=3, error_at=2)
    same_device = probe("fashion_mnist", interrupted, steps=None)
    assert same_device.run.micro_batch == 8
    assert same_device.summary["model_digest"] == uninterrupted.summary["model_digest"]

    elsewhere = configs()
    probe("fashion_mnist", elsewhere, steps=3, error_at=2)
    monkeypatch.setattr("common.run.out_of_memory.device_description",
                        lambda device, world_size: "a bigger GPU x 1 rank")
    bigger = probe("fashion_mnist", elsewhere, steps=None)
    assert bigger.run.micro_batch == 16 and bigger.summary["micro_batch_size"] == 16


# ---- 2 gloo ranks --------------------------------------------------------------------------------


def _two_ranks(rank: int, cases: dict[str, tuple[list[str], list[int]]], folder: Path) -> None:
    """Each case on 2 ranks: out of memory at step 2 on the ranks it names."""
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), launcher="torchrun")
    results: dict[str, Any] = {}
    for name, (settings, failing) in cases.items():
        recipe = name.split("-")[0]
        configs = Configs(recipe, folder / f"{name}-rank{rank}", settings)
        for label, error_at in (("halved", 2 if rank in failing else None), ("plain", None)):
            seen = probe(recipe, configs(f"run_dir={folder / name / label}"), steps=None, dist_info=info,
                         error_at=error_at, fixed_statistics=True)
            assert seen.error is None, seen.error
            results[f"{name}-{label}"] = {"micro_batch": seen.run.micro_batch, "gradients": seen.gradients,
                                          "summary": seen.summary if rank == 0 else None}
    torch.save(results, folder / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """fashion_mnist (DDP's place taken by the run's reduction) with only rank 1 out of memory, and
    timm_imagenet under FSDP2 with both ranks out of memory in the same micro-batch; each against the
    run that does not run out. BatchNorm normalises with its running statistics and dropout is off
    (``fixed_statistics``), so that a step's gradient is the same however its samples are cut."""
    folder = tmp_path_factory.mktemp("oom-two-ranks")
    b = CASES["timm_imagenet"][0]
    cases = {
        # agreeing where the ranks agree on the checkpoint cadence, every step here
        "fashion_mnist": ([*tiny_settings("fashion_mnist", tmp_path_factory), "trainer.batch_size=16",
                           "trainer.global_batch_size=64", *HALVE, "checkpoint.every_steps=0",
                           "checkpoint.sync_every_steps=1"], [1]),
        "timm_imagenet-fsdp": ([*tiny_settings("timm_imagenet", tmp_path_factory), f"trainer.batch_size={b}",
                                f"trainer.global_batch_size={4 * b}", *HALVE, "fsdp.enabled=true"], [0, 1]),
    }
    spawn_ranks(_two_ranks, cases, folder)
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "failing"), [("fashion_mnist", [1]), ("timm_imagenet-fsdp", [0, 1])])
def test_on_two_ranks_every_rank_agrees_on_the_halved_micro_batch(
        name: str, failing: list[int], two_ranks: list[dict[str, Any]]) -> None:
    b = 16 if name == "fashion_mnist" else CASES["timm_imagenet"][0]
    assert [ranks[f"{name}-halved"]["micro_batch"] for ranks in two_ranks] == [b // 2, b // 2]
    summary = two_ranks[0][f"{name}-halved"]["summary"]
    assert summary["micro_batch_size"] == b // 2
    assert [(record["step"], record["ranks"]) for record in summary["out_of_memory"]] == [(2, failing)]
    plain = two_ranks[0][f"{name}-plain"]
    assert plain["micro_batch"] == b and plain["summary"]["micro_batch_size"] == b
    for rank in range(2):  # the same step's gradient, however it was cut
        for got, expected in zip(two_ranks[rank][f"{name}-halved"]["gradients"], plain["gradients"]):
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6)


def test_an_out_of_memory_error_after_the_backward_passes_is_not_retried(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the step's forward and backward passes (gradient clipping, the optimizer step) the
    weights may already move: the error goes on to end the run (in one line, common/entry.py), as
    without trainer.out_of_memory, and says why halving did not apply."""
    from common.records.profiling import out_of_memory_error
    from common.run.training_run import TrainingRun
    from tests.recipe_probe import CPU

    clip, clipped = TrainingRun.clip_grad_norm, []

    def clip_then_run_out(run: TrainingRun, parameters: Any) -> Any:
        clipped.append(run.progress.step + 1)
        norm = clip(run, parameters)
        if run.progress.step + 1 == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return norm

    monkeypatch.setattr(TrainingRun, "clip_grad_norm", clip_then_run_out)
    with pytest.raises(torch.OutOfMemoryError):
        probe("fashion_mnist", configs_of("fashion_mnist", tmp_path_factory)(), steps=None)
    assert clipped == [1, 2]
    line = str(out_of_memory_error(torch.OutOfMemoryError("CUDA out of memory"), "run", CPU, 16, 32, "halve"))
    assert line.endswith("trainer.out_of_memory=halve redoes a step whose forward or backward pass runs out, and "
                         "this error came elsewhere (the optimizer step, an evaluation: trainer.eval_batch_size)")


def test_a_torchrun_launch_where_one_rank_runs_out_goes_on_with_every_rank_halved(
        fashion_data: Path, tmp_path: Path) -> None:
    """The command line on 2 gloo ranks (tests/pause_hook: CUDA's error in rank 1's step 2)."""
    import os

    from tests.conftest import REPO, read_summary, recipe_env, run_recipe
    from tests.trained_runs import TINY

    env = recipe_env(PYTHONPATH=f"{REPO / 'tests' / 'pause_hook'}{os.pathsep}{REPO}", OOM_AT_STEP="2", OOM_RANK="1")
    run_dir = tmp_path / "run"
    result = run_recipe("fashion_mnist", [*TINY["fashion_mnist"], f"data.root={fashion_data}", f"run_dir={run_dir}",
                                          "trainer.out_of_memory=halve", "trainer.global_batch_size=64",
                                          "trainer.max_steps=4"], nproc=2, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("rank 1: out of memory in step 2 on rank(s) 1 with micro-batches of 16: the step again with 8"
            in result.stdout)
    summary = read_summary(run_dir)
    assert summary["steps"] == 4 and summary["micro_batch_size"] == 8
    assert [(record["step"], record["ranks"]) for record in summary["out_of_memory"]] == [(2, [1])]


def test_the_gpu_decoder_running_out_of_memory_is_the_runs_to_handle(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.decode=gpu (run on the CPU here), nvjpeg out of memory in the first step's batch: not a file
    to decode again one by one, then on the CPU, but the step's error, which trainer.out_of_memory=halve
    redoes with half the micro-batch."""
    from common.data.device_input import DeviceTrainInput

    decode, calls = DeviceTrainInput.decode_on_device, []

    def runs_out_once(self: DeviceTrainInput, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(len(pieces))
        if len(calls) == 2:  # the first training batch (the first call checks the decoder at start-up)
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return decode(self, pieces)

    monkeypatch.setattr(DeviceTrainInput, "decode_on_device", runs_out_once)
    b = CASES["timm_imagenet"][0]
    seen = probe("timm_imagenet", configs_of("timm_imagenet", tmp_path_factory)("data.decode=gpu"), steps=None)
    assert seen.error is None, seen.error
    assert calls[:3] == [1, b, b // 2], "the step again with half the micro-batch, decoded as a batch"
    assert seen.summary["out_of_memory"] == [{"step": 1, "ranks": [0], "micro_batch_size": b // 2,
                                              "found_on": "cpu x 1 rank"}]
