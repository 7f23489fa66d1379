"""Whole image batches on the training device: per-channel normalisation and a seeded random
crop and flip.

Recipes whose dataset lives on the device (fashion_mnist, cifar100_resnet50, dinov2_fsdp) augment
a batch at a time where the model runs; the JPEG recipes normalise their uint8 batches there
(``common/data/images.py``). Both need only torch, so a recipe that uses them imports nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class Normalize:
    """Batches to float, normalised with per-channel ``mean`` and ``std`` (given on the 0-1 scale),
    on ``device``. The constants are made there once: made per batch, they would be a copy from
    the host, and a synchronisation with a GPU, each time. ``input_max`` is the largest value of
    the input: 255 for uint8 (or 0-255 floats), 1 for floats in [0, 1]."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], device: torch.device,
                 input_max: float = 255) -> None:
        self.device = device
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        if input_max != 1:
            self.mean, self.std = self.mean * input_max, self.std * input_max

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return (images.to(self.device, non_blocking=True).float() - self.mean) / self.std


def random_crop_and_flip(images: torch.Tensor, padding: int, flip: bool, generator: torch.Generator,
                         fill: float = 0.0, reflect: bool = False) -> torch.Tensor:
    """A random crop of each image after padding it by ``padding`` pixels on every side (with
    ``fill``, or by reflection), and a horizontal flip of each with probability 1/2 when ``flip``:
    torchvision's ``RandomCrop(padding=...)`` and ``RandomHorizontalFlip`` on a whole ``[B, C, H, W]``
    batch at once. Every draw comes from ``generator`` (crop offsets first, then flips), so a
    generator seeded for the step makes a resumed run crop exactly as the uninterrupted one."""
    batch, channels, height, width = images.shape
    device = images.device
    if padding > 0:
        if reflect:  # reflection padding takes floating point input
            padded = F.pad(images.float(), (padding,) * 4, mode="reflect").to(images.dtype)
        else:
            padded = F.pad(images, (padding,) * 4, value=fill)
        offsets = torch.randint(0, 2 * padding + 1, (2, batch), generator=generator, device=device)
        rows = offsets[0, :, None] + torch.arange(height, device=device)
        cols = offsets[1, :, None] + torch.arange(width, device=device)
        batch_index = torch.arange(batch, device=device)[:, None, None, None]
        channel_index = torch.arange(channels, device=device)[None, :, None, None]
        images = padded[batch_index, channel_index, rows[:, None, :, None], cols[:, None, None, :]]
    if flip:
        flips = torch.rand(batch, generator=generator, device=device) < 0.5
        images = torch.where(flips[:, None, None, None], images.flip(-1), images)
    return images
