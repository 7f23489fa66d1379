"""A search inside one Strong Compute ISC experiment: what it keeps in ``CHECKPOINT_ARTIFACT_PATH``
(``--checkpoint-artifacts``) so that it goes on across cycles.

A cycle starts with only what the ISC shipped of ``CHECKPOINT_ARTIFACT_PATH``: for each
``<name>.latest_checkpoint`` symlink its target, and the ``_force`` directories (see
docs/clusters.md). ``LOSSY_ARTIFACT_PATH`` is synced for download, but nothing promises that the
next cycle starts with it. So the study folder (trials' run directories, ``study.json``, plots)
goes to ``LOSSY_ARTIFACT_PATH`` for the user to download, and two things go to the artifact path:

* the study's journal, as AtomicDirectory checkpoints of its own name, ``search_checkpoint_<N>/``
  (``journal.log`` and a manifest with its sha256), the symlink ``search.latest_checkpoint`` moved
  to each new one. The worker writes one after every change it makes (a trial asked for, a trial
  recorded); a cycle whose study folder has no journal, or a shorter one (the journal only grows),
  starts from the newest intact copy;
* the running trial's checkpoints: its ``checkpoint.dir`` is the artifact path itself, as a plain
  run's is on the ISC, so only one trial runs per experiment. When the trial ends they move into
  its run directory in the study folder, so the next trial starts with none. Before a trial
  trains, every checkpoint there that its manifest's config does not name as this trial's is
  moved out: into the run directory of the trial it names when the study recorded that trial's
  end (one that ended in a cycle's last seconds), else aside, never resumed with other
  parameters; a copy already moved out once (the ISC can restore a shipped directory again) is
  deleted. Trials keep no ``_force`` best checkpoint there (``checkpoint.keep_best=false``): the
  ISC keeps every ``_force`` directory it ships and restores it into every later cycle, and a later
  trial's, numbered from 1 again, would carry the same name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from common.checkpoint.layout import LATEST, MANIFEST_FILE, checkpoint_dirs
from common.jsonfiles import write_json

SAVER = "search"  # the AtomicDirectory name of the journal's checkpoints
SAVER_LATEST = f"{SAVER}.latest_checkpoint"
SAVER_DIR = re.compile(rf"^{SAVER}_checkpoint_(\d+)$")
JOURNAL_COPY = "journal.log"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _saved_journals(artifacts: Path) -> list[tuple[int, Path]]:
    """The journal's checkpoints in ``artifacts``, newest first."""
    found = [(int(match.group(1)), path) for path in artifacts.iterdir() if (match := SAVER_DIR.match(path.name))]
    return sorted(found, reverse=True)


def save_journal(journal: Path, artifacts: Path) -> None:
    """A new checkpoint of the journal in ``artifacts``, committed by moving the symlink to it (the
    ISC deletes the older ones it does not ship). The copy is taken under the journal's lock, so it
    holds whole entries only."""
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(journal))
    lock.acquire()
    try:
        data = journal.read_bytes()
    finally:
        lock.release()
    index = 1 + max((number for number, _ in _saved_journals(artifacts)), default=0)
    final = artifacts / f"{SAVER}_checkpoint_{index}"
    partial = artifacts / f".tmp-{final.name}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    with open(partial / JOURNAL_COPY, "wb") as copy:
        copy.write(data)
        copy.flush()
        os.fsync(copy.fileno())
    write_json(partial / MANIFEST_FILE, {"step": index, "bytes": len(data), "sha256": _sha256(data)})
    partial.rename(final)
    link = artifacts / f"{SAVER_LATEST}_temp"
    link.unlink(missing_ok=True)
    os.symlink(final.resolve(), link)
    os.replace(link, artifacts / SAVER_LATEST)


def restore_journal(journal: Path, artifacts: Path, say: Callable[[str], None]) -> None:
    """Put the newest intact journal checkpoint in place of ``journal`` when it is longer (the
    journal only grows: the longer of two copies of one history is the newer)."""
    current = journal.stat().st_size if journal.is_file() else 0
    for _, path in _saved_journals(artifacts):
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
            data = (path / JOURNAL_COPY).read_bytes()
        except (OSError, ValueError):
            continue
        if _sha256(data) != manifest.get("sha256"):
            say(f"{path} is damaged (its journal does not match its sha256); trying an older one")
            continue
        if len(data) > current:
            journal.parent.mkdir(parents=True, exist_ok=True)
            partial = journal.with_name(f".{journal.name}.{os.getpid()}.tmp")
            partial.write_bytes(data)
            os.replace(partial, journal)
            say(f"restored the study's journal from {path} ({len(data)} bytes)")
        return


def belongs_to(config: dict[str, Any] | None, run_dir: Path, params: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``config`` (from its manifest) is that of the trial with ``run_dir``
    (by its name: the study folder moves between cycles) and ``params``."""
    if not isinstance(config, dict) or "run_dir" not in config:
        return False
    node = OmegaConf.create(config)
    return (Path(str(node.run_dir)).name == run_dir.name
            and all(OmegaConf.select(node, key) == value for key, value in params.items()))


def manifest_config(checkpoint: Path) -> dict[str, Any] | None:
    """The run config a checkpoint's manifest holds (None when unreadable)."""
    try:
        return json.loads((checkpoint / MANIFEST_FILE).read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return None


def clear_for(artifacts: Path, run_dir: Path, params: dict[str, Any],
              destination_of: Callable[[dict[str, Any] | None], Path]) -> list[str]:
    """Move every checkpoint in ``artifacts`` that is not this trial's to ``destination_of(its
    config)``; one already there (a copy the ISC restored again) is deleted. Returns a line for
    each destination."""
    moved: dict[Path, int] = {}
    for found in checkpoint_dirs(artifacts):
        config = manifest_config(found.path)
        if belongs_to(config, run_dir, params):
            continue
        destination = destination_of(config)
        if (destination / found.path.name).exists():
            shutil.rmtree(found.path)
        else:
            destination.mkdir(parents=True, exist_ok=True)
            shutil.move(str(found.path), str(destination / found.path.name))
            moved[destination] = moved.get(destination, 0) + 1
    link = artifacts / LATEST
    if link.is_symlink() and not (artifacts / Path(os.readlink(link)).name).is_dir():
        link.unlink()
    return [f"{count} checkpoint(s) of another trial to {destination}" for destination, count in moved.items()]


def move_checkpoints(artifacts: Path, destination: Path) -> None:
    """Move the trial checkpoints (and their symlink) out of ``artifacts`` into ``destination``."""
    destination.mkdir(parents=True, exist_ok=True)
    for found in checkpoint_dirs(artifacts):
        shutil.move(str(found.path), str(destination / found.path.name))
    if (artifacts / LATEST).is_symlink():
        shutil.move(str(artifacts / LATEST), str(destination / LATEST))
