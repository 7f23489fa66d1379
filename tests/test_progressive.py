"""Progressive resizing (``data.progressive``, issue 46 item 2): each epoch's training size from the epoch
alone, FFCV's schedule; workers and the device crop at the size of the batch's epoch; evaluation keeps its
size; a resume mid-way ends with the uninterrupted run's digest; each size compiles once; bad values are
one line."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from common.config import Decode, ProgressiveConfig
from common.data.device_input import DeviceTrainInput
from common.data.images import PathImages, TrainAugmentation, TrainImages, collate_train
from common.data.loaders import PerSampleSeeded, make_train_loader
from common.data.progressive import ImageSizes, ProgressiveImages, check_takes_any_size
from common.errors import UserError
from common.records.loggers import METRICS_FILE, read_metrics_file
from common.run import steps
from tests.recipe_probe import Configs, probe, tiny_settings

CPU = torch.device("cpu")
# 3 epochs at 16, 24 and 32 px (the tiny settings' training size): epoch 1 is mid-way
GROWING = ["data.progressive.start_size=16", "data.progressive.step=8", "data.progressive.end_epoch=2",
           "trainer.epochs=3"]


def ffcv_resolution(epoch: int, min_res: int, max_res: int, end_ramp: int, start_ramp: int) -> int:
    """FFCV's ``get_resolution`` (examples/imagenet-example/train_imagenet.py), as written there."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


def test_each_epochs_size_is_ffcvs_and_depends_on_the_epoch_alone() -> None:
    """FFCV's ResNet-50 ramps (160 to 192 px, and a wider one), asked in any order, by fresh objects."""
    for start, end, start_epoch, end_epoch, epochs in ((160, 192, 65, 76, 88), (128, 256, 2, 13, 16)):
        cfg = ProgressiveConfig(start_size=start, start_epoch=start_epoch, end_epoch=end_epoch)
        expected = [ffcv_resolution(epoch, start, end, end_epoch, start_epoch) for epoch in range(epochs)]
        order = list(range(epochs))
        random.Random(0).shuffle(order)
        asked = {epoch: ImageSizes.from_config(cfg, end, epochs, "data.train_size").of_epoch(epoch) for epoch in order}
        assert [asked[epoch] for epoch in range(epochs)] == expected
        assert ImageSizes.from_config(cfg, end, epochs, "k").distinct() == sorted(set(expected))
    assert len(set(expected)) > 3  # the wide ramp has steps between its ends
    off = ImageSizes.from_config(ProgressiveConfig(), 224, 90, "data.train_size")
    assert {off.of_epoch(epoch) for epoch in range(90)} == {224} and off.logged(0) == {}


@pytest.mark.parametrize(("settings", "end", "names"), [
    ({"start_size": 256}, 224, "data.train_size=224"),  # start above the end
    ({"start_size": 100}, 224, "multiples"),  # not a multiple of the step
    ({"start_size": 160}, 200, "multiples"),  # nor the end
    ({"start_size": 160, "step": 0}, 224, "step"),
    ({"start_size": -32}, 224, "start_size=-32"),
    ({"start_size": 160, "start_epoch": 5, "end_epoch": 3}, 224, "start_epoch <= end_epoch"),
    ({"start_size": 160, "end_epoch": 10}, 224, "trainer.epochs=10"),  # never at the full size
    ({"end_epoch": 5}, 224, "start_size=0 (off)"),  # a ramp with nothing to grow from
])
def test_bad_values_are_one_line_errors(settings: dict, end: int, names: str) -> None:
    with pytest.raises(UserError) as error:
        ImageSizes.from_config(ProgressiveConfig(**settings), end, 10, "data.train_size")
    assert names in str(error.value) and "\n" not in str(error.value)


def a_model_with_a_strict_patch_embedding() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 8, 8))
    model[0].strict_img_size = True  # what timm's PatchEmbed holds for a ViT without dynamic_img_size
    return model


def test_a_model_of_one_input_size_is_a_one_line_error_only_when_sizes_vary() -> None:
    model = a_model_with_a_strict_patch_embedding()
    check_takes_any_size(model, ImageSizes(32, 32), "fix")
    with pytest.raises(UserError, match=r"takes 32px images only, and epochs train at 16, 32px: fix"):
        check_takes_any_size(model, ImageSizes(16, 32, 0, 1, 16), "fix")


def jpegs(folder: Path, count: int) -> PathImages:
    from PIL import Image

    generator = np.random.default_rng(0)
    paths = []
    for i in range(count):
        paths.append(str(folder / f"{i}.jpg"))
        Image.fromarray(generator.integers(0, 256, (48 + 8 * i, 64, 3), dtype=np.uint8)).save(paths[-1])
    return PathImages(paths, list(range(count)))


@pytest.mark.parametrize("decode", [Decode.cpu, Decode.gpu])
def test_each_sample_is_made_at_its_epochs_size_as_the_run_of_that_size_makes_it(decode: Decode,
                                                                                  tmp_path: Path) -> None:
    """Keys of the next epoch (which workers prepare before an epoch ends) come at that epoch's size;
    with decode=gpu the device crops each batch at the size its samples carry."""
    source, sizes = jpegs(tmp_path, 4), ImageSizes(16, 32, 0, 2, 8)
    by_size = {size: TrainImages(source, TrainAugmentation(size=size, colour_jitter=0.4), decode)
               for size in sizes.distinct()}
    dataset = ProgressiveImages(by_size, sizes, seed=3)
    device = DeviceTrainInput(by_size[32].augmentation, decode, (0.5,) * 3, (0.5,) * 3, CPU)
    for epoch, size in ((0, 16), (1, 24), (2, 32), (5, 32)):
        batch = collate_train([dataset[(epoch, index)] for index in range(4)])
        alone = collate_train([PerSampleSeeded(by_size[size], 3)[(epoch, index)] for index in range(4)])
        images = device(batch[0])
        assert images.shape == (4, 3, size, size)
        torch.testing.assert_close(images, device(alone[0]), rtol=0, atol=0)


def test_a_persistent_worker_makes_each_epochs_batches_at_that_epochs_size(tmp_path: Path) -> None:
    """One worker, forked once for the whole run, serves three epochs' batches (as a run's one training
    iterator does, the next epoch's asked for before the current one ends) each at its epoch's size."""
    sizes = ImageSizes(16, 32, 0, 2, 8)
    by_size = {size: TrainImages(jpegs(tmp_path, 2), TrainAugmentation(size=size), Decode.cpu)
               for size in sizes.distinct()}
    batches = [[(epoch, 0), (epoch, 1)] for epoch in range(3)]
    loader = make_train_loader(ProgressiveImages(by_size, sizes, seed=0), batches, 1, False, collate_fn=collate_train)
    assert loader.persistent_workers
    assert [inputs["image"].shape[-1] for inputs, _ in loader] == [16, 24, 32]


def test_under_compile_each_size_compiles_once_and_no_step_recompiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trainer.compile``'s static shapes: 3 sizes x 4 steps (and a smaller batch) make one graph per
    shape; with automatic dynamic shapes the third size would run the second one's dynamic graph."""
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    forward = steps.compile_static(model)
    try:
        for size in (16, 24, 32):
            for _ in range(4):
                forward(torch.randn(2, 3, size, size)).sum().backward()
        assert counter.frame_count == 3
    finally:
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def timm_configs(tmp_path_factory: pytest.TempPathFactory) -> Configs:
    return Configs("timm_imagenet", tmp_path_factory.mktemp("progressive"),
                   [*tiny_settings("timm_imagenet", tmp_path_factory), "checkpoint.every_steps=1",
                    "trainer.log_every_steps=1", *GROWING])


def test_timm_trains_each_epoch_at_its_size_evaluates_at_eval_size_and_a_resume_ends_with_the_same_digest(
        timm_configs: Configs) -> None:
    sizes = {0: 16, 1: 24, 2: 32}
    whole = probe("timm_imagenet", timm_configs("data.eval_size=40"), steps=None)
    assert whole.error is None
    assert [batch.shape[-1] for batch in whole.inputs] == [sizes[epoch] for epoch in whole.epochs]
    assert set(whole.epochs) == {0, 1, 2} and {batch.shape[-1] for batch in whole.eval_inputs} == {40}
    logged = [record for record in read_metrics_file(Path(whole.cfg.run_dir) / "tensorboard" / METRICS_FILE)
              if "train/loss" in record]
    assert logged and all(record["train/image_size"] == sizes[whole.epochs[whole.steps.index(record["step"])]]
                          for record in logged)
    # killed in the middle of epoch 1 (at 24 px), resumed from the step before
    killed = timm_configs("data.eval_size=40")
    stop_at = whole.steps[whole.epochs.index(1)] + 1
    assert whole.epochs[whole.steps.index(stop_at)] == 1
    probe("timm_imagenet", killed, steps=stop_at)
    resumed = probe("timm_imagenet", killed, steps=None)
    assert resumed.run.loaded is not None and resumed.inputs[0].shape[-1] == 24
    assert resumed.summary["model_digest"] == whole.summary["model_digest"]


def test_fungitastic_builds_its_vit_for_any_size_and_trains_each_epoch_at_its_size(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A ViT that timm builds for one size (test_vit3; test_vit takes any already) is built with
    dynamic_img_size; its 16 px patches tile 16 and 32 px, not 24 (a one-line error)."""
    configs = Configs("fungitastic", tmp_path_factory.mktemp("progressive-fungi"),
                      [*tiny_settings("fungitastic", tmp_path_factory), "model.name=test_vit3",
                       "trainer.batch_size=8", *GROWING])
    assert "16px patches do not all tile" in probe("fungitastic", configs()).error
    run = probe("fungitastic", configs("data.progressive.step=16", "data.progressive.end_epoch=1"), steps=None)
    assert run.error is None
    assert [batch.shape[-1] for batch in run.inputs] == [{0: 16, 1: 32, 2: 32}[epoch] for epoch in run.epochs]
    assert set(run.epochs) == {0, 1, 2} and {batch.shape[-1] for batch in run.eval_inputs} == {32}
