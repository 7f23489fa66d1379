"""timm_imagenet as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone. ``train.py`` imports the model as trained, the splits and
the evaluation from here (this module imports nothing of it), so training and the tools share them.

The export keeps timm's tensor names, so timm loads it as it is (the ``timm`` entry of
``metadata.json``); the classes are the ImageFolder's class folders (WordNet ids for ImageNet),
in the order of the classifier's outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.after_training.evaluate import classification_scores, metric_prefix, most_batches
from common.after_training.export import timm_classifiers, timm_loading
from common.config import DataFormat
from common.data.image_batches import Normalize
from common.data.loaders import make_loader
from common.data.sampler import ResumableDistributedSampler
from common.pytorch.activation_checkpointing import checkpoint_blocks, residual_blocks
from common.pytorch.distributed import DistInfo, on_device
from common.pytorch.fsdp import check_fsdp_settings, fully_shard_blocks, process_group_options
from common.recipes import Evaluate, PredictInput, RecipeSpec, one_classifier
from recipes.timm_imagenet.config import ModelConfig, TimmImageNetConfig
from recipes.timm_imagenet.data import EvalImages, check_layout, class_names, eval_transform, resolve, split_images
from recipes.timm_imagenet.model import build_model

SPLITS = ("val",)  # data.val_split of the ImageFolder tree; ImageNet's test labels are not public


def model_as_trained(cfg: TimmImageNetConfig, dist_info: DistInfo, pretrained: bool = True) -> torch.nn.Module:
    """The model as training holds it, before DDP and compile: one output per class folder, sharded
    with FSDP2 (each block a unit) under ``fsdp.enabled``."""
    check_fsdp_settings(cfg.fsdp.enabled, cfg.fsdp.cpu_offload, dist_info.device, cfg.trainer.precision)
    model = build_model(cfg.model, len(class_names(cfg.data)), pretrained)
    checkpoint_blocks(model, cfg.trainer.activation_checkpointing, cfg.model.name)
    # FSDP2 shards contiguous tensors only: under it the weights keep PyTorch's layout (the inputs are still
    # channels-last with trainer.channels_last, and the convolutions compute in that layout).
    model = on_device(model, dist_info.device, cfg.trainer.channels_last and not cfg.fsdp.enabled)
    if cfg.fsdp.enabled:  # fp32 parameters: trainer.precision's autocast computes as it does under DDP
        fully_shard_blocks(model, residual_blocks(model), bf16_parameters=False,
                           reshard_after_forward=cfg.fsdp.reshard_after_forward, cpu_offload=cfg.fsdp.cpu_offload)
    return model


def process_group(cfg: TimmImageNetConfig) -> dict[str, bool]:
    """The process group FSDP2 needs (``fsdp.enabled``): a group even of one rank."""
    return process_group_options(cfg.fsdp.enabled, cfg.fsdp.cpu_offload)


def _evaluation_images(cfg: TimmImageNetConfig, dist_info: DistInfo, split: str) -> tuple[EvalImages, dict[str, Any]]:
    """A split's images with timm's evaluation transform (resize, centre crop), and its data config."""
    if cfg.data.format == DataFormat.files:
        check_layout(cfg.data.root, cfg.data.train_split, cfg.data.val_split)
    source, classes, _ = split_images(cfg.data, split, cfg.run_dir, dist_info.local_rank)
    with torch.device("meta"):  # only its data config (size, interpolation, mean and std) is read
        eval_config = resolve(build_model(cfg.model, len(classes), pretrained=False), cfg.data.eval_size,
                              cfg.data.eval_crop_pct, cfg.data.interpolation)
    return EvalImages(source, eval_transform(eval_config)), eval_config


def train_inputs(cfg: TimmImageNetConfig, dist_info: DistInfo) -> Iterator[torch.Tensor]:
    """The training split with timm's evaluation transform, normalised on the device, in the order of the first
    epoch: images as the model sees them without random augmentation."""
    images, eval_config = _evaluation_images(cfg, dist_info, cfg.data.train_split)
    sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, seed=cfg.seed,
                                          shuffle=True, drop_last=True)
    loader = make_loader(images, sampler, cfg.trainer.batch_size, cfg.trainer.num_workers,
                         dist_info.device.type == "cuda", drop_last=True)
    normalize = Normalize(eval_config["mean"], eval_config["std"], dist_info.device)
    return (normalize(batch) for batch, _ in loader)


def evaluator(cfg: TimmImageNetConfig, dist_info: DistInfo, split: str) -> Evaluate:
    """Loss, top-1 and top-5 over the val folder (or its shards) with timm's evaluation transform
    (resize, centre crop; normalised on the device), each image counted once across ranks."""
    images, eval_config = _evaluation_images(cfg, dist_info, cfg.data.val_split)
    sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, shuffle=False,
                                          drop_last=False)
    loader = make_loader(images, sampler, cfg.trainer.eval_batch_size, cfg.trainer.num_workers,
                         dist_info.device.type == "cuda")
    normalize = Normalize(eval_config["mean"], eval_config["std"], dist_info.device)
    forwards = most_batches(len(images), dist_info.world_size, cfg.trainer.eval_batch_size)

    def evaluate(model: torch.nn.Module, of_ema: bool = False) -> dict[str, float]:
        batches = ((normalize(batch), labels.to(dist_info.device, non_blocking=True)) for batch, labels in loader)
        return classification_scores(model, batches, dist_info.device, cfg.trainer.precision,
                                     cfg.trainer.channels_last, metric_prefix(of_ema), forwards)

    return evaluate


def export_metadata(cfg: TimmImageNetConfig) -> dict[str, Any]:
    classes = class_names(cfg.data)
    with torch.device("meta"):  # only its data config is read
        model = build_model(cfg.model, len(classes), pretrained=False)
    data = resolve(model, cfg.data.eval_size, cfg.data.eval_crop_pct, cfg.data.interpolation)
    return {"input": {"size": list(data["input_size"]), "mean": list(data["mean"]), "std": list(data["std"]),
                      "crop_pct": data["crop_pct"], "crop_mode": data["crop_mode"],
                      "interpolation": data["interpolation"],
                      "pixels": "resize to size / crop_pct, centre crop, / 255, then (x - mean) / std"},
            "num_classes": len(classes), "classes": classes,
            "timm": timm_loading(cfg.model.name, len(classes), data["input_size"], data["mean"], data["std"],
                                 dict(cfg.model.kwargs), crop_pct=data["crop_pct"],
                                 interpolation=data["interpolation"])}


def predict_input(metadata: dict[str, Any], device: torch.device) -> PredictInput:
    """Image files through timm's evaluation transform (resize, centre crop) as ``metadata.json``'s input
    describes it, normalised on the device as the evaluation does."""
    entry = metadata["input"]
    data_config = {"input_size": tuple(entry["size"]), "interpolation": entry["interpolation"],
                   "mean": tuple(entry["mean"]), "std": tuple(entry["std"]), "crop_pct": entry["crop_pct"],
                   "crop_mode": entry["crop_mode"]}
    return one_classifier(metadata, EvalImages([], eval_transform(data_config)).decoded,
                          Normalize(entry["mean"], entry["std"], device))


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
    predict_input=predict_input,
    train_inputs=train_inputs,
    process_group=process_group,
)
