"""profile.*: its settings are checked, and an out-of-memory error becomes one line that names the
step, the memory snapshot (when the history was recorded) and a batch size that keeps the global
batch. The trace itself is checked on a real run in tests/test_records.py; a CUDA memory history
needs a GPU (benchmarks/gpu_check.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from common.config import ProfileConfig
from common.errors import UserError
from common.pytorch.distributed import DistInfo
from common.records import profiling
from common.records.profiling import StepProfiler, out_of_memory_error, smaller_batch

CPU = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), launcher="test")
OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 79 GiB")


def test_a_window_of_no_steps_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"profile.start_step \(0\) and profile.active_steps \(3\) must be at least 1"):
        StepProfiler(ProfileConfig(enabled=True, start_step=0), tmp_path, CPU, print)
    StepProfiler(ProfileConfig(enabled=False, start_step=0), tmp_path, CPU, print)  # not asked for: not checked


def test_the_smaller_batch_divides_the_global_batch_per_rank() -> None:
    assert smaller_batch(64, 256) == 32
    assert smaller_batch(48, 96) == 32
    assert smaller_batch(7, 7) == 1
    assert smaller_batch(1, 8) is None


def test_out_of_memory_names_the_step_the_snapshot_and_a_batch_that_keeps_the_global_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profiler = StepProfiler(ProfileConfig(), tmp_path, CPU, print)
    profiler.step_starting(7)
    monkeypatch.setattr(profiling, "_recording_memory", True)  # as profile.memory_on_oom does on CUDA
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"history"))
    error = out_of_memory_error(OOM, tmp_path, CPU, batch_size=64, global_batch_size=0)
    snapshot = tmp_path / "profile" / "rank1-oom-step7.memory.pickle"
    assert snapshot.read_bytes() == b"history"
    assert str(error) == (f"out of CPU memory in optimizer step 7 on rank 1 ({socket.gethostname()}) (Tried to "
                          f"allocate 512.00 MiB); memory snapshot: {snapshot} (https://pytorch.org/memory_viz); try "
                          f"trainer.batch_size=32 trainer.global_batch_size=128 (gradient accumulation keeps the "
                          f"global batch), or let the run halve it (trainer.out_of_memory=halve)")
    assert error.exit_code == 2

    profiler.step_finished(7)
    monkeypatch.setattr(profiling, "_recording_memory", False)
    error = out_of_memory_error(OOM, tmp_path, CPU, batch_size=1, global_batch_size=8)
    assert "outside a training step" in str(error) and "memory snapshot" not in str(error)
    assert str(error).endswith("; trainer.batch_size=1 is the smallest micro-batch for the global batch 8")
