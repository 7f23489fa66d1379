"""Background checkpoint writes: the loop waits only for the snapshot, and a crash mid-write is harmless."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import common.checkpoint.writer as checkpoint_module
from common.checkpoint.layout import checkpoint_dirs, latest_name
from common.checkpoint.manager import CheckpointManager
from common.checkpoint.writer import CheckpointWriteError, HostSnapshot
from tests.conftest import REPO

KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, sys, threading
    import torch
    import common.checkpoint.writer as checkpoint_module
    from common.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(sys.argv[1], async_save=True, best_metric="eval/top1")
    state = {"weights": torch.arange(300_000, dtype=torch.float32), "step": 1}
    manager.save(1, state, {"eval/top1": 0.5})
    manager.wait()

    # From here on the background writer writes one chunk of state.pt, then hangs, so the
    # SIGKILL that the test sends lands in the middle of the write.
    real_write = checkpoint_module._HashingWriter.write
    def write_one_chunk_then_hang(self, data):
        written = real_write(self, data)
        self.flush()
        os.write(1, b"PARTIAL\\n")  # one write: the two threads' lines never interleave
        threading.Event().wait()
        return written
    checkpoint_module._HashingWriter.write = write_one_chunk_then_hang

    state = {"weights": torch.arange(300_000, dtype=torch.float32) * 2, "step": 2}
    manager.save(2, state, {"eval/top1": 0.9})
    os.write(1, b"RETURNED\\n")  # save() came back while its write is still going on
    state["weights"].zero_()  # the loop goes on changing the live tensors
    threading.Event().wait()
    """
)


def read_until(process: subprocess.Popen, markers: set[str], timeout: float = 120) -> None:
    """Read the child's stdout until every marker was printed (the child blocks afterwards);
    a child still silent after ``timeout`` seconds is killed, which ends the read."""
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    seen: set[str] = set()
    try:
        while seen != markers:
            line = process.stdout.readline()
            assert line, (f"only {seen} of {markers}; the child exited with code {process.wait()} "
                          f"(killed after {timeout} s if -9): {process.stderr.read()[-2000:]}")
            seen |= {line.strip()} & markers
    finally:
        watchdog.cancel()


def test_a_crash_during_the_background_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, str(directory)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        read_until(process, {"PARTIAL", "RETURNED"})
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL

    partial = directory / ".tmp-checkpoint_1"
    assert (partial / "state.pt").stat().st_size > 0, "the kill should have landed in the middle of the write"
    assert not (partial / "manifest.json").exists()
    assert [found.path.name for found in checkpoint_dirs(directory)] == ["AtomicDirectory_checkpoint_0_force"]
    assert latest_name(directory) == "AtomicDirectory_checkpoint_0_force"

    manager = CheckpointManager(directory)
    assert not partial.exists(), "opening the directory removes the partial write"
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1
    assert manager.verify(loaded.path)["step"] == 1
    assert torch.equal(loaded.state["weights"], torch.arange(300_000, dtype=torch.float32))
    assert loaded.metrics == {"eval/top1": 0.5}


@pytest.fixture
def held_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background writes wait for this event before writing anything."""
    release = threading.Event()
    real_save = checkpoint_module.torch.save

    def save_when_released(obj, f, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(60), "the test never released the writer"
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save_when_released)
    return release


def test_save_returns_before_the_write_and_writes_the_state_as_it_was(tmp_path: Path,
                                                                      held_writer: threading.Event) -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "progress": {"step": 7}}
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]}

    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(7, state)
    assert not checkpoint_dirs(tmp_path), "save() waited for the write"
    with torch.no_grad():  # the loop changes the live weights and optimizer state meanwhile
        for param in model.parameters():
            param.add_(1.0)
            optimizer.state[param]["momentum_buffer"].mul_(-1)
    state["progress"]["step"] = 8
    held_writer.set()
    manager.wait()

    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 7
    for key, value in expected["model"].items():
        assert torch.equal(loaded.state["model"][key], value), key
    assert loaded.state["model"]._metadata == model.state_dict()._metadata
    saved_momentum = [entry["momentum_buffer"] for entry in loaded.state["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(saved_momentum, expected["momentum"], strict=True))
    assert loaded.state["progress"] == {"step": 7}


def test_one_save_in_flight_the_next_waits_for_it(tmp_path: Path, held_writer: threading.Event) -> None:
    manager = CheckpointManager(tmp_path, async_save=True, keep_last=5)
    manager.save(1, {"weights": torch.ones(10)})
    waiting, returned = threading.Event(), threading.Event()
    real_wait = manager.wait

    def note_waiting() -> None:
        if threading.current_thread().name == "second save":
            waiting.set()
        real_wait()

    manager.wait = note_waiting

    def second_save() -> None:
        manager.save(2, {"weights": torch.full((10,), 2.0)})
        returned.set()

    second = threading.Thread(target=second_save, name="second save")
    second.start()
    deadline = time.monotonic() + 60
    while not (waiting.is_set() or returned.is_set()):  # the held first write cannot finish meanwhile
        assert time.monotonic() < deadline, "the second save neither waited nor returned within 60 s"
        time.sleep(0.01)
    assert not returned.is_set(), "a second save went ahead while the first was still being written"
    assert not checkpoint_dirs(tmp_path)
    held_writer.set()
    second.join(timeout=60)
    assert returned.is_set()
    manager.wait()
    assert [found.path.name for found in checkpoint_dirs(tmp_path)] == ["AtomicDirectory_checkpoint_0",
                                                                       "AtomicDirectory_checkpoint_1"]
    assert manager.load_latest().step == 2


def test_a_failed_background_write_is_reported_and_the_previous_checkpoint_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(1, {"weights": torch.ones(10)})
    manager.wait()

    def disk_full(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full)
    manager.save(2, {"weights": torch.full((10,), 2.0)})
    expected = (f"could not write a checkpoint to {tmp_path}: No space left on device "
                r"\(a checkpoint needs about 40 B, [\d.]+ [kMGT]?B free there\)")
    with pytest.raises(CheckpointWriteError, match=expected):
        manager.wait()
    monkeypatch.undo()
    assert not list(tmp_path.glob(".tmp-*")), "the partial checkpoint was left behind"
    assert CheckpointManager(tmp_path).load_latest().step == 1


def test_snapshot_buffers_are_reused_and_hold_copies() -> None:
    weights = torch.randn(64, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    snapshots = HostSnapshot()
    first = snapshots.snapshot({"w": weights, "rng": (3, (1, 2), None)})
    weights.add_(1.0)
    assert not torch.equal(first["w"], weights)
    second = snapshots.snapshot({"w": weights, "rng": (3, (1, 2), None)})
    assert second["w"].data_ptr() == first["w"].data_ptr(), "the second snapshot should refill the same buffer"
    assert torch.equal(second["w"], weights)
    assert second["w"].is_contiguous(memory_format=torch.channels_last)
    assert second["rng"] == (3, (1, 2), None)
