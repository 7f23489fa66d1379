"""Semantic segmentation with torchvision models on Pascal VOC or COCO: a port of torchvision's
``references/segmentation`` to the run contract, readable top to bottom.

    python -m recipes.tv_segmentation.train [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.tv_segmentation.train +experiment=seg_fcn_resnet101_coco

Run contract (see README.md): the run directory is ``runs/tv_segmentation/<name>``; a run
whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common import train_state
from common.checkpoint import CheckpointManager
from common.data import PerSampleSeeded, make_loader
from common.determinism import configure_determinism
from common.distributed import DistInfo, init_distributed, shutdown_distributed
from common.entry import recipe_main
from common.errors import UserError
from common.images import Normalize
from common.loggers import RunLogger
from common.metrics import SumMetrics, ratio
from common.optim import accumulation_steps, scaled_lr
from common.precision import autocast, grad_scaler
from common.preemption import CheckpointCadence
from common.sampler import ResumableDistributedSampler
from common.summary import where_outputs_are, write_summary
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
    configure_determinism(cfg.trainer.deterministic, cfg.device)  # before CUDA starts
    dist_info = init_distributed(cfg.device)
    try:
        train(cfg, dist_info)
    finally:
        shutdown_distributed()


def train(cfg: DictConfig, dist_info: DistInfo) -> None:
    device = dist_info.device
    train_state.seed_everything(cfg.seed)

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
    pin_memory = device.type == "cuda"
    micro_batch = cfg.trainer.batch_size
    # Own generators: creating an iterator must not draw from the global RNG that dropout uses.
    train_loader = make_loader(train_set, sampler, micro_batch, cfg.trainer.num_workers, pin_memory,
                               collate_fn=pad_collate, drop_last=True, generator=torch.Generator())
    val_loader = make_loader(val_set, val_sampler, cfg.data.eval_batch_size, cfg.trainer.num_workers, pin_memory,
                             collate_fn=pad_collate, generator=torch.Generator())
    normalize = Normalize(MEAN, STD, device)  # the loaders hand over uint8

    # ---- model: torchvision by name, SyncBatchNorm under DDP ---------------------------------
    model = build_model(cfg.model)
    synced_norms = 0
    if dist_info.distributed and cfg.model.sync_batchnorm:
        model, synced_norms = convert_sync_batchnorm(model, device)
    model = model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if dist_info.distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = torch.compile(model) if cfg.trainer.compile else model

    # ---- optimization: SGD with momentum, aux head at 10x LR, warmup + poly schedule ----------
    accumulate = accumulation_steps(cfg.trainer.global_batch_size, micro_batch, dist_info.world_size)
    global_batch = micro_batch * dist_info.world_size * accumulate
    lr = scaled_lr(cfg.optim.lr, global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    groups = param_groups(model, aux_lr=lr * cfg.optim.aux_lr_multiplier)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    samples_per_step = micro_batch * accumulate  # per rank
    steps_per_epoch = sampler.samples_per_rank_in_epoch() // samples_per_step
    if steps_per_epoch == 0:
        raise UserError(f"the {cfg.data.train_split} split has {len(train_set)} images, fewer than one step of "
                        f"{global_batch} needs")
    total_steps = steps_per_epoch * cfg.trainer.epochs
    if cfg.trainer.max_steps:
        total_steps = min(total_steps, cfg.trainer.max_steps)
    scheduler = warmup_poly(optimizer, round(cfg.optim.warmup_epochs * steps_per_epoch), total_steps,
                            cfg.optim.poly_power, cfg.optim.warmup_start_factor)
    scaler = grad_scaler(device, cfg.trainer.precision)
    train_sums = SumMetrics(device)

    # ---- resume: the newest valid checkpoint in the checkpoint directory, if any ------------
    checkpoints = CheckpointManager.from_config(cfg.checkpoint)
    progress = train_state.Progress()
    # Loaded to the CPU: RNG states must be there, and so must the optimizer's step counts (on a GPU
    # each optimizer step would read them back to the host).
    loaded = checkpoints.load_latest() if cfg.checkpoint.resume else None
    if loaded is not None:
        progress = train_state.restore(loaded.state, model, optimizer, scheduler, scaler, sampler, train_sums)
    else:
        sampler.set_epoch(0)

    logger = RunLogger.from_config(cfg, dist_info.is_main, resume_step=progress.step)
    if loaded is not None:
        logger.console(f"resumed from {loaded.path} (step {progress.step}, epoch {progress.epoch})")
    logger.console(
        f"tv_segmentation: {cfg.model.name} on {cfg.data.dataset.value} ({len(train_set)} train, {len(val_set)} val "
        f"images), {dist_info.world_size} rank(s) on {device.type}, global batch {global_batch} "
        f"({micro_batch} x {dist_info.world_size} ranks x {accumulate} accumulation), lr {lr:g}, {total_steps} steps, "
        f"{train_loader.num_workers} loader workers per rank"
    )
    if synced_norms:
        logger.console(f"SyncBatchNorm: {synced_norms} BatchNorm layers synchronised across "
                       f"{dist_info.world_size} ranks")

    timer = train_state.SegmentTimer()
    cadence = CheckpointCadence.from_config(cfg.checkpoint)

    def save(metrics: dict[str, float] | None = None) -> None:
        progress.train_seconds += timer.lap()
        state = train_state.capture(model, optimizer, scheduler, scaler, sampler, progress, train_sums)
        checkpoints.save(progress.step, state, metrics)
        cadence.saved()

    def run_eval() -> dict[str, float]:
        metrics = evaluate(forward, val_loader, normalize, cfg, dist_info)
        logger.log(metrics, progress.step)
        logger.console(f"epoch {progress.epoch}, step {progress.step}: eval/miou {metrics['eval/miou']:.4f}, "
                       f"eval/pixel_accuracy {metrics['eval/pixel_accuracy']:.4f}")
        return metrics

    def training_done() -> bool:
        return progress.epoch >= cfg.trainer.epochs or progress.step >= total_steps

    # ---- training loop: full optimizer steps only; an epoch's remainder (< one step) is dropped --
    # The step reads plain dataclass copies of its settings: a DictConfig lookup costs about 20 µs.
    trainer_cfg, model_cfg = (OmegaConf.to_object(node) for node in (cfg.trainer, cfg.model))
    model.train()
    if not training_done():
        progress.finished = False  # a finished run restarted with more epochs or steps goes on
    while not training_done():
        steps_left_in_epoch = len(sampler) // samples_per_step
        bar = logger.progress(steps_per_epoch, initial=steps_per_epoch - steps_left_in_epoch,
                              description=f"epoch {progress.epoch + 1}/{trainer_cfg.epochs}")
        batches = iter(train_loader)
        for _ in range(steps_left_in_epoch):
            for i in range(accumulate):
                images, masks = next(batches)
                images = normalize(images)
                masks = masks.to(device, non_blocking=True).long()
                if trainer_cfg.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                skip_grad_sync = dist_info.distributed and i < accumulate - 1
                with model.no_sync() if skip_grad_sync else contextlib.nullcontext():
                    with autocast(device, trainer_cfg.precision), training_resize(device, trainer_cfg.deterministic):
                        loss = segmentation_loss(forward(images), masks, model_cfg.aux_weight)
                    scaler.scale(loss / accumulate).backward()
                train_sums.add(loss=loss.detach(), batches=1)
            if trainer_cfg.grad_clip_norm:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sampler.advance(samples_per_step)
            progress.step += 1
            bar.update()

            if progress.step % trainer_cfg.log_every_steps == 0:
                sums = train_sums.reduce()
                train_sums.reset()
                metrics = {"train/loss": ratio(sums, "loss", "batches"), "train/lr": scheduler.get_last_lr()[0]}
                logger.log(metrics, progress.step)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
            if progress.step >= total_steps:
                break
            decision = cadence.after_step(progress.step)
            if decision.save:
                save()
            if decision.stop:
                bar.close()
                checkpoints.wait()
                logger.close()
                raise cadence.preempted(progress.step)
        bar.close()

        if len(sampler) < samples_per_step:  # every full step of this epoch is done
            progress.epoch += 1
            sampler.set_epoch(progress.epoch)
            if not training_done():
                due = progress.epoch % trainer_cfg.eval_every_epochs == 0
                save(run_eval() if due else None)

    # ---- finish: final evaluation and checkpoint, then summary.json ---------------------------
    if progress.finished:
        eval_metrics = loaded.metrics
    else:
        eval_metrics = run_eval()
        progress.finished = True
        save(eval_metrics)
    checkpoints.wait()
    logger.close()
    cadence.close()
    if dist_info.is_main:
        summary = write_summary(
            cfg.run_dir,
            recipe=cfg.recipe,
            metrics=eval_metrics,
            progress=progress,
            world_size=dist_info.world_size,
            model_digest=train_state.model_digest(model),
            model=cfg.model.name,
            dataset=cfg.data.dataset.value,
        )
        logger.console(
            f"done: eval mIoU {eval_metrics['eval/miou']:.4f}, pixel accuracy "
            f"{eval_metrics['eval/pixel_accuracy']:.4f} after {progress.step} steps\n"
            + where_outputs_are(cfg, summary)
        )


if __name__ == "__main__":
    main()
