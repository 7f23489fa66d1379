"""The timm_imagenet config schema and every default of the recipe (``conf/timm_imagenet.yaml`` only
composes it with the shared run layout; the ``conf/experiment/timm_*`` presets set published recipes'
values). Names follow timm's ``train.py`` arguments where there is one.

Default: a plain 90-epoch ResNet-50 baseline (Nesterov SGD, lr 0.1 per 256 images scaled linearly,
cosine with 5 warmup epochs, label smoothing 0.1, bf16, channels_last, background checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from common.config import (
    CheckpointConfig,
    DataFormat,
    Decode,
    DistillConfig,
    EmaConfig,
    FSDPConfig,
    LRScaling,
    MixupConfig,
    Precision,
    ProgressiveConfig,
    RunConfig,
    ShardsConfig,
    TrainerConfig,
)


@dataclass
class DataConfig:
    root: str = "data/imagenet"  # ImageFolder tree: <root>/train/<wnid>/*.JPEG, <root>/val/<wnid>/*.JPEG
    train_split: str = "train"
    val_split: str = "val"
    format: DataFormat = DataFormat.files  # files: the tree, listed once (<root>/<split>.index.npz); shards
    shards: ShardsConfig = field(default_factory=ShardsConfig)  # data.format=shards: <shards.root>/<split>
    rebuild_index: bool = False  # list the tree's files again, even when its saved list is up to date
    stage_to_local: bool = False  # copy data.root to stage_dir first (local rank 0 copies, the others wait)
    stage_dir: str = "${oc.env:TMPDIR,/tmp}"  # node-local disk; SLURM sets TMPDIR per job on most clusters
    decode: Decode = Decode.auto  # training JPEGs: cpu = in DataLoader workers; gpu = on the device; auto = the faster
    draft_decode: bool = True  # decode at 1/2, 1/4 or 1/8 scale when the crop stays >= the output size (cpu)
    # Resolutions: 0 / "" / 0.0 take the model's own default (timm's resolve_data_config).
    train_size: int = 224
    eval_size: int = 224
    progressive: ProgressiveConfig = field(default_factory=ProgressiveConfig)  # train_size grown to from start_size
    eval_crop_pct: float = 0.875  # eval resizes to eval_size / crop_pct, then centre-crops eval_size
    interpolation: str = "bilinear"  # bilinear | bicubic | random
    # Training augmentation (timm's create_transform).
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop area range
    ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: float = 0.5
    color_jitter: float = 0.4  # timm turns it off when auto_augment is set
    auto_augment: str = ""  # a timm policy ("rand-m9-mstd0.5-inc1", "original", "augmix-m5-w4-d2") or "ta_wide"
    re_prob: float = 0.0  # random erasing
    re_mode: str = "pixel"
    re_count: int = 1
    repeated_augmentation: int = 0  # copies of each sampled image per epoch (DeiT/timm --aug-repeats); 0 = off
    ra_selected_round: int = 256  # as timm: the images used per epoch are rounded down to a multiple of this


@dataclass
class ModelConfig:
    name: str = "resnet50"  # any timm model name (`timm.list_models()`), optionally with a weight tag
    pretrained: bool = False  # load the name's published weights from the Hugging Face hub
    pretrained_file: str = ""  # or load weights from this local file (.pth/.safetensors); the head is re-sized
    drop_rate: float = 0.0  # dropout before the classifier
    drop_path_rate: float = 0.0  # stochastic depth
    kwargs: dict[str, Any] = field(default_factory=dict)  # more timm.create_model arguments, e.g. img_size


class Scheduler(str, Enum):
    cosine = "cosine"
    tanh = "tanh"
    step = "step"
    multistep = "multistep"
    poly = "poly"


class Loss(str, Enum):
    ce = "ce"  # cross-entropy (soft-target with mixup), with label smoothing
    bce = "bce"  # binary cross-entropy on (smoothed/mixed) one-hot targets, as in "ResNet strikes back"


@dataclass
class OptimConfig:
    opt: str = "sgd"  # any timm optimizer (timm.optim.list_optimizers()); timm's "sgd" is Nesterov SGD
    lr: float = 0.1  # for trainer.lr_reference_batch_size (256) images, scaled by trainer.lr_scaling
    momentum: float = 0.9
    weight_decay: float = 1e-4  # not applied to norms and biases
    opt_eps: float = 0.0  # 0 = the optimizer's default
    sched: Scheduler = Scheduler.cosine
    warmup_epochs: int = 5
    warmup_lr: float = 1e-6
    min_lr: float = 0.0
    decay_epochs: float = 90.0  # step: decay every this many epochs
    decay_milestones: list[int] = field(default_factory=lambda: [90, 180, 270])  # multistep
    decay_rate: float = 0.1  # step / multistep factor
    loss: Loss = Loss.ce
    label_smoothing: float = 0.1
    bce_target_thresh: float = 0.0  # bce only: binarize targets above this (0 = off)


@dataclass
class TimmImageNetConfig(RunConfig):
    recipe: str = "timm_imagenet"
    data: DataConfig = field(default_factory=DataConfig)
    mixup: MixupConfig = field(default_factory=MixupConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # off unless distill.teacher is set
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # off: DDP across ranks
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        epochs=90, lr_scaling=LRScaling.linear, precision=Precision.bf16, channels_last=True, log_every_steps=100))
    # Background checkpoints: the loop waits only for the copy to host memory.
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(async_save=True))

