"""``trainer.nonfinite``: a run whose loss or weights stop being finite stops, or rolls back.

- :class:`NonfiniteWatch`: the first non-finite step, kept on the device (no host sync per step).
- :class:`Divergence`: the run's whole handling of it; before every save, :meth:`Divergence.check`
  either passes, rolls back to the last finite checkpoint (``rollback``), or stops every rank
  (``stop``: :class:`~common.errors.Diverged`, exit 3; the last finite checkpoint stays the latest).
- Why: a NaN run would otherwise commit NaN checkpoints as the latest, which the ISC ships and
  every later cycle resumes from.
"""

from __future__ import annotations

import math
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from common.checkpoint.layout import latest_checkpoint
from common.checkpoint.manager import CheckpointManager, LoadedCheckpoint
from common.config import TrainerConfig
from common.errors import EXIT_DIVERGED, Diverged
from common.pytorch import distributed
from common.pytorch.distributed import DistInfo
from common.pytorch.nested import tensors_in
from common.records import heartbeat
from common.records.loggers import RunLogger
from common.records.summary import write_summary
from common.records.telemetry import StepTelemetry
from common.run.cadence import NONE, CheckpointCadence
from common.run.progress import Progress
from common.run.steps import StepPlan


class NonfiniteWatch:
    """The first optimizer step whose watched values were not all finite, kept on ``device``.

    - :meth:`observe` each step: on a GPU a few device operations, no host sync.
    - :meth:`poll` where the ranks agree (no wait; a step or so late on CUDA), :meth:`settle`
      before a save (exact; waits for the device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._first = torch.full((), NONE, dtype=torch.int64, device=device)  # CUDA: the step, on the device
        self._known = NONE  # what the host knows of it (on the CPU: the step itself)
        self._pinned: torch.Tensor | None = None  # CUDA: where the value is copied to, without waiting
        self._copy: torch.cuda.Event | None = None  # ... and the copy in flight

    def observe(self, step: int, *values: torch.Tensor | None) -> None:
        """Note ``values`` (a loss sum, a gradient norm; None: not computed) of optimizer step ``step``
        (on the CPU, where reading costs nothing, they are read)."""
        present = [value.detach() for value in tensors_in(values)]  # a DTensor (FSDP2's norm): its replicated value
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


def all_finite(*states: Any) -> bool:
    """Whether every floating-point tensor in ``states`` (state dicts, nested) is finite: one host
    sync, for before a save. A weight update can make the weights non-finite before any loss does."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for state in states:
        for tensor in tensors_in(state):
            if tensor.is_floating_point() and tensor.numel():
                flags.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    return all(bool(torch.stack(device_flags).all()) for device_flags in flags.values())


# Every LR value a schedule computes its LR from: a torch ``LRScheduler``'s ``base_lrs`` (the
# recipes' LambdaLR schedules multiply them); a timm scheduler's ``base_values``, its warmup's start
# and slope, and its floor. Scaling all of them scales the whole schedule, warmup included.
_SCHEDULE_LR_ATTRIBUTES = ("base_lrs", "base_values", "warmup_lr_init", "warmup_steps", "lr_min")


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply the learning rate by ``factor`` from now on, at every step of the schedule.

    - Scales the optimizer's groups and the schedule's LR values (:data:`_SCHEDULE_LR_ATTRIBUTES`).
    - Their state dicts keep them: a resumed run keeps the factor too.
    """
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


class GuardedRun(Protocol):
    """What :class:`Divergence` reads and calls of the run it guards, a
    :class:`~common.run.training_run.TrainingRun`: named here, as that module imports this one."""

    dist_info: DistInfo
    plan: StepPlan
    recipe: str
    run_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    extra_state: dict[str, Any]
    checkpoints: CheckpointManager
    cadence: CheckpointCadence
    telemetry: StepTelemetry
    logger: RunLogger | None

    @property
    def progress(self) -> Progress: ...

    def segment_seconds(self) -> float: ...

    def restart_clock(self) -> None: ...

    def reload_latest(self) -> LoadedCheckpoint | None: ...

    def console(self, message: str, everywhere: bool = False) -> None: ...

    def save(self, metrics: dict[str, float] | None = None, milestone: str | None = None) -> None: ...


class Divergence:
    """The run's handling of ``trainer.nonfinite``: watch each step, check before each save, roll back or stop.

    - ``trainer``: its ``nonfinite``, ``rollback_lr_factor`` and ``max_rollbacks``.
    - ``run``: the run it guards (its state, checkpoints, logs): what it uses is :class:`GuardedRun`.
    - Its records live in the run's :class:`~common.run.progress.Progress` (``rollbacks``): checkpointed.
    """

    def __init__(self, trainer: TrainerConfig, run: GuardedRun) -> None:
        self.nonfinite = trainer.nonfinite.value
        self.rollback_lr_factor = trainer.rollback_lr_factor
        self.max_rollbacks = trainer.max_rollbacks
        self.run = run
        self.watch = NonfiniteWatch(run.dist_info.device)

    @property
    def rolls_back(self) -> bool:
        """Whether a finite checkpoint to go back to must exist from the first step on."""
        return self.nonfinite == "rollback"

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Watch optimizer step ``step``'s loss (and gradient norm, where it clips); no host sync on a GPU."""
        self.watch.observe(step, loss, grad_norm)

    def poll(self) -> int:
        """The first non-finite step the host knows of (NONE: none), without waiting for the device."""
        return self.watch.poll()

    def check(self) -> bool:
        """Whether training is finite so far on every rank: the watched values and the state a
        checkpoint would hold. Collective; waits for the device, as the save it precedes does.

        - True: finite. False: rolled back (``rollback`` with rollbacks left and a checkpoint).
        - Raises :class:`~common.errors.Diverged` otherwise, on every rank.
        """
        run = self.run
        with heartbeat.phase(heartbeat.FINITE_CHECK):
            seen = distributed.all_gather_object((self.watch.settle(), self._state_finite()))
        watched = {rank: step for rank, (step, _) in enumerate(seen) if step != NONE}
        if watched:  # where a loss or gradient went non-finite first, not the weights that followed
            nonfinite_step = min(watched.values())
            ranks = sorted(rank for rank, step in watched.items() if step == nonfinite_step)
        else:
            nonfinite_step, ranks = run.progress.step, [rank for rank, (_, finite) in enumerate(seen) if not finite]
        if not ranks:
            return True
        hosts = distributed.all_gather_object(socket.gethostname())
        what = (f"the training was not finite at step {nonfinite_step} on "
                + ", ".join(f"rank {rank} ({hosts[rank]})" for rank in ranks))
        if self.nonfinite == "rollback" and len(run.progress.rollbacks) < self.max_rollbacks:
            if self._roll_back(nonfinite_step, ranks, what):
                return False
        self._stop_diverged(nonfinite_step, ranks, [hosts[rank] for rank in ranks], what)

    def _state_finite(self) -> bool:
        run = self.run
        states: list[Any] = [run.model.state_dict(), *(obj.state_dict() for obj in run.extra_state.values())]
        if run.optimizer is not None:
            states.append(list(run.optimizer.state.values()))
        return all_finite(*states)

    def _roll_back(self, nonfinite_step: int, ranks: list[int], what: str) -> bool:
        """Back to the newest valid checkpoint (all of it), past the micro-batches of the steps up to
        ``nonfinite_step``, with the LR times ``rollback_lr_factor``; checkpointed at once. False
        when there is no checkpoint."""
        run = self.run
        detected_at, kept = run.progress.step, replace(run.progress)  # the restore overwrites the counters
        seconds = kept.train_seconds + run.segment_seconds()
        loaded = run.reload_latest()
        if loaded is None:
            return False
        progress = run.progress
        back_to = progress.step
        run.plan.skip(nonfinite_step - back_to)
        scale_learning_rate(run.optimizer, run.scheduler, self.rollback_lr_factor)
        record = {"nonfinite_step": nonfinite_step, "ranks": ranks, "detected_at_step": detected_at,
                  "back_to_step": back_to, "checkpoint": loaded.path.name, "skipped_steps": nonfinite_step - back_to,
                  "lr_factor": self.rollback_lr_factor}
        progress.rollbacks = [*kept.rollbacks, record]
        progress.out_of_memory = kept.out_of_memory  # the micro-batch in use stays: it is what fits here
        progress.micro_batch_size, progress.micro_batch_found_on = kept.micro_batch_size, kept.micro_batch_found_on
        progress.resumes, progress.train_seconds = kept.resumes, seconds
        run.restart_clock()
        run.telemetry.start_window()
        self.watch.reset()
        run.console(f"rollback {len(progress.rollbacks)} of at most {self.max_rollbacks}: {what}; back to step "
                    f"{back_to} ({loaded.path.name}), skipping the batches of steps {back_to + 1}-{nonfinite_step}"
                    + (f", lr x{self.rollback_lr_factor:g}" if self.rollback_lr_factor != 1.0 else ""))
        run.save()
        return True

    def _stop_diverged(self, nonfinite_step: int, ranks: list[int], hosts: list[str], what: str) -> None:
        """Stop every rank: the newest (finite) checkpoint stays the latest, the summary says where
        the run diverged, and :class:`~common.errors.Diverged` ends it with ``EXIT_DIVERGED``."""
        run = self.run
        run.progress.train_seconds += run.segment_seconds()
        run.checkpoints.wait()
        last = distributed.broadcast_object(latest_checkpoint(run.checkpoints.directory)
                                            if run.dist_info.is_main else None)
        if last is None:
            kept = "no checkpoint was written before it"
        else:
            kept = f"the last finite checkpoint, {last.path} (step {last.step}), stays the latest"
        rollbacks = run.progress.rollbacks
        after = f" after {len(rollbacks)} rollback(s)" if rollbacks else ""
        message = (f"the run diverged{after}: {what}; {kept}. Lower optim.lr"
                   + ("" if self.nonfinite == "rollback" else " or let it roll back (trainer.nonfinite=rollback)")
                   + f"; exiting with code {EXIT_DIVERGED}")
        if run.dist_info.is_main:
            diverged = {"step": nonfinite_step, "ranks": ranks, "hosts": hosts,
                        "checkpoint": last.path.name if last is not None else None}
            write_summary(run.run_dir, recipe=run.recipe, metrics=last.metrics if last is not None else {},
                          progress=run.progress, world_size=run.dist_info.world_size, model_digest=None,
                          diverged=diverged, **({"rollbacks": rollbacks} if rollbacks else {}))
        run.logger.close()
        run.cadence.close()
        raise Diverged(message, agreed=True)
