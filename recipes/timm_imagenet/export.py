"""What ``make export`` writes for timm_imagenet, and the model rebuilt from it (``common/export.py``).

The export keeps timm's tensor names, so timm loads it as it is (the ``timm`` entry of
``metadata.json``); the classes are the ImageFolder's class folders (WordNet ids for ImageNet),
in the order of the classifier's outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from common.export import timm_classifiers, timm_loading
from recipes.timm_imagenet.data import check_layout, image_folder, resolve
from recipes.timm_imagenet.evaluate import architecture


def key_prefixes(model_cfg: DictConfig) -> list[tuple[str, str]]:
    return [("", "")]


def head_prefixes(model_cfg: DictConfig) -> list[str]:
    return [f"{name}." for name in timm_classifiers(model_cfg.name)]


def describe(cfg: DictConfig) -> dict[str, Any]:
    _, val_dir = check_layout(cfg.data.root, cfg.data.train_split, cfg.data.val_split)
    classes = image_folder(val_dir, None).classes
    model = architecture(cfg.model, len(classes))
    data = resolve(model, cfg.data.eval_size, cfg.data.eval_crop_pct, cfg.data.interpolation)
    kwargs = OmegaConf.to_container(cfg.model.kwargs, resolve=True)
    return {"input": {"size": list(data["input_size"]), "mean": list(data["mean"]), "std": list(data["std"]),
                      "crop_pct": data["crop_pct"], "interpolation": data["interpolation"],
                      "pixels": "resize to size / crop_pct, centre crop, / 255, then (x - mean) / std"},
            "num_classes": len(classes), "classes": list(classes),
            "timm": timm_loading(cfg.model.name, len(classes), data["input_size"], data["mean"], data["std"], kwargs,
                                 crop_pct=data["crop_pct"], interpolation=data["interpolation"])}


def rebuild(model_cfg: DictConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return architecture(model_cfg, metadata["num_classes"])
