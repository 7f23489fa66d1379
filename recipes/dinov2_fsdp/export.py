"""What ``make export`` writes for dinov2_fsdp, and the model rebuilt from it (``common/export.py``).

The FSDP shards are consolidated into one ``model.safetensors``. With transformers (the default)
its names are those of ``Dinov2ForImageClassification`` (``dinov2.*`` and ``classifier.*``) and
the folder has that backbone's ``config.json`` (with CIFAR-100's labels), so
``Dinov2Model.from_pretrained(folder)`` loads the backbone, and with ``model.features=cls_patch_mean``
(the head that class has) ``Dinov2ForImageClassification.from_pretrained(folder)`` loads the whole
classifier. With timm the names are timm's, and with ``model.features=cls`` (timm's token pooling)
timm loads the whole classifier (the ``timm`` entry of ``metadata.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn

from common import cifar100
from common.export import timm_loading
from recipes.dinov2_fsdp.data import MEAN, STD
from recipes.dinov2_fsdp.model import NUM_CLASSES, DinoClassifier, transformers_config

WHOLE_CLASSIFIER = "Dinov2ForImageClassification"  # its head reads the CLS token and the mean patch token


def key_prefixes(model_cfg: DictConfig) -> list[tuple[str, str]]:
    if model_cfg.library == "transformers":
        return [("backbone.", "dinov2."), ("head.", "classifier.")]
    return [("backbone.", ""), ("head.", "head.")]


def head_prefixes(model_cfg: DictConfig) -> list[str]:
    return ["head."]


def describe(cfg: DictConfig) -> dict[str, Any]:
    size = [3, cfg.model.image_size, cfg.model.image_size]
    described = {"input": {"size": size, "mean": list(MEAN), "std": list(STD),
                           "pixels": "32x32 images resized to size (bicubic), / 255, then (x - mean) / std"},
                 "num_classes": NUM_CLASSES, "classes": cifar100.class_names(cfg.data.root)}
    if cfg.model.library == "transformers":
        whole = cfg.model.features == "cls_patch_mean"
        described["transformers"] = {"class": WHOLE_CLASSIFIER if whole else "Dinov2Model"}
    elif cfg.model.features == "cls":
        described["timm"] = timm_loading(cfg.model.name, NUM_CLASSES, size, MEAN, STD,
                                         {"img_size": cfg.model.image_size})
    return described


def write_extras(cfg: DictConfig, folder: Path, metadata: dict[str, Any]) -> None:
    """transformers' ``config.json`` of the backbone, with the classes as its labels."""
    if cfg.model.library != "transformers":
        return
    config = transformers_config(cfg.model)
    config.architectures = [metadata["transformers"]["class"]]
    config.id2label = dict(enumerate(metadata["classes"]))
    config.label2id = {name: index for index, name in enumerate(metadata["classes"])}
    config.save_pretrained(folder)


def rebuild(model_cfg: DictConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    if model_cfg.library == "transformers":
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config.from_pretrained(folder)
        config._attn_implementation = "sdpa"
        backbone = Dinov2Model(config)
    else:
        import timm

        backbone = timm.create_model(model_cfg.name, pretrained=False, num_classes=0,
                                     img_size=metadata["input"]["size"][-1])
    return DinoClassifier(backbone, model_cfg.library, model_cfg.features)
