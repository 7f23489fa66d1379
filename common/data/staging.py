"""Copy a dataset to node-local disk before training: many small files on a network file system are slow.

- Local rank 0 copies the folder (into ``$TMPDIR`` on most SLURM clusters) while the node's other ranks wait.
- A completion marker lets a restarted job on the same node reuse the copy.
- Symlinks are followed: a prepared tree of links becomes real files.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

from common.errors import UserError
from common.pytorch import distributed

_COMPLETE_MARKER = ".staging-complete"


def _staged_path(source: Path, stage_root: Path) -> Path:
    """Where ``source`` is staged: one folder per source path, so two datasets never collide."""
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:10]
    return stage_root / f"{source.name}-{tag}"


def stage_directory(source: str | Path, stage_root: str | Path, local_rank: int,
                    poll_seconds: float = 1.0) -> Path:
    """Copy ``source`` under ``stage_root`` once per node and return the copy.

    Collective (a barrier at the end); raises ``UserError`` when ``source`` is no folder or the copy fails."""
    source, stage_root = Path(source), Path(stage_root)
    if not source.is_dir():
        raise UserError(f"cannot stage {source}: it is not a directory")
    target = _staged_path(source, stage_root)
    marker = target / _COMPLETE_MARKER
    if local_rank == 0 and not marker.is_file():
        partial = target.with_name(target.name + ".partial")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(source, partial, symlinks=False)
            (partial / _COMPLETE_MARKER).write_text(f"{source.resolve()}\n")
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
        except OSError as error:
            raise UserError(f"could not stage {source} to {stage_root}: {error}") from error
    while not marker.is_file():  # the other local ranks wait for the copy without a collective time-out
        time.sleep(poll_seconds)
    distributed.barrier()
    return target
