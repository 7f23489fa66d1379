"""Memory on one GPU: the largest batch that fits, and its images/s, with ``trainer.activation_checkpointing``
none, ``blocks`` and ``selective``, for

1. **ViT-L/14 at 224 px**: DINOv2-large's architecture (transformers), ``benchmarks/dinov2_fsdp.py``'s
   fine-tune step (bf16 autocast, cross-entropy, backward, the recipe's AdamW), on the plain module;
2. **the timm_imagenet preset ``timm_vit_large_patch16_224``** (timm's ViT-L/16 at 224 px, the preset's
   SGD) **with FSDP2 on one GPU**: a process group of one, each block a unit, as ``fsdp.enabled=true``
   builds it (``recipes/timm_imagenet/train.py``), in a process of its own.

The blocks are checkpointed by ``common/pytorch/activation_checkpointing.py``, as the recipes do. The
largest batch: the peak memory of steps of 8 and 16 images (the optimizer's state allocated by then)
gives a first guess from the GPU's memory, and tries of one step each (a try that runs out of memory
is cleaned up and left) narrow it down to a multiple of 8 within about 3%; images/s is then timed
at that batch and the peak memory read (``torch.cuda.max_memory_allocated``). About 5 minutes on an
H100 for both models. The figures hold for the GPU they name. Without a GPU a tiny ViT takes one
batch per setting on the CPU, to keep the code path checked: no largest batch, no memory.

    python -m benchmarks.run --only memory        # on a GPU machine; writes its table in RESULTS.md
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.results import Result
from common.pytorch.activation_checkpointing import checkpoint_blocks, residual_blocks
from common.pytorch.precision import autocast

BENCHMARK = "memory: largest batch on one GPU"
MODES = ("none", "blocks", "selective")
PRESET = "timm_vit_large_patch16_224"
NUM_CLASSES = 1000


@dataclass(frozen=True)
class Setup:
    """A model with its optimizer, ready for steps of a batch size."""

    label: str
    image_size: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    outputs: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def vit_l14(mode: str, device: torch.device, tiny: bool) -> Setup:
    """DINOv2-large's ViT-L/14 with a linear head, the dinov2_fsdp fine-tune (all of it trains)."""
    from transformers import Dinov2Config, Dinov2Model

    from recipes.dinov2_fsdp.model import DINOV2_ARCHITECTURES, DinoClassifier
    from recipes.dinov2_fsdp.train import make_optimizer

    size = 28 if tiny else 224
    architecture = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2} if tiny \
        else DINOV2_ARCHITECTURES["facebook/dinov2-large"]
    config = Dinov2Config(**architecture, image_size=size)
    config._attn_implementation = "sdpa"
    model = DinoClassifier(Dinov2Model(config), "transformers", "cls")
    checkpoint_blocks(model.backbone, mode, "ViT-L/14")
    model = model.to(device)
    label = "tiny ViT/14 (CPU)" if tiny else "ViT-L/14 (DINOv2-large), 224 px"
    return Setup(label, size, model, make_optimizer(model, 1e-5, 0.05), lambda model, x: model(x))


def preset_vit_l16_fsdp(mode: str, device: torch.device, tiny: bool) -> Setup:
    """The timm_imagenet preset's model and optimizer, sharded with FSDP2 on a process group of one."""
    from timm.optim import create_optimizer_v2

    from common.entry import compose_config, typed_config
    from common.pytorch.fsdp import fully_shard_blocks
    from recipes.timm_imagenet.model import build_model

    overrides = ["model.name=test_vit", "+model.kwargs.img_size=32"] if tiny else []
    cfg = typed_config(compose_config("timm_imagenet", [f"+experiment={PRESET}", *overrides]))
    model = build_model(cfg.model, NUM_CLASSES, pretrained=False)
    checkpoint_blocks(model, mode, cfg.model.name)
    model = model.to(device)
    fully_shard_blocks(model, residual_blocks(model), bf16_parameters=False,
                       reshard_after_forward=cfg.fsdp.reshard_after_forward, cpu_offload=False)
    optimizer = create_optimizer_v2(model, opt=cfg.optim.opt, lr=1e-4, weight_decay=cfg.optim.weight_decay,
                                    momentum=cfg.optim.momentum)
    size = 32 if tiny else cfg.data.train_size
    label = f"{cfg.model.name} (timm_imagenet +experiment={PRESET}), {size} px, FSDP2 on one GPU"
    return Setup(label, size, model, optimizer, lambda model, x: model(x))


def train_step(setup: Setup, batch: int, device: torch.device) -> None:
    images = torch.randn(batch, 3, setup.image_size, setup.image_size, device=device)
    with autocast(device, "bf16"):
        logits = setup.outputs(setup.model, images).float()
    F.cross_entropy(logits, torch.randint(0, logits.shape[1], (batch,), device=device)).backward()
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fits(setup: Setup, batch: int, device: torch.device, steps: int = 1) -> bool:
    """Whether ``steps`` steps of ``batch`` images run without running out of memory (two in the search:
    the second step's memory is the steady state's)."""
    try:
        for _ in range(steps):
            train_step(setup, batch, device)
        synchronize(device)
        return True
    except torch.OutOfMemoryError:
        clean_up_after_error(setup, device)
        return False


def clean_up_after_error(setup: Setup, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule

    setup.optimizer.zero_grad(set_to_none=True)
    if isinstance(setup.model, FSDPModule) and hasattr(setup.model, "reset_iter_state"):  # torch >= 2.12
        setup.model.reset_iter_state()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_gib(setup: Setup, batch: int, device: torch.device, steps: int) -> float:
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        train_step(setup, batch, device)
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def largest_batch(setup: Setup, device: torch.device, limit: int) -> int:
    """The largest multiple of 8 (up to ``limit``) whose step fits, within about 3%: a guess from
    the memory of 8 and 16 images, up by an eighth while it fits, then bisecting between the
    largest batch that fits and the smallest that does not."""
    small, double = peak_gib(setup, 8, device, steps=2), peak_gib(setup, 16, device, steps=1)
    per_image = max((double - small) / 8, 1e-6)
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    guess = min(limit, max(24, int((0.95 * total - (small - 8 * per_image)) / per_image) // 8 * 8))
    fitting = 16
    while fits(setup, guess, device, steps=2):
        fitting = guess
        if guess >= limit:
            return guess
        guess = min(limit, (guess + guess // 8) // 8 * 8 + 8)
    failing = guess
    while failing - fitting > max(8, fitting // 32):
        middle = (fitting + failing) // 2 // 8 * 8
        if middle <= fitting:
            break
        if fits(setup, middle, device, steps=2):
            fitting = middle
        else:
            failing = middle
    return fitting


def images_per_s(setup: Setup, batch: int, device: torch.device, warmup: int, steps: int) -> tuple[float, float]:
    """Images/s over ``steps`` steps of ``batch``, and the peak memory of those steps in GiB (0 on a CPU)."""
    for _ in range(warmup):
        train_step(setup, batch, device)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(setup, batch, device)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return batch * steps / seconds, peak


def measure(build: Callable[[str, torch.device, bool], Setup], device: torch.device, quick: bool) -> list[Result]:
    """Each activation-checkpointing mode of one model: its largest batch and images/s (a GPU), or
    images/s at a batch of 4 (a CPU)."""
    results = []
    if device.type == "cuda":  # a batch near the limit must not fail on the cache's fragments
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    for mode in MODES:
        torch.manual_seed(0)
        setup = build(mode, device, device.type == "cpu")
        setting = f"{setup.label}, trainer.activation_checkpointing={mode}, bf16"
        if device.type == "cpu":
            speed, _ = images_per_s(setup, 4, device, warmup=1, steps=2)
            results.append(Result(BENCHMARK, setting, speed, "images/s", "batch 4 on the CPU: the code path only"))
        else:
            limit = 1024 if quick else 8192
            batch = largest_batch(setup, device, limit)
            while True:  # the timed steps can meet fragments the search's two did not: a sixteenth less
                try:
                    speed, peak = images_per_s(setup, batch, device, warmup=1, steps=3 if quick else 6)
                    break
                except torch.OutOfMemoryError:
                    clean_up_after_error(setup, device)
                    batch -= max(8, batch // 16 // 8 * 8)
            name = torch.cuda.get_device_name(device)
            found = f"the search's limit ({'--quick' if quick else 'full run'})" if batch >= limit \
                else "the largest multiple of 8 within about 3%"
            results += [Result(BENCHMARK, setting, batch, "images per batch", f"{found}, {name}"),
                        Result(BENCHMARK, setting, speed, "images/s", f"at that batch, {name}"),
                        Result(BENCHMARK, setting, peak, "GiB peak", "torch.cuda.max_memory_allocated at that batch")]
            print(f"{setting}: batch {batch}, {speed:.1f} images/s, {peak:.1f} GiB peak", flush=True)
        del setup
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _sharded_measurement(out: str, quick: bool) -> None:
    """The FSDP2 part, in a spawned process: its own process group of one, ended without interpreter
    shutdown (see ``common.entry.exit_process``)."""
    from common.pytorch import distributed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    distributed.init_distributed(device.type, group_of_one=True)
    code = 1
    try:
        results = measure(preset_vit_l16_fsdp, device, quick)
        Path(out).write_text(json.dumps([result.__dict__ for result in results]))
        code = 0
    except Exception:
        traceback.print_exc()
    finally:
        distributed.shutdown_distributed()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(quick: bool) -> list[Result]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = measure(vit_l14, device, quick)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "sharded.json"
        child = multiprocessing.get_context("spawn").Process(target=_sharded_measurement, args=(str(out), quick))
        child.start()
        child.join()
        if not out.exists():
            raise RuntimeError(f"the FSDP2 measurement's process ended with code {child.exitcode} and no figures")
        results += [Result(**fields) for fields in json.loads(out.read_text())]
    return results
