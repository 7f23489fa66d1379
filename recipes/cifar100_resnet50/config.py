"""The cifar100_resnet50 config schema and every default of the recipe (``conf/cifar100_resnet50.yaml``
only composes it with the shared run layout).

Default: SGD + Nesterov, lr 0.1, wd 5e-4 (none on norms and biases), batch 128, one warmup epoch
then cosine over 200 epochs, random crop + flip, bf16 autocast, channels_last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.config import CheckpointConfig, DistillConfig, EmaConfig, MixupConfig, Precision, RunConfig, TrainerConfig


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


@dataclass
class ModelConfig:
    name: str = "resnet50"  # any timm ResNet (resnet18 ... resnet152, test_resnet in tests)
    cifar_stem: bool = True  # 3x3 stride-1 first conv and no max-pool, for 32x32 inputs
    drop_path_rate: float = 0.0


class Scheduler(str, Enum):
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
    sched: Scheduler = Scheduler.cosine
    warmup_epochs: float = 1.0
    min_lr_ratio: float = 0.0  # cosine only
    milestones: list[int] = field(default_factory=lambda: [60, 120, 160])  # multistep only, in epochs
    gamma: float = 0.2  # multistep only
    label_smoothing: float = 0.0


@dataclass
class Cifar100ResNet50Config(RunConfig):
    recipe: str = "cifar100_resnet50"
    data: DataConfig = field(default_factory=DataConfig)
    mixup: MixupConfig = field(default_factory=MixupConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # off unless distill.teacher is set
    optim: OptimConfig = field(default_factory=OptimConfig)
    # On a CPU, trainer.precision=fp32 is usually faster than bf16.
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(
        epochs=200, eval_batch_size=512, precision=Precision.bf16, channels_last=True))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

