"""``pytest --timeline FILE`` records each test's worker, span and CPU seconds (its children's too),
and ``python -m tools.suite_timeline`` reports them (``tests/timeline.py``, docs/testing.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, recipe_env

TESTS = '''
import subprocess, sys, time

import pytest

BURN = "import time\\nwhile time.process_time() < 0.5: pass"


def test_a_child_burns_half_a_cpu_second():
    subprocess.run([sys.executable, "-c", BURN], check=True)


@pytest.mark.slow
def test_a_slow_one_burns_as_much():
    subprocess.run([sys.executable, "-c", BURN], check=True)


def test_a_sleep_costs_no_cpu():
    time.sleep(0.5)
'''


def test_each_test_has_its_worker_span_and_the_cpu_of_its_children_and_the_report_adds_them_up(
        tmp_path: Path) -> None:
    (tmp_path / "test_two.py").write_text(TESTS)
    timeline = tmp_path / "timeline.jsonl"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.timeline", "-p", "no:cacheprovider", "-n", "2",
                          "--timeline", str(timeline), "test_two.py"], cwd=tmp_path,
                         env=recipe_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]
    lines = {line["test"]: line for line in map(json.loads, timeline.read_text().splitlines())}
    burn = lines["test_two.py::test_a_child_burns_half_a_cpu_second"]
    sleep = lines["test_two.py::test_a_sleep_costs_no_cpu"]
    slow = lines["test_two.py::test_a_slow_one_burns_as_much"]
    assert {burn["worker"], sleep["worker"], slow["worker"]} <= {"gw0", "gw1"}
    assert slow["slow"] and not burn["slow"] and not sleep["slow"]
    assert burn["cpu_s"] >= 0.5, "the child's CPU is not counted"
    assert sleep["end"] - sleep["start"] >= 0.5 and sleep["cpu_s"] < 0.25, "a sleep counted as CPU"

    report = subprocess.run([sys.executable, "-m", "tools.suite_timeline", str(timeline), "--top", "2",
                             "--slow-cpu-s", "0.5"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("3 tests in "), report.stdout
    costliest = report.stdout.split("the 2 tests that used the most CPU:\n", 1)[1].splitlines()[1:3]
    assert sorted(line.split("  ")[-1] for line in costliest) == [
        "test_two.py::test_a_child_burns_half_a_cpu_second", "test_two.py::test_a_slow_one_burns_as_much"]
    total = burn["cpu_s"] + sleep["cpu_s"] + slow["cpu_s"]
    assert f"{total:>7.0f} 100.0%      3  test_two.py" in report.stdout
    unmarked = report.stdout.split("not marked slow", 1)[1].splitlines()[1:]
    assert unmarked == [f"{burn['cpu_s']:>7.1f}  test_two.py::test_a_child_burns_half_a_cpu_second"], report.stdout

    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text('{"test": "a", "wor')
    for path, says in ((tmp_path / "none.jsonl", "does not exist"), (damaged, "is not a timeline")):
        failed = subprocess.run([sys.executable, "-m", "tools.suite_timeline", str(path)], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert failed.returncode == 2 and failed.stderr.count("\n") == 1 and says in failed.stderr, failed.stderr
