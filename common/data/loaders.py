"""DataLoader set-up for recipes whose input pipeline runs in workers, kept exact across resumes.

- :class:`PerSampleSeeded`: each sample's randomness depends on ``(seed, epoch, index)`` only, not on
  the worker seeds PyTorch draws when an iterator is made (a resumed run makes it at another moment).
- :func:`leave_stop_signals_to_the_rank`: a stop signal sent to the whole process group is the rank's.
- :func:`split_micro_batch`: a batch cut into micro-batches; :func:`halved`: the next one's size.
- :func:`copied_ahead`: each batch's copy to the GPU started while the one before trains.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from common.data.sampler import ResumableDistributedSampler
from common.pytorch.nested import tensors_in
from common.pytorch.rng import seeded_global_rng


class PerSampleSeeded(Dataset):
    """Wraps a dataset whose ``__getitem__`` uses Python, NumPy or torch global randomness.

    - Keys: ``(epoch, index)``, as ``ResumableDistributedSampler(yield_epoch=True)`` yields them.
    - The global generators are restored after each sample: without workers, the training
      process's own random stream is undisturbed.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        with seeded_global_rng(self.seed, epoch, index):
            return self.dataset[index]


def cpu_cores_per_rank() -> int:
    """The CPU cores this rank may use for its workers; at least 1.

    Its affinity mask, capped by ``SLURM_CPUS_PER_TASK``, divided among the ``LOCAL_WORLD_SIZE`` ranks torchrun
    started on the node (unset under ``srun``, where each task has its own cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        cores = min(cores, int(os.environ["SLURM_CPUS_PER_TASK"]))
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def leave_stop_signals_to_the_rank(worker_id: int) -> None:
    """A DataLoader worker's ``worker_init_fn``: SIGTERM and SIGUSR1 are its rank's to act on.

    - Why: torchrun and SLURM signal every process of a rank, and PyTorch's handler killed a worker on
      a SIGTERM its parent did not send, so the rank failed ("DataLoader worker exited unexpectedly",
      exit 1, no requeue) instead of writing its stop checkpoint (exit 75).
    - Now a thread of the worker waits for both: SIGUSR1 is dropped, SIGTERM ends the worker only when
      its parent (the loader shutting down) sent it. A no-op where ``signal.sigwaitinfo`` is missing (macOS).
    """
    if not hasattr(signal, "sigwaitinfo"):  # macOS: PyTorch's own handling stays
        return
    parent, stops = os.getppid(), {signal.SIGTERM, signal.SIGUSR1}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # the main thread's mask, which the waiter inherits

    def wait() -> None:
        while True:
            received = signal.sigwaitinfo(stops)
            if received.si_signo == signal.SIGTERM and received.si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait, name="stop-signals", daemon=True).start()


def make_loader(
    dataset: Dataset,
    sampler: ResumableDistributedSampler,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
    collate_fn: Callable | None = None,
    drop_last: bool = False,
    generator: torch.Generator | None = None,
) -> DataLoader:
    """A DataLoader over a resumable sampler, one epoch per iterator (an evaluation's), set to keep a GPU fed.

    - ``num_workers=-1`` (``trainer.num_workers``' default): one worker per core this rank gets
      (:func:`cpu_cores_per_rank`).
    - ``generator``: give it its own when training uses the global torch RNG (dropout): each new
      iterator draws its workers' seed from it, and a resumed run makes its iterator at another step.
    """
    return _loader(dataset, num_workers, pin_memory, collate_fn, generator, sampler=sampler, batch_size=batch_size,
                   drop_last=drop_last)


def make_train_loader(
    dataset: Dataset,
    batches: Iterable[list[Any]],
    num_workers: int,
    pin_memory: bool,
    collate_fn: Callable | None = None,
    generator: torch.Generator | None = None,
) -> DataLoader:
    """A training DataLoader whose one iterator serves the whole run.

    - ``batches``: lists of sampler keys, a plan's :class:`~common.run.steps.EpochBatches`, which runs on
      past an epoch's end so workers prepare the next epoch's first batches early.
    - Other arguments: :func:`make_loader`'s.
    """
    return _loader(dataset, num_workers, pin_memory, collate_fn, generator, batch_sampler=batches)


def _loader(dataset: Dataset, num_workers: int, pin_memory: bool, collate_fn: Callable | None,
            generator: torch.Generator | None, **batching: Any) -> DataLoader:
    if num_workers < 0:
        num_workers = cpu_cores_per_rank()
    return DataLoader(
        dataset,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        collate_fn=collate_fn,
        generator=generator,
        worker_init_fn=leave_stop_signals_to_the_rank if num_workers > 0 else None,
        **batching,
    )


def copied_ahead(batches: Iterator[Any], to_device: Callable[[Any], Any], device: torch.device) -> Iterator[Any]:
    """``batches`` through ``to_device``, each one's copy started while the batch before is trained on.

    - Why: a copy queued on the training stream runs between two steps' kernels, and the GPU waits
      for it (timm's ``PrefetchLoader`` copies on a side stream too).
    - On a GPU: the copy runs on a side stream; when a batch is handed out the training stream waits
      for its copy (an event, not the next batch's), and its memory is marked as used there, so the
      allocator cannot hand it to the next copy early. Elsewhere: ``to_device`` as each batch comes.
    """
    if device.type != "cuda":
        yield from map(to_device, batches)
        return
    stream, ahead = torch.cuda.Stream(device), None
    for batch in batches:
        with torch.cuda.stream(stream):
            copied, ready = to_device(batch), torch.cuda.Event()
            ready.record(stream)
        if ahead is not None:
            yield _handed_over(*ahead, device)
        ahead = (copied, ready)
    if ahead is not None:
        yield _handed_over(*ahead, device)


def _handed_over(batch: Any, ready: torch.cuda.Event, device: torch.device) -> Any:
    training = torch.cuda.current_stream(device)
    training.wait_event(ready)
    for tensor in tensors_in(batch):
        if tensor.device.type == "cuda":
            tensor.record_stream(training)
    return batch


def halved(size: int) -> int:
    """A micro-batch after one more out-of-memory error: half, rounded up."""
    return math.ceil(size / 2)


def split_micro_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` cut along its first dimension into pieces of ``size`` samples, the last one shorter.

    Takes tensors and tuples, lists and dicts of them; an object with ``split_samples(size)`` cuts itself (packed
    file bytes). Raises ``TypeError`` for anything else."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if hasattr(batch, "split_samples"):
        return batch.split_samples(size)
    if isinstance(batch, tuple):
        return [tuple(fields) for fields in zip(*(split_micro_batch(field, size) for field in batch))]
    if isinstance(batch, dict):
        pieces = {key: split_micro_batch(value, size) for key, value in batch.items()}
        return [type(batch)(zip(pieces, values)) for values in zip(*pieces.values())]
    if isinstance(batch, list):  # one entry per sample (file paths)
        return [batch[start : start + size] for start in range(0, len(batch), size)]
    raise TypeError(f"cannot cut a {type(batch).__name__} into micro-batches")
