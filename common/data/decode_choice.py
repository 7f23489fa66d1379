"""``data.decode=auto``: decode training JPEGs where it does not slow the run down.

CPU workers cost the GPU nothing while they keep up; nvjpeg (``data.decode=gpu``) frees the CPU but
takes time from every step. ``auto`` measures both sides at start-up on rank 0, and every rank takes
its choice:

- supply: images/s one core decodes and augments through the recipe's CPU pipeline (a few training
  files), times the rank's loader workers;
- demand: images/s the model trains on this GPU (forward and backward of a synthetic micro-batch of
  the size the run will use, the resumed one after ``trainer.out_of_memory=halve``; running out of
  memory halves the measurement, never stops the run; weights, buffers, gradients and random
  generators left as they were);
- the CPU when supply >= :data:`HEADROOM` x demand, and whenever only the CPU can run (CPU device, an
  augmentation only the CPU path has) or timings must not matter (``trainer.deterministic``);
- a resumed run decodes as it began (the choice is in its checkpoint, ``Progress.decode``): decoding
  the other way draws other augmentations, and the resume would not end with the digest of an
  uninterrupted run. Only a ``data.decode`` set to the other side changes it, said in the line;
- the choice and its reason are one line of the start-up summary.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from common.config import Decode, Precision, TrainerConfig
from common.data.device_input import gpu_decode_unsupported
from common.data.images import TrainAugmentation, TrainImages
from common.data.loaders import PerSampleSeeded, cpu_cores_per_rank, halved
from common.pytorch import distributed
from common.pytorch.fsdp import is_sharded
from common.pytorch.precision import autocast

HEADROOM = 1.1  # the CPU must supply this much more than the model trains: decode times vary per file
_SAMPLE_SECONDS = 0.3  # of one core's CPU time spent measuring its decode rate
_TIMED_STEPS = 2
_SAMPLE_FILES = 64  # training files the decode rate is measured on, at most


@dataclass(frozen=True)
class DecodeChoice:
    """Where a run decodes, and the line that says why."""

    decode: Decode
    reason: str


def choose_decode(configured: Decode, *, device: torch.device, deterministic: bool, gpu_unsupported: str | None,
                  workers: int, core_rate: Callable[[], float], model_rate: Callable[[], float],
                  model_is_sharded: bool = False, resumed: Decode | None = None) -> DecodeChoice:
    """Where this run decodes: ``configured``, or under ``auto`` the rule of the module.

    - ``gpu_unsupported``: why the GPU path cannot run this augmentation (None: it can).
    - ``workers`` cores at ``core_rate()`` images/s each are weighed against ``model_rate()``.
    - The rates are measured only when needed, on rank 0 (``model_rate`` on every rank when
      ``model_is_sharded``: FSDP2's forward passes are collective).
    - ``resumed``: where the checkpoint resumed from decoded (None: a fresh run); ``auto`` keeps it.
    - Collective: rank 0's choice is broadcast.
    """
    if configured != Decode.auto:
        if resumed is not None and resumed != configured:
            return DecodeChoice(configured, f"data.decode={configured.value}, set for this resume: the run decoded on "
                                            f"the {resumed.value} before, so from here on it draws other "
                                            f"augmentations than an uninterrupted run would")
        return DecodeChoice(configured, f"data.decode={configured.value}")
    only_cpu = "the device is not a GPU" if device.type != "cuda" else gpu_unsupported
    if only_cpu:
        moved = "; the run decoded on the GPU before this resume: it draws other augmentations from here on" \
            if resumed == Decode.gpu else ""
        return DecodeChoice(Decode.cpu, f"data.decode=auto: {only_cpu}{moved}")
    if resumed is not None:
        return DecodeChoice(resumed, f"data.decode=auto: on the {resumed.value}, as the run chose at its start (kept "
                                     f"in its checkpoint, so the resume draws the augmentations of an uninterrupted "
                                     f"run; data.decode=cpu or gpu changes it)")
    if deterministic:
        return DecodeChoice(Decode.cpu, "data.decode=auto: trainer.deterministic=true, and the choice would depend on "
                                        "timings (set data.decode=gpu to decode on the GPU)")
    choice = None
    demand = model_rate() if model_is_sharded else None
    if not dist.is_initialized() or dist.get_rank() == 0:
        per_core, demand = core_rate(), model_rate() if demand is None else demand
        supply = per_core * max(workers, 1)
        decode = Decode.cpu if supply >= HEADROOM * demand else Decode.gpu
        if demand == 0:
            choice = DecodeChoice(decode, "data.decode=auto: the model ran out of GPU memory with one sample, so "
                                          "the GPU has none to decode with")
        else:
            choice = DecodeChoice(decode, f"data.decode=auto: {max(workers, 1)} loader worker(s) decode ~{supply:,.0f} "
                                          f"images/s (~{per_core:,.0f} per core) and the model trains ~{demand:,.0f} "
                                          f"on this GPU; the CPU keeps up from {HEADROOM * demand / per_core:.1f} "
                                          f"cores")
    return distributed.broadcast_object(choice)


def core_rate(decode_one: Callable[[int], object], count: int) -> float:
    """Images/s one core decodes, timing ``decode_one(i)`` for i < ``count`` in this thread's CPU time.

    The first call (imports, caches) is not counted; timing stops after ``_SAMPLE_SECONDS``.
    """
    decode_one(0)
    start, done = time.thread_time(), 0
    while done < count - 1 and time.thread_time() - start < _SAMPLE_SECONDS:
        decode_one(1 + done)
        done += 1
    return done / max(time.thread_time() - start, 1e-6)


def model_rate(model: torch.nn.Module, batch: int, image_size: int, precision: Precision, channels_last: bool,
               device: torch.device) -> float:
    """Images/s ``model`` trains (forward and backward, no optimizer step) on a synthetic ``batch``.

    - Out of memory: measured again with half the batch, as ``trainer.out_of_memory=halve`` would
      train; 0.0 when not even one sample fits.
    - Leaves parameters, buffers, gradients (set to None) and random generators as they were."""
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            while True:
                try:
                    return _TIMED_STEPS * batch / _train_seconds(model, batch, image_size, precision, channels_last,
                                                                 device)
                except torch.OutOfMemoryError:
                    model.zero_grad(set_to_none=True)
                    gc.collect()  # the failed attempt's activations, held in cycles through its traceback
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    if batch == 1:
                        return 0.0
                    batch = halved(batch)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])


def _train_seconds(model: torch.nn.Module, batch: int, image_size: int, precision: Precision, channels_last: bool,
                   device: torch.device) -> float:
    """Seconds of :data:`_TIMED_STEPS` forward and backward passes of a synthetic ``batch``, after one untimed."""
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    seconds = 0.0
    for step in range(1 + _TIMED_STEPS):  # the first autotunes cuDNN, as the run's first step would
        _synchronize(device)
        start = time.perf_counter()
        with autocast(device, precision):
            output = model(images)
        outputs = output.values() if isinstance(output, dict) else [output]  # a multi-task model's heads
        sum(head.float().mean() for head in outputs).backward()
        _synchronize(device)
        seconds += (time.perf_counter() - start) if step else 0.0
    return seconds


def choose_train_decode(configured: Decode, trainer: TrainerConfig, augmentation: TrainAugmentation,
                        images: Dataset, draft_decode: bool, model: torch.nn.Module, image_size: int,
                        device: torch.device, *, micro_batch: int, resumed: str) -> DecodeChoice:
    """:func:`choose_decode` for a recipe's training ``images`` (files or shards) and its built ``model``.

    - Takes workers, precision and determinism from ``trainer``; the model is measured at
      ``micro_batch``, the run's (``TrainingRun.micro_batch``, after its resume).
    - ``resumed``: ``Progress.decode`` after the resume ("" for a fresh run). Collective."""
    workers = trainer.num_workers if trainer.num_workers >= 0 else cpu_cores_per_rank()
    files = TrainImages(Subset(images, range(min(len(images), _SAMPLE_FILES))), augmentation, Decode.cpu,
                        draft_decode)
    seeded = PerSampleSeeded(files, seed=0)  # the augmentation draws from the global generators: left as they are
    return choose_decode(
        configured, device=device, deterministic=trainer.deterministic,
        gpu_unsupported=gpu_decode_unsupported(augmentation), workers=workers,
        core_rate=lambda: core_rate(lambda index: seeded[(0, index)], len(files)),
        model_rate=lambda: model_rate(model, micro_batch, image_size, trainer.precision, trainer.channels_last,
                                      device),
        model_is_sharded=is_sharded(model), resumed=Decode(resumed) if resumed else None,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
