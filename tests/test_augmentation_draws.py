"""Randomness that must vary does, and randomness that must repeat does: each recipe's training
augmentation draws differently for every sample of a batch, every step and every epoch, the same
after a resume for the same (seed, epoch, sample), and the sampler's order changes every epoch.

A run that compares only with itself (an interrupted run against an uninterrupted one) cannot see
an augmentation that draws the same for every sample, step or epoch, or a sampler that repeats
its first epoch's order: both runs do it alike. Here each recipe trains two epochs through its
real loop (``tests/recipe_probe.py``) on data whose training images are all the same image, so
the inputs the model receives differ only by the augmentation's draws: two inputs alike mean
the same draw. Draws come from a generator seeded by (seed, step, rank) for the recipes that
augment whole batches in memory (fashion_mnist, cifar100_resnet50, dinov2_fsdp), and from
(seed, epoch, index) for those that load samples in DataLoader workers (``PerSampleSeeded``).
A random crop and flip of one image can draw alike by chance (fashion_mnist's 4-pixel padding
and flip: 1 in 162), so the tests ask for a large majority of differences, where a missing
key in a seed makes every one of them alike.
"""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import trained_runs
from tests.recipe_probe import Configs, Probe, probe, tiny_settings
from tools.tiny_data import write_idx

AUGMENTED = {  # the recipes' own augmentation, on where it is off by default
    "fashion_mnist": ["data.random_crop_padding=4", "data.horizontal_flip=true"],
    "cifar100_resnet50": [],
    "timm_imagenet": [],
    "tv_segmentation": [],
    "fungitastic": [],
    "dinov2_fsdp": [],
}
RECIPES = list(AUGMENTED)
MOSTLY = 0.8  # of pairs that must differ


# ---- one image everywhere -------------------------------------------------------------------------


def one_image_fashion(root: Path) -> Path:
    images = np.tile(np.random.default_rng(0).integers(0, 256, size=(1, 28, 28)), (32, 1, 1))
    write_idx(root / "train-images-idx3-ubyte", images)
    write_idx(root / "train-labels-idx1-ubyte", np.arange(32) % 10)
    write_idx(root / "t10k-images-idx3-ubyte", images[:8])
    write_idx(root / "t10k-labels-idx1-ubyte", np.arange(8))
    return root


def one_image_cifar(factory: pytest.TempPathFactory, root: Path) -> Path:
    shutil.copytree(trained_runs.cifar_data(factory), root, dirs_exist_ok=True)
    train = root / "cifar-100-python" / "train"
    entry = pickle.loads(train.read_bytes())
    entry[b"data"] = np.tile(entry[b"data"][:1], (len(entry[b"data"]), 1))
    train.write_bytes(pickle.dumps(entry, protocol=2))
    return root


def one_file_everywhere(source: Path, root: Path, *patterns: str) -> Path:
    """A copy of ``source`` in which every training file matching a pattern is its first one."""
    shutil.copytree(source, root, dirs_exist_ok=True)
    for pattern in patterns:
        files = sorted(root.glob(pattern))
        for path in files[1:]:
            shutil.copyfile(files[0], path)
    return root


def one_image_data(recipe: str, factory: pytest.TempPathFactory) -> list[str]:
    """Overrides pointing ``recipe`` at its tiny data with one training image everywhere."""

    def make(root: Path) -> Path:
        if recipe == "fashion_mnist":
            return one_image_fashion(root)
        if recipe in ("cifar100_resnet50", "dinov2_fsdp"):
            return one_image_cifar(factory, root)
        if recipe == "timm_imagenet":
            return one_file_everywhere(trained_runs.imagenet_data(factory), root, "train/*/*.JPEG")
        if recipe == "fungitastic":
            return one_file_everywhere(trained_runs.fungi_data(factory), root, "FungiTastic-Mini/train/*/*.JPG")
        return one_file_everywhere(trained_runs.voc_data(factory), root, "JPEGImages/*train*.jpg",
                                   "SegmentationClass/*train*.png")

    data = trained_runs.shared_run(f"one_image_{recipe}", factory, make)
    return [*tiny_settings(recipe, factory), f"data.root={data}", *AUGMENTED[recipe]]


# ---- the runs --------------------------------------------------------------------------------------


_runs: dict[str, dict[str, Probe]] = {}


@pytest.fixture(scope="module", autouse=True)
def _free_the_probes() -> Iterator[None]:
    """Probes hold models, inputs and gradients: let them go when this module's tests are done."""
    yield
    _runs.clear()


def runs(recipe: str, factory: pytest.TempPathFactory) -> dict[str, Probe]:
    """Two epochs uninterrupted; the same run stopped a step into its second epoch (a checkpoint,
    as at a pre-emption), and resumed from it to the end of that epoch."""
    if recipe not in _runs:
        configs = Configs(recipe, factory.mktemp(f"{recipe}-draws"), one_image_data(recipe, factory))
        whole = probe(recipe, configs("trainer.epochs=2"), steps=None)
        assert whole.error is None, whole.error
        per_epoch = whole.run.plan.per_epoch
        stopped = probe(recipe, configs("trainer.epochs=2", f"trainer.max_steps={per_epoch + 1}"), steps=None)
        resumed = probe(recipe, configs("trainer.epochs=2", f"run_dir={stopped.cfg.run_dir}"), steps=None)
        assert resumed.run.progress.resumes == 1, "the second run did not resume"
        _runs[recipe] = {"whole": whole, "resumed": resumed}
    return _runs[recipe]


def by_sample(seen: Probe) -> dict[tuple[int, int], torch.Tensor]:
    """Each (epoch, sample index)'s input as the model received it."""
    inputs = {}
    for epoch, batch, indices in zip(seen.epochs, seen.inputs, seen.samples()):
        for row, index in zip(batch, indices):
            inputs[(epoch, index)] = row
    return inputs


def fraction_differing(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    assert pairs, "nothing to compare"
    return sum(not torch.equal(a, b) for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_samples_of_a_batch_draw_differently(recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    seen = runs(recipe, tmp_path_factory)["whole"]
    pairs = [(batch[i], batch[j]) for batch in seen.inputs for i in range(len(batch)) for j in range(i)]
    assert fraction_differing(pairs) >= MOSTLY, "the samples of a batch are augmented alike"


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_step_draws_differently_from_the_one_before(recipe: str,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    seen = runs(recipe, tmp_path_factory)["whole"]
    by_step: dict[int, list[torch.Tensor]] = {}
    for step, batch in zip(seen.steps, seen.inputs):
        by_step.setdefault(step, []).append(batch)
    steps = [torch.cat(batches) for _, batches in sorted(by_step.items())]  # a step's micro-batches together
    pairs = [(earlier[row], later[row]) for earlier, later in zip(steps, steps[1:])
             for row in range(min(len(earlier), len(later)))]
    assert fraction_differing(pairs) >= MOSTLY, "a step's batch repeats the draws of the step before"


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_sample_draws_differently_in_each_epoch(recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    inputs = by_sample(runs(recipe, tmp_path_factory)["whole"])
    pairs = [(row, inputs[(1, index)]) for (epoch, index), row in inputs.items() if epoch == 0 and (1, index) in inputs]
    assert len(pairs) >= 4, "too few samples seen in both epochs"
    assert fraction_differing(pairs) >= MOSTLY, "a sample is augmented in its second epoch as in its first"


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_sampler_orders_each_epoch_differently(recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    seen = runs(recipe, tmp_path_factory)["whole"]
    order = {epoch: [index for e, indices in zip(seen.epochs, seen.samples()) if e == epoch for index in indices]
             for epoch in (0, 1)}
    assert sorted(order[0]) == sorted(order[1]), "the two epochs see other samples"
    assert order[0] != order[1], "the second epoch repeats the first one's order"


@pytest.mark.parametrize("recipe", RECIPES)
def test_after_a_resume_each_sample_draws_what_it_drew_in_the_uninterrupted_run(
        recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    seen = runs(recipe, tmp_path_factory)
    whole, resumed = by_sample(seen["whole"]), by_sample(seen["resumed"])
    assert len(resumed) >= 2 and all(epoch == 1 for epoch, _ in resumed), "the resumed run did not train epoch 2"
    for key, row in resumed.items():
        assert torch.equal(row, whole[key]), f"(epoch, sample) {key} is augmented otherwise after the resume"


# ---- the pieces: per-sample seeding, timm's repeated augmentation --------------------------------------


class Draws(torch.utils.data.Dataset):
    """A dataset whose every item is what the global generators draw for it."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[float, float, float]:
        import random

        return random.random(), float(np.random.random()), float(torch.rand(()))


def test_per_sample_seeding_draws_by_seed_epoch_and_index_and_nothing_else() -> None:
    from common.data.loaders import PerSampleSeeded

    seeded = PerSampleSeeded(Draws(), seed=3)
    draws = {(epoch, index): seeded[(epoch, index)] for epoch in range(3) for index in range(10)}
    assert len(set(draws.values())) == len(draws), "two (epoch, index) keys drew alike"
    torch.rand(5)  # whatever the process drew in between
    assert all(seeded[key] == value for key, value in draws.items()), "the same key drew otherwise"
    assert PerSampleSeeded(Draws(), seed=4)[(0, 0)] != draws[(0, 0)]


def test_timm_repeated_augmentation_orders_each_epoch_differently() -> None:
    from recipes.timm_imagenet.sampler import RepeatedAugmentationSampler

    sampler = RepeatedAugmentationSampler(40, repeats=3, seed=1, selected_round=0)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        orders.append([index for _, index in sampler])
    assert orders[0] != orders[1]


def test_timm_copies_of_an_image_under_repeated_augmentation_draw_differently(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    configs = Configs("timm_imagenet", tmp_path_factory.mktemp("repeats"), one_image_data("timm_imagenet",
                                                                                        tmp_path_factory))
    seen = probe("timm_imagenet", configs("data.repeated_augmentation=3"), steps=3)
    copies: dict[int, list[torch.Tensor]] = {}
    for batch, indices in zip(seen.inputs, seen.samples()):
        for row, index in zip(batch, indices):
            copies.setdefault(index, []).append(row)
    pairs = [(rows[i], rows[j]) for rows in copies.values() for i in range(len(rows)) for j in range(i)]
    assert len(pairs) >= 8, "too few images seen more than once"
    assert fraction_differing(pairs) >= MOSTLY, "the copies of an image are augmented alike"
