"""DINOv2 on CIFAR-100 with FSDP2: a linear probe on the frozen backbone, then full fine-tuning.

    python -m recipes.dinov2_fsdp.train [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.dinov2_fsdp.train [hydra overrides]

Stage 1 (the first ``stages.probe_epochs`` epochs) trains only the head: the backbone has no
gradients and no optimizer state. Stage 2 trains everything at ``stages.finetune_lr_ratio`` of
the probe LR with a fresh optimizer and schedule. The stage is saved in every checkpoint.

With several ranks (or ``fsdp.on_one_rank=true``) the model is sharded with FSDP2 (one unit per
transformer block, then the root) and checkpoints hold its shards (``torch.distributed.checkpoint``),
so a run can resume on a different number of ranks. Run contract: see README.md.
"""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common import cifar100, train_state
from common.checkpoint import SHARDED_DIR, CheckpointManager
from common.data import seeded_generator
from common.determinism import configure_determinism
from common.distributed import DistInfo, init_distributed, shutdown_distributed
from common.entry import recipe_main
from common.errors import UserError
from common.loggers import RunLogger
from common.metrics import SumMetrics, ratio
from common.optim import accumulation_steps, param_groups, scaled_lr, warmup_cosine
from common.precision import autocast
from common.preemption import CheckpointCadence
from common.sampler import ResumableDistributedSampler
from common.summary import where_outputs_are, write_summary
from recipes.dinov2_fsdp.config import DinoV2FSDPConfig
from recipes.dinov2_fsdp.data import augment, to_model_input
from recipes.dinov2_fsdp.model import build_model, refresh_mixed_precision, shard_with_fsdp


class Stage(str, Enum):
    probe = "probe"
    finetune = "finetune"


def check_settings(cfg: DictConfig, dist_info: DistInfo) -> None:
    """Settings this recipe cannot honour, refused before any work."""
    if not 0 <= cfg.stages.probe_epochs <= cfg.trainer.epochs:
        raise UserError(f"stages.probe_epochs={cfg.stages.probe_epochs} must be between 0 and "
                        f"trainer.epochs={cfg.trainer.epochs}")
    if cfg.trainer.precision == "fp16":
        raise UserError("trainer.precision=fp16 is not supported here: use bf16 (no loss scaling needed) or fp32")
    if cfg.fsdp.cpu_offload and dist_info.device.type != "cuda":
        raise UserError("fsdp.cpu_offload moves GPU state to host memory: it needs device=cuda")


def eval_batches(
    num_samples: int, rank: int, world_size: int, batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's evaluation batches as (indices, keep mask): each sample is kept on exactly one
    rank, and every rank gets the same number of batches (FSDP gathers weights collectively), so
    a rank with one sample fewer pads with a masked-out sample."""
    sampler = ResumableDistributedSampler(num_samples, rank, world_size, shuffle=False, drop_last=False)
    mine = torch.tensor(list(sampler), dtype=torch.long)
    per_rank = math.ceil(num_samples / world_size)
    indices = torch.zeros(per_rank, dtype=torch.long)
    indices[: len(mine)] = mine
    keep = torch.arange(per_rank) < len(mine)
    return list(zip(indices.split(batch_size), keep.split(batch_size)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, cfg: DictConfig,
             dist_info: DistInfo, precision: str) -> dict[str, float]:
    """Loss and accuracy over the whole split from sums over all ranks (total correct / total count)."""
    model.eval()
    sums = SumMetrics(dist_info.device)
    for batch, keep in eval_batches(len(images), dist_info.rank, dist_info.world_size, cfg.trainer.batch_size * 2):
        batch, keep = batch.to(images.device), keep.to(images.device)
        x = to_model_input(images[batch], cfg.model.image_size)
        if cfg.trainer.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(dist_info.device, precision):
            logits = model(x).float()
        y = labels[batch]
        sums.add(loss=F.cross_entropy(logits, y, reduction="none") * keep,
                 correct=(logits.argmax(1) == y) & keep, count=keep)
    model.train()
    totals = sums.reduce()
    return {"eval/loss": ratio(totals, "loss", "count"), "eval/accuracy": ratio(totals, "correct", "count")}


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, no weight decay on norms and biases; PyTorch's default
    implementation (foreach on CUDA), which works on FSDP2's sharded parameters."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr)


def load_optimizer_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Load the optimizer's shards of ``checkpoint`` once its stage has decided which optimizer exists."""
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(checkpoint / SHARDED_DIR))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


@recipe_main(DinoV2FSDPConfig)
def main(cfg: DictConfig) -> None:
    configure_determinism(cfg.trainer.deterministic, cfg.device)  # before CUDA starts
    dist_info = init_distributed(cfg.device, cpu_collectives=cfg.fsdp.cpu_offload,
                                 group_of_one=cfg.fsdp.on_one_rank)
    try:
        train(cfg, dist_info)
    finally:
        shutdown_distributed()


def train(cfg: DictConfig, dist_info: DistInfo) -> None:
    device = dist_info.device
    check_settings(cfg, dist_info)
    train_state.seed_everything(cfg.seed)

    # ---- data: CIFAR-100 as uint8 tensors on the device, checked before anything else -------
    train_split = cifar100.load_split(cfg.data.root, "train")
    test_split = cifar100.load_split(cfg.data.root, "test")
    train_images, train_labels = train_split.images.to(device), train_split.labels.to(device)
    test_images, test_labels = test_split.images.to(device), test_split.labels.to(device)

    # ---- model: FSDP2 across ranks (bf16 parameters, fp32 reductions); one rank: autocast ----
    model = build_model(cfg.model)
    model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    sharded = dist_info.distributed or cfg.fsdp.on_one_rank
    if sharded:
        shard_with_fsdp(model, cfg.trainer.precision, cfg.fsdp.reshard_after_forward, cfg.fsdp.cpu_offload)
    compute_precision = "fp32" if sharded else cfg.trainer.precision  # FSDP casts parameters itself
    if cfg.trainer.compile:  # each block's forward; FSDP's hooks around it stay eager
        for block in model.blocks:
            block.forward = torch.compile(block.forward)

    # ---- batch bookkeeping and the two stages' plan -----------------------------------------
    micro_batch = cfg.trainer.batch_size
    accumulate = accumulation_steps(cfg.trainer.global_batch_size, micro_batch, dist_info.world_size)
    global_batch = micro_batch * dist_info.world_size * accumulate
    probe_lr = scaled_lr(cfg.optim.lr, global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    sampler = ResumableDistributedSampler(
        len(train_images), dist_info.rank, dist_info.world_size, seed=cfg.seed, shuffle=True, drop_last=True
    )
    steps_per_epoch = math.ceil(math.ceil(sampler.samples_per_rank_in_epoch() / micro_batch) / accumulate)
    total_steps = steps_per_epoch * cfg.trainer.epochs
    if cfg.trainer.max_steps:
        total_steps = min(total_steps, cfg.trainer.max_steps)
    probe_steps = min(steps_per_epoch * cfg.stages.probe_epochs, total_steps)

    def stage_of_epoch(epoch: int) -> Stage:
        return Stage.probe if epoch < cfg.stages.probe_epochs else Stage.finetune

    def start_stage(stage: Stage) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """Freeze or unfreeze the backbone; a fresh AdamW over the trainable parameters, and its schedule."""
        model.set_backbone_trainable(stage == Stage.finetune)
        if sharded and stage == Stage.finetune:
            refresh_mixed_precision(model)
        if stage == Stage.probe:
            lr, steps, warmup = probe_lr, probe_steps, cfg.stages.probe_warmup_epochs
        else:
            lr, steps = probe_lr * cfg.stages.finetune_lr_ratio, total_steps - probe_steps
            warmup = cfg.stages.finetune_warmup_epochs
        optimizer = make_optimizer(model, lr, cfg.optim.weight_decay)
        scheduler = warmup_cosine(optimizer, round(warmup * steps_per_epoch), steps, cfg.optim.min_lr_ratio)
        return optimizer, scheduler

    train_sums = SumMetrics(device)

    # ---- resume: state.pt and the model's shards, then the stage's optimizer and its shards --
    checkpoints = CheckpointManager.from_config(cfg.checkpoint)
    progress = train_state.Progress(extra={"stage": stage_of_epoch(0).value})
    loaded = None
    if cfg.checkpoint.resume:
        model_state = {"model": get_model_state_dict(model)}
        loaded = checkpoints.load_latest(map_location="cpu", sharded_state=model_state)
        if loaded is not None:
            set_model_state_dict(model, model_state["model"])
    stage = Stage(loaded.state["progress"]["extra"]["stage"]) if loaded is not None else stage_of_epoch(0)
    optimizer, scheduler = start_stage(stage)
    if loaded is not None:
        load_optimizer_shards(model, optimizer, loaded.path)
        progress = train_state.restore(loaded.state, None, None, scheduler, None, sampler, train_sums)
    else:
        sampler.set_epoch(0)

    logger = RunLogger.from_config(cfg, dist_info.is_main, resume_step=progress.step)
    if loaded is not None:
        logger.console(f"resumed from {loaded.path} (step {progress.step}, epoch {progress.epoch}, "
                       f"stage {stage.value})")
    logger.console(
        f"dinov2_fsdp: {cfg.model.name} at {cfg.model.image_size}px, {dist_info.world_size} rank(s) on "
        f"{device.type}{' with FSDP2' if sharded else ''}, global batch {global_batch} "
        f"({micro_batch} x {dist_info.world_size} ranks x {accumulate} accumulation), probe lr {probe_lr:g}, "
        f"{probe_steps} probe + {total_steps - probe_steps} fine-tune steps"
    )

    timer = train_state.SegmentTimer()
    cadence = CheckpointCadence.from_config(cfg.checkpoint)

    def save(metrics: dict[str, float] | None = None, milestone: str | None = None) -> None:
        progress.train_seconds += timer.lap()
        state = train_state.capture(None, None, scheduler, None, sampler, progress, train_sums)
        model_shards, optimizer_shards = get_state_dict(model, optimizer)
        checkpoints.save(progress.step, state, metrics, sharded_state={"model": model_shards,
                                                                      "optimizer": optimizer_shards},
                         milestone=milestone)
        cadence.saved()

    def end_of_probe() -> str | None:
        """The checkpoint after the probe's last epoch is kept for good (``_force``; the ISC ships it)."""
        return "end of linear probe" if progress.epoch == cfg.stages.probe_epochs else None

    def run_eval() -> dict[str, float]:
        metrics = evaluate(model, test_images, test_labels, cfg, dist_info, compute_precision)
        logger.log(metrics, progress.step)
        logger.console(f"epoch {progress.epoch} ({stage.value}), step {progress.step}: "
                       + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items()))
        return metrics

    def training_done() -> bool:
        return progress.epoch >= cfg.trainer.epochs or progress.step >= total_steps

    # ---- training loop --------------------------------------------------------------------
    # The step reads plain dataclass copies of its settings: a DictConfig lookup costs about 20 µs.
    trainer_cfg, data_cfg, optim_cfg, model_cfg = (
        OmegaConf.to_object(node) for node in (cfg.trainer, cfg.data, cfg.optim, cfg.model)
    )
    seed = cfg.seed
    model.train()
    if not training_done():
        progress.finished = False  # a finished run restarted with more epochs or steps goes on
    while not training_done():
        if stage_of_epoch(progress.epoch) != stage:
            stage = stage_of_epoch(progress.epoch)
            optimizer, scheduler = start_stage(stage)
            progress.extra["stage"] = stage.value
            logger.console(f"stage {stage.value}: backbone unfrozen, lr {scheduler.base_lrs[0]:g} at step "
                           f"{progress.step}")
        micro_batches = sampler.index_batches(micro_batch, device)
        steps_left_in_epoch = math.ceil(len(micro_batches) / accumulate)
        bar = logger.progress(steps_per_epoch, initial=steps_per_epoch - steps_left_in_epoch,
                              description=f"epoch {progress.epoch + 1}/{trainer_cfg.epochs} ({stage.value})")
        for first in range(0, len(micro_batches), accumulate):
            group = micro_batches[first : first + accumulate]
            group_samples = sum(len(batch) for batch in group)
            generator = seeded_generator(device, seed, progress.step, dist_info.rank)
            for i, batch in enumerate(group):
                x = to_model_input(
                    augment(train_images[batch], data_cfg.random_crop_padding, data_cfg.horizontal_flip, generator),
                    model_cfg.image_size,
                )
                if trainer_cfg.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                y = train_labels[batch]
                if sharded:
                    model.set_requires_gradient_sync(i == len(group) - 1)
                with autocast(device, compute_precision):
                    logits = model(x).float()
                loss = F.cross_entropy(logits, y, label_smoothing=optim_cfg.label_smoothing)
                (loss * (len(batch) / group_samples)).backward()
                train_sums.add(loss=loss.detach() * len(batch), correct=(logits.argmax(1) == y).sum(),
                               count=len(batch))
            if trainer_cfg.grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sampler.advance(group_samples)
            progress.step += 1
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
                save(run_eval() if due else None, milestone=end_of_probe())

    # ---- finish: final evaluation and checkpoint, then summary.json ---------------------------
    if progress.finished:
        eval_metrics = loaded.metrics
    else:
        eval_metrics = run_eval()
        progress.finished = True
        save(eval_metrics, milestone=end_of_probe())
    checkpoints.wait()
    logger.close()
    cadence.close()
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist_info.is_main:
        summary = write_summary(
            cfg.run_dir,
            recipe=cfg.recipe,
            metrics=eval_metrics,
            progress=progress,
            world_size=dist_info.world_size,
            model_digest=train_state.state_digest(full_state),
            stage=stage.value,
        )
        logger.console(
            f"done: eval accuracy {eval_metrics['eval/accuracy']:.4f} after {progress.step} steps\n"
            + where_outputs_are(cfg, summary)
        )


if __name__ == "__main__":
    main()
