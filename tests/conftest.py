"""Shared fixtures: the repo root, tiny datasets, and running recipes as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.checkpoint.layout import STATE_FILE, committed_checkpoints, latest_checkpoint
from common.entry import exit_process
from common.pytorch import distributed
from common.pytorch.distributed import free_port
from tests import slurm_cluster as sc
from tools.processes import kill_tree
from tools.tiny_data import write_fashion_mnist

REPO = Path(__file__).resolve().parents[1]
pytest.register_assert_rewrite("tests.resume")  # the shared resume check's asserts say what failed


def _rank_process(rank: int, world_size: int, port: int, function: Callable[..., None], args: tuple) -> None:
    """One rank of :func:`spawn_ranks`: its process group set up and torn down as a recipe's is."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    distributed.init_distributed("cpu")
    try:
        function(rank, *args)
    finally:
        distributed.shutdown_distributed()
    exit_process(0)


def spawn_ranks(function: Callable[..., None], *args: object, world_size: int = 2) -> None:
    """Run ``function(rank, *args)`` in ``world_size`` fresh processes joined in a gloo group,
    ending each as a recipe's process ends (``common.entry.exit_process``); fail if any fails.
    Spawned, not forked: a child forked after earlier tests started torch's threads can deadlock."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_process, args=(world_size, free_port(), function, args), nprocs=world_size, join=True)


def recipe_env(**extra: str) -> dict[str, str]:
    """The environment recipes run in during tests: offline, 1 thread per process, no ISC paths."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("CHECKPOINT_ARTIFACT_PATH", "LOSSY_ARTIFACT_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                          "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def recipe_command(recipe: str, overrides: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", f"recipes.{recipe}.train", *overrides]
    if not any(override.startswith("device=") for override in overrides):
        overrides = ["device=cpu", *overrides]  # several ranks on gloo, whatever GPUs this machine has
    return [sys.executable, "-m", "cluster.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "-m", f"recipes.{recipe}.train", *overrides]


def run_recipe(recipe: str, overrides: list[str], nproc: int = 1, timeout: float = 300,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(recipe_command(recipe, overrides, nproc), cwd=REPO, env=env or recipe_env(),
                          capture_output=True, text=True, timeout=timeout)


def start_recipe(recipe: str, overrides: list[str], nproc: int = 1,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a run in the background; :func:`kill_run` ends it the way a lost node would."""
    return subprocess.Popen(recipe_command(recipe, overrides, nproc), cwd=REPO, env=env or recipe_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_run(process: subprocess.Popen) -> None:
    """SIGKILL a run started by :func:`start_recipe` (launcher, every rank, every data worker),
    with no clean-up anywhere, and wait until none of its processes can run any more."""
    killed = kill_tree(process.pid)
    process.wait()
    deadline = time.monotonic() + 30
    for pid in killed - {process.pid}:
        stat = Path(f"/proc/{pid}/stat")
        while time.monotonic() < deadline:
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
            except (OSError, IndexError):
                break
            time.sleep(0.01)


def latest_step(checkpoint_dir: Path) -> int:
    """The step of the checkpoint the latest_checkpoint symlink points at; -1 before the first."""
    latest = latest_checkpoint(checkpoint_dir)
    return -1 if latest is None else latest.step


def checkpoint_of_step(checkpoint_dir: Path, step: int) -> Path:
    """The newest committed checkpoint directory of ``step``."""
    found = [found_dir.path for found_dir in committed_checkpoints(checkpoint_dir) if found_dir.step == step]
    assert found, f"no checkpoint of step {step} in {checkpoint_dir}"
    return found[-1]


def sampler_positions(checkpoint_dir: Path) -> list[dict[str, int]]:
    """The sampler state recorded in the committed checkpoints of ``checkpoint_dir``, one per step
    (a step saved twice, at an epoch's end and again with its evaluation, by its newer save):
    ``{"step", "epoch", "consumed", "world_size", ...}``. ``consumed`` counts the positions of the
    epoch's global order done by all ranks together, so a chain of these shows which samples each
    step took. Uncommitted checkpoints are not listed."""
    import torch

    by_step = {}
    for found in committed_checkpoints(checkpoint_dir):
        state = torch.load(found.path / STATE_FILE, map_location="cpu", weights_only=True)
        by_step[found.step] = {"step": found.step, **state["sampler"]}
    return [by_step[step] for step in sorted(by_step)]


def wait_for_step(checkpoint_dir: Path, step: int, process: subprocess.Popen, timeout: float = 120) -> int:
    """Poll until a checkpoint at ``step`` or later exists; fail if the run ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reached = latest_step(checkpoint_dir)
        if reached >= step:
            return reached
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            pytest.fail(f"the run ended (code {process.returncode}) before step {step}:\n{output[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"no checkpoint at step {step} within {timeout} s")


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\n"
                                    f"stderr:\n{result.stderr[-3000:]}")


# Under pytest-xdist (make test: --dist loadgroup), each of these groups of test modules runs in one
# worker, which builds their shared session fixtures once (each worker would build its own): the
# one-node local SLURM (with the search's SLURM array), the two-node one, the trained runs, studies
# and gradients several tests of a module read. No group is larger than it must be: a group's tests
# run one after another, and the suite cannot end before its largest group. xdist's own
# xdist_group markers are not used: xdist 3.8 applies them by renaming item._nodeid, which pytest 9
# no longer reads.
WORKER_GROUPS = {
    "slurm": ("test_cluster", "test_local_slurm", "test_search_slurm"),
    "multinode": ("test_multinode",),
    "search": ("test_search",),
    "trained_runs": ("test_evaluate", "test_export", "test_init_from", "test_predict", "test_average"),
    "dinov2_fsdp": ("test_dinov2_fsdp",),
    "fungitastic": ("test_fungitastic",),
    "cifar100_resnet50": ("test_cifar100_resnet50",),
    "gradient_equivalence": ("test_gradient_equivalence",),
    "fsdp": ("test_fsdp",),
    "records": ("test_records",),
}
_GROUP_OF_MODULE = {module: group for group, modules in WORKER_GROUPS.items() for module in modules}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadgroup``: xdist's scope scheduling, a scope being a group of
    :data:`WORKER_GROUPS` or else a single test (the largest groups are handed out first)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkerGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _GROUP_OF_MODULE.get(Path(nodeid.split("::", 1)[0]).stem, nodeid)

    return WorkerGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` first, the order otherwise kept: under xdist they are handed out
    right after the worker groups, and the suite does not end with one worker on a long chain
    while the other has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fashion_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Fashion-MNIST in the original IDX format (256 train, 64 test images)."""
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion_mnist"))


# A requeued job may start again after 5 s, SLURM's least (the script's default is 10 s).
REQUEUE_SOONER = {"LOCAL_SLURM_REQUEUE_DELAY": "5"}


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory: pytest.TempPathFactory):
    """One real local SLURM cluster for the whole session (skipped, or failed under REQUIRE_SLURM=1, without it)."""
    sc.require_slurm_or_skip()
    with sc.running_local_slurm(tmp_path_factory.mktemp("slurm"), extra_env=REQUEUE_SOONER) as env:
        yield env


@pytest.fixture(scope="session")
def multinode_slurm(tmp_path_factory: pytest.TempPathFactory):
    """A real two-node local SLURM for the whole session, each slurmd in its own network, UTS and
    mount namespace (skipped where namespaces are not permitted, failed under REQUIRE_MULTINODE=1)."""
    sc.require_multinode_or_skip(nodes=2)
    state = tmp_path_factory.mktemp("slurm2")
    with sc.running_local_slurm(state, nodes=2, extra_env=REQUEUE_SOONER) as env:
        yield sc.LocalCluster(env=env, state_dir=state, nodes=("node0", "node1"))

