"""fungitastic as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone.

``model.safetensors`` is the timm backbone with the species head as its classifier, in timm's
names, so timm loads it as a species classifier (the ``timm`` entry of ``metadata.json``); the
heads of the other levels are in ``level_heads.safetensors`` (``level_heads.<level>.weight``).
``metadata.json`` carries the taxonomic mappings (each level's names by index, each species'
parents) and ``classes``, the species names by label (``null`` where a label has no species).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from common.after_training.export import timm_classifiers, timm_loading
from common.recipes import RecipeSpec
from recipes.fungitastic import metadata
from recipes.fungitastic.config import FungiTasticConfig, ModelConfig
from recipes.fungitastic.model import build_model, input_normalization, size_kwargs
from recipes.fungitastic.train import SPLITS, SplitEvaluation, class_counts, model_as_trained, process_group


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
                  "pixels": "whole image resized to size (bilinear), / 255, then (x - mean) / std"},
        "levels": levels, "num_classes": num_classes, "classes": species,
        "taxonomy": {key: mappings[key] for key in ("source", "levels", "num_classes", "name_to_index",
                                                    "species_parents")},
    }
    if "species" in levels:
        exported["timm"] = timm_loading(cfg.model.name, num_classes["species"], size, mean, std,
                                        size_kwargs(cfg.model.name, cfg.data.image_size))
    return exported


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
    process_group=process_group,
)
