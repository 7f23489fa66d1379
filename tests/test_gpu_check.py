"""``make gpu-check DEVICE=cpu``: the GPU check's whole sequence at tiny sizes, so that it cannot rot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import COMPILED, RECIPES, TORCH_DIR, CheckFailed, judge_syncs, step_lines, sync_site
from benchmarks.run import HAND_END, HAND_START
from tests.conftest import REPO, assert_ok, recipe_env

CHECKED = ("fashion_mnist", "dinov2_fsdp")  # the recipes whose runs the whole sequence checks on a CPU


@pytest.mark.slow
def test_the_whole_sequence_runs_on_the_cpu_and_is_recorded(tmp_path: Path) -> None:
    """Compiled runs are left out: on 2 CPU cores each takes minutes of C++ compilation. Two recipes'
    runs are checked, the plainest and the FSDP one (the only one whose check reads more): each
    recipe's own SIGTERM-and-resume is tested in tests/test_<recipe>.py, and that the default checks
    all six in the stubbed test below."""
    results = tmp_path / "RESULTS.md"
    shutil.copy(REPO / "benchmarks" / "RESULTS.md", results)
    hand_written = results.read_text().split(HAND_START, 1)[1].split(HAND_END, 1)[0]
    report_file = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--skip-compile", "--results", str(results),
         "--json", str(report_file), "--recipes", ",".join(CHECKED)],
        cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=1800,
    )
    assert_ok(result)
    report = json.loads(report_file.read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert sorted(check.split(":")[0] for check in checks if check.endswith(": uninterrupted run")) == sorted(CHECKED)
    for recipe in CHECKED:
        assert checks[f"{recipe}: uninterrupted run"]["passed"]
        resumed = checks[f"{recipe}: SIGTERM, exit 75, resume, same digest"]
        assert resumed["passed"] and "the resumed run's digest is the same" in resumed["detail"]
    assert checks["tv_segmentation: synchronised BatchNorm across 2 processes"]["passed"]
    assert all(check["passed"] for check in report["checks"]), [c for c in report["checks"] if not c["passed"]]
    units = {figure["unit"] for figure in report["figures"]}
    assert {"images/s", "ms", "%", "ms/step"} <= units
    assert report["torch"] and report["device"].startswith("none")

    text = results.read_text()
    recorded = text.split(HAND_START, 1)[1].split(HAND_END, 1)[0]
    assert recorded.startswith(hand_written), "the earlier hand-written records must stay as they were"
    assert "### `make gpu-check`" in recorded and "| fashion_mnist: uninterrupted run | pass |" in recorded
    assert "| check | result | seconds | detail |" in result.stdout and "all checks passed" in result.stdout


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_training_step_is_found_in_every_train_py(recipe: str) -> None:
    train_py = REPO / "recipes" / recipe / "train.py"
    step, allowed = step_lines(train_py)
    lines = train_py.read_text().splitlines()
    increment = next(n for n, line in enumerate(lines, 1) if line.strip().startswith("run.step_done(group.samples"))
    grad_norm = next(n for n, line in enumerate(lines, 1) if "run.clip_grad_norm(" in line)
    loop = next(n for n, line in enumerate(lines, 1) if "in run.steps(" in line)
    reduce_for_logging = next(n for n, line in enumerate(lines, 1) if "train_sums.reduce()" in line)
    micro_batch = micro_batch_call(lines)  # the forward and backward passes, in a helper the step calls
    assert increment in step and increment not in allowed
    assert grad_norm in step and grad_norm not in allowed, "the gradient norm of every step must not sync"
    assert loop in allowed, "the run contract saves between steps, on the loop's line"
    assert reduce_for_logging in allowed and micro_batch in step and micro_batch not in allowed
    assert not any("def save" in lines[n - 1] or "def run_eval" in lines[n - 1] for n in step)


def micro_batch_call(lines: list[str]) -> int:
    """The line where a recipe's step calls its micro-batch helper (forward and backward passes)."""
    return next(n for n, line in enumerate(lines, 1) if line.strip().startswith("forward_backward("))


def test_a_sync_inside_the_step_fails_and_one_in_the_logging_branch_does_not(tmp_path: Path) -> None:
    train_py = REPO / "recipes" / "fashion_mnist" / "train.py"
    lines = train_py.read_text().splitlines()
    reduce_for_logging = next(n for n, line in enumerate(lines, 1) if "train_sums.reduce()" in line)
    backward = micro_batch_call(lines)
    syncs = tmp_path / "fashion_mnist" / "syncs.json"
    syncs.parent.mkdir()
    syncs.write_text(json.dumps({str(reduce_for_logging): 3, "outside train.py": 40}))
    assert judge_syncs(syncs) == "none in the step; 3 in logging/checkpoint branches, 40 outside the step"
    syncs.write_text(json.dumps({str(reduce_for_logging): 3, str(backward): 32}))
    with pytest.raises(CheckFailed, match=f"train.py:{backward} x32"):
        judge_syncs(syncs)


def test_a_sync_in_a_helper_is_judged_by_the_frame_that_called_it_from_the_step(tmp_path: Path) -> None:
    """A sync in a function defined in train.py counts where the step called it: walking outward
    from the innermost train.py frame, the first inside the step decides."""
    train_py = REPO / "recipes" / "fashion_mnist" / "train.py"
    step, allowed = step_lines(train_py)
    lines = train_py.read_text().splitlines()
    helper = next(n for n, line in enumerate(lines, 1) if ".backward()" in line)  # forward_backward's, outside
    reduce_for_logging = next(n for n, line in enumerate(lines, 1) if "train_sums.reduce()" in line)
    backward = micro_batch_call(lines)  # where the step calls forward_backward
    assert helper not in step and backward in step
    syncs = tmp_path / "fashion_mnist" / "syncs.json"
    syncs.parent.mkdir()
    syncs.write_text(json.dumps({f"{helper},{reduce_for_logging}": 2, str(helper): 5, "outside train.py": 1}))
    assert judge_syncs(syncs) == "none in the step; 2 in logging/checkpoint branches, 6 outside the step"
    syncs.write_text(json.dumps({f"{helper},{backward}": 4}))
    with pytest.raises(CheckFailed, match=rf"train.py:{backward} \(in train.py:{helper}\) x4"):
        judge_syncs(syncs)


def test_the_tracer_records_every_train_py_frame_innermost_first_and_the_call_that_synced() -> None:
    train_py = str(REPO / "recipes" / "r" / "train.py")
    frame = traceback.FrameSummary
    stack = traceback.StackSummary.from_list([
        frame("/usr/lib/python3/runpy.py", 5, "_run_code"), frame(train_py, 87, "main"),
        frame(f"{TORCH_DIR}nn/modules/module.py", 3, "__call__"), frame(train_py, 212, "helper"),
        frame(f"{TORCH_DIR}_tensor.py", 9, "item")])
    assert sync_site(stack, train_py) == "212,87"
    assert sync_site(stack[:1], train_py) == "outside train.py at /usr/lib/python3/runpy.py:5"
    library = f"{os.path.dirname(TORCH_DIR.rstrip(os.sep))}/torchvision/ops/roi_align.py"
    deeper = [*stack[:4], frame(str(REPO / "common" / "data" / "images.py"), 431, "resized_crops"),
              frame(library, 281, "roi_align"), frame(f"{TORCH_DIR}_dynamo/eval_frame.py", 9, "_fn"),
              frame(warnings.__file__, 7, "_showwarnmsg")]
    assert sync_site(deeper, train_py) == "212,87 at torchvision/ops/roi_align.py:281"
    assert sync_site(deeper[:5], train_py) == "212,87 at common/data/images.py:431"


def test_a_sync_in_the_step_names_the_call_that_synced(tmp_path: Path) -> None:
    train_py = REPO / "recipes" / "fashion_mnist" / "train.py"
    backward = micro_batch_call(train_py.read_text().splitlines())
    syncs = tmp_path / "fashion_mnist" / "syncs.json"
    syncs.parent.mkdir()
    syncs.write_text(json.dumps({f"{backward} at torchvision/ops/roi_align.py:281": 3}))
    with pytest.raises(CheckFailed, match=rf"train.py:{backward} \(at torchvision/ops/roi_align.py:281\) x3"):
        judge_syncs(syncs)


# Makes two packages unimportable, as on a GPU machine whose Python lacks them.
BLOCK_PACKAGES = """\
import sys


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "simsimd"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocked())
"""


def test_missing_packages_are_one_line_naming_them_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_PACKAGES)
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick",
                             "--work-dir", str(tmp_path / "work")],
                            cwd=REPO, env=recipe_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
    assert result.stderr.startswith("error: gpu-check needs Python packages that ")
    assert ": hydra-core, simsimd (run `make setup`" in result.stderr
    assert not (tmp_path / "work").exists()


def test_quick_runs_every_check_and_neither_figures_nor_compilation(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What each mode runs, with the runs themselves stubbed out (the whole sequence runs above)."""
    recipe_runs, figures = {}, []
    monkeypatch.setattr(gpu_check, "write_datasets", lambda root: {recipe: [] for recipe in RECIPES})
    monkeypatch.setattr(gpu_check, "check_recipe", lambda report, recipe, overrides, device, work, compile_too:
                        recipe_runs.__setitem__(recipe, compile_too))
    monkeypatch.setattr(gpu_check, "check_sync_batchnorm", lambda device, work: "stub")
    for name in ("resnet50_figures", "vit_figures", "checkpoint_stall_figures", "overhead_figures"):
        monkeypatch.setattr(gpu_check, name, lambda *args, name=name: figures.append(name) or [])
    for quick in (True, False):
        recipe_runs.clear()
        figures.clear()
        report = tmp_path / f"report-{quick}.json"
        code = gpu_check.main(["--device", "cpu", "--work-dir", str(tmp_path / "work"), "--json", str(report),
                               *(["--quick"] if quick else [])])
        assert code == 0
        checks = [check["name"] for check in json.loads(report.read_text())["checks"]]
        assert "tv_segmentation: synchronised BatchNorm across 2 processes" in checks
        assert sorted(recipe_runs) == sorted(RECIPES)
        if quick:
            assert figures == [] and not any(recipe_runs.values())
        else:
            assert figures == ["resnet50_figures", "vit_figures", "checkpoint_stall_figures", "overhead_figures"]
            assert {recipe for recipe, compiled in recipe_runs.items() if compiled} == set(COMPILED)
    recipe_runs.clear()
    assert gpu_check.main(["--device", "cpu", "--work-dir", str(tmp_path / "work"), "--quick",
                           "--recipes", "dinov2_fsdp,fashion_mnist"]) == 0
    assert sorted(recipe_runs) == ["dinov2_fsdp", "fashion_mnist"]


def test_the_checks_name_every_recipe_and_refuse_an_unknown_one(capsys: pytest.CaptureFixture) -> None:
    assert sorted(RECIPES) == sorted(path.parent.name for path in (REPO / "recipes").glob("*/train.py"))
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--device", "cpu", "--recipes", "fashion_mnist,mnist"])
    assert stopped.value.code == 2
    assert "unknown recipe mnist: choose from fashion_mnist, cifar100_resnet50" in capsys.readouterr().err


def test_a_recorded_section_starts_after_a_blank_line(tmp_path: Path) -> None:
    """A section appended right after a table would be read as the table's next row."""
    results = tmp_path / "RESULTS.md"
    results.write_text(f"| a | b |\n|---|---|\n| 1 | 2 |\n{HAND_END}\n")
    gpu_check.record_section(results, "### section\n\ntext\n")
    assert results.read_text() == f"| a | b |\n|---|---|\n| 1 | 2 |\n\n### section\n\ntext\n{HAND_END}\n"
    gpu_check.record_section(results, "### another\n")
    assert results.read_text().endswith("text\n\n### another\n" + HAND_END + "\n")
