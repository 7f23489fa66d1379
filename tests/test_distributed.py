"""Distributed pieces of common/: launch detection, exact metric reduction, agreed stop decisions."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.config import CheckpointConfig
from common.errors import UserError
from common.pytorch import distributed
from common.pytorch.metrics import SumMetrics, ratio
from common.pytorch.optim import accumulation_steps, scaled_lr
from common.run.cadence import NONE, CheckpointCadence, StopSignals
from tests.conftest import free_port, spawn_ranks


def test_torchrun_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert distributed._launch_env() == (3, 4, 1, "torchrun")


def test_srun_without_torchrun_uses_slurm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # _launch_env sets MASTER_ADDR and MASTER_PORT itself; patch.dict removes them afterwards, which
    # monkeypatch.delenv does not do for a variable that was not set before the test.
    with mock.patch.dict(os.environ):
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_NODELIST",
                    "SLURM_NODELIST"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("SLURM_PROCID", "5")
        monkeypatch.setenv("SLURM_NTASKS", "8")
        monkeypatch.setenv("SLURM_LOCALID", "1")
        monkeypatch.setenv("SLURM_JOB_ID", "1234")
        monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3")
        assert distributed._launch_env() == (5, 8, 1, "slurm")
        assert os.environ["MASTER_ADDR"] == "10.1.2.3"
        assert os.environ["MASTER_PORT"] == str(20000 + 1234)


def test_neither_means_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    info = distributed.init_distributed("cpu")
    assert (info.rank, info.world_size, info.launcher, info.device.type) == (0, 1, "single", "cpu")
    assert not dist.is_initialized()


def test_asking_for_cuda_without_a_gpu_is_a_user_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match="no CUDA GPU"):
        distributed.resolve_device("cuda")


@pytest.fixture
def one_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CUDA reported present with one GPU; returns the indices ``set_device`` was called with."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_more_processes_on_a_node_than_gpus_is_refused_in_one_line(one_fake_gpu: list[int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for local_rank in (0, 1):  # every rank says so, not only the one without a GPU
        with pytest.raises(UserError, match=r"^2 processes on this node but 1 GPU\(s\) visible: start at most 1 "):
            distributed.resolve_device("auto", local_rank, "torchrun")
    assert one_fake_gpu == []
    assert distributed.resolve_device("cpu", 1, "torchrun") == torch.device("cpu")


def test_one_process_per_gpu_takes_its_local_rank(one_fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert distributed.resolve_device("cuda", 0, "torchrun") == torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # srun --gpus-per-task=1: task 3 of a node sees only its own GPU, as device 0.
    assert distributed.resolve_device("cuda", 3, "slurm") == torch.device("cuda", 0)
    assert one_fake_gpu == [0, 0]


def test_process_group_backends() -> None:
    assert distributed.process_group_backend(torch.device("cpu")) == "gloo"
    assert distributed.process_group_backend(torch.device("cuda", 0)) == "nccl"
    # FSDP2's CPU offload with gradient clipping reduces host tensors: gloo beside nccl.
    assert distributed.process_group_backend(torch.device("cuda", 0), cpu_collectives=True) == "cpu:gloo,cuda:nccl"


def test_accumulation_and_lr_scaling_rules() -> None:
    assert accumulation_steps(0, 32, 4) == 1
    assert accumulation_steps(256, 32, 2) == 4
    assert accumulation_steps(256, 32, 8) == 1
    with pytest.raises(UserError, match="not a multiple"):
        accumulation_steps(256, 48, 2)
    assert scaled_lr(0.1, 512, 256, "linear") == pytest.approx(0.2)
    assert scaled_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 1024, 256, "none") == 0.1


def _worker(rank: int, results: Path, main_backend: str) -> None:
    if main_backend == "nccl":  # what the cadence sees on GPUs: it must agree over a gloo group of its own
        dist.get_backend = lambda group=None: "nccl"
    # Rank 0 sees 1 sample, all correct; rank 1 sees 3, none correct. The exact accuracy is
    # 1/4; an average of rank averages would say 1/2.
    sums = SumMetrics(torch.device("cpu"))
    if rank == 0:
        sums.add(correct=torch.tensor([1]), count=1)
    else:
        sums.add(correct=torch.tensor([0, 0, 0]), count=3)
    accuracy = ratio(sums.reduce(), "correct", "count")

    # Only rank 1 receives the signal, during step 3; with checks every 2 steps both ranks
    # must decide to save and stop at step 4, neither earlier.
    flag = StopSignals()
    cadence = CheckpointCadence(CheckpointConfig(every_steps=0, every_seconds=0, sync_every_steps=2), flag)
    assert (cadence.group is None) == (main_backend == "gloo")
    stopped_at = None
    for step in range(1, 9):
        if rank == 1 and step == 3:
            flag.signal_name = "SIGUSR1"
        # Rank 1 also saw a non-finite loss at step 3: both ranks learn it, and where, at step 4.
        decision = cadence.after_step(step, lambda: 3 if rank == 1 and step >= 3 else NONE, 8)
        assert (decision.nonfinite_step, decision.nonfinite_ranks) == ((3, (1,)) if step == 4 else (NONE, ()))
        if decision.stop:
            assert decision.save
            stopped_at = step
            break
    flag.restore()
    (results / f"rank{rank}.txt").write_text(f"{accuracy} {stopped_at}")


@pytest.mark.parametrize("main_backend", ["gloo", "nccl"])
def test_two_gloo_ranks_reduce_exactly_and_agree_when_to_stop(tmp_path: Path, main_backend: str) -> None:
    spawn_ranks(_worker, tmp_path, main_backend)
    for rank in range(2):
        accuracy, stopped_at = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert float(accuracy) == 0.25
        assert stopped_at == "4"


def test_a_group_of_one_leaves_no_launch_variables_behind() -> None:
    """An in-process group of one (FSDP2 on one device) must not leave MASTER_ADDR/MASTER_PORT in
    the environment: every process started later (an sbatch that exports it) would inherit them."""
    import subprocess
    import sys

    code = ("import os; from common.pytorch.distributed import init_distributed; "
            "init_distributed('cpu', group_of_one=True); "
            "import torch.distributed as dist; assert dist.is_initialized(); "
            "print(sorted(k for k in os.environ if k.startswith('MASTER_')))")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MASTER_", "RANK", "WORLD_SIZE"))}
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _gloo_worker_threads() -> list[str]:
    """This process's gloo threads (c10d's and gloo's own names for them, Linux)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # a thread that ended while listing
            continue
    return [name for name in names if "gloo" in name]


def _shutdown_worker(rank: int, port: int, results: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    distributed.init_distributed("cpu")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())  # imports torch._dynamo, as every recipe's optimizer does
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    running = _gloo_worker_threads()
    del model, optimizer
    distributed.shutdown_distributed()
    (results / f"rank{rank}.txt").write_text(f"{len(running)} {_gloo_worker_threads()}")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_the_process_group_is_freed_at_shutdown_with_its_gloo_threads(tmp_path: Path) -> None:
    """A gloo group alive at interpreter shutdown aborts the process at random ("terminate called
    without an active exception"): a worker thread freeing its last collective's tensors needs the
    GIL then. The recipes' shutdown must free the group, joining its threads, before that."""
    mp.spawn(_shutdown_worker, args=(free_port(), tmp_path), nprocs=2, join=True)
    for rank in range(2):
        running, left = (tmp_path / f"rank{rank}.txt").read_text().split(" ", 1)
        assert int(running) > 0, "no gloo thread ran: the test no longer sees what it checks"
        assert left == "[]", f"rank {rank}: gloo threads still running after shutdown_distributed: {left}"
