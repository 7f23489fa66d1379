"""FungiTastic with a multi-task timm backbone (BEiT-B/16 by default): one head per taxonomic
rank, readable top to bottom.

    python -m recipes.fungitastic.train [hydra overrides]
    torchrun --nproc-per-node 8 -m recipes.fungitastic.train [hydra overrides]
    python -m recipes.fungitastic.train +experiment=fungi_beit_mini   # the published BEiT-B/16 setting

Run contract (see README.md): the run directory is ``runs/fungitastic/<name>``; a run whose
checkpoint directory holds a valid checkpoint resumes from it; SIGTERM/SIGUSR1 finish the step,
checkpoint and exit with code 75; a finished run writes ``summary.json`` with the final
validation and test metrics. The checkpoint with the best validation species macro-F1 is kept
and named in ``checkpoints/best``.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common import train_state
from common.checkpoint import CheckpointManager
from common.data import PerSampleSeeded, make_loader
from common.determinism import configure_determinism
from common.distributed import DistInfo, init_distributed, shutdown_distributed
from common.entry import recipe_main
from common.errors import UserError
from common.images import DeviceTrainInput, Normalize, ResizedImages, TrainImages, collate_train
from common.loggers import RunLogger
from common.metrics import SumMetrics, ratio
from common.optim import accumulation_steps, scaled_lr, warmup_cosine
from common.precision import autocast, grad_scaler
from common.preemption import CheckpointCadence
from common.sampler import ResumableDistributedSampler
from common.summary import where_outputs_are, write_summary
from recipes.fungitastic import metadata
from recipes.fungitastic.config import FungiTasticConfig
from recipes.fungitastic.data import Split, load_split, train_augmentation
from recipes.fungitastic.metrics import TaxonomyMetrics, species_marginals
from recipes.fungitastic.model import build_model, load_pretrained, optimizer_groups


class MultiTaskLoss:
    """Sum over ranks of ``weight[rank] * cross-entropy`` (a rank without a weight weighs 1);
    labels of -1 are ignored."""

    def __init__(self, ranks: list[str], rank_weights: dict[str, float], class_weights: dict[str, torch.Tensor],
                 label_smoothing: float) -> None:
        self.ranks = ranks
        self.rank_weights = {rank: float(rank_weights.get(rank, 1.0)) for rank in ranks}
        self.class_weights = class_weights
        self.label_smoothing = label_smoothing

    def __call__(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor, training: bool = True) -> torch.Tensor:
        """Training: the weighted sum of per-rank means (class weights, smoothing). Evaluation:
        the plain per-sample sum, so that a split's loss is exact however it is batched."""
        total = torch.zeros((), device=labels.device)
        for column, rank in enumerate(self.ranks):
            target = labels[:, column]
            if training:
                loss = F.cross_entropy(outputs[rank].float(), target, weight=self.class_weights.get(rank),
                                       ignore_index=metadata.UNKNOWN, label_smoothing=self.label_smoothing)
                loss = torch.nan_to_num(loss)  # a micro-batch with no label at this rank adds nothing
            else:
                loss = F.cross_entropy(outputs[rank].float(), target, ignore_index=metadata.UNKNOWN, reduction="sum")
            total = total + self.rank_weights[rank] * loss
        return total


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, normalize: Normalize, cfg: DictConfig,
             dist_info: DistInfo, criterion: MultiTaskLoss, num_classes: dict[str, int],
             parents: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
    """Top-1, top-3 and macro-F1 per rank and hierarchy consistency over the whole split, each
    sample counted once across ranks."""
    was_training = model.training
    model.eval()
    ranks = list(cfg.data.ranks)
    heads = dict(num_classes)
    if parents and cfg.model.derive_from_species:
        heads |= {f"{rank}_from_species": num_classes[rank] for rank in parents}
    loader.sampler.set_epoch(0)
    metrics = TaxonomyMetrics(heads, parents, dist_info.device)
    for images, labels in loader:
        x = normalize(images)
        if cfg.trainer.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        labels = labels.to(dist_info.device, non_blocking=True)
        with autocast(dist_info.device, cfg.trainer.precision):
            outputs = model(x)
        outputs = {rank: logits.float() for rank, logits in outputs.items()}
        metrics.add_loss(criterion(outputs, labels, training=False), len(labels))
        for column, rank in enumerate(ranks):
            metrics.add_rank(rank, outputs[rank], labels[:, column])
        if parents:
            metrics.add_consistency({rank: logits.argmax(1) for rank, logits in outputs.items()})
            if cfg.model.derive_from_species:
                for rank, table in parents.items():
                    derived = species_marginals(outputs["species"], table, num_classes[rank])
                    metrics.add_rank(f"{rank}_from_species", derived, labels[:, ranks.index(rank)])
    model.train(was_training)
    return metrics.compute(prefix)


def eval_loader(split: Split, cfg: DictConfig, dist_info: DistInfo, pin_memory: bool) -> DataLoader:
    sampler = ResumableDistributedSampler(len(split.paths), dist_info.rank, dist_info.world_size, shuffle=False,
                                          drop_last=False)
    dataset = ResizedImages(split.paths, torch.from_numpy(split.labels), cfg.data.image_size, cfg.data.draft_decode)
    return make_loader(dataset, sampler, cfg.trainer.batch_size * 2, cfg.trainer.num_workers, pin_memory,
                       generator=torch.Generator())


@recipe_main(FungiTasticConfig)
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
    ranks = list(cfg.data.ranks)
    if not ranks or len(set(ranks)) != len(ranks):
        raise UserError(f"data.ranks must name each rank once, got {ranks}")
    unknown_weights = sorted(set(cfg.loss.rank_weights) - set(ranks) - set(metadata.RANK_COLUMNS))
    if unknown_weights:
        raise UserError(f"loss.rank_weights names {unknown_weights}, which are neither in data.ranks {ranks} nor "
                        f"taxonomic ranks")

    # ---- data: label spaces and every split's CSV and images, checked before anything else -----
    mappings = metadata.load_mappings(cfg.data.prepared_dir, cfg.data.subset)
    unknown_ranks = [rank for rank in ranks if rank not in mappings["num_classes"]]
    if unknown_ranks:
        raise UserError(f"data.ranks names {unknown_ranks}; taxonomic_mappings.json has {mappings['ranks']}")
    splits = {name: load_split(cfg.data, name, mappings) for name in ("train", "val", "test")
              if name != "test" or cfg.data.test_split}
    num_classes = {rank: mappings["num_classes"][rank] for rank in ranks}
    parents = ({rank: metadata.parent_table(mappings, rank) for rank in ranks if rank != "species"}
               if "species" in ranks else {})
    class_weights: dict[str, torch.Tensor] = {}
    if cfg.loss.class_weighted_ranks:
        stored = metadata.load_class_weights(cfg.data.prepared_dir, cfg.data.subset)
        for rank in cfg.loss.class_weighted_ranks:
            if rank not in ranks or rank not in stored or len(stored[rank]) != num_classes.get(rank):
                raise UserError(f"loss.class_weighted_ranks: no class weights of {rank!r} that fit data.ranks "
                                f"{ranks}; rerun `make prep-fungitastic`")
            class_weights[rank] = stored[rank].to(device)
    criterion = MultiTaskLoss(ranks, dict(cfg.loss.rank_weights), class_weights, cfg.loss.label_smoothing)

    # ---- model ---------------------------------------------------------------------------------
    model = build_model(cfg.model, num_classes, ranks, cfg.data.image_size)
    loaded_weights = load_pretrained(model, cfg.model.pretrained) if cfg.model.pretrained else None
    stats = (tuple(model.backbone.pretrained_cfg["mean"]), tuple(model.backbone.pretrained_cfg["std"]))
    model = model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if dist_info.distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = torch.compile(model) if cfg.trainer.compile else model

    # ---- loaders: workers draw each sample's augmentation, seeded per (seed, epoch, index), and
    # decode and crop it (data.decode=cpu) or leave that to the device (gpu); normalised on the device
    pin_memory = device.type == "cuda"
    sampler = ResumableDistributedSampler(len(splits["train"].paths), dist_info.rank, dist_info.world_size,
                                          seed=cfg.seed, shuffle=True, drop_last=True, yield_epoch=True)
    augmentation = train_augmentation(cfg.data)
    train_images = PerSampleSeeded(TrainImages(splits["train"].paths, torch.from_numpy(splits["train"].labels),
                                               augmentation, cfg.data.decode, cfg.data.draft_decode), cfg.seed)
    micro_batch = cfg.trainer.batch_size
    # Own generators: creating an iterator must not draw from the global RNG that drop path uses.
    train_loader = make_loader(train_images, sampler, micro_batch, cfg.trainer.num_workers, pin_memory,
                               collate_fn=collate_train, generator=torch.Generator())
    train_input = DeviceTrainInput(augmentation, cfg.data.decode, *stats, device)
    eval_input = Normalize(*stats, device)
    eval_loaders = {name: eval_loader(split, cfg, dist_info, pin_memory)
                    for name, split in splits.items() if name != "train"}

    # ---- optimization: batch bookkeeping, LR rule, schedule ---------------------------------
    accumulate = accumulation_steps(cfg.trainer.global_batch_size, micro_batch, dist_info.world_size)
    global_batch = micro_batch * dist_info.world_size * accumulate
    lr = scaled_lr(cfg.optim.lr, global_batch, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    raw_model = train_state.unwrap_model(model)
    optimizer = torch.optim.AdamW(optimizer_groups(raw_model, lr, cfg.optim.weight_decay, cfg.optim.layer_decay),
                                  lr=lr, betas=tuple(cfg.optim.betas))
    steps_per_epoch = math.ceil(math.ceil(sampler.samples_per_rank_in_epoch() / micro_batch) / accumulate)
    total_steps = steps_per_epoch * cfg.trainer.epochs
    if cfg.trainer.max_steps:
        total_steps = min(total_steps, cfg.trainer.max_steps)
    scheduler = warmup_cosine(optimizer, round(cfg.optim.warmup_epochs * steps_per_epoch), total_steps,
                              cfg.optim.min_lr_ratio)
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
    else:
        sampler.set_epoch(0)

    logger = RunLogger.from_config(cfg, dist_info.is_main, resume_step=progress.step)
    if loaded is not None:
        logger.console(f"resumed from {loaded.path} (step {progress.step}, epoch {progress.epoch})")
    for split in splits.values():
        logger.console(f"{split.name}: {len(split.paths)} images from {split.csv}")
        if split.unknown_species:
            logger.console(f"{split.name}: excluded {split.unknown_species} row(s) whose species is unknown (-1) "
                           f"from the closed-set metrics")
        if split.skipped_missing:
            logger.console(f"{split.name}: skipped {split.skipped_missing} row(s) whose image is missing "
                           f"(data.skip_missing=true)")
    if loaded_weights:
        logger.console(f"pretrained {loaded_weights} from {cfg.model.pretrained}")
    logger.console(
        f"fungitastic: {cfg.model.name} with heads {', '.join(f'{r} ({num_classes[r]})' for r in ranks)} on "
        f"{dist_info.world_size} rank(s) on {device.type}, global batch {global_batch} ({micro_batch} x "
        f"{dist_info.world_size} ranks x {accumulate} accumulation), lr {lr:g}, {total_steps} steps; images "
        f"decoded on {cfg.data.decode.value} by {train_loader.num_workers} loader workers per rank"
    )

    timer = train_state.SegmentTimer()
    log_timer = train_state.SegmentTimer()  # images/s between two logs (saves and evaluations included)
    cadence = CheckpointCadence.from_config(cfg.checkpoint)

    def save(metrics: dict[str, float] | None = None) -> None:
        progress.train_seconds += timer.lap()
        state = train_state.capture(model, optimizer, scheduler, scaler, sampler, progress, train_sums)
        checkpoints.save(progress.step, state, metrics)
        cadence.saved()

    def run_eval(split: str) -> dict[str, float]:
        metrics = evaluate(forward, eval_loaders[split], eval_input, cfg, dist_info, criterion, num_classes, parents,
                           prefix=split)
        logger.log(metrics, progress.step)
        headline = [f"{split}/{rank}/{m}" for rank in ranks[:1] for m in ("top1", "top3", "f1")]
        headline += [f"{split}/hierarchy_consistency"] if parents else []
        logger.console(f"epoch {progress.epoch}, step {progress.step}: "
                       + ", ".join(f"{name} {metrics[name]:.4f}" for name in headline))
        return metrics

    def training_done() -> bool:
        return progress.epoch >= cfg.trainer.epochs or progress.step >= total_steps

    # ---- training loop --------------------------------------------------------------------
    # The step reads plain dataclass copies of its settings: a DictConfig lookup costs about 20 µs.
    trainer_cfg = OmegaConf.to_object(cfg.trainer)
    model.train()
    if not training_done():
        progress.finished = False  # a finished run restarted with more epochs or steps goes on
    while not training_done():
        batches = iter(train_loader)  # the rest of this epoch, from the sampler's position
        steps_left_in_epoch = math.ceil(len(train_loader) / accumulate)
        bar = logger.progress(steps_per_epoch, initial=steps_per_epoch - steps_left_in_epoch,
                              description=f"epoch {progress.epoch + 1}/{trainer_cfg.epochs}")
        for _ in range(steps_left_in_epoch):
            group = list(itertools.islice(batches, accumulate))
            group_samples = sum(len(labels) for _, labels in group)
            for i, (inputs, labels) in enumerate(group):
                x = train_input(inputs)
                if trainer_cfg.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                labels = labels.to(device, non_blocking=True)
                skip_grad_sync = dist_info.distributed and i < len(group) - 1
                with model.no_sync() if skip_grad_sync else contextlib.nullcontext():
                    with autocast(device, trainer_cfg.precision):
                        outputs = forward(x)
                        loss = criterion(outputs, labels)
                    scaler.scale(loss * (len(labels) / group_samples)).backward()
                hits = {f"correct_{rank}": (outputs[rank].argmax(1) == labels[:, column]).sum()
                        for column, rank in enumerate(ranks)}
                known = {f"count_{rank}": (labels[:, column] != metadata.UNKNOWN).sum()
                         for column, rank in enumerate(ranks)}
                train_sums.add(loss=loss.detach() * len(labels), count=len(labels), **hits, **known)
            if trainer_cfg.grad_clip_norm:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sampler.advance(group_samples)
            progress.step += 1
            bar.update()

            if progress.step % trainer_cfg.log_every_steps == 0:
                sums = train_sums.reduce()
                train_sums.reset()
                metrics = {"train/loss": ratio(sums, "loss", "count"), "train/lr": scheduler.get_last_lr()[0],
                           "train/images_per_s": sums.get("count", 0.0) / max(log_timer.lap(), 1e-9)}
                metrics |= {f"train/{rank}/top1": ratio(sums, f"correct_{rank}", f"count_{rank}") for rank in ranks}
                logger.log(metrics, progress.step)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}",
                                images_per_s=f"{metrics['train/images_per_s']:.0f}")
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
                save(run_eval("val") if due else None)

    # ---- finish: final validation and test evaluation and checkpoint, then summary.json ------
    if progress.finished:
        eval_metrics = loaded.metrics
    else:
        eval_metrics = run_eval("val")
        if "test" in eval_loaders:
            eval_metrics |= run_eval("test")
        progress.finished = True
        save(eval_metrics)
    checkpoints.wait()
    logger.close()
    cadence.close()
    if dist_info.is_main:
        best = checkpoints.best()
        summary = write_summary(
            cfg.run_dir,
            recipe=cfg.recipe,
            metrics=eval_metrics,
            progress=progress,
            world_size=dist_info.world_size,
            model_digest=train_state.model_digest(model),
            best_checkpoint=best.path.name if best is not None else None,
            best_metric=cfg.checkpoint.best_metric,
            excluded_unknown_species={name: split.unknown_species for name, split in splits.items()},
            skipped_missing_images={name: split.skipped_missing for name, split in splits.items()},
        )
        final = "test" if "test" in eval_loaders else "val"
        logger.console(
            f"done: {final} {ranks[0]} top-1 {eval_metrics[f'{final}/{ranks[0]}/top1']:.4f}, macro-F1 "
            f"{eval_metrics[f'{final}/{ranks[0]}/f1']:.4f} after {progress.step} steps\n"
            + where_outputs_are(cfg, summary)
        )


if __name__ == "__main__":
    main()
