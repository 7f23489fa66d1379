"""`make new-recipe` copies a recipe whose own tests then pass without edits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import EXIT_DIVERGED
from tests.conftest import REPO, recipe_env
from tests.resume import PAUSE_HOOK

COPIED = ["common", "conf", "recipes", "data_prep", "tools", "tests", "cluster", "Makefile", "pyproject.toml"]


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


@pytest.mark.slow
def test_new_recipe_round_trip(tmp_path: Path, fashion_data: Path) -> None:
    sandbox = make_sandbox(tmp_path)
    venv = Path(sys.executable).parents[1]
    made = subprocess.run(["make", "new-recipe", "NAME=demo_copy", "FROM=fashion_mnist", f"VENV={venv}", "STAMP="],
                          cwd=sandbox, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    for path in ("recipes/demo_copy/train.py", "recipes/demo_copy/config.py", "conf/demo_copy.yaml",
                 "conf/experiment/demo_copy_long.yaml", "conf/search/demo_copy.yaml", "data_prep/demo_copy.py",
                 "tests/test_demo_copy.py"):
        assert (sandbox / path).is_file(), path
    config = (sandbox / "recipes/demo_copy/config.py").read_text()
    assert "class DemoCopyConfig(RunConfig)" in config and 'recipe: str = "demo_copy"' in config
    assert "  - demo_copy_schema\n" in (sandbox / "conf/demo_copy.yaml").read_text()
    assert "fashion_mnist" not in (sandbox / "recipes/demo_copy/train.py").read_text()

    again = subprocess.run(["make", "new-recipe", "NAME=demo_copy", f"VENV={venv}", "STAMP="],
                           cwd=sandbox, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "already exists" in again.stderr

    for path in ("cluster/slurm/demo_copy.sbatch", "cluster/isc/demo_copy.isc"):
        text = (sandbox / path).read_text()
        assert "recipes.demo_copy.train" in text and "fashion_mnist" not in text, path

    # What the copy changes is its names: its end-to-end run, its one-line errors and its config run
    # here, and so do the suite's checks that every recipe has its cluster files, which pass as they
    # did before the copy (the copied sbatch file is also linted). Its other tests (resume chains,
    # another number of ranks, precisions) are the original's code under another name, which this suite already runs.
    already_run = [f"--deselect=tests/test_demo_copy.py::{name}" for name in (
        "test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact",
        "test_a_finished_run_extended_on_another_number_of_ranks_continues",
        "test_fp16_with_its_grad_scaler_runs_and_resumes",
        "test_user_errors_are_one_line_and_exit_2[trainer.nonsense=1",  # Hydra's errors: only data.root's is the copy's
        "test_user_errors_are_one_line_and_exit_2[trainer.epochs=many",
        "test_user_errors_are_one_line_and_exit_2[trainer.precision=fp8",
    )]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-x", "-v", "-p", "no:cacheprovider",
                            "tests/test_demo_copy.py", *already_run, "tests/test_isc.py", "tests/test_cluster.py",
                            "-k", "test_demo_copy or every_recipe or demo_copy.isc or demo_copy.sbatch"],
                           cwd=sandbox, env=recipe_env(), capture_output=True, text=True, timeout=900)
    assert tests.returncode == 0, tests.stdout[-4000:]
    for name in ("test_every_recipe_has_an_isc_file", "test_every_recipe_has_an_sbatch_file_that_runs_it",
                 "demo_copy.isc", "demo_copy.sbatch", "test_demo_copy.py::test_user_errors"):
        assert name in tests.stdout, f"{name} did not run in the copy:\n{tests.stdout[-4000:]}"
    assert " passed" in tests.stdout and "failed" not in tests.stdout

    # The copy's loop hands its loss to the divergence watch as the original's does: a NaN loss at
    # step 2 (tests/pause_hook) stops it with exit code 3.
    diverged = subprocess.run([sys.executable, "-m", "recipes.demo_copy.train", f"data.root={fashion_data}",
                               f"run_dir={tmp_path / 'diverged'}", "model.channels=[4,8]", "model.hidden=16",
                               "trainer.batch_size=16", "trainer.max_steps=4", "logging.backend=none",
                               "checkpoint.sync_every_steps=1"], cwd=sandbox, capture_output=True, text=True,
                              env=recipe_env(PYTHONPATH=f"{PAUSE_HOOK}{os.pathsep}{sandbox}", NONFINITE_AT_STEP="2"),
                              timeout=300)
    assert diverged.returncode == EXIT_DIVERGED, diverged.stderr[-2000:]
    assert "the training was not finite at step 2" in diverged.stderr
