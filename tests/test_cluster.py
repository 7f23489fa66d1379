"""cluster/: the real sbatch files on a real one-node SLURM, the torchrun launcher, the scripts.

The SLURM tests start slurmctld + slurmd on 127.0.0.1 (Debian's slurm-wlm and munge, as
root); without them they are skipped, and with REQUIRE_SLURM=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import slurm_cluster as sc
from tests.conftest import REPO, free_port, latest_step, read_summary, recipe_env, run_recipe, start_recipe
from tests.resume import CHAIN_SETTINGS, paused_env, wait_for_pause
from tools.tiny_data import write_fashion_mnist

TINY = ["trainer.deterministic=true", "model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=32",
        "logging.backend=none", "logging.progress_bar=false"]
SHELL_SCRIPTS = sorted(
    path for folder in ("cluster", "benchmarks", "tools") for pattern in ("*.sh", "*.sbatch", "*.pbs")
    for path in (REPO / folder).rglob(pattern)
)


def clean_env(**extra: str) -> dict[str, str]:
    """The recipes' test environment, plus the interpreter the cluster scripts run (PYTHON)."""
    return recipe_env(PYTHON=sys.executable, **extra)


# ---- SLURM: the real fashion_mnist sbatch file ----------------------------------------------

@pytest.fixture(scope="session")
def slurm_runs(slurm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two jobs with the same config, side by side: one left alone, one pre-empted with USR1."""
    tmp = tmp_path_factory.mktemp("sbatch")
    data = write_fashion_mnist(tmp / "data")
    # 4 epochs of 8 steps; a checkpoint every step so the pre-emption lands mid-run.
    overrides = [f"data.root={data}", "trainer.epochs=4", "checkpoint.every_steps=1", *TINY]
    # Submit-time options replace the file's site lines: no GPUs and one CPU on this cluster.
    options = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]
    jobs = {}
    for name in ("alone", "preempted"):
        run_dir = tmp / name
        # The job left alone also stages its data to "node-local" disk first; the other pauses after
        # its checkpoint of step 2 until the signal reaches it, however fast or slow this machine is.
        if name == "alone":
            env = clean_env(**slurm_env, STAGE_DATA="1", STAGE_DIR=str(tmp / "node-local"))
        else:
            env = {**paused_env(2, tmp / "paused"), **slurm_env, "PYTHON": sys.executable}
        job = sc.sbatch(REPO / "cluster" / "slurm" / "fashion_mnist.sbatch",
                        args=[*options, f"--output={tmp}/{name}-%j.out"], env=env,
                        cwd=REPO, script_args=[*overrides, f"run_dir={run_dir}"])
        jobs[name] = {"job": job, "run_dir": run_dir, "log": tmp / f"{name}-{job}.out", "tmp": tmp}

    preempted = jobs["preempted"]
    env = clean_env(**slurm_env)
    deadline = time.monotonic() + 300
    while not (tmp / "paused").exists():
        assert sc.job_state(preempted["job"], env) in ("PENDING", "RUNNING"), preempted["log"].read_text()
        assert time.monotonic() < deadline, "no checkpoint at step 2 within 300 s"
        time.sleep(0.2)
    preempted["signalled_at_step"] = latest_step(preempted["run_dir"] / "checkpoints")
    sc.signal_batch(preempted["job"], "USR1", env=env)

    for run in jobs.values():
        run["state"] = sc.wait_for_job(run["job"], timeout_s=360, env=env)
        run["restarts"] = sc.job_restart_count(run["job"], env=env)
        run["output"] = run["log"].read_text()
    return jobs


@pytest.mark.slow
@pytest.mark.slurm
def test_fashion_mnist_sbatch_runs_to_completion(slurm_runs: dict):
    alone = slurm_runs["alone"]
    assert alone["state"] == "COMPLETED", alone["output"]
    assert alone["restarts"] == 0
    result = read_summary(alone["run_dir"])
    assert result["steps"] == 32 and result["epochs"] == 4 and result["resumes"] == 0
    assert "training finished" in alone["output"]
    node_local = alone["tmp"] / "node-local"
    assert f"staging {alone['tmp'] / 'data'} to node-local {node_local}/recipes-" in alone["output"]
    assert node_local.is_dir() and not any(node_local.iterdir())  # the copy was removed at the end


@pytest.mark.slurm
def test_preempted_sbatch_requeues_resumes_and_matches_uninterrupted_digest(slurm_runs: dict):
    preempted, alone = slurm_runs["preempted"], slurm_runs["alone"]
    assert preempted["state"] == "COMPLETED", preempted["output"]
    assert preempted["restarts"] == 1, preempted["output"]
    output = preempted["output"]
    # One log, appended to across the requeue: checkpoint and stop, requeue, resume, finish.
    first, stop = output.index("start (restart 0)"), output.index("requeueing")
    second, resumed = output.index("start (restart 1)"), output.index("resumed from")
    assert first < stop < second < resumed < output.index("training finished"), output
    assert preempted["signalled_at_step"] == 2
    assert "received SIGUSR1: checkpoint saved at step 3" in output
    assert "training stopped (exit 75) after its checkpoint; requeueing" in output
    result = read_summary(preempted["run_dir"])
    assert result["resumes"] == 1 and result["steps"] == 32
    assert result["model_digest"] == read_summary(alone["run_dir"])["model_digest"]


@pytest.mark.slow
@pytest.mark.slurm
def test_usr1_to_one_task_of_an_array_requeues_that_task_alone(slurm_env: dict[str, str], tmp_path: Path):
    """The task of an array whose $SLURM_JOB_ID is the array's own id (task 0 or the last, by SLURM
    version) would requeue every task with `scontrol requeue $SLURM_JOB_ID`
    (Lightning-AI/pytorch-lightning#15040): lib.sh names <array job>_<task>. That task is stopped
    with USR1: it alone is requeued, the other keeps running with its job id."""
    data = write_fashion_mnist(tmp_path / "data")
    env = {**paused_env(2, tmp_path / "paused"), **slurm_env, "PYTHON": sys.executable}  # both tasks pause at step 2
    array = sc.sbatch(REPO / "cluster" / "slurm" / "fashion_mnist.sbatch",
                      args=["--array=0-1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
                            f"--output={tmp_path}/task-%a.out"], env=env, cwd=REPO,
                      script_args=[f"data.root={data}", "trainer.epochs=2", "checkpoint.every_steps=1", *TINY,
                                   f"run_dir={tmp_path}/task-${{oc.env:SLURM_ARRAY_TASK_ID}}"])
    deadline = time.monotonic() + 300
    while any(latest_step(tmp_path / f"task-{task}" / "checkpoints") < 2 for task in (0, 1)):
        assert time.monotonic() < deadline, "the array's tasks did not both reach their checkpoint of step 2"
        time.sleep(0.2)
    job_ids = {task: sc.job_info(f"{array}_{task}", slurm_env)["JobId"] for task in (0, 1)}
    stopped = next(task for task, job_id in job_ids.items() if job_id == array)
    other = 1 - stopped

    sc.signal_batch(f"{array}_{stopped}", "USR1", env=slurm_env)
    log = tmp_path / f"task-{stopped}.out"
    assert sc.wait_for_job(f"{array}_{stopped}", timeout_s=300, env=slurm_env) == "COMPLETED", log.read_text()
    assert sc.job_restart_count(f"{array}_{stopped}", env=slurm_env) == 1
    assert f"requeueing {array}_{stopped}" in log.read_text()
    try:
        assert sc.job_state(f"{array}_{other}", slurm_env) == "RUNNING", "the other task was stopped too"
        assert sc.job_restart_count(f"{array}_{other}", env=slurm_env) == 0, "the other task was requeued too"
        assert sc.job_info(f"{array}_{other}", slurm_env)["JobId"] == job_ids[other]
        assert (tmp_path / f"task-{other}.out").read_text().count("start (restart") == 1
    finally:
        sc.cancel(f"{array}_{other}", env=slurm_env)


@pytest.mark.slow
@pytest.mark.slurm
def test_a_requeued_job_takes_over_the_lock_its_earlier_run_left(slurm_env: dict[str, str], tmp_path: Path):
    """Processes of a job's run before its requeue may linger on another node, heart-beating: the
    requeued job (same job id) takes their lock over at once; another job is refused it."""
    from common.run_lock import LOCK_FILE

    data = write_fashion_mnist(tmp_path / "data")
    options = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=10", "--hold"]
    env = clean_env(**slurm_env)
    jobs, run_dirs = {}, {}
    for name in ("requeued", "another"):
        run_dirs[name] = tmp_path / name
        jobs[name] = sc.sbatch(REPO / "cluster" / "slurm" / "fashion_mnist.sbatch",
                               args=[*options, f"--output={tmp_path}/{name}.out"], env=env, cwd=REPO,
                               script_args=[f"data.root={data}", "trainer.epochs=1", *TINY,
                                            f"run_dir={run_dirs[name]}"])
    for name, job in jobs.items():  # a fresh heartbeat from another host: only the job id can settle it
        run_dirs[name].mkdir()
        (run_dirs[name] / LOCK_FILE).write_text(json.dumps({
            "host": "node-gone", "boot_id": "x", "pid": 4321, "pid_start": "", "isc_artifacts": None,
            "since": "2026-01-01T00:00:00+00:00", "slurm_job": job if name == "requeued" else "999999"}))
        subprocess.run(["scontrol", "release", job], env={**os.environ, **slurm_env}, check=True)
    assert sc.wait_for_job(jobs["requeued"], timeout_s=300, env=env) == "COMPLETED"
    output = (tmp_path / "requeued.out").read_text()
    assert (f"took over the lock of {run_dirs['requeued']} from host node-gone, pid 4321, SLURM job "
            f"{jobs['requeued']}" in output and "from before it was requeued" in output), output
    assert sc.wait_for_job(jobs["another"], timeout_s=300, env=env) == "FAILED"
    output = (tmp_path / "another.out").read_text()
    assert "is in use by another launch of this run (host node-gone, pid 4321, SLURM job 999999" in output, output
    assert "training exited with code 2" in output and not (run_dirs["another"] / "checkpoints").exists()


# ---- SLURM: a Hydra sweep through hydra-submitit-launcher -----------------------------------

@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_sweep_requeues_a_signalled_job_which_resumes_to_the_same_digest(
    slurm_env: dict[str, str], tmp_path: Path,
):
    """Two sweep points that train the same model (they differ only in how often they log).

    The first gets the time-limit signal submitit asks SLURM for (USR2) mid-run: submitit
    requeues it and exits, and the requeued job resumes from its newest periodic checkpoint in
    the same directory and ends with the same weights as the job left alone.
    """
    data = write_fashion_mnist(tmp_path / "data")
    sweep_dir = tmp_path / "sweep"
    command = [
        sys.executable, "-m", "recipes.fashion_mnist.train", "-m", "hydra/launcher=slurm",
        "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={sweep_dir}", f"data.root={data}", "trainer.epochs=4", "checkpoint.every_steps=1",
        *TINY, "trainer.log_every_steps=1,4",
    ]
    # The first sweep job waits after its step-2 checkpoint until a stop signal reaches it (the
    # requeue's SIGTERM), so it cannot finish before the USR2 however fast this machine is.
    env = {**paused_env(2, tmp_path / "paused", PAUSE_ONLY_IN="trainer.log_every_steps=1"), **slurm_env,
           "PYTHON": sys.executable}
    sweep = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "paused").exists():
            assert sweep.poll() is None, sweep.communicate()[0]
            assert time.monotonic() < deadline, "the first sweep job wrote no checkpoint at step 2 within 300 s"
            time.sleep(0.2)
        (latest,) = [path for path in sweep_dir.rglob("checkpoints/AtomicDirectory.latest_checkpoint")
                     if "trainer.log_every_steps=1" in str(path)]
        signalled = latest.parents[1], latest_step(latest.parent)
        first_job = next(sweep_dir.glob(".submitit/*_0")).name  # array task 0: the first sweep point
        subprocess.run(["scancel", "--signal=USR2", first_job], env=clean_env(**slurm_env), check=True)
        output = sweep.communicate(timeout=420)[0]
    finally:
        if sweep.poll() is None:
            sweep.kill()

    assert sweep.returncode == 0, output
    run_dirs = sorted(path.parent for path in sweep_dir.rglob("summary.json"))
    assert len(run_dirs) == 2, run_dirs
    signalled_dir, signalled_at_step = signalled
    assert signalled_dir in run_dirs, run_dirs
    (other_dir,) = [d for d in run_dirs if d != signalled_dir]
    log = (sweep_dir / ".submitit" / first_job / f"{first_job}_0_log.err").read_text()
    # With a 10-minute limit submitit guarantees no run time, so any USR2 counts as the time limit.
    assert "Caught signal SIGUSR2" in log and "this job is timed-out" in log and "DUE TO JOB REQUEUE" in log, log
    assert sc.job_restart_count(first_job, env=slurm_env) == 1
    resumed, alone = read_summary(signalled_dir), read_summary(other_dir)
    assert signalled_at_step == 2 and resumed["steps"] == alone["steps"] == 32
    assert resumed["resumes"] == 1 and alone["resumes"] == 0
    assert resumed["model_digest"] == alone["model_digest"]


# ---- cluster/launch.sh: two simulated nodes on this machine ---------------------------------

def launch(args: list[str], log_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(REPO / "cluster" / "launch.sh"), *args], cwd=REPO,
                            env=clean_env(LOG_DIR=str(log_dir), NPROC_PER_NODE="1", BACKEND="gloo", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_launch_worker_with_closed_master_port_fails_with_one_clear_line(tmp_path: Path):
    port = str(free_port())  # nobody listens on it
    node = launch(["fashion_mnist", "2", "1", "127.0.0.1", port, "--", *TINY], tmp_path / "logs",
                  CONNECT_TIMEOUT="2")
    output = node.communicate(timeout=120)[0]

    assert node.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot reach the master at 127.0.0.1:{port} over TCP within 2 s"), output
    assert "Traceback" not in output


def test_launch_rejects_a_bad_override_before_torchrun(tmp_path: Path):
    node = launch(["fashion_mnist", "--", "trainer.no_such_key=1"], tmp_path / "logs")
    output = node.communicate(timeout=120)[0]

    assert node.returncode == 1
    assert output.strip().splitlines()[-1].startswith("error: config fashion_mnist:"), output
    assert "no_such_key" in output and "torch.distributed" not in output


# ---- cluster/torchrun.py: torchrun with a single process's exit codes ---------------------------

def workers_of(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the workers the launcher started (its children that torchrun gave a RANK)."""
    workers = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher.pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((item[5:] for item in environ if item.startswith(b"RANK=")), None)
        if rank is not None:
            workers[int(rank)] = int(stat.parent.name)
    return workers


def test_make_train_with_nproc_reports_a_bad_override_in_one_line_before_starting_workers(tmp_path: Path):
    """What `make train-<r> NPROC=2 ARGS=trainer.nonsense=1` printed before: every rank's error and
    torchrun's traceback, 43 lines, exit 1. (cifar100_resnet50: its target has no data-prep step.)"""
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", "train-cifar100_resnet50", "NPROC=2",
                             f"PY={sys.executable}", f"ARGS=trainer.nonsense=1 run_dir={tmp_path / 'run'}"],
                            cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    ours = [line for line in result.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]
    assert ours == ["error: Could not override 'trainer.nonsense': Key 'nonsense' not in 'TrainerConfig'"], \
        result.stderr
    assert "Traceback" not in result.stdout + result.stderr and not (tmp_path / "run").exists()


def test_torchrun_exits_2_without_a_traceback_when_every_worker_reports_a_user_error(tmp_path: Path):
    result = run_recipe("fashion_mnist", ["data.root=/does/not/exist", f"run_dir={tmp_path}/run", *TINY], nproc=2)
    assert result.returncode == 2, result.stderr
    assert "error: data directory /does/not/exist does not exist" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_torchrun_exits_75_when_the_workers_themselves_get_sigterm(fashion_data: Path, tmp_path: Path):
    """As when SLURM or a process-group kill signals the workers and not the launcher: torchrun
    sees its workers exit non-zero, which it reports as a failure (exit 1)."""
    marker = tmp_path / "paused"
    launcher = start_recipe("fashion_mnist", [f"data.root={fashion_data}", f"run_dir={tmp_path}/run", *TINY,
                                              *CHAIN_SETTINGS, "trainer.epochs=2"],
                            nproc=2, env=paused_env(2, marker))
    wait_for_pause(marker, launcher)
    workers = workers_of(launcher)
    assert sorted(workers) == [0, 1]
    for pid in workers.values():
        os.kill(pid, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, output
    assert output.count("received SIGTERM: checkpoint saved at step 3") == 2, output
    assert "torchrun: all 2 worker(s) checkpointed and stopped; exiting with code 75" in output


def test_torchrun_does_not_report_75_when_a_worker_died_without_its_checkpoint(fashion_data: Path, tmp_path: Path):
    marker = tmp_path / "paused"
    launcher = start_recipe("fashion_mnist", [f"data.root={fashion_data}", f"run_dir={tmp_path}/run", *TINY,
                                              *CHAIN_SETTINGS, "trainer.epochs=2"],
                            nproc=2, env=paused_env(2, marker))
    wait_for_pause(marker, launcher)
    os.kill(workers_of(launcher)[1], signal.SIGKILL)
    launcher.send_signal(signal.SIGTERM)  # rank 0 is then told to stop, but rank 1 is gone
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 1, output
    assert "checkpointed and stopped" not in output


# A torchrun worker whose stop checkpoint takes TEST_STOP_SECONDS: on SIGTERM it takes that long,
# then records and exits with 75, as a recipe does.
SLOW_STOP_WORKER = """\
import os
import signal
import sys
import time
from pathlib import Path

from common.entry import record_exit_code

stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
Path(os.environ["TEST_READY"]).touch()
while not stop:
    time.sleep(0.1)
time.sleep(float(os.environ["TEST_STOP_SECONDS"]))
record_exit_code(75)
print("stop checkpoint written", flush=True)
sys.exit(75)
"""

# cluster/torchrun.py under an agent that closes its workers with a window of its own, shorter than
# their stop checkpoint: torch 2.11's calls close(death_sig), i.e. PContext.close's hard-coded 30 s;
# this one passes 2 s, so that the test need not outlast 30 s.
LAUNCHER_WITH_A_HARD_CODED_WINDOW = """\
import signal

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

import cluster.torchrun as launcher


def shutdown_with_a_hard_coded_window(self, death_sig=signal.SIGTERM, timeout=30):
    if self._pcontext:
        self._pcontext.close(death_sig, 2)


LocalElasticAgent._shutdown = shutdown_with_a_hard_coded_window
launcher.main()
"""


def test_torchrun_gives_the_stop_checkpoint_its_window_where_torch_hard_codes_one(tmp_path: Path):
    """A stop checkpoint longer than the window the agent hard-codes (torch 2.11: 30 s; here 2 s)
    ends with exit code 75: the launcher's window (120 s) holds there too."""
    (tmp_path / "slow_stop_worker.py").write_text(SLOW_STOP_WORKER)
    (tmp_path / "launcher.py").write_text(LAUNCHER_WITH_A_HARD_CODED_WINDOW)
    ready = tmp_path / "ready"
    env = recipe_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), TEST_READY=str(ready),
                     TEST_STOP_SECONDS="6")
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), "--standalone",
                                 "--nproc-per-node=1", "-m", "slow_stop_worker"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 75, output
    assert "stop checkpoint written" in output


# ---- the scripts and the submitit launcher config -------------------------------------------

@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shell_script_passes_bash_n_and_shellcheck(script: Path):
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    if shutil.which("shellcheck") is None:
        if os.environ.get("REQUIRE_SLURM") == "1":
            pytest.fail("shellcheck not installed (apt-get install shellcheck)")
        pytest.skip("shellcheck not installed")
    lint = subprocess.run(["shellcheck", "-x", "-s", "bash", str(script.relative_to(REPO))], cwd=REPO,
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


def test_every_recipe_has_an_sbatch_file_that_runs_it():
    recipes = sorted(p.parent.name for p in (REPO / "recipes").glob("*/train.py"))
    assert "fashion_mnist" in recipes
    for recipe in recipes:
        text = (REPO / "cluster" / "slurm" / f"{recipe}.sbatch").read_text()
        assert f"-m recipes.{recipe}.train" in text and "-m cluster.torchrun" in text, recipe
        for option in ("--requeue", "--signal=B:USR1@", "--open-mode=append", "--gpus-per-node="):
            assert f"#SBATCH {option}" in text, (recipe, option)


def test_hydra_slurm_launcher_requeues_and_keeps_run_dirs_deterministic():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from common.entry import recipe_schema, register_schema

    register_schema(recipe_schema("fashion_mnist"))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("fashion_mnist", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.partition == "gpu"
    assert launcher.max_num_timeout > 0 and launcher.signal_delay_s > 0
    assert launcher.additional_parameters.requeue is True
    sweep = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)  # a requeued job gets the same directory
    assert sweep == {"dir": "runs/${recipe}/${name}", "subdir": "${hydra.job.override_dirname}"}
