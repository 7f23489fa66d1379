"""timm_imagenet as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone.

The export keeps timm's tensor names, so timm loads it as it is (the ``timm`` entry of
``metadata.json``); the classes are the ImageFolder's class folders (WordNet ids for ImageNet),
in the order of the classifier's outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.after_training.export import timm_classifiers, timm_loading
from common.recipes import RecipeSpec
from recipes.timm_imagenet.config import ModelConfig, TimmImageNetConfig
from recipes.timm_imagenet.data import class_names, resolve
from recipes.timm_imagenet.model import build_model
from recipes.timm_imagenet.train import SPLITS, evaluator, model_as_trained, process_group


def export_metadata(cfg: TimmImageNetConfig) -> dict[str, Any]:
    classes = class_names(cfg.data)
    with torch.device("meta"):  # only its data config is read
        model = build_model(cfg.model, len(classes), pretrained=False)
    data = resolve(model, cfg.data.eval_size, cfg.data.eval_crop_pct, cfg.data.interpolation)
    return {"input": {"size": list(data["input_size"]), "mean": list(data["mean"]), "std": list(data["std"]),
                      "crop_pct": data["crop_pct"], "interpolation": data["interpolation"],
                      "pixels": "resize to size / crop_pct, centre crop, / 255, then (x - mean) / std"},
            "num_classes": len(classes), "classes": classes,
            "timm": timm_loading(cfg.model.name, len(classes), data["input_size"], data["mean"], data["std"],
                                 dict(cfg.model.kwargs), crop_pct=data["crop_pct"],
                                 interpolation=data["interpolation"])}


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg, metadata["num_classes"], pretrained=False)


SPEC = RecipeSpec(
    schema=TimmImageNetConfig,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    head_names=lambda model_cfg: [f"{name}." for name in timm_classifiers(model_cfg.name)],
    export_metadata=export_metadata,
    model_from_export=model_from_export,
    process_group=process_group,
)
