"""Evaluate a timm_imagenet checkpoint on the val split, without training (``common/evaluate.py``),
with timm's evaluation transform (resize, centre crop); with ``ema.enabled`` its EMA weights too.

    make eval-timm_imagenet RUN=runs/timm_imagenet/default [WHICH=best] [NPROC=8]
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from common.data import make_loader
from common.distributed import DistInfo
from common.evaluate import Evaluation, main
from common.image_batches import Normalize
from common.sampler import ResumableDistributedSampler
from recipes.timm_imagenet.data import check_layout, eval_transform, image_folder, resolve
from recipes.timm_imagenet.model import build_model
from recipes.timm_imagenet.train import evaluate

SPLITS = ("val",)  # data.val_split of the ImageFolder tree; ImageNet's test labels are not public


def architecture(model_cfg: DictConfig, num_classes: int) -> torch.nn.Module:
    """The model without pretrained weights (a checkpoint or an export brings them)."""
    return build_model(OmegaConf.merge(model_cfg, {"pretrained": False, "pretrained_file": ""}), num_classes)


def evaluation(cfg: DictConfig, dist_info: DistInfo, split: str) -> Evaluation:
    device = dist_info.device
    _, val_dir = check_layout(cfg.data.root, cfg.data.train_split, cfg.data.val_split)
    val_images = image_folder(val_dir, None)
    model = architecture(cfg.model, len(val_images.classes))
    eval_config = resolve(model, cfg.data.eval_size, cfg.data.eval_crop_pct, cfg.data.interpolation)
    val_images.transform = eval_transform(eval_config)
    sampler = ResumableDistributedSampler(len(val_images), dist_info.rank, dist_info.world_size, shuffle=False,
                                          drop_last=False)
    sampler.set_epoch(0)
    loader = make_loader(val_images, sampler, cfg.trainer.eval_batch_size, cfg.trainer.num_workers,
                         device.type == "cuda")
    normalize = Normalize(eval_config["mean"], eval_config["std"], device)
    model = model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)

    def evaluate_ema(ema: torch.nn.Module) -> dict[str, float]:
        return evaluate(ema, loader, normalize, cfg, device, "eval_ema")

    return Evaluation(model, lambda model: evaluate(model, loader, normalize, cfg, device, "eval"),
                      evaluate_ema if cfg.ema.enabled else None)


if __name__ == "__main__":
    main("timm_imagenet", SPLITS, evaluation)
