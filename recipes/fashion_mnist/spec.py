"""fashion_mnist as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone.

The export keeps the model's own tensor names (a plain ``nn.Sequential``):
``recipes.fashion_mnist.model.build_model`` with the exported ``model`` config loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from common.recipes import RecipeSpec
from recipes.fashion_mnist.config import FashionMNISTConfig, ModelConfig
from recipes.fashion_mnist.data import CLASSES, MEAN, STD
from recipes.fashion_mnist.model import IMAGE_SIZE, build_model
from recipes.fashion_mnist.train import SPLITS, evaluator, model_as_trained


def head_names(model_cfg: ModelConfig) -> list[str]:
    """The last layer, the classifier."""
    return [f"{len(build_model(model_cfg)) - 1}."]


def export_metadata(cfg: FashionMNISTConfig) -> dict[str, Any]:
    return {"input": {"size": [1, IMAGE_SIZE, IMAGE_SIZE], "mean": [MEAN], "std": [STD],
                      "pixels": "uint8 / 255, then (x - mean) / std"},
            "num_classes": len(CLASSES), "classes": list(CLASSES)}


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg)


SPEC = RecipeSpec(
    schema=FashionMNISTConfig,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    head_names=head_names,
    export_metadata=export_metadata,
    model_from_export=model_from_export,
)
