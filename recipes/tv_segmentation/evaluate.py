"""Evaluate a tv_segmentation checkpoint on the val split, without training (``common/evaluate.py``):
mIoU, pixel accuracy and per-class IoU, from one confusion matrix summed over ranks.

    make eval-tv_segmentation RUN=runs/tv_segmentation/default [WHICH=best] [NPROC=4]
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from common.data import make_loader
from common.distributed import DistInfo
from common.evaluate import Evaluation, main
from common.image_batches import Normalize
from common.sampler import ResumableDistributedSampler
from recipes.tv_segmentation.data import MEAN, STD, SegmentationDataset, eval_transform, find_pairs, pad_collate
from recipes.tv_segmentation.model import build_model
from recipes.tv_segmentation.train import evaluate

SPLITS = ("val",)  # data.val_split; VOC's and COCO's test annotations are not public


def architecture(model_cfg: DictConfig) -> torch.nn.Module:
    """The model without pretrained weights (a checkpoint or an export brings them)."""
    return build_model(OmegaConf.merge(model_cfg, {"weights": "", "weights_backbone": ""}))


def evaluation(cfg: DictConfig, dist_info: DistInfo, split: str) -> Evaluation:
    device = dist_info.device
    dataset = SegmentationDataset(find_pairs(cfg.data, cfg.data.val_split), eval_transform(cfg.data),
                                  cfg.model.num_classes, augment=False)
    sampler = ResumableDistributedSampler(len(dataset), dist_info.rank, dist_info.world_size, shuffle=False,
                                          drop_last=False)
    loader = make_loader(dataset, sampler, cfg.trainer.eval_batch_size, cfg.trainer.num_workers,
                         device.type == "cuda", collate_fn=pad_collate, generator=torch.Generator())
    normalize = Normalize(MEAN, STD, device)
    model = architecture(cfg.model).to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return Evaluation(model, lambda model: evaluate(model, loader, normalize, cfg, dist_info))


if __name__ == "__main__":
    main("tv_segmentation", SPLITS, evaluation)
