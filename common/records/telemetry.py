"""What every training log reports beside the recipe's metrics: step time, data wait, grad norm, memory, MFU.

- Metrics: ``train/images_per_s``, ``train/step_s``, ``train/data_wait_frac``, ``train/grad_norm``,
  ``train/max_mem_gib``, ``train/mfu`` and the slowest rank (docs/records.md says what each means).
- All of them count the same time: the window's, less its checkpoint saves and evaluations
  (:meth:`StepTelemetry.excluded`), so that images/s times step_s is a step's samples.
- Timed with the host's clock between logs; the device is read and ranks gathered only in
  :meth:`StepTelemetry.report`, on logging steps. Other steps make no host sync and no collective.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

# Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets, in TFLOP/s per GPU: bf16 (fp16 the
# same), tf32 (fp32 matmuls when TF32 is on: trainer.deterministic=false on CUDA) and plain fp32.
# The first pattern that matches torch.cuda.get_device_name() wins: the more specific ones first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100|GH200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"H200 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
)


def peak_tflops(device_name: str, precision: str, tf32: bool) -> float | None:
    """The dense peak TFLOP/s of the GPU named ``device_name``, or None when unknown.

    ``precision``: ``fp32``, ``bf16`` or ``fp16``; ``tf32``: fp32 matmuls run on TF32 tensor cores."""
    kind = "bf16" if precision in ("bf16", "fp16") else "tf32" if tf32 else "fp32"
    return next((peaks[kind] for pattern, peaks in PEAK_TFLOPS if re.search(pattern, device_name)), None)


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """FLOP/s of ``device`` at its dense peak for ``precision`` (None on a CPU or an unknown GPU)."""
    if device.type != "cuda":
        return None
    peak = peak_tflops(torch.cuda.get_device_name(device), precision, torch.backends.cuda.matmul.allow_tf32)
    return None if peak is None else peak * 1e12


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The total 2-norm of the gradients before clipping; clips them to ``max_norm`` when it is > 0.

    No host sync. FSDP2's DTensor gradients give the whole model's norm as a DTensor (read with :func:`as_float`).
    """
    parameters = list(parameters)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])


def as_float(value: torch.Tensor) -> float:
    """A scalar tensor's value on the host (a DTensor's whole value: collective for a sharded one)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


class FlopCount:
    """The FLOPs run from construction to :meth:`stop` (forward and backward), by ``FlopCounterMode``.

    A ``torch.compile``d module runs eager while counting (``set_stance("force_eager")``): compiled
    under the counter's module hooks its graphs would differ from later steps', be compiled twice and
    miss the compile cache a resumed run brings.
    """

    def __init__(self) -> None:
        self._counter = FlopCounterMode(display=False)
        self._excluded = 0  # FLOPs run inside the counter that are not the model's (:meth:`excluded`)
        self._contexts = contextlib.ExitStack()
        self._contexts.enter_context(torch.compiler.set_stance("force_eager"))
        self._contexts.enter_context(self._counter)

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Work inside the step that is not the model's (a distillation teacher's forward): counted by a
        counter of its own, nested inside, and taken off the total."""
        counter = FlopCounterMode(display=False)
        with counter:
            yield
        self._excluded += counter.get_total_flops()

    def stop(self) -> float:
        self._contexts.close()
        return float(self._counter.get_total_flops() - self._excluded)


class StepTelemetry:
    """One rank's measurements since the last log (see the module), and their report."""

    def __init__(self, device: torch.device, precision: str) -> None:
        self.device = device
        self.peak_flops = device_peak_flops(device, precision)
        self.grad_norm: torch.Tensor | None = None  # of the last step, where it was computed
        self.start_window()

    def start_window(self) -> None:
        """Start measuring anew (at the start of a segment, after each log, after a rollback)."""
        self._start = self._step_end = time.perf_counter()
        self._excluded = 0.0  # checkpoint saves and evaluations
        self._data_wait = 0.0
        self.steps = 0
        self.samples = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def batches(self, micro_batches: Iterable[Any]) -> Iterator[Any]:
        """``micro_batches``, timing how long each takes to come.

        The iterator is made now: a DataLoader seeds its workers from torch's global generator when it is
        made, and inside a step's ``seeded_global_rng`` that draw would break exact resume."""
        return self._timed(iter(micro_batches))

    def _timed(self, source: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                batch = next(source)
            except StopIteration:
                return
            self._data_wait += time.perf_counter() - start
            yield batch

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time that is not training steps (a checkpoint save, an evaluation)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - start

    def step_done(self, samples: int, grad_norm: torch.Tensor | None) -> None:
        self.steps += 1
        self.samples += samples
        self.grad_norm = grad_norm
        self._step_end = time.perf_counter()

    def report(self, world_size: int, flops_per_sample: float | None,
               group: dist.ProcessGroup | None) -> dict[str, float]:
        """The metrics of the steps since the last log; starts a new window.

        Collective when ``world_size > 1``: gathers each rank's figures over ``group`` (host tensors)."""
        training = max(time.perf_counter() - self._start - self._excluded, 1e-9)  # saves and evaluations left out
        steps = max(self.steps, 1)
        metrics = {"train/images_per_s": self.samples * world_size / training,
                   "train/step_s": training / steps, "train/data_wait_frac": self._data_wait / training}
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = as_float(self.grad_norm)
        if self.peak_flops is not None and flops_per_sample is not None:
            metrics["train/mfu"] = flops_per_sample * self.samples / training / self.peak_flops
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        own_step_s = max(self._step_end - self._start - self._excluded, 0.0) / steps
        if world_size > 1:
            mine = torch.tensor([own_step_s, -1.0 if memory is None else memory], dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(gathered, mine, group=group)
            step_times = [float(row[0]) for row in gathered]
            slowest = max(range(world_size), key=step_times.__getitem__)
            metrics["train/step_s_max_rank"] = step_times[slowest]
            metrics["train/step_s_slowest_rank"] = float(slowest)
            memory = None if memory is None else max(float(row[1]) for row in gathered)
        if memory is not None:
            metrics["train/max_mem_gib"] = memory
        self.start_window()
        return metrics
