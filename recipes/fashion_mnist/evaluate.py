"""Evaluate a fashion_mnist checkpoint on the test split, without training (``common/evaluate.py``).

    make eval-fashion_mnist RUN=runs/fashion_mnist/default [WHICH=best]
    python -m recipes.fashion_mnist.evaluate runs/fashion_mnist/default --which best
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from common.distributed import DistInfo
from common.evaluate import Evaluation, main
from recipes.fashion_mnist.data import load_split
from recipes.fashion_mnist.model import build_model
from recipes.fashion_mnist.train import evaluate

SPLITS = ("test",)  # Fashion-MNIST has a train and a test split; training evaluates on test


def evaluation(cfg: DictConfig, dist_info: DistInfo, split: str) -> Evaluation:
    images, labels = (t.to(dist_info.device) for t in load_split(cfg.data.root, split))
    model = build_model(cfg.model).to(dist_info.device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return Evaluation(model, lambda model: evaluate(model, images, labels, cfg, dist_info))


if __name__ == "__main__":
    main("fashion_mnist", SPLITS, evaluation)
