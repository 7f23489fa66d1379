"""The tv_segmentation config schema and every default of the recipe (``conf/tv_segmentation.yaml``
only composes it with the shared run layout).

Default: deeplabv3_mobilenet_v3_large on Pascal VOC 2012 train/val, from scratch unless
model.weights_backbone is set; torchvision's reference settings (lr 0.01, batch 4 per GPU, 30 epochs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.config import CheckpointConfig, RunConfig, TrainerConfig


class DatasetName(str, Enum):
    voc = "voc"  # Pascal VOC 2012: JPEGImages/, SegmentationClass/, ImageSets/Segmentation/
    coco = "coco"  # COCO 2017 with masks of the 20 VOC classes written by `make prep-tv_segmentation`


@dataclass
class DataConfig:
    dataset: DatasetName = DatasetName.voc
    root: str = "data/tv_segmentation/voc"  # the VOC2012 folder, or the prepared COCO folder
    train_split: str = "train"
    val_split: str = "val"
    base_size: int = 520  # training resizes the shorter side to [min_scale, max_scale] x this; eval to this
    crop_size: int = 480  # training crop; smaller images are padded (image with 0, mask with 255)
    min_scale: float = 0.5
    max_scale: float = 2.0
    hflip_prob: float = 0.5


@dataclass
class ModelConfig:
    name: str = "deeplabv3_mobilenet_v3_large"  # any torchvision segmentation model
    num_classes: int = 21  # background + the 20 VOC classes
    aux_loss: bool = True
    aux_weight: float = 0.5
    weights: str = ""  # whole-model weights: a state-dict file or a torchvision name (…_Weights.X)
    weights_backbone: str = ""  # backbone weights: a state-dict file or a torchvision name
    sync_batchnorm: bool = True  # BatchNorm statistics over the global batch under DDP


@dataclass
class OptimConfig:
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-4
    aux_lr_multiplier: float = 10.0  # the auxiliary head trains at 10x the base LR
    poly_power: float = 0.9
    warmup_epochs: float = 0.0
    warmup_start_factor: float = 0.01


@dataclass
class TvSegmentationConfig(RunConfig):
    recipe: str = "tv_segmentation"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Batch 4 per GPU, as the reference commands (-b 4); evaluation one image at a time, as the
    # reference does (trainer.eval_batch_size > 1 pads images of different sizes, masks with 255).
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(epochs=30, batch_size=4, eval_batch_size=1,
                                                                         log_every_steps=20))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(best_metric="eval/miou"))

