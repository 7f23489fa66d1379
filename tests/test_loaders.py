"""Training loaders (common/data/loaders.py): their workers leave stop signals to their rank, and
one iterator serves the whole run, so the next epoch's first batches are ready before it starts.

torchrun forwards SIGTERM and SIGUSR1 to each rank's whole process group, and SLURM signals
every process of a step, so the workers get them too. A worker must outlive both (the rank stops
after its checkpoint and shuts its workers down), but still end when its rank terminates it.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch.utils.data import Dataset

from common.data.loaders import make_loader
from common.data.sampler import ResumableDistributedSampler
from common.run.steps import EpochBatches, EpochTail, StepPlan
from common.run.training_run import TrainingRun
from tests.recipe_probe import Configs, probe, tiny_settings

SAMPLES = 32


class Numbers(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def test_a_worker_outlives_stop_signals_from_others_and_ends_when_its_rank_terminates_it() -> None:
    sampler = ResumableDistributedSampler(SAMPLES, shuffle=False, drop_last=False)
    loader = make_loader(Numbers(), sampler, batch_size=1, num_workers=1, pin_memory=False)
    batches = iter(loader)
    seen = [int(next(batches))]  # the worker runs, and has prefetched the next batches
    (worker,) = batches._workers
    for name in ("USR1", "TERM"):  # sent by another process, as torchrun's killpg and SLURM do
        subprocess.run(["kill", f"-{name}", str(worker.pid)], check=True)
    seen += [int(batch) for batch in batches]
    assert seen == list(range(SAMPLES)) and worker.is_alive()

    worker.terminate()  # SIGTERM from the worker's parent: the loader shutting it down
    worker.join(timeout=30)
    assert worker.exitcode == 0


@pytest.mark.parametrize("tail", list(EpochTail))
@pytest.mark.parametrize("world_size", [1, 3])
def test_epoch_batches_are_the_micro_batches_each_epochs_steps_take(tail: EpochTail, world_size: int) -> None:
    """From a position mid-epoch to the run's end: each epoch's batches as a new DataLoader over the
    sampler would make them, cut by the plan's tail rule, none across an epoch's end."""
    sampler = ResumableDistributedSampler(53, world_size - 1, world_size, seed=3, yield_epoch=True)
    plan = StepPlan(sampler, micro_batch=4, accumulate=3, world_size=world_size, epochs=3, tail=tail)
    sampler.set_epoch(1, 9)
    batches = list(plan.epoch_batches())
    assert len(plan.epoch_batches()) == len(batches)
    expected = []
    for epoch in (1, 2):
        keys = list(sampler)
        for _, samples in plan._steps_left():
            step, keys = keys[:samples], keys[samples:]
            expected += [step[first:first + plan.micro_batch] for first in range(0, samples, plan.micro_batch)]
        sampler.set_epoch(epoch + 1)
    assert batches == expected


def test_the_next_epochs_first_batches_are_asked_for_before_the_epoch_ends(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """timm_imagenet with a loader worker, two epochs: one iterator for both, and the first batches
    of epoch 2 handed to the worker before epoch 1's evaluation, not after it."""
    events: list[tuple[str, int]] = []
    batches, evaluate = EpochBatches.__iter__, TrainingRun._evaluate

    def noted_batches(self: EpochBatches):  # noqa: ANN202
        events.append(("iterator", -1))
        for batch in batches(self):
            events.append(("batch", batch[0][0]))  # its keys are (epoch, index)
            yield batch

    def noted_evaluate(run: TrainingRun, function):  # noqa: ANN001, ANN202
        events.append(("evaluate", run.progress.epoch))
        return evaluate(run, function)

    monkeypatch.setattr(EpochBatches, "__iter__", noted_batches)
    monkeypatch.setattr(TrainingRun, "_evaluate", noted_evaluate)
    configs = Configs("timm_imagenet", tmp_path_factory.mktemp("epoch-stream"),
                      tiny_settings("timm_imagenet", tmp_path_factory))
    seen = probe("timm_imagenet", configs("trainer.num_workers=1", "trainer.epochs=2"), steps=None)
    assert seen.error is None, seen.error
    assert [event for event in events if event[0] == "iterator"] == [("iterator", -1)], "one iterator for the run"
    first_of_epoch_2 = events.index(("batch", 1))
    assert first_of_epoch_2 < events.index(("evaluate", 1)), f"epoch 2 was asked for only after epoch 1: {events}"
