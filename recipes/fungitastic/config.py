"""The fungitastic config schema and every default of the recipe (``conf/fungitastic.yaml`` only
composes it with the shared run layout).

Default: FungiTastic-Mini at 300p, BEiT-B/16 at 224 px from ImageNet weights, AdamW, warmup +
cosine, the published baseline's augmentation (RandomResizedCrop 0.8-1, RandAugment(2, 20)),
bf16 autocast; the best checkpoint by validation species macro-F1 is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.config import (
    CheckpointConfig,
    DataFormat,
    Decode,
    DistillConfig,
    FSDPConfig,
    Precision,
    ProgressiveConfig,
    RunConfig,
    ShardsConfig,
    TrainerConfig,
)

DEFAULT_LEVELS = ["species", "genus", "family", "order", "class", "phylum"]


class Subset(str, Enum):
    full = "full"  # FungiTastic: metadata/FungiTastic/FungiTastic[-ClosedSet]-{Train,Val,Test}.csv
    mini = "mini"  # FungiTastic-Mini: metadata/FungiTastic-Mini/FungiTastic-Mini[-ClosedSet]-*.csv


@dataclass
class DataConfig:
    root: str = "data/fungitastic"  # holds metadata/ and FungiTastic[-Mini]/{train,val,test}/<size>/
    prepared_dir: str = "${data.root}/prepared"  # taxonomic_mappings.json, class_weights.pt, *-Minimal.csv
    subset: Subset = Subset.mini
    size: str = "300p"  # which image folder to read: 300p, 500p, 720p or fullsize
    minimal: bool = False  # use the *-Minimal.csv subsets written by `MINI=1 make prep-fungitastic`
    levels: list[str] = field(default_factory=lambda: list(DEFAULT_LEVELS))  # one head per level
    image_size: int = 224  # training (the last epochs' under data.progressive) and evaluation
    progressive: ProgressiveConfig = field(default_factory=ProgressiveConfig)  # image_size grown to from start_size
    crop_scale_min: float = 0.8  # RandomResizedCrop scale (min, 1.0), as the published baseline
    randaugment_ops: int = 2  # RandAugment(2, 20): the FGVC "vit_heavy" baseline; 0 ops = off
    randaugment_magnitude: int = 20
    horizontal_flip: bool = False
    draft_decode: bool = True  # let libjpeg decode large JPEGs at 1/2, 1/4 or 1/8 scale (never below image_size)
    decode: Decode = Decode.auto  # training JPEGs: cpu = in DataLoader workers; gpu = on the device; auto = the faster
    skip_missing: bool = False  # rows whose image file is missing: false = stop with an error, true = skip them
    format: DataFormat = DataFormat.files  # files: listed once (prepared_dir); shards: see data.shards
    shards: ShardsConfig = field(default_factory=ShardsConfig)  # <shards.root>/<subset>-<size>[-minimal]/<split>
    rebuild_index: bool = False  # list each split's files again, even when its saved list is up to date
    test_split: bool = True  # evaluate the final model on the test split (its CSV must have labels)


@dataclass
class ModelConfig:
    name: str = "beit_base_patch16_224"  # any timm model (test_vit in tests)
    # "" = random init; a local copy (a folder under data/weights/ that `make prep-fungitastic` fills, or a
    # state-dict file); or a hub name (hf-hub:..., a timm tag), which is then fetched at every start.
    pretrained: str = "data/weights/timm/beit_base_patch16_224.in22k_ft_in22k_in1k"
    drop_path_rate: float = 0.1
    head_dropout: float = 0.0
    derive_from_species: bool = False  # also report higher levels predicted by summing species probabilities


@dataclass
class LossConfig:
    level_weights: dict[str, float] = field(default_factory=lambda: {level: 1.0 for level in DEFAULT_LEVELS})
    class_weighted_levels: list[str] = field(default_factory=list)  # levels whose loss uses class_weights.pt


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    layer_decay: float = 0.0  # layer-wise LR decay (BEiT fine-tuning); 0 = off, else e.g. 0.65
    warmup_epochs: float = 1.0
    min_lr_ratio: float = 0.01
    label_smoothing: float = 0.0


@dataclass
class FungiTasticConfig(RunConfig):
    recipe: str = "fungitastic"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # off unless distill.teacher is set
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # off: DDP across ranks
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(epochs=30, batch_size=64, eval_batch_size=128,
                                                                         precision=Precision.bf16))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(best_metric="val/species/f1"))

