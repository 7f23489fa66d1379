"""Data helpers shared by recipes whose input pipeline runs in DataLoader workers.

Random augmentation inside DataLoader workers normally depends on the worker seeds, which
PyTorch draws when an iterator is created. A run that resumes mid-epoch creates its iterator
at a different moment, so its augmentations (and its final weights) would differ from an
uninterrupted run. :class:`PerSampleSeeded` makes each sample's randomness a function of
``(seed, epoch, index)`` only, which keeps resume bit-exact whatever the worker count.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from common.sampler import ResumableDistributedSampler


@functools.cache
def channel_constants(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a ``[1, C, 1, 1]`` float tensor on ``device``, made once per device and
    reused: making it per batch would copy from the host and synchronise with the GPU each time."""
    return torch.tensor(values, device=device).view(1, -1, 1, 1)


def sample_seed(*keys: int) -> int:
    """A 63-bit seed that depends only on ``keys`` (e.g. seed, epoch, index)."""
    digest = hashlib.blake2b(":".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator for batch-level augmentation seeded from ``keys`` (e.g. seed, step, rank),
    so a resumed run draws exactly what the uninterrupted run drew at that step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(sample_seed(*keys))
    return generator


@contextlib.contextmanager
def seeded_global_rng(*keys: int) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's CPU global generators from ``keys`` for the block, and
    restore them after it: for library code that draws only from global state (timm's Mixup,
    torchvision's RandAugment), so that a resumed run draws what the uninterrupted run drew."""
    seed = sample_seed(*keys)
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that reseeds CUDA too
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


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
    """A DataLoader over a resumable sampler with the settings that keep a GPU fed.

    ``num_workers=-1`` (``trainer.num_workers``' default) starts one worker per CPU core this
    rank gets (:func:`cpu_cores_per_rank`). Pass a ``generator`` of its own when training uses
    the global torch RNG (dropout): a new DataLoader iterator draws its workers' base seed from
    it, and a resumed run creates its iterator at a different step than the uninterrupted run did.
    """
    if num_workers < 0:
        num_workers = cpu_cores_per_rank()
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        collate_fn=collate_fn,
        drop_last=drop_last,
        generator=generator,
    )
