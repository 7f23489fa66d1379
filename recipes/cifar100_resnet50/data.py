"""CIFAR-100 as uint8 tensors on the training device, augmented a whole batch at a time.

The dataset (150 MB) lives on the device, so a batch is one gather and the augmentation runs
on tensors where the model runs: no DataLoader workers, no PIL. Every random draw comes from
the step's seeded generator (crop, flip, rotation, erasing) or from global generators seeded
for the step and restored afterwards (TrivialAugment/RandAugment, drawn as torchvision draws them
and applied to the whole batch by ``common.data.auto_augment``; timm's Mixup),
so a run resumed at step ``s`` augments exactly as the uninterrupted run did.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.data.mixup import mixup_target

from common.config import MixupConfig
from common.data import cifar100
from common.data.auto_augment import BatchAutoAugment
from common.data.image_batches import Normalize, random_crop_and_flip
from common.pytorch.rng import seeded_global_rng
from recipes.cifar100_resnet50.config import DataConfig

# Per-channel mean and std of the CIFAR-100 training images, in [0, 1].
MEAN = (0.5071, 0.4865, 0.4409)
STD = (0.2673, 0.2564, 0.2762)
ERASE_SCALE = (0.02, 1 / 3)  # fraction of the image a random-erasing rectangle covers (timm's default)
ERASE_LOG_RATIO = (math.log(0.3), math.log(1 / 0.3))  # its aspect ratio


def rotate(images: torch.Tensor, degrees: float, generator: torch.Generator) -> torch.Tensor:
    """Rotate each image by its own angle in ``[-degrees, degrees]`` about its centre; nearest
    neighbour, corners filled with zeros (torchvision's ``RandomRotation`` on a batch)."""
    batch = images.shape[0]
    angles = (torch.rand(batch, generator=generator, device=images.device) * 2 - 1) * math.radians(degrees)
    cos, sin, zero = angles.cos(), angles.sin(), torch.zeros_like(angles)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="nearest", padding_mode="zeros", align_corners=False)


def random_erase(images: torch.Tensor, probability: float, generator: torch.Generator) -> torch.Tensor:
    """Replace one random rectangle per image (with ``probability``) by per-pixel normal noise,
    as timm's ``RandomErasing(mode="pixel")`` does, for a whole batch at once."""
    batch, _, height, width = images.shape
    device = images.device

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(batch, generator=generator, device=device)

    area = uniform(*ERASE_SCALE) * height * width
    aspect = uniform(*ERASE_LOG_RATIO).exp()
    box_h = (area * aspect).sqrt().round().clamp(1, height)
    box_w = (area / aspect).sqrt().round().clamp(1, width)
    top = (uniform(0, 1) * (height - box_h + 1)).floor()
    left = (uniform(0, 1) * (width - box_w + 1)).floor()
    erase = uniform(0, 1) < probability
    rows = torch.arange(height, device=device)[None, :, None]
    cols = torch.arange(width, device=device)[None, None, :]
    inside = ((rows >= top[:, None, None]) & (rows < (top + box_h)[:, None, None])
              & (cols >= left[:, None, None]) & (cols < (left + box_w)[:, None, None]) & erase[:, None, None])
    noise = torch.randn(images.shape, generator=generator, device=device, dtype=images.dtype)
    return torch.where(inside[:, None], noise, images)


class BatchAugmentation:
    """The configured training augmentation: uint8 images and labels in, model inputs and
    targets out (class indices, or soft targets when mixup/cutmix is on). ``normalize`` takes
    floats in [0, 1]."""

    def __init__(self, cfg: DataConfig, mixup: MixupConfig, label_smoothing: float, normalize: Normalize,
                 num_classes: int = cifar100.NUM_CLASSES) -> None:
        self.cfg = cfg
        self.normalize = normalize
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.policy: BatchAutoAugment | None = None  # torchvision's, for the whole batch at once
        if cfg.auto_augment == "trivialaugment":
            self.policy = BatchAutoAugment.trivial_augment_wide()
        elif cfg.auto_augment == "randaugment":
            self.policy = BatchAutoAugment.rand_augment(cfg.randaugment_ops, cfg.randaugment_magnitude)
        self.mixup = None
        if mixup.mixup_alpha > 0 or mixup.cutmix_alpha > 0:
            self.mixup = Mixup(mixup_alpha=mixup.mixup_alpha, cutmix_alpha=mixup.cutmix_alpha, prob=mixup.prob,
                               switch_prob=mixup.switch_prob, mode=mixup.mode, label_smoothing=label_smoothing,
                               num_classes=num_classes)

    @property
    def soft_targets(self) -> bool:
        return self.mixup is not None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator,
                 *rng_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``generator`` and ``rng_keys`` (seed, step, rank, micro-batch) fix every random draw."""
        cfg = self.cfg
        images = random_crop_and_flip(images, cfg.random_crop_padding, cfg.horizontal_flip, generator)
        if self.policy is not None:
            with seeded_global_rng(*rng_keys):  # each image's ops, drawn as torchvision's policy draws them
                draws = [self.policy.draw(*images.shape[-2:]) for _ in range(len(images))]
            images = self.policy.apply(images, draws)
        images = images.float() / 255.0
        if cfg.rotation_degrees > 0:
            images = rotate(images, cfg.rotation_degrees, generator)
        images = self.normalize(images)
        if cfg.random_erasing > 0:
            images = random_erase(images, cfg.random_erasing, generator)
        if self.mixup is None:
            return images, labels
        paired = len(images) - len(images) % 2  # Mixup pairs samples; an odd one out stays unmixed
        with seeded_global_rng(*rng_keys):
            mixed, targets = self.mixup(images[:paired], labels[:paired])
        if paired == len(images):
            return mixed, targets
        odd_target = mixup_target(labels[paired:], self.num_classes, smoothing=self.label_smoothing)
        return torch.cat([mixed, images[paired:]]), torch.cat([targets, odd_target])
