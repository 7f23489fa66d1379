"""Fashion-MNIST with a small CNN: the reference recipe, readable top to bottom.

    python -m recipes.fashion_mnist.train [hydra overrides]
    torchrun --nproc-per-node 2 -m recipes.fashion_mnist.train [hydra overrides]

Run contract (see README.md, ``common/run.py``): the run directory is ``runs/fashion_mnist/<name>``;
a run whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from common.distributed import DistInfo, broadcast_buffers
from common.entry import recipe_main, training_process
from common.image_batches import random_crop_and_flip
from common.metrics import SumMetrics, ratio
from common.optim import param_groups, scaled_lr, warmup_cosine
from common.precision import autocast, grad_scaler
from common.rng import seed_everything, seeded_generator
from common.run import TrainingRun
from common.sampler import ResumableDistributedSampler
from common.steps import EpochTail, StepPlan, compile_static
from recipes.fashion_mnist.config import FashionMNISTConfig
from recipes.fashion_mnist.data import BLACK, load_split, normalize
from recipes.fashion_mnist.model import build_model


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, cfg: DictConfig,
             dist_info: DistInfo) -> dict[str, float]:
    """Loss and top-1 accuracy over the whole split, each sample counted once across ranks."""
    broadcast_buffers(model)  # every rank scores rank 0's model, the one checkpointed
    model.eval()
    sampler = ResumableDistributedSampler(
        len(images), dist_info.rank, dist_info.world_size, shuffle=False, drop_last=False
    )
    sums = SumMetrics(dist_info.device)
    for batch in sampler.index_batches(cfg.trainer.eval_batch_size, images.device):
        x = normalize(images[batch])
        if cfg.trainer.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(dist_info.device, cfg.trainer.precision):
            logits = model(x)
        y = labels[batch]
        sums.add(loss=F.cross_entropy(logits.float(), y, reduction="sum"), correct=(logits.argmax(1) == y).sum(),
                 count=len(batch))
    model.train()
    totals = sums.reduce()
    return {"eval/loss": ratio(totals, "loss", "count"), "eval/top1": ratio(totals, "correct", "count")}


@recipe_main(FashionMNISTConfig)
def main(cfg: DictConfig) -> None:
    with training_process(cfg) as dist_info:
        train(cfg, dist_info)


def train(cfg: DictConfig, dist_info: DistInfo) -> None:
    device = dist_info.device
    seed_everything(cfg.seed)

    # ---- data: the whole dataset on the device, checked before anything else --------------
    train_images, train_labels = (t.to(device) for t in load_split(cfg.data.root, "train"))
    test_images, test_labels = (t.to(device) for t in load_split(cfg.data.root, "test"))

    # ---- model -------------------------------------------------------------------------------
    model = build_model(cfg.model).to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
        if dist_info.distributed else model
    forward = compile_static(ddp_model) if cfg.trainer.compile else ddp_model

    # ---- optimization: steps of accumulated micro-batches, LR rule, schedule ----------------
    sampler = ResumableDistributedSampler(
        len(train_images), dist_info.rank, dist_info.world_size, seed=cfg.seed, shuffle=True, drop_last=True
    )
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.keep)
    lr = scaled_lr(cfg.optim.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    groups = param_groups(model, cfg.optim.weight_decay)
    if cfg.optim.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=cfg.optim.momentum, nesterov=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr)
    scheduler = warmup_cosine(optimizer, round(cfg.optim.warmup_epochs * plan.per_epoch), plan.total,
                              cfg.optim.min_lr_ratio)
    scaler = grad_scaler(device, cfg.trainer.precision)
    train_sums = SumMetrics(device)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run.py) ---------
    run = TrainingRun.from_config(cfg, dist_info, plan, model=model, optimizer=optimizer, scheduler=scheduler,
                                  scaler=scaler, sampler=sampler, train_sums=train_sums)
    progress = run.resume()
    run.console(f"fashion_mnist: {dist_info.world_size} rank(s) on {device.type}, {plan.describe()}, lr {lr:g}, "
                f"{plan.total} steps")

    def run_eval() -> dict[str, float]:
        return run.log_eval(evaluate(forward, test_images, test_labels, cfg, dist_info))

    # ---- training loop --------------------------------------------------------------------
    # The step reads plain dataclass copies of its settings: a DictConfig lookup costs about 20 µs.
    trainer_cfg, data_cfg, optim_cfg = (OmegaConf.to_object(node) for node in (cfg.trainer, cfg.data, cfg.optim))
    seed = cfg.seed
    model.train()
    while not run.training_done():
        for group in run.steps(sampler.index_batches(plan.micro_batch, device)):  # one optimizer step per group
            generator = seeded_generator(device, seed, progress.step, dist_info.rank)
            for i, batch in enumerate(group):
                x = random_crop_and_flip(normalize(train_images[batch]), data_cfg.random_crop_padding,
                                         data_cfg.horizontal_flip, generator, fill=BLACK)
                if trainer_cfg.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                y = train_labels[batch]
                skip_grad_sync = dist_info.distributed and i < len(group) - 1
                with ddp_model.no_sync() if skip_grad_sync else contextlib.nullcontext():
                    with autocast(device, trainer_cfg.precision):
                        logits = forward(x)
                        loss = F.cross_entropy(logits, y, label_smoothing=optim_cfg.label_smoothing)
                    scaler.scale(loss * (len(batch) / group.samples)).backward()
                train_sums.add(loss=loss.detach() * len(batch), correct=(logits.argmax(1) == y).sum(),
                               count=len(batch))
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
                run.log_train({"train/loss": ratio(sums, "loss", "count"),
                               "train/top1": ratio(sums, "correct", "count"),
                               "train/lr": scheduler.get_last_lr()[0]})
        run.end_epoch(run_eval)  # a whole epoch: evaluate every trainer.eval_every_epochs, checkpoint

    # ---- finish: final evaluation and checkpoint, then summary.json ---------------------------
    run.finish(run_eval)


if __name__ == "__main__":
    main()
