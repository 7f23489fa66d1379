"""Provenance: the commit and changes of a checkout, what happens without git, the package list,
what a bit-identical resume needs unchanged, and a copied recipe outside any checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.records.provenance import (
    append_record,
    bit_identity_differences,
    git_state,
    installed_packages,
    read_records,
)
from tests.conftest import REPO, assert_ok, recipe_env


def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    folder = tmp_path / "checkout"
    folder.mkdir()
    git(folder, "init", "-q")
    git(folder, "config", "user.email", "t@example.com")
    git(folder, "config", "user.name", "t")
    (folder / "train.py").write_text("lr = 0.1\n")
    git(folder, "add", "train.py")
    git(folder, "commit", "-q", "-m", "first")
    return folder


def test_the_commit_is_the_checkouts_and_a_change_makes_it_dirty_with_its_diff(checkout: Path) -> None:
    first = git(checkout, "rev-parse", "HEAD").strip()
    clean = git_state(checkout)
    assert (clean.commit, clean.dirty, clean.diff, clean.note) == (first, False, b"", None)

    (checkout / "train.py").write_text("lr = 0.2\n")
    git(checkout, "commit", "-q", "-am", "second")
    second = git(checkout, "rev-parse", "HEAD").strip()
    assert git_state(checkout).commit == second != first

    (checkout / "train.py").write_text("lr = 0.3\n")
    (checkout / "new_model.py").write_text("x = 1\n")
    dirty = git_state(checkout)
    assert dirty.commit == second and dirty.dirty is True
    assert b"-lr = 0.2\n+lr = 0.3" in dirty.diff
    assert dirty.untracked == ["new_model.py"]
    git(checkout, "checkout", "-q", "train.py")
    assert git_state(checkout).dirty is True, "an untracked file is a change too"


def test_without_a_checkout_or_git_or_a_git_that_hangs_the_commit_is_null_with_a_note(
        tmp_path: Path, checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "copied").mkdir()
    elsewhere = git_state(tmp_path / "copied")
    assert (elsewhere.commit, elsewhere.dirty) == (None, None)
    assert "is not a git checkout" in elsewhere.note

    sleep = shutil.which("sleep")
    monkeypatch.setenv("PATH", str(tmp_path / "no-binaries"))
    assert git_state(checkout).note == "git is not installed: the code's version is unknown"

    fake = tmp_path / "hanging"
    fake.mkdir()
    (fake / "git").write_text(f"#!/bin/sh\nexec {sleep} 30\n")
    (fake / "git").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    hung = git_state(checkout, timeout_s=0.5)
    assert hung.commit is None and hung.note == "git did not answer within 0.5 s: the code's version is unknown"


def test_the_package_list_is_pip_freezes() -> None:
    """The same ``name==version`` lines; pip names an editable install (this project) by its folder."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    expected = {line.lower() for line in frozen if "==" in line and not line.startswith("#")}
    ours = {line.lower() for line in installed_packages().splitlines()}
    assert expected <= ours
    assert len(ours - expected) == sum(line.startswith("-e ") for line in frozen)


def test_a_record_cut_short_by_a_kill_is_skipped_and_the_next_starts_a_new_line(tmp_path: Path) -> None:
    append_record(tmp_path, {"segment": 0})
    with open(tmp_path / "provenance.jsonl", "a") as handle:
        handle.write('{"segment": 1, "git_co')
    append_record(tmp_path, {"segment": 1})
    assert read_records(tmp_path) == [{"segment": 0}, {"segment": 1}]


def test_what_a_bit_identical_resume_needs_unchanged_is_named() -> None:
    saved = {"device": "cuda", "gpu": "NVIDIA A100-SXM4-80GB", "driver": "550.54.15", "torch": "2.11.0",
             "cuda": "12.8", "cudnn": 91002, "python": "3.12.3", "hosts": ["a"]}
    assert bit_identity_differences(saved, {**saved, "python": "3.12.4", "hosts": ["b"]}) == []
    now = {**saved, "gpu": "NVIDIA H100 80GB HBM3", "cudnn": 91100}
    assert bit_identity_differences(saved, now) == ["gpu NVIDIA A100-SXM4-80GB (now NVIDIA H100 80GB HBM3)",
                                                    "cudnn 91002 (now 91100)"]
    assert bit_identity_differences(None, now) == [], "a checkpoint from before these records"


def test_code_untracked_inside_another_repository_names_none_of_its_commits(checkout: Path) -> None:
    """A project copied or vendored into another repository: that repository's commit does not hold
    the code until the code is committed there."""
    project = checkout / "vendor" / "project"
    code = ("common", "recipes/demo")
    for folder in code:
        (project / folder).mkdir(parents=True)
        (project / folder / "code.py").write_text("x = 1\n")
    inside = git_state(project, code=code)
    assert (inside.commit, inside.dirty, inside.diff, inside.untracked) == (None, None, b"", [])
    assert inside.note == (f"common, recipes/demo in {project} is not tracked by the git repository at {checkout}, "
                           f"whose commit does not hold the code that ran: the code's version is unknown")

    git(checkout, "add", "vendor/project/common")
    git(checkout, "commit", "-q", "-m", "vendor common only")
    assert git_state(project, code=code).note.startswith("recipes/demo in "), "the recipe's folder is untracked"

    git(checkout, "add", "vendor")
    git(checkout, "commit", "-q", "-m", "vendor the recipe")
    tracked = git_state(project, code=code)
    assert (tracked.commit, tracked.dirty, tracked.note) == (git(checkout, "rev-parse", "HEAD").strip(), False, None)


@pytest.mark.parametrize("enclosing_repository", [False, True], ids=["outside-any-repository", "inside-another"])
def test_a_recipe_copied_out_of_the_checkout_trains_and_says_its_version_is_unknown(
        tmp_path: Path, fashion_data: Path, enclosing_repository: bool) -> None:
    if enclosing_repository:  # the user's own repository, with a commit that holds none of the copy
        git(tmp_path, "init", "-q")
        git(tmp_path, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x")
    copy = tmp_path / "project"
    for part in ("common", "conf", "recipes/fashion_mnist"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "recipes" / "__init__.py", copy / "recipes" / "__init__.py")
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "recipes.fashion_mnist.train", f"data.root={fashion_data}",
                             f"run_dir={run_dir}", "model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16",
                             "trainer.max_steps=2", "logging.backend=none", "logging.progress_bar=false"],
                            cwd=copy, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert_ok(result)
    (record,) = read_records(run_dir)
    assert record["git_commit"] is None and record["git_dirty"] is None
    if enclosing_repository:
        assert record["git_untracked"] == [] and record["git_diff"] is None
        assert record["git_note"] == (f"common, recipes/fashion_mnist in {copy} is not tracked by the git repository "
                                      f"at {tmp_path}, whose commit does not hold the code that ran: the code's "
                                      f"version is unknown")
    else:
        assert record["git_note"] == f"{copy} is not a git checkout (a copied recipe?): the code's version is unknown"
