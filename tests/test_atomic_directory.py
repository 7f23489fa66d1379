"""Our checkpoint folders and cycling_utils' AtomicDirectory understand each other, both ways.

cycling_utils is not on PyPI and its saver needs CUDA, so the rules are written out here as its
docstring (StrongResearch/cycling_utils, cycling_utils/saving.py) and Strong Compute's Artifacts
page state them, and exercised by the small functions below:

1. A checkpoint directory is ``<name>_checkpoint_<N>`` or ``<name>_checkpoint_<N>_force`` in the
   output folder, recognised by the regex ``_checkpoint_(\\d+)(_force)?$`` on its name.
2. A checkpoint is committed after it is complete: a symlink to it is made as
   ``<name>.latest_checkpoint_temp`` and ``os.replace``d onto ``<name>.latest_checkpoint``.
3. Preparing the next directory: a symlink without any checkpoint directory is an error; the next
   ``N`` is the symlink target's ``N`` + 1 (0 without a symlink); directories above the symlink's
   ``N`` that are not ``_force`` are deleted (they were never committed); ``_force`` is appended
   when the caller forces the save.
4. A reader resumes from ``os.readlink(<name>.latest_checkpoint)``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from common.checkpoint.layout import NAME, checkpoint_dirs, latest_checkpoint
from common.checkpoint.manager import KEEP_ALL, CheckpointManager

RULE_PATTERN = re.compile(r"_checkpoint_(\d+)(_force)?$")
SYMLINK = f"{NAME}.latest_checkpoint"


def rule_checkpoints(folder: Path) -> dict[str, int]:
    """Rule 1: checkpoint directory name -> N."""
    found = {}
    for path in folder.iterdir():
        match = RULE_PATTERN.search(path.name)
        if match and path.is_dir() and path.name.startswith(f"{NAME}_checkpoint"):
            found[path.name] = int(match.group(1))
    return found


def rule_prepare(folder: Path, force: bool = False) -> Path:
    """Rule 3: delete what was never committed and make the next directory."""
    found = rule_checkpoints(folder)
    latest = -1
    if os.path.lexists(folder / SYMLINK):
        assert found, "rule 3: a symlink but no checkpoint directory"
        latest = found[Path(os.readlink(folder / SYMLINK)).name]
        for name, index in found.items():
            if index > latest and not name.endswith("_force"):
                shutil.rmtree(folder / name)
    path = folder / f"{NAME}_checkpoint_{latest + 1}{'_force' if force else ''}"
    path.mkdir()
    assert not any(path.iterdir()), "rule 3: the next directory must be new"
    return path


def rule_commit(checkpoint: Path) -> None:
    """Rule 2."""
    temp = checkpoint.parent / f"{SYMLINK}_temp"
    os.symlink(checkpoint, temp)
    os.replace(temp, checkpoint.parent / SYMLINK)


def rule_read_latest(folder: Path) -> Path:
    """Rule 4."""
    return Path(os.readlink(folder / SYMLINK))


def state_for(step: int) -> dict:
    return {"weights": torch.full((100,), float(step)), "step": step}


def our_files(tmp_path: Path, step: int) -> Path:
    """A checkpoint directory of ours (state.pt and manifest.json) for ``step``, written elsewhere."""
    scratch = tmp_path / f"scratch-{step}"
    manager = CheckpointManager(scratch)
    manager.save(step, state_for(step))
    return latest_checkpoint(scratch).path


def test_a_folder_we_wrote_is_accepted_by_atomic_directory_rules(tmp_path: Path) -> None:
    for keep_last in (KEEP_ALL, 2):
        folder = tmp_path / f"keep_{keep_last}"
        manager = CheckpointManager(folder, keep_last=keep_last, best_metric="eval/top1")
        manager.save(1, state_for(1), {"eval/top1": 0.5})  # the best: _force
        manager.save(2, state_for(2))
        manager.save(2, state_for(2), {"eval/top1": 0.4})  # the same step again, with its evaluation
        manager.save(3, state_for(3))
        ours = rule_checkpoints(folder)
        assert f"{NAME}_checkpoint_0_force" in ours and len(ours) == (4 if keep_last == KEEP_ALL else 3)

        latest = rule_read_latest(folder)
        assert latest.is_dir() and latest.name == f"{NAME}_checkpoint_3"
        assert torch.load(latest / "state.pt", weights_only=True)["step"] == 3

        following = rule_prepare(folder)
        assert following.name == f"{NAME}_checkpoint_4"  # after ours
        assert set(ours) <= set(rule_checkpoints(folder)), "the rules deleted a checkpoint of ours"
        following.rmdir()


def test_a_folder_laid_out_by_atomic_directory_rules_with_our_files_resumes(tmp_path: Path) -> None:
    folder = tmp_path / "artifacts"
    folder.mkdir()
    for step, force in ((1, False), (2, True)):
        checkpoint = rule_prepare(folder, force=force)
        shutil.copytree(our_files(tmp_path, step), checkpoint, dirs_exist_ok=True)
        rule_commit(checkpoint)
    crashed = rule_prepare(folder)  # a save that never reached the symlink
    (crashed / "state.pt").write_bytes(b"half")
    assert crashed.name == f"{NAME}_checkpoint_2"

    manager = CheckpointManager(folder)
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 2 and loaded.path.name == f"{NAME}_checkpoint_1_force"
    assert not crashed.exists()
    manager.save(3, state_for(3))
    assert rule_read_latest(folder).name == f"{NAME}_checkpoint_2"
    assert rule_prepare(folder).name == f"{NAME}_checkpoint_3"
    assert {found.path.name for found in checkpoint_dirs(folder)} >= {f"{NAME}_checkpoint_1_force",
                                                                     f"{NAME}_checkpoint_2"}


def test_an_absolute_symlink_to_a_path_that_is_gone_resolves_by_name(tmp_path: Path) -> None:
    """Artifacts restored at another path, or downloaded with `isc download` onto a laptop."""
    written = tmp_path / "node" / "checkpoints"
    manager = CheckpointManager(written, keep_last=KEEP_ALL)
    for step in (5, 10):
        manager.save(step, state_for(step))
    # A save that never reached the symlink (complete on disk: only the symlink says it is not committed).
    shutil.copytree(our_files(tmp_path, 99), written / f"{NAME}_checkpoint_2")
    restored = tmp_path / "laptop" / "checkpoints"
    restored.parent.mkdir()
    shutil.move(written, restored)
    assert os.path.isabs(os.readlink(restored / SYMLINK)) and not (restored / SYMLINK).exists()

    manager = CheckpointManager(restored)
    assert not (restored / f"{NAME}_checkpoint_2").exists(), "the uncommitted save was taken for committed"
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 10 and loaded.path == restored / f"{NAME}_checkpoint_1"
    manager.save(11, state_for(11))
    assert rule_read_latest(restored) == restored.resolve() / f"{NAME}_checkpoint_2"
