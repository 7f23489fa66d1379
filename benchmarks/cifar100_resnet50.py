"""Training throughput: ResNet-50 on synthetic data, and the cifar100_resnet50 recipe end to end.

1. ResNet-50 (timm, ImageNet shape: 224 px, 1000 classes) trained on one synthetic batch kept
   in device memory, so only the model, the optimizer and the precision settings are measured:
   fp32 vs bf16, channels_last on/off, ``torch.compile`` on/off. Target on one H100: 3,500
   images/s or more in bf16 (NVIDIA's published one-A100 AMP figure is 2,470).
2. The recipe itself (``train()`` with its default config: bf16, channels_last, on-device
   augmentation) on data in the CIFAR-100 file format. Its images/s is the difference of two
   runs of different lengths, so start-up, the final evaluation and the final checkpoint cancel,
   both measured after a warm-up run.

On a GPU everything runs full size. Without one, or with ``quick=True``, the sizes are tiny
(timm's ``test_resnet`` at 32 px; fp32 for the recipe) so that it finishes in seconds on a CPU,
and compiled variants are left out: compiling takes minutes on a CPU.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

from benchmarks.results import Result
from common.entry import compose_config, typed_config
from common.pytorch.determinism import configure_determinism
from common.pytorch.distributed import init_distributed
from common.pytorch.precision import autocast
from data_prep import cifar100_resnet50 as prep
from data_prep.files import file_digest
from recipes.cifar100_resnet50.train import train as train_recipe
from tools.tiny_data import write_cifar100_tarball


@dataclass(frozen=True)
class SyntheticSetting:
    precision: str
    channels_last: bool
    compile: bool

    def label(self) -> str:
        return ", ".join([self.precision, "channels_last" if self.channels_last else "contiguous",
                          "compile" if self.compile else "eager"])


FULL_SETTINGS = [
    SyntheticSetting("fp32", False, False),
    SyntheticSetting("fp32", True, False),
    SyntheticSetting("bf16", False, False),
    SyntheticSetting("bf16", True, False),
    SyntheticSetting("fp32", True, True),
    SyntheticSetting("bf16", True, True),
]
QUICK_SETTINGS = [setting for setting in FULL_SETTINGS if not setting.compile]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def imagenet_model(model_name: str, device: torch.device) -> torch.nn.Module:
    """A timm model with ImageNet's 1,000 classes, randomly initialised, on ``device``."""
    torch.manual_seed(0)
    return timm.create_model(model_name, pretrained=False, num_classes=1000).to(device)


def synthetic_images_per_second(model: torch.nn.Module, image_size: int, batch_size: int, setting: SyntheticSetting,
                                steps: int, warmup: int, device: torch.device) -> float:
    """Training images/s (forward, backward, SGD step) of ``model`` on one batch that stays on the
    device. The caller builds the model once for all its settings: its weights change, not its speed."""
    images = torch.randn(batch_size, 3, image_size, image_size, device=device)
    labels = torch.randint(0, 1000, (batch_size,), device=device)
    model = model.to(memory_format=torch.channels_last if setting.channels_last else torch.contiguous_format)
    if setting.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    forward = torch.compile(model) if setting.compile else model

    def step() -> None:
        with autocast(device, setting.precision):
            loss = F.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):  # includes compilation and cuDNN autotuning
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return batch_size * steps / (time.perf_counter() - start)


def recipe_train_seconds(data_root: Path, run_dir: Path, steps: int, overrides: list[str]) -> float:
    """The recipe's own training wall time (``summary.json``'s ``wall_time_s``) for ``steps`` steps."""
    cfg = typed_config(compose_config("cifar100_resnet50", [
        f"data.root={data_root}", f"run_dir={run_dir}", f"trainer.max_steps={steps}",
        "logging.backend=none", "logging.progress_bar=false", "checkpoint.every_seconds=0", *overrides,
    ]))
    configure_determinism(cfg.trainer.deterministic, cfg.device)
    train_recipe(cfg, init_distributed(cfg.device))
    return json.loads((run_dir / "summary.json").read_text())["wall_time_s"]


def images_per_second_between(seconds_for_steps: Callable[[int], float], short: int, long: int,
                              batch_size: int) -> float:
    """(long - short) steps of ``batch_size`` images over the difference of two runs' times, so
    that start-up, the final evaluation and the final checkpoint cancel. A first, unmeasured run
    pays what only a process's first run pays (CUDA context, cuDNN autotuning, compilation), so
    that both measured runs start equally warm; without it the short run alone would pay it and
    the difference would be too small (even negative)."""
    seconds_for_steps(short)
    short_s = seconds_for_steps(short)
    long_s = seconds_for_steps(long)
    return batch_size * (long - short) / (long_s - short_s)


def recipe_images_per_second(short: int, long: int, batch_size: int, n_test: int, overrides: list[str]) -> float:
    """End-to-end images/s of the recipe (see :func:`images_per_second_between`)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tarball = write_cifar100_tarball(root / prep.TARBALL, n_train=batch_size * (long + 1), n_test=n_test)
        prep.prepare(root / "data", tarball, md5=file_digest(tarball))
        settings = [f"trainer.batch_size={batch_size}", *overrides]
        runs = itertools.count()
        return images_per_second_between(
            lambda steps: recipe_train_seconds(root / "data", root / f"run-{next(runs)}", steps, settings),
            short, long, batch_size,
        )


def run(quick: bool) -> list[Result]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    full = device.type == "cuda" and not quick
    results = []

    model_name, size, batch = ("resnet50", 224, 256) if full else ("test_resnet", 32, 8)
    steps, warmup = (50, 10) if full else (3, 1)
    model = imagenet_model(model_name, device)
    for setting in FULL_SETTINGS if full else QUICK_SETTINGS:
        value = synthetic_images_per_second(model, size, batch, setting, steps, warmup, device)
        results.append(Result(
            benchmark=f"{model_name} training throughput, synthetic {size} px batch {batch} in device memory",
            setting=f"{device.type}: {setting.label()}", value=round(value, 1), unit="images/s",
            note="target on one H100: >= 3,500 images/s in bf16" if full else "quick: tiny model, not ResNet-50",
        ))

    recipe_model, short, long, batch, n_test, precision = (
        ("resnet50", 20, 120, 128, 10000, "bf16") if full else ("test_resnet", 2, 6, 16, 32, "fp32")
    )
    overrides = [f"model.name={recipe_model}", f"trainer.precision={precision}"]
    value = recipe_images_per_second(short, long, batch, n_test, overrides)
    results.append(Result(
        benchmark="cifar100_resnet50 recipe end to end (32 px, on-device augmentation)",
        setting=f"{device.type}: {recipe_model}, batch {batch}, {precision}, channels_last, crop+flip",
        value=round(value, 1), unit="images/s",
        note=f"steps {short} -> {long}: difference of the two runs' training wall time, both after a warm-up run",
    ))
    return results
