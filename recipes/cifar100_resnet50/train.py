"""CIFAR-100 with a timm ResNet-50 trained from scratch, readable top to bottom.

    python -m recipes.cifar100_resnet50.train [hydra overrides]
    torchrun --nproc-per-node 2 -m recipes.cifar100_resnet50.train [hydra overrides]
    python -m recipes.cifar100_resnet50.train +experiment=cifar100_reference   # the published 77.4% recipe

Run contract (see README.md): the run directory is ``runs/cifar100_resnet50/<name>``; a run
whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel

from common import train_state
from common.checkpoint import CheckpointManager
from common.data import seeded_generator
from common.determinism import configure_determinism
from common.distributed import DistInfo, broadcast_buffers, init_distributed, shutdown_distributed
from common.entry import recipe_main
from common.errors import UserError
from common.loggers import RunLogger
from common.metrics import SumMetrics, ratio
from common.optim import accumulation_steps, param_groups, scaled_lr, warmup_cosine, warmup_multistep
from common.precision import autocast, grad_scaler
from common.preemption import CheckpointCadence
from common.sampler import ResumableDistributedSampler
from common.summary import where_outputs_are, write_summary
from recipes.cifar100_resnet50 import config as _schema  # noqa: F401  (registers the schema)
from recipes.cifar100_resnet50.data import TrainAugmentation, load_split, normalize
from recipes.cifar100_resnet50.model import build_model


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, cfg: DictConfig,
             dist_info: DistInfo, prefix: str = "eval") -> dict[str, float]:
    """Loss, top-1 and top-5 accuracy over the whole split, each sample counted once across ranks."""
    broadcast_buffers(model)  # every rank scores rank 0's model, the one checkpointed
    was_training = model.training
    model.eval()
    sampler = ResumableDistributedSampler(
        len(images), dist_info.rank, dist_info.world_size, shuffle=False, drop_last=False
    )
    sums = SumMetrics(dist_info.device)
    for batch in sampler.index_batches(cfg.trainer.batch_size * 4, images.device):
        x = normalize(images[batch])
        if cfg.trainer.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(dist_info.device, cfg.trainer.precision):
            logits = model(x).float()
        y = labels[batch]
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        sums.add(loss=F.cross_entropy(logits, y, reduction="sum"), correct=(top5[:, 0] == y).sum(),
                 correct_top5=(top5 == y[:, None]).any(1).sum(), count=len(batch))
    model.train(was_training)
    totals = sums.reduce()
    return {f"{prefix}/loss": ratio(totals, "loss", "count"),
            f"{prefix}/accuracy": ratio(totals, "correct", "count"),
            f"{prefix}/top5": ratio(totals, "correct_top5", "count")}


@recipe_main("cifar100_resnet50")
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

    # ---- data: the whole dataset on the device, checked before anything else --------------
    train_images, train_labels = (t.to(device) for t in load_split(cfg.data.root, "train"))
    test_images, test_labels = (t.to(device) for t in load_split(cfg.data.root, "test"))
    augmentation = TrainAugmentation(cfg.data, cfg.optim.label_smoothing)

    # ---- model (and its EMA) -------------------------------------------------------------------
    model = build_model(cfg.model).to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = ModelEmaV3(model, decay=cfg.model.ema_decay) if cfg.model.ema_decay > 0 else None
    raw_model = model
    if dist_info.distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = torch.compile(model) if cfg.trainer.compile else model

    # ---- optimization: batch bookkeeping, LR rule, schedule ---------------------------------
    micro_batch = cfg.trainer.batch_size
    accumulate = accumulation_steps(cfg.trainer.global_batch_size, micro_batch, dist_info.world_size)
    global_batch = micro_batch * dist_info.world_size * accumulate
    lr = scaled_lr(cfg.optim.lr, global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    if cfg.optim.decay_norms_and_biases:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        groups = param_groups(model, cfg.optim.weight_decay)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov,
                                weight_decay=cfg.optim.weight_decay)
    sampler = ResumableDistributedSampler(
        len(train_images), dist_info.rank, dist_info.world_size, seed=cfg.seed, shuffle=True, drop_last=True
    )
    steps_per_epoch = math.ceil(math.ceil(sampler.samples_per_rank_in_epoch() / micro_batch) / accumulate)
    total_steps = steps_per_epoch * cfg.trainer.epochs
    if cfg.trainer.max_steps:
        total_steps = min(total_steps, cfg.trainer.max_steps)
    warmup_steps = round(cfg.optim.warmup_epochs * steps_per_epoch)
    if cfg.optim.schedule == "multistep":
        scheduler = warmup_multistep(optimizer, warmup_steps, [m * steps_per_epoch for m in cfg.optim.milestones],
                                     cfg.optim.gamma)
    else:
        scheduler = warmup_cosine(optimizer, warmup_steps, total_steps, cfg.optim.min_lr_ratio)
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
        if ema is not None:
            if "ema" not in loaded.state.get("extra", {}):
                raise UserError(f"{loaded.path} was saved without an EMA; resume with model.ema_decay=0")
            ema.module.load_state_dict(loaded.state["extra"]["ema"])
    else:
        sampler.set_epoch(0)

    logger = RunLogger.from_config(cfg, dist_info.is_main, resume_step=progress.step)
    if loaded is not None:
        logger.console(f"resumed from {loaded.path} (step {progress.step}, epoch {progress.epoch})")
    logger.console(
        f"cifar100_resnet50: {cfg.model.name} on {dist_info.world_size} rank(s) on {device.type}, "
        f"global batch {global_batch} ({micro_batch} x {dist_info.world_size} ranks x {accumulate} accumulation), "
        f"lr {lr:g}, {cfg.optim.schedule.value} schedule, {total_steps} steps"
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
        metrics = evaluate(forward, test_images, test_labels, cfg, dist_info)
        if ema is not None:
            metrics |= evaluate(ema.module, test_images, test_labels, cfg, dist_info, prefix="eval_ema")
        logger.log(metrics, progress.step)
        logger.console(f"epoch {progress.epoch}, step {progress.step}: "
                       + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        return metrics

    def training_done() -> bool:
        return progress.epoch >= cfg.trainer.epochs or progress.step >= total_steps

    # ---- training loop --------------------------------------------------------------------
    # The step reads plain dataclass copies of its settings: a DictConfig lookup costs about 20 µs.
    trainer_cfg, optim_cfg = (OmegaConf.to_object(node) for node in (cfg.trainer, cfg.optim))
    seed = cfg.seed
    model.train()
    if not training_done():
        progress.finished = False  # a finished run restarted with more epochs or steps goes on
    while not training_done():
        micro_batches = sampler.index_batches(micro_batch, device)
        steps_left_in_epoch = math.ceil(len(micro_batches) / accumulate)
        bar = logger.progress(steps_per_epoch, initial=steps_per_epoch - steps_left_in_epoch,
                              description=f"epoch {progress.epoch + 1}/{trainer_cfg.epochs}")
        for first in range(0, len(micro_batches), accumulate):
            group = micro_batches[first : first + accumulate]
            group_samples = sum(len(batch) for batch in group)
            generator = seeded_generator(device, seed, progress.step, dist_info.rank)
            for i, batch in enumerate(group):
                y = train_labels[batch]
                x, targets = augmentation(train_images[batch], y, generator, seed, progress.step,
                                          dist_info.rank, i)
                if trainer_cfg.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                skip_grad_sync = dist_info.distributed and i < len(group) - 1
                with model.no_sync() if skip_grad_sync else contextlib.nullcontext():
                    with autocast(device, trainer_cfg.precision):
                        logits = forward(x)
                        smoothing = 0.0 if augmentation.soft_targets else optim_cfg.label_smoothing
                        loss = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing)
                    scaler.scale(loss * (len(batch) / group_samples)).backward()
                train_sums.add(loss=loss.detach() * len(batch), correct=(logits.argmax(1) == y).sum(),
                               count=len(batch))
            if trainer_cfg.grad_clip_norm:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sampler.advance(group_samples)
            progress.step += 1
            if ema is not None:
                ema.update(raw_model, step=progress.step)
            bar.update()

            if progress.step % trainer_cfg.log_every_steps == 0:
                sums = train_sums.reduce()
                train_sums.reset()
                metrics = {"train/loss": ratio(sums, "loss", "count"),
                           "train/accuracy": ratio(sums, "correct", "count"),
                           "train/lr": scheduler.get_last_lr()[0]}
                logger.log(metrics, progress.step)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{metrics['train/accuracy']:.3f}")
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

        if len(sampler) == 0:  # every sample of this epoch is done
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
        )
        logger.console(
            f"done: eval top-1 {eval_metrics['eval/accuracy']:.4f}, top-5 {eval_metrics['eval/top5']:.4f} "
            f"after {progress.step} steps\n"
            + where_outputs_are(cfg, summary)
        )


if __name__ == "__main__":
    main()
