"""What the README promises of ``trainer.global_batch_size``: the same global batch trains the same
whether it is one batch, ``k`` accumulated micro-batches, or several ranks' micro-batches, and an
epoch's short last step weighs each of its samples as much as a full step does.

Every loop scales each micro-batch's mean loss by ``len(micro-batch) / group.samples`` (the samples
of the step on this rank) before its backward, so a step's gradient is the mean over its samples of
the per-sample gradients, whatever the micro-batches (``common/run/steps.py``: with ``EpochTail.keep``
the last step of an epoch may hold fewer micro-batches, and its last micro-batch fewer samples),
and DDP / FSDP2 average that over the ranks. These tests run each recipe's real loop
(``tests/recipe_probe.py``) over the same samples cut three ways and compare the gradients each
optimizer step applied:

* ``accumulated``: micro-batches of ``b``, ``trainer.global_batch_size=2b`` (2 per step);
* ``one batch``: micro-batches of ``2b`` (1 per step): the same samples in each step, since the
  sampler's global order depends only on the seed and the epoch;
* ``two ranks``: 2 gloo processes with micro-batches of ``b``: rank ``r`` takes positions
  ``r, r+2, ...`` of the same order, so together each step holds the same samples.

The comparison needs a step's gradient to be a per-sample mean, so every training forward runs in
eval mode (``fixed_statistics``): BatchNorm in training mode normalises each micro-batch by its own
statistics, so ``k`` micro-batches are not one batch by design (the README says so for
tv_segmentation), and dropout and drop path would draw differently. The LR is 0, so the weights are
those of the first step at every step and every step's gradient can be compared, the epoch's
short last one included. Augmentations that draw per batch from a generator seeded by
(seed, step, rank) (fashion_mnist, cifar100_resnet50, dinov2_fsdp) are off: cut differently, a
batch draws differently by design; those drawn per sample from (seed, epoch, index) stay on.
tv_segmentation's loss is each micro-batch's mean over its labelled pixels (as torchvision's
reference, per rank): it is a per-image mean only when every image has as many labelled pixels, so
its data here has no void (255) pixels and its crops no padding.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.pytorch.distributed import DistInfo
from tests.conftest import spawn_ranks
from tests.recipe_probe import Configs, Probe, probe, tiny_settings

FP32 = ["trainer.precision=fp32", "optim.lr=0"]
# recipe: (micro-batch b, overrides for all three ways). The data sizes make the epoch's last step
# short and mixed where the recipe keeps every sample (EpochTail.keep): fashion_mnist 256 = 10 x 24
# + [12, 4]; cifar100_resnet50 and dinov2_fsdp 32 = 2 x 12 + [6, 2]; fungitastic 24 = 14 + [7, 3].
CASES: dict[str, tuple[int, list[str]]] = {
    "fashion_mnist": (12, FP32),
    "cifar100_resnet50": (6, [*FP32, "data.random_crop_padding=0", "data.horizontal_flip=false"]),
    "timm_imagenet": (4, [*FP32, "optim.warmup_lr=0", "optim.min_lr=0"]),  # 24 images, 3 whole steps
    "tv_segmentation": (2, [*FP32, "data.base_size=48", "data.min_scale=1.0", "data.max_scale=1.0"]),
    "fungitastic": (7, FP32),
    "dinov2_fsdp": (6, [*FP32, "data.random_crop_padding=0", "data.horizontal_flip=false"]),
}
RECIPES = list(CASES)
SHORT_LAST_STEP = ["fashion_mnist", "cifar100_resnet50", "fungitastic", "dinov2_fsdp"]  # EpochTail.keep


def overrides(recipe: str, factory: pytest.TempPathFactory) -> list[str]:
    """The recipe's tiny settings and data, with the case's settings; tv_segmentation's data without void."""
    settings = [*tiny_settings(recipe, factory), *CASES[recipe][1]]
    if recipe == "tv_segmentation":
        settings.append(f"data.root={voc_without_void(factory)}")
    return settings


def voc_without_void(factory: pytest.TempPathFactory) -> Path:
    """The tiny VOC with its 255 outlines labelled background: every pixel counts in the loss."""
    import shutil

    from PIL import Image

    from tests.trained_runs import shared_run, voc_data

    def make(root: Path) -> Path:
        copy = root / "VOC2012"
        shutil.copytree(voc_data(factory), copy)
        for path in (copy / "SegmentationClass").glob("*.png"):
            with Image.open(path) as mask:
                palette, labels = mask.getpalette(), np.array(mask)
            labels[labels == 255] = 0
            relabelled = Image.fromarray(labels)
            relabelled.putpalette(palette)
            relabelled.save(path)
        return copy

    return shared_run("voc_without_void", factory, make)


def one_epoch(recipe: str, configs: Configs, batch: int, global_batch: int) -> Probe:
    """The recipe's first epoch with micro-batches of ``batch`` and that global batch, every step recorded."""
    cfg = configs(f"trainer.batch_size={batch}", f"trainer.global_batch_size={global_batch}", "trainer.epochs=1")
    seen = probe(recipe, cfg, steps=None, fixed_statistics=True)
    assert seen.error is None, seen.error
    return seen


_probes: dict[str, dict[str, Probe]] = {}


@pytest.fixture(scope="module", autouse=True)
def _free_the_probes() -> Iterator[None]:
    """Probes hold models, inputs and gradients: let them go when this module's tests are done."""
    yield
    _probes.clear()


def probes(recipe: str, factory: pytest.TempPathFactory) -> dict[str, Probe]:
    """The ``accumulated`` and ``one batch`` epochs of ``recipe``, made once, and for the recipes
    whose last step may be short the ``whole epoch`` as one batch."""
    if recipe not in _probes:
        b = CASES[recipe][0]
        configs = Configs(recipe, factory.mktemp(f"{recipe}-equivalence"), overrides(recipe, factory))
        _probes[recipe] = {"accumulated": one_epoch(recipe, configs, b, 2 * b),
                           "one batch": one_epoch(recipe, configs, 2 * b, 0)}
        if recipe in SHORT_LAST_STEP:
            _probes[recipe]["whole epoch"] = one_epoch(recipe, configs, len(one_epoch_samples(_probes[recipe])), 0)
    return _probes[recipe]


def one_epoch_samples(seen: dict[str, Probe]) -> list[torch.Tensor]:
    """Every training input row of the one-batch epoch: its samples."""
    return [row for batch in seen["one batch"].inputs for row in batch]


def assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """Equal up to float32 summation order: every parameter within 1e-4 of its largest entry."""
    assert got.keys() == expected.keys(), f"{what}: other parameters have gradients"
    for name, value in expected.items():
        tolerance = 1e-4 * float(value.abs().max()) + 1e-8
        difference = float((got[name] - value).abs().max())
        assert difference <= tolerance, f"{what}: the gradient of {name} differs by {difference:.3g} ({tolerance:.3g})"


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_accumulated_micro_batches_give_the_gradient_of_one_batch_twice_as_large(
        recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    seen = probes(recipe, tmp_path_factory)
    accumulated, one_batch = seen["accumulated"], seen["one batch"]
    b = CASES[recipe][0]
    assert [len(x) for x in accumulated.inputs[:2]] == [b, b] and len(one_batch.inputs[0]) == 2 * b
    assert torch.equal(torch.cat(accumulated.inputs[:2]), one_batch.inputs[0]), "the first step holds other samples"
    assert accumulated.losses[0] == pytest.approx(one_batch.losses[0], rel=1e-5)
    assert_same_gradients(accumulated.gradients[0], one_batch.gradients[0], f"{recipe}, the first step")


@pytest.mark.parametrize("recipe", SHORT_LAST_STEP)
def test_a_short_last_step_weighs_each_of_its_samples_as_a_full_step_does(
        recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """An epoch's last step of micro-batches [b, r] (r < b) against the same samples as one short
    batch, and every step of the epoch, each times its samples, against the whole epoch as one
    batch: each sample weighs 1/n in its step of n samples, the micro-batches b/(b+r) and
    r/(b+r), not 1/2 each, and the step's n is the samples it holds, not those of a full step."""
    seen = probes(recipe, tmp_path_factory)
    accumulated, one_batch, whole_epoch = seen["accumulated"], seen["one batch"], seen["whole epoch"]
    b = CASES[recipe][0]
    last_micro_batches = [len(x) for x in accumulated.inputs[-2:]]
    assert last_micro_batches[0] == b and 0 < last_micro_batches[1] < b, f"no short last step: {last_micro_batches}"
    assert len(accumulated.gradients) == len(one_batch.gradients)
    assert_same_gradients(accumulated.gradients[-1], one_batch.gradients[-1], f"{recipe}, the short last step")
    for name, cut in (("accumulated", accumulated), ("one batch", one_batch)):
        assert_same_gradients(samples_times_gradients(cut), samples_times_gradients(whole_epoch),
                              f"{recipe}, the steps of the {name} epoch added up")


def samples_times_gradients(seen: Probe) -> dict[str, torch.Tensor]:
    """The sum over the run's steps of (the step's samples x its gradient), in float64."""
    samples = {}
    for step, batch in zip(seen.steps, seen.inputs):
        samples[step] = samples.get(step, 0) + len(batch)
    total: dict[str, torch.Tensor] = {}
    for step, gradients in enumerate(seen.gradients, start=1):
        for name, gradient in gradients.items():
            total[name] = total.get(name, 0) + samples[step] * gradient.double()
    return total


def _two_ranks(rank: int, cases: dict[str, list[str]], folder: Path) -> None:
    """Each recipe's first step on 2 gloo ranks with micro-batches of ``b`` (global batch 2b)."""
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), launcher="torchrun")
    results = {}
    for recipe, settings in cases.items():
        b = CASES[recipe][0]
        configs = Configs(recipe, folder / f"{recipe}-rank{rank}", settings)
        cfg = configs(f"trainer.batch_size={b}", f"trainer.global_batch_size={2 * b}", "trainer.epochs=1",
                      f"run_dir={folder / recipe}")
        seen = probe(recipe, cfg, steps=1, dist_info=info, fixed_statistics=True)
        assert seen.error is None, seen.error
        results[recipe] = {"gradients": seen.gradients[0], "indices": seen.indices[:1], "loss": seen.losses[0]}
    torch.save(results, folder / f"rank{rank}.pt")


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every recipe's first step on 2 ranks, both ranks' records (one pair of processes for all)."""
    folder = tmp_path_factory.mktemp("two-ranks")
    spawn_ranks(_two_ranks, {recipe: overrides(recipe, tmp_path_factory) for recipe in RECIPES}, folder)
    return [torch.load(folder / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_give_the_gradient_of_one_rank_with_the_same_global_batch(
        recipe: str, two_ranks: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> None:
    one_rank = probes(recipe, tmp_path_factory)["one batch"]
    if one_rank.indices:  # in-memory recipes: the ranks' samples, interleaved, are the one rank's batch
        together = sorted(two_ranks[0][recipe]["indices"][0] + two_ranks[1][recipe]["indices"][0])
        assert together == sorted(one_rank.indices[0]), "the two ranks' first step holds other samples"
    loss = two_ranks[0][recipe]["loss"] + two_ranks[1][recipe]["loss"]
    assert loss == pytest.approx(one_rank.losses[0], rel=1e-5), "the ranks' losses do not add up to one rank's"
    for rank in range(2):
        assert_same_gradients(two_ranks[rank][recipe]["gradients"], one_rank.gradients[0],
                              f"{recipe}, rank {rank} of 2")

