"""What ``make export`` writes for fashion_mnist, and the model rebuilt from it (``common/export.py``).

The export keeps the model's own tensor names (a plain ``nn.Sequential``):
``recipes.fashion_mnist.model.build_model`` with the exported ``model`` config loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from recipes.fashion_mnist.data import CLASSES, MEAN, STD
from recipes.fashion_mnist.model import IMAGE_SIZE, build_model


def key_prefixes(model_cfg: DictConfig) -> list[tuple[str, str]]:
    return [("", "")]


def head_prefixes(model_cfg: DictConfig) -> list[str]:
    """The last layer, the classifier."""
    return [f"{len(build_model(model_cfg)) - 1}."]


def describe(cfg: DictConfig) -> dict[str, Any]:
    return {"input": {"size": [1, IMAGE_SIZE, IMAGE_SIZE], "mean": [MEAN], "std": [STD],
                      "pixels": "uint8 / 255, then (x - mean) / std"},
            "num_classes": len(CLASSES), "classes": list(CLASSES)}


def rebuild(model_cfg: DictConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg)
