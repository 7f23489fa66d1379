"""Exporting a checkpoint's weights (``make export``, ``common/after_training/export.py``): the model rebuilt from
the export folder alone computes what the checkpoint's model computes; timm loads the timm-based
exports with ``pretrained_cfg_overlay=dict(file=...)``, transformers loads the DINOv2 backbone
with ``from_pretrained``; EMA weights are exported where a recipe keeps them, and say so."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import timm
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.after_training.export import export_run, load_export
from common.after_training.trained import open_run
from recipes.fashion_mnist.model import build_model as fashion_model
from recipes.fungitastic.model import build_model as fungi_model
from recipes.timm_imagenet.model import build_model as timm_model
from tests.conftest import REPO, assert_ok, recipe_env
from tests.trained_runs import dinov2_run, fashion_run, fungi_run, summary, timm_run


def checkpoint_state(run: Path, which: str = "latest") -> dict:
    trained = open_run(run, which)
    return torch.load(trained.checkpoint / "state.pt", map_location="cpu", weights_only=True)


def timm_from_export(folder: Path) -> torch.nn.Module:
    """The export loaded the way timm's documentation loads a local file, from metadata.json's entry."""
    entry = json.loads((folder / "metadata.json").read_text())["timm"]
    return timm.create_model(entry["model_name"], pretrained=True, **entry["kwargs"],
                             pretrained_cfg_overlay=dict(file=str(folder / "model.safetensors"),
                                                         **entry["pretrained_cfg_overlay"])).eval()


def header(file: Path) -> dict:
    with safe_open(str(file), "pt") as opened:
        return opened.metadata()


def test_fashion_mnist_export_rebuilds_the_model_with_the_same_logits(tmp_path_factory: pytest.TempPathFactory,
                                                                      tmp_path: Path) -> None:
    run = fashion_run(tmp_path_factory)
    result = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "export", f"RUN={run}",
                             "WHICH=best"], cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert_ok(result)
    folder = run / "export-best"
    assert f"to {folder}: model.safetensors, metadata.json" in result.stdout
    metadata = json.loads((folder / "metadata.json").read_text())
    best = run / "checkpoints" / summary(run)["best_checkpoint"]
    assert metadata["recipe"] == "fashion_mnist" and metadata["weights"] == "model"
    assert metadata["source"]["checkpoint"] == str(best.resolve())
    assert metadata["metrics"] == json.loads((best / "manifest.json").read_text())["metrics"]
    assert metadata["input"]["size"] == [1, 28, 28] and len(metadata["classes"]) == 10
    assert header(folder / "model.safetensors")["weights"] == "model"

    reference = fashion_model(open_run(run).cfg.model)
    reference.load_state_dict(checkpoint_state(run, "best")["model"])
    rebuilt, _ = load_export(folder)
    images = torch.randn(5, 1, 28, 28)
    assert torch.equal(rebuilt(images), reference.eval()(images))

    latest = export_run(open_run(run), tmp_path / "latest")
    latest_metadata = json.loads((latest / "metadata.json").read_text())
    assert latest_metadata["source"]["weights_digest"] == summary(run)["model_digest"]


def test_timm_export_holds_the_ema_and_loads_with_timm(tmp_path_factory: pytest.TempPathFactory,
                                                       tmp_path: Path) -> None:
    run = timm_run(tmp_path_factory)
    folder = export_run(open_run(run), tmp_path / "export")
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["weights"] == "ema" and header(folder / "model.safetensors")["weights"] == "ema"
    assert metadata["source"]["weights_digest"] == summary(run)["ema_digest"]

    ema = timm_model(open_run(run).cfg.model, metadata["num_classes"], pretrained=False)
    ema.load_state_dict(checkpoint_state(run)["extra"]["ema"])
    images = torch.randn(3, *metadata["input"]["size"])
    expected = ema.eval()(images)
    assert torch.equal(timm_from_export(folder)(images), expected)
    assert torch.equal(load_export(folder)[0](images), expected)
    data = timm.data.resolve_data_config(model=timm_from_export(folder))
    assert list(data["mean"]) == metadata["input"]["mean"] and list(data["input_size"]) == metadata["input"]["size"]


def test_fungitastic_export_keeps_every_level_head_and_timm_loads_the_species_classifier(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    run = fungi_run(tmp_path_factory)
    folder = export_run(open_run(run), tmp_path / "export")
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["files"] == ["level_heads.safetensors", "model.safetensors"]
    assert set(metadata["taxonomy"]["name_to_index"]) >= {"species", "genus", "phylum"}
    assert metadata["classes"][metadata["taxonomy"]["name_to_index"]["species"]["Amanita muscaria"]] == \
        "Amanita muscaria"

    cfg = open_run(run).cfg
    reference = fungi_model(cfg.model, metadata["num_classes"], metadata["levels"], cfg.data.image_size)
    reference.load_state_dict(checkpoint_state(run)["model"])
    images = torch.randn(2, *metadata["input"]["size"])
    expected = reference.eval()(images)
    rebuilt = load_export(folder)[0](images)
    assert rebuilt.keys() == expected.keys() and len(expected) == 6
    for rank, logits in expected.items():
        assert torch.equal(rebuilt[rank], logits), rank
    assert torch.equal(timm_from_export(folder)(images), expected["species"])


def test_dinov2_export_consolidates_two_ranks_shards_and_transformers_loads_the_backbone(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from transformers import Dinov2Model

    from recipes.dinov2_fsdp.model import build_model

    run = dinov2_run(tmp_path_factory)
    trained = open_run(run)
    folder = export_run(trained, tmp_path / "export")
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["source"]["weights_digest"] == summary(run)["model_digest"], "every rank's shard is in it"
    assert (folder / "config.json").is_file() and metadata["transformers"]["class"] == "Dinov2Model"

    # The checkpoint's model: its DCP shards gathered by torch's own converter, in a model built as training does.
    dcp_to_torch_save(trained.checkpoint / "sharded", tmp_path / "gathered.pt")
    reference = build_model(trained.cfg.model)
    reference.load_state_dict(torch.load(tmp_path / "gathered.pt", weights_only=True)["model"])
    reference.eval()
    images = torch.randn(2, *metadata["input"]["size"])
    assert torch.equal(load_export(folder)[0](images), reference(images))

    backbone = Dinov2Model.from_pretrained(folder).eval()
    assert torch.equal(backbone(pixel_values=images).last_hidden_state,
                       reference.backbone(pixel_values=images).last_hidden_state)
