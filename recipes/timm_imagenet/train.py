"""Any timm model on ImageNet-style ImageFolder data, built from timm's own training components.

    python -m recipes.timm_imagenet.train [+experiment=timm_resnet50] [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.timm_imagenet.train +experiment=timm_resnet50

timm provides the model (``create_model``), the data config (``resolve_data_config``), the
augmentation (``create_transform``'s, run by ``common/images.py``: per sample in DataLoader
workers or on the device, then colour jitter, normalisation and random erasing on the device a
batch at a time, as timm's ``--prefetcher``), Mixup/CutMix, the losses, ``create_optimizer_v2``
(no weight decay on norms and biases), ``create_scheduler_v2`` (stepped per optimizer update)
and EMA; the repeated-augmentation sampler is timm's, made resumable (``sampler.py``).

Run contract (see README.md): the run directory is ``runs/timm_imagenet/<name>``; a run whose
checkpoint directory holds a valid checkpoint resumes from it, bit-exactly; SIGTERM/SIGUSR1
finish the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, list_optimizers
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common import train_state
from common.checkpoint import CheckpointManager
from common.data import PerSampleSeeded, make_loader, sample_seed
from common.determinism import configure_determinism
from common.distributed import DistInfo, broadcast_buffers, init_distributed, shutdown_distributed
from common.entry import recipe_main
from common.errors import UserError
from common.images import DeviceTrainInput, Normalize, TrainImages, collate_train
from common.loggers import RunLogger
from common.metrics import SumMetrics, ratio
from common.optim import accumulation_steps, scaled_lr
from common.precision import autocast, grad_scaler
from common.preemption import CheckpointCadence
from common.sampler import ResumableDistributedSampler
from common.staging import stage_directory
from common.summary import where_outputs_are, write_summary
from recipes.timm_imagenet import config as _schema  # noqa: F401  (registers the schema)
from recipes.timm_imagenet.data import (
    check_layout,
    describe,
    eval_transform,
    image_folder,
    random_erasing,
    resolve,
    train_augmentation,
)
from recipes.timm_imagenet.model import build_model
from recipes.timm_imagenet.sampler import RepeatedAugmentationSampler


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed the global generators from (seed, step, rank) before each optimizer step.

    timm's Mixup draws from NumPy's global generator and drop-path/dropout from torch's; neither
    takes a generator argument. The global streams also move when a DataLoader iterator is
    created, which happens at different points in a resumed run; reseeding per step makes a
    resumed run draw exactly what the uninterrupted run drew.
    """
    value = sample_seed(seed, step, rank)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, normalize: Normalize, cfg: DictConfig,
             device: torch.device, prefix: str) -> dict[str, float]:
    """Loss, top-1 and top-5 over the whole split, each image counted once across ranks."""
    broadcast_buffers(model)  # every rank scores rank 0's model, the one checkpointed
    was_training = model.training
    model.eval()
    sums = SumMetrics(device)
    sums.add(loss=0.0, top1=0, top5=0, count=0)  # a rank with no images still joins the reduction
    for images, labels in loader:
        images, labels = normalize(images), labels.to(device, non_blocking=True)
        if cfg.trainer.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(device, cfg.trainer.precision):
            logits = model(images)
        logits = logits.float()
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == labels[:, None]
        sums.add(loss=F.cross_entropy(logits, labels, reduction="sum"), top1=hits[:, 0].sum(),
                 top5=hits.any(dim=1).sum(), count=len(labels))
    model.train(was_training)
    totals = sums.reduce()
    return {f"{prefix}/loss": ratio(totals, "loss", "count"), f"{prefix}/top1": ratio(totals, "top1", "count"),
            f"{prefix}/top5": ratio(totals, "top5", "count")}


def make_criterion(cfg: DictConfig, mixing: bool) -> torch.nn.Module:
    """timm train.py's choice of loss: soft targets with Mixup/CutMix, else label smoothing."""
    threshold = cfg.optim.bce_target_thresh or None
    if cfg.optim.loss == "bce":
        smoothing = 0.0 if mixing else cfg.optim.label_smoothing  # Mixup already smooths the targets
        return BinaryCrossEntropy(smoothing=smoothing, target_threshold=threshold)
    if mixing:
        return SoftTargetCrossEntropy()
    if cfg.optim.label_smoothing:
        return LabelSmoothingCrossEntropy(smoothing=cfg.optim.label_smoothing)
    return torch.nn.CrossEntropyLoss()


@recipe_main("timm_imagenet")
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

    # ---- data: layout checked first, optionally staged to node-local disk -------------------
    root = Path(cfg.data.root)
    check_layout(root, cfg.data.train_split, cfg.data.val_split)
    if cfg.data.stage_to_local:
        root = stage_directory(root, cfg.data.stage_dir, dist_info.local_rank)
    train_dir, val_dir = check_layout(root, cfg.data.train_split, cfg.data.val_split)
    train_folder, val_images = image_folder(train_dir, None), image_folder(val_dir, None)
    num_classes = len(train_folder.classes)

    # ---- model, and the data config that goes with it (sizes, interpolation, mean/std) -------
    model = build_model(cfg.model, num_classes)
    train_config = resolve(model, cfg.data.train_size, 0.0, cfg.data.interpolation)
    eval_config = resolve(model, cfg.data.eval_size, cfg.data.eval_crop_pct, cfg.data.interpolation)
    augmentation = train_augmentation(cfg.data, train_config)
    train_images = TrainImages([path for path, _ in train_folder.samples], train_folder.targets, augmentation,
                               cfg.data.decode, cfg.data.draft_decode)
    val_images.transform = eval_transform(eval_config)
    train_input = DeviceTrainInput(augmentation, cfg.data.decode, train_config["mean"], train_config["std"], device,
                                   random_erasing(cfg.data, device))
    eval_input = Normalize(eval_config["mean"], eval_config["std"], device)
    model = model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) if cfg.ema.enabled else None
    if dist_info.distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = torch.compile(model) if cfg.trainer.compile else model

    # ---- samplers and loaders -------------------------------------------------------------
    micro_batch = cfg.trainer.batch_size
    mixing = cfg.mixup.mixup_alpha > 0 or cfg.mixup.cutmix_alpha > 0
    if mixing and micro_batch % 2:
        raise UserError(f"Mixup/CutMix need an even trainer.batch_size, not {micro_batch}")
    if cfg.data.repeated_augmentation > 1:
        sampler: ResumableDistributedSampler = RepeatedAugmentationSampler(
            len(train_images), cfg.data.repeated_augmentation, dist_info.rank, dist_info.world_size,
            seed=cfg.seed, selected_round=cfg.data.ra_selected_round,
        )
    else:
        sampler = ResumableDistributedSampler(len(train_images), dist_info.rank, dist_info.world_size,
                                              seed=cfg.seed, shuffle=True, drop_last=True, yield_epoch=True)
    pin_memory = device.type == "cuda"
    train_loader = make_loader(PerSampleSeeded(train_images, cfg.seed), sampler, micro_batch,
                               cfg.trainer.num_workers, pin_memory, collate_fn=collate_train, drop_last=True)
    eval_sampler = ResumableDistributedSampler(len(val_images), dist_info.rank, dist_info.world_size,
                                               shuffle=False, drop_last=False)
    eval_sampler.set_epoch(0)
    eval_loader = make_loader(val_images, eval_sampler, micro_batch, cfg.trainer.num_workers, pin_memory)

    # ---- optimization: batch bookkeeping, LR rule, timm optimizer and schedule ---------------
    accumulate = accumulation_steps(cfg.trainer.global_batch_size, micro_batch, dist_info.world_size)
    global_batch = micro_batch * dist_info.world_size * accumulate
    micro_batches_per_epoch = sampler.samples_per_rank_in_epoch() // micro_batch
    if micro_batches_per_epoch == 0:
        raise UserError(f"{train_dir} has too few images for one batch of {micro_batch} on each of "
                        f"{dist_info.world_size} rank(s)")
    steps_per_epoch = math.ceil(micro_batches_per_epoch / accumulate)
    total_steps = steps_per_epoch * cfg.trainer.epochs
    if cfg.trainer.max_steps:
        total_steps = min(total_steps, cfg.trainer.max_steps)
    lr = scaled_lr(cfg.optim.lr, global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    if cfg.optim.opt.lower() not in list_optimizers():
        raise UserError(f"optim.opt={cfg.optim.opt!r} is not a timm optimizer (see timm.optim.list_optimizers())")
    optimizer = create_optimizer_v2(
        train_state.unwrap_model(model), opt=cfg.optim.opt, lr=lr, weight_decay=cfg.optim.weight_decay,
        momentum=cfg.optim.momentum, **({"eps": cfg.optim.opt_eps} if cfg.optim.opt_eps else {}),
    )
    scheduler, _ = create_scheduler_v2(  # epochs=0 only evaluates (e.g. published weights); the schedule needs >= 1
        optimizer, sched=cfg.optim.sched, num_epochs=max(1, cfg.trainer.epochs), decay_epochs=cfg.optim.decay_epochs,
        decay_milestones=list(cfg.optim.decay_milestones), decay_rate=cfg.optim.decay_rate,
        min_lr=cfg.optim.min_lr, warmup_lr=cfg.optim.warmup_lr, warmup_epochs=cfg.optim.warmup_epochs,
        step_on_epochs=False, updates_per_epoch=steps_per_epoch,
    )
    mixup = Mixup(mixup_alpha=cfg.mixup.mixup_alpha, cutmix_alpha=cfg.mixup.cutmix_alpha, prob=cfg.mixup.prob,
                  switch_prob=cfg.mixup.switch_prob, mode=cfg.mixup.mode, label_smoothing=cfg.optim.label_smoothing,
                  num_classes=num_classes) if mixing else None
    criterion = make_criterion(cfg, mixing)
    scaler = grad_scaler(device, cfg.trainer.precision)
    train_sums = SumMetrics(device)

    # ---- resume: the newest valid checkpoint in the checkpoint directory, if any ------------
    checkpoints = CheckpointManager.from_config(cfg.checkpoint)
    progress = train_state.Progress()
    # Loaded to the CPU: RNG states must be there, and so must the optimizer's step counts (on a GPU
    # each optimizer step would read them back to the host).
    loaded = checkpoints.load_latest() if cfg.checkpoint.resume else None
    if loaded is not None:
        try:
            progress = train_state.restore(loaded.state, model, optimizer, scheduler, scaler, sampler, train_sums)
            if ema is not None:
                ema.module.load_state_dict(loaded.state["extra"]["ema"])
        except (ValueError, KeyError, RuntimeError) as error:
            raise UserError(f"the checkpoint {loaded.path} does not fit this run's config: "
                            f"{str(error).splitlines()[0]}") from error
    else:
        sampler.set_epoch(0)

    logger = RunLogger.from_config(cfg, dist_info.is_main, resume_step=progress.step)
    if loaded is not None:
        logger.console(f"resumed from {loaded.path} (step {progress.step}, epoch {progress.epoch})")
    logger.console(
        f"timm_imagenet: {cfg.model.name}, {num_classes} classes, {len(train_images)} train / "
        f"{len(val_images)} val images from {root}\n"
        f"  train {describe(train_config, with_crop=False)} decoded on {cfg.data.decode.value}, eval "
        f"{describe(eval_config, with_crop=True)}, {train_loader.num_workers} loader workers per rank\n"
        f"  {dist_info.world_size} rank(s) on {device.type}, global batch {global_batch} "
        f"({micro_batch} x {dist_info.world_size} ranks x {accumulate} accumulation), {cfg.optim.opt} lr {lr:g}, "
        f"{total_steps} steps"
    )

    timer = train_state.SegmentTimer()
    cadence = CheckpointCadence.from_config(cfg.checkpoint)

    def save(metrics: dict[str, float] | None = None) -> None:
        progress.train_seconds += timer.lap()
        extra = {"ema": ema.module.state_dict()} if ema is not None else None
        state = train_state.capture(model, optimizer, scheduler, scaler, sampler, progress, train_sums, extra)
        checkpoints.save(progress.step, state, metrics)
        cadence.saved()

    def run_eval() -> dict[str, float]:
        metrics = evaluate(forward, eval_loader, eval_input, cfg, device, "eval")
        if ema is not None:
            metrics |= evaluate(ema.module, eval_loader, eval_input, cfg, device, "eval_ema")
        logger.log(metrics, progress.step)
        logger.console(f"epoch {progress.epoch}, step {progress.step}: "
                       + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        return metrics

    def training_done() -> bool:
        return progress.epoch >= cfg.trainer.epochs or progress.step >= total_steps

    # ---- training loop --------------------------------------------------------------------
    # The step reads plain dataclass copies of its settings: a DictConfig lookup costs about 20 µs.
    trainer_cfg = OmegaConf.to_object(cfg.trainer)
    seed = cfg.seed
    model.train()
    log_clock, log_images = time.monotonic(), 0
    if not training_done():
        progress.finished = False  # a finished run restarted with more epochs or steps goes on
    while not training_done():
        micro_batches_left = len(sampler) // micro_batch
        bar = logger.progress(steps_per_epoch, initial=steps_per_epoch - math.ceil(micro_batches_left / accumulate),
                              description=f"epoch {progress.epoch + 1}/{trainer_cfg.epochs}")
        group_size = 1
        for index, (inputs, labels) in enumerate(train_loader):
            position = index % accumulate
            if position == 0:
                group_size = min(accumulate, micro_batches_left - index)
                seed_step(seed, progress.step, dist_info.rank)
            images, labels = train_input(inputs), labels.to(device, non_blocking=True)
            targets = labels
            if mixup is not None:
                images, targets = mixup(images, labels)
            if trainer_cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            skip_grad_sync = dist_info.distributed and position < group_size - 1
            with model.no_sync() if skip_grad_sync else contextlib.nullcontext():
                with autocast(device, trainer_cfg.precision):
                    logits = forward(images)
                    loss = criterion(logits, targets)
                scaler.scale(loss / group_size).backward()
            train_sums.add(loss=loss.detach() * len(labels), correct=(logits.argmax(1) == labels).sum(),
                           count=len(labels))
            if position < group_size - 1:
                continue

            if trainer_cfg.grad_clip_norm:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(train_state.unwrap_model(model), step=progress.step)
            sampler.advance(group_size * micro_batch)
            progress.step += 1
            scheduler.step_update(num_updates=progress.step)
            log_images += group_size * micro_batch * dist_info.world_size
            bar.update()

            if progress.step % trainer_cfg.log_every_steps == 0:
                sums = train_sums.reduce()
                train_sums.reset()
                now = time.monotonic()
                metrics = {"train/loss": ratio(sums, "loss", "count"),
                           "train/accuracy": ratio(sums, "correct", "count"),
                           "train/lr": optimizer.param_groups[0]["lr"],
                           "train/images_per_s": log_images / max(now - log_clock, 1e-9)}
                log_clock, log_images = now, 0
                logger.log(metrics, progress.step)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", img_s=f"{metrics['train/images_per_s']:.0f}")
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

        if len(sampler) < micro_batch:  # the epoch is done; a remainder under one batch is dropped, as in timm
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
        extra = {"model": cfg.model.name, "num_classes": num_classes}
        if ema is not None:
            extra["ema_digest"] = train_state.state_digest(ema.module.state_dict())
        summary = write_summary(
            cfg.run_dir,
            recipe=cfg.recipe,
            metrics=eval_metrics,
            progress=progress,
            world_size=dist_info.world_size,
            model_digest=train_state.model_digest(model),
            **extra,
        )
        logger.console(
            f"done: eval top-1 {eval_metrics['eval/top1']:.4f}, top-5 {eval_metrics['eval/top5']:.4f} "
            f"after {progress.step} steps\n"
            + where_outputs_are(cfg, summary)
        )


if __name__ == "__main__":
    main()
