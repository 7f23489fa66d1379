"""A timm ResNet for 32x32 CIFAR images.

ImageNet ResNets shrink the input 4x in their stem (7x7 stride-2 conv, then a stride-2
max-pool), which leaves a 32x32 CIFAR image 1x1 pixel by the last stage. The CIFAR stem used
by the published CIFAR ResNet results (e.g. github.com/weiaicunzai/pytorch-cifar100) keeps
full resolution instead: one 3x3 stride-1 conv and no max-pool. It is the default here.
"""

from __future__ import annotations

import timm
from torch import nn

from common.data.cifar100 import NUM_CLASSES
from common.errors import UserError
from recipes.cifar100_resnet50.config import ModelConfig


def build_model(cfg: ModelConfig) -> nn.Module:
    """``cfg.name`` from timm with 100 classes, randomly initialised, optionally with a CIFAR stem."""
    try:
        model = timm.create_model(cfg.name, pretrained=False, num_classes=NUM_CLASSES,
                                  drop_path_rate=cfg.drop_path_rate)
    except (RuntimeError, ValueError) as error:  # timm's "Unknown model" is a RuntimeError
        raise UserError(f"model.name={cfg.name!r}: {error}") from error
    if cfg.cifar_stem:
        use_cifar_stem(model, cfg.name)
    return model


def use_cifar_stem(model: nn.Module, name: str) -> None:
    """Replace a timm ResNet's stem conv (plain or deep) by a 3x3 stride-1 conv and drop its max-pool."""
    if not all(hasattr(model, part) for part in ("conv1", "bn1", "maxpool")):
        raise UserError(f"model.cifar_stem=true needs a timm ResNet (conv1, bn1, maxpool); {name} is not one")
    model.conv1 = nn.Conv2d(3, model.bn1.num_features, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
