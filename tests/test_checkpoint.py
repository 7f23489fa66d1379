"""Atomic checkpoints: verified loading, fallback, retention, and saves killed midway."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.checkpoint.layout import (
    CheckpointError,
    checkpoint_dirs,
    committed_checkpoints,
    latest_checkpoint,
    latest_name,
)
from common.checkpoint.manager import KEEP_ALL, CheckpointManager
from common.errors import UserError
from tests.conftest import REPO


def state_for(step: int, size: int = 1000) -> dict:
    return {"weights": torch.full((size,), float(step)), "step": step}


def names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_save_then_load_round_trip(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(3, state_for(3), {"eval/top1": 0.5})
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 3
    assert torch.equal(loaded.state["weights"], torch.full((1000,), 3.0))
    assert loaded.metrics == {"eval/top1": 0.5}
    assert loaded.path == tmp_path / "AtomicDirectory_checkpoint_0"
    link = tmp_path / "AtomicDirectory.latest_checkpoint"
    assert link.is_symlink() and os.readlink(link) == str(tmp_path.resolve() / "AtomicDirectory_checkpoint_0")
    manifest = json.loads((loaded.path / "manifest.json").read_text())
    assert manifest["step"] == 3 and set(manifest["files"]) == {"state.pt"}


def test_empty_directory_has_nothing_to_resume(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "new").load_latest() is None


def test_n_counts_saves_and_a_step_saved_again_is_a_newer_directory(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (2, 4, 4, 6):
        manager.save(step, state_for(step))
    assert [(found.index, found.step) for found in committed_checkpoints(tmp_path)] == [(0, 2), (2, 4), (3, 6)]
    assert latest_checkpoint(tmp_path).path.name == "AtomicDirectory_checkpoint_3"
    assert CheckpointManager(tmp_path, keep_last=5)._next_index == 4


def test_keep_last_n_steps_and_the_best_by_metric_which_is_force(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, best_metric="eval/top1", best_mode="max")
    accuracies = {1: 0.3, 2: 0.9, 3: 0.4, 4: 0.5, 5: 0.6}
    for step, accuracy in accuracies.items():
        manager.save(step, state_for(step), {"eval/top1": accuracy})
    # step 1 was the best when it was written, step 2 beat it; the others never beat step 2.
    assert names(tmp_path) == ["AtomicDirectory.latest_checkpoint", "AtomicDirectory_checkpoint_1_force",
                               "AtomicDirectory_checkpoint_3", "AtomicDirectory_checkpoint_4"]
    assert manager.best().step == 2


def test_keep_best_k_keeps_the_k_best_each_force_when_it_ranked_among_them(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1, best_metric="eval/top1", keep_best_k=2)
    for step, accuracy in {1: 0.5, 2: 0.7, 3: 0.6, 4: 0.2, 5: 0.3}.items():
        manager.save(step, state_for(step), {"eval/top1": accuracy})
    # steps 2 and 3 are the two best; step 5 is the newest, below both when it was written
    assert [found.path.name for found in checkpoint_dirs(tmp_path)] == [
        "AtomicDirectory_checkpoint_1_force", "AtomicDirectory_checkpoint_2_force", "AtomicDirectory_checkpoint_4"]
    reopened = CheckpointManager(tmp_path, keep_last=1, best_metric="eval/top1", keep_best_k=2)
    reopened.save(6, state_for(6), {"eval/top1": 0.65})  # a resumed run knows the two best: 0.65 ranks second
    assert [found.path.name for found in checkpoint_dirs(tmp_path)] == [
        "AtomicDirectory_checkpoint_1_force", "AtomicDirectory_checkpoint_5_force"]


def test_best_by_a_metric_to_minimise(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1, best_metric="eval/loss", best_mode="min")
    for step, loss in {1: 0.9, 2: 0.2, 3: 0.5}.items():
        manager.save(step, state_for(step), {"eval/loss": loss})
    assert [found.path.name for found in checkpoint_dirs(tmp_path)] == ["AtomicDirectory_checkpoint_1_force",
                                                                       "AtomicDirectory_checkpoint_2"]


def test_milestones_are_force_and_never_pruned(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, state_for(1))
    manager.save(4, state_for(4), milestone="end of linear probe")
    for step in (5, 6, 7):
        manager.save(step, state_for(step))
    assert [(found.path.name, found.step) for found in committed_checkpoints(tmp_path)] == [
        ("AtomicDirectory_checkpoint_1_force", 4), ("AtomicDirectory_checkpoint_4", 7)]


def test_keep_all_prunes_nothing(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=KEEP_ALL)
    for step in (1, 2, 2, 3):
        manager.save(step, state_for(step))
    assert [found.index for found in checkpoint_dirs(tmp_path)] == [0, 1, 2, 3]


def test_the_artifact_path_keeps_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.data.sampler import ResumableDistributedSampler
    from common.entry import compose_config
    from common.pytorch.distributed import DistInfo
    from common.pytorch.metrics import SumMetrics
    from common.run.steps import StepPlan
    from common.run.training_run import TrainingRun

    monkeypatch.setenv("CHECKPOINT_ARTIFACT_PATH", str(tmp_path / "artifacts"))
    single = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="single")
    keep_last = {}
    for where in ("artifacts", "local"):
        cfg = compose_config("fashion_mnist", [f"run_dir={tmp_path}", f"checkpoint.dir={tmp_path / where}",
                                               "checkpoint.keep_last=1"])
        sampler = ResumableDistributedSampler(8)
        run = TrainingRun(cfg, single, StepPlan(sampler, 1, 1, 1, 1), model=torch.nn.Linear(1, 1),
                          sampler=sampler, train_sums=SumMetrics(single.device))
        run.cadence.close()
        keep_last[where] = run.checkpoints.keep_last
    assert keep_last == {"artifacts": KEEP_ALL, "local": 1}


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", "missing_file"])
def test_a_damaged_latest_falls_back_to_the_previous_one(tmp_path: Path, damage: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, state_for(1))
    manager.save(2, state_for(2))
    newest = tmp_path / "AtomicDirectory_checkpoint_1"
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
    assert "AtomicDirectory_checkpoint_1 is damaged" in capsys.readouterr().err


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, state_for(1))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state_file = tmp_path / "AtomicDirectory_checkpoint_0" / "state.pt"
    torch.save({"weights": Exploit()}, state_file)
    manifest_path = tmp_path / "AtomicDirectory_checkpoint_0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(state_file.read_bytes()).hexdigest(),
                                     "size": state_file.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refusing to load"):
        manager.load_latest()
    assert not marker.exists()


def test_half_written_and_uncommitted_saves_are_ignored_and_removed(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    CheckpointManager(tmp_path).save(4, state_for(4))
    partial = tmp_path / ".tmp-checkpoint_1"  # a save killed while writing
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"half a checkpoint")
    # A save of the same step killed after its rename, before the symlink moved: complete on disk,
    # but never committed.
    shutil.copytree(tmp_path / "AtomicDirectory_checkpoint_0", tmp_path / "AtomicDirectory_checkpoint_1")
    os.symlink("AtomicDirectory_checkpoint_0", tmp_path / "AtomicDirectory.latest_checkpoint_temp")
    manager = CheckpointManager(tmp_path)
    assert names(tmp_path) == ["AtomicDirectory.latest_checkpoint", "AtomicDirectory_checkpoint_0"]
    assert "removing" in capsys.readouterr().err
    loaded = manager.load_latest()
    assert loaded is not None and loaded.path.name == "AtomicDirectory_checkpoint_0"
    manager.save(5, state_for(5))
    assert latest_checkpoint(tmp_path).path.name == "AtomicDirectory_checkpoint_1"


def test_a_folder_of_the_older_layout_is_refused_not_restarted(tmp_path: Path) -> None:
    (tmp_path / "step_000000010").mkdir()
    (tmp_path / "step_000000010" / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="older step_<N>/ layout"):
        CheckpointManager(tmp_path)


# Every step is saved twice, as the recipes save an epoch's last step and then again with its
# evaluation. The fifth save (step 3, first version) stops for good at one point of its sequence:
# the test SIGKILLs the process there. keep_last=1, so that save also deletes step 2's directories.
CRASHING_SAVER = textwrap.dedent("""
    import os, shutil, sys, threading, torch
    import common.checkpoint.manager as manager_module
    import common.checkpoint.writer as checkpoint_module
    from common.checkpoint.manager import CheckpointManager

    folder, phase = sys.argv[1], sys.argv[2]
    saves = 0

    def stop_here():
        os.write(1, b"STOPPED\\n")
        threading.Event().wait()

    def after(real, name, condition=lambda *args: True):
        def wrapper(*args, **kwargs):
            result = real(*args, **kwargs)
            if saves == 5 and phase == name and condition(*args):
                stop_here()
            return result
        return wrapper

    os.rename = after(os.rename, "renamed", lambda source, target: "checkpoint_" in os.path.basename(source)
                      and not os.path.basename(source).startswith(".tmp-deleting"))
    os.symlink = after(os.symlink, "linked")
    os.replace = after(os.replace, "committed")
    real_chunk = checkpoint_module._HashingWriter.write
    def write_chunk(self, data):
        written = real_chunk(self, data)
        if saves == 5 and phase == "writing":
            self.flush()
            stop_here()
        return written
    checkpoint_module._HashingWriter.write = write_chunk
    real_rmtree = shutil.rmtree
    def rmtree_one_file_then_stop(path, *args, **kwargs):
        if saves == 5 and phase == "deleting" and os.path.exists(os.path.join(path, "state.pt")):
            os.remove(os.path.join(path, "state.pt"))
            stop_here()
        return real_rmtree(path, *args, **kwargs)
    manager_module.shutil.rmtree = rmtree_one_file_then_stop

    manager = CheckpointManager(folder, keep_last=1)
    for step in range(1, 10):
        for version in (0, 1):
            saves += 1
            manager.save(step, {"weights": torch.full((1000,), float(step)), "step": step, "version": version})
""")


@pytest.mark.parametrize(("phase", "committed"), [("writing", False), ("renamed", False), ("linked", False),
                                                  ("committed", True), ("deleting", True)])
def test_a_save_killed_at_any_point_leaves_a_loadable_latest_and_nothing_half_done(tmp_path: Path, phase: str,
                                                                                   committed: bool) -> None:
    """The symlink never names a missing or incomplete directory, nothing older goes before the
    newer checkpoint is committed, and what a kill leaves half done is gone once a manager opens
    the folder: no temporary directory, no checkpoint directory missing a file."""
    process = subprocess.Popen([sys.executable, "-c", CRASHING_SAVER, str(tmp_path), phase], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = process.stdout.readline()  # the child writes nothing else, and blocks after this line
        assert line == "STOPPED\n", f"the child ended first (code {process.poll()}): {process.stderr.read()[-2000:]}"
    finally:
        process.kill()
        process.wait()

    expected_step = 3 if committed else 2
    target = tmp_path / latest_name(tmp_path)
    assert target.is_dir(), f"the symlink names {target.name}, which is not there"
    manager = CheckpointManager(tmp_path, keep_last=1)
    assert manager.verify(target)["step"] == expected_step
    loaded = manager.load_latest()
    assert loaded is not None and loaded.path == target and loaded.step == expected_step
    assert loaded.state["version"] == (0 if committed else 1)
    assert torch.equal(loaded.state["weights"], torch.full((1000,), float(expected_step)))
    assert not list(tmp_path.glob(".tmp-*")), names(tmp_path)
    for found in checkpoint_dirs(tmp_path):
        manager.verify(found.path)  # raises for a directory with a file missing
    manager.save(4, state_for(4))
    assert manager.load_latest().step == 4
