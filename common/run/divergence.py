"""``trainer.nonfinite``: noticing that training stopped being finite, without a host sync per step.

A run whose loss goes NaN would otherwise train on to the end of its allocation and commit NaN
checkpoints as the latest, which the ISC ships and every later cycle resumes from (bit-exactly,
so the divergence replays). :class:`NonfiniteWatch` keeps, on the training device, the first
step whose loss or gradient norm was not finite; the run contract (``common/run/training_run.py``) reads it
where the ranks already agree on the checkpoint cadence, without waiting for the device, and
exactly before every save, which waits for the device anyway. What it then does (stop, or roll
back to the last finite checkpoint) is in :meth:`common.run.training_run.TrainingRun.steps`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

NONE = -1  # the watch's value while every step so far was finite


class NonfiniteWatch:
    """The first optimizer step whose watched values were not all finite, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._first = torch.full((), NONE, dtype=torch.int64, device=device)  # CUDA: the step, on the device
        self._known = NONE  # what the host knows of it (on the CPU: the step itself)
        self._pinned: torch.Tensor | None = None  # CUDA: where the value is copied to, without waiting
        self._copy: torch.cuda.Event | None = None  # ... and the copy in flight

    def observe(self, step: int, *values: torch.Tensor | None) -> None:
        """Note ``values`` (a loss sum, a gradient norm; None: not computed) of optimizer step
        ``step``: on a GPU a few device operations and no host sync; on the CPU, where reading a
        value costs nothing, it is read."""
        present = [value.detach() for value in _tensors(values)]  # a DTensor (FSDP2's norm): its replicated value
        if not present:
            return
        if self.device.type != "cuda":
            if self._known == NONE and not all(_finite_on_host(value) for value in present):
                self._known = step
            return
        # A value on the CPU (the gradient norm under FSDP2's CPU offload) is read there, where it
        # is already computed; the others are judged on the device.
        finite = [torch.isfinite(value).all() for value in present if value.device.type != "cpu"]
        if not all(_finite_on_host(value) for value in present if value.device.type == "cpu"):
            finite.append(torch.zeros((), dtype=torch.bool, device=self.device))
        if not finite:
            return
        bad = ~torch.stack(finite).all()
        self._first = torch.where(bad & (self._first == NONE), step, self._first)

    def poll(self) -> int:
        """The first non-finite step as far as the host knows it, without waiting for the device:
        on CUDA the value copied at the previous poll, if that copy has landed (a step or so
        late); on the CPU the current one."""
        if self.device.type != "cuda":
            return self._known
        if self._copy is not None and self._copy.query():
            self._known = int(self._pinned.item())
            self._copy = None
        if self._copy is None and self._known == NONE:
            if self._pinned is None:
                self._pinned = torch.empty((), dtype=torch.int64, pin_memory=True)
            self._pinned.copy_(self._first, non_blocking=True)
            self._copy = torch.cuda.Event()
            self._copy.record()
        return self._known

    def settle(self) -> int:
        """The first non-finite step, exactly (waits for the device: for before a save)."""
        if self.device.type == "cuda":
            self._known = int(self._first.item())
        return self._known

    def reset(self) -> None:
        """Forget what was seen (after a rollback, every watched value is finite again)."""
        self._first.fill_(NONE)
        self._known = NONE
        self._copy = None


def _finite_on_host(value: torch.Tensor) -> bool:
    return math.isfinite(value.item()) if value.numel() == 1 else bool(torch.isfinite(value).all())


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's shard
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def all_finite(*states: Any) -> bool:
    """Whether every floating-point tensor in ``states`` (state dicts, nested) is finite: one host
    sync, for before a save. A weight update can make the weights non-finite before any loss does."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for state in states:
        for tensor in _tensors(state):
            if tensor.is_floating_point() and tensor.numel():
                flags.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    return all(bool(torch.stack(device_flags).all()) for device_flags in flags.values())


# Every LR value a schedule computes its LR from: a torch ``LRScheduler``'s ``base_lrs`` (the
# recipes' LambdaLR schedules multiply them); a timm scheduler's ``base_values``, its warmup's start
# and slope, and its floor. Scaling all of them scales the whole schedule, warmup included.
_SCHEDULE_LR_ATTRIBUTES = ("base_lrs", "base_values", "warmup_lr_init", "warmup_steps", "lr_min")


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply the learning rate by ``factor`` from now on, at every step of the schedule: the
    optimizer's groups and the schedule's LR values (:data:`_SCHEDULE_LR_ATTRIBUTES`), which
    their state dicts keep, so a resumed run keeps the factor too."""
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key in group:
                group[key] *= factor
    for attribute in _SCHEDULE_LR_ATTRIBUTES:
        value = getattr(scheduler, attribute, None) if scheduler is not None else None
        if isinstance(value, list):
            setattr(scheduler, attribute, [item * factor for item in value])
        elif isinstance(value, float):
            setattr(scheduler, attribute, value * factor)
