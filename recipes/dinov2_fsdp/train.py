"""DINOv2 on CIFAR-100 with FSDP2: a linear probe on the frozen backbone, then full fine-tuning.

    python -m recipes.dinov2_fsdp.train [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.dinov2_fsdp.train [hydra overrides]

Stage 1 (the first ``stages.probe_epochs`` epochs) trains only the head: the backbone has no
gradients and no optimizer state. With ``probe.lrs`` (and ``probe.feature_variants``) it trains
several heads at once, as DINOv2's eval/linear.py does: one frozen forward per batch, each head its
own LR (its optimizer groups), each evaluated; the best by eval/top1 becomes the classifier's head.
Stage 2 trains everything at ``stages.finetune_lr_ratio`` of the (best head's) probe LR with a fresh
optimizer and schedule. The stage, and the probe's table of heads, are saved in every checkpoint.

With several ranks (or ``fsdp.on_one_rank=true``) the model is sharded with FSDP2 (one unit per
transformer block, then the root) and checkpoints hold its shards (``torch.distributed.checkpoint``),
so a run can resume on a different number of ranks. Run contract: see README.md, ``common/run/training_run.py``.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

from common.data import cifar100
from common.data.image_batches import Normalize, random_crop_and_flip
from common.data.sampler import ResumableDistributedSampler
from common.entry import exit_process, recipe_main
from common.pytorch.distributed import DistInfo, gradient_sync
from common.pytorch.metrics import SumMetrics, ratio
from common.pytorch.optim import scaled_lr, warmup_cosine, weight_decay_groups
from common.pytorch.precision import autocast
from common.pytorch.rng import seed_everything, seeded_generator
from common.records import startup
from common.run.steps import EpochTail, StepPlan, compile_static
from common.run.training_run import TrainingRun
from recipes.dinov2_fsdp.config import DinoV2FSDPConfig
from recipes.dinov2_fsdp.data import MEAN, STD, to_model_input
from recipes.dinov2_fsdp.model import refresh_mixed_precision
from recipes.dinov2_fsdp.spec import (
    SPEC,
    SPLITS,
    best_head,
    check_settings,
    compute_precision,
    evaluator,
    is_sharded,
    model_as_trained,
    probe_heads,
)


class Stage(str, Enum):
    probe = "probe"
    finetune = "finetune"


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, no weight decay on norms and biases; PyTorch's default
    implementation (foreach on CUDA), which works on FSDP2's sharded parameters."""
    return torch.optim.AdamW(weight_decay_groups(model, weight_decay), lr=lr)


def sweep_optimizer(heads: torch.nn.ModuleList, lrs: list[float], weight_decay: float) -> torch.optim.AdamW:
    """:func:`make_optimizer` for the probe's heads, each head's groups at its own LR (DINOv2's param
    groups): with the heads' losses summed, each head trains as it would alone."""
    return torch.optim.AdamW([group | {"lr": lr} for head, lr in zip(heads, lrs)
                              for group in weight_decay_groups(head, weight_decay)])


def train(cfg: DinoV2FSDPConfig, dist_info: DistInfo) -> None:
    startup.begin()  # the start-up's phases, timed to the first step (common/records/startup.py)
    device = dist_info.device
    check_settings(cfg, dist_info)
    seed_everything(cfg.seed)

    # ---- data: CIFAR-100 as uint8 tensors on the device, checked before anything else -------
    train_split = cifar100.load_split(cfg.data.root, "train")
    train_images, train_labels = train_split.images.to(device), train_split.labels.to(device)
    evaluate = evaluator(cfg, dist_info, SPLITS[0])
    normalize = Normalize(MEAN, STD, device, input_max=1)
    startup.done(startup.DATA)

    # ---- model: FSDP2 across ranks (bf16 parameters, fp32 reductions); one rank: autocast ----
    model = model_as_trained(cfg, dist_info)
    sharded, precision = is_sharded(cfg, dist_info), compute_precision(cfg, dist_info)
    if cfg.trainer.compile:  # each block's forward; FSDP's hooks around it stay eager
        for block in model.blocks:
            block.forward = compile_static(block.forward)

    # ---- steps of accumulated micro-batches and the two stages' plan -------------------------
    sampler = ResumableDistributedSampler(
        len(train_images), dist_info.rank, dist_info.world_size, seed=cfg.seed, shuffle=True, drop_last=True
    )
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.keep)
    heads = probe_heads(cfg)  # one (the classifier's head), or the sweep's, which the model holds beside it
    sweeping = len(heads) > 1
    probe_lrs = [scaled_lr(head.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
                 for head in heads]
    probe_steps = min(plan.per_epoch * cfg.stages.probe_epochs, plan.total)

    def stage_of_epoch(epoch: int) -> Stage:
        return Stage.probe if epoch < cfg.stages.probe_epochs else Stage.finetune

    def start_stage(stage: Stage) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """Freeze or unfreeze the backbone; a fresh AdamW over the trainable parameters, and its schedule."""
        model.set_backbone_trainable(stage == Stage.finetune)
        if sharded and stage == Stage.finetune:
            refresh_mixed_precision(model)
        if stage == Stage.probe:
            steps, warmup = probe_steps, cfg.stages.probe_warmup_epochs
            optimizer = sweep_optimizer(model.probe_heads.heads, probe_lrs, cfg.optim.weight_decay) if sweeping \
                else make_optimizer(model, probe_lrs[0], cfg.optim.weight_decay)
        else:
            best = progress.extra["probe"]["best"] if sweeping else 0
            lr, steps = probe_lrs[best] * cfg.stages.finetune_lr_ratio, plan.total - probe_steps
            warmup = cfg.stages.finetune_warmup_epochs
            optimizer = make_optimizer(model, lr, cfg.optim.weight_decay)
        scheduler = warmup_cosine(optimizer, round(warmup * plan.per_epoch), steps, cfg.optim.min_lr_ratio)
        return optimizer, scheduler

    train_sums = SumMetrics(device)
    startup.done(startup.MODEL)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run/training_run.py) ---------
    # The model and optimizer are saved through torch.distributed.checkpoint (each rank its FSDP
    # shards), so a run resumes on another number of ranks. The checkpoint at the end of the probe
    # is kept for good (_force: the ISC ships it). Which optimizer exists depends on the stage, so
    # it is made, and its state loaded, once the progress says which stage the run is in.
    run = TrainingRun(cfg, dist_info, plan, model=model, sampler=sampler, train_sums=train_sums,
                      sharded=True, milestones={cfg.stages.probe_epochs: "end of linear probe"})
    progress = run.resume()
    stage = Stage(progress.extra.setdefault("stage", stage_of_epoch(0).value))
    optimizer, scheduler = start_stage(stage)
    run.track_optimizer(optimizer, scheduler, restore=True)
    probe_line = f"probe lrs {', '.join(f'{lr:g}' for lr in probe_lrs)} ({len(heads)} heads)" if sweeping \
        else f"probe lr {probe_lrs[0]:g}"
    run.console(
        f"dinov2_fsdp: {cfg.model.name} at {cfg.model.image_size}px, {dist_info.world_size} rank(s) on "
        f"{device.type}{' with FSDP2' if sharded else ''}, {plan.describe()}, {probe_line}, "
        f"{probe_steps} probe + {plan.total - probe_steps} fine-tune steps"
    )

    def run_eval() -> dict[str, float]:
        """Evaluate; while the probe sweeps, every head, and keep their table in the progress (checkpointed)."""
        metrics = evaluate(model)
        if not model.probing:
            return run.log_eval(metrics)
        table = [{"head": head.name, "lr": head.lr, "features": head.features.value}
                 | {metric: metrics[f"eval/probe/{head.name}/{metric}"] for metric in ("loss", "top1", "top5")}
                 for head in heads]
        progress.extra["probe"] = {"step": progress.step, "heads": table, "best": best_head(metrics, heads)}
        return run.log_eval(metrics, headline=["eval/loss", "eval/top1", "eval/top5"])

    def end_probe() -> None:
        """The sweep's best head (by eval/top1, evaluated at this step) becomes the classifier's head."""
        if progress.extra.get("probe", {}).get("step") != progress.step:
            run_eval()
        best = progress.extra["probe"]["best"]
        model.take_probe_head(best)
        run.console(f"probe: best of {len(heads)} heads {heads[best].name}, eval/top1 "
                    f"{progress.extra['probe']['heads'][best]['top1']:.4f}; the classifier starts from it")

    # ---- training loop --------------------------------------------------------------------
    def forward_backward(batch: torch.Tensor, generator: torch.Generator, share: float, sync: bool) -> None:
        """One micro-batch's part of the step's gradient: ``share`` is its part of the step's samples.
        (A function, so that what it computed is freed if it runs out of memory.)"""
        x = random_crop_and_flip(train_images[batch], cfg.data.random_crop_padding, cfg.data.horizontal_flip,
                                 generator, reflect=True)
        x = to_model_input(x, cfg.model.image_size, normalize)
        if cfg.trainer.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = train_labels[batch]
        with gradient_sync(model, sync):
            with autocast(device, precision):
                logits = model(x).float()  # [batch, classes]; while the probe sweeps, [heads, batch, classes]
            if model.probing:  # each head's loss, summed: each head's gradient is that of its own loss
                loss = torch.stack([F.cross_entropy(head, y, label_smoothing=cfg.optim.label_smoothing)
                                    for head in logits]).sum()
            else:
                loss = F.cross_entropy(logits, y, label_smoothing=cfg.optim.label_smoothing)
            (loss * share).backward()
        count = len(logits) if model.probing else 1  # train/loss and train/top1: the heads' mean
        train_sums.add(loss=loss.detach() * len(batch) / count, top1=(logits.argmax(-1) == y).sum() / count,
                       count=len(batch))

    model.train()
    while not run.training_done():
        if stage_of_epoch(progress.epoch) != stage:
            if model.probing:
                end_probe()
            stage = stage_of_epoch(progress.epoch)
            optimizer, scheduler = start_stage(stage)
            run.track_optimizer(optimizer, scheduler)
            progress.extra["stage"] = stage.value
            run.console(f"stage {stage.value}: backbone unfrozen, lr {scheduler.base_lrs[0]:g} at step "
                        f"{progress.step}")
        for group in run.steps(sampler.index_batches(plan.micro_batch, device)):  # one optimizer step per group
            with group:  # out of memory in here: trainer.out_of_memory=halve hands the step out again, halved
                generator = seeded_generator(device, cfg.seed, progress.step, dist_info.rank)
                for i, batch in enumerate(group):
                    forward_backward(batch, generator, len(batch) / group.samples, i == len(group) - 1)
                grad_norm = run.clip_grad_norm(model.parameters())  # clips to trainer.grad_clip_norm; train/grad_norm
                optimizer.step()
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
    if model.probing:  # a run that only probes ends its probe here
        end_probe()
    probed = {"probe_heads": progress.extra["probe"]["heads"],
              "probe_best": heads[progress.extra["probe"]["best"]].name} if sweeping else {}
    run.finish(run_eval, stage=stage.value, **probed)


if __name__ == "__main__":
    exit_process(recipe_main(SPEC, train))  # overrides from the command line; train() in a training process
