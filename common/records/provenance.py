"""What each segment of a run ran: the code, the command, the software and the machines.

A *segment* is one process of a run that is pre-empted and resumed (a job, an ISC cycle), possibly on
other machines or another checkout.

- Every start and resume appends one JSON record to ``<run_dir>/provenance.jsonl`` (rank 0, with
  every rank's host); every checkpoint of the segment holds the same record in its manifest.
- The record: git commit and dirtiness (the diff saved as ``provenance/segment-<n>.diff``), command
  line and Hydra overrides, Python/PyTorch/CUDA/cuDNN/NCCL versions, GPU model, count and driver, CPU
  model, hosts, SLURM or ISC variables, start time, and the hash of ``pip freeze``'s list (saved once
  per environment as ``provenance/env-<hash>.txt``).
- Git never fails or hangs a run: calls have a deadline; no ``git``, no checkout, a refusal, or code
  untracked inside another repository (whose commit does not hold it) leave ``git_commit`` null
  with a ``git_note`` saying why.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common import jsonfiles
from common.pytorch import distributed
from common.pytorch.distributed import DistInfo

_PROVENANCE_FILE = "provenance.jsonl"
_PROVENANCE_DIR = "provenance"
_CODE_DIR = Path(__file__).resolve().parents[2]  # the checkout whose code runs
_GIT_TIMEOUT_S = 10.0  # for all of a segment's git calls together
_SLURM_VARIABLES = {"job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID",
                   "array_task_id": "SLURM_ARRAY_TASK_ID", "restart_count": "SLURM_RESTART_COUNT"}
# What the Strong Compute ISC sets for an experiment (docs/clusters.md; EXPERIMENT_ID as in its isc-demos).
ISC_VARIABLES = {"experiment_id": "EXPERIMENT_ID", "checkpoint_artifact_path": "CHECKPOINT_ARTIFACT_PATH",
                 "lossy_artifact_path": "LOSSY_ARTIFACT_PATH"}
# What a bit-identical resume needs unchanged (trainer.deterministic; docs/run-contract.md, "When a resumed run is
# bit-identical").
_BIT_IDENTITY_FIELDS = ("device", "gpu", "driver", "torch", "cuda", "cudnn")
_UNTRACKED_LISTED = 20  # untracked files named in a record, at most


@dataclass(frozen=True)
class GitState:
    """A checkout's commit and changes; ``commit`` is None (and ``note`` says why) when unknown."""

    commit: str | None
    dirty: bool | None
    diff: bytes = b""  # ``git diff HEAD --binary``: the changes to tracked files
    untracked: list[str] = field(default_factory=list)  # files git does not track and does not ignore
    note: str | None = None


def code_paths(recipe: str) -> tuple[str, ...]:
    """The folders, relative to the project's root, whose code a run of ``recipe`` runs."""
    return "common", f"recipes/{recipe}"


def git_state(folder: Path = _CODE_DIR, code: tuple[str, ...] = (), timeout_s: float = _GIT_TIMEOUT_S) -> GitState:
    """The commit of the checkout holding ``folder``, whether it has changes, and what they are.

    - ``code``: paths relative to ``folder`` that the commit must hold; when one is not in it, the
      folder lies untracked in an enclosing repository: ``commit`` is None and ``note`` says so.
    - Never raises and never takes much longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0"}  # read only: no index lock

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, check=True, env=env,
                              stdin=subprocess.DEVNULL, timeout=max(0.1, deadline - time.monotonic())).stdout

    try:
        commit = git("rev-parse", "HEAD").decode().strip()
        outside = [path for path in code if not git("ls-tree", "--name-only", "HEAD", "--", path).strip()]
        if outside:
            top = git("rev-parse", "--show-toplevel").decode().strip()
            return GitState(None, None, note=f"{', '.join(outside)} in {folder} is not tracked by the git repository "
                                             f"at {top}, whose commit does not hold the code that ran: the code's "
                                             f"version is unknown")
        status = git("status", "--porcelain").decode(errors="replace").splitlines()
        diff = git("diff", "HEAD", "--binary") if status else b""
    except FileNotFoundError:
        return GitState(None, None, note="git is not installed: the code's version is unknown")
    except subprocess.TimeoutExpired:
        return GitState(None, None, note=f"git did not answer within {timeout_s:g} s: the code's version is unknown")
    except (subprocess.CalledProcessError, OSError) as error:
        stderr = getattr(error, "stderr", b"") or b""
        message = stderr.decode(errors="replace").strip().splitlines()
        if message and "not a git repository" in message[0]:
            return GitState(None, None, note=f"{folder} is not a git checkout (a copied recipe?): the code's "
                                             f"version is unknown")
        return GitState(None, None, note=f"git failed: {message[0] if message else error}")
    untracked = [line[3:] for line in status if line.startswith("?? ")]
    return GitState(commit, bool(status), diff, untracked)


@functools.cache
def installed_packages() -> str:
    """``pip freeze``'s list (``name==version`` per line, sorted), without starting pip.

    - Read with ``importlib.metadata`` in this process (timings: benchmarks/RESULTS.md, issue 36 section).
    - Cached per process: what the process imports from was installed before it started.
    """
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():  # in sys.path order: the one Python imports comes first
        name, version = _name_and_version(dist)
        if name:
            found.setdefault(re.sub(r"[-_.]+", "-", name).lower(), f"{name}=={version}")
    return "".join(f"{line}\n" for _, line in sorted(found.items()))


def _name_and_version(dist: importlib.metadata.Distribution) -> tuple[str | None, str | None]:
    """A distribution's Name and Version from its metadata's header lines alone.

    ``dist.metadata`` would parse the whole file, long description included (cost: benchmarks/RESULTS.md).
    """
    # The files importlib.metadata reads, in its order ("": an old egg-info that is itself the file).
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or dist.read_text("") or ""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key in ("Name", "Version"):
            fields.setdefault(key, value.strip())
    return fields.get("Name"), fields.get("Version")


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def driver_version() -> str | None:
    """The NVIDIA driver's version from the kernel module (no nvidia-smi needed), else NVML, else None."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 (NVML missing or failing: the field is then unknown)
        return None


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 (a build without NCCL)
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def machine(device: torch.device) -> dict[str, Any]:
    """Software and hardware as this process sees them; the GPU fields are null on a CPU run."""
    cuda = device.type == "cuda"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": _nccl_version() if cuda else None,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else None,
        "driver": driver_version() if cuda else None,
        "cpu": cpu_model(),
    }


def variables(names: dict[str, str]) -> dict[str, str] | None:
    """The set ones among ``names`` (record key -> environment variable); None when none is."""
    found = {key: os.environ[name] for key, name in names.items() if os.environ.get(name)}
    return found or None


def _hydra_overrides() -> list[str] | None:
    """The overrides Hydra composed this run's config with (None outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``provenance.jsonl``, oldest first; a line cut short by a kill is left out."""
    path = Path(run_dir) / _PROVENANCE_FILE
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _write_once(path: Path, data: bytes) -> None:
    """``data`` at ``path`` unless it is there already (written whole: a temporary file renamed)."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def append_record(run_dir: str | Path, record: dict[str, Any]) -> Path:
    """Append ``record`` to ``provenance.jsonl`` as one line (after a line a kill cut short, on a new one)."""
    path = Path(run_dir) / _PROVENANCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        start = b""
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            start = b"" if handle.read(1) == b"\n" else b"\n"
        handle.write(start + (jsonfiles.dumps(record) + "\n").encode())
    return path


def segment_record(run_dir: str | Path, dist_info: DistInfo, resumed_from: dict[str, Any] | None,
                   recipe: str) -> dict[str, Any] | None:
    """Record this segment of a run of ``recipe`` (see the module).

    - Rank 0 appends the record to ``provenance.jsonl``, saves the diff and package list, and returns it;
      other ranks return None.
    - Collective: every rank must call it (each reports its host after rank 0's git calls).
    """
    record = _this_segment(Path(run_dir), dist_info, resumed_from, recipe) if dist_info.is_main else None
    hosts = distributed.all_gather_object(socket.gethostname())
    if record is None:
        return None
    record["hosts"] = hosts
    append_record(run_dir, record)
    return record


def _this_segment(run_dir: Path, dist_info: DistInfo, resumed_from: dict[str, Any] | None,
                  recipe: str) -> dict[str, Any]:
    """The record of this segment, but its hosts; the diff and the package list written beside it."""
    segment = len(read_records(run_dir))
    git = git_state(code=code_paths(recipe))
    diff_file = None
    if git.diff:
        diff_file = f"{_PROVENANCE_DIR}/segment-{segment}.diff"
        _write_once(run_dir / diff_file, git.diff)
    packages = installed_packages()
    packages_hash = hashlib.sha256(packages.encode()).hexdigest()[:16]
    packages_file = f"{_PROVENANCE_DIR}/env-{packages_hash}.txt"
    _write_once(run_dir / packages_file, packages.encode())
    return {
        "segment": segment,
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "resumed_from": resumed_from,
        "git_commit": git.commit,
        "git_dirty": git.dirty,
        "git_diff": diff_file,
        "git_untracked": git.untracked[:_UNTRACKED_LISTED],
        **({"git_note": git.note} if git.note else {}),
        "command": list(sys.orig_argv),  # the interpreter, its options (-m recipes.<r>.train) and the arguments
        "overrides": _hydra_overrides(),
        **machine(dist_info.device),
        "world_size": dist_info.world_size,
        "hosts": None,
        "slurm": variables(_SLURM_VARIABLES),
        "isc": variables(ISC_VARIABLES),
        "packages": packages_file,
        "packages_hash": packages_hash,
    }


def bit_identity_differences(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """What a bit-identical resume needs (:data:`_BIT_IDENTITY_FIELDS`) that differs from the checkpoint's segment.

    - ``saved``: the record of the segment that wrote the checkpoint; None (an older checkpoint) gives ``[]``.
    - Returns lines such as ``"gpu NVIDIA A100-SXM4-80GB (now NVIDIA H100 80GB HBM3)"``.
    """
    if not saved:
        return []
    return [f"{name} {saved.get(name)} (now {current.get(name)})" for name in _BIT_IDENTITY_FIELDS
            if saved.get(name) != current.get(name)]
