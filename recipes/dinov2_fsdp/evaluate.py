"""Evaluate a dinov2_fsdp checkpoint on the CIFAR-100 test split, without training (``common/evaluate.py``).
Its FSDP shards load on any number of ranks: with several (or ``fsdp.on_one_rank=true``) the model
is sharded as in training, with one it is whole.

    make eval-dinov2_fsdp RUN=runs/dinov2_fsdp/default [WHICH=best] [NPROC=8]
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from common import cifar100
from common.distributed import DistInfo
from common.evaluate import Evaluation, main
from common.image_batches import Normalize
from recipes.dinov2_fsdp.data import MEAN, STD
from recipes.dinov2_fsdp.model import build_model, shard_with_fsdp
from recipes.dinov2_fsdp.train import check_settings, evaluate, process_group

SPLITS = ("test",)  # CIFAR-100 has a train and a test split; training evaluates on test


def evaluation(cfg: DictConfig, dist_info: DistInfo, split: str) -> Evaluation:
    device = dist_info.device
    check_settings(cfg, dist_info)
    data = cifar100.load_split(cfg.data.root, split)
    images, labels = data.images.to(device), data.labels.to(device)
    normalize = Normalize(MEAN, STD, device, input_max=1)
    model = build_model(cfg.model).to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    sharded = dist_info.distributed or cfg.fsdp.on_one_rank
    if sharded:
        shard_with_fsdp(model, cfg.trainer.precision, cfg.fsdp.reshard_after_forward, cfg.fsdp.cpu_offload)
    precision = "fp32" if sharded else cfg.trainer.precision  # FSDP casts parameters itself
    return Evaluation(model, lambda model: evaluate(model, images, labels, normalize, cfg, dist_info, precision))


if __name__ == "__main__":
    main("dinov2_fsdp", SPLITS, evaluation, process_group)
