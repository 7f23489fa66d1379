"""A small CNN: conv blocks (conv-BN-ReLU x n, the last conv max-pooled before its BN and ReLU), then a
two-layer classifier.

Pooling the block's last conv before its BatchNorm and ReLU, as fast CIFAR-10 trainers do, leaves those two
a quarter of the pixels: on a CPU the step takes about 0.6x the time of conv-BN-ReLU-pool, and the model is
no less accurate (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from torch import nn

from recipes.fashion_mnist.config import ModelConfig

IMAGE_SIZE = 28
NUM_CLASSES = 10


def build_model(cfg: ModelConfig) -> nn.Module:
    layers: list[nn.Module] = []
    in_channels, size = 1, IMAGE_SIZE
    for out_channels in cfg.channels:
        for i in range(cfg.convs_per_block):
            layers.append(nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False))
            if i == cfg.convs_per_block - 1:
                layers.append(nn.MaxPool2d(2))
            layers += [nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True)]
            in_channels = out_channels
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
