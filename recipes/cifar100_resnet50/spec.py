"""cifar100_resnet50 as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone.

The export keeps timm's tensor names. With ``model.cifar_stem=false`` the model is a plain timm
ResNet, which timm loads directly (the ``timm`` entry of ``metadata.json``); the default CIFAR
stem (3x3 stride-1 first conv, no max-pool) is not a timm architecture, so
``recipes.cifar100_resnet50.model.build_model`` rebuilds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from common.after_training.export import timm_classifiers, timm_loading
from common.data import cifar100
from common.recipes import RecipeSpec
from recipes.cifar100_resnet50.config import Cifar100ResNet50Config, ModelConfig
from recipes.cifar100_resnet50.data import MEAN, STD
from recipes.cifar100_resnet50.model import build_model
from recipes.cifar100_resnet50.train import SPLITS, evaluator, model_as_trained

INPUT_SIZE = [3, 32, 32]


def export_metadata(cfg: Cifar100ResNet50Config) -> dict[str, Any]:
    metadata = {"input": {"size": INPUT_SIZE, "mean": list(MEAN), "std": list(STD),
                          "pixels": "uint8 / 255, then (x - mean) / std"},
                "num_classes": cifar100.NUM_CLASSES, "classes": cifar100.class_names(cfg.data.root)}
    if not cfg.model.cifar_stem:
        metadata["timm"] = timm_loading(cfg.model.name, cifar100.NUM_CLASSES, INPUT_SIZE, MEAN, STD)
    return metadata


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg)


SPEC = RecipeSpec(
    schema=Cifar100ResNet50Config,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    head_names=lambda model_cfg: [f"{name}." for name in timm_classifiers(model_cfg.name)],
    export_metadata=export_metadata,
    model_from_export=model_from_export,
)
