"""The dinov2_fsdp config schema and every default of the recipe (``conf/dinov2_fsdp.yaml`` only
composes it with the shared run layout).

Default: DINOv2 ViT-S/14 on CIFAR-100: 2 epochs of linear probe on the frozen backbone, then 8 epochs
of full fine-tuning at 1/8 of the probe LR, global batch 256, bf16. FSDP2 on several ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.config import CheckpointConfig, FSDPSettings, Precision, RunConfig, TrainerConfig


@dataclass
class DataConfig:
    root: str = "data/cifar100"  # holds cifar-100-python/, written by `make prep-cifar100_resnet50`
    random_crop_padding: int = 4  # pixels of padding for random 32x32 crops (before upsampling); 0 = none
    horizontal_flip: bool = True


class Library(str, Enum):
    transformers = "transformers"
    timm = "timm"


class Features(str, Enum):
    """What the head reads: the class token of the last block or (``cls4``) of each of the last 4, as
    DINOv2's eval/linear.py (``n_last_blocks``), optionally followed by the last block's mean patch token."""

    cls = "cls"  # the CLS token
    cls_patch_mean = "cls_patch_mean"  # CLS token concatenated with the mean of the patch tokens
    cls4 = "cls4"  # the CLS tokens of the last 4 blocks (each normalised), concatenated
    cls4_patch_mean = "cls4_patch_mean"  # those 4, then the last block's mean patch token


@dataclass
class ModelConfig:
    library: Library = Library.transformers
    # The architecture. transformers: a hub name (facebook/dinov2-{small,base,large,giant}) or a folder
    # written by save_pretrained; timm: a model name such as vit_base_patch14_dinov2.lvd142m.
    name: str = "facebook/dinov2-small"
    pretrained: bool = True  # false: the architecture only, randomly initialised
    # The pretrained weights' local copy, which `make prep-dinov2_fsdp` fills: a save_pretrained folder
    # (transformers), a timm folder or weights file (timm). "" = fetch `name` from the hub at every start.
    weights: str = "data/weights/facebook/dinov2-small"
    image_size: int = 224  # CIFAR images are upsampled to this (a multiple of the patch size)
    features: Features = Features.cls


@dataclass
class FSDPConfig(FSDPSettings):
    """Used when there are several ranks; one rank trains the plain module under autocast."""

    on_one_rank: bool = False  # shard with FSDP2 on a single rank too (a group of one): checks FSDP on one GPU


@dataclass
class StagesConfig:
    probe_epochs: int = 2  # the first epochs train only the head on the frozen backbone
    probe_warmup_epochs: float = 0.0
    finetune_lr_ratio: float = 0.125  # the fine-tune LR is this fraction of the probe LR
    finetune_warmup_epochs: float = 1.0


@dataclass
class ProbeConfig:
    """DINOv2's linear-evaluation sweep: several heads trained at once on one frozen forward per batch;
    the fine-tune starts from the one with the best eval/top1."""

    # One head per LR (each scaled as optim.lr is); [] = one head at optim.lr, the probe of a plain run.
    lrs: list[float] = field(default_factory=list)
    # Also a head for each narrower part of model.features: the last block's CLS token alone and, for
    # cls4*, the last 4 blocks' without the mean patch token (DINOv2's n_last_blocks 1 and 4, avgpool or not).
    feature_variants: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-3  # AdamW LR of the linear probe, for trainer.lr_reference_batch_size images
    weight_decay: float = 0.05
    min_lr_ratio: float = 0.0
    label_smoothing: float = 0.1


@dataclass
class DinoV2FSDPConfig(RunConfig):
    recipe: str = "dinov2_fsdp"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        batch_size=64, global_batch_size=256, eval_batch_size=128, precision=Precision.bf16))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

