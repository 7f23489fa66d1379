"""What ``make export`` writes for tv_segmentation, and the model rebuilt from it (``common/export.py``).

The export keeps torchvision's tensor names: ``torchvision.models.get_model(name, **kwargs)``
with the ``torchvision`` entry of ``metadata.json`` and ``load_state_dict`` of
``model.safetensors`` rebuild it (the auxiliary head included when the run trained one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from recipes.tv_segmentation.data import MEAN, STD
from recipes.tv_segmentation.evaluate import architecture
from recipes.tv_segmentation.train import class_names


def key_prefixes(model_cfg: DictConfig) -> list[tuple[str, str]]:
    return [("", "")]


def head_prefixes(model_cfg: DictConfig) -> list[str]:
    """The layers that output one channel per class (the last of the main and auxiliary heads)."""
    model = architecture(model_cfg)
    return [f"{name}." for name, module in model.named_modules()
            if name.startswith(("classifier", "aux_classifier")) and isinstance(module, nn.Conv2d)
            and module.out_channels == model_cfg.num_classes]


def describe(cfg: DictConfig) -> dict[str, Any]:
    return {"input": {"mean": list(MEAN), "std": list(STD), "base_size": cfg.data.base_size,
                      "pixels": "shorter side resized to base_size, / 255, then (x - mean) / std; "
                                "the output's 'out' holds per-pixel class scores"},
            "num_classes": cfg.model.num_classes, "classes": class_names(cfg.model.num_classes),
            "torchvision": {"model_name": cfg.model.name,
                            "kwargs": {"num_classes": cfg.model.num_classes, "weights": None, "weights_backbone": None,
                                       **({"aux_loss": True} if cfg.model.aux_loss else {})}}}


def rebuild(model_cfg: DictConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return architecture(model_cfg)
