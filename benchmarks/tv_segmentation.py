"""tv_segmentation: training images/s of the two presets' models (fcn_resnet101 and
deeplabv3_mobilenet_v3_large with their auxiliary heads).

One measured step is what the recipe's loop does per micro-batch: forward, main + 0.5 x aux
cross entropy with ignore_index=255, backward, SGD with momentum. Data loading is left out
(it runs in DataLoader workers, in parallel). Full size (crop 480, 4 images, as each GPU of
the reference runs) on a GPU when not quick; tiny images on the CPU otherwise.
"""

from __future__ import annotations

import time

import torch

from benchmarks.results import Result
from common.pytorch.precision import autocast
from recipes.tv_segmentation.config import ModelConfig
from recipes.tv_segmentation.model import build_model, head_lr_groups, segmentation_loss

PRESETS = {"fcn_resnet101": 1e-4, "deeplabv3_mobilenet_v3_large": 1e-6}  # model: weight decay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def images_per_second(name: str, weight_decay: float, device: torch.device, crop: int, batch: int,
                      precision: str, channels_last: bool, warmup: int, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name)).to(device).train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(head_lr_groups(model, aux_lr=0.1), lr=0.01, momentum=0.9, weight_decay=weight_decay)
    images = torch.randn(batch, 3, crop, crop, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    masks = torch.randint(0, 21, (batch, crop, crop), device=device)
    masks[:, :, : crop // 8] = 255  # some ignored pixels, as after padding
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        with autocast(device, precision):
            loss = segmentation_loss(model(images), masks, aux_weight=0.5)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(device)
    return batch * steps / (time.perf_counter() - start)


def run(quick: bool) -> list[Result]:
    full = torch.cuda.is_available() and not quick
    device = torch.device("cuda" if full else "cpu")
    crop, batch, warmup, steps = (480, 4, 5, 20) if full else (48, 2, 1, 2)
    settings = [("fp32", False), ("bf16", True)] if full else [("fp32", False)]
    where = torch.cuda.get_device_name(device) if full else "CPU"
    results = []
    for name, weight_decay in PRESETS.items():
        for precision, channels_last in settings:
            value = images_per_second(name, weight_decay, device, crop, batch, precision, channels_last, warmup,
                                      steps)
            layout = ", channels_last" if channels_last else ""
            results.append(Result(
                benchmark="tv_segmentation training throughput",
                setting=f"{name}, {where}, {precision}{layout}, crop {crop}, batch {batch}",
                value=round(value, 2),
                unit="images/s",
                note="one rank, model step only (data loading excluded)"
                + ("" if full else "; tiny CPU sizes, not comparable to GPU figures"),
            ))
    return results
