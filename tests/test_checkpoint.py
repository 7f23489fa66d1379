"""Atomic checkpoints: verified loading, fallback, retention, and saves killed midway."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from common.checkpoint import CheckpointError, CheckpointManager
from tests.conftest import REPO


def state_for(step: int, size: int = 1000) -> dict:
    return {"weights": torch.full((size,), float(step)), "step": step}


def test_save_then_load_round_trip(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(3, state_for(3), {"eval/accuracy": 0.5})
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 3
    assert torch.equal(loaded.state["weights"], torch.full((1000,), 3.0))
    assert loaded.metrics == {"eval/accuracy": 0.5}
    assert (tmp_path / "latest").read_text().strip() == "step_000000003"
    manifest = json.loads((tmp_path / "step_000000003" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"state.pt"}


def test_empty_directory_has_nothing_to_resume(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "new").load_latest() is None


def test_keep_last_n_and_the_best_by_metric(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, best_metric="eval/accuracy", best_mode="max")
    accuracies = {1: 0.3, 2: 0.9, 3: 0.4, 4: 0.5, 5: 0.6}
    for step, accuracy in accuracies.items():
        manager.save(step, state_for(step), {"eval/accuracy": accuracy})
    kept = sorted(path.name for path in tmp_path.glob("step_*"))
    assert kept == ["step_000000002", "step_000000004", "step_000000005"]
    assert (tmp_path / "best").read_text().strip() == "step_000000002"


def test_best_by_a_metric_to_minimise(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1, best_metric="eval/loss", best_mode="min")
    for step, loss in {1: 0.9, 2: 0.2, 3: 0.5}.items():
        manager.save(step, state_for(step), {"eval/loss": loss})
    assert sorted(path.name for path in tmp_path.glob("step_*")) == ["step_000000002", "step_000000003"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", "missing_file"])
def test_a_damaged_latest_falls_back_to_the_previous_one(tmp_path: Path, damage: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, state_for(1))
    manager.save(2, state_for(2))
    newest = tmp_path / "step_000000002"
    state_file = newest / "state.pt"
    if damage == "flip":
        data = bytearray(state_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state_file.write_bytes(bytes(data))
    elif damage == "truncate":
        state_file.write_bytes(state_file.read_bytes()[:-100])
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    else:
        state_file.unlink()
    loaded = CheckpointManager(tmp_path, keep_last=3).load_latest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["weights"], torch.full((1000,), 1.0))
    assert "step_000000002 is damaged" in capsys.readouterr().err


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, state_for(1))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state_file = tmp_path / "step_000000001" / "state.pt"
    torch.save({"weights": Exploit()}, state_file)
    manifest_path = tmp_path / "step_000000001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(state_file.read_bytes()).hexdigest(),
                                     "size": state_file.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refusing to load"):
        manager.load_latest()
    assert not marker.exists()


def test_stale_temporary_directories_are_ignored_and_removed(tmp_path: Path) -> None:
    CheckpointManager(tmp_path).save(1, state_for(1))
    partial = tmp_path / ".tmp-step_000000002"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"half a checkpoint")
    manager = CheckpointManager(tmp_path)
    assert not partial.exists()
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1


def test_saving_a_step_again_replaces_it_and_a_crash_midway_keeps_the_old_one(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(4, state_for(4), {"eval/accuracy": 0.1})
    manager.save(4, state_for(40), {"eval/accuracy": 0.2})
    loaded = CheckpointManager(tmp_path, keep_last=1).load_latest()
    assert loaded is not None and loaded.step == 4 and loaded.state["step"] == 40
    assert loaded.metrics == {"eval/accuracy": 0.2}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_000000004"]

    # A crash between moving the old checkpoint aside and renaming the new one into place.
    (tmp_path / "step_000000004").rename(tmp_path / ".replaced-step_000000004")
    (tmp_path / ".tmp-step_000000004").mkdir()
    loaded = CheckpointManager(tmp_path, keep_last=1).load_latest()
    assert loaded is not None and loaded.step == 4 and loaded.state["step"] == 40
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_000000004"]


SAVER = textwrap.dedent("""
    import sys, torch
    from common.checkpoint import CheckpointManager
    manager = CheckpointManager(sys.argv[1], keep_last=2)
    step = 0
    while True:
        step += 1
        manager.save(step, {"weights": torch.full((2_000_000,), float(step)), "step": step})
        print(step, flush=True)
""")


def test_a_save_killed_midway_never_loads_with_wrong_content(tmp_path: Path) -> None:
    rng = random.Random(0)
    for trial in range(6):
        process = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], cwd=REPO,
                                   stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        process.stdout.readline()  # at least one checkpoint is complete
        time.sleep(rng.uniform(0.0, 0.4))
        process.send_signal(signal.SIGKILL)
        process.wait()
        loaded = CheckpointManager(tmp_path, keep_last=2).load_latest()
        assert loaded is not None, f"trial {trial}: no loadable checkpoint"
        assert loaded.state["step"] == loaded.step
        assert torch.equal(loaded.state["weights"], torch.full((2_000_000,), float(loaded.step)))
