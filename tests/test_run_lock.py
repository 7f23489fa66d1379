"""One run directory, one run (``common/run_lock.py``): a second launch on a run in progress exits
2 naming the holder and touches nothing; a holder that is gone is taken over, with a line."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from common import run_lock
from common.errors import EXIT_PREEMPTED, EXIT_USER_ERROR
from common.records.heartbeat import HEARTBEAT_DIR
from common.records.loggers import METRICS_FILE
from common.run_lock import LOCK_FILE, Holder, RunLock, RunLockHeld, stale_reason
from tests.conftest import REPO, assert_ok, kill_run, read_summary, recipe_env, run_recipe, start_recipe
from tests.resume import paused_env, wait_for_pause

RECIPE = "fashion_mnist"
TINY = ["model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16", "logging.backend=none",
        "logging.progress_bar=false", "checkpoint.every_seconds=0", "checkpoint.every_steps=2", "trainer.epochs=1",
        "checkpoint.sync_every_steps=1"]


def holder(**changes: object) -> Holder:
    return dataclasses.replace(Holder.this_process(), **changes)


def forge(folder: Path, who: Holder, heartbeat_age: float = 0.0) -> Path:
    """A lock file in ``folder`` naming ``who``, last touched ``heartbeat_age`` seconds ago."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    path.write_text(json.dumps(dataclasses.asdict(who)))
    then = time.time() - heartbeat_age
    os.utime(path, (then, then))
    return path


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# ---- the rules --------------------------------------------------------------------------------


def test_who_may_take_a_lock_over() -> None:
    me = holder(slurm_job=None, isc_artifacts=None)
    assert stale_reason(holder(pid=dead_pid()), me, 0) is not None, "same host, process gone"
    assert stale_reason(holder(pid=1, pid_start=""), me, 0) is None, "same host, process alive"
    assert "another process" in stale_reason(holder(pid=1, pid_start="12345678"), me, 0), "same host, pid reused"
    elsewhere = holder(host="node-7", boot_id="other")
    assert stale_reason(elsewhere, me, run_lock.STALE_AFTER_S - 1) is None, "another host, heartbeat fresh"
    assert "heartbeat" in stale_reason(elsewhere, me, run_lock.STALE_AFTER_S + 1), "another host, heartbeat stale"
    job = holder(host="node-7", boot_id="other", slurm_job="4242")
    assert "SLURM job" in stale_reason(job, dataclasses.replace(me, slurm_job="4242"), 0), "the same job, requeued"
    assert stale_reason(job, dataclasses.replace(me, slurm_job="4243"), 0) is None, "another job"
    task = holder(host="node-7", boot_id="other", slurm_job="4242_1")
    assert stale_reason(task, dataclasses.replace(me, slurm_job="4242_0"), 0) is None, "another task of the array"
    isc = holder(host="node-7", boot_id="other", isc_artifacts="/mnt/old-cycle/checkpoints")
    assert "ISC" in stale_reason(isc, dataclasses.replace(me, isc_artifacts="/mnt/new-cycle/checkpoints"), 0)


def test_array_tasks_are_named_as_scontrol_requeue_names_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert run_lock.slurm_job() == "101"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert run_lock.slurm_job() == "100_1"


def test_a_held_lock_is_refused_naming_its_holder_and_a_gone_one_is_taken_over(tmp_path: Path) -> None:
    lines: list[str] = []
    forge(tmp_path / "held", holder(host="node-7", boot_id="other", pid=4321, slurm_job="77"))
    with pytest.raises(RunLockHeld, match=r"in use by another launch of this run \(host node-7, pid 4321, "
                                          r"SLURM job 77, since .*; last heartbeat 0 s ago\)"):
        RunLock(tmp_path / "held", lines.append).acquire()

    forge(tmp_path / "gone", holder(pid=dead_pid()))
    lock = RunLock(tmp_path / "gone", lines.append)
    lock.acquire()
    assert lines and "took over the lock" in lines[-1] and "is gone" in lines[-1]
    assert json.loads((tmp_path / "gone" / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "gone" / LOCK_FILE).exists()


def test_a_holder_whose_lock_was_taken_over_stops_at_its_next_heartbeat(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import time
        from common import run_lock
        run_lock.HEARTBEAT_S = 0.1
        run_lock.RunLock({str(tmp_path)!r}, print).acquire()
        print("held", flush=True)
        time.sleep(60)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "held"
    forge(tmp_path, holder(host="node-7", boot_id="other", slurm_job="77"))  # a requeued launch took it over
    assert process.wait(timeout=60) == EXIT_USER_ERROR
    assert "was taken over by host node-7" in process.stderr.read()


# ---- real launches ---------------------------------------------------------------------------


def file_state(run_dir: Path) -> dict[str, bytes]:
    """Every file of ``run_dir`` but the running run's heartbeats, which it rewrites as it runs."""
    return {str(path.relative_to(run_dir)): path.read_bytes() if path.is_file() else b""
            for path in sorted(run_dir.rglob("*")) if path.relative_to(run_dir).parts[0] != HEARTBEAT_DIR}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_launch_on_a_running_run_exits_2_naming_it_and_touches_nothing(
    fashion_data: Path, tmp_path: Path, nproc: int
) -> None:
    run_dir = tmp_path / "run"
    command = [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY]
    first = start_recipe(RECIPE, command, nproc=nproc, env=paused_env(2, tmp_path / "paused"))
    try:
        wait_for_pause(tmp_path / "paused", first)
        before = file_state(run_dir)
        second = run_recipe(RECIPE, [*command, "seed=1"], nproc=nproc)  # a config that would show if written
        assert second.returncode == EXIT_USER_ERROR, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, second.stderr[-3000:]
        assert f"{run_dir} is in use by another launch of this run (host " in errors[0]
        assert f"pid {json.loads((run_dir / LOCK_FILE).read_text())['pid']}," in errors[0]
        assert file_state(run_dir) == before, "the refused launch changed the running run's files"
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=300) == EXIT_PREEMPTED
    finally:
        if first.poll() is None:
            kill_run(first)
    assert not (run_dir / LOCK_FILE).exists(), "a run that stopped leaves no lock"
    assert (run_dir / ".hydra" / "config.yaml").read_text().count("seed: 0") == 1


def test_a_lock_left_by_a_killed_run_is_taken_over_and_the_run_resumes(fashion_data: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY]
    first = start_recipe(RECIPE, command, env=paused_env(2, tmp_path / "paused"))
    wait_for_pause(tmp_path / "paused", first)
    pid = json.loads((run_dir / LOCK_FILE).read_text())["pid"]
    kill_run(first)
    assert (run_dir / LOCK_FILE).exists(), "SIGKILL leaves the lock behind"
    again = run_recipe(RECIPE, command, env=recipe_env())
    assert_ok(again)
    assert f"took over the lock of {run_dir} from host" in again.stdout
    assert f"its process {pid} is gone" in again.stdout
    assert "resumed from" in again.stdout and read_summary(run_dir)["resumes"] == 1
    assert (run_dir / "tensorboard" / METRICS_FILE).is_file()
