"""Whole image batches on the training device: per-channel normalisation and a seeded random crop and flip.

- Used by recipes whose dataset lives on the device (fashion_mnist, cifar100_resnet50, dinov2_fsdp) and
  by the JPEG recipes' uint8 batches (``common/data/images.py``).
- Needs only torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class Normalize:
    """Batches to float on ``device``, normalised with per-channel ``mean`` and ``std``.

    - ``mean``, ``std``: on the 0-1 scale. ``input_max``: the input's largest value (255 for uint8, 1 for [0, 1]).
    - The constants are made on ``device`` once: per batch they would cost a host copy and a GPU sync.
    """

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
    """torchvision's ``RandomCrop(padding=...)`` and ``RandomHorizontalFlip`` on a whole ``[B, C, H, W]`` batch.

    - ``padding``: pixels on every side, with ``fill`` or by reflection (``reflect``); ``flip``: each image
      flipped with probability 1/2.
    - Every draw comes from ``generator`` (offsets, then flips): seeded per step, a resume crops identically.
    """
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
