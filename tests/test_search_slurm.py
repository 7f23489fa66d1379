"""Hyperparameter search on the local SLURM: ``cluster/slurm/search.sbatch`` as an array of two
workers, one requeued by USR1 (in the SLURM tests' worker group, with the session's cluster)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests import slurm_cluster as sc
from tests.conftest import REPO, read_summary
from tests.resume import CHAIN_SETTINGS, paused_env
from tests.test_search import (
    DEADLINE_S,
    FASHION_SPACE,
    claim_holder,
    fashion_overrides,
    started,
    study_json,
    write_space,
)


@pytest.mark.slow
@pytest.mark.slurm
def test_a_slurm_array_of_two_workers_with_one_requeued_by_usr1_finishes_the_study(
        slurm_env: dict[str, str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Trial 0 pauses after its step-2 checkpoint in whichever task takes it; once the other task
    has run trials 1 and 2 and ended, USR1 to the holder's batch shell: the trial checkpoints,
    lib.sh requeues that task alone, and the requeued task resumes trial 0."""
    study, overrides = tmp_path / "study", fashion_overrides(tmp_path_factory, *CHAIN_SETTINGS)
    marker = tmp_path / "paused"
    env = {**paused_env(2, marker, PAUSE_ONLY_IN=f"{os.sep}trial_0{os.sep}"), **slurm_env, "PYTHON": sys.executable}
    array = sc.sbatch(REPO / "cluster" / "slurm" / "search.sbatch",
                      args=["--array=0-1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
                            f"--output={tmp_path}/task-%a.out"], env=env, cwd=REPO,
                      script_args=["fashion_mnist", "--space", str(write_space(tmp_path, FASHION_SPACE)),
                                   "--trials", "3", "--study", str(study), "--", *overrides])
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not marker.exists():
            assert time.monotonic() < deadline, "trial 0 did not reach its step-2 checkpoint"
            time.sleep(0.2)
        holder = claim_holder(study, 0)["slurm_job"]
        task = int(holder.split("_")[1])
        assert holder == f"{array}_{task}"
        other = f"{array}_{1 - task}"
        assert sc.wait_for_job(other, timeout_s=DEADLINE_S, env=slurm_env) == "COMPLETED"
        assert sc.job_state(holder, slurm_env) == "RUNNING"

        sc.signal_batch(holder, "USR1", env=slurm_env)
        assert sc.wait_for_job(holder, timeout_s=DEADLINE_S, env=slurm_env) == "COMPLETED"
    finally:
        sc.cancel(array, env=slurm_env)
    logs = {name: (tmp_path / f"task-{name}.out").read_text() for name in (task, 1 - task)}
    assert sc.job_restart_count(holder, env=slurm_env) == 1 and sc.job_restart_count(other, env=slurm_env) == 0
    held = logs[task]
    first, stop = held.index("start (restart 0)"), held.index(f"requeueing {holder}")
    second, resume = held.index("start (restart 1)"), held.index("search: trial 0: resuming")
    assert first < stop < second < resume, held
    assert "received SIGUSR1: checkpoint saved at step 3" in held
    assert sorted(started(logs[task]) + started(logs[1 - task])) == [0, 1, 2]  # no trial run twice
    assert sorted(started(logs[1 - task])) == [1, 2]
    assert read_summary(study / "trial_0")["resumes"] == 1
    record = study_json(study)
    assert record["counts"] == {"complete": 3} and len(record["trials"]) == 3
