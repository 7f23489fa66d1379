"""What ``make export`` writes for cifar100_resnet50, and the model rebuilt from it (``common/export.py``).

The export keeps timm's tensor names. With ``model.cifar_stem=false`` the model is a plain timm
ResNet, which timm loads directly (the ``timm`` entry of ``metadata.json``); the default CIFAR
stem (3x3 stride-1 first conv, no max-pool) is not a timm architecture, so
``recipes.cifar100_resnet50.model.build_model`` rebuilds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from common import cifar100
from common.export import timm_classifiers, timm_loading
from recipes.cifar100_resnet50.data import MEAN, STD
from recipes.cifar100_resnet50.model import build_model

INPUT_SIZE = [3, 32, 32]


def key_prefixes(model_cfg: DictConfig) -> list[tuple[str, str]]:
    return [("", "")]


def head_prefixes(model_cfg: DictConfig) -> list[str]:
    return [f"{name}." for name in timm_classifiers(model_cfg.name)]


def describe(cfg: DictConfig) -> dict[str, Any]:
    described = {"input": {"size": INPUT_SIZE, "mean": list(MEAN), "std": list(STD),
                           "pixels": "uint8 / 255, then (x - mean) / std"},
                 "num_classes": cifar100.NUM_CLASSES, "classes": cifar100.class_names(cfg.data.root)}
    if not cfg.model.cifar_stem:
        described["timm"] = timm_loading(cfg.model.name, cifar100.NUM_CLASSES, INPUT_SIZE, MEAN, STD)
    return described


def rebuild(model_cfg: DictConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg)
