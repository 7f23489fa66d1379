"""A distributed sampler that can stop anywhere and resume exactly, on any number of ranks.

- Each epoch has one global order drawn from ``(seed, epoch)``; rank ``r`` of ``W`` takes positions
  ``r, r+W, ...``. Progress is one number, ``consumed``, so a job back on another number of ranks
  splits the rest of the epoch among them, nothing skipped or repeated.
- ``drop_last=True`` (training): every rank gets as many samples; the last ``remaining % W`` wait.
- ``drop_last=False`` (evaluation): every sample exactly once, no padding, so summed metrics are exact.
- ``yield_epoch=True``: yields ``(epoch, index)`` pairs for :class:`common.data.loaders.PerSampleSeeded`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler):
    """Rank ``rank`` of ``world_size``'s share of ``num_samples`` indices (see the module).

    Raises ``ValueError`` for an empty dataset or a rank outside the world."""

    def __init__(
        self,
        num_samples: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        yield_epoch: bool = False,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.yield_epoch = yield_epoch
        self.epoch = 0
        self.consumed = 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Start ``epoch`` at position ``consumed`` of its global order (0: the beginning)."""
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(f"consumed={consumed} is outside 0..{self.num_samples}")
        self.epoch = epoch
        self.consumed = consumed

    def global_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def remaining(self, consumed: int) -> int:
        """This rank's samples of an epoch from position ``consumed`` of its global order."""
        base, extra = divmod(self.num_samples - consumed, self.world_size)
        return base if self.drop_last else base + (1 if self.rank < extra else 0)

    def __len__(self) -> int:
        return self.remaining(self.consumed)

    def samples_per_rank_in_epoch(self) -> int:
        """Samples each rank sees in a whole epoch started from the beginning (``drop_last`` ranks)."""
        return self.num_samples // self.world_size

    def keys(self, epoch: int, consumed: int = 0) -> list[Any]:
        """This rank's keys of any ``epoch`` from position ``consumed`` on, without moving the sampler."""
        order = self.global_order(epoch)[consumed:]
        mine = order[self.rank :: self.world_size][: self.remaining(consumed)].tolist()
        return [(epoch, index) for index in mine] if self.yield_epoch else mine

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys(self.epoch, self.consumed))

    def index_batches(self, batch_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """This rank's remaining indices as tensors of ``batch_size`` on ``device``, for in-memory datasets.

        The last may be shorter; empty when the epoch is done (a resume from an epoch's last step)."""
        indices = list(self)
        if not indices:
            return ()
        return torch.tensor(indices, dtype=torch.long, device=device).split(batch_size)

    def advance(self, samples_per_rank: int) -> None:
        """Record that every rank has finished ``samples_per_rank`` more samples of this epoch."""
        self.consumed = min(self.num_samples, self.consumed + samples_per_rank * self.world_size)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where the saved run stopped, on any world size.

        Raises ``ValueError`` when the dataset size or the seed differ from the saved ones."""
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"the checkpoint was taken on a dataset of {state['num_samples']} samples, "
                f"this one has {self.num_samples}"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint used sampler seed {state['seed']}, this run uses {self.seed}")
        self.set_epoch(state["epoch"], state["consumed"])
