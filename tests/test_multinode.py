"""Several SLURM nodes on this machine, for real: multinode.sbatch and launch.sh across nodes.

The session fixture ``multinode_slurm`` starts ``tools/slurm_local_cluster.sh start --nodes 2``:
one slurmctld and two slurmd, each in its own network namespace (its own address on a bridge),
UTS namespace (hostname node0 or node1) and mount namespace (its own /etc/hosts and scratch
folder, its TMPDIR). The jobs submit the real ``cluster/slurm/multinode.sbatch``: srun starts
torchrun on each node, the c10d rendezvous is at the first node's NodeAddr, gloo on CPU.

The SLURM scenarios run side by side, each in a thread of one session fixture (SLURM queues what
does not fit on the nodes), and the tests check what each recorded. Where namespaces are not
permitted they skip, and REQUIRE_MULTINODE=1 (CI) makes that a failure.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import slurm_cluster as sc
from tests.conftest import REPO, free_port, latest_step, read_summary, recipe_env, sampler_positions, start_recipe
from tests.resume import paused_env
from tools.processes import kill_tree
from tools.tiny_data import write_fashion_mnist, write_image_folder

pytestmark = pytest.mark.slurm

MULTINODE = REPO / "cluster" / "slurm" / "multinode.sbatch"
SAMPLES = 2048  # 32 steps an epoch on 2 nodes, 64 on 1
BATCH = 32
TINY = ["model.channels=[4,8]", "model.hidden=16", f"trainer.batch_size={BATCH}", "logging.backend=none",
        "logging.progress_bar=false"]
# A checkpoint after every step, and stop decisions every step, so signals land mid-epoch.
TRAIN = [*TINY, "trainer.epochs=2", "checkpoint.every_steps=1", "checkpoint.sync_every_steps=1"]
# Submit-time options replace the file's site lines: no GPUs and one CPU per node.
OPTIONS = ["--gpus-per-node=0", "--cpus-per-task=1"]
SCENARIO_DEADLINE_S = 420
PAUSE_VARIABLES = ("PYTHONPATH", "PAUSE_AT_STEP", "PAUSE_MARKER", "PAUSE_HOW")  # what a job needs of paused_env


def job_env(cluster: sc.LocalCluster, **extra: str) -> dict[str, str]:
    return recipe_env(PYTHON=sys.executable, **cluster.env, **extra)


@dataclass
class Job:
    id: str
    run_dir: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def submit(cluster: sc.LocalCluster, tmp: Path, name: str, nodes: int, overrides: list[str],
           options: tuple[str, ...] = ("--time=10",), run_dir: Path | None = None, recipe: str = "fashion_mnist",
           **env: str) -> Job:
    run_dir = run_dir or tmp / name
    job = sc.sbatch(MULTINODE, args=[*OPTIONS, f"--nodes={nodes}", *options, f"--output={tmp}/{name}-%j.out"],
                    env=job_env(cluster, **env), cwd=REPO,
                    script_args=[recipe, *overrides, f"run_dir={run_dir}"])
    return Job(job, run_dir, tmp / f"{name}-{job}.out")


def wait_until(condition: Callable[[], object], what: str, job: Job, env: dict[str, str],
               timeout_s: float = SCENARIO_DEADLINE_S) -> object:
    """Poll ``condition`` until it returns something true; fail if the job ends first or time runs out
    (the deadline includes time in the queue: the scenarios share two nodes of two CPUs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        state = sc.job_state(job.id, env)
        assert state not in sc.FINAL_STATES, f"job {job.id} ended ({state}) before {what}:\n{job.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{job.output()[-3000:]}"
        time.sleep(0.1)


def stops_at(output: str) -> dict[str, int]:
    """The step at which each task (= node, one process per node) checkpointed on its own SIGUSR1."""
    return {task: int(step) for task, step in
            re.findall(r"^(\d+): received SIGUSR1: checkpoint saved at step (\d+)", output, re.MULTILINE)}


def kill_node_running_rank(job_id: str, rank: int) -> str:
    """SIGKILL the torchrun of the node that runs ``rank`` of the job together with its workers, all
    at once, with no clean-up (what losing that node does to the training); returns the node."""
    for environ_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            environ = dict(item.split("=", 1) for item in environ_file.read_bytes().decode(errors="replace")
                           .split("\0") if "=" in item)
            stat = (environ_file.parent / "stat").read_text()
        except OSError:
            continue
        if (environ.get("SLURM_JOB_ID") == job_id and environ.get("RANK") == str(rank)
                and "TORCHELASTIC_RUN_ID" in environ):
            kill_tree(int(stat.rsplit(")", 1)[1].split()[1]))  # the worker's parent: that node's torchrun
            return environ["SLURMD_NODENAME"]
    raise AssertionError(f"no process of rank {rank} of job {job_id} found")


def assert_every_sample_once(positions: list[dict[str, int]]) -> None:
    """Each step took the next ``BATCH x world size`` positions of its epoch's global order (the last
    step of an epoch took the rest): no position skipped, none taken twice, across any resume."""
    steps = [p["step"] for p in positions]
    assert steps == list(range(1, steps[-1] + 1)), f"a step has no checkpoint: {steps}"
    for before, after in zip(positions, positions[1:]):
        took = BATCH * after["world_size"]
        if after["epoch"] == before["epoch"]:
            assert after["consumed"] == before["consumed"] + took, (before, after)
        else:
            assert after["epoch"] == before["epoch"] + 1 and after["consumed"] == 0, (before, after)
            assert 0 < SAMPLES - before["consumed"] <= took, (before, after)


# ---- the nodes ----------------------------------------------------------------------------

def test_nodes_look_like_separate_hosts(multinode_slurm: sc.LocalCluster, tmp_path: Path):
    cluster = multinode_slurm
    assert sc.node_states(cluster.env) == {"node0": "idle", "node1": "idle"}
    addrs = {node: sc.node_addr(node, cluster.env) for node in cluster.nodes}
    assert len(set(addrs.values())) == 2 and not any(a.startswith("127.") for a in addrs.values())
    probe = ("echo $(hostname) $(hostname -I) $(getent hosts node0 node1) TMPDIR=$TMPDIR; "
             "touch $TMPDIR/seen-by-$(hostname)")
    result = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "bash", "-c", probe],
                            env=sc.slurm_env(cluster.env), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Its own hostname and address; every node resolves every node's name to its NodeAddr.
    hosts = [addrs["node0"], "node0", addrs["node1"], "node1"]
    scratch = cluster.state_dir / "scratch"
    assert sorted(line.split() for line in result.stdout.splitlines()) == [
        [node, addrs[node], *hosts, f"TMPDIR={scratch}"] for node in cluster.nodes], result.stdout
    # One TMPDIR path, a different folder behind it on each node (where earlier tests' jobs left files too).
    for node in cluster.nodes:
        assert sorted(p.name for p in cluster.scratch(node).glob("seen-by-*")) == [f"seen-by-{node}"]
        (cluster.scratch(node) / f"seen-by-{node}").unlink()


def _tag(state_dir: Path) -> str:
    """The tag slurm_local_cluster.sh puts in the names of a cluster's namespaces and links."""
    return hashlib.md5(str(state_dir.resolve()).encode()).hexdigest()[:8]


def _leftovers(state_dir: Path, pids: set[int], mount_namespaces: set[str]) -> list[str]:
    """What of the cluster in ``state_dir`` still exists: namespaces, links, processes, mounts."""
    tag = _tag(state_dir)
    found = [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
             .splitlines() if tag in line]
    found += [line for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
              .splitlines() if tag in line]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            text = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
            mount_namespace = (proc / "ns" / "mnt").readlink().name
        except OSError:
            continue
        if int(proc.name) in pids or str(state_dir).encode() in text or mount_namespace in mount_namespaces:
            found.append(f"process {proc.name}: {(proc / 'cmdline').read_bytes()[:200]!r}")
    found += [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(state_dir) in line]
    return found


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path: slurmstepd's socket paths in a cluster's state dir must fit in 108
    bytes, and pytest's ``tmp_path`` under an xdist worker (``.../popen-gw0/<test name>``) does not."""
    with tempfile.TemporaryDirectory(prefix="lc", dir="/tmp") as folder:
        yield Path(folder)


def test_stop_removes_everything_also_after_a_failed_start(multinode_slurm: sc.LocalCluster, short_dir: Path,
                                                           tmp_path: Path):
    state = short_dir / "c"
    failed = subprocess.run(["bash", str(sc.SCRIPT), "start", "--nodes", "2", str(state)], capture_output=True,
                            text=True, env=sc.script_env({"LOCAL_SLURM_TIMEOUT": "0"}), timeout=120)
    assert failed.returncode == 1
    assert "error: not all 2 node(s) idle after 0s" in failed.stderr.strip().splitlines()[-1], failed.stderr
    assert _leftovers(state, set(), set()) == []

    with sc.running_local_slurm(state, nodes=2) as env:
        pids = {int((state / "run" / f"slurmd-{node}.pid").read_text()) for node in ("node0", "node1")}
        mount_namespaces = {Path(f"/proc/{pid}/ns/mnt").readlink().name for pid in pids}
        assert len(mount_namespaces) == 2
        job = sc.sbatch(args=["--nodes=2", "--output=/dev/null", "--wrap", "srun sleep 300"], env=env, cwd=tmp_path)
        assert sc.wait_for_state(job, ["RUNNING"], timeout_s=60, env=env) == "RUNNING"
        assert _leftovers(state, pids, mount_namespaces) != []
    assert _leftovers(state, pids, mount_namespaces) == []


def test_without_namespace_capabilities_start_stops_first_with_one_line(tmp_path: Path):
    sc.require_slurm_or_skip()
    drop = ["setpriv", "--bounding-set=-sys_admin,-net_admin"]  # root, but as in an unprivileged container
    result = subprocess.run([*drop, "bash", str(sc.SCRIPT), "start", "--nodes", "2", str(tmp_path / "c")],
                            capture_output=True, text=True, env=sc.script_env(), timeout=60)
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"{sc.SCRIPT.name}: error: cannot create network namespaces"), result.stderr
    assert "CAP_SYS_ADMIN and CAP_NET_ADMIN" in result.stderr
    assert list((tmp_path / "c").iterdir()) == []  # checked before anything was made


# ---- the SLURM scenarios, side by side -------------------------------------------------------

def preempted_and_single_node(cluster: sc.LocalCluster, tmp: Path, data: Path) -> dict:
    """A 2-node job that stages its data to each node's scratch and is sent USR1 with `scancel
    --signal=USR1 --batch` mid-run; and the same config as 2 processes on one node, without SLURM."""
    overrides = [f"data.root={data}", *TRAIN]
    # The job waits after its step-2 checkpoint until the signal reaches it, so that a fast machine
    # cannot finish the run first (and its staged copies are there to be seen meanwhile).
    pause = paused_env(2, tmp / "preempted.paused")
    preempted = submit(cluster, tmp, "preempted", 2, overrides, STAGE_DATA="1",
                       **{name: pause[name] for name in PAUSE_VARIABLES})
    single_node = start_recipe("fashion_mnist", [*overrides, f"run_dir={tmp / 'single_node'}"], nproc=2)
    copies_seen: set[str] = set()
    signalled_at = None
    deadline = time.monotonic() + SCENARIO_DEADLINE_S
    while sc.job_state(preempted.id, cluster.env) not in sc.FINAL_STATES:
        assert time.monotonic() < deadline, f"job {preempted.id} not done in {SCENARIO_DEADLINE_S} s"
        for node in cluster.nodes:
            if any(cluster.scratch(node).glob(f"recipes-*-{preempted.id}/train-images-idx3-ubyte")):
                copies_seen.add(node)
        if signalled_at is None and (tmp / "preempted.paused").exists():
            signalled_at = latest_step(preempted.run_dir / "checkpoints")
            sc.signal_batch(preempted.id, "USR1", env=cluster.env)
        time.sleep(0.1)
    single_node_output = single_node.communicate(timeout=300)[0]
    assert single_node.returncode == 0, single_node_output
    return {
        "preempted": preempted, "copies_seen": copies_seen, "signalled_at": signalled_at,
        "single_node": read_summary(tmp / "single_node"),
        "state": sc.job_state(preempted.id, cluster.env), "restarts": sc.job_restart_count(preempted.id, cluster.env),
        "scratch_left": {node: sorted(p.name for p in cluster.scratch(node).iterdir()) for node in cluster.nodes},
    }


def from_shards(cluster: sc.LocalCluster, tmp: Path, data: Path) -> dict:
    """A 2-node timm_imagenet job reading its images from shards through a file:// remote, each node
    through its own cache in its own TMPDIR, sent USR1 after its step-2 checkpoint: it requeues and
    resumes. And the same config as 2 processes on one node without SLURM, reading the loose files.
    (``data`` is the fashion_mnist of the other scenarios; this one makes a tiny ImageFolder.)"""
    from tests.trained_runs import TINY as TINY_RUNS

    root = write_image_folder(tmp / "imagenet", train_per_class=8, val_per_class=3)
    prep = subprocess.run([sys.executable, "-m", "data_prep.timm_imagenet", "--out", str(root), "--format", "shards",
                           "--workers", "1"], cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr  # litdata writes shards from a main thread: not in this one
    overrides = [*TINY_RUNS["timm_imagenet"], "trainer.batch_size=4", "trainer.epochs=2", "checkpoint.every_steps=1",
                 "checkpoint.sync_every_steps=1"]
    pause = paused_env(2, tmp / "shards.paused")
    shards = ["data.format=shards", f"data.shards.root=file://{root}/shards"]
    job = submit(cluster, tmp, "shards", 2, [*overrides, *shards], recipe="timm_imagenet", DATA_ROOT=str(root),
                 **{name: pause[name] for name in PAUSE_VARIABLES})
    files = start_recipe("timm_imagenet", [f"data.root={root}", *overrides, f"run_dir={tmp / 'shards_files'}"], nproc=2)
    signalled = False
    deadline = time.monotonic() + SCENARIO_DEADLINE_S
    while sc.job_state(job.id, cluster.env) not in sc.FINAL_STATES:
        assert time.monotonic() < deadline, f"job {job.id} not done in {SCENARIO_DEADLINE_S} s"
        if not signalled and (tmp / "shards.paused").exists():
            sc.signal_batch(job.id, "USR1", env=cluster.env)
            signalled = True
        time.sleep(0.1)
    files_output = files.communicate(timeout=300)[0]
    assert files.returncode == 0, files_output
    return {"job": job, "state": sc.job_state(job.id, cluster.env),
            "restarts": sc.job_restart_count(job.id, cluster.env), "files": read_summary(tmp / "shards_files"),
            "cached": {node: sorted(path.name for path in cluster.scratch(node).rglob("chunk-*.bin"))
                       for node in cluster.nodes}}


def time_limited(cluster: sc.LocalCluster, tmp: Path, data: Path) -> dict:
    """A 2-node job that would train far longer than the test waits, submitted with a 10-minute
    limit and --signal=B:USR1@170. Once it has checkpointed step 1 (where it waits for the signal,
    rather than keep two CPUs busy), the limit is cut to 3 minutes, which makes the warning due at
    once: SLURM sends USR1 to the batch shell at its next time-limit check (it checks every 30 s).
    The job checkpoints and requeues; while it waits, the limit goes back to 10 minutes, so the
    requeued job is not signalled again; it is cancelled once it has resumed."""
    pause = paused_env(1, tmp / "time_limit.paused")
    job = submit(cluster, tmp, "time_limit", 2, [f"data.root={data}", *TRAIN, "trainer.epochs=1000"],
                 options=("--time=10", "--signal=B:USR1@170"), **{name: pause[name] for name in PAUSE_VARIABLES})
    checkpoints = job.run_dir / "checkpoints"
    try:
        wait_until(lambda: latest_step(checkpoints) >= 1, "a checkpoint", job, cluster.env)
        sc.update_job(job.id, cluster.env, TimeLimit="3")
        wait_until(lambda: sc.job_restart_count(job.id, cluster.env) >= 1, "the requeue", job, cluster.env, 120)
        sc.update_job(job.id, cluster.env, TimeLimit="10")
        resumed = wait_until(lambda: re.search(r"resumed from \S+ \(step (\d+), ", job.output()),
                             "the resume", job, cluster.env)
    finally:
        sc.cancel(job.id, cluster.env)
    output = job.output()
    return {"job": job, "output": output, "first_segment": output[:output.index("start (restart 1)")],
            "resumed_at": int(resumed.group(1)), "restarts": sc.job_restart_count(job.id, cluster.env)}


def resized_and_node_killed(cluster: sc.LocalCluster, tmp: Path, data: Path) -> dict:
    """A run that starts on 1 node, is pre-empted mid-epoch and requeued onto 2 nodes
    (`scontrol update NumNodes=2-2`), loses the node running rank 0 to a SIGKILL mid-epoch, and
    is finished by a new 1-node job with the same run_dir."""
    overrides = [f"data.root={data}", *TRAIN, "checkpoint.keep_last=1000"]
    checkpoints = tmp / "resized" / "checkpoints"
    first = submit(cluster, tmp, "resized", 1, overrides)
    try:
        wait_until(lambda: latest_step(checkpoints) >= 3, "a checkpoint at step 3", first, cluster.env)
        sc.signal_batch(first.id, "USR1", env=cluster.env)
        wait_until(lambda: sc.job_restart_count(first.id, cluster.env) == 1, "the requeue", first, cluster.env)
        sc.update_job(first.id, cluster.env, NumNodes="2-2")  # within the 5 s the requeued job waits
        resumed_at = wait_until(lambda: re.findall(r"resumed from \S+ \(step (\d+), ", first.output()),
                                "the resume on 2 nodes", first, cluster.env)
        resumed_at = int(resumed_at[0])
        wait_until(lambda: latest_step(checkpoints) >= resumed_at + 3, "3 steps on 2 nodes", first, cluster.env)
        killed_node = kill_node_running_rank(first.id, 0)
        first_state = sc.wait_for_job(first.id, timeout_s=180, env=cluster.env)
    finally:
        sc.cancel(first.id, cluster.env)  # a no-op when it has ended; frees the nodes when it has not
    complete_after_kill = [p["step"] for p in sampler_positions(checkpoints)]
    second = submit(cluster, tmp, "resized-again", 1, overrides, run_dir=tmp / "resized")
    second_state = sc.wait_for_job(second.id, timeout_s=SCENARIO_DEADLINE_S, env=cluster.env)
    return {
        "first": first, "second": second, "first_state": first_state, "second_state": second_state,
        "first_restarts": sc.job_restart_count(first.id, cluster.env), "killed_node": killed_node,
        "complete_after_kill": complete_after_kill, "positions": sampler_positions(checkpoints),
    }


@pytest.fixture(scope="session")
def scenarios(multinode_slurm: sc.LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every scenario's record, or the exception that ended it (raised again by its tests)."""
    tmp = tmp_path_factory.mktemp("multinode")
    data = write_fashion_mnist(tmp / "data", n_train=SAMPLES)
    runs = {"preemption": preempted_and_single_node, "time_limit": time_limited,
            "resize": resized_and_node_killed, "shards": from_shards}
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(run, multinode_slurm, tmp, data) for name, run in runs.items()}
        return {name: future.exception() or future.result() for name, future in futures.items()}


def record(scenarios: dict, name: str) -> dict:
    if isinstance(scenarios[name], BaseException):
        raise scenarios[name]
    return scenarios[name]


@pytest.mark.slow
def test_two_node_job_meets_at_the_first_node_and_ends_like_a_two_process_single_node_run(
        scenarios: dict, multinode_slurm: sc.LocalCluster):
    """The pre-empted and requeued 2-node job's model is the 2-process single-node run's: the nodes'
    rendezvous, the staging and the requeue change nothing the training computes."""
    run = record(scenarios, "preemption")
    preempted = run["preempted"]
    output = preempted.output()
    assert run["state"] == "COMPLETED", output
    head_addr = sc.node_addr("node0", multinode_slurm.env)
    assert re.search(rf"rendezvous at node0 \({re.escape(head_addr)}:\d+\)", output), output
    summary = read_summary(preempted.run_dir)
    assert summary["world_size"] == 2 and summary["steps"] == 64
    assert run["single_node"]["world_size"] == 2 and run["single_node"]["resumes"] == 0
    assert summary["model_digest"] == run["single_node"]["model_digest"]


def test_staged_data_is_on_each_nodes_own_disk_and_removed_on_exit_and_requeue(scenarios: dict):
    run = record(scenarios, "preemption")
    assert run["copies_seen"] == {"node0", "node1"}  # each node's own scratch folder held a copy
    preempted = run["preempted"].output()
    requeued = preempted.index("requeueing")
    before_requeue, after_requeue = preempted[:requeued], preempted[preempted.index("start (restart 1)"):]
    for node in ("node0", "node1"):
        # Staged by the first segment, removed on every node before the requeue, staged again by the
        # requeued job and removed when it ends.
        assert re.search(rf"^staged \S+ on {node}$", before_requeue, re.MULTILINE), preempted
        assert re.search(rf"^removed \S+ on {node}$", before_requeue, re.MULTILINE), preempted
        assert re.search(rf"^staged \S+ on {node}$", preempted[requeued:], re.MULTILINE), preempted
        assert re.search(rf"^removed \S+ on {node}$", after_requeue, re.MULTILINE), preempted
    # torchrun leaves its own empty torchelastic_* folders in TMPDIR; the staged data is gone.
    assert {node: [name for name in names if name.startswith("recipes-")]
            for node, names in run["scratch_left"].items()} == {"node0": [], "node1": []}


def test_usr1_reaches_every_rank_on_every_node_and_the_job_requeues_and_resumes_there(scenarios: dict):
    run = record(scenarios, "preemption")
    preempted = run["preempted"]
    output = preempted.output()
    assert run["state"] == "COMPLETED" and run["restarts"] == 1, output
    first_segment = output[:output.index("start (restart 1)")]
    stops = stops_at(first_segment)
    assert stops.keys() == {"0", "1"} and len(set(stops.values())) == 1, first_segment  # one checkpoint, together
    step = stops["0"]
    assert run["signalled_at"] == 2 and step == 3
    assert re.search(rf"resumed from \S+ \(step {step}, ", output[output.index("start (restart 1)"):]), output
    summary = read_summary(preempted.run_dir)
    assert summary["resumes"] == 1 and summary["steps"] == 64 and summary["world_size"] == 2


def test_time_limit_signal_reaches_every_rank_on_every_node_and_the_job_requeues_and_resumes(scenarios: dict):
    run = record(scenarios, "time_limit")
    first_segment = run["first_segment"]
    assert "got SIGUSR1: asking the training to checkpoint and stop" in first_segment, first_segment
    stops = stops_at(first_segment)
    assert stops.keys() == {"0", "1"} and len(set(stops.values())) == 1, first_segment  # one checkpoint, together
    assert run["resumed_at"] == stops["0"] and run["restarts"] == 1, run["output"]


def test_run_resized_from_one_to_two_nodes_resumes_mid_epoch_with_every_sample_once(scenarios: dict):
    run = record(scenarios, "resize")
    positions = run["positions"]
    assert run["first_restarts"] == 1
    first_on_two = next((p for p in positions if p["world_size"] == 2), None)
    assert first_on_two is not None, positions
    before = positions[positions.index(first_on_two) - 1]
    assert before["world_size"] == 1 and 0 < before["consumed"] < SAMPLES  # a 1-node checkpoint mid-epoch
    assert first_on_two["epoch"] == before["epoch"]
    assert_every_sample_once(positions)


def test_node_failure_leaves_no_half_checkpoint_and_a_one_node_job_finishes_the_run(scenarios: dict):
    run = record(scenarios, "resize")
    first, second = run["first"], run["second"]
    assert run["killed_node"] in ("node0", "node1")
    assert run["first_state"] == "FAILED", first.output()[-3000:]
    assert run["second_state"] == "COMPLETED", second.output()[-3000:]
    # The new job resumed from the newest complete checkpoint the failed job left.
    resumed = re.search(r"resumed from \S+ \(step (\d+), ", second.output())
    assert resumed and int(resumed.group(1)) == max(run["complete_after_kill"]), second.output()
    positions = {p["step"]: p for p in run["positions"]}
    at_resume = positions[int(resumed.group(1))]
    assert at_resume["world_size"] == 2 and 0 < at_resume["consumed"] < SAMPLES  # 2 nodes -> 1, mid-epoch
    assert positions[int(resumed.group(1)) + 1]["world_size"] == 1
    assert_every_sample_once(run["positions"])
    summary = read_summary(first.run_dir)
    assert summary["world_size"] == 1 and summary["epochs"] == 2 and summary["resumes"] == 2


def test_two_node_job_on_shards_caches_them_on_each_node_and_resumes_after_a_requeue_to_the_model_of_files(
        scenarios: dict):
    """Each node read the shards into its own cache; the job requeued after USR1, resumed on both
    nodes, and ended with the model of 2 processes on one node reading the loose files."""
    run = record(scenarios, "shards")
    output = run["job"].output()
    assert run["state"] == "COMPLETED" and run["restarts"] == 1, output
    resumed = output[output.index("start (restart 1)"):]
    assert re.search(r"resumed from \S+ \(step 3, ", resumed), output
    assert "train: 24 images in 1 shards" in output and "cached in " in output, output
    summary = read_summary(run["job"].run_dir)
    assert summary["world_size"] == 2 and summary["resumes"] == 1 and summary["steps"] == 6
    assert summary["model_digest"] == run["files"]["model_digest"]
    assert summary["metrics"] == run["files"]["metrics"]
    assert all(run["cached"][node] for node in ("node0", "node1")), run["cached"]


def test_srun_without_torchrun_meets_at_the_first_nodes_address(multinode_slurm: sc.LocalCluster):
    """common.pytorch.distributed under plain `srun` (no torchrun): rank 0 is on the first node, and every
    rank reaches it at that node's NodeAddr."""
    code = ("import os, torch, torch.distributed as dist; "
            "from common.pytorch.distributed import init_distributed, shutdown_distributed; "
            "info = init_distributed('cpu'); total = torch.tensor([info.rank + 1]); dist.all_reduce(total); "
            "print(os.environ['SLURMD_NODENAME'], info.launcher, info.rank, info.world_size, "
            "os.environ['MASTER_ADDR'], total.item()); shutdown_distributed()")
    result = subprocess.run(["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", sys.executable, "-c", code],
                            env=sc.slurm_env(recipe_env(**multinode_slurm.env)), cwd=REPO, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    head = sc.node_addr("node0", multinode_slurm.env)
    assert sorted(result.stdout.splitlines()) == [f"node0 slurm 0 2 {head} 3", f"node1 slurm 1 2 {head} 3"]


# ---- cluster/launch.sh on two namespaced nodes ------------------------------------------------

def launch_on(cluster: sc.LocalCluster, node: str, args: list[str], log_dir: Path, **env: str) -> subprocess.Popen:
    return sc.on_node(cluster.state_dir, node, ["bash", str(REPO / "cluster" / "launch.sh"), *args], cwd=REPO,
                      env=recipe_env(PYTHON=sys.executable, LOG_DIR=str(log_dir), NPROC_PER_NODE="1",
                                     BACKEND="gloo", **env))


@pytest.mark.slow
def test_launch_on_two_nodes_node1_reaches_node0_by_its_address(multinode_slurm: sc.LocalCluster, tmp_path: Path):
    cluster = multinode_slurm
    data = write_fashion_mnist(tmp_path / "data")
    head = sc.node_addr("node0", cluster.env)
    port = str(free_port())
    overrides = ["--", f"data.root={data}", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=6", *TINY]
    nodes = [launch_on(cluster, f"node{rank}", ["fashion_mnist", "2", str(rank), head, port, *overrides],
                       tmp_path / "logs", CONNECT_TIMEOUT="120") for rank in (0, 1)]
    outputs = [node.communicate(timeout=400)[0] for node in nodes]

    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    assert "preflight: master port: port" in outputs[0]
    assert f"preflight: master reachable: {head}:{port} reachable" in outputs[1]
    assert "all-reduce (gloo) across 2 ranks: ok" in outputs[0]
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["steps"] == 6
    for rank in (0, 1):
        latest = tmp_path / "logs" / f"latest_node{rank}.log"
        assert latest.is_symlink() and latest.resolve().name.endswith(f"-node{rank}.log")
        assert "preflight: config: fashion_mnist config resolves" in latest.read_text()


def test_launch_on_a_node_whose_master_port_is_closed_fails_with_one_clear_line(
    multinode_slurm: sc.LocalCluster, tmp_path: Path,
):
    head = sc.node_addr("node0", multinode_slurm.env)
    port = str(free_port())  # nobody listens on it on node0
    node = launch_on(multinode_slurm, "node1", ["fashion_mnist", "2", "1", head, port, "--", *TINY],
                     tmp_path / "logs", CONNECT_TIMEOUT="2")
    output = node.communicate(timeout=120)[0]

    assert node.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot reach the master at {head}:{port} over TCP within 2 s"), output
    assert "Traceback" not in output
