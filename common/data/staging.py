"""Copy a dataset to node-local disk before training (optional in the recipes that read many files).

Reading a million small JPEGs from a network file system is often what limits an ImageNet run.
On each node, local rank 0 copies the data folder to a node-local directory (``$TMPDIR`` on most
SLURM clusters) while the other local ranks wait; a completion marker makes a restarted job on
the same node reuse the copy instead of copying again. Symlinks are followed, so a prepared
tree of links to the original files becomes real files.
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
    """Copy ``source`` under ``stage_root`` once per node and return the copy (collective)."""
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
