"""When to evaluate, when to save and when to stop: the cadences, the same decision on every rank.

- :class:`StopSignals`: SIGTERM/SIGUSR1 (and a launcher's SIGUSR2) recorded, not fatal.
- :class:`CheckpointCadence`: after each step, save and/or stop; the ranks agree every
  ``checkpoint.sync_every_steps`` steps with one tiny all-gather of a host tensor over gloo.
- :class:`EvaluationCadence`: ``trainer.eval_every_epochs`` or ``trainer.eval_every_steps``; it
  follows from the step and the epoch alone, so the ranks agree and a resumed run evaluates at the
  steps an uninterrupted one does.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config import CheckpointConfig, TrainerConfig
from common.errors import Preempted, UserError
from common.pytorch import distributed
from common.records import heartbeat

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Taken over only when some Python code already handles it (submitit's requeue signal by default).
_LAUNCHER_SIGNALS = (signal.SIGUSR2,)

NONE = -1  # a rank's first non-finite step while every step so far was finite (common/run/divergence.py)


class StopSignals:
    """Records the first stop signal instead of dying, so the step can finish and be checkpointed.

    - Installs handlers for SIGTERM, SIGUSR1 and, where Python code already handles it, SIGUSR2.
    - A launcher's displaced handler (submitit's requeue, which raises ``SystemExit``) is called
      by :meth:`hand_over`, once the checkpoint is written.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._received: int | None = None
        self._previous = {}
        claimed = [signum for signum in _LAUNCHER_SIGNALS if callable(signal.getsignal(signum))]
        for signum in (*STOP_SIGNALS, *claimed):
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self._received is None:
            self._received = signum
        self.signal_name = signal.Signals(signum).name

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def hand_over(self) -> None:
        """Call the Python handler the first signal displaced, if any (after the checkpoint)."""
        previous = self._previous.get(self._received) if self._received is not None else None
        if callable(previous):
            previous(self._received, None)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _host_group() -> dist.ProcessGroup | None:
    """A group that all-reduces host tensors: the default one when it has gloo, else a gloo group
    made for it. Collective."""
    if "gloo" in dist.get_backend():
        return None
    return distributed.gloo_group()


@dataclass(frozen=True)
class Decision:
    save: bool
    stop: bool
    nonfinite_step: int = NONE  # the first step some rank knows to be non-finite (NONE: none)
    nonfinite_ranks: tuple[int, ...] = ()
    micro_batches: tuple[int, ...] = ()  # each rank's micro-batch (trainer.out_of_memory=halve), where they agreed


class CheckpointCadence:
    """After each optimizer step: whether to save and whether to stop, the same on every rank.

    - ``checkpoint``: its ``every_steps``, ``every_seconds`` and ``sync_every_steps``.
    - The step cadence agrees by construction; the wall clock, signals, non-finite steps and
      micro-batch sizes are gathered every ``sync_every_steps`` steps (a host tensor over gloo:
      it never waits for the GPU's queue).
    """

    def __init__(self, checkpoint: CheckpointConfig, stop_signals: StopSignals) -> None:
        self.every_steps = checkpoint.every_steps
        self.every_seconds = checkpoint.every_seconds
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.sync_every_steps = max(1, checkpoint.sync_every_steps) if self.distributed else 1
        self.group = _host_group() if self.distributed else None
        self.stop_signals = stop_signals
        self.last_save = time.monotonic()

    def preempted(self, step: int) -> Preempted:
        """The exception raised once the checkpoint for a stop decision is written (a displaced
        launcher handler is called first: submitit requeues and exits there)."""
        self.stop_signals.hand_over()
        received = self.stop_signals.signal_name or "a stop signal on another rank"
        return Preempted(f"received {received}: checkpoint saved at step {step}")

    def close(self) -> None:
        """Give the signals back to the handlers they had before."""
        self.stop_signals.restore()

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def after_step(self, step: int, nonfinite: Callable[[], int], micro_batch: int) -> Decision:
        """The decision after ``step``.

        - ``nonfinite()``: the first non-finite step this rank knows of (NONE: none), read only
          where the ranks agree.
        - ``micro_batch``: the micro-batch this rank uses, compared there too.
        """
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        if step % self.sync_every_steps != 0:
            return Decision(save=by_steps, stop=False)
        due = self.every_seconds > 0 and time.monotonic() - self.last_save >= self.every_seconds
        stop = self.stop_signals.raised
        rows = [[float(due), float(stop), float(nonfinite()), float(micro_batch)]]
        if self.distributed:
            mine = torch.tensor(rows[0], dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            with heartbeat.phase(heartbeat.CADENCE):
                dist.all_gather(gathered, mine, group=self.group)
            rows = [row.tolist() for row in gathered]
        due, stop = any(row[0] > 0 for row in rows), any(row[1] > 0 for row in rows)
        bad = {rank: int(row[2]) for rank, row in enumerate(rows) if row[2] != NONE}
        return Decision(save=by_steps or due or stop, stop=stop, nonfinite_step=min(bad.values(), default=NONE),
                        nonfinite_ranks=tuple(sorted(bad)), micro_batches=tuple(int(row[3]) for row in rows))


class EvaluationCadence:
    """When the run evaluates (and saves the evaluation's checkpoint): at the end of every
    ``trainer.eval_every_epochs``-th epoch, or, with ``trainer.eval_every_steps`` above 0, after every
    ``eval_every_steps``-th optimizer step, mid-epoch included (an ImageNet epoch of 5,000 steps, a
    run of one epoch). The finish always evaluates.

    - Raises :class:`UserError` for a negative ``eval_every_steps``, an ``eval_every_epochs`` below 1, or for
      both set (which would leave one unused).
    """

    def __init__(self, trainer: TrainerConfig) -> None:
        self.every_epochs, self.every_steps = trainer.eval_every_epochs, trainer.eval_every_steps
        if self.every_steps < 0:
            raise UserError(f"trainer.eval_every_steps={self.every_steps} is negative: set the optimizer steps "
                            f"between evaluations, or 0 to evaluate every trainer.eval_every_epochs epochs")
        if self.every_epochs < 1:
            raise UserError(f"trainer.eval_every_epochs={self.every_epochs} is below 1: set the epochs between "
                            f"evaluations (1: every epoch), or trainer.eval_every_steps for evaluations by step")
        if self.every_steps and self.every_epochs != 1:
            raise UserError(f"trainer.eval_every_steps={self.every_steps} and trainer.eval_every_epochs="
                            f"{self.every_epochs} are both set: keep one (eval_every_steps=0 evaluates by epochs)")

    @property
    def by_steps(self) -> bool:
        return self.every_steps > 0

    def mid_epoch(self, step: int) -> bool:
        """Whether an evaluation follows ``step``, a step that does not end its epoch."""
        return self.by_steps and step % self.every_steps == 0

    def at_epoch_end(self, epoch: int, step: int) -> bool:
        """Whether an evaluation follows the end of the ``epoch``-th epoch, at optimizer step ``step``."""
        return self.mid_epoch(step) if self.by_steps else epoch % self.every_epochs == 0
