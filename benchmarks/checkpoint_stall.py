"""Checkpoint stall: how long a checkpoint of ResNet-50 + SGD momentum blocks the training loop.

Three ways to save the same state into ``runs/benchmarks/``, where checkpoints normally go
(what ``common.run.training_run.TrainingRun`` saves of a torchvision
ResNet-50 after one SGD step with momentum, so every momentum buffer exists):

* plain ``torch.save`` to a file: no fsync, no digest, not atomic (the baseline of the issue);
* ``CheckpointManager`` synchronous: write, sha256, fsync, manifest, atomic rename, prune;
* ``CheckpointManager(async_save=True)``: the loop waits only for the copy into (reused)
  host buffers, the same synchronous sequence runs in a background thread.

Each figure is the median over repeats of the time ``save()`` takes to return. The first
asynchronous save allocates its snapshot buffers (page-locked on a GPU) and is reported apart.
On a GPU the model and optimizer state live on the GPU, so every save includes the copy to
the host.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torchvision

from benchmarks.results import Result
from common.checkpoint.manager import CheckpointManager
from common.pytorch.rng import rng_state
from common.run.training_run import Progress

BENCHMARK = "checkpoint stall (ResNet-50 + SGD momentum)"
RUNS = Path(__file__).resolve().parents[1] / "runs" / "benchmarks"  # the file system real checkpoints go to


def resnet50_training_state(device: torch.device) -> dict:
    """What a recipe checkpoints: model, optimizer with momentum buffers, schedule, RNG, progress."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    model(torch.randn(2, 3, 64, 64, device=device)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": [rng_state()], "progress": asdict(Progress(step=1))}


def state_megabytes(state: dict) -> float:
    tensors = [*state["model"].values(), *(v for s in state["optimizer"]["state"].values() for v in s.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)) / 2**20


def timed_ms(action) -> float:
    start = time.perf_counter()
    action()
    return (time.perf_counter() - start) * 1000


def measure(device: torch.device, repeats: int, workdir: Path) -> dict[str, list[float]]:
    state = resnet50_training_state(device)
    synchronous = CheckpointManager(workdir / "sync", keep_last=1)
    background = CheckpointManager(workdir / "async", keep_last=1, async_save=True)
    plain_file = workdir / "plain.pt"
    times: dict[str, list[float]] = {"plain": [], "sync": [], "async": [], "async first": [], "async total": []}
    times["async first"].append(timed_ms(lambda: background.save(0, state)))
    background.wait()
    for step in range(1, repeats + 1):  # interleaved, so all three see the same machine
        times["plain"].append(timed_ms(lambda: torch.save(state, plain_file)))
        times["sync"].append(timed_ms(lambda: synchronous.save(step, state)))
        start = time.perf_counter()
        times["async"].append(timed_ms(lambda: background.save(step, state)))
        background.wait()
        times["async total"].append((time.perf_counter() - start) * 1000)
    times["megabytes"] = [state_megabytes(state)]
    return times


def run(quick: bool) -> list[Result]:
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    results = []
    for device in devices:
        RUNS.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=RUNS, prefix="checkpoint_stall-") as workdir:
            times = measure(device, 2 if quick else 7, Path(workdir))
        plain, sync, blocked = (statistics.median(times[k]) for k in ("plain", "sync", "async"))
        repeats = f"median of {len(times['plain'])}"
        results += [
            Result(BENCHMARK, f"{device.type}: plain torch.save", plain, "ms",
                   f"{times['megabytes'][0]:.0f} MiB of tensors; no fsync, no digest, not atomic; {repeats}"),
            Result(BENCHMARK, f"{device.type}: CheckpointManager, synchronous", sync, "ms",
                   f"loop blocked for the whole atomic, verified write (fsync + sha256); {repeats}"),
            Result(BENCHMARK, f"{device.type}: CheckpointManager, async: loop blocked", blocked, "ms",
                   f"snapshot into reused host buffers (HostSnapshot); {repeats}"),
            Result(BENCHMARK, f"{device.type}: async blocked / plain torch.save", 100 * blocked / plain, "%",
                   "target <= 10"),
            Result(BENCHMARK, f"{device.type}: async blocked / synchronous manager save", 100 * blocked / sync, "%",
                   "target <= 10"),
            Result(BENCHMARK, f"{device.type}: first async save: loop blocked", times["async first"][0], "ms",
                   "allocates the snapshot buffers (page-locked on a GPU) once per run"),
            Result(BENCHMARK, f"{device.type}: async save until written", statistics.median(times["async total"]),
                   "ms", "save() to wait() returning, nothing else running"),
        ]
    return results
