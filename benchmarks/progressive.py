"""Progressive resizing (``data.progressive``): images/s at the start size against the end size.

FFCV's ResNet-50 ramp, 160 px early and 192 px late, measured on the two sides of a step at each size:

- the model: forward, backward and SGD step of ResNet-50 (``quick``: timm's ``test_resnet``) on a
  synthetic batch, fp32, channels-last, in this process's threads;
- the input: one loader worker's decode and augmentation (``common.data.images.TrainImages``,
  ``data.decode=cpu``) of photo-like 500x375 JPEGs, one thread.

The ratio (start / end) is what an epoch at the start size gains over one at the end size where that
side limits the step. On a shared CPU the figures are noisy; the ratio holds better than each rate.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import timm
import torch

from benchmarks.results import Result
from common.config import Decode
from common.data.images import PathImages, TrainAugmentation, TrainImages
from common.data.loaders import PerSampleSeeded
from tools.tiny_data import photo

BENCHMARK = "progressive resizing, start size against end size (CPU)"
START, END = 160, 192  # FFCV's rn50 configurations: min_res, max_res


def model_rate(name: str, size: int, batch: int, steps: int) -> float:
    """Images/s of forward, backward and an SGD step at ``size`` px, after one untimed step."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).to(memory_format=torch.channels_last).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(batch, 3, size, size).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,))
    seconds = 0.0
    for step in range(1 + steps):
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += (time.perf_counter() - start) if step else 0.0
    return steps * batch / seconds


def input_rate(paths: list[str], size: int, repeats: int) -> float:
    """Images/s one thread decodes and augments (crop, flip, colour jitter draws) at ``size`` px."""
    images = TrainImages(PathImages(paths, [0] * len(paths)), TrainAugmentation(size=size, colour_jitter=0.4),
                         Decode.cpu)
    dataset = PerSampleSeeded(images, seed=0)
    dataset[(0, 0)]  # warm-up
    start = time.perf_counter()
    for epoch in range(repeats):
        for index in range(len(paths)):
            dataset[(epoch, index)]
    return repeats * len(paths) / (time.perf_counter() - start)


def run(quick: bool) -> list[Result]:
    name, batch, steps = ("test_resnet", 8, 2) if quick else ("resnet50", 8, 3)
    count, repeats = (8, 1) if quick else (48, 3)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_progressive_") as scratch:
        rng = np.random.default_rng(0)
        paths = []
        for i in range(count):
            paths.append(str(Path(scratch) / f"{i}.JPEG"))
            photo(500, 375, rng).save(paths[-1], quality=90)
        for side, measure, note in (
            (f"{name} step, batch {batch}", lambda size: model_rate(name, size, batch, steps),
             f"forward, backward, SGD; fp32 channels-last, {torch.get_num_threads()} threads"),
            ("input, one worker", lambda size: input_rate(paths, size, repeats),
             "decode + random-resized crop of 500x375 JPEGs, data.decode=cpu, one thread"),
        ):
            threads = torch.get_num_threads()
            if side.startswith("input"):
                torch.set_num_threads(1)  # as a DataLoader worker runs
            try:
                rates = {size: measure(size) for size in (START, END)}
            finally:
                torch.set_num_threads(threads)
            results += [Result(BENCHMARK, f"{side}, {size} px", rate, "images/s", note) for size, rate in rates.items()]
            results.append(Result(BENCHMARK, f"{side}, {START} px / {END} px", rates[START] / rates[END], "x",
                                  f"pixels {(END / START) ** 2:.2f}x; shared machine, noisy"))
    return results
