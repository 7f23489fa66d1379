"""dinov2_fsdp: fine-tune throughput (images/s) and model FLOPs utilisation for ViT-B/14 and ViT-L/14.

One step is the recipe's stage-2 step on one device (all parameters trainable): upsample a uint8
CIFAR batch to 224 px, forward under bf16 autocast, cross-entropy, backward, and the recipe's own
AdamW (``make_optimizer``: foreach, not fused). It is timed
with ``torch.compile`` of each transformer block off, then on (one model: its blocks compiled in
place). FLOPs per step are counted once, on the eager model, with
``torch.utils.flop_counter`` (matmuls, convolutions, attention), and MFU is the achieved FLOP/s
over the GPU's dense bf16 peak. Without a GPU (quick mode) a tiny DINOv2 runs on the CPU with
compile off, to keep the code path checked; its MFU is not reported (no meaningful peak).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.results import Result
from common.data.image_batches import Normalize
from common.pytorch.precision import autocast
from common.records.telemetry import device_peak_flops
from recipes.dinov2_fsdp.data import MEAN, STD, to_model_input
from recipes.dinov2_fsdp.model import DINOV2_ARCHITECTURES, DinoClassifier
from recipes.dinov2_fsdp.train import make_optimizer

BENCHMARK = "dinov2_fsdp fine-tune"


@dataclass(frozen=True)
class Size:
    label: str
    architecture: dict
    image_size: int
    batch_size: int


FULL = (
    Size("ViT-B/14", DINOV2_ARCHITECTURES["facebook/dinov2-base"], 224, 128),
    Size("ViT-L/14", DINOV2_ARCHITECTURES["facebook/dinov2-large"], 224, 64),
)
QUICK = (Size("tiny ViT/14 (CPU)", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}, 56, 8),)


def build(size: Size, device: torch.device) -> DinoClassifier:
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(**size.architecture, image_size=size.image_size)
    config._attn_implementation = "sdpa"
    return DinoClassifier(Dinov2Model(config), "transformers", "cls").to(device)


def train_step(model: DinoClassifier, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
               image_size: int, normalize: Normalize) -> None:
    with autocast(images.device, "bf16"):
        logits = model(to_model_input(images, image_size, normalize)).float()
    F.cross_entropy(logits, labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flops_per_step(model: DinoClassifier, size: Size, device: torch.device) -> float:
    """Forward and backward FLOPs of one batch, counted on the model before its blocks are compiled."""
    images = torch.randint(0, 256, (size.batch_size, 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 100, (size.batch_size,), device=device)
    counter = FlopCounterMode(display=False)
    with counter, autocast(device, "bf16"):
        logits = model(to_model_input(images, size.image_size, Normalize(MEAN, STD, device, input_max=1))).float()
    with counter:
        F.cross_entropy(logits, labels).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(size: Size, device: torch.device, compiled_too: bool, warmup: int, steps: int) -> list[Result]:
    """Images/s (and on CUDA peak memory and MFU) of one model: eager, then with each block
    compiled when ``compiled_too``. The model is built once; its FLOPs are counted while eager."""
    torch.manual_seed(0)
    model = build(size, device)
    optimizer = make_optimizer(model, lr=1e-5, weight_decay=0.05)
    images = torch.randint(0, 256, (size.batch_size, 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 100, (size.batch_size,), device=device)
    normalize = Normalize(MEAN, STD, device, input_max=1)
    peak = device_peak_flops(device, "bf16")
    flops = flops_per_step(model, size, device) if peak is not None else None
    results = []
    for compiled in (False, True) if compiled_too else (False,):
        if compiled:
            for block in model.blocks:
                block.forward = torch.compile(block.forward)
        for _ in range(warmup):
            train_step(model, optimizer, images, labels, size.image_size, normalize)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            train_step(model, optimizer, images, labels, size.image_size, normalize)
        synchronize(device)
        seconds = time.perf_counter() - start
        setting = (f"{size.label}, {size.image_size}px, batch {size.batch_size}, bf16, "
                   f"compile {'on' if compiled else 'off'}")
        results.append(Result(BENCHMARK, setting, size.batch_size * steps / seconds, "images/s", f"{device}"))
        if device.type == "cuda":
            results.append(Result(BENCHMARK, setting, torch.cuda.max_memory_allocated(device) / 2**30, "GiB peak",
                                  "torch.cuda.max_memory_allocated during the timed steps"))
        if flops is not None:
            results.append(Result(BENCHMARK, setting, 100 * flops * steps / seconds / peak, "% MFU",
                                  f"of {peak / 1e12:.0f} TFLOP/s dense bf16"))
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def run(quick: bool) -> list[Result]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        return [result for size in QUICK for result in measure(size, device, False, warmup=1, steps=3)]
    warmup, steps = (3, 5) if quick else (10, 30)
    return [result for size in FULL for result in measure(size, device, True, warmup, steps)]
