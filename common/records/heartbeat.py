"""Where every rank is, and a hang that says where: heartbeats, stacks and one line.

- Every rank keeps ``<run_dir>/heartbeat/rank<N>.json`` (host, pid, last step, phase, since when),
  rewritten by a background thread; marking a phase costs one attribute write.
- A collective that waits longer than ``trainer.collective_timeout_s`` stops the run as hung: ranks
  append their stacks under ``hang/``, rank 0 prints :func:`hang_line` and every rank exits with
  :data:`~common.errors.EXIT_HUNG` without tearing down the broken process group.
- The whole sequence, NCCL's flight recorder and the launcher's part: docs/run-contract.md, "Heartbeats, hangs and
  compiled code".
"""

from __future__ import annotations

import contextlib
import datetime as dt
import faulthandler
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from common.errors import EXIT_HUNG

HEARTBEAT_DIR = "heartbeat"
HANG_DIR = "hang"
_DECLARED_FILE = "declared.json"
REPORT_FILE = "report.txt"

# Phases, as the heartbeat names them.
_START_UP = "start-up"
DATA = "data"
FORWARD_BACKWARD = "forward/backward"  # with DDP's all-reduce of the gradients
OPTIMIZER = "optimizer step"
AFTER_STEP = "after the step"  # the recipe's logging (a metric all-reduce every trainer.log_every_steps)
CADENCE = "checkpoint cadence (all_gather)"
FINITE_CHECK = "finite check (all_gather)"
OUT_OF_MEMORY = "out-of-memory check (all_gather)"  # trainer.out_of_memory=halve: did every rank run out here?
SAVE = "checkpoint save"
LOAD = "checkpoint load"
EVALUATION = "evaluation"

# How a rank took part in a hang (its heartbeat's "hang").
WAITED = "waited"  # its collective failed: it arrived
STOPPED = "stopped"  # it saw another rank declare the hang while it was elsewhere

_SETTLE_S = 60.0  # the longest rank 0 waits for every rank to say how it took part
_TIMEOUT_PATTERN = re.compile(r"timed? ?out", re.IGNORECASE)

_current: Heartbeat | None = None


def enter(phase: str) -> None:
    """This rank is now in ``phase`` (nothing without a heartbeat)."""
    if _current is not None:
        _current.enter(phase)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """In ``name`` for the block, then back in the phase before it."""
    beat = _current
    if beat is None:
        yield
        return
    before = beat.where[0]
    beat.enter(name)
    try:
        yield
    finally:
        beat.enter(before)


def at_step(step: int) -> None:
    """This rank's last finished optimizer step is ``step``."""
    if _current is not None:
        _current.step = step


def is_timeout(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is a collective's timeout."""
    while error is not None:
        if isinstance(error, RuntimeError) and _TIMEOUT_PATTERN.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def read_heartbeats(run_dir: str | Path, world_size: int | None = None) -> list[dict[str, Any] | None]:
    """Each rank's heartbeat record, None where missing or unreadable.

    ``world_size``: how many ranks to read; by default the largest world size the records found state."""
    folder = Path(run_dir) / HEARTBEAT_DIR

    def read(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    if world_size is None:
        found = [beat for beat in map(read, folder.glob("rank*.json")) if beat is not None]
        world_size = max((beat["world_size"] for beat in found), default=0)
    return [read(folder / f"rank{rank}.json") for rank in range(world_size)]


def clear(run_dir: str | Path) -> None:
    """Forget an earlier launch's heartbeats, hang declaration and report; stacks stay (a new hang appends).

    Rank 0 calls it, holding the run's lock, before any rank of this launch starts its heartbeat."""
    for path in (Path(run_dir) / HEARTBEAT_DIR).glob("rank*.json"):
        path.unlink(missing_ok=True)
    for name in (_DECLARED_FILE, REPORT_FILE):
        (Path(run_dir) / HANG_DIR / name).unlink(missing_ok=True)


def launcher_hang_line(run_dir: str | Path) -> str:
    """:func:`hang_line` from the heartbeat files alone, for a launcher whose rank 0 could not say it."""
    beats = read_heartbeats(run_dir)
    timeout_s = next((beat["timeout_s"] for beat in beats if beat is not None), float("nan"))
    return hang_line(beats, timeout_s, run_dir)


def hang_line(beats: list[dict[str, Any] | None], timeout_s: float, run_dir: str | Path,
              now: float | None = None) -> str:
    """The one line a hang is reported with: each rank that did not arrive, its host, pid, phase and step.

    "silent for N s" is judged by this host's clock: the hosts' clocks must agree to a few seconds.
    """
    now = time.time() if now is None else now
    missing = []
    for rank, beat in enumerate(beats):
        if beat is not None and beat.get("hang") == WAITED:
            continue
        if beat is None:
            missing.append(f"rank {rank} (no heartbeat)")
            continue
        silent = now - beat["time"]
        dead = f", silent for {silent:.0f} s (process gone or frozen)" if silent > 3 * beat["interval_s"] + 5 else ""
        missing.append(f"rank {rank} on {beat['host']} (pid {beat['pid']}), last in {beat['phase']} after step "
                       f"{beat['step']} for {beat['time'] - beat['phase_since']:.0f} s{dead}")
    head = f"hang: a collective waited more than {timeout_s:g} s (trainer.collective_timeout_s)"
    if not beats:
        what = "no rank left a heartbeat"
    elif missing:
        what = f"did not arrive: {'; '.join(missing)}"
    else:
        phases = ", ".join(f"rank {rank} in {beat['phase']} after step {beat['step']}"
                           for rank, beat in enumerate(beats))
        what = f"every rank waited, in different collectives ({phases})"
    return (f"{head}; {what}. Stacks: {Path(run_dir) / HANG_DIR}/, heartbeats: {Path(run_dir) / HEARTBEAT_DIR}/; "
            f"exiting with code {EXIT_HUNG}")


class Heartbeat:
    """One rank's heartbeat file and, in a run of several ranks, its part in a hang (see the module)."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int, timeout_s: float,
                 end_process: Callable[[], NoReturn]) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.end_process = end_process
        self.interval_s = min(10.0, max(0.5, timeout_s / 10))
        self.host = socket.gethostname()
        self.step = 0
        self.where = (_START_UP, time.time())  # (phase, since): one tuple, so the thread reads a consistent pair
        self.hang: str | None = None
        self.file = self.run_dir / HEARTBEAT_DIR / f"rank{rank}.json"
        self.hang_dir = self.run_dir / HANG_DIR
        self._stuck_since_reported: float | None = None
        self._stopped = threading.Event()
        self._handling = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def enter(self, phase: str) -> None:
        self.where = (phase, time.time())

    def start(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def write(self) -> None:
        """Replace the heartbeat file whole (a reader never sees half of it); a failed write is skipped."""
        phase, since = self.where
        record = {"rank": self.rank, "world_size": self.world_size, "host": self.host, "pid": os.getpid(),
                  "step": self.step, "phase": phase, "phase_since": since, "time": time.time(),
                  "interval_s": self.interval_s, "timeout_s": self.timeout_s, "hang": self.hang}
        temporary = self.file.with_name(f".{self.file.name}.tmp")
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(record))
            os.replace(temporary, self.file)

    def _beat(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.write()
            if not self.distributed:
                continue
            phase, since = self.where
            stuck_s = time.time() - since
            if (self.hang_dir / _DECLARED_FILE).exists() and stuck_s > self.timeout_s + self.interval_s:
                self.hung(STOPPED)
            if stuck_s > self.timeout_s and self._stuck_since_reported != since:
                self._stuck_since_reported = since
                self.dump_stacks(f"in {phase} for more than {self.timeout_s:g} s")

    def dump_stacks(self, why: str, error: BaseException | None = None) -> Path:
        """Append every thread's Python stack (and ``error``'s traceback) to ``hang/rank<N>-stacks.txt``."""
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        path = self.hang_dir / f"rank{self.rank}-stacks.txt"
        phase, _ = self.where
        with open(path, "a") as out:
            out.write(f"--- rank {self.rank} on {self.host} (pid {os.getpid()}), "
                      f"{dt.datetime.now().astimezone().isoformat(timespec='seconds')}: {why}; "
                      f"in {phase} after step {self.step}\n")
            if error is not None:
                out.write("where the collective failed:\n" + "".join(traceback.format_exception(error)))
            out.write("every thread now:\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        return path

    def hung(self, how: str, error: BaseException | None = None) -> NoReturn:
        """Take part in a hang (``how``: :data:`WAITED` or :data:`STOPPED`) and end the process.

        Once per process: a second caller (the other thread) blocks until the first ends it."""
        if not self._handling.acquire(blocking=False):
            threading.Event().wait()
        self.hang = how
        if how == WAITED:
            self.dump_stacks(f"a collective failed: {str(error).splitlines()[0] if error else ''}", error)
            self.write()
            self._declare()
        else:
            self.dump_stacks("stopped: another rank declared a hang")
            self.write()
        if self.rank == 0:
            line = hang_line(self._settle(), self.timeout_s, self.run_dir)
            print(f"error: {line}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                (self.hang_dir / REPORT_FILE).write_text(line + "\n")
        self.end_process()

    def _declare(self) -> None:
        record = {"rank": self.rank, "host": self.host, "time": time.time()}
        with contextlib.suppress(FileExistsError, OSError), open(self.hang_dir / _DECLARED_FILE, "x") as out:
            out.write(json.dumps(record))

    def _settle(self) -> list[dict[str, Any] | None]:
        """The heartbeats once every rank has said how it took part, or at the deadline (a frozen rank never says)."""
        deadline = time.monotonic() + min(self.timeout_s, _SETTLE_S) + 2 * self.interval_s
        while True:
            beats = read_heartbeats(self.run_dir, self.world_size)
            if all(beat is not None and beat.get("hang") for beat in beats) or time.monotonic() > deadline:
                return beats
            time.sleep(min(0.5, self.interval_s))


@contextlib.contextmanager
def beating(run_dir: str | Path, rank: int, world_size: int, timeout_s: float,
            end_process: Callable[[], NoReturn]) -> Iterator[Heartbeat]:
    """This rank's :class:`Heartbeat` for the block.

    Ends the process as a hang on a collective's timeout raised in the block, or on any error once a hang is
    declared (the broken group fails the other ranks' collectives too)."""
    global _current
    beat = Heartbeat(run_dir, rank, world_size, timeout_s, end_process)
    beat.start()
    _current = beat
    try:
        yield beat
    except Exception as error:
        if beat.distributed and (is_timeout(error) or (beat.hang_dir / _DECLARED_FILE).exists()):
            beat.hung(WAITED, error)
        raise
    finally:
        _current = None
        beat.stop()
