"""Semantic segmentation with torchvision models on Pascal VOC or COCO: a port of torchvision's
``references/segmentation`` to the run contract, readable top to bottom.

    python -m recipes.tv_segmentation.train [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.tv_segmentation.train +experiment=seg_fcn_resnet101_coco

Run contract (see README.md, ``common/run/training_run.py``): the run directory is ``runs/tv_segmentation/<name>``;
a run whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import torch

from common.data.image_batches import Normalize
from common.data.loaders import PerSampleSeeded, make_train_loader
from common.data.sampler import ResumableDistributedSampler
from common.entry import exit_process, recipe_main
from common.pytorch.distributed import DistInfo, data_parallel, gradient_sync
from common.pytorch.metrics import SumMetrics, ratio
from common.pytorch.optim import scaled_lr
from common.pytorch.precision import autocast, grad_scaler
from common.pytorch.rng import seed_everything
from common.records import startup
from common.run.steps import EpochTail, StepPlan, compile_static
from common.run.training_run import TrainingRun
from recipes.tv_segmentation.config import TvSegmentationConfig
from recipes.tv_segmentation.data import MEAN, STD, SegmentationDataset, find_pairs, pad_collate, train_transform
from recipes.tv_segmentation.model import head_lr_groups, segmentation_loss, training_resize, warmup_poly
from recipes.tv_segmentation.spec import SPEC, SPLITS, evaluator, model_as_trained
from recipes.tv_segmentation.sync_batchnorm import AllReduceBatchNorm


def train(cfg: TvSegmentationConfig, dist_info: DistInfo) -> None:
    startup.begin()  # the start-up's phases, timed to the first step (common/records/startup.py)
    device = dist_info.device
    seed_everything(cfg.seed)

    # ---- data: file lists checked before anything else; images decoded in DataLoader workers --
    train_set = PerSampleSeeded(SegmentationDataset(find_pairs(cfg.data, cfg.data.train_split),
                                                    train_transform(cfg.data), cfg.model.num_classes, augment=True),
                                cfg.seed)
    evaluate = evaluator(cfg, dist_info, SPLITS[0])
    sampler = ResumableDistributedSampler(len(train_set), dist_info.rank, dist_info.world_size, seed=cfg.seed,
                                          shuffle=True, drop_last=True, yield_epoch=True)
    # Full optimizer steps only: an epoch's remainder of less than a step is left out (BatchNorm).
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.drop_partial_step)
    # Own generator: creating an iterator must not draw from the global RNG that dropout uses.
    train_loader = make_train_loader(train_set, plan.epoch_batches(), cfg.trainer.num_workers, device.type == "cuda",
                                     collate_fn=pad_collate, generator=torch.Generator())
    normalize = Normalize(MEAN, STD, device)  # the loaders hand over uint8
    startup.done(startup.DATA)

    # ---- model: torchvision by name, synchronised BatchNorm under DDP -------------------------
    model = model_as_trained(cfg, dist_info)
    ddp_model = data_parallel(model, dist_info, cfg.trainer.out_of_memory.value)
    forward = compile_static(ddp_model) if cfg.trainer.compile else ddp_model

    # ---- optimization: SGD with momentum, aux head at 10x LR, warmup + poly schedule ----------
    lr = scaled_lr(cfg.optim.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    groups = head_lr_groups(model, aux_lr=lr * cfg.optim.aux_lr_multiplier)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    scheduler = warmup_poly(optimizer, round(cfg.optim.warmup_epochs * plan.per_epoch), plan.total,
                            cfg.optim.poly_power, cfg.optim.warmup_start_factor)
    scaler = grad_scaler(device, cfg.trainer.precision)
    train_sums = SumMetrics(device)
    startup.done(startup.MODEL)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run/training_run.py) ---------
    run = TrainingRun(cfg, dist_info, plan, model=model, optimizer=optimizer, scheduler=scheduler,
                      scaler=scaler, sampler=sampler, train_sums=train_sums)
    progress = run.resume()
    run.console(
        f"tv_segmentation: {cfg.model.name} on {cfg.data.dataset.value} ({len(train_set)} train images), "
        f"{dist_info.world_size} rank(s) on {device.type}, {plan.describe()}, lr {lr:g}, {plan.total} steps, "
        f"{train_loader.num_workers} loader workers per rank"
    )
    synced_norms = sum(isinstance(module, AllReduceBatchNorm) for module in model.modules())
    if synced_norms:
        run.console(f"BatchNorm: {synced_norms} layers synchronised across {dist_info.world_size} ranks")

    def run_eval() -> dict[str, float]:
        return run.log_eval(evaluate(forward), headline=["eval/miou", "eval/pixel_accuracy"])

    # ---- training loop --------------------------------------------------------------------
    def forward_backward(images: torch.Tensor, masks: torch.Tensor, share: float, sync: bool) -> None:
        """One micro-batch's part of the step's gradient: ``share`` is its part of the step's samples.
        (A function, so that what it computed is freed if it runs out of memory.)"""
        images = normalize(images)
        masks = masks.to(device, non_blocking=True).long()
        if cfg.trainer.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with gradient_sync(ddp_model, sync):
            with autocast(device, cfg.trainer.precision), training_resize(device, cfg.trainer.deterministic):
                loss = segmentation_loss(forward(images), masks, cfg.model.aux_weight)
            scaler.scale(loss * share).backward()
        train_sums.add(loss=loss.detach() * len(images), count=len(images))

    model.train()
    while not run.training_done():
        for group in run.steps(train_loader):  # one optimizer step per group of micro-batches
            with group:  # out of memory in here: trainer.out_of_memory=halve hands the step out again, halved
                for i, (images, masks) in enumerate(group):
                    forward_backward(images, masks, len(images) / group.samples, i == len(group) - 1)
                grad_norm = run.clip_grad_norm(model.parameters())  # clips to trainer.grad_clip_norm; train/grad_norm
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                run.step_done(group.samples, grad_norm, loss=train_sums.running("loss"))

                if progress.step % cfg.trainer.log_every_steps == 0:
                    sums = train_sums.reduce()
                    train_sums.reset()
                    run.log_train({"train/loss": ratio(sums, "loss", "count"), "train/lr": scheduler.get_last_lr()[0]})
        run.end_epoch(run_eval)  # evaluate when due (eval_every_epochs/_steps), checkpoint

    # ---- finish: final evaluation and checkpoint, then summary.json ---------------------------
    run.finish(run_eval, model=cfg.model.name, dataset=cfg.data.dataset.value)


if __name__ == "__main__":
    exit_process(recipe_main(SPEC, train))  # overrides from the command line; train() in a training process
