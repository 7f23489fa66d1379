"""Compiled code survives restarts: a resumed ``trainer.compile=true`` run takes what an earlier
segment compiled from the checkpoint, on a node whose own cache is empty; an archive made for
another torch, device or code, or a damaged one, is ignored with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from common.checkpoint.layout import CheckpointError, read_attachment
from common.checkpoint.manager import CheckpointManager, LoadedCheckpoint
from common.run import compile_cache
from common.run.compile_cache import (
    ARCHIVE_FILE,
    CACHE_DIR_VARIABLE,
    CompileCache,
    cache_key,
    key_fields,
    source_digest,
)
from tests.conftest import REPO, assert_ok, recipe_env, run_recipe
from tests.resume import PAUSE_HOOK

TINY = ["model.channels=[4]", "model.hidden=8", "trainer.batch_size=16", "logging.backend=none",
        "logging.progress_bar=false", "trainer.compile=true"]


def compile_counters(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("COMPILE_COUNTERS ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0].removeprefix("COMPILE_COUNTERS "))


@pytest.mark.slow
def test_a_resumed_compiled_run_does_not_compile_again(fashion_data: Path, tmp_path: Path) -> None:
    """Each segment gets an empty Inductor cache of its own, as on another node: the second can only
    have its graphs from the checkpoint. Two steps (the first runs eager while train/mfu counts its
    FLOPs), then one more after the resume."""
    command = [f"data.root={fashion_data}", f"run_dir={tmp_path / 'run'}", *TINY]

    def segment(steps: int, cache: str) -> dict:
        env = recipe_env(PYTHONPATH=f"{PAUSE_HOOK}{os.pathsep}{REPO}", PRINT_COMPILE_COUNTERS="1",
                         **{CACHE_DIR_VARIABLE: str(tmp_path / cache)})
        result = run_recipe("fashion_mnist", [*command, f"trainer.max_steps={steps}"], env=env, timeout=600)
        assert_ok(result)
        return {"stdout": result.stdout, **compile_counters(result.stdout)}

    cold = segment(2, "node-a")
    assert cold["inductor"].get("fxgraph_cache_miss", 0) > 0  # it compiled: the counters see it
    warm = segment(3, "node-b")
    assert "compiled code restored from the compile cache in AtomicDirectory_checkpoint_" in warm["stdout"]
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    assert warm["inductor"]["fxgraph_cache_hit"] >= cold["inductor"]["fxgraph_cache_miss"]
    assert warm["aot_autograd"].get("autograd_cache_miss", 0) == 0, warm


@pytest.fixture
def cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A compile cache folder holding one compiled file, as this process's Inductor cache."""
    folder = tmp_path / "cache"
    (folder / "ab").mkdir(parents=True)
    (folder / "ab" / "cabc.so").write_bytes(b"kernel")
    (folder / "locks").mkdir()
    (folder / "locks" / "cabc.lock").write_bytes(b"")
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(folder))
    return folder


def saved_with(cache: CompileCache, directory: Path) -> LoadedCheckpoint:
    manager = CheckpointManager(directory)
    manager.save(1, {"model": {"w": torch.zeros(2)}}, attachments=(cache.attachment(),))
    return manager.load_latest()


def test_the_archive_holds_the_compiled_files_and_unpacks_elsewhere(cache_folder: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fields = key_fields("fashion_mnist", torch.device("cpu"))
    loaded = saved_with(CompileCache(fields), tmp_path / "checkpoints")
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "elsewhere"))
    line = CompileCache(fields).restore(loaded)
    assert line.startswith(f"compiled code restored from the compile cache in {loaded.path.name}: 1 files"), line
    assert (tmp_path / "elsewhere" / "ab" / "cabc.so").read_bytes() == b"kernel"
    assert not (tmp_path / "elsewhere" / "locks").exists()


@pytest.mark.parametrize("changed", ["torch", "cuda", "python", "device", "source"])
def test_an_archive_for_another_torch_device_or_code_is_ignored(cache_folder: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, changed: str) -> None:
    fields = key_fields("fashion_mnist", torch.device("cpu"))
    loaded = saved_with(CompileCache(fields), tmp_path / "checkpoints")
    other = {**fields, changed: "something else"}
    assert cache_key(other) != cache_key(fields)
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "elsewhere"))
    line = CompileCache(other).restore(loaded)
    assert line == (f"the compile cache in {loaded.path.name} was made for another {changed}; ignored, "
                    f"compiling afresh")
    assert not (tmp_path / "elsewhere" / "ab").exists()


def test_a_damaged_archive_is_ignored_and_the_checkpoint_still_loads(cache_folder: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fields = key_fields("fashion_mnist", torch.device("cpu"))
    loaded = saved_with(CompileCache(fields), tmp_path / "checkpoints")
    (loaded.path / ARCHIVE_FILE).write_bytes(b"not a tar")
    again = CheckpointManager(tmp_path / "checkpoints").load_latest()
    assert again.path == loaded.path, "a damaged attachment is no reason to fall back to an older checkpoint"
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        read_attachment(again.path, ARCHIVE_FILE, again.attachments[ARCHIVE_FILE])
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "elsewhere"))
    line = CompileCache(fields).restore(again)
    assert line.startswith(f"the compile cache in {loaded.path.name} is unusable (compile_cache.tar does not match")


def test_the_code_key_follows_the_recipe_and_common_sources(tmp_path: Path) -> None:
    for name in ("recipes/toy/model.py", "common/run/training_run.py", "recipes/other/model.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    before = source_digest("toy", tmp_path)
    (tmp_path / "recipes/other/model.py").write_text("x = 2\n")
    assert source_digest("toy", tmp_path) == before, "another recipe's code is not this one's"
    (tmp_path / "common/run/training_run.py").write_text("x = 2\n")
    assert source_digest("toy", tmp_path) != before
    assert compile_cache.source_digest("fashion_mnist") == source_digest("fashion_mnist", REPO)
