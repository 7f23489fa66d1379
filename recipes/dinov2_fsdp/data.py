"""CIFAR-100 for a DINOv2 backbone: uint8 tensors on the device, augmented and upsampled per batch.

The images come from the shared reader (``common.data.cifar100``, the cifar100_resnet50 prep's
layout). The whole split (150 MB) lives on the training device; random crop (after reflection
padding) and flip run at 32x32 on whole batches with a seeded generator (``common.data.image_batches``),
then the batch is upsampled to the backbone's resolution and normalised with the ImageNet
statistics DINOv2 was trained with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.data.image_batches import Normalize

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def to_model_input(images: torch.Tensor, image_size: int, normalize: Normalize) -> torch.Tensor:
    """uint8 ``[B, 3, 32, 32]`` to normalised float ``[B, 3, image_size, image_size]`` (bicubic);
    ``normalize`` takes floats in [0, 1]."""
    x = images.float() / 255.0
    if x.shape[-1] != image_size:
        x = F.interpolate(x, size=(image_size, image_size), mode="bicubic", align_corners=False)
    return normalize(x)
