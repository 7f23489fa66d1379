"""The one check of the run contract's resume promises that every recipe's tests call.

:func:`kill_signal_resume` runs one chain for a recipe and a number of processes (a torchrun
launch through ``cluster/torchrun.py`` with more than one):

1. **reference**: an uninterrupted run (or the caller's, made with the same overrides);
2. **killed**: the same command, SIGKILLed (launcher, every rank, every loader worker at once,
   no clean-up) right after the checkpoint of a step drawn in the *middle* of an epoch is
   committed (``kill="mid-write"``: in the middle of that checkpoint's background write instead;
   ``kill="after-evaluation"``: right after the checkpoint an epoch's end writes with its metrics);
3. **signalled**: started again, it resumes from exactly that checkpoint; SIGTERM or SIGUSR1 is
   sent to it (to the launcher under torchrun) right after the step before an epoch's *last* step:
   the run finishes that last step, checkpoints it and exits with code 75;
4. **finished**: started again, it resumes from that epoch's last step and runs to the end; its
   ``model_digest`` (and ``extra_digests``), its final metrics and every evaluation its segments
   logged (the steps and the values) must equal the reference's.

With several processes, the chain then evaluates the model of step 3's checkpoint on one rank:
every metric must equal what the resumed run of step 4 and the uninterrupted run computed for the
same weights on all ranks at that step (exactly; a loss up to the order of its float sum).

The steps are drawn from a seed that differs on every run and is printed with every failure;
``KILL_SEED=<seed>`` replays a failure. The kills and signals land exactly where they are meant
to because the runs pause there (``tests/pause_hook/sitecustomize.py``, which this module puts on
the runs' PYTHONPATH): no test here depends on how fast the machine is.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.checkpoint.layout import STATE_FILE, latest_checkpoint
from common.errors import EXIT_PREEMPTED
from common.records.loggers import METRICS_FILE, read_metrics_file
from tests.conftest import REPO, assert_ok, kill_run, read_summary, recipe_env, run_recipe, start_recipe
from tools.processes import descendants

PAUSE_HOOK = Path(__file__).resolve().parent / "pause_hook"
# Every step checkpointed, stop decisions taken every step, no wall-clock saves: where a run
# stops is decided by the test alone. None of these changes what the run computes.
CHAIN_SETTINGS = ["checkpoint.every_steps=1", "checkpoint.sync_every_steps=1", "checkpoint.every_seconds=0"]
RESUMED = re.compile(r"resumed from \S+ \(step (\d+),")
DEADLINE_S = 300  # for one run to reach its pause; generous for a loaded 2-core machine


def chain_seed() -> int:
    """``KILL_SEED`` when set (to replay a failure), else a new seed for every run of the suite."""
    return int(os.environ.get("KILL_SEED") or secrets.randbits(32))


# Where the SIGKILL lands: right after the checkpoint of a step in the middle of an epoch; in the
# middle of writing that checkpoint in the background (with checkpoint.async_save=true), so the
# run resumes from the step before; or right after the checkpoint an epoch's end writes with its
# evaluation, so the run resumes at the start of the next epoch.
KILLS = ("mid-epoch", "mid-write", "after-evaluation")


@dataclass
class Plan:
    """Where a chain stops: SIGKILL after step ``kill_at``, a signal after step ``signal_after``
    so that the run stops at ``stop_at``, the last step of an epoch."""

    seed: int
    kill: str
    kill_at: int
    stop_at: int
    steps_per_epoch: int
    resumed_at: int = 0  # the step the killed run's latest committed checkpoint holds

    @property
    def signal_after(self) -> int:
        return self.stop_at - 1

    def replay(self) -> str:
        return (f"KILL_SEED={self.seed}: killed ({self.kill}) after step {self.kill_at}, stopped at step "
                f"{self.stop_at} ({self.steps_per_epoch} steps per epoch)")


def draw_plan(seed: int, steps_per_epoch: int, total_steps: int, first_kill: int = 1, kill: str = "mid-epoch"
              ) -> Plan:
    """A kill step (see :data:`KILLS`: mid-epoch, or an epoch's end for ``after-evaluation``; for
    ``mid-write`` the step before is mid-epoch too, since the run resumes there) and the last step
    of a later epoch, at least two steps after it, before the end of training."""
    epoch_ends = [end for end in range(steps_per_epoch, total_steps, steps_per_epoch)]

    def fits(step: int) -> bool:
        if kill == "after-evaluation":
            return step % steps_per_epoch == 0
        return bool(step % steps_per_epoch) and (kill != "mid-write" or step > 1 and (step - 1) % steps_per_epoch)

    kills = [step for step in range(max(1, first_kill), total_steps)
             if fits(step) and any(end >= step + 2 for end in epoch_ends)]
    assert kills, (f"no {kill} kill step fits {total_steps} steps of {steps_per_epoch} per epoch "
                   f"(from step {first_kill}); give the chain more steps")
    rng = random.Random(seed)
    kill_at = rng.choice(kills)
    stop_at = rng.choice([end for end in epoch_ends if end >= kill_at + 2])
    return Plan(seed, kill, kill_at, stop_at, steps_per_epoch)


def paused_env(pause_at: int, marker: Path, pause: str = "after-save", **extra: str) -> dict[str, str]:
    """The environment of a run that pauses at its first checkpoint of step ``pause_at`` or later
    (``pause``: after-save, mid-write or after-evaluation; see tests/pause_hook/sitecustomize.py)."""
    return recipe_env(PYTHONPATH=f"{PAUSE_HOOK}{os.pathsep}{REPO}", PAUSE_AT_STEP=str(pause_at),
                      PAUSE_MARKER=str(marker), PAUSE_HOW=pause, **extra)


def wait_for_pause(marker: Path, process: subprocess.Popen) -> int:
    """Poll until the run paused at its chosen checkpoint; fail if it ended first."""
    deadline = time.monotonic() + DEADLINE_S
    while not marker.exists():
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            pytest.fail(f"the run ended (code {process.returncode}) before it paused:\n{output[-4000:]}")
        if time.monotonic() > deadline:
            kill_run(process)
            pytest.fail(f"the run did not reach its pause within {DEADLINE_S} s")
        time.sleep(0.05)
    return int(marker.read_text())


def kill_leftovers(pids: set[int], marker: Path) -> None:
    """SIGKILL those of ``pids`` that are still processes of this run (their environment names its
    pause marker: a pid the system has since given to another process is left alone)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            if f"PAUSE_MARKER={marker}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)


def saved_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)


def latest_saved(checkpoints: Path) -> tuple[int, dict]:
    latest = latest_checkpoint(checkpoints)
    assert latest is not None, f"no committed checkpoint in {checkpoints}"
    return latest.step, saved_state(latest.path)


NOT_EVALUATION = ("step", "time", "train/", "startup/")  # what a metrics.jsonl record holds besides evaluations


def evaluations(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` of every evaluation the run logged, in order (metrics.jsonl holds every
    logged value; a resume drops what a killed segment logged after its checkpoint)."""
    found = [(record["step"], {name: value for name, value in record.items() if not name.startswith(NOT_EVALUATION)})
             for record in read_metrics_file(run_dir / "tensorboard" / METRICS_FILE)]
    return [(step, metrics) for step, metrics in found if metrics]


def eval_metrics_at(run_dir: Path, step: int) -> dict[str, float]:
    """The evaluation metrics a run logged at ``step``, merged where it evaluated twice there (a run
    that ends with dinov2_fsdp's probe evaluates the sweep's heads, then the classifier it chose)."""
    at_step = [metrics for logged, metrics in evaluations(run_dir) if logged == step]
    assert at_step, f"no evaluation logged at step {step} in {run_dir / 'tensorboard' / METRICS_FILE}"
    return {name: value for metrics in at_step for name, value in metrics.items()}


def assert_same_metrics(one_rank: dict[str, float], all_ranks: dict[str, float], what: str) -> None:
    """Counts reduced over ranks are exact; a loss is a float sum, equal up to its order."""
    missing = set(all_ranks) - set(one_rank)
    assert not missing, f"{what}: the one-rank evaluation has no {sorted(missing)}"
    for name, value in all_ranks.items():
        if "loss" in name:
            assert one_rank[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (what, name)
        else:
            assert one_rank[name] == value, (what, name, one_rank[name], value)


def kill_signal_resume(
    recipe: str,
    overrides: list[str],
    tmp_path: Path,
    nproc: int = 1,
    stop_signal: signal.Signals = signal.SIGTERM,
    reference: Path | None = None,
    extra_digests: tuple[str, ...] = (),
    first_kill: int = 1,
    kill: str = "mid-epoch",
    one_rank_eval_overrides: tuple[str, ...] = (),
    timeout: float = 600,
) -> dict:
    """Run the chain described in this module's docstring; returns the finished run's summary.

    ``overrides`` are the recipe's (``run_dir`` is set here). ``reference`` is the run directory
    of an uninterrupted run with the same overrides and :data:`CHAIN_SETTINGS` (one is made
    otherwise). ``kill`` is one of :data:`KILLS`; ``first_kill`` is the earliest step to kill at
    (e.g. to kill in a later stage).
    ``one_rank_eval_overrides`` are added to the one-rank evaluation of a multi-process chain.
    """
    settings = [*overrides, *CHAIN_SETTINGS]
    if reference is None:
        reference = tmp_path / "reference"
        assert_ok(run_recipe(recipe, [*settings, f"run_dir={reference}"], nproc=nproc, timeout=timeout))
    expected = read_summary(reference)
    assert expected["world_size"] == nproc
    steps_per_epoch = expected["steps"] // expected["epochs"]
    seed = chain_seed()
    plan = draw_plan(seed, steps_per_epoch, expected["steps"], first_kill, kill)
    print(f"{recipe}, {nproc} process(es): {plan.replay()}")
    try:
        return _run_chain(recipe, settings, tmp_path / "run", nproc, stop_signal, reference, extra_digests, plan,
                          one_rank_eval_overrides, timeout)
    except (AssertionError, pytest.fail.Exception) as error:
        error.add_note(f"replay with {plan.replay()}")
        raise


def _run_chain(recipe: str, settings: list[str], run_dir: Path, nproc: int, stop_signal: signal.Signals,
               reference: Path, extra_digests: tuple[str, ...], plan: Plan,
               one_rank_eval_overrides: tuple[str, ...], timeout: float) -> dict:
    expected = read_summary(reference)
    checkpoints = run_dir / "checkpoints"
    command = [*settings, f"run_dir={run_dir}"]

    # 2. killed mid-epoch, mid-write or after an epoch's evaluation
    marker = run_dir.parent / "killed.paused"
    pause = "after-save" if plan.kill == "mid-epoch" else plan.kill
    process = start_recipe(recipe, command, nproc=nproc, env=paused_env(plan.kill_at, marker, pause))
    paused_at = wait_for_pause(marker, process)
    kill_run(process)
    assert paused_at == plan.kill_at
    step, state = latest_saved(checkpoints)
    if plan.kill == "mid-write":
        partial = list(checkpoints.glob(".tmp-checkpoint_*/state.pt"))
        assert partial and partial[0].stat().st_size > 0, "the kill did not land in the middle of a write"
        assert step == plan.kill_at - 1, f"the checkpoint being written at the kill was committed (step {step})"
    else:
        assert step == plan.kill_at
    if plan.kill == "after-evaluation":
        assert state["progress"]["epoch"] == step // plan.steps_per_epoch and state["sampler"]["consumed"] == 0, \
            f"the checkpoint of step {step} does not start the next epoch: {state['sampler']}"
    else:
        assert state["progress"]["epoch"] == step // plan.steps_per_epoch and state["sampler"]["consumed"] > 0, \
            f"the checkpoint of step {step} is not in the middle of an epoch: {state['sampler']}"
    plan.resumed_at = step

    # 3. resumed, then signalled: it stops on an epoch's last step with exit code 75
    marker = run_dir.parent / "signalled.paused"
    process = start_recipe(recipe, command, nproc=nproc, env=paused_env(plan.signal_after, marker))
    assert wait_for_pause(marker, process) == plan.signal_after
    tree = {process.pid, *descendants(process.pid)}
    process.send_signal(stop_signal)
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:  # a launcher that died of the signal leaves its workers behind, paused
        kill_leftovers(tree, marker)
    assert process.returncode == EXIT_PREEMPTED, f"exit {process.returncode}, expected {EXIT_PREEMPTED}:\n" \
                                                 f"{output[-4000:]}"
    assert [int(found) for found in RESUMED.findall(output)] == [plan.resumed_at], output[-4000:]
    assert f"received {stop_signal.name}: checkpoint saved at step {plan.stop_at}" in output, output[-4000:]
    step, state = latest_saved(checkpoints)
    assert step == plan.stop_at
    assert state["progress"]["epoch"] == plan.stop_at // plan.steps_per_epoch - 1, \
        "the stop checkpoint is not the last step of its epoch (the epoch already ended)"
    assert not (run_dir / "summary.json").exists()
    stopped = run_dir.parent / "stopped"
    shutil.copytree(checkpoints, stopped / "checkpoints", symlinks=True)

    # 4. resumed to the end: the same model as the uninterrupted run
    result = run_recipe(recipe, command, nproc=nproc, timeout=timeout)
    assert_ok(result)
    assert [int(found) for found in RESUMED.findall(result.stdout)] == [plan.stop_at], result.stdout[-4000:]
    resumed = read_summary(run_dir)
    assert resumed["resumes"] == 2 and resumed["steps"] == expected["steps"]
    assert resumed["model_digest"] == expected["model_digest"], "the resumed run ended with other weights"
    assert resumed["metrics"] == expected["metrics"]
    assert evaluations(run_dir) == evaluations(reference), "the resumed run's evaluations differ (steps or values)"
    for name in extra_digests:
        assert resumed[name] == expected[name], name

    # With several ranks: the model of the stop checkpoint, evaluated on one rank, scores what
    # the resumed run computed for it on all ranks.
    if nproc > 1:
        one_rank = run_recipe(recipe, [*settings, f"run_dir={stopped}", *one_rank_eval_overrides,
                                       f"trainer.epochs={plan.stop_at // plan.steps_per_epoch}"], timeout=timeout)
        assert_ok(one_rank)
        assert read_summary(stopped)["world_size"] == 1
        single = eval_metrics_at(stopped, plan.stop_at)
        assert_same_metrics(single, eval_metrics_at(run_dir, plan.stop_at),
                            f"step {plan.stop_at} evaluated on 1 rank and on {nproc} after the resume")
        assert_same_metrics(single, eval_metrics_at(reference, plan.stop_at),
                            f"step {plan.stop_at} evaluated on 1 rank and on {nproc} in the uninterrupted run")
    return resumed
