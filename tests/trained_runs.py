"""Tiny finished runs of every recipe, trained in this process and shared by the tests of what
comes after training (evaluate, export, init_from, early stopping).

A run is trained the way ``python -m recipes.<r>.train`` trains it (the composed config, the
recipe's own ``train`` in ``common.entry.training_process``, which writes ``.hydra/config.yaml``),
minus the subprocess, so the run directory is what the tools read. Each run is made once per test session
(:func:`shared_run`), whichever test module asks first.
"""

from __future__ import annotations

import csv
import importlib
import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from PIL import Image

from common.after_training.evaluate import eval_file_name
from common.after_training.evaluate import main as evaluate_main
from common.after_training.predict import main as predict_main
from common.entry import compose_config, training_process, typed_config
from common.recipes import load_recipe
from tests import recipe_tables
from tools.tiny_data import (
    write_cifar100_tarball,
    write_fashion_mnist,
    write_fungitastic,
    write_image_folder,
    write_voc,
)

TINY = recipe_tables.TINY  # recipe -> its tiny settings, from recipes/<recipe>/testing.py
_made: dict[str, Any] = {}  # name -> what shared_run made, for the whole session


def shared_run(name: str, factory: pytest.TempPathFactory, make: Callable[[Path], Any]) -> Any:
    """``make(<a fresh folder>)`` the first time ``name`` is asked for in this session; its result after."""
    if name not in _made:
        _made[name] = make(factory.mktemp(name))
    return _made[name]


def train_here(recipe: str, run_dir: Path, *overrides: str) -> dict[str, Any]:
    """Train ``recipe`` with its tiny settings and ``overrides`` into ``run_dir``; its summary."""
    cfg = typed_config(compose_config(recipe, [f"run_dir={run_dir}", *TINY[recipe], *overrides]))
    train = importlib.import_module(f"recipes.{recipe}.train")
    group = load_recipe(recipe).process_group(cfg)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        with training_process(cfg, **group) as dist_info:
            train.train(cfg, dist_info)
    finally:
        torch.use_deterministic_algorithms(deterministic)  # training_process set it for this whole process
    return summary(run_dir)


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def evaluate_here(recipe: str, run: Path, *args: str, which: str = "latest", split: str | None = None) -> dict:
    """``python -m common.after_training.evaluate RUN --which W [--split S] [args]`` in this process; the report."""
    split = split or load_recipe(recipe).splits[0]
    evaluate_main(argv=[str(run), "--which", which, "--split", split, *args])
    return json.loads((run / eval_file_name(split, which)).read_text())


def predict_here(run: Path, inputs: Path, out: Path, *args: str) -> list[dict[str, str]]:
    """``python -m common.after_training.predict RUN INPUT --out OUT [args]`` in this process; the CSV's rows."""
    predict_main(argv=[str(run), str(inputs), "--out", str(out), "--workers", "0", "--batch-size", "4", *args])
    with (out / "predictions.csv").open() as file:
        return list(csv.DictReader(file))


def fashion_pngs(data: Path, folder: Path) -> dict[str, str]:
    """Fashion-MNIST's test split as one grey PNG per image; ``{path: class name}``."""
    from recipes.fashion_mnist.data import CLASSES, load_split

    images, labels = load_split(data, "test")
    folder.mkdir(parents=True, exist_ok=True)
    label_of = {}
    for i, (image, label) in enumerate(zip(images.numpy(), labels.tolist())):
        path = folder / f"{i:03d}.png"
        Image.fromarray(image).save(path)
        label_of[str(path)] = CLASSES[label]
    return label_of


# ---- data, one of each per session ---------------------------------------------------------


def tiny_files(recipe: str, factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{key: path}``: the tiny data ``recipe`` declares (``TINY_DATA`` in its ``testing.py``),
    each written by the function of this module it names, once per session."""
    return {key: _maker(recipe, maker)(factory) for key, maker in recipe_tables.tiny_data(recipe).items()}


def tiny_shards(recipe: str, factory: pytest.TempPathFactory) -> Path:
    """``recipe``'s tiny data as shards (``TINY_SHARDS`` in its ``testing.py``), written by its own
    data prep once per session."""
    return _maker(recipe, recipe_tables.tiny_shards(recipe))(factory, recipe)


def _maker(recipe: str, name: str) -> Callable[..., Path]:
    maker = globals().get(name)
    if not callable(maker):
        raise KeyError(f"recipes/{recipe}/testing.py names {name!r}, which tests/trained_runs.py does not define")
    return maker



def fashion_data(factory: pytest.TempPathFactory) -> Path:
    return shared_run("fashion_data", factory, write_fashion_mnist)


def cifar_data(factory: pytest.TempPathFactory) -> Path:
    """CIFAR-100's python version, extracted (what ``make prep-cifar100_resnet50`` leaves)."""

    def make(root: Path) -> Path:
        tarball = write_cifar100_tarball(root / "cifar-100-python.tar.gz", n_train=32, n_test=11)
        with tarfile.open(tarball) as archive:
            archive.extractall(root, filter="data")
        return root

    return shared_run("cifar_data", factory, make)


def imagenet_data(factory: pytest.TempPathFactory) -> Path:
    return shared_run("imagenet_data", factory, lambda root: write_image_folder(root, train_per_class=8,
                                                                                 val_per_class=3))


def imagenet_shards(factory: pytest.TempPathFactory, recipe: str = "timm_imagenet") -> Path:
    """The tiny ImageFolder's splits as shards, written by ``data_prep/<recipe>.py`` (which stamps
    them with its recipe's name), where ``data.format=shards`` reads them (``<data.root>/shards``);
    a copy's (``make new-recipe``) beside them."""
    data = imagenet_data(factory)
    return _shards(recipe, "timm_imagenet", data, factory, lambda prep, shards: prep.shard(data, shards, workers=1))


def voc_data(factory: pytest.TempPathFactory) -> Path:
    return shared_run("voc_data", factory, lambda root: write_voc(root / "VOC2012", n_train=8, n_val=4))


def fungi_data(factory: pytest.TempPathFactory) -> Path:
    """A FungiTastic download prepared by the real prep code (minimal CSVs, 2 rows per species)."""
    from data_prep.fungitastic import prepare

    def make(root: Path) -> Path:
        write_fungitastic(root / "download")
        prepare(root / "data", root / "download", "300p", True, 2, False)
        return root / "data"

    return shared_run("fungi_data", factory, make)


def fungi_shards(factory: pytest.TempPathFactory, recipe: str = "fungitastic") -> Path:
    """The tiny FungiTastic's splits (full and minimal CSVs) as shards, written by
    ``data_prep/<recipe>.py``, where ``data.format=shards`` reads them (a copy's beside them)."""
    data = fungi_data(factory)
    return _shards(recipe, "fungitastic", data, factory,
                   lambda prep, shards: prep.save_lists(data, "mini", "300p", True, False, shards))


def _shards(recipe: str, original: str, data: Path, factory: pytest.TempPathFactory,
            write: Callable[[ModuleType, Path], None]) -> Path:
    """``write(data_prep.<recipe>, folder)`` once per session; the folder: ``<data>/shards`` for
    the recipe the data is ``original``ly for, ``<data>/shards-<recipe>`` for a copy of it."""
    shards = data / ("shards" if recipe == original else f"shards-{recipe}")
    shared_run(f"{recipe}_shards", factory, lambda _: write(importlib.import_module(f"data_prep.{recipe}"), shards))
    return shards


def dinov2_backbone(factory: pytest.TempPathFactory) -> Path:
    """A tiny 'pretrained' DINOv2 in transformers' save_pretrained layout."""
    from transformers import Dinov2Config, Dinov2Model

    def make(path: Path) -> Path:
        torch.manual_seed(123)
        Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                 image_size=42, patch_size=14)).save_pretrained(path)  # the runs train at 28 px
        return path

    return shared_run("dinov2_backbone", factory, make)


# ---- finished runs -----------------------------------------------------------------------------


def fashion_run(factory: pytest.TempPathFactory) -> Path:
    """2 epochs, a checkpoint per epoch, at an LR low enough that it still gets part of the test images
    wrong (about 60% right): tests/test_predict.py compares which."""
    data = fashion_data(factory)
    return shared_run("fashion_run", factory, lambda base: _trained("fashion_mnist", base, f"data.root={data}",
                                                                    "trainer.epochs=2", "optim.lr=1e-3"))


def cifar_run(factory: pytest.TempPathFactory) -> Path:
    """2 epochs with an EMA of the weights."""
    data = cifar_data(factory)
    return shared_run("cifar_run", factory, lambda base: _trained(
        "cifar100_resnet50", base, f"data.root={data}", "trainer.epochs=2", "ema.enabled=true", "ema.decay=0.9"))


def timm_run(factory: pytest.TempPathFactory) -> Path:
    """test_vit at 32 px (the backbone the fungitastic run uses) with an EMA, 1 epoch."""
    data = imagenet_data(factory)
    return shared_run("timm_run", factory, lambda base: _trained(
        "timm_imagenet", base, f"data.root={data}", "model.name=test_vit", "+model.kwargs.img_size=32",
        "trainer.epochs=1", "ema.enabled=true", "ema.decay=0.9"))


def fungi_run(factory: pytest.TempPathFactory) -> Path:
    data = fungi_data(factory)
    return shared_run("fungi_run", factory,
                      lambda base: _trained("fungitastic", base, f"data.root={data}", "trainer.epochs=1"))


def segmentation_run(factory: pytest.TempPathFactory) -> Path:
    data = voc_data(factory)
    return shared_run("segmentation_run", factory,
                      lambda base: _trained("tv_segmentation", base, f"data.root={data}", "trainer.epochs=1"))


def _trained(recipe: str, base: Path, *overrides: str) -> Path:
    train_here(recipe, base / "run", *overrides)
    return base / "run"


def dinov2_run(factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank torchrun (FSDP2, bf16 parameters): a probe epoch, then a fine-tune epoch; its
    checkpoints are DCP shards written by 2 ranks."""
    from tests.conftest import assert_ok, run_recipe

    data, backbone = cifar_data(factory), dinov2_backbone(factory)

    def make(base: Path) -> Path:
        assert_ok(run_recipe("dinov2_fsdp", [f"run_dir={base / 'run'}", f"data.root={data}",
                                             f"model.weights={backbone}", "trainer.epochs=2", *TINY["dinov2_fsdp"]],
                             nproc=2))
        return base / "run"

    return shared_run("dinov2_run", factory, make)
