"""How long a segment's start-up took, phase by phase, from the process's start to its first step done.

A recipe's ``train()`` starts the clock with :func:`begin` (ending the process's imports and config) and
ends each of its own phases with :func:`done`; its ``TrainingRun`` takes the record (:func:`claim`), ends
``resume`` and ``first_step`` (:func:`end`) and puts it in the first training log, one console line and
``summary.json``.

- A phase is the time since the previous one ended: the phases add up to the time from the process's
  start to the end of its first step, with nothing counted twice or left out.
- One segment per process: each start and resume records its own (a later :func:`begin` starts afresh).
- Host clock only, and no wait for the device (``make gpu-check`` allows no host sync in a step): the
  first step ends when the host is done with it. Autotuning and compilation run on the host and are in
  it; on a GPU, kernels it queued and the device has not yet run fall into the next step.
"""

from __future__ import annotations

import os
import time

IMPORTS_CONFIG = "imports_config"  # from the process's start to train(): imports, config, process group, run lock
DATA = "data"  # file lists or shards, datasets, the evaluation's data
MODEL = "model"  # the model, its weights, wrappers (DDP, FSDP2, compile), optimizer and schedule
RESUME = "resume"  # the run contract: the newest checkpoint loaded, or init_from's weights; provenance
DECODE_CHOICE = "decode_choice"  # data.decode=auto's measurement (recipes that decode images)
FIRST_STEP = "first_step"  # the loader's first batches and the first step: autotuning, compilation, FLOP count

_IMPORTED = time.monotonic()  # the process's start where the system does not say when it was (not Linux)


def process_start() -> float:
    """When this process started, on ``time.monotonic()``'s clock (Linux: from ``/proc``, to the clock tick;
    elsewhere: when this module was imported)."""
    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED
    return time.monotonic() - age


class StartUp:
    """The phases of one segment's start-up so far: ``phases`` maps each name to its seconds, in order."""

    def __init__(self) -> None:
        self.claimed = False  # by the segment's TrainingRun
        self._phase_start = process_start()
        self.phases: dict[str, float] = {}

    def done(self, phase: str) -> None:
        """``phase`` ends now: it took the time since the previous phase ended (added, if it ran before)."""
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + max(now - self._phase_start, 0.0)
        self._phase_start = now

    def line(self) -> str:
        """The phases as one console line."""
        return (f"start-up {sum(self.phases.values()):.1f} s: "
                + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items()))


_current: StartUp | None = None


def begin() -> None:
    """Start timing this segment's start-up: the process's imports and config end now."""
    global _current
    _current = StartUp()
    _current.done(IMPORTS_CONFIG)


def done(phase: str) -> None:
    """``phase`` of this segment's start-up ends now (nothing when no start-up is being timed)."""
    if _current is not None:
        _current.done(phase)


def claim() -> StartUp | None:
    """The start-up being timed, for the run of its segment; None when none is, or a run has it already (a
    run in the same process after one that stopped before its first step)."""
    if _current is None or _current.claimed:
        return None
    _current.claimed = True
    return _current


def end(record: StartUp, phase: str | None = None) -> None:
    """End the start-up ``record`` (with ``phase``, when given): later phases mark nothing."""
    global _current
    if phase is not None:
        record.done(phase)
    if _current is record:
        _current = None
