"""Any timm model on ImageNet-style ImageFolder data, built from timm's own training components.

    python -m recipes.timm_imagenet.train [+experiment=timm_resnet50] [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.timm_imagenet.train +experiment=timm_resnet50

timm provides the model (``create_model``), the data config (``resolve_data_config``), the
augmentation (``create_transform``'s, run by ``common/data/images.py``: per sample in DataLoader
workers or on the device, then colour jitter, normalisation and random erasing on the device a
batch at a time, as timm's ``--prefetcher``), Mixup/CutMix, the losses, ``create_optimizer_v2``
(no weight decay on norms and biases), ``create_scheduler_v2`` (stepped per optimizer update)
and EMA; the repeated-augmentation sampler is timm's, made resumable (``sampler.py``).

Run contract (see README.md, ``common/run/training_run.py``): the run directory is ``runs/timm_imagenet/<name>``;
a run whose checkpoint directory holds a valid checkpoint resumes from it, bit-exactly; SIGTERM/SIGUSR1
finish the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, list_optimizers
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3

from common.after_training.distill import distilled, load_teacher
from common.config import DataFormat
from common.data.decode_choice import choose_train_decode
from common.data.device_input import DeviceTrainInput
from common.data.images import TrainImages, collate_train
from common.data.loaders import make_train_loader
from common.data.progressive import ImageSizes, ProgressiveImages, check_takes_any_size
from common.data.sampler import ResumableDistributedSampler
from common.data.staging import stage_directory
from common.entry import exit_process, recipe_main
from common.errors import UserError
from common.pytorch.activation_checkpointing import residual_blocks
from common.pytorch.distributed import DistInfo, data_parallel, gradient_sync
from common.pytorch.metrics import SumMetrics, ratio
from common.pytorch.optim import scaled_lr
from common.pytorch.precision import autocast, grad_scaler
from common.pytorch.rng import seed_everything, seeded_global_rng
from common.records import startup
from common.run.steps import EpochTail, StepPlan, compile_static
from common.run.training_run import TrainingRun
from recipes.timm_imagenet.config import TimmImageNetConfig
from recipes.timm_imagenet.data import (
    check_layout,
    class_names,
    describe_input,
    random_erasing,
    resolve,
    split_files,
    split_images,
    train_augmentation,
)
from recipes.timm_imagenet.sampler import RepeatedAugmentationSampler
from recipes.timm_imagenet.spec import SPEC, SPLITS, evaluator, model_as_trained


def make_criterion(cfg: TimmImageNetConfig, mixing: bool) -> torch.nn.Module:
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


def train(cfg: TimmImageNetConfig, dist_info: DistInfo) -> None:
    startup.begin()  # the start-up's phases, timed to the first step (common/records/startup.py)
    device = dist_info.device
    seed_everything(cfg.seed)

    # ---- data: the tree's saved file lists (checked, or made once), optionally copied to node-local
    # disk with them; or the splits' shards ---------------------------------------------------------
    root = Path(cfg.data.root)
    if cfg.data.stage_to_local and cfg.data.format == DataFormat.shards:
        raise UserError("data.stage_to_local=true copies data.root's loose files, which data.format=shards does not "
                        "read: drop it, and give shards on a shared filesystem as a remote (data.shards.root="
                        "file:///path), read through the node-local cache data.shards.cache_dir")
    if cfg.data.format == DataFormat.files:
        check_layout(root, cfg.data.train_split, cfg.data.val_split)
        if cfg.data.stage_to_local:
            for split in (cfg.data.train_split, cfg.data.val_split):  # listed before the copy, which takes them
                split_files(cfg.data, split, root, cfg.run_dir, dist_info.local_rank)
            root = stage_directory(root, cfg.data.stage_dir, dist_info.local_rank)
    staged = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=str(root)))  # read from here
    train_source, classes, train_origin = split_images(staged.data, cfg.data.train_split, cfg.run_dir,
                                                       dist_info.local_rank)
    num_classes = len(classes)
    if class_names(staged.data) != classes:
        raise UserError(f"the {cfg.data.val_split} split holds other classes than {cfg.data.train_split} "
                        f"({train_origin}): prepare both from one dataset")
    evaluate = evaluator(staged, dist_info, SPLITS[0])
    startup.done(startup.DATA)

    # ---- model, and the data config that goes with it (sizes, interpolation, mean/std) -------
    model = model_as_trained(staged, dist_info)
    train_config = resolve(model, cfg.data.train_size, 0.0, cfg.data.interpolation)
    eval_config = resolve(model, cfg.data.eval_size, cfg.data.eval_crop_pct, cfg.data.interpolation)
    # data.progressive: each epoch's size (the last one's train_size), and an augmentation built for each size
    sizes = ImageSizes.from_config(cfg.data.progressive, train_config["input_size"][-1], cfg.trainer.epochs,
                                   "data.train_size")
    check_takes_any_size(model, sizes, "build it for any size (+model.kwargs.dynamic_img_size=true for a timm ViT)")
    augmentations = {size: train_augmentation(cfg.data, train_config | {"input_size": (3, size, size)})
                     for size in sizes.distinct()}
    augmentation = augmentations[sizes.end]
    if cfg.ema.enabled and cfg.fsdp.enabled:
        raise UserError("ema.enabled keeps a whole copy of the weights on every rank, which fsdp.enabled shards: "
                        "turn one of them off")
    ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) if cfg.ema.enabled else None
    ddp_model = model if cfg.fsdp.enabled else data_parallel(model, dist_info, cfg.trainer.out_of_memory.value)
    forward = compile_static(ddp_model) if cfg.trainer.compile and not cfg.fsdp.enabled else ddp_model
    if cfg.trainer.compile and cfg.fsdp.enabled:  # each block's forward; FSDP's hooks around it stay eager
        for block in residual_blocks(model):
            block.forward = compile_static(block.forward)

    # ---- samplers and steps: full micro-batches only, as in timm (BatchNorm) --------------------
    mixing = cfg.mixup.mixup_alpha > 0 or cfg.mixup.cutmix_alpha > 0
    if mixing and cfg.trainer.batch_size % 2:
        raise UserError(f"Mixup/CutMix need an even trainer.batch_size, not {cfg.trainer.batch_size}")
    if cfg.data.repeated_augmentation > 1:
        sampler: ResumableDistributedSampler = RepeatedAugmentationSampler(
            len(train_source), cfg.data.repeated_augmentation, dist_info.rank, dist_info.world_size,
            seed=cfg.seed, selected_round=cfg.data.ra_selected_round,
        )
    else:
        sampler = ResumableDistributedSampler(len(train_source), dist_info.rank, dist_info.world_size,
                                              seed=cfg.seed, shuffle=True, drop_last=True, yield_epoch=True)
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.drop_partial_batch)

    # ---- optimization: LR rule, timm optimizer and schedule, Mixup, loss -----------------------
    lr = scaled_lr(cfg.optim.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    if cfg.optim.opt.lower() not in list_optimizers():
        raise UserError(f"optim.opt={cfg.optim.opt!r} is not a timm optimizer (see timm.optim.list_optimizers())")
    optimizer = create_optimizer_v2(
        model, opt=cfg.optim.opt, lr=lr, weight_decay=cfg.optim.weight_decay,
        momentum=cfg.optim.momentum, **({"eps": cfg.optim.opt_eps} if cfg.optim.opt_eps else {}),
    )
    scheduler, _ = create_scheduler_v2(  # epochs=0 only evaluates (e.g. published weights); the schedule needs >= 1
        optimizer, sched=cfg.optim.sched.value, num_epochs=max(1, cfg.trainer.epochs),
        decay_epochs=cfg.optim.decay_epochs, decay_milestones=list(cfg.optim.decay_milestones),
        decay_rate=cfg.optim.decay_rate, min_lr=cfg.optim.min_lr, warmup_lr=cfg.optim.warmup_lr,
        warmup_epochs=cfg.optim.warmup_epochs, step_on_epochs=False, updates_per_epoch=plan.per_epoch,
    )
    mixup = Mixup(mixup_alpha=cfg.mixup.mixup_alpha, cutmix_alpha=cfg.mixup.cutmix_alpha, prob=cfg.mixup.prob,
                  switch_prob=cfg.mixup.switch_prob, mode=cfg.mixup.mode, label_smoothing=cfg.optim.label_smoothing,
                  num_classes=num_classes) if mixing else None
    criterion = make_criterion(cfg, mixing)
    teacher = load_teacher(staged, device)  # distill.teacher: frozen, in eval mode; None without one
    scaler = grad_scaler(device, cfg.trainer.precision)
    train_sums = SumMetrics(device)
    startup.done(startup.MODEL)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run/training_run.py) ---------
    # Under fsdp.enabled the model and optimizer state are saved as each rank's shards
    # (torch.distributed.checkpoint), so a run resumes on another number of ranks.
    run = TrainingRun(cfg, dist_info, plan, model=model, optimizer=optimizer, scheduler=scheduler,
                      scaler=scaler, sampler=sampler, train_sums=train_sums, sharded=cfg.fsdp.enabled,
                      extra_state={"ema": ema.module} if ema is not None else None, teacher=teacher)
    progress = run.resume()

    # ---- the input pipeline: decoded in the loader workers or on the device. data.decode=auto measures both
    # sides at the micro-batch in use, or keeps the choice the resumed checkpoint holds ---------------------
    decode = choose_train_decode(cfg.data.decode, cfg.trainer, augmentation, train_source, cfg.data.draft_decode,
                                 model, train_config["input_size"][-1], device, micro_batch=run.micro_batch,
                                 resumed=progress.decode)
    startup.done(startup.DECODE_CHOICE)
    progress.decode = decode.decode.value
    train_images = ProgressiveImages({size: TrainImages(train_source, augmentations[size], decode.decode,
                                                        cfg.data.draft_decode) for size in augmentations},
                                     sizes, cfg.seed)
    train_loader = make_train_loader(train_images, plan.epoch_batches(), cfg.trainer.num_workers,
                                     device.type == "cuda", collate_fn=collate_train)
    train_input = DeviceTrainInput(augmentation, decode.decode, train_config["mean"], train_config["std"], device,
                                   random_erasing(cfg.data, device), channels_last=cfg.trainer.channels_last)
    run.console(
        f"timm_imagenet: {cfg.model.name}, {num_classes} classes, train: {train_origin}\n"
        f"  train {describe_input(train_config, with_crop=False)}{sizes.describe()} decoded on {decode.decode.value}, "
        f"eval "
        f"{describe_input(eval_config, with_crop=True)}, {train_loader.num_workers} loader workers per rank\n"
        f"  {decode.reason}\n"
        f"  {dist_info.world_size} rank(s) on {device.type}{' with FSDP2' if cfg.fsdp.enabled else ''}, "
        f"{plan.describe()}, {cfg.optim.opt} lr {lr:g}, "
        f"{plan.total} steps"
    )

    def run_eval() -> dict[str, float]:
        metrics = evaluate(forward)
        if ema is not None:
            metrics |= evaluate(ema.module, of_ema=True)
        return run.log_eval(metrics)

    # ---- training loop --------------------------------------------------------------------
    def forward_backward(inputs: dict, labels: torch.Tensor, share: float, sync: bool) -> None:
        """One micro-batch's part of the step's gradient: ``share`` is its part of the step's samples.
        (A function, so that what it computed is freed if it runs out of memory.)"""
        images, labels = train_input(inputs), labels.to(device, non_blocking=True)
        targets = labels
        if mixup is not None:  # in place: the images stay in the memory format train_input wrote
            images, targets = mixup(images, labels)
        with gradient_sync(ddp_model, sync):
            with autocast(device, cfg.trainer.precision):
                logits = forward(images)
                loss = criterion(logits, targets)
                if teacher is not None:  # the same batch, after Mixup; its FLOPs are not the model's (train/mfu)
                    with torch.no_grad(), run.uncounted():
                        teacher_logits = teacher.model(images)
                    loss = distilled(loss, logits, teacher_logits, cfg.distill)
            scaler.scale(loss * share).backward()
        train_sums.add(loss=loss.detach() * len(labels), top1=(logits.argmax(1) == labels).sum(), count=len(labels))

    model.train()
    while not run.training_done():
        for group in run.steps(train_loader, train_input.to_device):  # one optimizer step per group of micro-batches
            with group:  # out of memory in here: trainer.out_of_memory=halve hands the step out again, halved
                # timm's Mixup draws from NumPy's global generator and drop path from torch's: seeded per step.
                with seeded_global_rng(cfg.seed, progress.step, dist_info.rank):
                    for i, (inputs, labels) in enumerate(group):
                        forward_backward(inputs, labels, len(labels) / group.samples, i == len(group) - 1)
                grad_norm = run.clip_grad_norm(model.parameters())  # clips to trainer.grad_clip_norm; train/grad_norm
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                run.step_done(group.samples, grad_norm, loss=train_sums.running("loss"))
                scheduler.step_update(num_updates=progress.step)
                if ema is not None:
                    ema.update(model, step=progress.step)

                if progress.step % cfg.trainer.log_every_steps == 0:
                    sums = train_sums.reduce()
                    train_sums.reset()
                    run.log_train({"train/loss": ratio(sums, "loss", "count"),
                                   "train/top1": ratio(sums, "top1", "count"),
                                   "train/lr": optimizer.param_groups[0]["lr"]} | sizes.logged(progress.epoch))
        run.end_epoch(run_eval)  # evaluate when due (eval_every_epochs/_steps), checkpoint

    # ---- finish: final evaluation and checkpoint, then summary.json ---------------------------
    run.finish(run_eval, model=cfg.model.name, num_classes=num_classes)


if __name__ == "__main__":
    exit_process(recipe_main(SPEC, train))  # overrides from the command line; train() in a training process
