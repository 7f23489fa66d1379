"""Semantic segmentation with torchvision models on Pascal VOC or COCO: a port of torchvision's
``references/segmentation`` to the run contract, readable top to bottom.

    python -m recipes.tv_segmentation.train [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.tv_segmentation.train +experiment=seg_fcn_resnet101_coco

Run contract (see README.md, ``common/run.py``): the run directory is ``runs/tv_segmentation/<name>``;
a run whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common.data import PerSampleSeeded, make_loader
from common.distributed import DistInfo
from common.entry import recipe_main, training_process
from common.image_batches import Normalize
from common.metrics import SumMetrics, ratio
from common.optim import scaled_lr
from common.precision import autocast, grad_scaler
from common.rng import seed_everything
from common.run import TrainingRun
from common.sampler import ResumableDistributedSampler
from common.steps import EpochTail, StepPlan, compile_static
from recipes.tv_segmentation.config import TvSegmentationConfig
from recipes.tv_segmentation.data import (
    MEAN,
    STD,
    VOC_CLASSES,
    SegmentationDataset,
    eval_transform,
    find_pairs,
    pad_collate,
    train_transform,
)
from recipes.tv_segmentation.metrics import ConfusionMatrix, segmentation_scores
from recipes.tv_segmentation.model import build_model, param_groups, segmentation_loss, training_resize, warmup_poly
from recipes.tv_segmentation.sync_batchnorm import convert_sync_batchnorm


def class_names(num_classes: int) -> list[str]:
    return list(VOC_CLASSES) if num_classes == len(VOC_CLASSES) else [f"class_{i}" for i in range(num_classes)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, normalize: Normalize, cfg: DictConfig,
             dist_info: DistInfo) -> dict[str, float]:
    """mIoU, pixel accuracy and per-class IoU over the whole split, each pixel counted once."""
    model.eval()
    matrix = ConfusionMatrix(cfg.model.num_classes, dist_info.device)
    for images, masks in loader:
        images = normalize(images)
        masks = masks.to(dist_info.device, non_blocking=True)
        if cfg.trainer.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(dist_info.device, cfg.trainer.precision):
            logits = model(images)["out"]
        matrix.update(masks, logits.argmax(1))
    model.train()
    scores = segmentation_scores(matrix.reduce())
    metrics = {"eval/miou": scores["miou"], "eval/pixel_accuracy": scores["pixel_accuracy"]}
    for name, iou in zip(class_names(cfg.model.num_classes), scores["iou"]):
        if iou == iou:  # NaN: the class is neither in the targets nor predicted
            metrics[f"eval/iou/{name}"] = iou
    return metrics


@recipe_main(TvSegmentationConfig)
def main(cfg: DictConfig) -> None:
    with training_process(cfg) as dist_info:
        train(cfg, dist_info)


def train(cfg: DictConfig, dist_info: DistInfo) -> None:
    device = dist_info.device
    seed_everything(cfg.seed)

    # ---- data: file lists checked before anything else; images decoded in DataLoader workers --
    train_pairs = find_pairs(cfg.data, cfg.data.train_split)
    val_pairs = find_pairs(cfg.data, cfg.data.val_split)
    train_set = PerSampleSeeded(
        SegmentationDataset(train_pairs, train_transform(cfg.data), cfg.model.num_classes, augment=True), cfg.seed
    )
    val_set = SegmentationDataset(val_pairs, eval_transform(cfg.data), cfg.model.num_classes, augment=False)
    sampler = ResumableDistributedSampler(len(train_set), dist_info.rank, dist_info.world_size, seed=cfg.seed,
                                          shuffle=True, drop_last=True, yield_epoch=True)
    val_sampler = ResumableDistributedSampler(len(val_set), dist_info.rank, dist_info.world_size, shuffle=False,
                                              drop_last=False)
    # Full optimizer steps only: an epoch's remainder of less than a step is left out (BatchNorm).
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.drop_partial_step)
    pin_memory = device.type == "cuda"
    # Own generators: creating an iterator must not draw from the global RNG that dropout uses.
    train_loader = make_loader(train_set, sampler, plan.micro_batch, cfg.trainer.num_workers, pin_memory,
                               collate_fn=pad_collate, drop_last=plan.drop_last, generator=torch.Generator())
    val_loader = make_loader(val_set, val_sampler, cfg.trainer.eval_batch_size, cfg.trainer.num_workers, pin_memory,
                             collate_fn=pad_collate, generator=torch.Generator())
    normalize = Normalize(MEAN, STD, device)  # the loaders hand over uint8

    # ---- model: torchvision by name, synchronised BatchNorm under DDP -------------------------
    model = build_model(cfg.model)
    synced_norms = 0
    if dist_info.distributed and cfg.model.sync_batchnorm:
        model, synced_norms = convert_sync_batchnorm(model)
    model = model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
        if dist_info.distributed else model
    forward = compile_static(ddp_model) if cfg.trainer.compile else ddp_model

    # ---- optimization: SGD with momentum, aux head at 10x LR, warmup + poly schedule ----------
    lr = scaled_lr(cfg.optim.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    groups = param_groups(model, aux_lr=lr * cfg.optim.aux_lr_multiplier)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    scheduler = warmup_poly(optimizer, round(cfg.optim.warmup_epochs * plan.per_epoch), plan.total,
                            cfg.optim.poly_power, cfg.optim.warmup_start_factor)
    scaler = grad_scaler(device, cfg.trainer.precision)
    train_sums = SumMetrics(device)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run.py) ---------
    run = TrainingRun.from_config(cfg, dist_info, plan, model=model, optimizer=optimizer, scheduler=scheduler,
                                  scaler=scaler, sampler=sampler, train_sums=train_sums)
    progress = run.resume()
    run.console(
        f"tv_segmentation: {cfg.model.name} on {cfg.data.dataset.value} ({len(train_set)} train, {len(val_set)} val "
        f"images), {dist_info.world_size} rank(s) on {device.type}, {plan.describe()}, lr {lr:g}, {plan.total} "
        f"steps, {train_loader.num_workers} loader workers per rank"
    )
    if synced_norms:
        run.console(f"SyncBatchNorm: {synced_norms} BatchNorm layers synchronised across {dist_info.world_size} ranks")

    def run_eval() -> dict[str, float]:
        return run.log_eval(evaluate(forward, val_loader, normalize, cfg, dist_info),
                            headline=["eval/miou", "eval/pixel_accuracy"])

    # ---- training loop --------------------------------------------------------------------
    # The step reads plain dataclass copies of its settings: a DictConfig lookup costs about 20 µs.
    trainer_cfg, model_cfg = (OmegaConf.to_object(node) for node in (cfg.trainer, cfg.model))
    model.train()
    while not run.training_done():
        for group in run.steps(train_loader):  # one optimizer step per group of micro-batches
            for i, (images, masks) in enumerate(group):
                images = normalize(images)
                masks = masks.to(device, non_blocking=True).long()
                if trainer_cfg.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                skip_grad_sync = dist_info.distributed and i < len(group) - 1
                with ddp_model.no_sync() if skip_grad_sync else contextlib.nullcontext():
                    with autocast(device, trainer_cfg.precision), training_resize(device, trainer_cfg.deterministic):
                        loss = segmentation_loss(forward(images), masks, model_cfg.aux_weight)
                    scaler.scale(loss / len(group)).backward()
                train_sums.add(loss=loss.detach(), batches=1)
            grad_norm = None
            if trainer_cfg.grad_clip_norm:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            run.step_done(group.samples, grad_norm)

            if progress.step % trainer_cfg.log_every_steps == 0:
                sums = train_sums.reduce()
                train_sums.reset()
                run.log_train({"train/loss": ratio(sums, "loss", "batches"), "train/lr": scheduler.get_last_lr()[0]})
        run.end_epoch(run_eval)  # a whole epoch: evaluate every trainer.eval_every_epochs, checkpoint

    # ---- finish: final evaluation and checkpoint, then summary.json ---------------------------
    run.finish(run_eval, model=cfg.model.name, dataset=cfg.data.dataset.value)


if __name__ == "__main__":
    main()
