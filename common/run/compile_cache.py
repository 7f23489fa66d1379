"""Compiled code that survives restarts: ``torch.compile``'s caches travel inside the checkpoint.

- Each process compiles into a local Inductor cache folder named by :func:`cache_key`; rank 0
  attaches a tar of it to every checkpoint (``compile_cache.tar``, a :class:`common.checkpoint.layout.Attachment`).
- A resumed process unpacks the archive of the checkpoint it loads before its first compiled step,
  so a requeue on another node or the next ISC cycle skips Inductor.
- An archive for another key, or a damaged one, is ignored with one line.
- Why not ``torch.compiler.save_cache_artifacts()``: on a CPU it leaves the compiled C++ kernels out
  (figures: benchmarks/RESULTS.md, issue 26). The key: docs/run-contract.md, "Heartbeats, hangs and compiled code".
"""

from __future__ import annotations

import getpass
import hashlib
import io
import json
import os
import platform
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

import torch

from common.checkpoint.layout import Attachment, CheckpointError, read_attachment
from common.checkpoint.manager import LoadedCheckpoint
from common.records.provenance import cpu_model

ARCHIVE_FILE = "compile_cache.tar"
CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
_LOCAL_ONLY = ("locks",)  # Inductor's lock files: this machine's
REPO = Path(__file__).resolve().parents[2]


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model: compiled kernels are made for one of them."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model() or platform.machine()


def source_digest(recipe: str, root: Path = REPO) -> str:
    """sha256 over the Python sources of ``recipes/<recipe>/`` and ``common/``, which build the model and step."""
    digest = hashlib.sha256()
    for path in sorted([*(root / "recipes" / recipe).rglob("*.py"), *(root / "common").rglob("*.py")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def key_fields(recipe: str, device: torch.device) -> dict[str, str]:
    """What compiled code depends on besides the graph itself (which Inductor's own keys cover)."""
    return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version(),
            "device": device_name(device), "source": source_digest(recipe)}


def cache_key(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _default_folder(key: str) -> Path:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    return Path(tempfile.gettempdir()) / f"recipes-compile-cache-{user}" / key


class CompileCache:
    """This process's compile cache folder, and its archive in checkpoints (see the module).

    Make it before the first compiled call: it points Inductor at the folder (``TORCHINDUCTOR_CACHE_DIR``)."""

    def __init__(self, fields: dict[str, str]) -> None:
        self.fields = fields
        self.key = cache_key(fields)
        self.folder = Path(os.environ.get(CACHE_DIR_VARIABLE) or _default_folder(self.key)).resolve()
        os.environ[CACHE_DIR_VARIABLE] = str(self.folder)
        self._attachment: Attachment | None = None
        self._listed: list[tuple[str, int, int]] = []

    @classmethod
    def for_run(cls, recipe: str, device: torch.device) -> CompileCache:
        return cls(key_fields(recipe, device))

    def _files(self) -> list[tuple[str, int, int]]:
        """(relative path, size, mtime) of every file worth shipping, sorted: a change means a new graph."""
        listed = []
        for directory, folders, files in os.walk(self.folder):
            here = Path(directory)
            if here == self.folder:
                folders[:] = [name for name in folders if name not in _LOCAL_ONLY]
            for name in files:
                if name.startswith("."):  # Inductor's files while it writes them
                    continue
                path = here / name
                try:
                    stat = path.stat()
                except OSError:
                    continue
                listed.append((path.relative_to(self.folder).as_posix(), stat.st_size, stat.st_mtime_ns))
        return sorted(listed)

    def attachment(self) -> Attachment | None:
        """The folder as a checkpoint attachment, None while empty; rebuilt only when the folder changed."""
        listed = self._files()
        if listed and listed != self._listed:
            buffer = io.BytesIO()
            try:
                with tarfile.open(fileobj=buffer, mode="w") as tar:
                    for relative, _, _ in listed:
                        tar.add(self.folder / relative, arcname=relative, recursive=False)
            except OSError:  # a file went away while it was read: the next save tries again
                return self._attachment
            self._attachment = Attachment(ARCHIVE_FILE, buffer.getvalue(), {"key": self.key, "made_for": self.fields})
            self._listed = listed
        return self._attachment

    def restore(self, loaded: LoadedCheckpoint) -> str:
        """Unpack ``loaded``'s compile cache into the folder; returns the line that says what happened.

        None in the checkpoint, one made for another key, or a damaged one: the run compiles afresh."""
        entry = loaded.attachments.get(ARCHIVE_FILE)
        where = f"the compile cache in {loaded.path.name}"
        if entry is None:
            return f"{loaded.path.name} holds no compile cache; compiling afresh"
        if entry.get("key") != self.key:
            made_for = entry.get("made_for", {})
            changed = [name for name, value in self.fields.items() if made_for.get(name) != value]
            return f"{where} was made for another {', '.join(changed) or 'key'}; ignored, compiling afresh"
        try:
            count = self._unpack(read_attachment(loaded.path, ARCHIVE_FILE, entry))
        except (CheckpointError, tarfile.TarError, OSError) as error:
            return f"{where} is unusable ({str(error).splitlines()[0]}); ignored, compiling afresh"
        return f"compiled code restored from {where}: {count} files in {self.folder}"

    def _unpack(self, data: bytes) -> int:
        """Unpack the archive's regular files atomically; files already there (named by content digest) are kept."""
        count = 0
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            for member in tar:
                relative = PurePosixPath(member.name)
                if not member.isfile() or relative.is_absolute() or ".." in relative.parts:
                    continue
                target = self.folder.joinpath(*relative.parts)
                count += 1
                if target.is_file() and target.stat().st_size == member.size:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                temporary.write_bytes(tar.extractfile(member).read())
                os.chmod(temporary, member.mode & 0o777)
                os.replace(temporary, target)
        return count

