"""Progressive resizing (``data.progressive``): train at a low resolution early and the full one late, as
FFCV's ResNet-50 configurations do (its ``get_resolution``).

- The size of an epoch follows from the epoch alone (:meth:`ImageSizes.of_epoch`): a resumed run trains
  each epoch at the size an uninterrupted one does, and loader workers that prepare the next epoch's first
  batches before the epoch ends make them at that epoch's size (:class:`ProgressiveImages`).
- Evaluation keeps the recipe's evaluation size; the loop logs ``train/image_size``.
- Under ``trainer.compile`` the model is compiled with static shapes (``common.run.steps.compile_static``):
  each size gets one graph, compiled at its first step, and no step after it recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from common.config import ProgressiveConfig
from common.data.images import TrainImages
from common.data.loaders import PerSampleSeeded
from common.errors import UserError

KEY = "data.progressive"


@dataclass(frozen=True)
class ImageSizes:
    """The training image size of every epoch: ``start`` up to ``start_epoch``, then growing linearly to
    ``end`` at ``end_epoch``, rounded to a multiple of ``step``. ``start == end``: one size, no resizing."""

    start: int
    end: int
    start_epoch: int = 0
    end_epoch: int = 0
    step: int = 1

    @classmethod
    def from_config(cls, cfg: ProgressiveConfig, end: int, epochs: int, end_key: str) -> ImageSizes:
        """The sizes ``data.progressive`` asks for, growing to ``end`` (the recipe's training size, ``end_key``)
        within ``epochs`` (``trainer.epochs``). Raises :class:`~common.errors.UserError` for a bad value."""
        if cfg.start_size == 0:
            if cfg.start_epoch or cfg.end_epoch:
                raise UserError(f"{KEY}.start_epoch/end_epoch are set but {KEY}.start_size=0 (off): set "
                                f"{KEY}.start_size, the size of the first epochs, or drop them")
            return cls(end, end)
        if cfg.step < 1:
            raise UserError(f"{KEY}.step must be a positive number of pixels, not {cfg.step}")
        if not 0 < cfg.start_size <= end:
            raise UserError(f"{KEY}.start_size={cfg.start_size} must be between 1 and the training size it grows "
                            f"to, {end_key}={end}: lower it, or raise {end_key}")
        if cfg.start_size % cfg.step or end % cfg.step:
            raise UserError(f"{KEY}.start_size={cfg.start_size} and {end_key}={end} must be multiples of "
                            f"{KEY}.step={cfg.step}: round them, or set another step")
        if not 0 <= cfg.start_epoch <= cfg.end_epoch:
            raise UserError(f"{KEY} grows from start_epoch={cfg.start_epoch} to end_epoch={cfg.end_epoch}: both "
                            f"must be >= 0 and start_epoch <= end_epoch")
        if epochs and cfg.end_epoch >= epochs:
            raise UserError(f"{KEY}.end_epoch={cfg.end_epoch} is not a training epoch (epochs count from 0, and "
                            f"trainer.epochs={epochs}): lower it, so that the last epochs train at {end_key}={end}")
        return cls(cfg.start_size, end, cfg.start_epoch, cfg.end_epoch, cfg.step)

    @property
    def progressive(self) -> bool:
        return self.start != self.end

    def of_epoch(self, epoch: int) -> int:
        """The training image size of ``epoch`` (counted from 0), from nothing else."""
        if epoch <= self.start_epoch:
            return self.start
        if epoch >= self.end_epoch:
            return self.end
        grown = self.start + (self.end - self.start) * (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        return self.step * round(grown / self.step)

    def logged(self, epoch: int) -> dict[str, float]:
        """``train/image_size`` of ``epoch`` when the size varies (nothing otherwise), for ``TrainingRun.log_train``."""
        return {"train/image_size": float(self.of_epoch(epoch))} if self.progressive else {}

    def describe(self) -> str:
        """For the start-up line: how the size grows ("" when it does not)."""
        if not self.progressive:
            return ""
        return (f", grown from {self.start}px (to epoch {self.start_epoch}) by {self.step}px steps to {self.end}px "
                f"(from epoch {self.end_epoch})")

    def distinct(self) -> list[int]:
        """Every size an epoch trains at, smallest first."""
        return sorted({self.of_epoch(epoch) for epoch in range(self.end_epoch + 1)})


class ProgressiveImages(Dataset):
    """Training samples keyed ``(epoch, index)``, each made by the :class:`TrainImages` of its epoch's size
    and seeded from the key as :class:`~common.data.loaders.PerSampleSeeded` seeds it.

    - ``by_size``: one :class:`TrainImages` per size of ``sizes.distinct()`` (an augmentation built for it).
    """

    def __init__(self, by_size: dict[int, TrainImages], sizes: ImageSizes, seed: int) -> None:
        self.by_size = {size: PerSampleSeeded(images, seed) for size, images in by_size.items()}
        self.sizes = sizes

    def __len__(self) -> int:
        return len(next(iter(self.by_size.values())))

    def __getitem__(self, key: tuple[int, int]) -> tuple[dict, object]:
        return self.by_size[self.sizes.of_epoch(key[0])][key]


def check_takes_any_size(model: torch.nn.Module, sizes: ImageSizes, fix: str) -> None:
    """Raise :class:`~common.errors.UserError` when ``sizes`` vary and ``model`` cannot take them all: a timm
    patch embedding with ``strict_img_size`` (a ViT built without ``dynamic_img_size``; ``fix`` says how), or
    patches that do not tile a size (without ``dynamic_img_pad``)."""
    if not sizes.progressive:
        return
    listed = ", ".join(map(str, sizes.distinct()))
    for module in model.modules():
        if getattr(module, "strict_img_size", False):
            raise UserError(f"{KEY}: the model takes {sizes.end}px images only, and epochs train at {listed}px: "
                            f"{fix}, or set {KEY}.start_size=0")
        patch = getattr(module, "patch_size", None)
        if isinstance(patch, tuple) and not getattr(module, "dynamic_img_pad", False) and \
                any(size % side for size in sizes.distinct() for side in patch):
            raise UserError(f"{KEY}: epochs train at {listed}px, which the model's {patch[0]}px patches do not "
                            f"all tile: make {KEY}.start_size and {KEY}.step multiples of {patch[0]}")
