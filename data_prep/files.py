"""Download, copy and checksum helpers shared by the prep scripts."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tqdm import tqdm

from common.errors import EXIT_USER_ERROR, UserError


def file_digest(path: Path, algorithm: str = "md5") -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def bytes_digest(data: bytes, algorithm: str = "md5") -> str:
    return hashlib.new(algorithm, data).hexdigest()


def download(url: str, destination: Path, md5: str | None = None, timeout_s: float = 30) -> Path:
    """Download ``url`` to ``destination`` (atomically, with a progress bar) and check its md5."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=destination.name, file=sys.stderr) as bar:
                for block in iter(lambda: response.read(1 << 20), b""):
                    out.write(block)
                    bar.update(len(block))
    except (urllib.error.URLError, OSError, TimeoutError) as error:
        partial.unlink(missing_ok=True)
        raise UserError(f"could not download {url}: {error}") from error
    if md5 is not None and file_digest(partial) != md5:
        partial.unlink()
        raise UserError(f"{url} downloaded with a wrong md5 (expected {md5})")
    os.replace(partial, destination)
    return destination


def copy_file(source: Path, destination: Path) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".part")
    shutil.copyfile(source, partial)
    os.replace(partial, destination)
    return destination


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_bytes(data)
    os.replace(partial, path)


def run_cli(main) -> None:  # type: ignore[no-untyped-def]
    """Run a prep script's ``main()``; a :class:`UserError` is one line on stderr, exit 2."""
    try:
        main()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        sys.exit(130)
