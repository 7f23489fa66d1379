"""A small CNN: conv blocks (conv-BN-ReLU x n, max-pool), then a two-layer classifier."""

from __future__ import annotations

from torch import nn

from recipes.fashion_mnist.config import ModelConfig

IMAGE_SIZE = 28
NUM_CLASSES = 10


def build_model(cfg: ModelConfig) -> nn.Module:
    layers: list[nn.Module] = []
    in_channels, size = 1, IMAGE_SIZE
    for out_channels in cfg.channels:
        for _ in range(cfg.convs_per_block):
            layers += [
                nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
                nn.BatchNorm2d(out_channels),
                nn.ReLU(inplace=True),
            ]
            in_channels = out_channels
        layers.append(nn.MaxPool2d(2))
        size //= 2
    return nn.Sequential(
        *layers,
        nn.Flatten(),
        nn.Dropout(cfg.dropout),
        nn.Linear(in_channels * size * size, cfg.hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(cfg.dropout),
        nn.Linear(cfg.hidden, NUM_CLASSES),
    )
