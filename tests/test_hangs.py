"""A hang that says where: a rank that stalls inside a step stops a 2-rank run with one line naming
it (its host, last phase and step), every rank's stacks in ``hang/`` and exit code 4.

The runs are fashion_mnist on 2 gloo processes under ``cluster.torchrun`` with
``trainer.collective_timeout_s=5``; ``tests/pause_hook/sitecustomize.py`` makes one rank stall in
the forward pass of step 3 (sleeping in Python, or stopped with SIGSTOP), while the other waits
in DDP's all-reduce of that step's gradients, which gloo fails after the timeout.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from common.errors import EXIT_HUNG
from common.records import heartbeat
from tests.conftest import REPO, recipe_env, run_recipe
from tests.resume import PAUSE_HOOK

RECIPE = "fashion_mnist"
TINY = ["model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16", "logging.backend=none",
        "logging.progress_bar=false", "checkpoint.every_seconds=0", "trainer.epochs=1",
        "trainer.collective_timeout_s=5"]
STALL_AT = 3


def stall_env(rank: int, **extra: str) -> dict[str, str]:
    return recipe_env(PYTHONPATH=f"{PAUSE_HOOK}{os.pathsep}{REPO}", STALL_AT_STEP=str(STALL_AT),
                      STALL_RANK=str(rank), **extra)


def hang_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "hang: a collective waited more than 5 s" in line]


@pytest.mark.slow
@pytest.mark.parametrize("stalled", [1, 0])
def test_a_rank_stalled_in_a_step_is_named_with_its_host_phase_and_stacks(fashion_data: Path, tmp_path: Path,
                                                                           stalled: int) -> None:
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY], nproc=2,
                        env=stall_env(stalled), timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_HUNG, output[-3000:]
    lines = hang_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("error: hang:"), lines  # rank 0 said it, whichever rank stalled
    waiting = 1 - stalled
    assert (f"did not arrive: rank {stalled} on {socket.gethostname()} (pid "
            f"{json.loads((run_dir / 'heartbeat' / f'rank{stalled}.json').read_text())['pid']}), "
            f"last in {heartbeat.FORWARD_BACKWARD} after step {STALL_AT - 1} for ") in lines[0]
    assert f"rank {waiting} " not in lines[0]
    assert "Traceback" not in output
    stalled_stacks = (run_dir / "hang" / f"rank{stalled}-stacks.txt").read_text()
    assert "in stall_in_step" in stalled_stacks and "fashion_mnist/train.py" in stalled_stacks
    waiting_stacks = (run_dir / "hang" / f"rank{waiting}-stacks.txt").read_text()
    assert "Timed out" in waiting_stacks and "backward" in waiting_stacks
    assert (run_dir / "hang" / "report.txt").read_text().strip() == lines[0].removeprefix("error: ")
    beats = heartbeat.read_heartbeats(run_dir)
    assert [beat["hang"] for beat in beats] == [heartbeat.WAITED if rank == waiting else heartbeat.STOPPED
                                                for rank in range(2)]


@pytest.mark.slow
def test_the_launcher_names_a_frozen_rank_0(fashion_data: Path, tmp_path: Path) -> None:
    """Rank 0 stopped whole (SIGSTOP): it cannot say anything, so cluster/torchrun.py does, from the
    heartbeats, once it has killed it."""
    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY], nproc=2,
                        env=stall_env(0, STALL_HOW="freeze", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5"), timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_HUNG, output[-3000:]
    lines = hang_lines(output)
    assert len(lines) == 1 and lines[0].startswith("torchrun: error: hang:"), output[-3000:]
    assert f"did not arrive: rank 0 on {socket.gethostname()}" in lines[0]
    assert f"last in {heartbeat.FORWARD_BACKWARD} after step {STALL_AT - 1}" in lines[0]
    assert "(process gone or frozen)" in lines[0]
    assert "Timed out" in (run_dir / "hang" / "rank1-stacks.txt").read_text()


def test_a_new_launch_forgets_the_last_hang(tmp_path: Path) -> None:
    (tmp_path / "hang").mkdir()
    (tmp_path / "heartbeat").mkdir()
    for name in ("hang/declared.json", "hang/report.txt", "hang/rank1-stacks.txt", "heartbeat/rank1.json"):
        (tmp_path / name).write_text("{}")
    heartbeat.clear(tmp_path)
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.*")) == ["hang/rank1-stacks.txt"]


def test_the_line_names_silent_ranks_and_ranks_without_a_heartbeat() -> None:
    now = 1000.0
    waited = {"hang": heartbeat.WAITED, "host": "a", "pid": 1, "phase": heartbeat.CADENCE, "step": 7,
              "phase_since": 990.0, "time": 999.0, "interval_s": 1.0}
    frozen = {**waited, "hang": None, "host": "b", "pid": 2, "phase": heartbeat.SAVE, "step": 6,
              "phase_since": 900.0, "time": 950.0}
    line = heartbeat.hang_line([waited, frozen, None], 30, "runs/x", now=now)
    assert ("did not arrive: rank 1 on b (pid 2), last in checkpoint save after step 6 for 50 s, silent for 50 s "
            "(process gone or frozen); rank 2 (no heartbeat)") in line
    assert line.endswith(f"exiting with code {EXIT_HUNG}")
    everyone = heartbeat.hang_line([waited, {**waited, "step": 8}], 30, "runs/x", now=now)
    assert "every rank waited, in different collectives" in everyone


def test_a_timeout_is_told_from_other_errors() -> None:
    assert heartbeat.is_timeout(RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    try:
        try:
            raise RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3)")
        except RuntimeError as error:
            raise ValueError("the checkpoint does not fit") from error
    except ValueError as chained:
        assert heartbeat.is_timeout(chained)
    assert not heartbeat.is_timeout(RuntimeError("Connection closed by peer"))
    assert not heartbeat.is_timeout(ValueError("timed out"))
