"""The cifar100_resnet50 config schema; ``conf/cifar100_resnet50.yaml`` sets its values."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.config import CheckpointConfig, LoggingConfig, RunConfig, TrainerConfig


class AutoAugment(str, Enum):
    none = "none"
    trivialaugment = "trivialaugment"  # torchvision's TrivialAugmentWide
    randaugment = "randaugment"  # torchvision's RandAugment


@dataclass
class DataConfig:
    root: str = "data/cifar100"  # holds cifar-100-python/ as written by `make prep-cifar100_resnet50`
    random_crop_padding: int = 4  # pixels of zero padding for 32x32 random crops; 0 = no crop
    horizontal_flip: bool = True
    rotation_degrees: float = 0.0  # random rotation in [-d, d] degrees (nearest, black corners); 0 = off
    auto_augment: AutoAugment = AutoAugment.none
    randaugment_ops: int = 2
    randaugment_magnitude: int = 9
    random_erasing: float = 0.0  # probability of erasing one rectangle per image with noise
    mixup_alpha: float = 0.0  # timm Mixup; 0 = off
    cutmix_alpha: float = 0.0  # timm Mixup's CutMix; 0 = off
    mix_prob: float = 1.0  # probability of mixing a batch when mixup or cutmix is on
    mix_switch_prob: float = 0.5  # probability of CutMix instead of mixup when both are on


@dataclass
class ModelConfig:
    name: str = "resnet50"  # any timm ResNet (resnet18 ... resnet152, test_resnet in tests)
    cifar_stem: bool = True  # 3x3 stride-1 first conv and no max-pool, for 32x32 inputs
    drop_path_rate: float = 0.0
    ema_decay: float = 0.0  # timm ModelEmaV3 of the weights, evaluated alongside; 0 = no EMA


class Schedule(str, Enum):
    cosine = "cosine"  # linear warmup, then cosine decay to min_lr_ratio x lr
    multistep = "multistep"  # linear warmup, then lr x gamma after each milestone epoch


@dataclass
class OptimConfig:
    """SGD with momentum (Nesterov by default), the optimizer of the CIFAR ResNet literature."""

    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    decay_norms_and_biases: bool = False  # True applies weight decay to every parameter
    schedule: Schedule = Schedule.cosine
    warmup_epochs: float = 1.0
    min_lr_ratio: float = 0.0  # cosine only
    milestones: list[int] = field(default_factory=lambda: [60, 120, 160])  # multistep only, in epochs
    gamma: float = 0.2  # multistep only
    label_smoothing: float = 0.0


@dataclass
class Cifar100ResNet50Config(RunConfig):
    recipe: str = "cifar100_resnet50"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

