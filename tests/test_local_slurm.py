"""The local SLURM cluster (tools/slurm_local_cluster.sh) runs, signals and requeues real jobs.

These tests start a real slurmctld + slurmd on 127.0.0.1 (Debian's slurm-wlm,
as root). Without SLURM they are skipped; with REQUIRE_SLURM=1 they fail.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests import slurm_cluster as sc

pytestmark = pytest.mark.slurm


def test_wrap_job_completes_and_writes_output(slurm_env, tmp_path: Path):
    out = tmp_path / "hi-%j.out"
    job = sc.sbatch(args=["--output", str(out), "--wrap", "echo hi"], env=slurm_env, cwd=tmp_path)

    assert sc.wait_for_job(job, timeout_s=180, env=slurm_env) == "COMPLETED"
    assert (tmp_path / f"hi-{job}.out").read_text() == "hi\n"
    assert sc.job_restart_count(job, env=slurm_env) == 0


def test_failing_job_is_reported_failed(slurm_env, tmp_path: Path):
    job = sc.sbatch(
        args=["--output", str(tmp_path / "fail.out"), "--wrap", "echo before; exit 3"],
        env=slurm_env,
        cwd=tmp_path,
    )

    assert sc.wait_for_job(job, timeout_s=180, env=slurm_env) == "FAILED"
    info = sc.job_info(job, env=slurm_env)
    assert info is not None and info["ExitCode"] == "3:0"


# The pattern a pre-emptible training job uses: on USR1 (sent by SLURM before
# the time limit with --signal=B:USR1@N, or by an admin/test with
# `scancel --signal=USR1 --batch`), save state, requeue itself and exit; the
# requeued run sees SLURM_RESTART_COUNT and resumes.
REQUEUE_SCRIPT = textwrap.dedent(
    """\
    #!/bin/bash
    #SBATCH --job-name=requeue-test
    #SBATCH --requeue
    #SBATCH --open-mode=append
    #SBATCH --time=10
    #SBATCH --signal=B:USR1@60
    restart=${SLURM_RESTART_COUNT:-0}
    echo "run restart=$restart job=$SLURM_JOB_ID"
    if [[ $restart -ge 1 ]]; then
        echo "resumed run finished"
        exit 0
    fi
    on_usr1() {
        echo "got USR1; requeueing"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    }
    trap on_usr1 USR1
    echo "trap armed"
    # `wait` returns as soon as a trapped signal arrives; a foreground sleep would delay the trap.
    while true; do
        sleep 30 &
        wait $!
    done
    """
)


def test_usr1_requeue_then_second_run_completes(slurm_env, tmp_path: Path):
    script = tmp_path / "requeue.sbatch"
    script.write_text(REQUEUE_SCRIPT)
    out = tmp_path / "requeue.out"
    job = sc.sbatch(script, args=["--output", str(out)], env=slurm_env, cwd=tmp_path)

    # Signal only once the trap is in place (bash's default for USR1 is to die).
    sc.wait_for_file(out, timeout_s=180, contains="trap armed")
    assert sc.job_state(job, env=slurm_env) == "RUNNING"
    sc.signal_batch(job, "USR1", env=slurm_env)

    # Requeued: back to PENDING (for cred_expire seconds) with Restarts=1, then runs again.
    assert sc.wait_for_job(job, timeout_s=300, env=slurm_env) == "COMPLETED"
    assert sc.job_restart_count(job, env=slurm_env) == 1

    text = out.read_text()
    first = text.index("run restart=0")
    requeued = text.index("got USR1; requeueing")
    second = text.index("run restart=1")
    assert first < requeued < second, text
    assert text.count("got USR1") == 1, text
    assert "resumed run finished" in text[second:], text


TIME_LIMIT_SIGNAL_SCRIPT = textwrap.dedent(
    """\
    #!/bin/bash
    #SBATCH --time=1
    #SBATCH --signal=B:USR1@55
    trap 'echo "got USR1 from the time limit"; exit 0' USR1
    echo "trap armed"
    for _ in $(seq 120); do
        sleep 1 &
        wait $!
    done
    echo "no signal came"
    exit 1
    """
)


@pytest.mark.slow
def test_signal_before_time_limit_reaches_batch_shell(slurm_env, tmp_path: Path):
    """--signal=B:USR1@55 with a 1-minute limit: USR1 arrives ~5 s after the job starts (slurmctld
    checks time limits about every 30 s, so up to ~35 s), long before the limit kills the job. The
    wait allows for a loaded machine: a job left without the signal would end TIMEOUT or FAILED."""
    script = tmp_path / "limit.sbatch"
    script.write_text(TIME_LIMIT_SIGNAL_SCRIPT)
    out = tmp_path / "limit.out"
    job = sc.sbatch(script, args=["--output", str(out)], env=slurm_env, cwd=tmp_path)

    assert sc.wait_for_job(job, timeout_s=300, env=slurm_env) == "COMPLETED"
    assert "got USR1 from the time limit" in out.read_text()


def test_a_port_another_starting_cluster_claimed_is_not_picked(tmp_path_factory: pytest.TempPathFactory):
    """A two-node start claims its slurmctld port, then sets up its network before binding it: a
    cluster starting meanwhile (another xdist worker) must not take the same, still-free port."""
    import socket

    sc.require_slurm_or_skip()

    def in_use(port: int) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    first = next(p for p in range(6817, 6917, 2) if not in_use(p) and not in_use(p + 1))
    registry = Path("/run/local-slurm")
    registry.mkdir(parents=True, exist_ok=True)
    state = tmp_path_factory.mktemp("claim")  # short: slurmstepd's socket paths have a limit
    claim = registry / f"cluster-test-{state.name}.ports"
    claim.write_text(f"{first}\n")
    try:
        with sc.running_local_slurm(state):
            conf = (state / "slurm.conf").read_text()
    finally:
        claim.unlink()
    assert f"SlurmctldPort={first}\n" not in conf
