"""timm's repeated-augmentation sampler, made resumable on the policy of :mod:`common.data.sampler`.

timm's ``RepeatAugSampler`` (from DeiT) repeats every index of a shuffled epoch ``repeats``
times in a row ([7, 7, 7, 2, 2, 2, ...]) and lets ranks take positions interleaved, so with
``repeats`` or more ranks the copies of one image are augmented on different ranks. An epoch
uses only the first ``len(dataset)`` positions (rounded down to a multiple of
``selected_round``): about ``1/repeats`` of the images, each seen ``repeats`` times.

Here that order is the global order of :class:`ResumableDistributedSampler`: progress is the
number of positions consumed, so a run resumes exactly where it stopped, on any number of ranks.
"""

from __future__ import annotations

import torch

from common.data.sampler import ResumableDistributedSampler


class RepeatedAugmentationSampler(ResumableDistributedSampler):
    """Yields ``(draw, index)`` keys for :class:`common.data.loaders.PerSampleSeeded`.

    ``draw = epoch * repeats + copy`` differs between the copies of one image, so each copy gets
    its own augmentation, and depends only on the position in the epoch, never on the rank.
    """

    def __init__(
        self,
        dataset_size: int,
        repeats: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        selected_round: int = 256,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, not {repeats}")
        used = dataset_size
        if selected_round and dataset_size >= selected_round:
            used = dataset_size // selected_round * selected_round
        super().__init__(used, rank, world_size, seed=seed, shuffle=True, drop_last=True, yield_epoch=True)
        self.dataset_size = dataset_size
        self.repeats = repeats

    def global_order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + epoch)
        permutation = torch.randperm(self.dataset_size, generator=generator)
        return permutation.repeat_interleave(self.repeats)[: self.num_samples]

    def keys(self, epoch: int, consumed: int = 0) -> list[tuple[int, int]]:
        positions = torch.arange(consumed, self.num_samples)[self.rank :: self.world_size][: self.remaining(consumed)]
        indices = self.global_order(epoch)[positions]
        draws = epoch * self.repeats + positions % self.repeats
        return list(zip(draws.tolist(), indices.tolist()))

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "repeats": self.repeats, "dataset_size": self.dataset_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("repeats") != self.repeats or state.get("dataset_size") != self.dataset_size:
            raise ValueError(
                f"the checkpoint used {state.get('repeats')} repeats of {state.get('dataset_size')} images, "
                f"this run uses {self.repeats} of {self.dataset_size}"
            )
        super().load_state_dict(state)
