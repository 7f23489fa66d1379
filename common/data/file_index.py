"""A split's file list, built once and reused: names, labels and the image sizes the crop boxes need.

Why: torchvision's ``ImageFolder`` walks its whole tree in every process at every start (every rank,
requeue and ISC cycle); timings in benchmarks/RESULTS.md, issue 37.

- Built once, by ``make prep-<recipe>`` or at the first start (local rank 0 of each node reads every
  header in parallel while the others wait), saved as ``<name>.index.npz`` next to the data, or in the
  run directory's ``index/`` when the data's folder is read-only.
- Every later process loads it and checks it with one ``stat`` per folder it was built from (a
  folder's mtime changes when a file is added, removed or renamed).
- Changed folders or a bad checksum stop the run with one line naming the fix; the list is rebuilt only
  when asked (``data.rebuild_index=true``). A file changed in place is caught by its decoded size
  (:func:`common.data.images.check_size`).
- Names are one UTF-8 byte array plus their ends, not a list of a million strings: workers reading a
  Python list copy its pages through the reference counts (pytorch/pytorch#13246); numpy arrays stay shared.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from common.data.encoded import EncodedImage
from common.data.images import read_file, read_header
from common.errors import UserError
from common.pytorch.distributed import broadcast_object

FORMAT = 1  # the layout of the saved file; another one is built again
SUFFIX = ".index.npz"
PARALLEL_FROM = 2000  # files; fewer are read in this process (a pool takes a second to start)
UNREADABLE_SHOWN = 5


@dataclass
class FileIndex:
    """Every file of a split: name relative to the data root, label (``[N]`` or ``[N, K]``), size, nvjpeg flag.

    ``info``: what it was built from (JSON), with the watched folders and the checksum."""

    names: np.ndarray  # uint8: every name in UTF-8, one after another
    ends: np.ndarray  # int64 [N]: where each name ends in ``names``
    labels: np.ndarray  # int64
    widths: np.ndarray  # int32
    heights: np.ndarray  # int32
    device_decodable: np.ndarray  # bool
    info: dict[str, Any]

    ARRAYS = ("names", "ends", "labels", "widths", "heights", "device_decodable")

    def __len__(self) -> int:
        return len(self.ends)

    def name(self, index: int) -> str:
        start = int(self.ends[index - 1]) if index else 0
        return self.names[start : int(self.ends[index])].tobytes().decode()

    def checksum(self) -> str:
        """sha256 over the arrays: what the list holds, whatever file it is read from."""
        digest = hashlib.sha256()
        for name in self.ARRAYS:
            array = np.ascontiguousarray(getattr(self, name))
            digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    def save(self, path: Path) -> None:
        """Written next to ``path`` and renamed onto it: a reader sees the old list or the new one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        info = {**self.info, "checksum": self.checksum()}
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as handle:
                np.savez(handle, info=np.frombuffer(json.dumps(info).encode(), dtype=np.uint8),
                         **{name: getattr(self, name) for name in self.ARRAYS})
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        self.info = info

    @classmethod
    def load(cls, path: Path) -> FileIndex:
        """The list saved at ``path``; raises ``UserError`` when unreadable or its checksum fails."""
        try:
            with np.load(path, allow_pickle=False) as saved:
                info = json.loads(saved["info"].tobytes())
                arrays = {name: saved[name] for name in cls.ARRAYS}
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            raise UserError(f"{path} is not a readable file list ({error}); delete it, or list the files again "
                            "with data.rebuild_index=true") from error
        index = cls(**arrays, info=info)
        if info.get("format") != FORMAT or index.checksum() != info.get("checksum"):
            raise UserError(f"{path} does not match its checksum (damaged, or written by another version); delete "
                            "it, or list the files again with data.rebuild_index=true")
        return index

    def changes(self, root: Path) -> list[str]:
        """The folders and files the list was built from that changed since (a stat of each)."""
        changed = []
        for relative, (mtime_ns, _) in self.info["watched"].items():
            try:
                if os.stat(root / relative).st_mtime_ns != mtime_ns:
                    changed.append(relative)
            except OSError:
                changed.append(relative)
        return changed

    def describe_changes(self, root: Path, changed: list[str]) -> str:
        """One clause: which of the watched folders changed and how many entries they hold now."""
        then = sum(self.info["watched"][relative][1] for relative in changed)
        now = sum(len(os.listdir(root / relative)) if (root / relative).is_dir() else 1 for relative in changed
                  if (root / relative).exists())
        shown = ", ".join(f"{relative}/" if relative else "./" for relative in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"{shown}{more} changed ({then:,} entries then, {now:,} now)"


def watch(root: Path, relatives: Sequence[str]) -> dict[str, list[int]]:
    """What a list built now depends on: each folder's (or file's) modification time and entries."""
    watched = {}
    for relative in relatives:
        path = root / relative
        entries = len(os.listdir(path)) if path.is_dir() else 1
        watched[relative] = [os.stat(path).st_mtime_ns, entries]
    return watched


def _header(path: str) -> tuple[int, int, bool] | str:
    """A file's width, height and nvjpeg flag from its first few KB, or why it has none."""
    try:
        return read_header(path, path)
    except UserError as error:
        return str(error)


def read_headers(paths: Sequence[str], workers: int, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Widths, heights and nvjpeg flags of ``paths``, read in ``workers`` processes with a progress bar.

    Raises one ``UserError`` naming the first few unreadable files."""
    bar = tqdm(total=len(paths), desc=f"reading the headers of {what}", unit="files", file=sys.stderr,
               mininterval=1 if sys.stderr.isatty() else 30, disable=len(paths) < PARALLEL_FROM)
    if workers > 1 and len(paths) >= PARALLEL_FROM:
        with ProcessPoolExecutor(workers, mp_context=get_context("forkserver")) as pool:
            headers = []
            for header in pool.map(_header, paths, chunksize=512):
                headers.append(header)
                bar.update()
    else:
        headers = []
        for path in paths:
            headers.append(_header(path))
            bar.update()
    bar.close()
    problems = [header for header in headers if isinstance(header, str)]
    if problems:
        raise UserError(f"{len(problems)} unreadable image(s) in {what}: {'; '.join(problems[:UNREADABLE_SHOWN])}. "
                        f"Remove or replace them and start again")
    widths, heights, decodable = zip(*headers) if headers else ((), (), ())
    return (np.asarray(widths, dtype=np.int32), np.asarray(heights, dtype=np.int32),
            np.asarray(decodable, dtype=bool))


def build(root: Path, names: Sequence[str], labels: np.ndarray, watched: Sequence[str], workers: int,
          what: str, **info: Any) -> FileIndex:
    """The list of ``names`` (relative to ``root``) with their headers read; ``info`` is kept with it.

    ``watched``: folders and files under ``root`` the list is checked against, stat-ed before the headers are
    read, so a change made meanwhile shows at the next start."""
    watched_now = watch(root, watched)
    encoded = [name.encode() for name in names]
    widths, heights, decodable = read_headers([str(root / name) for name in names], workers, what)
    return FileIndex(np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
                     np.cumsum([len(name) for name in encoded], dtype=np.int64), np.asarray(labels, dtype=np.int64),
                     widths, heights, decodable,
                     {"format": FORMAT, "what": what, "built_from": str(root.resolve()),
                      "built_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                      "watched": watched_now, **info})


def saved_list(beside_data: Path, run_dir: Path) -> tuple[Path, Path]:
    """Where a list is saved: next to the data, or (read-only data) in the run directory's index/."""
    return beside_data, run_dir / "index" / beside_data.name


def load_or_build(root: Path, beside_data: Path, run_dir: Path, make: Callable[[], FileIndex], rebuild: bool,
                  local_rank: int, fix: str, poll_seconds: float = 0.5) -> tuple[FileIndex, Path]:
    """The saved list of a split and where it is, checked against ``root``.

    - ``make`` builds it when there is none or ``rebuild`` asks; then it is saved (:func:`save`).
    - Collective: local rank 0 of each node builds while the others poll for the list it saves (made
      by this start: a damaged or older file there is passed over), so no collective times out
      while a million headers are read.
    - ``fix``: the prep command named in the ``UserError`` a changed tree stops with.
    """
    token = broadcast_object(secrets.token_hex(8))  # names a list built by this start
    paths = saved_list(beside_data, run_dir)
    found = next((path for path in reversed(paths) if path.is_file()), None)
    if found is not None and not rebuild:
        index = FileIndex.load(found)
        changed = index.changes(root)
        if changed:
            raise UserError(f"{root} changed since its file list {found} was saved: "
                            f"{index.describe_changes(root, changed)}; list the files again with "
                            f"data.rebuild_index=true (or {fix})")
        return index, found
    if local_rank == 0:
        index = make()
        index.info["token"] = token
        return index, save(index, paths)
    checked: dict[Path, tuple[int, int]] = {}  # each file as it was when last read: read again once replaced
    while True:  # local rank 0 builds it; a file there before (damaged, or an older list) is not the one to wait for
        for path in reversed(paths):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            if checked.get(path) != (stat.st_ino, stat.st_mtime_ns):
                checked[path] = (stat.st_ino, stat.st_mtime_ns)
                try:
                    index = FileIndex.load(path)
                except UserError:
                    continue
                if index.info.get("token") == token:
                    return index, path
        time.sleep(poll_seconds)


def save(index: FileIndex, paths: tuple[Path, Path]) -> Path:
    """Save next to the data, else in the run directory; where it went."""
    beside_data, in_run_dir = paths
    try:
        index.save(beside_data)
        return beside_data
    except OSError:
        index.save(in_run_dir)
        print(f"{beside_data.parent} cannot be written: saved its file list in {in_run_dir}", flush=True)
        return in_run_dir


class IndexedFiles(Dataset):
    """The files of a saved list as a dataset of :class:`EncodedImage` (bytes read as needed, size and label listed).

    ``label_columns``: the columns of ``[N, K]`` labels to return."""

    def __init__(self, root: str | Path, index: FileIndex, label_columns: Sequence[int] | None = None) -> None:
        self.root = str(root)
        self.index = index
        self.labels = torch.from_numpy(index.labels)
        self.label_columns = label_columns

    def __len__(self) -> int:
        return len(self.index)

    @property
    def paths(self) -> list[str]:
        return [self.path(i) for i in range(len(self))]

    def path(self, index: int) -> str:
        return os.path.join(self.root, self.index.name(index))

    def __getitem__(self, index: int) -> EncodedImage:
        path = self.path(index)
        label = self.labels[index] if self.label_columns is None else self.labels[index, self.label_columns]
        return EncodedImage(read_file(path), path, int(self.index.widths[index]), int(self.index.heights[index]),
                            bool(self.index.device_decodable[index]), label)
