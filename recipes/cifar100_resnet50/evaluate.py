"""Evaluate a cifar100_resnet50 checkpoint on the test split, without training (``common/evaluate.py``);
with ``ema.enabled`` its EMA weights too (``eval_ema/*``).

    make eval-cifar100_resnet50 RUN=runs/cifar100_resnet50/default [WHICH=best]
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from common.distributed import DistInfo
from common.evaluate import Evaluation, main
from common.image_batches import Normalize
from recipes.cifar100_resnet50.data import MEAN, STD, load_split
from recipes.cifar100_resnet50.model import build_model
from recipes.cifar100_resnet50.train import evaluate

SPLITS = ("test",)  # CIFAR-100 has a train and a test split; training evaluates on test


def evaluation(cfg: DictConfig, dist_info: DistInfo, split: str) -> Evaluation:
    device = dist_info.device
    images, labels = (t.to(device) for t in load_split(cfg.data.root, split))
    normalize = Normalize(MEAN, STD, device, input_max=1)
    model = build_model(cfg.model).to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    def evaluate_ema(ema: torch.nn.Module) -> dict[str, float]:
        return evaluate(ema, images, labels, normalize, cfg, dist_info, prefix="eval_ema")

    return Evaluation(model, lambda model: evaluate(model, images, labels, normalize, cfg, dist_info),
                      evaluate_ema if cfg.ema.enabled else None)


if __name__ == "__main__":
    main("cifar100_resnet50", SPLITS, evaluation)
