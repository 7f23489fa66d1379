"""Data helpers shared by recipes whose input pipeline runs in DataLoader workers.

Random augmentation inside DataLoader workers normally depends on the worker seeds, which
PyTorch draws when an iterator is created. A run that resumes mid-epoch creates its iterator
at a different moment, so its augmentations (and its final weights) would differ from an
uninterrupted run. :class:`PerSampleSeeded` makes each sample's randomness a function of
``(seed, epoch, index)`` only, which keeps resume bit-exact whatever the worker count.
A stop signal sent to a rank's whole process group is left to the rank
(:func:`leave_stop_signals_to_the_rank`).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from common.data.sampler import ResumableDistributedSampler
from common.pytorch.rng import seeded_global_rng


class PerSampleSeeded(Dataset):
    """Wraps a dataset whose ``__getitem__`` uses Python, NumPy or torch global randomness.

    Expects ``(epoch, index)`` keys, as yielded by ``ResumableDistributedSampler(yield_epoch=True)``.
    The global generators are restored afterwards, so using it without workers does not
    disturb the training process's own random stream.
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
    """The CPU cores this process may use (its affinity mask, capped by SLURM_CPUS_PER_TASK), shared
    with the other ranks torchrun started on this node (LOCAL_WORLD_SIZE); at least 1. Under
    ``srun`` with one task per rank each task has its own cores, and LOCAL_WORLD_SIZE is unset."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        cores = min(cores, int(os.environ["SLURM_CPUS_PER_TASK"]))
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def leave_stop_signals_to_the_rank(worker_id: int) -> None:
    """A DataLoader worker's ``worker_init_fn``: SIGTERM and SIGUSR1 are its rank's to act on.

    torchrun forwards a stop signal to each rank's whole process group, and SLURM signals every
    process of a job step. PyTorch's SIGTERM handler in a worker exits quietly only when the
    worker's parent sent it and otherwise dies of it, so the rank failed with "DataLoader worker
    exited unexpectedly" instead of writing its stop checkpoint (exit 1, not 75: no requeue).
    Here both signals wait in a thread of the worker: SIGUSR1 is dropped, and SIGTERM ends the
    worker only when its parent sent it (the loader shutting it down, as PyTorch's handler does).
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
    """A DataLoader over a resumable sampler with the settings that keep a GPU fed, read one epoch
    per iterator (an evaluation's).

    - ``num_workers=-1`` (``trainer.num_workers``' default) starts one worker per CPU core this
      rank gets (:func:`cpu_cores_per_rank`).
    - ``generator``: pass one of its own when training uses the global torch RNG (dropout): a new
      DataLoader iterator draws its workers' base seed from it, and a resumed run creates its
      iterator at a different step than the uninterrupted run did."""
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
    """A training DataLoader whose batches are ``batches``' lists of sampler keys: a plan's
    :class:`~common.run.steps.EpochBatches`, which runs on past an epoch's end, so that one iterator
    serves the whole run and its workers prepare the next epoch's first batches before this one
    ends. The other arguments are :func:`make_loader`'s."""
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


def split_micro_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` (what a loader or the sampler hands out: tensors, and tuples, lists and dicts of
    them, along their first dimension) cut into pieces of ``size`` samples, the last one shorter.
    An object with a ``split_samples(size)`` method cuts itself (packed file bytes)."""
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
