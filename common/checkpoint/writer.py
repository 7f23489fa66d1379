"""Writing a checkpoint: the atomic write sequence, the host snapshot a background save writes from,
and the thread that writes it."""

from __future__ import annotations

import copy
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from common import jsonfiles
from common.checkpoint.layout import (
    MANIFEST_FILE,
    SHARDED_DIR,
    STATE_FILE,
    Attachment,
    file_digest,
    fsync_dir,
    point_latest_at,
    verify_checkpoint,
)
from common.errors import UserError


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (a full disk, a quota, a permission).

    - Its partial directory is removed; the earlier checkpoints stay valid, and the run resumes from them.
    """


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


def write_checkpoint(directory: Path, tmp: Path, final: Path, state: dict[str, Any], manifest: dict[str, Any],
                     attachments: tuple[Attachment, ...] = ()) -> None:
    """Write rank 0's part of a checkpoint into ``tmp`` and commit it as ``final`` in ``directory``.

    - Writes its files (:func:`write_checkpoint_files`), renames ``tmp`` to ``final`` and moves the
      symlink onto it: a crash at any point leaves the previous checkpoint as the latest.
    """
    write_checkpoint_files(tmp, state, manifest, attachments)
    os.rename(tmp, final)
    fsync_dir(directory)
    point_latest_at(directory, final)


def write_checkpoint_files(tmp: Path, state: dict[str, Any], manifest: dict[str, Any],
                           attachments: tuple[Attachment, ...] = ()) -> None:
    """Write ``attachments``, ``state.pt`` (hashed as it is written) and the manifest into ``tmp``, each fsynced.

    - Lists the files of ``sharded/`` that the ranks already wrote; verifies the sizes.
    """
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
            files[str(path.relative_to(tmp))] = {"sha256": file_digest(path), "size": path.stat().st_size}
        fsync_dir(sharded)
    with open(tmp / MANIFEST_FILE, "w") as handle:
        handle.write(jsonfiles.dumps({**manifest, "files": files}, indent=1, sort_keys=True))
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(tmp)
    verify_checkpoint(tmp, digests=False)  # the digests were taken from the bytes as they were written


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in ``obj`` (nested dicts, lists, tuples).

    - Of a sharded tensor (a DTensor), its whole size, which is what the checkpoint of all ranks holds.
    """
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def readable_size(size: float) -> str:
    """``size`` bytes as 40 B, 3.2 kB, 97.5 MB, 1.2 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind ``error``; None without one.

    - Looks at ``error`` itself, its causes, and each rank's failure in a
      ``torch.distributed.checkpoint`` exception (which wraps each rank's exception).
    """
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


class HostSnapshot:
    """Host-memory copies of a state for background writes, in buffers reused from save to save.

    - The first snapshot allocates one buffer per tensor, page-locked when the tensor is on a GPU
      (the device-to-host copies run at full speed and are all queued before one synchronisation).
    - Later snapshots of a state with the same structure refill them in place: the training loop
      pays one memory copy and no allocation. Refill only after the previous snapshot was written.
    - Costs host memory: rank 0 (which snapshots everything that is not sharded) keeps a copy of the
      whole training state (model, optimizer state, EMA) for the life of the run, page-locked on a
      GPU machine, where PyTorch's caching host allocator rounds each block up to a power of two.
      Sizes: ``benchmarks/RESULTS.md``, "Background checkpoint writes". Page-locked memory cannot
      be swapped; leave room for it beside the DataLoader workers, or save synchronously
      (``checkpoint.async_save=false``).
    - FSDP shards are staged by ``torch.distributed.checkpoint`` instead, each rank its own.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def snapshot(self, obj: Any) -> Any:
        """A copy of ``obj`` with every tensor in host memory, complete when this returns.

        - Host-to-host copies run on this thread alone: a state holds hundreds of tensors, and with
          the other cores busy (DataLoader workers) waking the intra-op pool for each one costs more
          than the parallel copy saves (figures: ``benchmarks/RESULTS.md``, "Background checkpoint writes").
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


class BackgroundWriter:
    """One background save at a time: this rank's shard write and, on rank 0, a thread that writes the rest.

    - :meth:`write_shards` then :meth:`start` begin a save; :meth:`finish` blocks until it is done.
      Begin the next one only after :meth:`finish` returned: the snapshot's buffers are reused.
    - An error is kept, not raised: :meth:`finish` returns it.
    - The thread is a daemon: call :meth:`finish` before the process exits.
    """

    def __init__(self) -> None:
        self._snapshots = HostSnapshot()
        self._thread: threading.Thread | None = None
        self._shards_written: Future | None = None  # this rank's background shard write (sharded async saves)
        self._error: BaseException | None = None

    def write_shards(self, sharded_state: dict[str, Any], checkpoint_id: str, process_group: Any) -> None:
        """Stage this rank's shards and write them to ``checkpoint_id`` in the background.

        - ``process_group``: where the write's collectives run, apart from the training loop's.
        """
        import torch.distributed.checkpoint as dcp

        written = dcp.async_save(sharded_state, checkpoint_id=checkpoint_id, process_group=process_group)
        self._shards_written = getattr(written, "upload_completion", written)  # newer releases wrap the future

    def start(self, state: dict[str, Any], write: Callable[[dict[str, Any]], None],
              describe: Callable[[BaseException], str]) -> None:
        """Copy ``state`` to host memory (all the loop waits for), then ``write(copy)`` in a thread.

        - The thread first waits for every rank's shards (the shard write's last step is collective).
        - An OS error becomes a :class:`CheckpointWriteError` with the line ``describe(error)`` gives.
        """
        snapshot = self._snapshots.snapshot(state)
        shards_written, self._shards_written = self._shards_written, None
        self._thread = threading.Thread(target=self._write, args=(snapshot, write, describe, shards_written),
                                        name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, snapshot: dict[str, Any], write: Callable[[dict[str, Any]], None],
               describe: Callable[[BaseException], str], shards_written: Future | None) -> None:
        try:
            if shards_written is not None:
                shards_written.result()  # every rank's shards are on disk (the write's last step is collective)
            write(snapshot)
        except BaseException as error:  # returned by the next finish()
            self._error = CheckpointWriteError(describe(error)) if os_error_in(error) is not None else error

    def finish(self) -> BaseException | None:
        """Block until the save in flight (if any) is written on this rank; the error it ended with, if any."""
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
        return error
