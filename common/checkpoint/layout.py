"""Checkpoint directories in cycling_utils' AtomicDirectory layout (the one the Strong Compute ISC's
Checkpoint Artifacts ship): names, manifest, verification, and which checkpoint to take::

    checkpoints/
      AtomicDirectory_checkpoint_6_force/   the best by the chosen metric, or a stage milestone
      AtomicDirectory_checkpoint_7/         state.pt, sharded/ (FSDP), compile_cache.tar, manifest.json
      AtomicDirectory.latest_checkpoint -> /abs/path/checkpoints/AtomicDirectory_checkpoint_7
      average-last-3/                       weights averaged by `make average`: read by name, never resumed

The symlink is the commit point; what a crash at each moment leaves, and what is kept:
docs/run-contract.md (the steps are in :meth:`common.checkpoint.manager.CheckpointManager.save`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAME = "AtomicDirectory"  # cycling_utils' default saver name, so ISC tools and AtomicDirectory readers agree
LATEST = f"{NAME}.latest_checkpoint"
LATEST_TEMP = f"{LATEST}_temp"
CHECKPOINT_DIR = re.compile(rf"^{NAME}_checkpoint_(\d+)(_force)?$")
AVERAGE_DIR = re.compile(r"^average-(last|best)-(\d+)$")  # no <NAME>_checkpoint_<N>: resumes and the ISC ignore it
TMP_PREFIX = ".tmp-"  # saves in progress and directories being deleted: no checkpoint to the ISC or AtomicDirectory
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
MANIFEST_FILE = "manifest.json"
ARTIFACT_PATH_VARIABLE = "CHECKPOINT_ARTIFACT_PATH"


def report_to_stderr(message: str) -> None:
    """The default ``log`` of this package: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


def checkpoint_dir_name(index: int, force: bool = False) -> str:
    """``<NAME>_checkpoint_<index>``, with ``_force`` for one the ISC must keep."""
    return f"{NAME}_checkpoint_{index}{'_force' if force else ''}"


@dataclass(frozen=True)
class CheckpointDir:
    """A directory whose name follows the layout.

    - ``manifest``: None until it is read (:func:`committed_checkpoints` reads it).
    - ``step`` and ``metrics`` come from the manifest.
    """

    path: Path
    index: int
    force: bool
    manifest: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def metrics(self) -> dict[str, float]:
        return self.manifest.get("metrics", {})


def checkpoint_dirs(directory: str | Path) -> list[CheckpointDir]:
    """Every directory named ``<NAME>_checkpoint_<N>[_force]`` in ``directory``, by ``N``.

    - Committed or not, manifest not read; an empty list when ``directory`` does not exist.
    """
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = CHECKPOINT_DIR.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            found.append(CheckpointDir(Path(entry.path), int(match.group(1)), match.group(2) is not None))
    return sorted(found, key=lambda found_dir: (found_dir.index, found_dir.force))


def latest_name(directory: str | Path) -> str | None:
    """The directory name the symlink points at; None without a symlink.

    - Only the name counts: the link's absolute target may be a path of another machine or an
      earlier ISC cycle.
    """
    try:
        return Path(os.readlink(Path(directory) / LATEST)).name
    except OSError:  # no symlink (FileNotFoundError), or a file that is not one
        return None


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("step"), int) else None


def committed_checkpoints(directory: str | Path) -> list[CheckpointDir]:
    """The committed checkpoints with a readable manifest, oldest first.

    - Committed: the symlink's target and every directory below its ``N``; all of them without a symlink.
    - Not verified: :func:`verify_checkpoint` checks the files.
    """
    found = checkpoint_dirs(directory)
    target = latest_name(directory)
    limit = next((found_dir.index for found_dir in found if found_dir.path.name == target), None)
    committed = []
    for found_dir in found:
        if limit is not None and found_dir.index > limit:
            continue
        manifest = _read_manifest(found_dir.path)
        if manifest is not None:
            committed.append(CheckpointDir(found_dir.path, found_dir.index, found_dir.force, manifest))
    return committed


def latest_checkpoint(directory: str | Path) -> CheckpointDir | None:
    """The checkpoint the symlink points at, with its manifest; None if there is none (yet)."""
    target = latest_name(directory)
    return next((found_dir for found_dir in committed_checkpoints(directory) if found_dir.path.name == target), None)


def improves(value: float | None, best: float | None, mode: str) -> bool:
    """Whether ``value`` of the watched metric beats ``best``: the one rule for "better".

    - ``best``: None while there is no value yet; ``mode``: ``max`` or ``min``.
    - A value that is missing or not finite (NaN from a diverged evaluation) never improves.
    - Used for the best checkpoint (its ``_force`` directory and retention), early stopping and
      ``summary.json``'s best checkpoint.
    """
    if value is None or not math.isfinite(value):
        return False
    return best is None or (value > best if mode == "max" else value < best)


def best_checkpoints(checkpoints: list[CheckpointDir], metric: str | None, mode: str) -> list[CheckpointDir]:
    """The checkpoints with a finite value of ``metric``, best first (ties: the earlier first, as
    :func:`best_checkpoint` takes)."""
    scored = [found_dir for found_dir in checkpoints
              if metric is not None and improves(found_dir.metrics.get(metric), None, mode)]
    return sorted(scored, key=lambda found_dir: found_dir.metrics[metric], reverse=mode == "max")


def best_checkpoint(checkpoints: list[CheckpointDir], metric: str | None, mode: str) -> CheckpointDir | None:
    """The first checkpoint with the best value of ``metric`` by :func:`improves`; None without one."""
    best, best_value = None, None
    for found_dir in checkpoints:
        value = found_dir.metrics.get(metric) if metric is not None else None
        if improves(value, best_value, mode):
            best, best_value = found_dir, value
    return best


def is_artifact_path(directory: str | Path) -> bool:
    """Whether ``directory`` is the ISC's ``CHECKPOINT_ARTIFACT_PATH``, where the ISC, not the recipe,
    decides what is deleted."""
    artifact_path = os.environ.get(ARTIFACT_PATH_VARIABLE)
    return bool(artifact_path) and os.path.abspath(directory) == os.path.abspath(artifact_path)


def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    """The sha256 of the file ``path``, as hex."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def point_latest_at(directory: Path, final: Path) -> None:
    """Commit ``final``: move the symlink the way AtomicDirectory does, a new link, then ``os.replace``."""
    temp = directory / LATEST_TEMP
    temp.unlink(missing_ok=True)
    os.symlink(os.path.abspath(final), temp)
    os.replace(temp, directory / LATEST)
    fsync_dir(directory)


@dataclass(frozen=True)
class Attachment:
    """A file that travels in a checkpoint directory beside its state (compiled code:
    ``common/run/compile_cache.py``).

    - Its sha256 and size go into the manifest's ``attachments`` with ``info``, not among the
      checkpoint's ``files``.
    - A damaged attachment is for its reader to ignore (:func:`read_attachment`), never a reason to
      fall back to an older checkpoint.
    """

    name: str
    data: bytes
    info: dict[str, Any]

    @functools.cached_property
    def entry(self) -> dict[str, Any]:
        """What the manifest records (its digest computed once: the same attachment is saved again)."""
        return {**self.info, "sha256": hashlib.sha256(self.data).hexdigest(), "size": len(self.data)}


class CheckpointError(Exception):
    """A checkpoint that is incomplete or whose content does not match its manifest."""


def read_attachment(checkpoint: Path, name: str, entry: dict[str, Any]) -> bytes:
    """The attachment ``name`` of ``checkpoint``, checked against its manifest ``entry``.

    - Raises :class:`CheckpointError` when it is missing or damaged.
    """
    try:
        data = (checkpoint / name).read_bytes()
    except OSError as error:
        raise CheckpointError(f"{name} cannot be read ({error.strerror or error})") from error
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{name} does not match its sha256 in the manifest")
    return data


def verify_checkpoint(path: Path, digests: bool = True) -> dict[str, Any]:
    """The manifest of ``path``, if every file it lists matches it.

    - Checks each file's size, and its sha256 with ``digests``.
    - Raises :class:`CheckpointError` for a missing or unreadable manifest, or a file that is
      missing or does not match.
    """
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError("no manifest (the save did not complete)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"unreadable manifest ({error})") from error
    for relative, expected in manifest["files"].items():
        file = path / relative
        if not file.is_file():
            raise CheckpointError(f"{relative} is missing")
        if file.stat().st_size != expected["size"]:
            raise CheckpointError(f"{relative} has {file.stat().st_size} bytes, expected {expected['size']}")
        if digests and file_digest(file) != expected["sha256"]:
            raise CheckpointError(f"{relative} does not match its sha256")
    return manifest


def _load_candidates(directory: Path, log: Callable[[str], None] = report_to_stderr) -> list[Path]:
    """Where to look for the latest checkpoint, in order: the symlink's target, then older
    directories, newest first (all of them, highest ``N`` first, without a symlink)."""
    found = checkpoint_dirs(directory)
    target = latest_name(directory)
    target_dir = next((found_dir for found_dir in found if found_dir.path.name == target), None)
    if target is not None and target_dir is None:
        log(f"warning: {directory / LATEST} names {target}, which is not in {directory}; "
            f"trying the checkpoints that are")
    if target_dir is not None:
        found = [found_dir for found_dir in found if found_dir.index <= target_dir.index]
    found.sort(key=lambda found_dir: (found_dir.path.name == target, found_dir.index, found_dir.force), reverse=True)
    return [found_dir.path for found_dir in found]


def newest_valid_checkpoint(directory: Path,
                            log: Callable[[str], None] = report_to_stderr) -> tuple[Path, dict[str, Any]] | None:
    """The latest checkpoint whose files match its manifest, and the manifest; None without one.

    - A damaged one is reported through ``log`` and the previous one tried.
    - Reads only: nothing in ``directory`` changes.
    """
    for path in _load_candidates(directory, log):
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as error:
            log(f"warning: checkpoint {path} is damaged ({error}); trying the previous one")
    return None
