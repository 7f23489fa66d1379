"""Where the suite's time went, from the lines ``pytest --timeline=FILE`` wrote (``tests/timeline.py``).

    make test PYTEST_ARGS="--timeline=/tmp/timeline.jsonl"
    python -m tools.suite_timeline /tmp/timeline.jsonl [--top 25]

Prints the suite's wall time and CPU seconds (how many cores it kept busy on average), each
worker's span (a worker that ends long before the others shows a group or a long test handed out
too late), the tests that used the most CPU, the CPU of each test module, and the tests of
:data:`SLOW_CPU_S` or more that are not marked ``slow`` (slow tests are handed out first, and
docs/testing.md says why each must take what it takes). CPU seconds, not a loaded machine's wall
time, say what a test costs the suite.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from common.errors import UserError
from data_prep.files import run_cli

SLOW_CPU_S = 30  # a test that uses this much CPU is marked slow (pyproject.toml's markers)


def read_timeline(path: Path) -> list[dict]:
    """The timeline's lines; a ``UserError`` for a missing, empty or damaged file."""
    if not path.is_file():
        raise UserError(f"{path} does not exist: write it with `make test PYTEST_ARGS=\"--timeline={path}\"`")
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not a timeline pytest --timeline wrote ({error})") from None
    if not lines:
        raise UserError(f"{path} holds no test")
    return lines


def grouped(lines: list[dict], key: Callable[[dict], str]) -> dict[str, list[dict]]:
    """The lines by ``key`` (a worker, a test module), in their order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        groups[key(line)].append(line)
    return groups


def report(lines: list[dict], top: int, slow_cpu_s: float = SLOW_CPU_S) -> str:
    """The text :func:`main` prints."""
    start, end = min(line["start"] for line in lines), max(line["end"] for line in lines)
    wall, cpu = end - start, sum(line["cpu_s"] for line in lines)
    out = [f"{len(lines)} tests in {wall:.0f} s of wall time, {cpu:.0f} CPU s "
           f"({cpu / max(wall, 1e-9):.2f} cores busy on average)", "",
           f"{'worker':<8} {'tests':>6} {'busy s':>8} {'CPU s':>8} {'ends at s':>10}"]
    for worker, ran in sorted(grouped(lines, lambda line: line["worker"]).items()):
        busy = sum(line["end"] - line["start"] for line in ran)
        out.append(f"{worker:<8} {len(ran):>6} {busy:>8.0f} {sum(line['cpu_s'] for line in ran):>8.0f} "
                   f"{max(line['end'] for line in ran) - start:>10.0f}")
    out += ["", f"the {min(top, len(lines))} tests that used the most CPU:",
            f"{'CPU s':>7} {'wall s':>7}  test"]
    for line in sorted(lines, key=lambda line: -line["cpu_s"])[:top]:
        out.append(f"{line['cpu_s']:>7.1f} {line['end'] - line['start']:>7.1f}  {line['test']}")
    modules = {module: (len(ran), sum(line["cpu_s"] for line in ran))
               for module, ran in grouped(lines, lambda line: line["test"].split("::", 1)[0]).items()}
    out += ["", "CPU by test module:", f"{'CPU s':>7} {'share':>6} {'tests':>6}  module"]
    for module, (count, seconds) in sorted(modules.items(), key=lambda item: -item[1][1]):
        out.append(f"{seconds:>7.0f} {seconds / max(cpu, 1e-9):>6.1%} {count:>6}  {module}")
    return "\n".join(out + unmarked_slow_tests(lines, slow_cpu_s))


def unmarked_slow_tests(lines: list[dict], slow_cpu_s: float) -> list[str]:
    """The report's last part: each test function with a run of ``slow_cpu_s`` CPU seconds or more
    that is not marked ``slow`` (nothing for a timeline written before lines said so)."""
    if any("slow" not in line for line in lines):
        return []
    unmarked = grouped([line for line in lines if line["cpu_s"] >= slow_cpu_s and not line["slow"]],
                       lambda line: line["test"].split("[", 1)[0])
    if not unmarked:
        return ["", f"every test of {slow_cpu_s:g} CPU s or more is marked slow"]
    out = ["", f"tests of {slow_cpu_s:g} CPU s or more not marked slow (mark them @pytest.mark.slow and say why "
               "in docs/testing.md):"]
    for test, ran in sorted(unmarked.items(), key=lambda item: -max(line["cpu_s"] for line in item[1])):
        out.append(f"{max(line['cpu_s'] for line in ran):>7.1f}  {test}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", type=Path, help="the file pytest --timeline wrote")
    parser.add_argument("--top", type=int, default=25, help="how many of the costliest tests to list")
    parser.add_argument("--slow-cpu-s", type=float, default=SLOW_CPU_S,
                        help="list the tests of this many CPU seconds or more that are not marked slow")
    args = parser.parse_args()
    print(report(read_timeline(args.timeline), args.top, args.slow_cpu_s))


if __name__ == "__main__":
    run_cli(main)
