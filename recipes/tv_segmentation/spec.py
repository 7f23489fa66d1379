"""tv_segmentation as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone.

The export keeps torchvision's tensor names: ``torchvision.models.get_model(name, **kwargs)``
with the ``torchvision`` entry of ``metadata.json`` and ``load_state_dict`` of
``model.safetensors`` rebuild it (the auxiliary head included when the run trained one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from common.recipes import RecipeSpec
from recipes.tv_segmentation.config import ModelConfig, TvSegmentationConfig
from recipes.tv_segmentation.data import MEAN, STD, class_names
from recipes.tv_segmentation.model import build_model
from recipes.tv_segmentation.train import SPLITS, evaluator, model_as_trained


def head_names(model_cfg: ModelConfig) -> list[str]:
    """The layers that output one channel per class (the last of the main and auxiliary heads)."""
    model = build_model(model_cfg, pretrained=False)
    return [f"{name}." for name, module in model.named_modules()
            if name.startswith(("classifier", "aux_classifier")) and isinstance(module, nn.Conv2d)
            and module.out_channels == model_cfg.num_classes]


def export_metadata(cfg: TvSegmentationConfig) -> dict[str, Any]:
    return {"input": {"mean": list(MEAN), "std": list(STD), "base_size": cfg.data.base_size,
                      "pixels": "shorter side resized to base_size, / 255, then (x - mean) / std; "
                                "the output's 'out' holds per-pixel class scores"},
            "num_classes": cfg.model.num_classes, "classes": class_names(cfg.model.num_classes),
            "torchvision": {"model_name": cfg.model.name,
                            "kwargs": {"num_classes": cfg.model.num_classes, "weights": None, "weights_backbone": None,
                                       **({"aux_loss": True} if cfg.model.aux_loss else {})}}}


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg, pretrained=False)


SPEC = RecipeSpec(
    schema=TvSegmentationConfig,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    head_names=head_names,
    export_metadata=export_metadata,
    model_from_export=model_from_export,
)
