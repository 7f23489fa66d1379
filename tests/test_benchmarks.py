"""The benchmark harness: collects modules, keeps the hand-written section, reports a failing module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import benchmarks
from benchmarks import run as harness
from benchmarks.results import Result

FAKE_MODULES = {
    "tiny_ok": "from benchmarks.results import Result\n"
               "def run(quick):\n    return [Result('tiny', 'quick' if quick else 'full', 1.5, 'ms', 'a note')]\n",
    "tiny_broken": "def run(quick):\n    raise ValueError('this benchmark is broken')\n",
    "tiny_helper": "VALUE = 1  # a module without run() is not a benchmark\n",
}


@pytest.fixture
def fake_benchmarks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A second benchmarks folder on the package path, holding tiny modules."""
    folder = tmp_path / "extra"
    folder.mkdir()
    for name, source in FAKE_MODULES.items():
        (folder / f"{name}.py").write_text(source)
    monkeypatch.setattr(benchmarks, "__path__", [*benchmarks.__path__, str(folder)])
    yield folder
    for name in FAKE_MODULES:
        sys.modules.pop(f"benchmarks.{name}", None)


def test_discovers_the_real_modules_and_not_the_harness() -> None:
    names = harness.discover()
    assert {"overhead", "checkpoint_stall", "resume_cost", "data_throughput"} <= set(names)
    assert "run" not in names and "results" not in names


def test_writes_tables_keeps_hand_written_text_and_reports_failures(fake_benchmarks: Path, tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    output.write_text(f"# old\n{harness.HAND_START}\nH100: 4.2 ms/step (by hand)\n{harness.HAND_END}\nold tables\n")

    code = harness.main(["--quick", "--only", "tiny_ok", "tiny_broken", "tiny_helper", "--output", str(output)])

    text = output.read_text()
    assert code == 1, "a failing module makes the exit code non-zero"
    assert "H100: 4.2 ms/step (by hand)" in text
    assert "old tables" not in text
    assert "| quick | 1.5 | ms | a note |" in text
    assert "ValueError: this benchmark is broken" in text
    assert "module: tiny_helper" not in text, "a module without run() gets no section"
    assert "- machine: CPU " in text and "torch " in text
    assert "--only tiny_ok tiny_broken" in text


def test_only_refreshes_the_modules_it_runs(fake_benchmarks: Path, tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    assert harness.main(["--only", "tiny_ok", "--output", str(output)]) == 0
    harness.main(["--only", "tiny_broken", "--output", str(output)])
    text = output.read_text()
    assert "| full | 1.5 | ms | a note |" in text, "the table of the module not run again is kept"
    assert "this benchmark is broken" in text
    assert harness.HAND_START in text and "Recorded by hand" in text


def test_an_unknown_module_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert harness.main(["--only", "no_such_benchmark", "--output", str(tmp_path / "R.md")]) == 2
    assert "no benchmark module no_such_benchmark" in capsys.readouterr().err
    assert not (tmp_path / "R.md").exists()


def test_result_values_are_formatted_for_reading() -> None:
    assert harness.format_value(2470.4) == "2,470"
    assert harness.format_value(12.345) == "12.3"
    assert harness.format_value(0.01234) == "0.0123"
    assert harness.format_value(float("nan")) == "n/a"
    assert Result("b", "s", 1.0, "u").note == ""


def test_throughput_from_two_run_lengths_is_exact_when_only_the_first_run_pays_warm_up() -> None:
    """Runs cost 5 s of start-up and 0.1 s per step, and the process's first run 30 s more
    (CUDA context, cuDNN autotuning, compilation): 10 images per step give 100 images/s."""
    from benchmarks.cifar100_resnet50 import images_per_second_between

    runs = []

    def seconds_for_steps(steps: int) -> float:
        runs.append(steps)
        return 5 + 0.1 * steps + (30 if len(runs) == 1 else 0)

    assert images_per_second_between(seconds_for_steps, short=20, long=120, batch_size=10) == pytest.approx(100)


# ---- make bench-peers: the harness, on the CPU with the stand-in for timm's scripts --------------------


def test_a_timm_train_line_is_read_as_its_step_and_data_wait() -> None:
    from benchmarks.peers import TIMM_LINE

    line = ("Train: 2 [  15/32 ( 50%)]  Loss: 4.12 (4.30)  Time: 0.056s, 4571.43/s  (0.057s, 4491.23/s)  "
            "LR: 1.000e-01  Data: 0.007 (0.012)")
    match = TIMM_LINE.search(line)
    assert (match["epoch"], match["index"], match["per_epoch"], match["time"], match["data"]) == \
        ("2", "15", "32", "0.056", "0.007")


@pytest.mark.slow
def test_bench_peers_tiny_runs_both_sides_and_reports_every_figure(tmp_path: Path) -> None:
    import json
    import subprocess

    from tests.conftest import REPO, recipe_env

    result = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                            env=recipe_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "peers.json").read_text())
    runs = {run["name"]: run for run in report["runs"]}
    assert set(runs) == {"timm_imagenet", "peer_stand_in.py (stand-in for timm train.py)"}
    steps = report["settings"]["images"] // report["settings"]["batch"] * report["settings"]["epochs"]
    for run in runs.values():
        assert run["steady_images_per_s"] > 0 and 0 < run["seconds_to_fifth_step"] < run["wall_s"]
        assert 0 <= run["steady_data_wait_frac"] <= 1 and 0 <= run["epoch_start_data_wait_frac"] <= 1
        covered = [step for window in run["windows"] for step in range(window["first"], window["last"] + 1)]
        assert covered == list(range(1, steps + 1)), f"{run['name']}: the windows do not tile the run's steps"
    settings = {row["setting"] for row in report["results"]}
    assert any(setting.startswith("ViT step, this project's") for setting in settings)
    assert any(setting.startswith("ViT step, timm peer_stand_in.py") for setting in settings)
    assert "steady images/s" in result.stdout


# ---- benchmarks/memory.py: its search for the largest batch, on a pretended GPU ---------------------


@pytest.mark.parametrize(("fitting", "misjudged"), [(24, 1.3), (200, 0.8), (1000, 1.3), (5000, 0.8)])
def test_the_largest_batch_search_ends_within_3_percent_below_what_fits(
        fitting: int, misjudged: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU of 80 GiB where a batch fits up to ``fitting`` images, and whose peak memory of small
    batches grows by ``misjudged`` times what the failures show (the first guess too high or too low)."""
    from types import SimpleNamespace

    from benchmarks import memory

    tried = []

    def fits(setup: object, batch: int, device: object, steps: int = 1) -> bool:
        tried.append(batch)
        return batch <= fitting

    per_image = 70 / fitting * misjudged
    monkeypatch.setattr(memory, "fits", fits)
    monkeypatch.setattr(memory, "peak_gib", lambda setup, batch, device, steps: 5 + batch * per_image)
    monkeypatch.setattr(memory.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
        total_memory=80 * 2**30))
    found = memory.largest_batch(None, "cuda", limit=8192)
    assert found % 8 == 0 and found <= fitting and found >= 0.96 * fitting - 8, (found, tried)
    assert len(tried) <= 12, tried


def test_the_memory_benchmark_takes_each_setting_on_the_cpu() -> None:
    """Without a GPU: one batch per activation-checkpointing mode, for the ViT and the preset under
    FSDP2 (in a process of its own): the code path the GPU session runs."""
    from benchmarks import memory

    results = memory.run(quick=True)
    settings = [result.setting for result in results]
    assert len(results) == 6 and all(result.unit == "images/s" and result.value > 0 for result in results)
    for mode in memory.MODES:
        assert sum(f"activation_checkpointing={mode}," in setting for setting in settings) == 2
    assert sum("FSDP2 on one GPU" in setting for setting in settings) == 3


def test_a_timed_batch_that_runs_out_of_memory_is_timed_again_a_sixteenth_smaller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's two steps can fit where the timed ones meet the allocator's fragments (as on an
    H100, 2026-11-26): the figure is then taken at a smaller batch, and the one reported is that batch."""
    from types import SimpleNamespace

    from benchmarks import memory

    timed = []

    def images_per_s(setup: object, batch: int, device: object, warmup: int, steps: int) -> tuple[float, float]:
        timed.append(batch)
        if batch > 900:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 100.0, 70.0

    monkeypatch.setattr(memory, "images_per_s", images_per_s)
    monkeypatch.setattr(memory, "largest_batch", lambda setup, device, limit: 1024)
    monkeypatch.setattr(memory, "clean_up_after_error", lambda setup, device: None)
    monkeypatch.setattr(memory.torch.cuda.memory, "_set_allocator_settings", lambda settings: None)
    monkeypatch.setattr(memory.torch.cuda, "get_device_name", lambda device: "a GPU")
    results = memory.measure(lambda mode, device, tiny: SimpleNamespace(label="a ViT"), SimpleNamespace(type="cuda"),
                             quick=False)
    assert timed == [1024, 960, 904, 848] * len(memory.MODES)
    assert [r.value for r in results if r.unit == "images per batch"] == [848] * len(memory.MODES)
