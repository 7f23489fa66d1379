"""Sharded datasets: a split as a few hundred chunk files (:data:`CHUNK_BYTES` each), written and read with litdata.

Why: a shared filesystem (Lustre, NFS) or an object store serves a few large files far better than a
million small ones; its metadata servers limit a run that opens one file per image.

- Writing: ``make prep-<recipe> FORMAT=shards`` stores a split's saved file list
  (:mod:`common.data.file_index`) in its order; sample ``i`` holds entry ``i``'s bytes as they are
  (never re-encoded), size, nvjpeg flag, label and name. ``index.json`` says under ``"recipes"`` what
  the set was made from (recipe, split, classes, the list's checksum).
- Reading: by index (:class:`ShardImages`), so the resumable sampler keeps the order and a run gives
  the same batches from shards or loose files, and resumes exactly.
- A local folder is read in place; a remote (``s3://``, ``gs://``, ``local:/path``, ``file:///path``)
  goes through a node-local cache (``data.shards.cache_dir``) bounded by ``data.shards.cache_limit``.
  The order is a global permutation, so a limit below the set's size refetches chunks (the start says so).
- Why litdata: Mosaic ``streaming`` 0.13 pins numpy<2.2 and transformers<5, which this project is past;
  webdataset and timm's ``reader_wds.py`` read in order and cannot follow the sampler, which exact
  resume needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from common.data.encoded import EncodedImage
from common.data.file_index import FileIndex
from common.errors import UserError

INDEX_FILE = "index.json"  # litdata's
METADATA_KEY = "recipes"  # ours, in litdata's index.json
CHUNK_BYTES = "256MB"
REMOTE_PREFIXES = ("s3://", "gs://", "azure://", "r2://", "hf://", "local:", "file://")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_size(text: str, key: str) -> int:
    """``"200GB"``, ``"512MiB"`` or a number of bytes as bytes; ``key`` names the setting in the error."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(f"{key}={text!r} is not a size: write it as 200GB, 512MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def litdata_url(location: str) -> str | None:
    """The litdata remote ``location`` names (``file:///x`` is litdata's ``local:/x``), or None for a folder."""
    if location.startswith("file://"):
        return "local:" + location[len("file://"):]
    return location if location.startswith(REMOTE_PREFIXES) else None


def local_folder(location: str) -> Path | None:
    """The folder on this machine that holds the chunks (a folder, ``local:`` or ``file://``), else None."""
    url = litdata_url(location)
    if url is None:
        return Path(location)
    return Path(url[len("local:"):]) if url.startswith("local:") else None


# ---- writing ---------------------------------------------------------------------------------------


def _sample(entry: tuple) -> dict[str, Any]:
    """One litdata sample: the file's bytes as they are, and what the list says of it."""
    index, path, width, height, decodable, label, name = entry
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise UserError(f"{path} cannot be read ({error})") from error
    return {"index": index, "image": data, "width": width, "height": height, "device_decodable": decodable,
            "label": label, "name": name}


def write_shards(index: FileIndex, root: Path, out: Path, metadata: dict[str, Any], workers: int,
                 chunk_bytes: str = CHUNK_BYTES) -> int:
    """Write the files of ``index`` (names relative to ``root``) as shards in ``out``, in the list's order.

    - ``metadata``: stored in the set's ``index.json``. Returns the number of chunk files.
    - Written beside ``out`` and swapped in at the end: a failed write leaves the old set as it was.
    """
    from litdata import optimize

    labels = index.labels.tolist()
    entries = [(i, str(root / index.name(i)), int(index.widths[i]), int(index.heights[i]),
                bool(index.device_decodable[i]), np.asarray(labels[i], dtype=np.int64) if index.labels.ndim > 1
                else int(labels[i]), index.name(i)) for i in range(len(index))]
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    optimize(fn=_sample, inputs=entries, output_dir=str(partial), chunk_bytes=chunk_bytes,
             num_workers=max(1, min(workers, len(entries))), keep_data_ordered=True, reorder_files=False,
             mode="overwrite", start_method="fork")
    index_file = partial / INDEX_FILE
    written = json.loads(index_file.read_text())
    written[METADATA_KEY] = {**metadata, "count": len(index), "list_checksum": index.checksum()}
    index_file.write_text(json.dumps(written))
    check_order(partial, len(index))
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)
    else:
        partial.rename(out)
    return len(written["chunks"])


def check_order(folder: Path, count: int) -> None:
    """The first and last sample of a freshly written set are the list's first and last entries."""
    from litdata import StreamingDataset

    streaming = StreamingDataset(str(folder))
    for position in {0, count - 1}:
        if streaming[position]["index"] != position:
            raise RuntimeError(f"litdata wrote {folder} out of the list's order (sample {position})")


# ---- reading ---------------------------------------------------------------------------------------


class ShardImages(Dataset):
    """The samples of a shard set by index, as :class:`common.data.images.TrainImages` takes them.

    - Checked when made: ``index.json``, the ``expect``-ed metadata (recipe, split...), and where the
      chunks are local, every chunk's size. Raises ``UserError`` naming ``fix`` (the command that
      writes the set) on any mismatch.
    - ``label_columns``: the columns of ``[K]`` labels to return.
    - A reader belongs to the process that made it: a forked DataLoader worker (or any child) opens
      its own on its first sample. Why: litdata's reader fetches chunks in a thread of the process
      that first read through it, and a fork copies the reader without that thread, so every chunk
      the parent had not fetched would be waited for until litdata gives up (``data.decode=auto``
      reads samples in the main process before the workers start).
    """

    def __init__(self, location: str, cache_dir: str, cache_limit: str, expect: dict[str, Any], fix: str,
                 label_columns: Sequence[int] | None = None) -> None:
        self.location, self.url, self.fix = location, litdata_url(location), fix
        self.cache_dir = cache_dir
        self.cache_limit = parse_size(cache_limit, "data.shards.cache_limit")
        self.label_columns = list(label_columns) if label_columns is not None else None
        folder = local_folder(location)
        if folder is not None and not (folder / INDEX_FILE).is_file():
            raise UserError(f"{folder} holds no shard set (no {INDEX_FILE}): write one with `{fix}`")
        self._streaming: Any = None
        self._streaming_pid = 0  # the process self._streaming belongs to
        try:
            listing = json.loads(Path(self.streaming().input_dir.path, INDEX_FILE).read_text())
        except (OSError, ValueError, RuntimeError) as error:  # what litdata raises for a remote it cannot read
            raise UserError(f"{location}: its {INDEX_FILE} cannot be read ({error}); check the address, or write "
                            f"the shards with `{fix}`") from error
        self.metadata = listing.get(METADATA_KEY)
        if not isinstance(self.metadata, dict):
            raise UserError(f"{location} is a litdata set not written by `{fix}` (its {INDEX_FILE} has no "
                            f"\"{METADATA_KEY}\"): write the shards with it")
        wrong = {key: self.metadata.get(key) for key, value in expect.items() if self.metadata.get(key) != value}
        if wrong:
            expected = ", ".join(f"{key} {expect[key]!r}" for key in wrong)
            found = ", ".join(f"{key} {value!r}" for key, value in wrong.items())
            raise UserError(f"{location} holds the shards of another dataset ({found}; this run needs {expected}): "
                            f"point data.shards.root at this dataset's shards, or write them with `{fix}`")
        self.chunks = listing["chunks"]
        self.length = sum(chunk["chunk_size"] for chunk in self.chunks)
        if self.length != self.metadata["count"]:
            raise UserError(f"{location} lists {self.length} samples in its chunks and {self.metadata['count']} in "
                            f"its metadata: write the shards again with `{fix}`")
        if folder is not None:
            self.check_chunks(folder)

    @property
    def bytes(self) -> int:
        return sum(chunk["chunk_bytes"] for chunk in self.chunks)

    def check_chunks(self, folder: Path) -> None:
        """Every chunk file is there at its full size: litdata would wait for a missing one forever."""
        for chunk in self.chunks:
            path = folder / chunk["filename"]
            try:
                size = path.stat().st_size
            except OSError:
                raise UserError(f"{path} is missing: write the shards again with `{self.fix}`") from None
            if size != chunk["chunk_bytes"]:
                raise UserError(f"{path} is truncated ({size:,} of {chunk['chunk_bytes']:,} bytes): write the shards "
                                f"again with `{self.fix}`")

    def streaming(self) -> Any:
        """litdata's reader for this process: made on first use in each process (see the class)."""
        if self._streaming is None or self._streaming_pid != os.getpid():
            from litdata import StreamingDataset

            if self.url is None:
                streaming = StreamingDataset(self.location)
            else:
                streaming = StreamingDataset(self.url, cache_dir=self.cache_dir, max_cache_size=self.cache_limit)
                # Whole chunks through the bounded cache. litdata's default for reads by index
                # fetches each sample's bytes alone: for a local: remote that copies every chunk
                # into the cache and never evicts one.
                streaming._on_demand_bytes = False
            self._streaming, self._streaming_pid = streaming, os.getpid()
        return self._streaming

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_streaming": None}

    def __len__(self) -> int:
        return self.length

    def describe(self) -> str:
        text = f"{self.length:,} images in {len(self.chunks)} shards ({self.bytes / 1e9:.3g} GB) from {self.location}"
        if self.url is None:
            return text
        text += f", cached in {self.cache_dir} (limit {self.cache_limit / 1e9:.3g} GB)"
        if self.bytes > self.cache_limit:
            text += ("; the set is larger than the cache's limit, so chunks are downloaded again each time the "
                     "random order comes back to them: raise data.shards.cache_limit to the set's size")
        return text

    def __getitem__(self, index: int) -> EncodedImage:
        sample = self.streaming()[index]
        name = f"{self.location}[{index}] ({sample['name']})"
        if sample["index"] != index:
            raise UserError(f"{name} holds entry {sample['index']} of its list: the shard set is damaged; write it "
                            f"again with `{self.fix}`")
        label = sample["label"]
        if isinstance(label, np.ndarray):
            label = torch.from_numpy(label if self.label_columns is None else label[self.label_columns])
        data = np.frombuffer(bytearray(sample["image"]), dtype=np.uint8)  # a copy: chunks may be unmapped
        return EncodedImage(data, name, sample["width"], sample["height"], bool(sample["device_decodable"]), label)


def shard_folder(root: str, *parts: str) -> str:
    """The location of one split's set under ``data.shards.root`` (a folder or a remote)."""
    return os.path.join(root, *parts) if litdata_url(root) is None else "/".join([root.rstrip("/"), *parts])
