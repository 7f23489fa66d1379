"""What a run records, read from one tiny fashion_mnist run and its resume: the telemetry of every
training log (console, TensorBoard, metrics.jsonl), a provenance record per segment (and in every
checkpoint's manifest), the resolved config printed once per segment, a profile of the steps asked
for, the columns ``make compare`` takes from them; and the one-line end of an out-of-memory error."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from common.checkpoint.layout import MANIFEST_FILE, committed_checkpoints, latest_checkpoint
from common.records.loggers import read_metrics_file
from common.records.provenance import read_records
from tests.conftest import REPO, assert_ok, recipe_env, run_recipe
from tests.resume import PAUSE_HOOK

TINY = ["model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16", "trainer.log_every_steps=2",
        "checkpoint.every_seconds=0", "checkpoint.every_steps=2", "checkpoint.keep_last=20"]
FIRST_STEPS, ALL_STEPS = 6, 10
TELEMETRY = ("train/images_per_s", "train/step_s", "train/data_wait_frac", "train/grad_norm")
FAKE_TORCH = "0.0.1-another-build"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


class Recorded:
    """The run: its folder and the output of its two segments."""

    def __init__(self, run_dir: Path, first: subprocess.CompletedProcess, second: subprocess.CompletedProcess,
                 manifests_before: set[str]) -> None:
        self.run_dir = run_dir
        self.first, self.second = first, second
        self.manifests_before = manifests_before  # the checkpoints the first segment saved

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics_file(self.run_dir / "tensorboard" / "metrics.jsonl")


@pytest.fixture(scope="session")
def recorded(fashion_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """Segment one: 6 steps with a trace of steps 3-4, TensorBoard, a progress line per log. Then
    the manifest of its last checkpoint is made to say another PyTorch wrote it, and segment two
    resumes to step 10 with trainer.deterministic=true."""
    run_dir = tmp_path_factory.mktemp("recorded") / "run"
    common = [f"data.root={fashion_data}", f"run_dir={run_dir}", *TINY, "logging.backend=tensorboard"]
    first = run_recipe("fashion_mnist", [*common, f"trainer.max_steps={FIRST_STEPS}", "profile.enabled=true",
                                         "profile.start_step=3", "profile.active_steps=2"])
    assert_ok(first)
    checkpoints = run_dir / "checkpoints"
    manifests_before = {found.path.name for found in committed_checkpoints(checkpoints)}
    latest = latest_checkpoint(checkpoints).path / MANIFEST_FILE
    manifest = json.loads(latest.read_text())
    manifest["provenance"]["torch"] = FAKE_TORCH
    latest.write_text(json.dumps(manifest))
    second = run_recipe("fashion_mnist", [*common, f"trainer.max_steps={ALL_STEPS}", "trainer.deterministic=true"])
    assert_ok(second)
    return Recorded(run_dir, first, second, manifests_before)


def test_every_training_log_has_the_telemetry_in_all_three_outputs(recorded: Recorded) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_logs = [record for record in recorded.metrics() if "train/loss" in record]
    assert [record["step"] for record in train_logs] == list(range(2, ALL_STEPS + 1, 2))
    for record in train_logs:
        assert set(TELEMETRY) <= set(record), record
        assert 0 <= record["train/data_wait_frac"] <= 1 and record["train/step_s"] > 0
        assert record["train/grad_norm"] > 0, "the norm is measured on logging steps with clipping off"
        # On a CPU: no peak FLOP/s to compare with, no device memory to measure, one rank.
        assert not {"train/mfu", "train/max_mem_gib", "train/step_s_max_rank"} & set(record)
    events = EventAccumulator(str(recorded.run_dir / "tensorboard"))
    events.Reload()
    assert set(TELEMETRY) <= set(events.Tags()["scalars"])
    progress_lines = [line for line in recorded.first.stdout.splitlines() if line.startswith("epoch 1/")]
    assert len(progress_lines) == FIRST_STEPS // 2
    assert all("step_s " in line and "data_wait_frac " in line and "grad_norm " in line for line in progress_lines)


def test_each_segment_appends_a_provenance_record_of_its_commit_and_machine(recorded: Recorded) -> None:
    records = read_records(recorded.run_dir)
    assert [record["segment"] for record in records] == [0, 1]
    assert records[0]["resumed_from"] is None
    assert records[1]["resumed_from"]["step"] == FIRST_STEPS
    status = git("status", "--porcelain")
    for record in records:
        assert record["git_commit"] == git("rev-parse", "HEAD").strip()
        assert record["git_dirty"] == bool(status)
        if status:
            assert (recorded.run_dir / record["git_diff"]).read_bytes() == subprocess.run(
                ["git", "-C", str(REPO), "diff", "HEAD", "--binary"], capture_output=True, check=True).stdout
        else:
            assert record["git_diff"] is None
        assert record["torch"] == torch.__version__ and record["device"] == "cpu" and record["gpu"] is None
        assert record["hosts"] == [socket.gethostname()] and record["world_size"] == 1
        assert "-m" in record["command"] and "recipes.fashion_mnist.train" in record["command"]
        assert f"run_dir={recorded.run_dir}" in record["overrides"]
        packages = (recorded.run_dir / record["packages"]).read_text()
        assert hashlib.sha256(packages.encode()).hexdigest()[:16] == record["packages_hash"]
        assert f"torch=={torch.__version__.split('+')[0]}" in packages.splitlines()  # (no local version: +cu130)
    assert records[1]["start_time"] >= records[0]["start_time"]


def test_every_checkpoint_holds_the_record_of_the_segment_that_saved_it(recorded: Recorded) -> None:
    records = read_records(recorded.run_dir)
    saved = committed_checkpoints(recorded.run_dir / "checkpoints")
    assert len({found.manifest["provenance"]["segment"] for found in saved}) == 2, "both segments kept a checkpoint"
    for found in saved:
        segment = 0 if found.path.name in recorded.manifests_before else 1
        if segment == 0 and found.manifest["provenance"]["torch"] == FAKE_TORCH:
            continue  # the manifest the fixture edited
        assert found.manifest["provenance"] == records[segment], found.path.name


def test_a_deterministic_resume_on_other_software_says_it_will_not_be_bit_identical(recorded: Recorded) -> None:
    lines = [line for line in recorded.second.stdout.splitlines() if "will not be bit-identical" in line]
    assert len(lines) == 1, recorded.second.stdout[-3000:]
    assert f"torch {FAKE_TORCH} (now {torch.__version__})" in lines[0]
    assert "will not be bit-identical" not in recorded.first.stdout


def test_the_resolved_config_is_printed_once_per_segment(recorded: Recorded) -> None:
    for segment in (recorded.first, recorded.second):
        assert segment.stdout.count(f"config ({recorded.run_dir / '.hydra' / 'config.yaml'}):\n") == 1
        assert f"run_dir: {recorded.run_dir}\n" in segment.stdout, "the config is printed resolved"


def test_the_profile_traces_the_steps_asked_for_and_says_where(recorded: Recorded) -> None:
    trace = recorded.run_dir / "profile" / "rank0-step3.pt.trace.json.gz"
    with gzip.open(trace, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}
    assert any(event.get("name") == "aten::convolution" for event in events), "the model's work is in the trace"
    assert [path.name for path in (recorded.run_dir / "profile").iterdir()] == [trace.name]
    assert f"profile of optimizer steps 3-4: a trace in {trace.parent}/rank<r>-step3.pt.trace.json.gz" \
        in recorded.first.stdout


def test_compare_shows_the_commit_dirty_torch_and_device_of_the_newest_segment(recorded: Recorded,
                                                                               tmp_path: Path) -> None:
    import csv

    out = tmp_path / "compare"
    result = subprocess.run([sys.executable, "-m", "tools.compare", str(recorded.run_dir), "--out", str(out)],
                            cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert_ok(result)
    with open(out / "runs.csv") as handle:
        (row,) = list(csv.DictReader(handle))
    newest = read_records(recorded.run_dir)[-1]
    assert (row["git"], row["dirty"], row["torch"], row["device"]) == (
        newest["git_commit"], str(newest["git_dirty"]), torch.__version__, "cpu")
    assert newest["git_commit"][:10] in result.stdout and newest["git_commit"] not in result.stdout


def test_out_of_memory_in_the_loop_ends_in_one_line_naming_the_step_and_a_smaller_batch(
        fashion_data: Path, tmp_path: Path) -> None:
    env = recipe_env(PYTHONPATH=f"{PAUSE_HOOK}{os.pathsep}{REPO}", OOM_AT_STEP="3")
    result = run_recipe("fashion_mnist", [f"data.root={fashion_data}", f"run_dir={tmp_path / 'run'}", *TINY,
                                          "logging.backend=none", "trainer.global_batch_size=32",
                                          "profile.memory_on_oom=true"], env=env)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: out of CPU memory in optimizer step 3 on rank 0 ({socket.gethostname()}) (Tried to allocate "
        f"2.00 GiB); try trainer.batch_size=8 trainer.global_batch_size=32 (gradient accumulation keeps the "
        f"global batch), or let the run halve it (trainer.out_of_memory=halve)"]
    assert "profile.memory_on_oom: no memory history, it records CUDA allocations and this run is on cpu" \
        in result.stdout
