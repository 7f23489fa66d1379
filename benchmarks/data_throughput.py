"""Data throughput: each recipe's training input pipeline per worker, against its model's step.

For every recipe whose ``recipes/<r>/data.py`` exists, the benchmark builds the recipe's own
training pipeline (its dataset class and augmentation, from its default config) over generated
files in the dataset's real format and at realistic sizes (ImageNet-like 500x375 JPEGs, VOC
JPEG + palette PNG pairs, FungiTastic 300p JPEGs, CIFAR-100 pickles, Fashion-MNIST IDX), and
times it on one CPU core (``torch.set_num_threads(1)``, as in a DataLoader worker; per second of
CPU time, which other jobs on a shared machine change little), collation included. Pipelines
that run on the training device a whole batch at a time (fashion_mnist, cifar100_resnet50,
dinov2_fsdp) are timed the same way; on a GPU they run as GPU kernels. The JPEG recipes' worker
side is their default ``data.decode=cpu`` path (``benchmarks/jpeg_input.py`` compares it with
the pipelines before and with ``data.decode=gpu``, through the DataLoader).

The model's training step (forward, backward, SGD step, all threads) is timed on the same CPU.
No GPU here means the GPU side comes from published training throughputs, named in each row:
they say how many samples per second a GPU would ask for, hence how many workers (one per CPU
core: ``trainer.num_workers`` defaults to the cores each rank gets) like these it needs.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate

from benchmarks.results import Result
from common.data.image_batches import Normalize, random_crop_and_flip
from common.data.loaders import PerSampleSeeded
from common.entry import compose_config, typed_config
from common.pytorch.rng import seeded_generator
from recipes.tv_segmentation.coco import voc_palette
from tools.tiny_data import photo, write_cifar100_tarball, write_fashion_mnist

BENCHMARK = "data throughput"
REPO = Path(__file__).resolve().parents[1]
RECIPES = ("fashion_mnist", "cifar100_resnet50", "dinov2_fsdp", "timm_imagenet", "tv_segmentation", "fungitastic")


@dataclass
class GpuReference:
    samples_per_s: float
    source: str
    published: bool = True


# What one GPU consumes when it trains the recipe's default model (published figures).
GPU_REFERENCES = {
    "timm_imagenet": GpuReference(
        2470, "ResNet-50 v1.5, 1x A100 80GB, mixed precision (NVIDIA DeepLearningExamples, "
              "PyTorch/Classification/ConvNets/resnet50v1.5 README)"),
    "fungitastic": GpuReference(
        358, "beit_base_patch16_224, RTX 3090, AMP (timm results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv)"),
    "tv_segmentation": GpuReference(
        470, "estimate, no published figure: timm's mobilenetv3_large_100 trains at 2,167 img/s at 224 px on an "
             "RTX 3090 (same timm CSV), divided by the pixel ratio of 480 px crops (4.6x); the DeepLabV3 head "
             "makes the real model slower", published=False),
}


@dataclass
class Pipeline:
    """One recipe's training input: a callable that yields one batch, plus its model's step."""

    batch_size: int
    next_batch: Callable[[int], Any]  # batch number -> batch (the work a worker or the device does)
    model: torch.nn.Module
    model_input: torch.Tensor
    in_workers: bool  # False: the pipeline runs on the training device


def worker_batches(dataset, batch_size: int, seed: int, collate=default_collate) -> Callable[[int], Any]:
    """Batch ``n`` as a DataLoader worker builds it: per-sample seeded items, then collation."""
    seeded = PerSampleSeeded(dataset, seed)
    return lambda n: collate([seeded[(0, (n * batch_size + i) % len(dataset))] for i in range(batch_size)])


def fashion_mnist(workdir: Path) -> Pipeline:
    from recipes.fashion_mnist.data import BLACK, load_split, normalize
    from recipes.fashion_mnist.model import build_model

    data = write_fashion_mnist(workdir / "fm", n_train=4096, n_test=16)
    cfg = typed_config(compose_config("fashion_mnist", [f"data.root={data}"]))
    images, _ = load_split(cfg.data.root, "train")
    size = cfg.trainer.batch_size

    def batch(n: int) -> torch.Tensor:
        indices = torch.randint(0, len(images), (size,), generator=seeded_generator(images.device, 0, n))
        return random_crop_and_flip(normalize(images[indices]), cfg.data.random_crop_padding,
                                    cfg.data.horizontal_flip, seeded_generator(images.device, 1, n), fill=BLACK)

    return Pipeline(size, batch, build_model(cfg.model), torch.randn(size, 1, 28, 28), False)


def cifar100_resnet50(workdir: Path) -> Pipeline:
    import tarfile

    from common.data.cifar100 import load_split
    from recipes.cifar100_resnet50.data import MEAN, STD, BatchAugmentation
    from recipes.cifar100_resnet50.model import build_model

    root = workdir / "cifar100"
    with tarfile.open(write_cifar100_tarball(workdir / "cifar100.tar.gz", n_train=1024, n_test=16)) as tar:
        tar.extractall(root, filter="data")
    cfg = typed_config(compose_config("cifar100_resnet50", [f"data.root={root}"]))
    train = load_split(root, "train")
    images, labels = train.images, train.labels
    augmentation = BatchAugmentation(cfg.data, cfg.mixup, cfg.optim.label_smoothing,
                                     Normalize(MEAN, STD, images.device, input_max=1))
    size = cfg.trainer.batch_size

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.arange(n * size, (n + 1) * size) % len(images)
        return augmentation(images[indices], labels[indices], seeded_generator(images.device, 0, n), 0, n, 0, 0)

    return Pipeline(size, batch, build_model(cfg.model), torch.randn(4, 3, 32, 32), False)


def dinov2_fsdp(workdir: Path) -> Pipeline:
    from recipes.dinov2_fsdp.data import MEAN, STD, to_model_input
    from recipes.dinov2_fsdp.model import build_model

    cfg = typed_config(compose_config("dinov2_fsdp", ["model.pretrained=false"]))
    images = torch.randint(0, 256, (1024, 3, 32, 32), dtype=torch.uint8)  # CIFAR-100 as the recipe holds it
    normalize = Normalize(MEAN, STD, images.device, input_max=1)
    size = cfg.trainer.batch_size

    def batch(n: int) -> torch.Tensor:
        indices = torch.arange(n * size, (n + 1) * size) % len(images)
        uint8 = random_crop_and_flip(images[indices], cfg.data.random_crop_padding, cfg.data.horizontal_flip,
                                     seeded_generator(images.device, 0, n), reflect=True)
        return to_model_input(uint8, cfg.model.image_size, normalize)

    size_px = cfg.model.image_size
    return Pipeline(size, batch, build_model(cfg.model), torch.randn(2, 3, size_px, size_px), False)


def timm_imagenet(workdir: Path) -> Pipeline:
    import timm

    from common.data.images import PathImages, TrainImages, collate_train
    from recipes.timm_imagenet.data import resolve, train_augmentation

    rng = np.random.default_rng(0)
    paths = []
    for i in range(32):
        path = workdir / "imagenet" / f"img_{i}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        photo(500, 375, rng).save(path, quality=90)
        paths.append(str(path))
    cfg = typed_config(compose_config("timm_imagenet", [f"data.root={workdir / 'imagenet'}"]))
    model = timm.create_model(cfg.model.name, pretrained=False)
    data_config = resolve(model, cfg.data.train_size, cfg.data.eval_crop_pct, cfg.data.interpolation)
    dataset = TrainImages(PathImages(paths, [0] * len(paths)), train_augmentation(cfg.data, data_config),
                          cfg.data.decode)
    size = data_config["input_size"][-1]
    return Pipeline(32, worker_batches(dataset, 32, cfg.seed, collate_train), model, torch.randn(2, 3, size, size),
                    True)


def tv_segmentation(workdir: Path) -> Pipeline:
    import torchvision

    from recipes.tv_segmentation.data import SegmentationDataset, pad_collate, train_transform

    rng = np.random.default_rng(0)
    pairs = []
    for i in range(16):
        image, mask = workdir / "voc" / f"{i}.jpg", workdir / "voc" / f"{i}.png"
        image.parent.mkdir(parents=True, exist_ok=True)
        photo(500, 375, rng).save(image, quality=90)
        labels = np.zeros((375, 500), dtype=np.uint8)
        labels[80:300, 100:400] = 1 + i % 20
        png = Image.fromarray(labels, mode="P")
        png.putpalette(voc_palette())
        png.save(mask)
        pairs.append((image, mask))
    cfg = typed_config(compose_config("tv_segmentation", [f"data.root={workdir / 'voc'}"]))
    dataset = SegmentationDataset(pairs, train_transform(cfg.data), cfg.model.num_classes, augment=True)
    model = torchvision.models.get_model(cfg.model.name, weights=None, weights_backbone=None,
                                         num_classes=cfg.model.num_classes, aux_loss=cfg.model.aux_loss)
    crop = cfg.data.crop_size
    return Pipeline(cfg.trainer.batch_size, worker_batches(dataset, cfg.trainer.batch_size, cfg.seed, pad_collate),
                    model, torch.randn(2, 3, crop, crop), True)


def fungitastic(workdir: Path) -> Pipeline:
    import timm

    from common.data.images import PathImages, TrainImages, collate_train
    from recipes.fungitastic.data import train_augmentation

    rng = np.random.default_rng(0)
    paths = []
    for i in range(32):  # the 300p images: 300 px on the shorter side
        path = workdir / "fungi" / f"{i}.JPG"
        path.parent.mkdir(parents=True, exist_ok=True)
        photo(400, 300, rng).save(path, quality=90)
        paths.append(str(path))
    cfg = typed_config(compose_config("fungitastic", [f"data.root={workdir / 'fungi'}"]))
    labels = torch.zeros(len(paths), len(cfg.data.levels), dtype=torch.int64)
    dataset = TrainImages(PathImages(paths, labels), train_augmentation(cfg.data, cfg.data.image_size), cfg.data.decode,
                          cfg.data.draft_decode)
    model = timm.create_model(cfg.model.name, pretrained=False)
    size = cfg.data.image_size
    return Pipeline(cfg.trainer.batch_size, worker_batches(dataset, cfg.trainer.batch_size, cfg.seed, collate_train),
                    model, torch.randn(2, 3, size, size), True)


def samples_per_second(pipeline: Pipeline, seconds: float) -> float:
    """Batches until ``seconds`` of this process's CPU time have passed (at least two, the first
    one untimed), on one thread: samples per second of one core, whatever else the machine runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipeline.next_batch(0)
        start, batches = time.process_time(), 0
        while batches < 1 or time.process_time() - start < seconds:
            batches += 1
            pipeline.next_batch(batches)
        return batches * pipeline.batch_size / (time.process_time() - start)
    finally:
        torch.set_num_threads(threads)


def model_samples_per_second(model: torch.nn.Module, x: torch.Tensor, steps: int, warmup: bool) -> float:
    """Training steps (forward, backward, SGD) on this CPU with all its threads."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model.train()

    def step() -> None:
        output = model(x)
        outputs = output.values() if isinstance(output, dict) else [output]
        sum(t.float().mean() for t in outputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if warmup:
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * len(x) / (time.perf_counter() - start)


def verdict(recipe: str, per_worker: float) -> tuple[int, str]:
    """How many workers (CPU cores) like this one the GPU reference needs."""
    reference = GPU_REFERENCES[recipe]
    kind = "published" if reference.published else "estimated"
    text = (f"{kind} GPU demand {reference.samples_per_s:,.0f} samples/s ({reference.source}); give each GPU's "
            f"rank at least this many CPU cores (trainer.num_workers defaults to one worker per core)")
    return math.ceil(reference.samples_per_s / per_worker), text


def run(quick: bool) -> list[Result]:
    builders = {"fashion_mnist": fashion_mnist, "cifar100_resnet50": cifar100_resnet50, "dinov2_fsdp": dinov2_fsdp,
                "timm_imagenet": timm_imagenet, "tv_segmentation": tv_segmentation, "fungitastic": fungitastic}
    results = []
    for recipe in RECIPES:
        if not (REPO / "recipes" / recipe / "data.py").is_file():
            continue
        with tempfile.TemporaryDirectory() as workdir:
            pipeline = builders[recipe](Path(workdir))
            per_worker = samples_per_second(pipeline, 1.0 if quick else 10.0)
        model_rate = model_samples_per_second(pipeline.model, pipeline.model_input, 1 if quick else 3,
                                              warmup=not quick)
        on_device = not pipeline.in_workers
        where = "on the training device, one CPU thread" if on_device else "per DataLoader worker (one CPU core)"
        results += [
            Result(BENCHMARK, f"{recipe}: input pipeline", per_worker, "samples/s",
                   f"{where}; batch {pipeline.batch_size}"),
            Result(BENCHMARK, f"{recipe}: model training step on this CPU", model_rate, "samples/s",
                   f"batch {len(pipeline.model_input)}, input {tuple(pipeline.model_input.shape[1:])}, fp32"
                   f"{', first step (quick mode)' if quick else ''}; the pipeline is "
                   f"{per_worker / model_rate:,.0f}x faster"),
        ]
        if not on_device:
            needed, text = verdict(recipe, per_worker)
            results.append(Result(BENCHMARK, f"{recipe}: workers one GPU needs", needed, "workers", text))
    return results
