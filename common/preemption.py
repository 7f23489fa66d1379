"""When to checkpoint and when to stop: by steps, by wall clock, and on SIGTERM/SIGUSR1.

SLURM sends SIGUSR1 (``--signal``) or SIGTERM before pre-emption or the time limit; the ISC
and Kubernetes send SIGTERM. The handler only sets a flag; the training loop finishes its
step, writes a checkpoint and exits with :data:`common.errors.EXIT_PREEMPTED`.

A launcher running in this process may have its own handler for such a signal: submitit (the
Hydra SLURM launcher) requeues the job on SIGUSR2 and raises ``SystemExit`` wherever the
program happens to be, for instance inside ``torch.save``, which turns it into a failed save
and a failed job. Such a handler is displaced too, and handed the signal once the checkpoint
is written (:meth:`StopFlag.hand_over`): the job then requeues from a complete checkpoint.

Every rank must take the same decision at the same step, or a collective would hang. Step
cadence is the same everywhere by construction; the wall clock and signals are local, so
every ``sync_every_steps`` steps the ranks agree with one tiny all-reduce (MAX) of a host
tensor over gloo: on a GPU it waits for the other ranks' processes, never for the GPU's queue
of work (an nccl all-reduce read back on the host would drain it). A single process checks
every step at no cost.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.errors import Preempted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Taken over only when some Python code already handles it (submitit's requeue signal by default).
LAUNCHER_SIGNALS = (signal.SIGUSR2,)


@dataclass(frozen=True)
class Decision:
    save: bool
    stop: bool


class StopFlag:
    """Records the first SIGTERM/SIGUSR1 (or a launcher's signal) instead of dying, so the step
    can finish and be checkpointed."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._received: int | None = None
        self._previous = {}
        claimed = [signum for signum in LAUNCHER_SIGNALS if callable(signal.getsignal(signum))]
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
        """Call the Python handler the first signal displaced, if any (submitit's requeue, which
        exits). For after the checkpoint: nothing of the run is lost whatever that handler does."""
        previous = self._previous.get(self._received) if self._received is not None else None
        if callable(previous):
            previous(self._received, None)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def host_group() -> dist.ProcessGroup | None:
    """A group that all-reduces host tensors: the default one when it has gloo (a CPU run, or
    ``cpu:gloo,cuda:nccl``), else a gloo group made for it. Collective: every rank calls it."""
    if "gloo" in dist.get_backend():
        return None
    return dist.new_group(backend="gloo")


class CheckpointCadence:
    """Decides after each optimizer step whether to save and whether to stop."""

    def __init__(
        self,
        every_steps: int,
        every_seconds: float,
        sync_every_steps: int,
        stop_flag: StopFlag,
    ) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.sync_every_steps = max(1, sync_every_steps) if self.distributed else 1
        self.group = host_group() if self.distributed else None
        self.stop_flag = stop_flag
        self.last_save = time.monotonic()

    @classmethod
    def from_config(cls, cfg: Any) -> CheckpointCadence:
        """From a recipe's ``checkpoint`` node; installs the SIGTERM/SIGUSR1 handlers."""
        return cls(cfg.every_steps, cfg.every_seconds, cfg.sync_every_steps, StopFlag())

    def preempted(self, step: int) -> Preempted:
        """The exception a recipe raises once the checkpoint for a stop decision is written. A
        launcher's handler the signal displaced gets it first (submitit requeues and exits there)."""
        self.stop_flag.hand_over()
        received = self.stop_flag.signal_name or "a stop signal on another rank"
        return Preempted(f"received {received}: checkpoint saved at step {step}")

    def close(self) -> None:
        """Give the signals back to the handlers they had before."""
        self.stop_flag.restore()

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def after_step(self, step: int) -> Decision:
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        if step % self.sync_every_steps != 0:
            return Decision(save=by_steps, stop=False)
        due = self.every_seconds > 0 and time.monotonic() - self.last_save >= self.every_seconds
        stop = self.stop_flag.raised
        if self.distributed:
            flags = torch.tensor([float(due), float(stop)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            due, stop = (value > 0 for value in flags.tolist())
        return Decision(save=by_steps or due or stop, stop=stop)
