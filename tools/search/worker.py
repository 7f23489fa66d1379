"""A search worker: take the next trial, run it as an ordinary run of the recipe, record how it
ended, and again, until the study has the number of finished trials it was asked for.

**Resume, not restart.** A trial is one Optuna trial number, one run directory
(``<study>/trial_<n>/``) and one claim (``<study>/claims/trial_<n>/.run.lock``), held by the worker
that runs it from the moment it takes the trial until it records the result. The claim is the
run contract's own lock file (``common/run_lock.py``): created with ``O_EXCL``, heart-beating, and
taken over when its holder is gone by the same rules as a run directory's (on the same host when
its process no longer exists; at once when it is the same SLURM job, requeued, or an earlier
cycle of the same ISC experiment; from another host once its heartbeat is 5 minutes old).

A trial interrupted in any way stays RUNNING in the study with its parameters:

* a worker stopped by SIGTERM or SIGUSR1 forwards the signal to the trial's run, which finishes
  its step, checkpoints and exits 75; the worker releases the claim and exits 75 itself (the
  sbatch file then requeues that array task);
* a worker SIGKILLed (with its run) leaves its claim behind, which the next worker takes over.

Before asking the study for a new trial, a worker looks for such a trial and takes its claim;
its run resumes from the trial's newest checkpoint, in the same run directory, as any restarted
run does. Only then does it ask for a new one, and only while the finished and running trials
are fewer than the target, so an interrupted trial is never replaced by a new one and never
counted twice: it is told to the study once, when it ends.

Taking a claim and asking for a trial happen under a study-wide queue lock (``claims/queue``,
the same kind of lock), so a trial that has just been asked for cannot be taken by another
worker before its asker holds its claim.

Why not Optuna's heartbeat (``heartbeat_interval``, ``fail_stale_trials``,
``RetryFailedTrialCallback``): it exists only for database storages, not for the journal file
this search uses by default, and what it does with a stale trial is mark it failed and enqueue a
copy under a new number, which starts the run again from scratch.

How a trial's run ended decides what the study records: exit 0, the objective from its
``summary.json`` (``pruned`` there: the trial is pruned); exit 2 (a user error) or 3 (it
diverged): failed, with the run's error line as the reason; any other exit: failed, with the exit
code. Exit 2 because another launch holds the trial's run directory is not a failure: the worker
leaves that trial to it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from common.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, UserError
from common.jsonfiles import dumps, write_json
from common.records.summary import SUMMARY_FILE
from common.run.cadence import STOP_SIGNALS
from common.run_lock import LOCK_FILE, RunLock, RunLockHeld
from tools.search.isc import belongs_to, clear_for, move_checkpoints, save_journal
from tools.search.results import write_study_json
from tools.search.study import Search

QUEUE = "queue"
TRIAL_RECORD = "trial.json"  # in a trial's run directory: which trial of which study it is
STDERR_KEPT = 8192  # bytes of a run's stderr kept for the reason a failed trial gives


def say(message: str) -> None:
    print(f"search: {message}", flush=True)


@dataclass
class Claim:
    """A trial this worker holds: its number, parameters and claim lock."""

    number: int
    params: dict[str, Any]
    lock: RunLock
    interrupted: bool  # started before and not finished: its run resumes


def trial_command(recipe: str, overrides: list[str], nproc: int) -> list[str]:
    """The command ``make train-<recipe> NPROC=<nproc>`` runs."""
    if nproc == 1:
        return [sys.executable, "-m", f"recipes.{recipe}.train", *overrides]
    return [sys.executable, "-m", "cluster.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "-m", f"recipes.{recipe}.train", *overrides]


def quoted(path: Path) -> str:
    """``path`` as a quoted Hydra override value (a comma or a space in it would break the override;
    :class:`Worker` refuses paths with a quote or a backslash)."""
    return f"'{path}'"


def free_name(path: Path) -> Path:
    """``<path>.replaced-<i>``, the first such name not taken: where a folder that is not this
    trial's is moved aside."""
    return next(path.with_name(f"{path.name}.replaced-{index}") for index in range(1, 1_000_000)
                if not path.with_name(f"{path.name}.replaced-{index}").exists())


def last_error_line(stderr: str, code: int) -> str:
    """Why a run failed: its last ``error:`` line (a user error, a divergence), else its last line."""
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors:
        return errors[-1]
    return f"the run exited with code {code}" + (f": {lines[-1]}" if lines else "")


class Worker:
    """One worker of a search (see the module): :meth:`run` until the study has ``target`` finished
    trials. ``artifacts``: the ISC's CHECKPOINT_ARTIFACT_PATH, where the running trial checkpoints
    and the journal is kept (``tools/search/isc.py``)."""

    def __init__(self, search: Search, target: int, nproc: int, artifacts: Path | None = None) -> None:
        self.search = search
        self.target = target
        self.nproc = nproc
        self.artifacts = artifacts
        for folder in (search.study_dir, artifacts):
            if folder is not None and ("'" in str(folder) or "\\" in str(folder)):
                raise UserError(f"{folder}: a folder whose path holds a quote or a backslash cannot be passed to a "
                                f"trial as a Hydra override; choose another")
        self.child: subprocess.Popen | None = None
        self.stop_signal: str | None = None
        self.elsewhere: set[int] = set()  # trials whose run directory another launch holds

    def run(self) -> int:
        """Run trials; 0 once none is left for this worker, 75 when stopped by a signal."""
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            while self.stop_signal is None:
                claim = self._next_trial()
                if claim is None:
                    return 0
                try:
                    self._run_trial(claim)
                finally:
                    claim.lock.release()
            say(f"stopped by {self.stop_signal}; exiting with code {EXIT_PREEMPTED} (run again to go on)")
            return EXIT_PREEMPTED
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = self.stop_signal or signal.Signals(signum).name
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    # ---- which trial next ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _queue(self) -> Iterator[None]:
        """The study-wide lock under which claims are taken and trials asked for (held briefly)."""
        lock = RunLock(self.search.claim_folder(QUEUE), log=say)
        while True:
            try:
                lock.acquire()
                break
            except RunLockHeld:
                time.sleep(0.1)
        try:
            yield
        finally:
            lock.release()

    def _claim(self, number: int) -> RunLock | None:
        """Trial ``number``'s claim, if no live worker holds it (a gone holder's is taken over)."""
        lock = RunLock(self.search.claim_folder(f"trial_{number}"), log=say)
        try:
            lock.acquire()
        except RunLockHeld:
            return None
        return lock

    def _next_trial(self) -> Claim | None:
        """An interrupted trial first, else a new one while the study needs more; None when neither."""
        with self._queue():
            trials = self.search.trials()
            finished = sum(trial.state.is_finished() for trial in trials)
            if finished >= self.target:
                say(f"the study has {finished} finished trials (asked for {self.target}): nothing more to run")
                return None
            running = [trial for trial in trials if trial.state == TrialState.RUNNING]
            for trial in running:
                if trial.number in self.elsewhere:
                    continue
                lock = self._claim(trial.number)
                if lock is not None:
                    return Claim(trial.number, dict(trial.params), lock, interrupted=True)
            if finished + len(running) >= self.target:
                numbers = ", ".join(str(trial.number) for trial in running)
                say(f"nothing left for this worker: trial(s) {numbers} run elsewhere, and with them the study "
                    f"reaches {self.target}")
                return None
            trial = self.search.study.ask({param.key: param.distribution() for param in self.search.settings.params})
            lock = self._claim(trial.number)
            if lock is None:
                raise RuntimeError(f"the claim of trial {trial.number}, just asked for, is held by another worker")
            self._keep_journal()
            return Claim(trial.number, dict(trial.params), lock, interrupted=False)

    # ---- one trial ----------------------------------------------------------------------------

    def _run_trial(self, claim: Claim) -> None:
        """Train the trial (or resume it) and record how it ended, unless it was stopped."""
        number, run_dir = claim.number, self.search.run_dir(claim.number)
        self._check_run_dir(claim, run_dir)
        if self.artifacts is not None:
            self._clear_artifacts(claim, run_dir)
        if self.stop_signal is not None:
            say(f"trial {number}: not started, stopped by {self.stop_signal} first; the next worker starts it")
            return
        params = ", ".join(f"{key}={value!r}" for key, value in claim.params.items())
        say(f"trial {number}: {'resuming' if claim.interrupted else 'starting'} in {run_dir} ({params})")
        code, stderr = self._train(claim, run_dir)
        if code == 0:
            self._record_finished(number, run_dir)
        elif code == EXIT_PREEMPTED or self.stop_signal is not None:
            self.stop_signal = self.stop_signal or "a stop signal sent to the trial's run"
            say(f"trial {number}: stopped after its checkpoint (exit {code}); it stays in the study, to be resumed "
                f"by the next worker")
        elif code == EXIT_USER_ERROR and any((folder / LOCK_FILE).exists()
                                             for folder in (run_dir, self._checkpoints(run_dir))):
            self.elsewhere.add(number)
            say(f"trial {number}: its run directory is in use by another launch; leaving the trial to it")
        else:
            self._record(number, TrialState.FAIL, reason=last_error_line(stderr, code))

    def _check_run_dir(self, claim: Claim, run_dir: Path) -> None:
        """Make sure ``run_dir`` is this trial's: a folder holding another run (a study whose journal
        lost this trial, a folder made by hand) is moved aside, never resumed with these parameters."""
        record = json.loads(dumps({"study": self.search.name, "trial": claim.number, "params": claim.params}))
        path = run_dir / TRIAL_RECORD
        if run_dir.is_dir() and any(run_dir.iterdir()):
            try:
                found = json.loads(path.read_text())
            except (OSError, ValueError):
                found = None
            if found == record:
                return
            aside = free_name(run_dir)
            run_dir.rename(aside)
            say(f"trial {claim.number}: {run_dir} held another run (its {TRIAL_RECORD} does not name this trial "
                f"and its parameters); moved it to {aside}")
        write_json(path, record)

    def _clear_artifacts(self, claim: Claim, run_dir: Path) -> None:
        """Move checkpoints of other trials out of the artifact path before this trial trains there
        (``tools/search/isc.py``): into the run directory of a trial the study recorded as ended,
        else aside."""
        ended = {self.search.run_dir(trial.number).name: trial for trial in self.search.trials()
                 if trial.state.is_finished()}
        asides: dict[str, Path] = {}

        def destination_of(config: dict[str, Any] | None) -> Path:
            owner = Path(str(config.get("run_dir"))).name if isinstance(config, dict) else "unknown"
            trial = ended.get(owner)
            if trial is not None and belongs_to(config, self.search.run_dir(trial.number), trial.params):
                return self.search.run_dir(trial.number) / "checkpoints"
            if owner not in asides:
                asides[owner] = free_name(self.search.study_dir / owner) / "checkpoints"
            return asides[owner]

        for line in clear_for(self.artifacts, run_dir, claim.params, destination_of):
            say(f"trial {claim.number}: moved {line}")

    def _keep_journal(self) -> None:
        """On the ISC, a copy of the journal where the next cycle finds it (``tools/search/isc.py``)."""
        if self.artifacts is not None:
            save_journal(Path(self.search.storage), self.artifacts)

    def _checkpoints(self, run_dir: Path) -> Path:
        """A trial's ``checkpoint.dir``: in its run directory, or on the ISC the artifact path (isc.py)."""
        return run_dir / "checkpoints" if self.artifacts is None else self.artifacts

    def _train(self, claim: Claim, run_dir: Path) -> tuple[int, str]:
        """Run the trial's training to its end; its exit code and the tail of its stderr (which is
        passed on to this worker's stderr as it comes)."""
        settings = self.search.settings
        overrides = [*settings.overrides, *(param.override(claim.params[param.key]) for param in settings.params),
                     f"run_dir={quoted(run_dir)}", f"checkpoint.dir={quoted(self._checkpoints(run_dir))}",
                     f"logging.dir={quoted(run_dir / 'tensorboard')}"]
        if self.artifacts is not None:  # on the ISC: see tools/search/isc.py
            overrides.append("checkpoint.keep_best=false")
        env = {**os.environ, **self.search.search_trial(claim.number).to_environment()}
        child = subprocess.Popen(trial_command(settings.recipe, overrides, self.nproc), env=env,
                                 stderr=subprocess.PIPE)
        self.child = child
        if self.stop_signal is not None:  # a signal that came before the run existed
            child.send_signal(signal.SIGTERM)
        tail = bytearray()
        relay = threading.Thread(target=_relay, args=(child.stderr.fileno(), tail), daemon=True)
        relay.start()
        code = child.wait()
        relay.join()
        child.stderr.close()
        self.child = None
        return code, tail.decode(errors="replace")

    # ---- recording results --------------------------------------------------------------------

    def _record_finished(self, number: int, run_dir: Path) -> None:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        metric = self.search.metric
        if summary.get("pruned"):
            pruned = summary["pruned"]
            self._record(number, TrialState.PRUNED, pruned_at_epoch=pruned["epoch"], pruned_at_step=pruned["step"])
            return
        value = summary["metrics"].get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            self._record(number, TrialState.COMPLETE, value=float(value))
        else:
            reported = ", ".join(sorted(summary["metrics"]))
            reason = f"the objective {metric} is {value!r} in {run_dir / SUMMARY_FILE} (its metrics: {reported})"
            self._record(number, TrialState.FAIL, reason=reason)

    def _record(self, number: int, state: TrialState, value: float | None = None, **attrs: Any) -> None:
        """Tell the study how trial ``number`` ended (once: a trial already recorded stays as it is)."""
        storage, trial_id = self.search.optuna_storage, self.search.trial_id(number)
        recorded = storage.get_trial(trial_id).state
        if recorded.is_finished():
            say(f"trial {number}: already recorded as {recorded.name.lower()}; left as it is")
            return
        for key, attr in attrs.items():
            storage.set_trial_user_attr(trial_id, key, attr)
        self.search.study.tell(number, value, state=state)
        self._keep_journal()
        if self.artifacts is not None:
            move_checkpoints(self.artifacts, self.search.run_dir(number) / "checkpoints")
        if state == TrialState.COMPLETE:
            outcome = f"complete, {self.search.metric} {value:.6g}"
        elif state == TrialState.PRUNED:
            outcome = f"pruned after epoch {attrs['pruned_at_epoch']} (step {attrs['pruned_at_step']})"
        else:
            outcome = f"failed: {attrs['reason']}"
        finished = sum(trial.state.is_finished() for trial in self.search.trials())
        say(f"trial {number}: {outcome} ({finished} of {self.target} finished)")
        write_study_json(self.search)


def _relay(fd: int, tail: bytearray) -> None:
    """Copy a run's stderr to ours as it comes, keeping its last :data:`STDERR_KEPT` bytes."""
    while chunk := os.read(fd, 4096):
        sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.flush()
        tail.extend(chunk)
        del tail[:-STDERR_KEPT]
