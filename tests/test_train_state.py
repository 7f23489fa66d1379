"""What a checkpoint restores: RNG states from any device, and every rank's partial metric sums."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import train_state
from common.checkpoint import CheckpointManager
from common.metrics import SumMetrics
from tests.conftest import free_port


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
    train_state.seed_everything(7)
    saved = train_state.rng_state()
    expected = draws()
    train_state.seed_everything(8)
    train_state.set_rng_state(on_accelerator(saved))
    assert draws() == expected


def _sums_worker(rank: int, world_size: int, port: int, directory: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # Rank 0 has seen 1 sample (loss 1.0), rank 1 three (loss 6.0): the totals are 4 samples, 7.0.
        sums = SumMetrics(torch.device("cpu"))
        sums.add(loss=torch.tensor([1.0]) if rank == 0 else torch.tensor([1.0, 2.0, 3.0]), count=1 + 2 * rank)
        totals = sums.reduce()
        train_state.seed_everything(100 + rank)  # each rank's own random streams
        state = train_state.capture(None, None, None, None, None, train_state.Progress(step=3), sums)
        expected_draws = draws()
        checkpoints = CheckpointManager(directory)
        checkpoints.save(3, state)

        resumed = SumMetrics(torch.device("cpu"))
        train_state.seed_everything(0)
        train_state.restore(checkpoints.load_latest().state, None, None, None, None, None, resumed)
        (directory.parent / f"rank{rank}.json").write_text(json.dumps(
            {"before": totals, "after": resumed.reduce(), "same draws": draws() == expected_draws}))
    finally:
        dist.destroy_process_group()


def test_partial_metric_sums_and_random_streams_of_every_rank_survive_a_resume(tmp_path: Path) -> None:
    """After a 2-rank resume each rank holds its own partial sums and its own RNG states again
    (not rank 0's twice); on one rank the totals of both are kept."""
    directory = tmp_path / "checkpoints"
    mp.spawn(_sums_worker, args=(2, free_port(), directory), nprocs=2, join=True)
    for rank in range(2):
        sums = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sums["before"] == sums["after"] == {"count": 4.0, "loss": 7.0}
        assert sums["same draws"], f"rank {rank} does not draw what it would have drawn without the restart"

    one_rank = SumMetrics(torch.device("cpu"))
    train_state.restore(CheckpointManager(directory).load_latest().state, None, None, None, None, None, one_rank)
    assert one_rank.reduce() == {"count": 4.0, "loss": 7.0}


def test_capture_then_restore_brings_back_every_part_of_the_training_state(tmp_path: Path) -> None:
    """Through a real checkpoint: the weights, the optimizer's moments, the LR schedule's position,
    the fp16 grad scaler's scale and growth count, the sampler's place in its epoch, the progress
    counters and the RNGs, each into fresh objects built as a restarted run builds them."""
    from common.optim import warmup_cosine
    from common.sampler import ResumableDistributedSampler

    def build() -> tuple:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = warmup_cosine(optimizer, 2, 10, 0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        sampler = ResumableDistributedSampler(40, seed=1)
        return model, optimizer, scheduler, scaler, sampler

    model, optimizer, scheduler, scaler, sampler = build()
    sampler.set_epoch(1)
    for _ in range(3):
        scaler.scale(model(torch.randn(5, 4)).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()
        sampler.advance(5)
    assert scaler.get_scale() == 2048.0 and scaler.state_dict()["_growth_tracker"] == 1
    progress = train_state.Progress(step=3, epoch=1, extra={"stage": "probe"})
    train_state.seed_everything(11)
    checkpoints = CheckpointManager(tmp_path)
    checkpoints.save(3, train_state.capture(model, optimizer, scheduler, scaler, sampler, progress))
    expected_draws = draws()

    fresh = build()
    train_state.seed_everything(12)
    restored = train_state.restore(checkpoints.load_latest().state, *fresh)
    model2, optimizer2, scheduler2, scaler2, sampler2 = fresh
    assert draws() == expected_draws
    assert (restored.step, restored.epoch, restored.extra, restored.resumes) == (3, 1, {"stage": "probe"}, 1)
    assert train_state.model_digest(model2) == train_state.model_digest(model)
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(optimizer2.state_dict()["state"][0][key], value), key
    assert scheduler2.state_dict() == scheduler.state_dict() and scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert scaler2.state_dict() == scaler.state_dict()
    assert (sampler2.epoch, sampler2.consumed, list(sampler2)) == (1, 15, list(sampler))
