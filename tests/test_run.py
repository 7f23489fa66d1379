"""The run contract's pieces: what a checkpoint restores (RNG states from any device, every rank's
partial metric sums), how an epoch becomes optimizer steps, W&B run ids, progress lines, and a
checkpoint write that runs out of disk space."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from common.checkpoint.layout import committed_checkpoints
from common.checkpoint.manager import CheckpointManager
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from common.pytorch.distributed import DistInfo
from common.pytorch.metrics import SumMetrics
from common.pytorch.rng import rng_state, seed_everything, set_rng_state
from common.records.loggers import ProgressLines, RunLogger, wandb_run_id
from common.run.steps import EpochTail, StepPlan, compile_static
from common.run.training_run import TrainingRun
from tests.conftest import run_recipe, spawn_ranks
from tests.run_config import run_config


class OnAccelerator(torch.Tensor):
    """A tensor that behaves as one loaded with ``map_location="cuda"`` does where it matters here:
    NumPy refuses it (as it refuses a CUDA tensor) and ``.cpu()`` gives a plain CPU tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.cpu:
            return result.as_subclass(torch.Tensor)
        return result


def on_accelerator(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.as_subclass(OnAccelerator)
    if isinstance(obj, dict):
        return {key: on_accelerator(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_accelerator(value) for value in obj)
    return obj


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.random()), torch.rand(3).tolist()


def test_rng_states_loaded_to_another_device_than_the_cpu_are_restored() -> None:
    seed_everything(7)
    saved = rng_state()
    expected = draws()
    seed_everything(8)
    set_rng_state(on_accelerator(saved))
    assert draws() == expected


def small_run(directory: Path, sums: SumMetrics, rank: int = 0, world_size: int = 1) -> TrainingRun:
    """A run of a tiny model whose checkpoints go to ``directory``."""
    model = torch.nn.Linear(2, 2)
    sampler = ResumableDistributedSampler(8, rank, world_size)
    plan = StepPlan(sampler, micro_batch=1, accumulate=1, world_size=world_size, epochs=1)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), launcher="test")
    return TrainingRun(run_config(directory.parent, directory), info, plan, model=model,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler, train_sums=sums)


def _sums_worker(rank: int, directory: Path) -> None:
    world_size = 2
    # Rank 0 has seen 1 sample (loss 1.0), rank 1 three (loss 6.0): the totals are 4 samples, 7.0.
    sums = SumMetrics(torch.device("cpu"))
    run = small_run(directory, sums, rank, world_size)
    run.resume()
    sums.add(loss=torch.tensor([1.0]) if rank == 0 else torch.tensor([1.0, 2.0, 3.0]), count=1 + 2 * rank)
    totals = sums.reduce()
    seed_everything(100 + rank)  # each rank's own random streams
    run.save()
    expected_draws = draws()

    resumed = SumMetrics(torch.device("cpu"))
    seed_everything(0)
    small_run(directory, resumed, rank, world_size).resume()
    (directory.parent / f"rank{rank}.json").write_text(json.dumps(
        {"before": totals, "after": resumed.reduce(), "same draws": draws() == expected_draws}))


def test_partial_metric_sums_and_random_streams_of_every_rank_survive_a_resume(tmp_path: Path) -> None:
    """After a 2-rank resume each rank holds its own partial sums and its own RNG states again
    (not rank 0's twice); on one rank the totals of both are kept."""
    directory = tmp_path / "checkpoints"
    spawn_ranks(_sums_worker, directory)
    for rank in range(2):
        sums = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sums["before"] == sums["after"] == {"count": 4.0, "loss": 7.0}
        assert sums["same draws"], f"rank {rank} does not draw what it would have drawn without the restart"

    one_rank = SumMetrics(torch.device("cpu"))
    progress = small_run(directory, one_rank).resume()
    assert one_rank.reduce() == {"count": 4.0, "loss": 7.0}
    assert progress.resumes == 1


def test_a_resume_brings_back_every_part_of_the_training_state(tmp_path: Path) -> None:
    """Through a real checkpoint: the weights, the optimizer's moments, the LR schedule's position,
    the fp16 grad scaler's scale and growth count, the sampler's place in its epoch, the progress
    counters and the RNGs, each into fresh objects built as a restarted run builds them."""
    from common.pytorch.optim import warmup_cosine

    def build() -> TrainingRun:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        sampler = ResumableDistributedSampler(40, seed=1)
        plan = StepPlan(sampler, micro_batch=5, accumulate=1, world_size=1, epochs=3)
        info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="test")
        return TrainingRun(run_config(tmp_path), info, plan,
                           model=model, optimizer=optimizer, scheduler=warmup_cosine(optimizer, 2, 10, 0.0),
                           scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2),
                           sampler=sampler, train_sums=SumMetrics(torch.device("cpu")))

    run = build()
    run.resume()
    run.sampler.set_epoch(1)
    for _ in range(3):
        run.scaler.scale(run.model(torch.randn(5, 4)).square().mean()).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad()
        run.scheduler.step()
        run.sampler.advance(5)
    assert run.scaler.get_scale() == 2048.0 and run.scaler.state_dict()["_growth_tracker"] == 1
    run.progress.step, run.progress.epoch, run.progress.extra = 3, 1, {"stage": "probe"}
    seed_everything(11)
    run.save()
    expected_draws = draws()

    seed_everything(12)
    restored = build()
    progress = restored.resume()
    assert draws() == expected_draws
    assert (progress.step, progress.epoch, progress.extra, progress.resumes) == (3, 1, {"stage": "probe"}, 1)
    for name, value in run.model.state_dict().items():
        assert torch.equal(restored.model.state_dict()[name], value), name
    for key, value in run.optimizer.state_dict()["state"][0].items():
        assert torch.equal(restored.optimizer.state_dict()["state"][0][key], value), key
    assert restored.scheduler.state_dict() == run.scheduler.state_dict()
    assert restored.scheduler.get_last_lr() == run.scheduler.get_last_lr()
    assert restored.scaler.state_dict() == run.scaler.state_dict()
    assert (restored.sampler.epoch, restored.sampler.consumed, list(restored.sampler)) == (1, 15, list(run.sampler))


# ---- steps of an epoch ---------------------------------------------------------------------------


def walk(plan: StepPlan, sampler: ResumableDistributedSampler, micro_batch: int) -> list[tuple[int, int, list[int]]]:
    """(micro-batches, samples, batch sizes) of each step the plan takes through the rest of the epoch."""
    indices = list(sampler)
    batches = [indices[i : i + micro_batch] for i in range(0, len(indices), micro_batch)]
    steps = []
    for group in plan.groups(batches):
        sizes = [len(batch) for batch in group]
        steps.append((len(group), group.samples, sizes))
        sampler.advance(group.samples)
    return steps


@pytest.mark.parametrize(("tail", "steps"), [
    (EpochTail.keep, [(2, 20, [10, 10]), (2, 20, [10, 10]), (1, 8, [8])]),
    (EpochTail.drop_partial_batch, [(3, 30, [10, 10, 10]), (1, 10, [10])]),
    (EpochTail.drop_partial_step, [(3, 30, [10, 10, 10])]),
])
def test_each_epoch_tail_rule_walks_the_steps_it_says(tail: EpochTail, steps: list) -> None:
    """48 samples per rank in micro-batches of 10, 3 per step (keep: 2 per step)."""
    sampler = ResumableDistributedSampler(96, rank=1, world_size=2, seed=3)
    accumulate = 2 if tail == EpochTail.keep else 3
    plan = StepPlan(sampler, micro_batch=10, accumulate=accumulate, world_size=2, epochs=2, tail=tail)
    assert plan.per_epoch == len(steps) and plan.total == 2 * len(steps)
    assert plan.steps_left() == len(steps) and not plan.epoch_done()
    assert walk(plan, sampler, 10) == steps
    assert plan.epoch_done() and plan.steps_left() == 0
    assert plan.drop_last == (tail != EpochTail.keep)


def test_a_resumed_epoch_walks_only_the_steps_left() -> None:
    sampler = ResumableDistributedSampler(48, seed=3)
    plan = StepPlan(sampler, micro_batch=10, accumulate=2, world_size=1, epochs=1, max_steps=2)
    assert plan.total == 2  # max_steps caps the 3 steps of the epoch
    sampler.advance(20)  # the first step was done before the restart
    assert plan.steps_left() == 2
    assert walk(plan, sampler, 10) == [(2, 20, [10, 10]), (1, 8, [8])]


def test_a_step_must_use_all_its_micro_batches() -> None:
    sampler = ResumableDistributedSampler(8)
    plan = StepPlan(sampler, micro_batch=2, accumulate=2, world_size=1, epochs=1)
    groups = plan.groups(iter([[0, 1], [2, 3], [4, 5], [6, 7]]))
    first = next(groups)
    next(iter(first))  # one of its two micro-batches
    with pytest.raises(RuntimeError, match="used 1 of its 2 micro-batches"):
        next(groups)


def test_compiled_full_batches_keep_their_static_graph_after_the_epochs_short_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An EpochTail.keep epoch: full, short, then full micro-batches through trainer.compile's
    forward. The short one gets a static graph of its own; the next full one runs the first graph
    again, not a graph made dynamic by the short batch (the compiler's default)."""
    graphs: list[bool] = []  # per graph compiled: whether a dimension of its inputs is symbolic

    def recording_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(any(isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
            isinstance(size, torch.SymInt) for size in value.shape)) for value in example_inputs))
        return graph.forward

    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **options: compile_with(model, backend=recording_backend,
                                                                                **options))
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 2)
    forward = compile_static(model)
    for batch in (8, 3, 8, 8):
        assert forward(torch.randn(batch, 4)).shape == (batch, 2)
    assert graphs == [False, False], "one static graph for full batches, one for the short batch"
    torch._dynamo.reset()


def test_too_few_samples_for_one_step_is_a_user_error() -> None:
    sampler = ResumableDistributedSampler(12, world_size=2)
    with pytest.raises(UserError, match="6 samples per rank, too few for one optimizer step"):
        StepPlan(sampler, micro_batch=4, accumulate=2, world_size=2, epochs=1, tail=EpochTail.drop_partial_step)


# ---- logs ------------------------------------------------------------------------------------------


def test_wandb_run_id_comes_from_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    jobs = [wandb_run_id(f"runs/fashion_mnist/sweep/optim.lr={lr}") for lr in (0.001, 0.003)]
    assert jobs[0] != jobs[1], "two jobs of a sweep would log into one W&B run"
    assert wandb_run_id("runs/fashion_mnist/default") == wandb_run_id(tmp_path / "runs/fashion_mnist/default")
    assert all(len(job) <= 64 and job.replace("-", "").replace("_", "").isalnum() for job in jobs)


def test_without_a_terminal_progress_is_a_line_at_each_report(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    logger = RunLogger("none", tmp_path, is_main=True, run_name="r")
    progress = logger.progress(total=10, initial=2, description="epoch 1/3")
    assert isinstance(progress, ProgressLines)  # pytest's stdout is not a terminal
    progress.update()
    progress.set_postfix({"loss": "0.5", "top1": "0.75"})
    logger.close()
    assert capsys.readouterr().out == "epoch 1/3: step 3/10, loss 0.5, top1 0.75\n"


# ---- a checkpoint that does not fit -------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """An 8 MB tmpfs (as root); skipped where mounting is not permitted."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_earlier_checkpoints(
        fashion_data: Path, tmp_path: Path, small_disk: Path, async_save: bool) -> None:
    """fashion_mnist's default model makes checkpoints of about 2.4 MB: an 8 MB disk that keeps
    them all takes three, and the fourth save fails."""
    checkpoints = small_disk / "checkpoints"
    result = run_recipe("fashion_mnist", [
        f"data.root={fashion_data}", f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={checkpoints}",
        "trainer.batch_size=16", "trainer.epochs=1", "checkpoint.every_steps=1", "checkpoint.every_seconds=0",
        "checkpoint.keep_last=100", f"checkpoint.async_save={async_save}", "logging.backend=none",
        "logging.progress_bar=false"])
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: could not write a checkpoint to {checkpoints}: No space left on device "
                               "(a checkpoint needs about 2.")
    assert re.search(r"needs about 2\.\d MB, [\d.]+ [kM]?B free there\); the earlier checkpoints are intact$", lines[0])
    assert "Traceback" not in result.stdout + result.stderr
    assert not list(checkpoints.glob(".tmp-*")), "the partial checkpoint was left behind"
    committed = committed_checkpoints(checkpoints)
    assert len(committed) >= 2 and len(list(checkpoints.glob("AtomicDirectory_checkpoint_*"))) == len(committed)
    manager = CheckpointManager(checkpoints)
    for found in committed:
        manager.verify(found.path)  # every digest matches
    assert manager.load_latest().step == committed[-1].step
    assert not (tmp_path / "run" / "summary.json").exists()
