"""FungiTastic with a multi-task timm backbone (BEiT-B/16 by default): one head per taxonomic
level, readable top to bottom.

    python -m recipes.fungitastic.train [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.fungitastic.train [hydra overrides]
    python -m recipes.fungitastic.train +experiment=fungi_beit_mini   # the published BEiT-B/16 setting

Run contract (see README.md, ``common/run/training_run.py``): the run directory is ``runs/fungitastic/<name>``;
a run whose checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish
the step, checkpoint and exit with code 75; a finished run writes ``summary.json`` with the final
validation and test metrics. The checkpoint with the best validation species macro-F1 is kept
(a ``_force`` checkpoint, named in ``summary.json``'s ``best_checkpoint``).
"""

from __future__ import annotations

import torch

from common.after_training.distill import distilled, load_teacher
from common.data.decode_choice import choose_train_decode
from common.data.device_input import DeviceTrainInput
from common.data.images import TrainImages, collate_train
from common.data.loaders import make_train_loader
from common.data.progressive import ImageSizes, ProgressiveImages, check_takes_any_size
from common.data.sampler import ResumableDistributedSampler
from common.entry import exit_process, recipe_main
from common.errors import UserError
from common.pytorch.activation_checkpointing import residual_blocks
from common.pytorch.distributed import DistInfo, data_parallel, gradient_sync
from common.pytorch.metrics import SumMetrics, ratio
from common.pytorch.optim import scaled_lr, warmup_cosine
from common.pytorch.precision import autocast, grad_scaler
from common.pytorch.rng import seed_everything
from common.records import startup
from common.run.steps import EpochTail, StepPlan, compile_static
from common.run.training_run import TrainingRun
from recipes.fungitastic import metadata
from recipes.fungitastic.config import FungiTasticConfig
from recipes.fungitastic.data import split_files, train_augmentation
from recipes.fungitastic.model import MultiTaskLoss, input_normalization, layer_decay_groups
from recipes.fungitastic.spec import SPEC, SPLITS, SplitEvaluation, class_counts, model_as_trained


def train(cfg: FungiTasticConfig, dist_info: DistInfo) -> None:
    startup.begin()  # the start-up's phases, timed to the first step (common/records/startup.py)
    device = dist_info.device
    seed_everything(cfg.seed)
    levels = list(cfg.data.levels)
    if not levels or len(set(levels)) != len(levels):
        raise UserError(f"data.levels must name each level once, got {levels}")
    unknown_weights = sorted(set(cfg.loss.level_weights) - set(levels) - set(metadata.LEVEL_COLUMNS))
    if unknown_weights:
        raise UserError(f"loss.level_weights names {unknown_weights}, which are neither in data.levels {levels} nor "
                        f"taxonomic levels")

    # ---- data: label spaces and every split's CSV and images, checked before anything else -----
    mappings = metadata.load_mappings(cfg.data.prepared_dir, cfg.data.subset)
    num_classes = class_counts(cfg, mappings)
    train_files = split_files(cfg.data, "train", mappings, cfg.run_dir, dist_info.local_rank)
    evaluators = {split: SplitEvaluation(cfg, dist_info, split) for split in SPLITS
                  if split != "test" or cfg.data.test_split}
    class_weights: dict[str, torch.Tensor] = {}
    if cfg.loss.class_weighted_levels:
        stored = metadata.load_class_weights(cfg.data.prepared_dir, cfg.data.subset)
        for level in cfg.loss.class_weighted_levels:
            if level not in levels or level not in stored or len(stored[level]) != num_classes.get(level):
                raise UserError(f"loss.class_weighted_levels: no class weights of {level!r} that fit data.levels "
                                f"{levels}; rerun `make prep-fungitastic`")
            class_weights[level] = stored[level].to(device)
    criterion = MultiTaskLoss(levels, dict(cfg.loss.level_weights), class_weights, cfg.optim.label_smoothing)
    startup.done(startup.DATA)

    # ---- model: a ViT built to take each epoch's size under data.progressive -----------------
    sizes = ImageSizes.from_config(cfg.data.progressive, cfg.data.image_size, cfg.trainer.epochs, "data.image_size")
    model = model_as_trained(cfg, dist_info)
    check_takes_any_size(model, sizes, f"model.name={cfg.model.name} has no dynamic_img_size: choose a model that "
                                       f"has (a timm ViT) or takes any size (a convolutional network)")
    ddp_model = model if cfg.fsdp.enabled else data_parallel(model, dist_info, cfg.trainer.out_of_memory.value)
    forward = compile_static(ddp_model) if cfg.trainer.compile and not cfg.fsdp.enabled else ddp_model
    if cfg.trainer.compile and cfg.fsdp.enabled:  # each block's forward; FSDP's hooks around it stay eager
        for block in residual_blocks(model.backbone):
            block.forward = compile_static(block.forward)

    # ---- sampler and steps ------------------------------------------------------------------------
    sampler = ResumableDistributedSampler(len(train_files.images), dist_info.rank, dist_info.world_size,
                                          seed=cfg.seed, shuffle=True, drop_last=True, yield_epoch=True)
    plan = StepPlan.from_config(cfg.trainer, sampler, dist_info.world_size, tail=EpochTail.keep)

    # ---- optimization: LR rule, layer-wise groups, schedule ---------------------------------
    lr = scaled_lr(cfg.optim.lr, plan.global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    optimizer = torch.optim.AdamW(layer_decay_groups(model, lr, cfg.optim.weight_decay, cfg.optim.layer_decay),
                                  lr=lr, betas=tuple(cfg.optim.betas))
    scheduler = warmup_cosine(optimizer, round(cfg.optim.warmup_epochs * plan.per_epoch), plan.total,
                              cfg.optim.min_lr_ratio)
    scaler = grad_scaler(device, cfg.trainer.precision)
    teacher = load_teacher(cfg, device)  # distill.teacher: frozen, in eval mode; None without one
    train_sums = SumMetrics(device)
    startup.done(startup.MODEL)

    # ---- the run contract: resume, checkpoints, pre-emption, summary (common/run/training_run.py) ---------
    # Under fsdp.enabled the model and optimizer state are saved as each rank's shards
    # (torch.distributed.checkpoint), so a run resumes on another number of ranks.
    run = TrainingRun(cfg, dist_info, plan, model=model, optimizer=optimizer, scheduler=scheduler,
                      scaler=scaler, sampler=sampler, train_sums=train_sums, sharded=cfg.fsdp.enabled,
                      teacher=teacher)
    progress = run.resume()

    # ---- loaders: workers draw each sample's augmentation, seeded per (seed, epoch, index), and decode and
    # crop it (data.decode=cpu) or leave that to the device (gpu); normalised on the device. data.decode=auto
    # measures both sides at the micro-batch in use, or keeps the choice the resumed checkpoint holds
    augmentations = {size: train_augmentation(cfg.data, size) for size in sizes.distinct()}
    augmentation = augmentations[sizes.end]
    decode = choose_train_decode(cfg.data.decode, cfg.trainer, augmentation, train_files.images,
                                 cfg.data.draft_decode, model, cfg.data.image_size, device, micro_batch=run.micro_batch,
                                 resumed=progress.decode)
    startup.done(startup.DECODE_CHOICE)
    progress.decode = decode.decode.value
    train_images = ProgressiveImages({size: TrainImages(train_files.images, augmentations[size], decode.decode,
                                                        cfg.data.draft_decode) for size in augmentations},
                                     sizes, cfg.seed)
    # Own generator: creating an iterator must not draw from the global RNG that drop path uses.
    train_loader = make_train_loader(train_images, plan.epoch_batches(), cfg.trainer.num_workers, device.type == "cuda",
                                     collate_fn=collate_train, generator=torch.Generator())
    train_input = DeviceTrainInput(augmentation, decode.decode, *input_normalization(cfg.model, cfg.data.image_size),
                                   device, channels_last=cfg.trainer.channels_last)
    splits = [train_files, *(evaluate.files for evaluate in evaluators.values())]
    for files in splits:
        run.console(f"{files.name}: {files.origin}")
        if files.unknown_species:
            run.console(f"{files.name}: excluded {files.unknown_species} row(s) whose species is unknown (-1) "
                        f"from the closed-set metrics")
        if files.skipped_missing:
            run.console(f"{files.name}: skipped {files.skipped_missing} row(s) whose image is missing "
                        f"(data.skip_missing=true)")
    if model.pretrained_parts:
        run.console(f"pretrained {model.pretrained_parts} from {cfg.model.pretrained}")
    run.console(
        f"fungitastic: {cfg.model.name} with heads {', '.join(f'{r} ({num_classes[r]})' for r in levels)} on "
        f"{dist_info.world_size} rank(s) on {device.type}{' with FSDP2' if cfg.fsdp.enabled else ''}, "
        f"{plan.describe()}, lr {lr:g}, {plan.total} steps; {cfg.data.image_size}px images{sizes.describe()} "
        f"decoded on {decode.decode.value} by "
        f"{train_loader.num_workers} loader workers per rank ({decode.reason})"
    )

    def run_eval(split: str) -> dict[str, float]:
        metrics = evaluators[split](forward)
        headline = [f"{split}/{level}/{m}" for level in levels[:1] for m in ("top1", "top3", "f1")]
        return run.log_eval(metrics, headline=headline + ([f"{split}/hierarchy_consistency"] if len(levels) > 1
                                                          and "species" in levels else []))

    def final_eval() -> dict[str, float]:
        """Validation and, when the test split has labels, test metrics."""
        return run_eval("val") | (run_eval("test") if "test" in evaluators else {})

    # ---- training loop --------------------------------------------------------------------
    def forward_backward(inputs: dict, labels: torch.Tensor, share: float, sync: bool) -> None:
        """One micro-batch's part of the step's gradient: ``share`` is its part of the step's samples.
        (A function, so that what it computed is freed if it runs out of memory.)"""
        x = train_input(inputs)
        labels = labels.to(device, non_blocking=True)
        with gradient_sync(ddp_model, sync):
            with autocast(device, cfg.trainer.precision):
                outputs = forward(x)
                loss = criterion(outputs, labels)
                if teacher is not None:  # the same batch; each level head it shares, weighed as the loss weighs it
                    with torch.no_grad(), run.uncounted():
                        teacher_outputs = teacher.model(x)
                    loss = distilled(loss, outputs, teacher_outputs, cfg.distill, criterion.level_weights)
            scaler.scale(loss * share).backward()
        hits = {f"top1_{level}": (outputs[level].argmax(1) == labels[:, column]).sum()
                for column, level in enumerate(levels)}
        known = {f"count_{level}": (labels[:, column] != metadata.UNKNOWN).sum() for column, level in enumerate(levels)}
        train_sums.add(loss=loss.detach() * len(labels), count=len(labels), **hits, **known)

    model.train()
    while not run.training_done():
        for group in run.steps(train_loader, train_input.to_device):  # one optimizer step per group of micro-batches
            with group:  # out of memory in here: trainer.out_of_memory=halve hands the step out again, halved
                for i, (inputs, labels) in enumerate(group):
                    forward_backward(inputs, labels, len(labels) / group.samples, i == len(group) - 1)
                grad_norm = run.clip_grad_norm(model.parameters())  # clips to trainer.grad_clip_norm; train/grad_norm
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                run.step_done(group.samples, grad_norm, loss=train_sums.running("loss"))

                if progress.step % cfg.trainer.log_every_steps == 0:
                    sums = train_sums.reduce()
                    train_sums.reset()
                    metrics = {"train/loss": ratio(sums, "loss", "count"), "train/lr": scheduler.get_last_lr()[0]}
                    metrics |= sizes.logged(progress.epoch)
                    metrics |= {f"train/{level}/top1": ratio(sums, f"top1_{level}", f"count_{level}")
                                for level in levels}
                    run.log_train(metrics)
        run.end_epoch(lambda: run_eval("val"))  # evaluate when due (eval_every_epochs/_steps), checkpoint

    # ---- finish: final validation and test evaluation and checkpoint, then summary.json ------
    run.finish(final_eval, excluded_unknown_species={files.name: files.unknown_species for files in splits},
               skipped_missing_images={files.name: files.skipped_missing for files in splits})


if __name__ == "__main__":
    exit_process(recipe_main(SPEC, train))  # overrides from the command line; train() in a training process
