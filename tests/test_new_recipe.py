"""`make new-recipe` copies a recipe whose own tests, and the suite's checks of every recipe, then
pass without edits; the copy trains, resumes after a SIGKILL and ends with the weights of a run
that was never interrupted.

Each test copies the repository into a sandbox, makes the copy there and runs pytest there, so
that the suite's shared tables (``tests/test_config_keys.py``, ``tests/trained_runs.py``) see the
copy as they would in a researcher's checkout: they read its ``recipes/<copy>/testing.py``.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import EXIT_DIVERGED
from tests import trained_runs
from tests.conftest import REPO, kill_run, latest_step, read_summary, recipe_env
from tests.recipe_tables import COMMON
from tests.resume import RESUMED, wait_for_pause

COPIED = ["common", "conf", "recipes", "data_prep", "tools", "tests", "cluster", "Makefile", "pyproject.toml"]
KEY_CHECK = "test_changing_a_key_changes_what_it_should"


def make_sandbox(tmp_path: Path) -> Path:
    sandbox = tmp_path / "repo"
    sandbox.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, sandbox / name, ignore=ignore)
        else:
            shutil.copy2(source, sandbox / name)
    return sandbox


def files_of(sandbox: Path) -> dict[str, bytes]:
    return {str(path.relative_to(sandbox)): path.read_bytes() for path in sorted(sandbox.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts}


def copy_made_by(command: list[str], sandbox: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the tool; what it printed and the files it created. It changed no file that was there
    (the shared test tables included), and created exactly the files it says it created."""
    before = files_of(sandbox)
    made = subprocess.run(command, cwd=sandbox, env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    after = files_of(sandbox)
    assert [path for path in before if after.get(path) != before[path]] == [], "the tool changed existing files"
    created = sorted(set(after) - set(before))
    assert created == sorted(line.split("created ", 1)[1] for line in made.stdout.splitlines() if "  created " in line)
    return made, created


def recipe_files(sandbox: Path, source: str, name: str, others: list[str]) -> list[str]:
    """The copy's files: those of ``recipes/<source>/`` under ``recipes/<name>/``, and ``others``; sorted."""
    folder = sandbox / "recipes" / source
    return sorted([*(f"recipes/{name}/{path.relative_to(folder)}" for path in folder.rglob("*") if path.is_file()),
                   *others])


def pytest_in(sandbox: Path, files: list[str], deselected: list[str], keywords: str) -> str:
    """``pytest -v`` on ``files`` in the sandbox, ``-k keywords``; its output, once every selected test passed."""
    tests = subprocess.run([sys.executable, "-m", "pytest", "-x", "-v", "-p", "no:cacheprovider",
                            f"--basetemp={sandbox.parent / 'pytest'}", *files,
                            *(f"--deselect={test}" for test in deselected), "-k", keywords],
                           cwd=sandbox, env=recipe_env(), capture_output=True, text=True, timeout=900)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout
    return tests.stdout


def shared_checks(name: str) -> tuple[list[str], str]:
    """The suite's checks of every recipe, as they apply to the copy ``name``: files and ``-k`` keywords.
    (Its key checks' ids begin ``[<name>-``, its config's ``[<name>]``.)"""
    files = ["tests/test_config_keys.py", "tests/test_isc.py", "tests/test_cluster.py"]
    keywords = (f"{name}- or [{name}] or every_schema_key or registry_names or every_recipe or {name}.isc "
                f"or {name}.sbatch")
    return files, keywords


def assert_checked_as_the_original(output: str, source: str, name: str) -> None:
    """The copy's config keys passed exactly the checks its original's have (tests/test_config_keys.py)."""
    from tests.test_config_keys import _cases

    expected = {case.id.replace(source, name, 1) for case in _cases() if case.values[0] == source}
    passed = set(re.findall(rf"::{KEY_CHECK}\[({name}-[^\]]+)\] PASSED", output))
    assert expected and passed == expected, (f"key checks of the copy, missing: {sorted(expected - passed)}, "
                                             f"not the original's: {sorted(passed - expected)}")
    for test in ("test_every_schema_key_has_a_check_or_a_reason_it_has_no_effect_on_a_cpu",
                 "test_the_registry_names_only_keys_that_exist_and_observables_it_knows",
                 f"test_a_config_as_plain_data_is_what_omegaconf_makes_of_it[{name}]",
                 "test_every_recipe_has_an_isc_file", "test_every_recipe_has_an_sbatch_file_that_runs_it",
                 f"{name}.isc", f"{name}.sbatch"):
        assert test in output, f"{test} did not run in the copy:\n{output[-4000:]}"


def tiny_settings_of_the_copy(sandbox: Path, name: str, data: Path) -> list[str]:
    """The tiny settings the copy declares in its ``testing.py`` (as the shared tables read them), on ``data``."""
    declared = runpy.run_path(str(sandbox / "recipes" / name / "testing.py"))
    return [*declared["TINY"], *COMMON, f"data.root={data}"]


def killed_after_its_first_checkpoint_then_resumed(sandbox: Path, name: str, settings: list[str],
                                                   tmp_path: Path) -> dict:
    """Train the copy uninterrupted; train it again, SIGKILLed (every process, no clean-up) right after
    its first checkpoint (step 2, mid-epoch), then started again: it resumes from that checkpoint and
    ends with the uninterrupted run's weights and metrics. The resumed run's summary."""
    settings = [*settings, "checkpoint.every_steps=2", "checkpoint.every_seconds=0"]
    command = [sys.executable, "-m", f"recipes.{name}.train", *settings]
    env = recipe_env(PYTHONPATH=str(sandbox))

    reference = subprocess.run([*command, f"run_dir={tmp_path / 'reference'}"], cwd=sandbox, env=env,
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = read_summary(tmp_path / "reference")
    assert expected["steps"] // expected["epochs"] > 2, "the first checkpoint must fall in the middle of an epoch"

    run_dir, marker = tmp_path / "run", tmp_path / "killed.paused"
    paused = recipe_env(PYTHONPATH=f"{sandbox / 'tests' / 'pause_hook'}{os.pathsep}{sandbox}", PAUSE_AT_STEP="1",
                        PAUSE_MARKER=str(marker), PAUSE_HOW="after-save")
    process = subprocess.Popen([*command, f"run_dir={run_dir}"], cwd=sandbox, env=paused, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        paused_at = wait_for_pause(marker, process)
    finally:
        kill_run(process)
    assert paused_at == 2 and latest_step(run_dir / "checkpoints") == 2, "killed after another checkpoint"
    assert not (run_dir / "summary.json").exists()

    resumed = subprocess.run([*command, f"run_dir={run_dir}"], cwd=sandbox, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [int(step) for step in RESUMED.findall(resumed.stdout)] == [2], resumed.stdout[-3000:]
    summary = read_summary(run_dir)
    assert summary["resumes"] == 1 and summary["steps"] == expected["steps"]
    assert summary["model_digest"] == expected["model_digest"], "the resumed copy ended with other weights"
    assert summary["metrics"] == expected["metrics"]
    return summary


@pytest.mark.slow
def test_new_recipe_round_trip(tmp_path: Path, fashion_data: Path) -> None:
    sandbox = make_sandbox(tmp_path)
    venv = Path(sys.executable).parents[1]
    make = ["make", "new-recipe", "NAME=demo_copy", "FROM=fashion_mnist", f"VENV={venv}", "STAMP="]
    made, created = copy_made_by(make, sandbox)
    assert created == recipe_files(sandbox, "fashion_mnist", "demo_copy", [
        "conf/demo_copy.yaml", "conf/experiment/demo_copy_long.yaml", "conf/search/demo_copy.yaml",
        "data_prep/demo_copy.py", "tests/test_demo_copy.py", "tests/test_demo_copy_prep.py",
        "cluster/slurm/demo_copy.sbatch", "cluster/isc/demo_copy.isc"]), made.stdout
    for path in ("recipes/demo_copy/train.py", "recipes/demo_copy/config.py", "recipes/demo_copy/testing.py",
                 "conf/demo_copy.yaml", "conf/experiment/demo_copy_long.yaml", "conf/search/demo_copy.yaml",
                 "data_prep/demo_copy.py", "tests/test_demo_copy.py", "tests/test_demo_copy_prep.py"):
        assert (sandbox / path).is_file(), path
    config = (sandbox / "recipes/demo_copy/config.py").read_text()
    assert "class DemoCopyConfig(RunConfig)" in config and 'recipe: str = "demo_copy"' in config
    assert "  - demo_copy_schema\n" in (sandbox / "conf/demo_copy.yaml").read_text()
    assert "fashion_mnist" not in (sandbox / "recipes/demo_copy/train.py").read_text()
    assert "nothing else was written" in made.stdout and "recipes/demo_copy/testing.py" in made.stdout

    again = subprocess.run(["make", "new-recipe", "NAME=demo_copy", f"VENV={venv}", "STAMP="],
                           cwd=sandbox, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "already exists" in again.stderr

    for path in ("cluster/slurm/demo_copy.sbatch", "cluster/isc/demo_copy.isc"):
        text = (sandbox / path).read_text()
        assert "recipes.demo_copy.train" in text and "fashion_mnist" not in text, path

    # What the copy changes is its names: its end-to-end run, its one-line errors, its config and
    # its data prep run here, and so do the suite's checks of every recipe, which take the copy's
    # entries from its recipes/demo_copy/testing.py: every key check of the original, under the
    # copy's name, and the checks that every recipe has its cluster files (the copied sbatch file is
    # also linted). Its other tests (resume chains, another number of ranks, precisions) are the
    # original's code under another name, which this suite already runs; the copy's own resume is
    # checked below.
    already_run = [f"tests/test_demo_copy.py::{name}" for name in (
        "test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact",
        "test_a_finished_run_extended_on_another_number_of_ranks_continues",
        "test_fp16_with_its_grad_scaler_runs_and_resumes",
        "test_user_errors_are_one_line_and_exit_2[trainer.nonsense=1",  # Hydra's errors: only data.root's is the copy's
        "test_user_errors_are_one_line_and_exit_2[trainer.epochs=many",
        "test_user_errors_are_one_line_and_exit_2[trainer.precision=fp8",
    )]
    files, keywords = shared_checks("demo_copy")
    output = pytest_in(sandbox, ["tests/test_demo_copy.py", "tests/test_demo_copy_prep.py", *files], already_run,
                       f"test_demo_copy or {keywords}")
    assert "test_demo_copy.py::test_user_errors" in output and "test_demo_copy_prep.py::" in output, output[-4000:]
    assert_checked_as_the_original(output, "fashion_mnist", "demo_copy")

    settings = [*tiny_settings_of_the_copy(sandbox, "demo_copy", fashion_data), "trainer.batch_size=64",
                "trainer.epochs=2"]
    summary = killed_after_its_first_checkpoint_then_resumed(sandbox, "demo_copy", settings, tmp_path / "resume")
    assert summary["steps"] == 2 * 256 // 64

    # The copy's loop hands its loss to the divergence watch as the original's does: a NaN loss at
    # step 2 (tests/pause_hook) stops it with exit code 3.
    diverged = subprocess.run([sys.executable, "-m", "recipes.demo_copy.train", f"data.root={fashion_data}",
                               f"run_dir={tmp_path / 'diverged'}", "model.channels=[4,8]", "model.hidden=16",
                               "trainer.batch_size=16", "trainer.max_steps=4", "logging.backend=none",
                               "checkpoint.sync_every_steps=1"], cwd=sandbox, capture_output=True, text=True,
                              env=recipe_env(PYTHONPATH=f"{sandbox / 'tests' / 'pause_hook'}{os.pathsep}{sandbox}",
                                             NONFINITE_AT_STEP="2"),
                              timeout=300)
    assert diverged.returncode == EXIT_DIVERGED, diverged.stderr[-2000:]
    assert "the training was not finite at step 2" in diverged.stderr


@pytest.mark.slow
def test_a_copy_of_an_image_recipe_passes_its_tests_and_key_checks_and_resumes_after_sigkill(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """timm_imagenet copied by tools/new_recipe.py itself: its JPEG data, its data prep and shards
    (stamped with the copy's name), its key checks with their own resources (timm weights, shards)."""
    sandbox = make_sandbox(tmp_path)
    made, created = copy_made_by([sys.executable, "-m", "tools.new_recipe", "--name", "demo_images", "--from",
                                  "timm_imagenet"], sandbox)
    assert created == recipe_files(sandbox, "timm_imagenet", "demo_images", [
        "conf/demo_images.yaml", "data_prep/demo_images.py", "tests/test_demo_images.py",
        "cluster/slurm/demo_images.sbatch", "cluster/isc/demo_images.isc"]), made.stdout

    # Of the copy's own tests, those whose names the copy rewrote (its data prep, its error lines);
    # the rest are the original's code under another name, run whole in the fashion_mnist round
    # trip above, and the copy's training and resume are checked below.
    already_run = ["tests/test_demo_images.py::test_a_corrupt_jpeg_is_a_one_line_error[gpu]"]
    files, keywords = shared_checks("demo_images")
    output = pytest_in(sandbox, ["tests/test_demo_images.py", *files], already_run,
                       f"data_prep_sorts or corrupt_jpeg or {keywords}")
    for name in ("test_a_corrupt_jpeg_is_a_one_line_error", "test_data_prep_sorts_a_flat_val_folder"):
        assert f"test_demo_images.py::{name}" in output, f"{name} did not run in the copy:\n{output[-4000:]}"
    assert_checked_as_the_original(output, "timm_imagenet", "demo_images")

    data = trained_runs.imagenet_data(tmp_path_factory)  # 3 classes, 8 training images each
    settings = [*tiny_settings_of_the_copy(sandbox, "demo_images", data), "trainer.epochs=2"]
    summary = killed_after_its_first_checkpoint_then_resumed(sandbox, "demo_images", settings, tmp_path / "resume")
    assert summary["steps"] == 2 * 24 // 8


def modules_make_runs(sandbox: Path, target: str) -> list[str]:
    """The ``python -m`` modules ``make <target>`` would run in ``sandbox``, in order (``make -n``)."""
    venv = Path(sys.executable).parents[1]
    dry = subprocess.run(["make", "-n", target, f"VENV={venv}", "STAMP="], cwd=sandbox, capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    return re.findall(r" -m (\S+)", dry.stdout)


@pytest.mark.parametrize(("source", "prepares"), [("fashion_mnist", True), ("timm_imagenet", False)])
def test_a_copy_prepares_its_data_as_its_original_does_and_the_tool_names_each_command_it_needs(
        tmp_path: Path, source: str, prepares: bool) -> None:
    """``make train-<copy>`` runs what ``make train-<original>`` runs (its data prep first where the
    original's does), and the tool's last lines name the commands the copy needs, in order."""
    sandbox = make_sandbox(tmp_path)
    made, _ = copy_made_by([sys.executable, "-m", "tools.new_recipe", "--name", "mine", "--from", source], sandbox)
    original = modules_make_runs(sandbox, f"train-{source}")
    assert (f"data_prep.{source}" in original) == prepares and original[-1] == f"recipes.{source}.train"
    assert modules_make_runs(sandbox, "train-mine") == [module.replace(source, "mine") for module in original]

    named = [line.split()[:2] for line in made.stdout.split("in order:\n", 1)[1].splitlines()
             if line.startswith("  make ")]
    assert named == [*([] if prepares else [["make", "prep-mine"]]), ["make", "train-mine"], ["make", "test"]], \
        made.stdout
    for _, target in named[:-1]:
        assert modules_make_runs(sandbox, target)[-1] in ("data_prep.mine", "recipes.mine.train")


def test_the_files_of_a_recipe_whose_name_extends_the_originals_are_not_copied(tmp_path: Path) -> None:
    """Copying ``foo`` beside a recipe ``foo_v2``: foo_v2's preset and tests are not foo's."""
    from tools.new_recipe import files_to_copy

    for path in ("recipes/foo/train.py", "recipes/foo/testing.py", "recipes/foo_v2/train.py", "conf/foo.yaml",
                 "conf/foo_v2.yaml", "conf/experiment/foo_long.yaml", "conf/experiment/foo_v2_long.yaml",
                 "conf/experiment/other.yaml", "tests/test_foo.py", "tests/test_foo_prep.py", "tests/test_foo_v2.py",
                 "tests/test_foo_v2_prep.py", "cluster/isc/foo.isc"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    copied = [(str(source.relative_to(tmp_path)), str(copy.relative_to(tmp_path)))
              for source, copy in files_to_copy(tmp_path, "foo", "bar")]
    assert copied == [("recipes/foo/testing.py", "recipes/bar/testing.py"),
                      ("recipes/foo/train.py", "recipes/bar/train.py"),
                      ("conf/foo.yaml", "conf/bar.yaml"),
                      ("conf/experiment/foo_long.yaml", "conf/experiment/bar_long.yaml"),
                      ("tests/test_foo.py", "tests/test_bar.py"),
                      ("tests/test_foo_prep.py", "tests/test_bar_prep.py"),
                      ("cluster/isc/foo.isc", "cluster/isc/bar.isc")]
