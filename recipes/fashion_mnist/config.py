"""The fashion_mnist config schema; ``conf/fashion_mnist.yaml`` sets its values."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hydra.core.config_store import ConfigStore

from common.config import CheckpointConfig, LoggingConfig, RunConfig, TrainerConfig


@dataclass
class DataConfig:
    root: str = "data/fashion_mnist"  # the IDX files written by `make prep-fashion_mnist`
    random_crop_padding: int = 0  # pixels of zero padding for random crops; 0 = no crop
    horizontal_flip: bool = False


@dataclass
class ModelConfig:
    channels: list[int] = field(default_factory=lambda: [32, 64])  # one conv block per entry
    convs_per_block: int = 1
    hidden: int = 128
    dropout: float = 0.25


class OptimizerName(str, Enum):
    sgd = "sgd"
    adamw = "adamw"


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 3e-3
    momentum: float = 0.9  # SGD only
    weight_decay: float = 5e-4
    warmup_epochs: float = 0.5
    min_lr_ratio: float = 0.0
    label_smoothing: float = 0.0


@dataclass
class FashionMNISTConfig(RunConfig):
    recipe: str = "fashion_mnist"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


ConfigStore.instance().store(name="fashion_mnist_schema", node=FashionMNISTConfig)
