"""``pytest --timeline=FILE``: one JSON line per test, to see where the suite's time goes.

(Give it with ``=``: pytest reads a path on its own as the tests' folder before it knows the option.)

Each line holds the test, the xdist worker that ran it, when it started and ended (wall clock),
whether it is marked ``slow``, and the CPU seconds it used: the worker's own and those of the
processes it started and waited for (``resource.getrusage``, so a launcher's ranks and loader
workers count). A test's wall time on a loaded machine says little of its cost: on 2 cores under
3 workers a test that takes 17 s alone has taken 123 s, waiting for the cores. CPU seconds add up
to what the cores must do, and the workers' lines show when each one ran alone at the end.
``python -m tools.suite_timeline FILE`` reports both. Not counted: processes the test did not wait
for (the jobs a SLURM daemon starts, a tree killed with SIGKILL whose children were reparented).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timeline", metavar="FILE", type=Path, default=None,
                     help="append one JSON line per test to FILE: its worker, start, end and CPU seconds "
                          "(read it with python -m tools.suite_timeline FILE)")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Time the test's setup, call and teardown together, as the worker spends them."""
    path = item.config.getoption("timeline")
    if path is None:
        yield
        return
    start, cpu = time.time(), _cpu_seconds()
    yield
    line = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start,
            "end": time.time(), "cpu_s": _cpu_seconds() - cpu, "slow": item.get_closest_marker("slow") is not None}
    with open(path, "a") as timeline:  # one short write per line: the workers' lines do not interleave
        timeline.write(json.dumps(line) + "\n")
