"""Any timm model by name, with published weights from the hub or from a local file."""

from __future__ import annotations

from pathlib import Path

import timm
import torch

from common.errors import UserError
from recipes.timm_imagenet.config import ModelConfig


def build_model(cfg: ModelConfig, num_classes: int, pretrained: bool = True) -> torch.nn.Module:
    """``timm.create_model`` with the data's number of classes.

    With ``pretrained``, weights come from ``cfg.pretrained_file`` (a local file, never fetched) or,
    with ``cfg.pretrained``, from the hub under the model's name (e.g. ``resnet50.tv2_in1k``). timm
    keeps the classifier when the number of classes matches the weights' and re-initializes it
    otherwise, so fine-tuning on another dataset works with the same file. Without, the model is
    initialised at random (a checkpoint or an export brings its weights).
    """
    is_hub_id = ":" in cfg.name  # e.g. hf-hub:timm/resnet50.a1_in1k, resolved by timm itself
    if not is_hub_id and not timm.is_model(cfg.name.split(".", 1)[0]):
        raise UserError(f"model.name={cfg.name!r} is not a timm model (see timm.list_models())")
    options: dict = {}
    if pretrained and cfg.pretrained_file:
        weights = Path(cfg.pretrained_file)
        if not weights.is_file():
            raise UserError(f"model.pretrained_file={weights} does not exist")
        options = {"pretrained": True, "pretrained_cfg_overlay": {"file": str(weights)}}
    elif pretrained and cfg.pretrained:
        options = {"pretrained": True}
    try:
        return timm.create_model(
            cfg.name,
            num_classes=num_classes,
            drop_rate=cfg.drop_rate,
            drop_path_rate=cfg.drop_path_rate,
            **options,
            **dict(cfg.kwargs),
        )
    except (RuntimeError, TypeError, OSError, ValueError, KeyError) as error:
        source = (cfg.pretrained_file or ("the hub" if cfg.pretrained else "")) if pretrained else ""
        where = f" with weights from {source}" if source else ""
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"could not build {cfg.name}{where}: {detail}") from error
