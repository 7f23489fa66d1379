"""FungiTastic input pipeline: JPEG decode + augmentation throughput of one DataLoader worker.

A worker is one process with one intra-op thread (what PyTorch gives DataLoader workers), so
images/s here times ``trainer.num_workers`` is what the loader can feed one GPU; divide the GPU's
training throughput (``train/images_per_s`` in the recipe's logs) by it to size ``num_workers``.
The JPEGs are synthetic (smooth gradients plus noise) at the short sides of the dataset's 300p
and 720p folders; real photos compress differently, so treat the figures as indicative. ``draft`` is
``data.draft_decode``: libjpeg decodes at 1/2..1/8 scale while the crop stays >= the output size.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.results import Result
from common.config import Decode
from common.data.images import PathImages, ResizedImages, TrainImages
from common.data.loaders import PerSampleSeeded
from recipes.fungitastic.config import DataConfig
from recipes.fungitastic.data import train_augmentation

BENCHMARK = "FungiTastic decode + augment, one worker"


def write_jpegs(folder: Path, count: int, short_side: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    height, width = short_side, short_side * 4 // 3
    ramp = np.linspace(0, 1, width)[None, :, None] * np.linspace(0, 1, height)[:, None, None]
    paths = []
    for i in range(count):
        colour = rng.integers(40, 220, size=3)
        pixels = (ramp * colour + rng.normal(0, 12, size=(height, width, 3))).clip(0, 255).astype(np.uint8)
        path = folder / f"{short_side}-{i}.JPG"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(str(path))
    return paths


def images_per_second(dataset: torch.utils.data.Dataset, keys: list, repeats: int) -> float:
    dataset[keys[0]]  # warm-up: imports, first allocation
    start = time.perf_counter()
    for _ in range(repeats):
        for key in keys:
            dataset[key]
    return repeats * len(keys) / (time.perf_counter() - start)


def run(quick: bool) -> list[Result]:
    count, repeats = (8, 1) if quick else (64, 3)
    short_sides = (300,) if quick else (300, 720)
    cfg = DataConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for short_side in short_sides:
                paths = write_jpegs(Path(tmp), count, short_side)
                labels = [0] * count
                for draft in (False, True):
                    augmentation = train_augmentation(cfg, cfg.image_size)
                    train = PerSampleSeeded(TrainImages(PathImages(paths, labels), augmentation, Decode.cpu, draft), 0)
                    rate = images_per_second(train, [(0, i) for i in range(count)], repeats)
                    results.append(Result(BENCHMARK, f"train, {short_side}p, draft={draft}", rate, "images/s",
                                          "RandomResizedCrop(224, 0.8-1) + RandAugment(2, 20)"))
                evaluation = ResizedImages(PathImages(paths, labels), cfg.image_size)
                rate = images_per_second(evaluation, list(range(count)), repeats)
                results.append(Result(BENCHMARK, f"eval, {short_side}p, draft=True", rate, "images/s",
                                      "Resize(224, 224)"))
    finally:
        torch.set_num_threads(threads)
    return results


if __name__ == "__main__":
    for result in run(quick=True):
        print(result)
