"""One run directory, one run: a lock file that a second launch on the same run respects.

- Rank 0 takes ``.run.lock`` in the run directory (and in ``checkpoint.dir``) before anything reads
  a checkpoint; a second launch names the holder in one line and exits 2, having touched nothing.
- A file created with ``O_EXCL`` and touched every :data:`HEARTBEAT_S` seconds; not ``flock``, which
  is unreliable or node-local on NFS and Lustre.
- A holder that is gone is taken over (:func:`stale_reason` says when) under a short-lived
  ``.run.lock.break`` file, so two launches cannot both take it; a holder whose lock was taken over
  exits 2 at once.
- docs/run-contract.md, "One run directory, one run".
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from common.checkpoint.layout import ARTIFACT_PATH_VARIABLE
from common.errors import EXIT_USER_ERROR

LOCK_FILE = ".run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # a lock on another host whose heartbeat is this old is taken over
_BREAKER_STALE_S = 60.0  # a .run.lock.break this old was left by a launch that died while taking over


def _boot_id() -> str:
    """This boot of this machine (Linux); two containers with one host name on two machines differ here."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """When ``pid`` started, in clock ticks since boot (Linux), to tell a reused pid from its holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def slurm_job() -> str | None:
    """This process's SLURM job as ``scontrol requeue`` names it: ``<array job>_<task>`` in an array."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID") or None


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: written into the lock file when it is taken."""

    host: str
    boot_id: str
    pid: int
    pid_start: str
    slurm_job: str | None
    isc_artifacts: str | None  # CHECKPOINT_ARTIFACT_PATH when it ran on the ISC
    since: str  # ISO 8601, UTC

    @classmethod
    def this_process(cls) -> Holder:
        pid = os.getpid()
        return cls(host=socket.gethostname(), boot_id=_boot_id(), pid=pid, pid_start=_process_start(pid),
                   slurm_job=slurm_job(), isc_artifacts=os.environ.get(ARTIFACT_PATH_VARIABLE) or None,
                   since=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def describe(self) -> str:
        parts = [f"host {self.host}", f"pid {self.pid}"]
        if self.slurm_job:
            parts.append(f"SLURM job {self.slurm_job}")
        if self.isc_artifacts:
            parts.append(f"ISC experiment with artifacts at {self.isc_artifacts}")
        return ", ".join(parts) + f", since {self.since}"

    def same_process(self, other: Holder) -> bool:
        return (self.host, self.boot_id, self.pid, self.pid_start) == (other.host, other.boot_id, other.pid,
                                                                       other.pid_start)


def _read(path: Path) -> Holder | None:
    """The holder a lock file names; None if it is gone or not (yet) readable."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_exclusive(path: Path, holder: Holder) -> bool:
    """Create ``path`` naming ``holder`` if no such file exists; False if one does."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(asdict(holder)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return True


def stale_reason(holder: Holder, me: Holder, heartbeat_age: float) -> str | None:
    """Why ``holder``'s lock may be taken over by ``me``, in words; None while it is held.

    - The same SLURM job (a requeue; an array task is ``<array job>_<task>``) or ISC experiment
      (its cycles never overlap).
    - On this host, since its last boot: the holder's process is gone (its pid gone, or reused by another process).
    - On another host: ``heartbeat_age`` over :data:`STALE_AFTER_S` (the hosts' clocks must agree to
      within minutes, as NTP keeps them).
    """
    if me.slurm_job and holder.slurm_job == me.slurm_job:
        return f"it is this SLURM job's ({me.slurm_job}), from before it was requeued"
    if me.isc_artifacts and holder.isc_artifacts:
        return "it is this ISC experiment's, from an earlier cycle"
    if holder.host == me.host and holder.boot_id == me.boot_id:
        if not _pid_alive(holder.pid):
            return f"its process {holder.pid} is gone"
        if holder.pid_start and _process_start(holder.pid) != holder.pid_start:
            return f"its process {holder.pid} is gone (the pid now belongs to another process)"
        return None
    if heartbeat_age > STALE_AFTER_S:
        return f"its heartbeat stopped {heartbeat_age:.0f} s ago (stale after {STALE_AFTER_S:.0f} s)"
    return None


class RunLockHeld(Exception):
    """Another launch holds the lock; the message names it."""


class RunLock:
    """The lock of one folder (see the module): :meth:`acquire`, then :meth:`release`.

    - ``log``: where a takeover of a stale lock is reported (one line).
    """

    def __init__(self, folder: str | Path, log: Callable[[str], None]) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.log = log
        self.holder = Holder.this_process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._made_folder = False

    def acquire(self) -> None:
        """Take the lock, taking over a stale one (:func:`stale_reason`), and start its heartbeat.

        - Raises :class:`RunLockHeld` naming the holder when another launch holds it.
        - Creates the folder if it is missing.
        """
        self._made_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # each round either ends or saw the lock change hands
            if _write_exclusive(self.path, self.holder):
                return self._start_heartbeat()
            holder = _read(self.path)
            if holder is None:  # removed, or being written, since: look again
                time.sleep(0.05)
                continue
            if holder.same_process(self.holder):  # taken by this very process before
                return self._start_heartbeat()
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                continue
            reason = stale_reason(holder, self.holder, age)
            if reason is None:
                raise RunLockHeld(
                    f"{self.folder} is in use by another launch of this run ({holder.describe()}; last heartbeat "
                    f"{age:.0f} s ago): wait for it to end, or give this run another name= or run_dir= "
                    f"(if that launch is gone, delete {self.path}; see docs/run-contract.md, "
                    "'One run directory, one run')")
            if self._take_over(holder):
                self.log(f"took over the lock of {self.folder} from {holder.describe()}: {reason}")
                return self._start_heartbeat()
        raise RunLockHeld(f"could not take the lock {self.path}: it keeps changing hands")

    def _take_over(self, stale: Holder) -> bool:
        """Replace the lock naming ``stale`` by ours, under the breaker file; False if it changed meanwhile."""
        breaker = self.path.with_name(LOCK_FILE + ".break")
        with contextlib.suppress(FileNotFoundError):
            if time.time() - breaker.stat().st_mtime > _BREAKER_STALE_S:
                breaker.unlink()
        if not _write_exclusive(breaker, self.holder):
            time.sleep(0.1)
            return False
        try:
            if _read(self.path) != stale:
                return False
            tmp = self.path.with_name(f"{LOCK_FILE}.{self.holder.pid}.tmp")
            tmp.unlink(missing_ok=True)
            _write_exclusive(tmp, self.holder)
            os.replace(tmp, self.path)
            return True
        finally:
            breaker.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if _read(self.path) != self.holder:
                holder = _read(self.path)
                print(f"error: the lock of {self.folder} was taken over by "
                      f"{holder.describe() if holder else 'another launch'}; this process stops now, "
                      f"writing nothing more", file=sys.stderr, flush=True)
                os._exit(EXIT_USER_ERROR)
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file, if it still names this process.

        - Also removes the folder if :meth:`acquire` made it and it is still empty (a run that
          stopped at once).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if _read(self.path) == self.holder:
            self.path.unlink(missing_ok=True)
            if self._made_folder:
                with contextlib.suppress(OSError):  # not empty: the run wrote there
                    self.folder.rmdir()


@contextlib.contextmanager
def run_locks(folders: list[str | Path], log: Callable[[str], None]) -> Iterator[None]:
    """Hold the locks of ``folders``: the run directory, and ``checkpoint.dir`` when it is elsewhere.

    - Raises :class:`RunLockHeld` for the first one held by another launch; those taken are released.
    """
    held: list[RunLock] = []
    try:
        for folder in dict.fromkeys(os.path.abspath(folder) for folder in folders):
            lock = RunLock(folder, log)
            lock.acquire()
            held.append(lock)
        yield
    finally:
        for lock in reversed(held):
            lock.release()
