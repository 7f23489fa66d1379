"""CIFAR-100 with a timm ResNet-50 trained from scratch, readable top to bottom.

    python -m recipes.cifar100_resnet50.train [hydra overrides]
    torchrun --nproc-per-node 2 -m recipes.cifar100_resnet50.train [hydra overrides]
    python -m recipes.cifar100_resnet50.train +experiment=cifar100_reference   # the published 77.4% recipe

Run contract (see README.md, ``common/run/training_run.py``): the run directory is ``runs/cifar100_resnet50/<name>``;
a run whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.utils import ModelEmaV3

from common.after_training.distill import distilled, load_teacher
from common.data import cifar100
from common.data.image_batches import Normalize
from common.data.sampler import ResumableDistributedSampler
from common.entry import exit_process, recipe_main
from common.pytorch.distributed import DistInfo, data_parallel, gradient_sync
from common.pytorch.metrics import SumMetrics, ratio
from common.pytorch.optim import scaled_lr, warmup_cosine, warmup_multistep, weight_decay_groups
from common.pytorch.precision import autocast, grad_scaler
from common.pytorch.rng import seed_everything, seeded_generator
from common.records import startup
from common.run.steps import EpochTail, StepPlan, compile_static
from common.run.training_run import TrainingRun
from recipes.cifar100_resnet50.config import Cifar100ResNet50Config
from recipes.cifar100_resnet50.data import MEAN, STD, BatchAugmentation
from recipes.cifar100_resnet50.spec import SPEC, SPLITS, evaluator, model_as_trained


def train(cfg: Cifar100ResNet50Config, dist_info: DistInfo) -> None:
    startup.begin()  # the start-up's phases, timed to the first step (common/records/startup.py)
    device = dist_info.device
    seed_everything(cfg.seed)

    # ---- data: the whole dataset on the device, checked before anything else --------------
    train_data = cifar100.load_split(cfg.data.root, "train", prep="cifar100_resnet50")
    train_images, train_labels = train_data.images.to(device), train_data.labels.to(device)
    evaluate = evaluator(cfg, dist_info, SPLITS[0])
    augmentation = BatchAugmentation(cfg.data, cfg.mixup, cfg.optim.label_smoothing,
                                     Normalize(MEAN, STD, device, input_max=1))
    startup.done(startup.DATA)

    # ---- model (and its EMA) -------------------------------------------------------------------
    model = model_as_trained(cfg, dist_info)
    ema = ModelEmaV3(model, decay=cfg.ema.decay, use_warmup=cfg.ema.warmup) if cfg.ema.enabled else None
    ddp_model = data_parallel(model, dist_info, cfg.trainer.out_of_memory.value)
    forward = compile_static(ddp_model) if cfg.trainer.compile else ddp_model

    # ---- optimization: steps of accumulated micro-batches, LR rule, schedule ----------------
    sampler = ResumableDistributedSampler(
        len(train_images), dist_info.rank, dist_info.world_size, seed=cfg.seed, shuffle=True, drop_last=True
    )
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.keep)
    lr = scaled_lr(cfg.optim.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    if cfg.optim.decay_norms_and_biases:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        groups = weight_decay_groups(model, cfg.optim.weight_decay)
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov,
                                weight_decay=cfg.optim.weight_decay)
    warmup_steps = round(cfg.optim.warmup_epochs * plan.per_epoch)
    if cfg.optim.sched == "multistep":
        scheduler = warmup_multistep(optimizer, warmup_steps, [m * plan.per_epoch for m in cfg.optim.milestones],
                                     cfg.optim.gamma)
    else:
        scheduler = warmup_cosine(optimizer, warmup_steps, plan.total, cfg.optim.min_lr_ratio)
    scaler = grad_scaler(device, cfg.trainer.precision)
    teacher = load_teacher(cfg, device)  # distill.teacher: frozen, in eval mode; None without one
    train_sums = SumMetrics(device)
    startup.done(startup.MODEL)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run/training_run.py) ---------
    run = TrainingRun(cfg, dist_info, plan, model=model, optimizer=optimizer, scheduler=scheduler,
                      scaler=scaler, sampler=sampler, train_sums=train_sums,
                      extra_state={"ema": ema.module} if ema is not None else None, teacher=teacher)
    progress = run.resume()
    run.console(f"cifar100_resnet50: {cfg.model.name} on {dist_info.world_size} rank(s) on {device.type}, "
                f"{plan.describe()}, lr {lr:g}, {cfg.optim.sched.value} schedule, {plan.total} steps")

    def run_eval() -> dict[str, float]:
        metrics = evaluate(forward)
        if ema is not None:
            metrics |= evaluate(ema.module, of_ema=True)
        return run.log_eval(metrics)

    # ---- training loop --------------------------------------------------------------------
    def forward_backward(batch: torch.Tensor, generator: torch.Generator, index: int, share: float,
                         sync: bool) -> None:
        """The ``index``-th micro-batch's part of the step's gradient: ``share`` is its part of the step's
        samples. (A function, so that what it computed is freed if it runs out of memory.)"""
        y = train_labels[batch]
        x, targets = augmentation(train_images[batch], y, generator, cfg.seed, progress.step, dist_info.rank, index)
        if cfg.trainer.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with gradient_sync(ddp_model, sync):
            with autocast(device, cfg.trainer.precision):
                logits = forward(x)
                smoothing = 0.0 if augmentation.soft_targets else cfg.optim.label_smoothing
                loss = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing)
                if teacher is not None:  # the same batch, after Mixup; its FLOPs are not the model's (train/mfu)
                    with torch.no_grad(), run.uncounted():
                        teacher_logits = teacher.model(x)
                    loss = distilled(loss, logits, teacher_logits, cfg.distill)
            scaler.scale(loss * share).backward()
        train_sums.add(loss=loss.detach() * len(batch), top1=(logits.argmax(1) == y).sum(), count=len(batch))

    model.train()
    while not run.training_done():
        for group in run.steps(sampler.index_batches(plan.micro_batch, device)):  # one optimizer step per group
            with group:  # out of memory in here: trainer.out_of_memory=halve hands the step out again, halved
                generator = seeded_generator(device, cfg.seed, progress.step, dist_info.rank)
                for i, batch in enumerate(group):
                    forward_backward(batch, generator, i, len(batch) / group.samples, i == len(group) - 1)
                grad_norm = run.clip_grad_norm(model.parameters())  # clips to trainer.grad_clip_norm; train/grad_norm
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                run.step_done(group.samples, grad_norm, loss=train_sums.running("loss"))
                if ema is not None:
                    ema.update(model, step=progress.step)

                if progress.step % cfg.trainer.log_every_steps == 0:
                    sums = train_sums.reduce()
                    train_sums.reset()
                    run.log_train({"train/loss": ratio(sums, "loss", "count"),
                                   "train/top1": ratio(sums, "top1", "count"), "train/lr": scheduler.get_last_lr()[0]})
        run.end_epoch(run_eval)  # evaluate when due (eval_every_epochs/_steps), checkpoint

    # ---- finish: final evaluation and checkpoint, then summary.json ---------------------------
    run.finish(run_eval)


if __name__ == "__main__":
    exit_process(recipe_main(SPEC, train))  # overrides from the command line; train() in a training process
