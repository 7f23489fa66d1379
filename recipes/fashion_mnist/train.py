"""Fashion-MNIST with a small CNN: the reference recipe, readable top to bottom.

    python -m recipes.fashion_mnist.train [hydra overrides]
    torchrun --nproc-per-node 2 -m recipes.fashion_mnist.train [hydra overrides]

Run contract (see README.md, ``common/run/training_run.py``): the run directory is ``runs/fashion_mnist/<name>``;
a run whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.data.image_batches import random_crop_and_flip
from common.data.sampler import ResumableDistributedSampler
from common.entry import exit_process, recipe_main
from common.pytorch.distributed import DistInfo, data_parallel, gradient_sync
from common.pytorch.metrics import SumMetrics, ratio
from common.pytorch.optim import scaled_lr, warmup_cosine, weight_decay_groups
from common.pytorch.precision import autocast, grad_scaler
from common.pytorch.rng import seed_everything, seeded_generator
from common.records import startup
from common.run.steps import EpochTail, StepPlan, compile_static
from common.run.training_run import TrainingRun
from recipes.fashion_mnist.config import FashionMNISTConfig
from recipes.fashion_mnist.data import BLACK, load_split, normalize
from recipes.fashion_mnist.spec import SPEC, SPLITS, evaluator, model_as_trained


def train(cfg: FashionMNISTConfig, dist_info: DistInfo) -> None:
    startup.begin()  # the start-up's phases, timed to the first step (common/records/startup.py)
    device = dist_info.device
    seed_everything(cfg.seed)

    # ---- data: the whole dataset on the device, checked before anything else --------------
    train_images, train_labels = (t.to(device) for t in load_split(cfg.data.root, "train"))
    evaluate = evaluator(cfg, dist_info, SPLITS[0])
    startup.done(startup.DATA)

    # ---- model -------------------------------------------------------------------------------
    model = model_as_trained(cfg, dist_info)
    ddp_model = data_parallel(model, dist_info, cfg.trainer.out_of_memory.value)
    forward = compile_static(ddp_model) if cfg.trainer.compile else ddp_model

    # ---- optimization: steps of accumulated micro-batches, LR rule, schedule ----------------
    sampler = ResumableDistributedSampler(
        len(train_images), dist_info.rank, dist_info.world_size, seed=cfg.seed, shuffle=True, drop_last=True
    )
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.keep)
    lr = scaled_lr(cfg.optim.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    groups = weight_decay_groups(model, cfg.optim.weight_decay)
    if cfg.optim.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum, nesterov=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr)
    scheduler = warmup_cosine(optimizer, round(cfg.optim.warmup_epochs * plan.per_epoch), plan.total,
                              cfg.optim.min_lr_ratio)
    scaler = grad_scaler(device, cfg.trainer.precision)
    train_sums = SumMetrics(device)
    startup.done(startup.MODEL)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run/training_run.py) ---------
    run = TrainingRun(cfg, dist_info, plan, model=model, optimizer=optimizer, scheduler=scheduler,
                      scaler=scaler, sampler=sampler, train_sums=train_sums)
    progress = run.resume()
    run.console(f"fashion_mnist: {dist_info.world_size} rank(s) on {device.type}, {plan.describe()}, lr {lr:g}, "
                f"{plan.total} steps")

    def run_eval() -> dict[str, float]:
        return run.log_eval(evaluate(forward))

    # ---- training loop --------------------------------------------------------------------
    def forward_backward(batch: torch.Tensor, generator: torch.Generator, share: float, sync: bool) -> None:
        """One micro-batch's part of the step's gradient: ``share`` is its part of the step's samples.
        (A function, so that what it computed is freed if it runs out of memory.)"""
        x = random_crop_and_flip(normalize(train_images[batch]), cfg.data.random_crop_padding,
                                 cfg.data.horizontal_flip, generator, fill=BLACK)
        if cfg.trainer.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = train_labels[batch]
        with gradient_sync(ddp_model, sync):
            with autocast(device, cfg.trainer.precision):
                logits = forward(x)
                loss = F.cross_entropy(logits, y, label_smoothing=cfg.optim.label_smoothing)
            scaler.scale(loss * share).backward()
        train_sums.add(loss=loss.detach() * len(batch), top1=(logits.argmax(1) == y).sum(), count=len(batch))

    model.train()
    while not run.training_done():
        for group in run.steps(sampler.index_batches(plan.micro_batch, device)):  # one optimizer step per group
            with group:  # out of memory in here: trainer.out_of_memory=halve hands the step out again, halved
                generator = seeded_generator(device, cfg.seed, progress.step, dist_info.rank)
                for i, batch in enumerate(group):
                    forward_backward(batch, generator, len(batch) / group.samples, i == len(group) - 1)
                grad_norm = run.clip_grad_norm(model.parameters())  # clips to trainer.grad_clip_norm; train/grad_norm
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                run.step_done(group.samples, grad_norm, loss=train_sums.running("loss"))

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
