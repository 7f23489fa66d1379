"""fungitastic as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone. ``train.py`` imports the model as trained, the splits and
the evaluation from here (this module imports nothing of it), so training and the tools share them.

``model.safetensors`` is the timm backbone with the species head as its classifier, in timm's
names, so timm loads it as a species classifier (the ``timm`` entry of ``metadata.json``); the
heads of the other levels are in ``level_heads.safetensors`` (``level_heads.<level>.weight``).
``metadata.json`` carries the taxonomic mappings (each level's names by index, each species'
parents) and ``classes``, the species names by label (``null`` where a label has no species).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.after_training.evaluate import metric_prefix, model_outputs, most_batches
from common.after_training.export import timm_classifiers, timm_loading
from common.data.image_batches import Normalize
from common.data.images import ResizedImages
from common.data.loaders import make_loader
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from common.pytorch.activation_checkpointing import checkpoint_blocks, residual_blocks
from common.pytorch.distributed import DistInfo, on_device
from common.pytorch.fsdp import check_fsdp_settings, fully_shard_blocks, process_group_options
from common.recipes import PredictInput, RecipeSpec
from recipes.fungitastic import metadata
from recipes.fungitastic.config import FungiTasticConfig, ModelConfig
from recipes.fungitastic.data import split_files
from recipes.fungitastic.metrics import TaxonomyMetrics, species_marginals
from recipes.fungitastic.model import MultiTaskLoss, build_model, input_normalization, size_kwargs

SPLITS = ("val", "test")  # training evaluates on val each epoch, and on both at the end


def class_counts(cfg: FungiTasticConfig, mappings: dict) -> dict[str, int]:
    """Each configured level's number of classes, from the label spaces `make prep-fungitastic` wrote."""
    unknown = [level for level in cfg.data.levels if level not in mappings["num_classes"]]
    if unknown:
        raise UserError(f"data.levels names {unknown}; taxonomic_mappings.json has {mappings['levels']}")
    return {level: mappings["num_classes"][level] for level in cfg.data.levels}


def model_as_trained(cfg: FungiTasticConfig, dist_info: DistInfo, pretrained: bool = True) -> torch.nn.Module:
    """The model as training holds it, before DDP and compile: one head per level, on the device,
    sharded with FSDP2 (each backbone block a unit) under ``fsdp.enabled``."""
    check_fsdp_settings(cfg.fsdp.enabled, cfg.fsdp.cpu_offload, dist_info.device, cfg.trainer.precision)
    num_classes = class_counts(cfg, metadata.load_mappings(cfg.data.prepared_dir, cfg.data.subset))
    model = build_model(cfg.model, num_classes, list(cfg.data.levels), cfg.data.image_size, pretrained,
                        any_size=cfg.data.progressive.start_size > 0)  # each epoch's size
    checkpoint_blocks(model.backbone, cfg.trainer.activation_checkpointing, cfg.model.name)
    # FSDP2 shards contiguous tensors only: under it the weights keep PyTorch's layout (the inputs are still
    # channels-last with trainer.channels_last, and the convolutions compute in that layout).
    model = on_device(model, dist_info.device, cfg.trainer.channels_last and not cfg.fsdp.enabled)
    if cfg.fsdp.enabled:  # fp32 parameters: trainer.precision's autocast computes as it does under DDP
        fully_shard_blocks(model, residual_blocks(model.backbone), bf16_parameters=False,
                           reshard_after_forward=cfg.fsdp.reshard_after_forward, cpu_offload=cfg.fsdp.cpu_offload)
    return model


def process_group(cfg: FungiTasticConfig) -> dict[str, bool]:
    """The process group FSDP2 needs (``fsdp.enabled``): a group even of one rank."""
    return process_group_options(cfg.fsdp.enabled, cfg.fsdp.cpu_offload)


class SplitEvaluation:
    """The evaluation of one split (the recipe's evaluator): top-1, top-3 and macro-F1
    per level and hierarchy consistency (metrics named ``<split>/...``), each image counted once
    across ranks; whole images resized to the model's input in DataLoader workers, normalised on
    the device as training normalises them. ``files`` says which rows the split holds."""

    def __init__(self, cfg: FungiTasticConfig, dist_info: DistInfo, split: str) -> None:
        self.cfg, self.dist_info, self.split = cfg, dist_info, split
        self.levels = list(cfg.data.levels)
        mappings = metadata.load_mappings(cfg.data.prepared_dir, cfg.data.subset)
        self.num_classes = class_counts(cfg, mappings)
        self.files = split_files(cfg.data, split, mappings, cfg.run_dir, dist_info.local_rank)
        self.parents = ({level: metadata.parent_table(mappings, level) for level in self.levels if level != "species"}
                        if "species" in self.levels else {})
        self.heads = dict(self.num_classes)
        if self.parents and cfg.model.derive_from_species:
            self.heads |= {f"{level}_from_species": self.num_classes[level] for level in self.parents}
        self.criterion = MultiTaskLoss(self.levels, dict(cfg.loss.level_weights), {}, cfg.optim.label_smoothing)
        sampler = ResumableDistributedSampler(len(self.files.images), dist_info.rank, dist_info.world_size,
                                              shuffle=False, drop_last=False)
        images = ResizedImages(self.files.images, cfg.data.image_size, cfg.data.draft_decode)
        # Own generator: creating an iterator must not draw from the global RNG that drop path uses.
        self.loader = make_loader(images, sampler, cfg.trainer.eval_batch_size, cfg.trainer.num_workers,
                                  dist_info.device.type == "cuda", generator=torch.Generator())
        self.normalize = Normalize(*input_normalization(cfg.model, cfg.data.image_size), dist_info.device)
        self.forwards = most_batches(len(self.files.images), dist_info.world_size, cfg.trainer.eval_batch_size)

    def __call__(self, model: torch.nn.Module, of_ema: bool = False) -> dict[str, float]:
        cfg, device, levels = self.cfg, self.dist_info.device, self.levels
        metrics = TaxonomyMetrics(self.heads, self.parents, device)
        batches = ((self.normalize(batch), labels.to(device, non_blocking=True)) for batch, labels in self.loader)
        for outputs, labels in model_outputs(model, batches, device, cfg.trainer.precision, cfg.trainer.channels_last,
                                             self.forwards):
            outputs = {level: logits.float() for level, logits in outputs.items()}
            metrics.add_loss(self.criterion(outputs, labels, training=False), len(labels))
            for column, level in enumerate(levels):
                metrics.add_level(level, outputs[level], labels[:, column])
            if self.parents:
                metrics.add_consistency({level: logits.argmax(1) for level, logits in outputs.items()})
                if cfg.model.derive_from_species:
                    for level, table in self.parents.items():
                        derived = species_marginals(outputs["species"], table, self.num_classes[level])
                        metrics.add_level(f"{level}_from_species", derived, labels[:, levels.index(level)])
        return metrics.compute(metric_prefix(of_ema, self.split))


def export_names(model_cfg: ModelConfig) -> list[tuple[str, str]]:
    classifier = timm_classifiers(model_cfg.name)[0]
    return [("backbone.", ""), ("heads.species.", f"{classifier}."), ("heads.", "level_heads.")]


def export_metadata(cfg: FungiTasticConfig) -> dict[str, Any]:
    mappings = metadata.load_mappings(cfg.data.prepared_dir, cfg.data.subset)
    levels = list(cfg.data.levels)
    num_classes = class_counts(cfg, mappings)
    size = [3, cfg.data.image_size, cfg.data.image_size]
    mean, std = input_normalization(cfg.model, cfg.data.image_size)
    species = [None] * mappings["num_classes"]["species"]
    for name, index in mappings["name_to_index"]["species"].items():
        species[index] = name
    exported = {
        "input": {"size": size, "mean": list(mean), "std": list(std),
                  "draft_decode": cfg.data.draft_decode,
                  "pixels": "whole image resized to size (bilinear), / 255, then (x - mean) / std"},
        "levels": levels, "num_classes": num_classes, "classes": species,
        "taxonomy": {key: mappings[key] for key in ("source", "levels", "num_classes", "name_to_index",
                                                    "species_parents")},
    }
    if "species" in levels:
        exported["timm"] = timm_loading(cfg.model.name, num_classes["species"], size, mean, std,
                                        size_kwargs(cfg.model.name, cfg.data.image_size))
    return exported


def predict_input(metadata: dict[str, Any], device: torch.device) -> PredictInput:
    """Whole image files resized as the evaluation resizes them; each level's head scored, named by the
    taxonomy's labels."""
    entry, levels = metadata["input"], list(metadata["levels"])
    classes = {}
    for level in levels:
        names = [None] * metadata["num_classes"][level]
        for name, index in metadata["taxonomy"]["name_to_index"][level].items():
            names[index] = name
        classes[level] = names
    return PredictInput(decode=ResizedImages([], entry["size"][-1], entry["draft_decode"]).decoded,
                        prepare=Normalize(entry["mean"], entry["std"], device), classes=classes,
                        scores=lambda outputs: {level: outputs[level] for level in levels})


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(model_cfg, metadata["num_classes"], metadata["levels"], metadata["input"]["size"][-1],
                       pretrained=False)


SPEC = RecipeSpec(
    schema=FungiTasticConfig,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=SplitEvaluation,
    export_names=export_names,
    head_names=lambda model_cfg: ["heads."],
    export_metadata=export_metadata,
    model_from_export=model_from_export,
    export_files={"level_heads.": "level_heads.safetensors"},
    predict_input=predict_input,
    process_group=process_group,
)
