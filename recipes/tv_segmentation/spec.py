"""tv_segmentation as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone. ``train.py`` imports the model as trained, the splits and
the evaluation from here (this module imports nothing of it), so training and the tools share them.

The export keeps torchvision's tensor names: ``torchvision.models.get_model(name, **kwargs)``
with the ``torchvision`` entry of ``metadata.json`` and ``load_state_dict`` of
``model.safetensors`` rebuild it (the auxiliary head included when the run trained one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.after_training.evaluate import metric_prefix, model_outputs
from common.data.image_batches import Normalize
from common.data.loaders import make_loader
from common.data.sampler import ResumableDistributedSampler
from common.pytorch.activation_checkpointing import checkpoint_blocks
from common.pytorch.distributed import DistInfo, on_device
from common.recipes import CLASS, Evaluate, PredictInput, RecipeSpec
from recipes.tv_segmentation.coco import voc_palette
from recipes.tv_segmentation.config import ModelConfig, TvSegmentationConfig
from recipes.tv_segmentation.data import (
    MEAN,
    MEAN_UINT8,
    STD,
    EvalImage,
    SegmentationDataset,
    class_names,
    eval_transform,
    find_pairs,
    pad_collate,
)
from recipes.tv_segmentation.metrics import ConfusionMatrix, segmentation_scores
from recipes.tv_segmentation.model import build_model
from recipes.tv_segmentation.sync_batchnorm import convert_sync_batchnorm

SPLITS = ("val",)  # data.val_split; VOC's and COCO's test annotations are not public


def model_as_trained(cfg: TvSegmentationConfig, dist_info: DistInfo, pretrained: bool = True) -> torch.nn.Module:
    """The model as training holds it, before DDP and compile: BatchNorm synchronised across
    ranks under DDP (``model.sync_batchnorm``), the backbone's activations recomputed in the
    backward pass with ``trainer.activation_checkpointing``, on the device."""
    model = build_model(cfg.model, pretrained)
    checkpoint_blocks(model.backbone, cfg.trainer.activation_checkpointing, f"the backbone of {cfg.model.name}")
    if dist_info.distributed and cfg.model.sync_batchnorm:
        model, _ = convert_sync_batchnorm(model)
    return on_device(model, dist_info.device, cfg.trainer.channels_last)


def evaluator(cfg: TvSegmentationConfig, dist_info: DistInfo, split: str) -> Evaluate:
    """mIoU, pixel accuracy and per-class IoU over the val split, from one confusion matrix summed
    over ranks (each pixel counted once); images decoded in DataLoader workers, uint8 to the device."""
    dataset = SegmentationDataset(find_pairs(cfg.data, cfg.data.val_split), eval_transform(cfg.data.base_size),
                                  cfg.model.num_classes, augment=False)
    sampler = ResumableDistributedSampler(len(dataset), dist_info.rank, dist_info.world_size, shuffle=False,
                                          drop_last=False)
    # Own generator: creating an iterator must not draw from the global RNG that dropout uses.
    loader = make_loader(dataset, sampler, cfg.trainer.eval_batch_size, cfg.trainer.num_workers,
                         dist_info.device.type == "cuda", collate_fn=pad_collate, generator=torch.Generator())
    normalize = Normalize(MEAN, STD, dist_info.device)

    def evaluate(model: torch.nn.Module, of_ema: bool = False) -> dict[str, float]:
        matrix = ConfusionMatrix(cfg.model.num_classes, dist_info.device)
        batches = ((normalize(images), masks.to(dist_info.device, non_blocking=True)) for images, masks in loader)
        for outputs, masks in model_outputs(model, batches, dist_info.device, cfg.trainer.precision,
                                            cfg.trainer.channels_last):
            matrix.update(masks, outputs["out"].argmax(1))
        scores = segmentation_scores(matrix.reduce())
        prefix = metric_prefix(of_ema)
        metrics = {f"{prefix}/miou": scores["miou"], f"{prefix}/pixel_accuracy": scores["pixel_accuracy"]}
        for name, iou in zip(class_names(cfg.model.num_classes), scores["iou"]):
            if iou == iou:  # NaN: the class is neither in the targets nor predicted
                metrics[f"{prefix}/iou/{name}"] = iou
        return metrics

    return evaluate


def train_inputs(cfg: TvSegmentationConfig, dist_info: DistInfo) -> Iterator[torch.Tensor]:
    """The training split with the evaluation transform (shorter side to ``data.base_size``), normalised on the
    device, in the order of the first epoch: images as the model sees them without random augmentation."""
    dataset = SegmentationDataset(find_pairs(cfg.data, cfg.data.train_split), eval_transform(cfg.data.base_size),
                                  cfg.model.num_classes, augment=False)
    sampler = ResumableDistributedSampler(len(dataset), dist_info.rank, dist_info.world_size, seed=cfg.seed,
                                          shuffle=True, drop_last=True)
    loader = make_loader(dataset, sampler, cfg.trainer.batch_size, cfg.trainer.num_workers,
                         dist_info.device.type == "cuda", drop_last=True, collate_fn=pad_collate,
                         generator=torch.Generator())
    normalize = Normalize(MEAN, STD, dist_info.device)
    return (normalize(images) for images, _ in loader)


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


def predict_input(metadata: dict[str, Any], device: torch.device) -> PredictInput:
    """Image files through the evaluation transform, padded into batches as the evaluation pads them; the
    masks in Pascal VOC's palette."""
    return PredictInput(decode=EvalImage(metadata["input"]["base_size"]), prepare=Normalize(MEAN, STD, device),
                        classes={CLASS: list(metadata["classes"])}, scores=lambda outputs: {CLASS: outputs["out"]},
                        palette=voc_palette(), pad=MEAN_UINT8)


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
    predict_input=predict_input,
    train_inputs=train_inputs,
)
