"""Evaluate a fungitastic checkpoint on the val or test split, without training (``common/evaluate.py``):
top-1, top-3 and macro-F1 per taxonomic rank, hierarchy consistency.

    make eval-fungitastic RUN=runs/fungitastic/default WHICH=best SPLIT=test

The input normalisation is the one training used: that of the run's ``model.pretrained`` weights
(read again here, then replaced by the checkpoint's).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from common.distributed import DistInfo
from common.evaluate import Evaluation, main
from common.image_batches import Normalize
from recipes.fungitastic import metadata
from recipes.fungitastic.data import load_split
from recipes.fungitastic.model import TaxonomyClassifier, build_model, load_pretrained
from recipes.fungitastic.train import MultiTaskLoss, eval_loader, evaluate

SPLITS = ("val", "test")


def model_as_trained(cfg: DictConfig, mappings: dict) -> TaxonomyClassifier:
    """The model as ``train.py`` builds it, pretrained weights (and their input mean and std) included."""
    ranks = list(cfg.data.ranks)
    num_classes = {rank: mappings["num_classes"][rank] for rank in ranks}
    model = build_model(cfg.model, num_classes, ranks, cfg.data.image_size)
    if cfg.model.pretrained:
        load_pretrained(model, cfg.model.pretrained)
    return model


def evaluation(cfg: DictConfig, dist_info: DistInfo, split: str) -> Evaluation:
    device = dist_info.device
    ranks = list(cfg.data.ranks)
    mappings = metadata.load_mappings(cfg.data.prepared_dir, cfg.data.subset)
    loader = eval_loader(load_split(cfg.data, split, mappings), cfg, dist_info, device.type == "cuda")
    num_classes = {rank: mappings["num_classes"][rank] for rank in ranks}
    parents = ({rank: metadata.parent_table(mappings, rank) for rank in ranks if rank != "species"}
               if "species" in ranks else {})
    criterion = MultiTaskLoss(ranks, dict(cfg.loss.rank_weights), {}, cfg.optim.label_smoothing)
    model = model_as_trained(cfg, mappings)
    normalize = Normalize(model.backbone.pretrained_cfg["mean"], model.backbone.pretrained_cfg["std"], device)
    model = model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return Evaluation(model, lambda model: evaluate(model, loader, normalize, cfg, dist_info, criterion, num_classes,
                                                    parents, prefix=split))


if __name__ == "__main__":
    main("fungitastic", SPLITS, evaluation)
