"""dinov2_fsdp as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export`` and
``init_from=`` read this alone.

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

from torch import nn

from common.after_training.export import timm_loading
from common.data import cifar100
from common.recipes import RecipeSpec
from recipes.dinov2_fsdp.config import DinoV2FSDPConfig, ModelConfig
from recipes.dinov2_fsdp.data import MEAN, STD
from recipes.dinov2_fsdp.model import NUM_CLASSES, DinoClassifier, transformers_config
from recipes.dinov2_fsdp.train import SPLITS, evaluator, model_as_trained, process_group

WHOLE_CLASSIFIER = "Dinov2ForImageClassification"  # its head reads the CLS token and the mean patch token


def export_names(model_cfg: ModelConfig) -> list[tuple[str, str]]:
    if model_cfg.library == "transformers":
        return [("backbone.", "dinov2."), ("head.", "classifier.")]
    return [("backbone.", ""), ("head.", "head.")]


def export_metadata(cfg: DinoV2FSDPConfig) -> dict[str, Any]:
    size = [3, cfg.model.image_size, cfg.model.image_size]
    metadata = {"input": {"size": size, "mean": list(MEAN), "std": list(STD),
                          "pixels": "32x32 images resized to size (bicubic), / 255, then (x - mean) / std"},
                "num_classes": NUM_CLASSES, "classes": cifar100.class_names(cfg.data.root)}
    if cfg.model.library == "transformers":
        whole = cfg.model.features == "cls_patch_mean"
        metadata["transformers"] = {"class": WHOLE_CLASSIFIER if whole else "Dinov2Model"}
    elif cfg.model.features == "cls":
        metadata["timm"] = timm_loading(cfg.model.name, NUM_CLASSES, size, MEAN, STD,
                                        {"img_size": cfg.model.image_size})
    return metadata


def write_export_extras(cfg: DinoV2FSDPConfig, folder: Path, metadata: dict[str, Any]) -> None:
    """transformers' ``config.json`` of the backbone, with the classes as its labels."""
    if cfg.model.library != "transformers":
        return
    config = transformers_config(cfg.model)
    config.architectures = [metadata["transformers"]["class"]]
    config.id2label = dict(enumerate(metadata["classes"]))
    config.label2id = {name: index for index, name in enumerate(metadata["classes"])}
    config.save_pretrained(folder)


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
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


SPEC = RecipeSpec(
    schema=DinoV2FSDPConfig,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    export_names=export_names,
    head_names=lambda model_cfg: ["head."],
    export_metadata=export_metadata,
    model_from_export=model_from_export,
    write_export_extras=write_export_extras,
    process_group=process_group,
)
