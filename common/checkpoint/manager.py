"""``CheckpointManager``: saves, retention and loading of the checkpoints of one run directory, on every rank."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.checkpoint.layout import (
    LATEST,
    LATEST_TEMP,
    SHARDED_DIR,
    STATE_FILE,
    TMP_PREFIX,
    Attachment,
    CheckpointDir,
    CheckpointError,
    best_checkpoint,
    best_checkpoints,
    checkpoint_dir_name,
    checkpoint_dirs,
    committed_checkpoints,
    improves,
    latest_name,
    newest_valid_checkpoint,
    report_to_stderr,
    verify_checkpoint,
)
from common.checkpoint.writer import (
    BackgroundWriter,
    CheckpointWriteError,
    os_error_in,
    readable_size,
    tensor_bytes,
    write_checkpoint,
)
from common.errors import UserError
from common.pytorch import distributed

KEEP_ALL = -1  # keep_last: prune nothing (in CHECKPOINT_ARTIFACT_PATH, where the ISC decides)


@dataclass
class LoadedCheckpoint:
    """What :meth:`CheckpointManager.load_latest` found: the checkpoint's path, its state and its manifest's entries."""

    path: Path
    step: int
    state: dict[str, Any]
    metrics: dict[str, float]
    provenance: dict[str, Any] | None = None  # of the run segment that saved it (common/records/provenance.py)
    attachments: dict[str, dict[str, Any]] = field(default_factory=dict)  # the manifest's entry of each


class CheckpointManager:
    """Saves and finds the checkpoints in one directory; every rank makes one and calls it.

    - ``keep_last``: how many of the newest steps stay (at least 1), or :data:`KEEP_ALL` to prune
      nothing (in ``CHECKPOINT_ARTIFACT_PATH``, where the ISC decides). The best and the milestones
      always stay, and are ``_force`` so that an ISC sync ships them.
    - ``best_metric``, ``best_mode`` (``max`` or ``min``): the best checkpoint, by
      :func:`~common.checkpoint.layout.improves`; ``keep_best=False`` or no metric: none.
    - ``keep_best_k``: the ``k`` best by ``best_metric`` stay too (for ``make average BEST=k``), each
      ``_force`` when it ranks among them at its save; 0: the best alone, as ``keep_best`` says.
    - ``async_save``: copy the state (and each rank's shards) to host memory and write it in the
      background, at most one save in flight; call :meth:`wait` before the process exits.
    - ``N`` counts saves (the step is in the manifest): a step saved twice is a newer directory,
      nothing is replaced. Deleting renames a directory to a ``.tmp-`` name first.
    - A save that fails for an OS error (a full disk) removes its partial directory and raises
      :class:`~common.checkpoint.writer.CheckpointWriteError` on every rank, from :meth:`save` or,
      for a background save, from the next :meth:`wait`.
    - Starting removes what a crashed save left (:meth:`_remove_uncommitted`); raises
      :class:`~common.errors.UserError` for a folder of the older ``step_<N>/`` layout, and
      ``ValueError`` for a bad ``keep_last`` or ``best_mode``.
    """

    def __init__(
        self,
        directory: str | Path,
        keep_last: int = 2,
        keep_best: bool = True,
        best_metric: str | None = None,
        keep_best_k: int = 0,
        best_mode: str = "max",
        async_save: bool = False,
        log: Callable[[str], None] = report_to_stderr,
    ) -> None:
        if keep_last < 1 and keep_last != KEEP_ALL:
            raise ValueError(f"keep_last must be at least 1, or {KEEP_ALL} to keep every checkpoint")
        if keep_best_k < 0:
            raise ValueError(f"keep_best_k must be 0 or more, not {keep_best_k}")
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be max or min, not {best_mode!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best and best_metric is not None
        self.keep_best_k = keep_best_k if best_metric is not None else 0
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = async_save
        self.log = log
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self._background = BackgroundWriter()
        self._background_size = 0  # bytes of the save in flight, for the message if it fails
        self._best_value: float | None = None
        self._kept_best_values: list[float] = []  # of the keep_best_k best so far, best first
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
            self._kept_best_values = [found_dir.metrics[self.best_metric] for found_dir in self._kept_best()]
        self._next_index: int = distributed.broadcast_object(next_index)

    def _remove_uncommitted(self) -> None:
        """Half-written saves, a stale temporary symlink, and directories above the symlink's
        ``N`` that are not ``_force`` (renamed into place by a save that crashed before the symlink
        moved). Refuses a folder of the layout before this one rather than starting from scratch."""
        if list(self.directory.glob("step_*/manifest.json")) and not checkpoint_dirs(self.directory):
            raise UserError(f"{self.directory} holds checkpoints in the older step_<N>/ layout, which this version "
                            f"does not read; finish that run with the version that wrote it, or use a new run_dir")
        for stale in self.directory.glob(f"{TMP_PREFIX}*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        (self.directory / LATEST_TEMP).unlink(missing_ok=True)
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
        """Write a checkpoint of ``step``; collective, every rank calls it.

        - ``state``: rank 0's is written to ``state.pt``; ``sharded_state``: each rank's shard,
          through ``torch.distributed.checkpoint``, in ``sharded/``.
        - ``milestone`` (e.g. "end of linear probe"): a checkpoint that must be kept, ``_force`` and never pruned.
        - ``config`` (the run's config as plain data) and ``provenance`` (the record of the run
          segment that saves it) go into the manifest: a checkpoint folder on its own says how to
          rebuild its model and what wrote it. Rank 0's ``attachments`` are written beside the state.
        - Blocks until the checkpoint is committed; with ``async_save``, waits for the previous
          background save, copies ``state`` and this rank's ``sharded_state`` to host memory and
          returns, and :meth:`wait` (or the next save or load) blocks until it is committed.
        - Sequence: written into ``.tmp-checkpoint_<N>``, fsynced, given its manifest, verified,
          renamed into place; then the symlink is moved onto it, which commits it
          (:func:`~common.checkpoint.writer.write_checkpoint`); then older ones are pruned.
        """
        self.wait()
        metrics = dict(metrics or {})
        index = self._next_index
        self._next_index += 1
        tmp = self.directory / f"{TMP_PREFIX}checkpoint_{index}"
        size = tensor_bytes(state) + tensor_bytes(sharded_state)
        failure = None
        if self.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as error:
                failure = self._write_failure(error, size)
        self._raise_if_any_rank_failed(failure)  # also the barrier before every rank writes into tmp
        force = False
        if self.is_main:  # both asked: each updates what it tracks
            new_best, kept_best = self._is_new_best(metrics), self._ranks_among_kept_best(metrics)
            force = new_best or kept_best or milestone is not None
        final = self.directory / checkpoint_dir_name(index, force)
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
            if os_error_in(error) is None:
                raise
            failure = self._write_failure(error, size, tmp, final)
        self._raise_if_any_rank_failed(failure)

    def _save_in_background(self, tmp: Path, final: Path, state: dict[str, Any], sharded_state: dict[str, Any] | None,
                            manifest: dict[str, Any], size: int, attachments: tuple[Attachment, ...]) -> None:
        """Copy what this rank saves to host memory (all the loop waits for) and write it in the
        background: each rank its shards, then rank 0 the rest and the commit."""
        self._background_size = size
        if sharded_state is not None:
            self._background.write_shards(sharded_state, str(tmp / SHARDED_DIR), self._shard_group)
        if not self.is_main:
            return
        self._background.start(state, lambda snapshot: self._write(tmp, final, snapshot, manifest, attachments),
                               lambda error: self._write_failure(error, size, tmp, final))

    def _is_new_best(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` beat every earlier checkpoint's (then it is the new best)."""
        value = metrics.get(self.best_metric)
        if not self.keep_best or not improves(value, self._best_value, self.best_mode):
            return False
        self._best_value = value
        return True

    def _ranks_among_kept_best(self, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` rank among the ``keep_best_k`` best so far (then it is kept, and ``_force``)."""
        value = metrics.get(self.best_metric)
        values = self._kept_best_values
        if not self.keep_best_k or not improves(value, values[-1] if len(values) == self.keep_best_k else None,
                                                self.best_mode):
            return False
        values.append(value)
        values.sort(reverse=self.best_mode == "max")
        del values[self.keep_best_k :]
        return True

    def _write(self, tmp: Path, final: Path, state: dict[str, Any], manifest: dict[str, Any],
               attachments: tuple[Attachment, ...] = ()) -> None:
        """Rank 0's write and commit, then the pruning; in the background thread for a background save."""
        write_checkpoint(self.directory, tmp, final, state, manifest, attachments)
        self._prune()

    def _write_failure(self, error: BaseException, size: int, tmp: Path | None = None,
                       final: Path | None = None) -> str:
        """Remove what a failed save left (its directory, never committed) and say in one line why
        it failed and what a checkpoint needs."""
        if self.is_main:
            for partial in (tmp, final):
                if partial is not None and latest_name(self.directory) != partial.name:
                    shutil.rmtree(partial, ignore_errors=True)
            (self.directory / LATEST_TEMP).unlink(missing_ok=True)
        os_error = os_error_in(error)
        cause = (os_error.strerror or str(os_error)) if os_error is not None else str(error).splitlines()[0]
        try:
            free = f", {readable_size(shutil.disk_usage(self.directory).free)} free there"
        except OSError:
            free = ""
        return (f"could not write a checkpoint to {self.directory}: {cause} (a checkpoint needs about "
                f"{readable_size(size)}{free}); the earlier checkpoints are intact")

    def _raise_if_any_rank_failed(self, failure: str | None) -> None:
        """Raise :class:`CheckpointWriteError` on every rank when a save failed on any rank, so
        that none of them waits for the others in a later collective. Collective."""
        failures = [message for message in distributed.all_gather_object(failure) if message is not None]
        if failures:
            raise CheckpointWriteError(failures[0])

    def wait(self) -> None:
        """Block until a background save is committed; collective.

        - If it failed on any rank, raises on every rank: :class:`CheckpointWriteError` for an OS
          error such as a full disk, ``RuntimeError`` for any other.
        """
        error = self._background.finish()
        failure = None
        if isinstance(error, CheckpointWriteError):
            failure = str(error)
        elif error is not None and os_error_in(error) is not None:
            failure = self._write_failure(error, self._background_size)
        elif error is not None:
            raise RuntimeError(f"background checkpoint save failed: {error}") from error
        self._raise_if_any_rank_failed(failure)

    # --------------------------------------------------------------- retention

    def best(self) -> CheckpointDir | None:
        """The committed checkpoint with the best ``best_metric``; None without one, or without a metric."""
        if not self.keep_best:
            return None
        return best_checkpoint(committed_checkpoints(self.directory), self.best_metric, self.best_mode)

    def _kept_best(self) -> list[CheckpointDir]:
        """The ``keep_best_k`` committed checkpoints with the best ``best_metric``, best first."""
        return best_checkpoints(committed_checkpoints(self.directory), self.best_metric, self.best_mode)[
            : self.keep_best_k]

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
        keep |= {found_dir.path for found_dir in self._kept_best()}
        for found_dir in committed:
            if found_dir.path not in keep:
                self._delete(found_dir.path)

    def _delete(self, path: Path) -> None:
        """Rename ``path`` out of the layout, then delete it: a crash in the middle of deleting
        leaves a ``.tmp-`` directory, which the next manager removes, never a checkpoint
        directory with some of its files gone."""
        doomed = self.directory / f"{TMP_PREFIX}deleting-{path.name}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    # ----------------------------------------------------------------- loading

    def verify(self, path: Path, digests: bool = True) -> dict[str, Any]:
        """The manifest of ``path`` if every file matches it (:func:`~common.checkpoint.layout.verify_checkpoint`)."""
        return verify_checkpoint(path, digests)

    def load_latest(
        self, map_location: str | torch.device = "cpu", sharded_state: dict[str, Any] | None = None
    ) -> LoadedCheckpoint | None:
        """The latest valid checkpoint, chosen by rank 0 for all ranks; None if there is none. Collective.

        - Damaged ones are reported through ``log`` and skipped, newest first.
        - ``sharded_state`` (a state dict of the current, possibly differently sharded model):
          the sharded part is loaded into it in place, resharding as needed.
        - Raises :class:`~common.checkpoint.layout.CheckpointError` when ``state.pt`` holds
          objects other than tensors and plain data.
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
