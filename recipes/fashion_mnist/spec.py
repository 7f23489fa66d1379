"""fashion_mnist as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone. ``train.py`` imports the model as trained, the splits and
the evaluation from here (this module imports nothing of it), so training and the tools share them.

The export keeps the model's own tensor names (a plain ``nn.Sequential``):
``recipes.fashion_mnist.model.build_model`` with the exported ``model`` config loads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.after_training.evaluate import classification_scores, metric_prefix
from common.data.encoded import FixedSizeImage
from common.data.sampler import ResumableDistributedSampler
from common.pytorch.activation_checkpointing import checkpoint_blocks
from common.pytorch.distributed import DistInfo, on_device
from common.recipes import Evaluate, PredictInput, RecipeSpec, one_classifier
from recipes.fashion_mnist.config import FashionMNISTConfig, ModelConfig
from recipes.fashion_mnist.data import CLASSES, MEAN, STD, load_split, normalize
from recipes.fashion_mnist.model import IMAGE_SIZE, build_model

SPLITS = ("test",)  # Fashion-MNIST has a train and a test split; training evaluates on test


def model_as_trained(cfg: FashionMNISTConfig, dist_info: DistInfo, pretrained: bool = True) -> torch.nn.Module:
    """The model as training holds it, before DDP and compile (there are no pretrained weights)."""
    model = build_model(cfg.model)
    checkpoint_blocks(model, cfg.trainer.activation_checkpointing)
    return on_device(model, dist_info.device, cfg.trainer.channels_last)


def evaluator(cfg: FashionMNISTConfig, dist_info: DistInfo, split: str) -> Evaluate:
    """Loss, top-1 and top-5 accuracy over ``split``, each image counted once across ranks; the
    whole split on the device."""
    images, labels = (t.to(dist_info.device) for t in load_split(cfg.data.root, split))
    sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, shuffle=False,
                                          drop_last=False)

    def evaluate(model: torch.nn.Module, of_ema: bool = False) -> dict[str, float]:
        batches = ((normalize(images[batch]), labels[batch])
                   for batch in sampler.index_batches(cfg.trainer.eval_batch_size, images.device))
        return classification_scores(model, batches, dist_info.device, cfg.trainer.precision,
                                     cfg.trainer.channels_last, metric_prefix(of_ema))

    return evaluate


def train_inputs(cfg: FashionMNISTConfig, dist_info: DistInfo) -> Iterator[torch.Tensor]:
    """The training images normalised, without random crops or flips, in the order of the first epoch."""
    images, _ = load_split(cfg.data.root, "train")
    images = images.to(dist_info.device)
    sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, seed=cfg.seed,
                                          shuffle=True, drop_last=True)
    return (normalize(images[batch]) for batch in sampler.index_batches(cfg.trainer.batch_size, images.device))


def head_names(model_cfg: ModelConfig) -> list[str]:
    """The last layer, the classifier."""
    return [f"{len(build_model(model_cfg)) - 1}."]


def export_metadata(cfg: FashionMNISTConfig) -> dict[str, Any]:
    return {"input": {"size": [1, IMAGE_SIZE, IMAGE_SIZE], "mean": [MEAN], "std": [STD],
                      "pixels": "uint8 / 255, then (x - mean) / std"},
            "num_classes": len(CLASSES), "classes": list(CLASSES)}


def predict_input(metadata: dict[str, Any], device: torch.device) -> PredictInput:
    """Image files as greys of the dataset's size, normalised as the evaluation normalises the split."""
    return one_classifier(metadata, FixedSizeImage("L", IMAGE_SIZE),
                          lambda batch: normalize(batch[:, 0].to(device, non_blocking=True)))


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg)


SPEC = RecipeSpec(
    schema=FashionMNISTConfig,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    head_names=head_names,
    export_metadata=export_metadata,
    model_from_export=model_from_export,
    predict_input=predict_input,
    train_inputs=train_inputs,
)
