"""The mutation check itself: every mutation still applies to the source and names tests that
exist, and a mutation the suite catches is reported as killed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tools.mutation_check import apply
from tools.mutations import MUTATIONS


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[mutation.id for mutation in MUTATIONS])
def test_each_mutation_applies_once_and_names_existing_tests(mutation, tmp_path: Path) -> None:
    copy = tmp_path / mutation.file
    copy.parent.mkdir(parents=True, exist_ok=True)  # a file at the top is written into tmp_path itself
    copy.write_text((REPO / mutation.file).read_text())
    apply(mutation, tmp_path)  # raises unless the text occurs exactly once and the result compiles
    assert copy.read_text() != (REPO / mutation.file).read_text()
    for test in mutation.tests:
        path, _, name = test.partition("::")
        assert f"def {name.split('[')[0]}(" in (REPO / path).read_text(), test


def test_each_parametrized_case_a_mutation_names_is_collected() -> None:
    """A case id the test above cannot read from the source (``[2-SIGUSR1]``): pytest must collect it,
    or the check's baseline run stops on a case that a renamed parameter left behind."""
    cases = sorted({test for mutation in MUTATIONS for test in mutation.tests if "[" in test})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *cases], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = {line for line in result.stdout.splitlines() if "::" in line}
    assert collected == set(cases), set(cases) - collected


def test_a_caught_mutation_is_reported_killed() -> None:
    result = subprocess.run([sys.executable, "-m", "tools.mutation_check", "--only", "tensorboard-logs-nothing"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 1 mutations killed; 0 not: none" in result.stdout
