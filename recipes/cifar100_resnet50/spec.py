"""cifar100_resnet50 as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone. ``train.py`` imports the model as trained, the splits and
the evaluation from here (this module imports nothing of it), so training and the tools share them.

The export keeps timm's tensor names. With ``model.cifar_stem=false`` the model is a plain timm
ResNet, which timm loads directly (the ``timm`` entry of ``metadata.json``); the default CIFAR
stem (3x3 stride-1 first conv, no max-pool) is not a timm architecture, so
``recipes.cifar100_resnet50.model.build_model`` rebuilds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.after_training.evaluate import classification_scores, metric_prefix
from common.after_training.export import timm_classifiers, timm_loading
from common.data import cifar100
from common.data.encoded import FixedSizeImage
from common.data.image_batches import Normalize
from common.data.sampler import ResumableDistributedSampler
from common.pytorch.activation_checkpointing import checkpoint_blocks
from common.pytorch.distributed import DistInfo, on_device
from common.recipes import Evaluate, PredictInput, RecipeSpec, one_classifier
from recipes.cifar100_resnet50.config import Cifar100ResNet50Config, ModelConfig
from recipes.cifar100_resnet50.data import MEAN, STD
from recipes.cifar100_resnet50.model import build_model

SPLITS = ("test",)  # CIFAR-100 has a train and a test split; training evaluates on test


def model_as_trained(cfg: Cifar100ResNet50Config, dist_info: DistInfo, pretrained: bool = True) -> torch.nn.Module:
    """The model as training holds it, before DDP and compile (trained from scratch: no pretrained weights)."""
    model = build_model(cfg.model)
    checkpoint_blocks(model, cfg.trainer.activation_checkpointing)
    return on_device(model, dist_info.device, cfg.trainer.channels_last)


def evaluator(cfg: Cifar100ResNet50Config, dist_info: DistInfo, split: str) -> Evaluate:
    """Loss, top-1 and top-5 accuracy over ``split``, each image counted once across ranks; the
    whole split on the device."""
    data = cifar100.load_split(cfg.data.root, split, prep="cifar100_resnet50")
    images, labels = data.images.to(dist_info.device), data.labels.to(dist_info.device)
    normalize = Normalize(MEAN, STD, dist_info.device, input_max=1)
    sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, shuffle=False,
                                          drop_last=False)

    def evaluate(model: torch.nn.Module, of_ema: bool = False) -> dict[str, float]:
        batches = ((normalize(images[batch].float() / 255.0), labels[batch])
                   for batch in sampler.index_batches(cfg.trainer.eval_batch_size, images.device))
        return classification_scores(model, batches, dist_info.device, cfg.trainer.precision,
                                     cfg.trainer.channels_last, metric_prefix(of_ema))

    return evaluate


def train_inputs(cfg: Cifar100ResNet50Config, dist_info: DistInfo) -> Iterator[torch.Tensor]:
    """The training images normalised, without augmentation or mixing, in the order of the first epoch."""
    images = cifar100.load_split(cfg.data.root, "train", prep="cifar100_resnet50").images.to(dist_info.device)
    normalize = Normalize(MEAN, STD, dist_info.device, input_max=1)
    sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, seed=cfg.seed,
                                          shuffle=True, drop_last=True)
    return (normalize(images[batch].float() / 255.0)
            for batch in sampler.index_batches(cfg.trainer.batch_size, images.device))


INPUT_SIZE = [3, 32, 32]


def export_metadata(cfg: Cifar100ResNet50Config) -> dict[str, Any]:
    metadata = {"input": {"size": INPUT_SIZE, "mean": list(MEAN), "std": list(STD),
                          "pixels": "uint8 / 255, then (x - mean) / std"},
                "num_classes": cifar100.NUM_CLASSES, "classes": cifar100.class_names(cfg.data.root)}
    if not cfg.model.cifar_stem:
        metadata["timm"] = timm_loading(cfg.model.name, cifar100.NUM_CLASSES, INPUT_SIZE, MEAN, STD)
    return metadata


def predict_input(metadata: dict[str, Any], device: torch.device) -> PredictInput:
    """Image files as colour images of CIFAR's size, normalised as the evaluation normalises the split."""
    normalize = Normalize(MEAN, STD, device, input_max=1)
    return one_classifier(metadata, FixedSizeImage("RGB", INPUT_SIZE[-1]),
                          lambda batch: normalize(batch.to(device, non_blocking=True).float() / 255.0))


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg)


SPEC = RecipeSpec(
    schema=Cifar100ResNet50Config,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    head_names=lambda model_cfg: [f"{name}." for name in timm_classifiers(model_cfg.name)],
    export_metadata=export_metadata,
    model_from_export=model_from_export,
    predict_input=predict_input,
    train_inputs=train_inputs,
)
