"""CIFAR-100 for a DINOv2 backbone: uint8 tensors on the device, augmented and upsampled per batch.

The images come from the shared reader (``common.cifar100``, the cifar100_resnet50 prep's
layout). The whole split (150 MB) lives on the training device; random crop and flip run at
32x32 on whole batches with a seeded generator, then the batch is upsampled to the backbone's
resolution and normalised with the ImageNet statistics DINOv2 was trained with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.data import channel_constants

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def augment(images: torch.Tensor, padding: int, flip: bool, generator: torch.Generator) -> torch.Tensor:
    """Random crop after reflection padding and random horizontal flip, per sample, on a uint8 batch."""
    batch, channels, height, width = images.shape
    device = images.device
    if padding > 0:
        padded = F.pad(images.float(), (padding,) * 4, mode="reflect").to(images.dtype)
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


def to_model_input(images: torch.Tensor, image_size: int) -> torch.Tensor:
    """uint8 ``[B, 3, 32, 32]`` to normalised float ``[B, 3, image_size, image_size]`` (bicubic)."""
    x = images.float() / 255.0
    if x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bicubic", align_corners=False)
    return (x - channel_constants(MEAN, x.device)) / channel_constants(STD, x.device)
