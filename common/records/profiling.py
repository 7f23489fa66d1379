"""``profile.*``: what the steps did, on demand, and what filled the GPU when it ran out of memory.

- ``profile.enabled=true profile.start_step=S profile.active_steps=K``: ``torch.profiler`` traces
  optimizer steps S to S+K-1 on every rank into ``<run_dir>/profile/rank<r>-step<S>.pt.trace.json.gz``
  (open in https://ui.perfetto.dev or TensorBoard), each step marked ``ProfilerStep#<step>``.
- ``profile.memory=true`` (CUDA): also the allocation history of those steps,
  ``rank<r>-step<S>.memory.pickle`` (open in https://pytorch.org/memory_viz).
- ``profile.memory_on_oom=true`` (CUDA): records from the process's start and dumps
  ``rank<r>-oom-step<n>.memory.pickle`` on an out-of-memory error (:func:`out_of_memory_error`);
  costs some speed and host memory (the last :data:`_MEMORY_HISTORY_ENTRIES` allocations, with stacks).
- The run contract (``common/run/training_run.py``) drives :class:`StepProfiler`; recipes need no code.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.config import ProfileConfig
from common.errors import UserError
from common.pytorch.distributed import DistInfo

_PROFILE_DIR = "profile"
_MEMORY_HISTORY_ENTRIES = 100_000
_MEMORY_VIEWER = "https://pytorch.org/memory_viz"

_recording_memory = False  # this process records CUDA allocations (one history per process)
_current: StepProfiler | None = None  # the process's run, for the step an out-of-memory error names


def record_memory_history(device: torch.device) -> bool:
    """Start recording CUDA allocations (with Python stacks); False (nothing recorded) off CUDA."""
    global _recording_memory
    if device.type != "cuda":
        return False
    if not _recording_memory:
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=_MEMORY_HISTORY_ENTRIES)
        _recording_memory = True
    return True


def _stop_memory_history() -> None:
    global _recording_memory
    if _recording_memory:
        torch.cuda.memory._record_memory_history(enabled=None)
        _recording_memory = False


def _dump_memory_snapshot(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return path


class StepProfiler:
    """``profile.enabled`` and ``profile.memory`` for one run (see the module).

    - Call :meth:`step_starting` before a step takes its first micro-batch, :meth:`step_finished`
      after it, and :meth:`close` at the end.
    - Raises ``UserError`` when ``profile.start_step`` or ``profile.active_steps`` is below 1.
    """

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, dist_info: DistInfo,
                 console: Callable[[str], None], keep_memory_history: bool = False) -> None:
        global _current
        if cfg.enabled and (cfg.start_step < 1 or cfg.active_steps < 1):
            raise UserError(f"profile.start_step ({cfg.start_step}) and profile.active_steps ({cfg.active_steps}) "
                            f"must be at least 1")
        self.cfg = cfg
        self.folder = Path(run_dir) / _PROFILE_DIR
        self.dist_info = dist_info
        self.console = console
        self.keep_memory_history = keep_memory_history  # profile.memory_on_oom: recording since the start
        self.last = cfg.start_step + cfg.active_steps - 1
        self.step_in_progress: int | None = None
        self._profiler: torch.profiler.profile | None = None
        self._step_range: Any = None
        self._memory = False
        if cfg.enabled and cfg.memory and dist_info.device.type != "cuda":
            console(f"profile.memory: no memory snapshot, it records CUDA allocations and this run is on "
                    f"{dist_info.device.type}")
        _current = self

    def _name(self, suffix: str) -> Path:
        return self.folder / f"rank{self.dist_info.rank}-step{self.cfg.start_step}{suffix}"

    def step_starting(self, step: int) -> None:
        self.step_in_progress = step
        if not self.cfg.enabled or not self.cfg.start_step <= step <= self.last:
            return
        if self._profiler is None:
            if step != self.cfg.start_step:
                return  # resumed inside the window: its first steps are gone, so is the trace
            self._start()
        self._step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
        self._step_range.__enter__()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.dist_info.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._memory = self.cfg.memory and record_memory_history(self.dist_info.device)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def step_finished(self, step: int) -> None:
        self.step_in_progress = None
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profiler is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Write what the trace window recorded: at its last step, or when a run stops inside it."""
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profiler is None:
            return
        self._profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self._name(".pt.trace.json.gz")
        self._profiler.export_chrome_trace(str(trace))
        self._profiler = None
        written = [f"a trace in {trace.parent}/rank<r>-step{self.cfg.start_step}.pt.trace.json.gz per rank "
                   f"(https://ui.perfetto.dev)"]
        if self._memory:
            snapshot = _dump_memory_snapshot(self._name(".memory.pickle"))
            if not self.keep_memory_history:
                _stop_memory_history()
            written.append(f"a memory snapshot in {snapshot.parent}/rank<r>-step{self.cfg.start_step}"
                           f".memory.pickle ({_MEMORY_VIEWER})")
            self._memory = False
        self.console(f"profile of optimizer steps {self.cfg.start_step}-{self.last}: " + "; ".join(written))


def smaller_batch(batch_size: int, per_rank_global: int) -> int | None:
    """The largest micro-batch below ``batch_size`` that divides ``per_rank_global``, or None.

    Dividing the global batch per rank lets gradient accumulation keep the global batch.
    """
    return next((size for size in range(batch_size - 1, 0, -1) if per_rank_global % size == 0), None)


def out_of_memory_error(error: torch.OutOfMemoryError, run_dir: str | Path, dist_info: DistInfo,
                        batch_size: int, global_batch_size: int, out_of_memory: str = "stop",
                        micro_batch: int | None = None) -> UserError:
    """The one-line ``UserError`` an out-of-memory error in the loop becomes.

    - Says where it happened, names the memory snapshot (dumped now if ``profile.memory_on_oom``
      recorded the history) and what to try: a smaller ``trainer.batch_size`` with the global batch
      kept, or ``trainer.out_of_memory=halve``.
    - ``out_of_memory``: the ``trainer.out_of_memory`` setting; under ``halve``, ``micro_batch`` is the
      micro-batch the run had halved down to when the error came in a forward or backward pass.
    """
    global_batch = global_batch_size or batch_size * dist_info.world_size
    step = _current.step_in_progress if _current is not None else None
    where = f"in optimizer step {step}" if step is not None else "outside a training step"
    cause = re.search(r"Tried to allocate [\d.]+ \w+", str(error))
    line = (f"out of {dist_info.device.type.upper()} memory {where} on rank {dist_info.rank} "
            f"({socket.gethostname()}){f' ({cause.group(0)})' if cause else ''}")
    if _recording_memory:
        name = f"rank{dist_info.rank}-oom-step{step}.memory.pickle" if step is not None else\
            f"rank{dist_info.rank}-oom.memory.pickle"
        snapshot = _dump_memory_snapshot(Path(run_dir) / _PROFILE_DIR / name)
        line += f"; memory snapshot: {snapshot} ({_MEMORY_VIEWER})"
    elif dist_info.device.type == "cuda":
        line += "; profile.memory_on_oom=true would save a memory snapshot of it"
    if out_of_memory == "halve":
        if micro_batch is not None:
            line += (f"; trainer.out_of_memory=halve cut trainer.batch_size={batch_size} down to micro-batches of "
                     f"{micro_batch} sample(s), which do not fit either: recompute activations "
                     f"(trainer.activation_checkpointing) or shard the model (FSDP2) to save memory")
        else:
            line += ("; trainer.out_of_memory=halve redoes a step whose forward or backward pass runs out, and this "
                     "error came elsewhere (the optimizer step, an evaluation: trainer.eval_batch_size)")
        return UserError(line)
    smaller = smaller_batch(batch_size, global_batch // dist_info.world_size)
    if smaller is not None:
        line += (f"; try trainer.batch_size={smaller} trainer.global_batch_size={global_batch} (gradient "
                 f"accumulation keeps the global batch), or let the run halve it (trainer.out_of_memory=halve)")
    else:
        line += f"; trainer.batch_size={batch_size} is the smallest micro-batch for the global batch {global_batch}"
    return UserError(line)
