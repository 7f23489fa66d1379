"""Atomic checkpoints in cycling_utils' AtomicDirectory layout, the one the Strong Compute ISC's
Checkpoint Artifacts ship: verified, with fallback to an older one and retention::

    checkpoints/
      AtomicDirectory_checkpoint_6_force/   the best by the chosen metric, or a stage milestone
      AtomicDirectory_checkpoint_7/         state.pt, sharded/ (FSDP), compile_cache.tar, manifest.json
      AtomicDirectory.latest_checkpoint -> /abs/path/checkpoints/AtomicDirectory_checkpoint_7

The symlink is the commit point; what a crash at each moment leaves, and what is kept: README
"Outputs, resume and pre-emption" (the steps are in :meth:`CheckpointManager.save`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import jsonfiles
from common.errors import UserError
from common.pytorch import distributed

NAME = "AtomicDirectory"  # cycling_utils' default saver name, so ISC tools and AtomicDirectory readers agree
LATEST = f"{NAME}.latest_checkpoint"
_LATEST_TEMP = f"{LATEST}_temp"
CHECKPOINT_DIR = re.compile(rf"^{NAME}_checkpoint_(\d+)(_force)?$")
_TMP_PREFIX = ".tmp-"
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
MANIFEST_FILE = "manifest.json"
KEEP_ALL = -1
ARTIFACT_PATH_VARIABLE = "CHECKPOINT_ARTIFACT_PATH"


def _report_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _checkpoint_dir_name(index: int, force: bool = False) -> str:
    return f"{NAME}_checkpoint_{index}{'_force' if force else ''}"


@dataclass(frozen=True)
class CheckpointDir:
    """A directory whose name follows the layout; ``manifest`` is None until it is read."""

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
    """Every directory named ``<NAME>_checkpoint_<N>[_force]`` in ``directory``, by ``N``."""
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
    """The directory name the symlink points at (None without a symlink). Only the name counts:
    the link's absolute target may be a path of another machine or an earlier ISC cycle."""
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
    """The committed checkpoints with a readable manifest (not verified), oldest first: the
    symlink's target and every directory below its ``N``; all of them when there is no symlink."""
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
    """Whether ``value`` of the watched metric beats ``best`` (None: no value yet) in ``mode``
    (``max`` or ``min``). A value that is missing or not finite (NaN from a diverged evaluation)
    never does. The one rule for the best checkpoint (its ``_force`` directory and retention),
    early stopping and ``summary.json``'s best checkpoint."""
    if value is None or not math.isfinite(value):
        return False
    return best is None or (value > best if mode == "max" else value < best)


def best_checkpoint(checkpoints: list[CheckpointDir], metric: str | None, mode: str) -> CheckpointDir | None:
    """The first checkpoint with the best value of ``metric`` (``mode`` max or min), by :func:`improves`."""
    best, best_value = None, None
    for found_dir in checkpoints:
        value = found_dir.metrics.get(metric) if metric is not None else None
        if improves(value, best_value, mode):
            best, best_value = found_dir, value
    return best


def is_artifact_path(directory: str | Path) -> bool:
    """True when ``directory`` is the ISC's ``CHECKPOINT_ARTIFACT_PATH``, where the ISC, not the
    recipe, decides what is deleted."""
    artifact_path = os.environ.get(ARTIFACT_PATH_VARIABLE)
    return bool(artifact_path) and os.path.abspath(directory) == os.path.abspath(artifact_path)


class _HashingWriter:
    """A file object that hashes what ``torch.save`` writes, so no second read is needed."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


class HostSnapshot:
    """Host-memory copies of a state for background writes, in buffers reused from save to save.

    The first snapshot allocates one buffer per tensor (page-locked when the tensor is on a
    GPU, so the device-to-host copies run at full speed and can all be queued before a single
    synchronisation); later snapshots of a state with the same structure refill them in place,
    so the training loop pays one memory copy and no allocation. A snapshot's buffers may be
    refilled only after the previous snapshot has been written.

    The price is host memory: rank 0 (which snapshots everything that is not sharded) keeps a
    copy of the whole training state, model, optimizer state and EMA, for the life of the run,
    page-locked on a GPU machine. For ViT-L/14 with AdamW and an EMA that is about 5 GB, and more
    in practice: PyTorch's caching host allocator rounds each pinned block up to a power of two
    (up to twice the size). Page-locked memory cannot be swapped; leave room for it beside the
    DataLoader workers, or save synchronously (``checkpoint.async_save=false``). FSDP shards are
    staged by ``torch.distributed.checkpoint`` instead, each rank its own.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def snapshot(self, obj: Any) -> Any:
        """A copy of ``obj`` with every tensor in host memory, complete when this returns.

        Host-to-host copies run on this thread alone: a state holds hundreds of tensors, and
        when the other cores are busy (with DataLoader workers, say) waking the intra-op thread
        pool for each one costs far more than the parallel copy saves (ResNet-50 + momentum on
        2 busy cores: about 0.1 s on one thread, 0.2-0.3 s on two).
        """
        devices: set[torch.device] = set()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            copied = self._copy(obj, (), devices)
        finally:
            torch.set_num_threads(threads)
        for device in devices:
            torch.cuda.synchronize(device)
        return copied

    def _copy(self, obj: Any, key: tuple, devices: set[torch.device]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), key, devices)
        if isinstance(obj, dict):
            copied = type(obj)((name, self._copy(value, (*key, name), devices)) for name, value in obj.items())
            if hasattr(obj, "_metadata"):  # module state dicts carry their version numbers here
                copied._metadata = copy.deepcopy(obj._metadata)
            return copied
        if isinstance(obj, (list, tuple)):
            items = [self._copy(value, (*key, i), devices) for i, value in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuple or not
        return copy.deepcopy(obj)  # plain values too: the loop may change them while the writer runs

    def _copy_tensor(self, tensor: torch.Tensor, key: tuple, devices: set[torch.device]) -> torch.Tensor:
        on_gpu = tensor.device.type == "cuda"
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=on_gpu)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=on_gpu)
        if on_gpu:
            devices.add(tensor.device)
        return buffer


def _tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in ``obj`` (nested dicts, lists, tuples); of a sharded tensor
    (a DTensor), its whole size, which is what the checkpoint of all ranks holds."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(value) for value in obj)
    return 0


def _readable_size(size: float) -> str:
    """``size`` bytes as 40 B, 3.2 kB, 97.5 MB, 1.2 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def _os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, a cause, or one rank's failure in a
    ``torch.distributed.checkpoint`` exception (which wraps each rank's exception)."""
    seen: list[BaseException] = []
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if current is None or any(current is earlier for earlier in seen):
            continue
        seen.append(current)
        if isinstance(current, OSError):
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
        pending += [current.__cause__, current.__context__]
    return None



@dataclass(frozen=True)
class Attachment:
    """A file that travels in a checkpoint directory beside its state (compiled code:
    ``common/run/compile_cache.py``). Its sha256 and size go into the manifest's ``attachments`` with
    ``info``, not among the checkpoint's ``files``: a damaged attachment is for its reader to
    ignore (:func:`read_attachment`), never a reason to fall back to an older checkpoint."""

    name: str
    data: bytes
    info: dict[str, Any]

    @functools.cached_property
    def entry(self) -> dict[str, Any]:
        """What the manifest records (its digest computed once: the same attachment is saved again)."""
        return {**self.info, "sha256": hashlib.sha256(self.data).hexdigest(), "size": len(self.data)}


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict[str, Any]
    metrics: dict[str, float]
    provenance: dict[str, Any] | None = None  # of the run segment that saved it (common/records/provenance.py)
    attachments: dict[str, dict[str, Any]] = field(default_factory=dict)  # the manifest's entry of each


class CheckpointError(Exception):
    """A checkpoint that is incomplete or whose content does not match its manifest."""


def read_attachment(checkpoint: Path, name: str, entry: dict[str, Any]) -> bytes:
    """The attachment ``name`` of ``checkpoint``, checked against its manifest ``entry``;
    :class:`CheckpointError` when it is missing or damaged."""
    try:
        data = (checkpoint / name).read_bytes()
    except OSError as error:
        raise CheckpointError(f"{name} cannot be read ({error.strerror or error})") from error
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{name} does not match its sha256 in the manifest")
    return data


def verify_checkpoint(path: Path, digests: bool = True) -> dict[str, Any]:
    """The manifest of ``path`` if every file matches it (size, and sha256 with ``digests``);
    :class:`CheckpointError` otherwise."""
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
        if digests and _file_digest(file) != expected["sha256"]:
            raise CheckpointError(f"{relative} does not match its sha256")
    return manifest


def _load_candidates(directory: Path, log: Callable[[str], None] = _report_to_stderr) -> list[Path]:
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
                            log: Callable[[str], None] = _report_to_stderr) -> tuple[Path, dict[str, Any]] | None:
    """The latest checkpoint whose files match its manifest, and the manifest; a damaged one is
    reported and the previous one tried. Reads only: nothing in ``directory`` changes."""
    for path in _load_candidates(directory, log):
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as error:
            log(f"warning: checkpoint {path} is damaged ({error}); trying the previous one")
    return None


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (a full disk, a quota, a permission). Its partial
    directory is removed; the earlier checkpoints stay valid, and the run resumes from them."""


class CheckpointManager:
    """Saves and finds checkpoints in one directory; safe to use from every rank.

    ``N`` counts saves (the step is in the manifest): a step saved twice is a newer directory, and
    nothing is replaced. A save is written into ``.tmp-checkpoint_<N>`` (a name neither the ISC
    nor AtomicDirectory takes for a checkpoint), fsynced, given its manifest, verified and renamed
    into place; then a new symlink ``AtomicDirectory.latest_checkpoint_temp`` is ``os.replace``d
    onto the old one, which commits it. A directory above the symlink's ``N`` that is not
    ``_force`` was never committed and is deleted when the next manager starts (AtomicDirectory's
    rule). Readers resolve the symlink's absolute target by its name inside the folder, so a folder
    moved elsewhere resumes. At an ISC sync only the symlink's target and the ``_force``
    directories ship, so the best and the milestones are ``_force``; with ``keep_last=-1``
    (:data:`KEEP_ALL`, in ``CHECKPOINT_ARTIFACT_PATH``) nothing is pruned here, otherwise the
    ``keep_last`` newest steps, the best and the milestones stay. A directory is renamed to a
    ``.tmp-`` name before it is deleted. Loading verifies the manifest's digests from the newest
    down and says which damaged checkpoint it skipped.

    Rank 0 writes ``state.pt``; with ``sharded_state`` every rank writes its shard through
    ``torch.distributed.checkpoint``. With ``async_save=True`` the state (and each rank's shards)
    is copied to host memory and written in the background, at most one save in flight; the
    write is the same atomic sequence, so a crash during it leaves the previous checkpoint as the
    latest. A save that fails for an OS error (a full disk) removes its partial directory and
    raises :class:`CheckpointWriteError` on every rank, from ``save`` or, for a background save,
    from the next :meth:`wait`. Call :meth:`wait` before the process exits: the writer is a
    daemon thread.
    """

    def __init__(
        self,
        directory: str | Path,
        keep_last: int = 2,
        keep_best: bool = True,
        best_metric: str | None = None,
        best_mode: str = "max",
        async_save: bool = False,
        log: Callable[[str], None] = _report_to_stderr,
    ) -> None:
        if keep_last < 1 and keep_last != KEEP_ALL:
            raise ValueError(f"keep_last must be at least 1, or {KEEP_ALL} to keep every checkpoint")
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be max or min, not {best_mode!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best and best_metric is not None
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = async_save
        self.log = log
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self._snapshots = HostSnapshot()
        self._thread: threading.Thread | None = None
        self._shards_written: Future | None = None  # this rank's background shard write (sharded async saves)
        self._background_size = 0  # bytes of the save in flight, for the message if it fails
        self._error: BaseException | None = None
        self._best_value: float | None = None
        # Background shard writes agree over a gloo group of their own: their collectives run in
        # another thread than the training loop's, and must not interleave with them.
        self._shard_group = distributed.gloo_group() if async_save and dist.is_initialized() else None
        next_index = None
        if self.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_uncommitted()
            found = checkpoint_dirs(self.directory)
            next_index = found[-1].index + 1 if found else 0
            best = self.best()
            self._best_value = best.metrics[self.best_metric] if best is not None else None
        self._next_index: int = distributed.broadcast_object(next_index)

    def _remove_uncommitted(self) -> None:
        """Half-written saves, a stale temporary symlink, and directories above the symlink's
        ``N`` that are not ``_force`` (renamed into place by a save that crashed before the symlink
        moved). Refuses a folder of the layout before this one rather than starting from scratch."""
        if list(self.directory.glob("step_*/manifest.json")) and not checkpoint_dirs(self.directory):
            raise UserError(f"{self.directory} holds checkpoints in the older step_<N>/ layout, which this version "
                            f"does not read; finish that run with the version that wrote it, or use a new run_dir")
        for stale in self.directory.glob(f"{_TMP_PREFIX}*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        (self.directory / _LATEST_TEMP).unlink(missing_ok=True)
        found = checkpoint_dirs(self.directory)
        target = next((found_dir for found_dir in found if found_dir.path.name == latest_name(self.directory)), None)
        for found_dir in found:
            if target is not None and found_dir.index > target.index and not found_dir.force:
                self.log(f"removing {found_dir.path}: its save never reached {LATEST}")
                self._delete(found_dir.path)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        state: dict[str, Any],
        metrics: dict[str, float] | None = None,
        sharded_state: dict[str, Any] | None = None,
        milestone: str | None = None,
        config: dict[str, Any] | None = None,
        provenance: dict[str, Any] | None = None,
        attachments: tuple[Attachment, ...] = (),
    ) -> None:
        """Write a checkpoint of ``step``. Blocks until it is committed unless ``async_save`` is on.
        Collective: every rank calls it.

        ``milestone`` (e.g. "end of linear probe") names a checkpoint that must be kept: it is
        ``_force`` and never pruned. ``config`` (the run's config as plain data) goes into the
        manifest, so a checkpoint folder on its own says how to rebuild its model, and so does
        ``provenance`` (the record of the run segment that saves it), so it says what wrote it. Rank
        0's ``attachments`` are written beside the state (see :class:`Attachment`). With
        ``async_save`` it waits for the previous background save, copies ``state`` and this rank's
        ``sharded_state`` to host memory and returns; :meth:`wait` (or the next save or load)
        blocks until it is committed.
        """
        self.wait()
        metrics = dict(metrics or {})
        index = self._next_index
        self._next_index += 1
        tmp = self.directory / f"{_TMP_PREFIX}checkpoint_{index}"
        size = _tensor_bytes(state) + _tensor_bytes(sharded_state)
        failure = None
        if self.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as error:
                failure = self._write_failure(error, size)
        self._raise_if_any_rank_failed(failure)  # also the barrier before every rank writes into tmp
        force = self._is_new_best(metrics) or milestone is not None if self.is_main else False
        final = self.directory / _checkpoint_dir_name(index, force)
        manifest = {"format": 2, "step": step, "metrics": metrics, "milestone": milestone}
        if config is not None:
            manifest["config"] = config
        if provenance is not None:
            manifest["provenance"] = provenance
        if attachments:
            manifest["attachments"] = {attachment.name: attachment.entry for attachment in attachments}
        if self.async_save:
            self._save_in_background(tmp, final, state, sharded_state, manifest, size, attachments)
            return
        try:
            if sharded_state is not None:
                import torch.distributed.checkpoint as dcp

                dcp.save(sharded_state, checkpoint_id=str(tmp / SHARDED_DIR))
            if self.is_main:
                self._write(tmp, final, state, manifest, attachments)
        except BaseException as error:  # torch.distributed.checkpoint raises a BaseException subclass
            if _os_error_in(error) is None:
                raise
            failure = self._write_failure(error, size, tmp, final)
        self._raise_if_any_rank_failed(failure)

    def _save_in_background(self, tmp: Path, final: Path, state: dict[str, Any], sharded_state: dict[str, Any] | None,
                            manifest: dict[str, Any], size: int, attachments: tuple[Attachment, ...]) -> None:
        """Copy what this rank saves to host memory (all the loop waits for) and write it in the
        background: each rank its shards, then rank 0 the rest and the commit."""
        self._background_size = size
        if sharded_state is not None:
            import torch.distributed.checkpoint as dcp

            written = dcp.async_save(sharded_state, checkpoint_id=str(tmp / SHARDED_DIR),
                                     process_group=self._shard_group)
            self._shards_written = getattr(written, "upload_completion", written)  # newer releases wrap the future
        if not self.is_main:
            return
        snapshot = self._snapshots.snapshot(state)
        shards_written, self._shards_written = self._shards_written, None
        self._thread = threading.Thread(
            target=self._write_in_background, args=(tmp, final, snapshot, manifest, size, shards_written, attachments),
            name="checkpoint-writer", daemon=True,
        )
        self._thread.start()

    def _is_new_best(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` beat every earlier checkpoint's (then it is the new best)."""
        value = metrics.get(self.best_metric)
        if not self.keep_best or not improves(value, self._best_value, self.best_mode):
            return False
        self._best_value = value
        return True

    def _write_in_background(self, tmp: Path, final: Path, state: dict[str, Any], manifest: dict[str, Any],
                             size: int, shards_written: Future | None, attachments: tuple[Attachment, ...]) -> None:
        try:
            if shards_written is not None:
                shards_written.result()  # every rank's shards are on disk (the write's last step is collective)
            self._write(tmp, final, state, manifest, attachments)
        except BaseException as error:  # reported by the next wait()
            self._error = CheckpointWriteError(self._write_failure(error, size, tmp, final))\
                if _os_error_in(error) is not None else error

    def _write(self, tmp: Path, final: Path, state: dict[str, Any], manifest: dict[str, Any],
               attachments: tuple[Attachment, ...] = ()) -> None:
        files: dict[str, dict[str, Any]] = {}
        for attachment in attachments:
            with open(tmp / attachment.name, "wb") as handle:
                handle.write(attachment.data)
                handle.flush()
                os.fsync(handle.fileno())
        with open(tmp / STATE_FILE, "wb") as handle:
            writer = _HashingWriter(handle)
            torch.save(state, writer)
            handle.flush()
            os.fsync(handle.fileno())
        files[STATE_FILE] = {"sha256": writer.sha256.hexdigest(), "size": writer.size}
        sharded = tmp / SHARDED_DIR
        if sharded.is_dir():
            for path in sorted(p for p in sharded.rglob("*") if p.is_file()):
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
                files[str(path.relative_to(tmp))] = {"sha256": _file_digest(path), "size": path.stat().st_size}
            _fsync_dir(sharded)
        with open(tmp / MANIFEST_FILE, "w") as handle:
            handle.write(jsonfiles.dumps({**manifest, "files": files}, indent=1, sort_keys=True))
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_dir(tmp)
        self.verify(tmp, digests=False)  # the digests were taken from the bytes as they were written
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        self._point_latest_at(final)
        self._prune()

    def _write_failure(self, error: BaseException, size: int, tmp: Path | None = None,
                       final: Path | None = None) -> str:
        """Remove what a failed save left (its directory, never committed) and say in one line why
        it failed and what a checkpoint needs."""
        if self.is_main:
            for partial in (tmp, final):
                if partial is not None and latest_name(self.directory) != partial.name:
                    shutil.rmtree(partial, ignore_errors=True)
            (self.directory / _LATEST_TEMP).unlink(missing_ok=True)
        os_error = _os_error_in(error)
        cause = (os_error.strerror or str(os_error)) if os_error is not None else str(error).splitlines()[0]
        try:
            free = f", {_readable_size(shutil.disk_usage(self.directory).free)} free there"
        except OSError:
            free = ""
        return (f"could not write a checkpoint to {self.directory}: {cause} (a checkpoint needs about "
                f"{_readable_size(size)}{free}); the earlier checkpoints are intact")

    def _raise_if_any_rank_failed(self, failure: str | None) -> None:
        """Raise :class:`CheckpointWriteError` on every rank when a save failed on any rank, so
        that none of them waits for the others in a later collective. Collective."""
        failures = [message for message in distributed.all_gather_object(failure) if message is not None]
        if failures:
            raise CheckpointWriteError(failures[0])

    def _point_latest_at(self, final: Path) -> None:
        """Move the symlink the way AtomicDirectory does: a new link, then ``os.replace``."""
        temp = self.directory / _LATEST_TEMP
        temp.unlink(missing_ok=True)
        os.symlink(os.path.abspath(final), temp)
        os.replace(temp, self.directory / LATEST)
        _fsync_dir(self.directory)

    def wait(self) -> None:
        """Block until a background save is committed; if it failed on any rank, raise on every
        rank (:class:`CheckpointWriteError` for an OS error such as a full disk). Collective."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._shards_written is not None:
            try:
                self._shards_written.result()
            except BaseException as error:  # torch.distributed.checkpoint raises a BaseException subclass
                self._error = error
            self._shards_written = None
        error, self._error = self._error, None
        failure = None
        if isinstance(error, CheckpointWriteError):
            failure = str(error)
        elif error is not None and _os_error_in(error) is not None:
            failure = self._write_failure(error, self._background_size)
        elif error is not None:
            raise RuntimeError(f"background checkpoint save failed: {error}") from error
        self._raise_if_any_rank_failed(failure)

    # --------------------------------------------------------------- retention

    def best(self) -> CheckpointDir | None:
        """The committed checkpoint with the best ``best_metric`` (None without one, or without a metric)."""
        if not self.keep_best:
            return None
        return best_checkpoint(committed_checkpoints(self.directory), self.best_metric, self.best_mode)

    def _prune(self) -> None:
        if self.keep_last == KEEP_ALL:
            return
        committed = committed_checkpoints(self.directory)
        newest_first, steps_seen = [], set()
        for found_dir in reversed(committed):
            if found_dir.step not in steps_seen:  # an older directory of the same step was replaced
                steps_seen.add(found_dir.step)
                newest_first.append(found_dir)
        keep = {found_dir.path for found_dir in newest_first[: self.keep_last]}
        keep |= {found_dir.path for found_dir in committed if found_dir.manifest.get("milestone")}
        best = self.best()
        if best is not None:
            keep.add(best.path)
        for found_dir in committed:
            if found_dir.path not in keep:
                self._delete(found_dir.path)

    def _delete(self, path: Path) -> None:
        """Rename ``path`` out of the layout, then delete it: a crash in the middle of deleting
        leaves a ``.tmp-`` directory, which the next manager removes, never a checkpoint
        directory with some of its files gone."""
        doomed = self.directory / f"{_TMP_PREFIX}deleting-{path.name}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    # ----------------------------------------------------------------- loading

    def verify(self, path: Path, digests: bool = True) -> dict[str, Any]:
        """The manifest of ``path`` if every file matches it; see :func:`verify_checkpoint`."""
        return verify_checkpoint(path, digests)

    def load_latest(
        self, map_location: str | torch.device = "cpu", sharded_state: dict[str, Any] | None = None
    ) -> LoadedCheckpoint | None:
        """The latest valid checkpoint (None if there is none), chosen by rank 0 for all ranks.

        With ``sharded_state`` (a state dict of the current, possibly differently sharded
        model), the sharded part is loaded into it in place, resharding as needed.
        """
        self.wait()
        chosen = None
        if self.is_main and self.directory.is_dir():
            found = newest_valid_checkpoint(self.directory, self.log)
            if found is not None:
                chosen = (str(found[0]), found[1]["step"], found[1]["metrics"], found[1].get("provenance"),
                          found[1].get("attachments", {}))
        chosen = distributed.broadcast_object(chosen)
        if chosen is None:
            return None
        path, step, metrics, provenance, attachments = Path(chosen[0]), *chosen[1:]
        try:
            state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(f"{path / STATE_FILE} holds objects other than tensors and plain data; "
                                  f"refusing to load it ({str(error).splitlines()[0]})") from error
        if sharded_state is not None:
            import torch.distributed.checkpoint as dcp

            dcp.load(sharded_state, checkpoint_id=str(path / SHARDED_DIR))
        return LoadedCheckpoint(path=path, step=step, state=state, metrics=metrics, provenance=provenance,
                                attachments=attachments)
