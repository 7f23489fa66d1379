"""What ``make export`` writes for fungitastic, and the model rebuilt from it (``common/export.py``).

``model.safetensors`` is the timm backbone with the species head as its classifier, in timm's
names, so timm loads it as a species classifier (the ``timm`` entry of ``metadata.json``); the
heads of the other ranks are in ``rank_heads.safetensors`` (``rank_heads.<rank>.weight``).
``metadata.json`` carries the taxonomic mappings (each rank's names by index, each species'
parents) and ``classes``, the species names by label (``null`` where a label has no species).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from common.export import timm_classifiers, timm_loading
from recipes.fungitastic import metadata
from recipes.fungitastic.evaluate import model_as_trained
from recipes.fungitastic.model import build_model, size_kwargs

FILES = {"rank_heads.": "rank_heads.safetensors"}


def key_prefixes(model_cfg: DictConfig) -> list[tuple[str, str]]:
    classifier = timm_classifiers(model_cfg.name)[0]
    return [("backbone.", ""), ("heads.species.", f"{classifier}."), ("heads.", "rank_heads.")]


def head_prefixes(model_cfg: DictConfig) -> list[str]:
    return ["heads."]


def describe(cfg: DictConfig) -> dict[str, Any]:
    mappings = metadata.load_mappings(cfg.data.prepared_dir, cfg.data.subset)
    ranks = list(cfg.data.ranks)
    num_classes = {rank: mappings["num_classes"][rank] for rank in ranks}
    pretrained_cfg = model_as_trained(cfg, mappings).backbone.pretrained_cfg
    size, mean, std = [3, cfg.data.image_size, cfg.data.image_size], pretrained_cfg["mean"], pretrained_cfg["std"]
    species = [None] * mappings["num_classes"]["species"]
    for name, index in mappings["name_to_index"]["species"].items():
        species[index] = name
    described = {
        "input": {"size": size, "mean": list(mean), "std": list(std),
                  "pixels": "whole image resized to size (bilinear), / 255, then (x - mean) / std"},
        "ranks": ranks, "num_classes": num_classes, "classes": species,
        "taxonomy": {key: mappings[key] for key in ("source", "ranks", "num_classes", "name_to_index",
                                                    "species_parents")},
    }
    if "species" in ranks:
        described["timm"] = timm_loading(cfg.model.name, num_classes["species"], size, mean, std,
                                         size_kwargs(cfg.model.name, cfg.data.image_size))
    return described


def rebuild(model_cfg: DictConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    return build_model(OmegaConf.merge(model_cfg, {"pretrained": ""}), metadata["num_classes"], metadata["ranks"],
                       metadata["input"]["size"][-1])
