"""``make bench``: run every benchmark module and write ``benchmarks/RESULTS.md``.

    python -m benchmarks.run [--quick] [--only MODULE ...] [--output PATH]

A benchmark module is any ``benchmarks/<name>.py`` with ``run(quick: bool) -> list[Result]``.
A module that fails is reported in the file and the others still run. Each module's table is
replaced only when that module runs again, so ``--only`` refreshes one table and keeps the
rest. The hand-written section between the markers at the top (GPU figures measured on other
machines) is kept as it is.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import os
import pkgutil
import platform
import re
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import benchmarks
from benchmarks.results import Result
from common.records.provenance import cpu_model

RESULTS_FILE = Path(__file__).with_name("RESULTS.md")
NOT_BENCHMARKS = {"run", "results", "gpu_check"}
HAND_START = "<!-- hand-written: start (kept by benchmarks/run.py) -->"
HAND_END = "<!-- hand-written: end -->"
HAND_TEMPLATE = (
    "## Recorded by hand\n\n"
    "GPU figures measured on other machines: device, command, figure, date.\n"
)
SECTION = re.compile(r"<!-- module: (?P<name>\w+) -->\n.*?<!-- end module: (?P=name) -->\n", re.S)


def discover() -> list[str]:
    """Names of the modules in ``benchmarks/`` that may hold a benchmark, sorted."""
    return sorted(
        info.name for info in pkgutil.iter_modules(benchmarks.__path__)
        if info.name not in NOT_BENCHMARKS and not info.name.startswith("_")
    )


def load_runner(name: str) -> Callable[[bool], list[Result]] | None:
    """The module's ``run`` function, or None when the module is not a benchmark."""
    module = importlib.import_module(f"benchmarks.{name}")
    runner = getattr(module, "run", None)
    return runner if callable(runner) else None


def machine_description() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    gpu = ", ".join(gpus) if gpus else "none"
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"CPU {cpu_model() or platform.machine()} ({cores} cores usable{load}); GPU {gpu}; "
            f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} {platform.release()}")


def format_value(value: float) -> str:
    if value != value:  # NaN
        return "n/a"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def render_section(name: str, header: str, results: list[Result], error: str | None, seconds: float) -> str:
    lines = [f"<!-- module: {name} -->", f"## `{name}`", "", f"{header}; took {seconds:.0f} s.", ""]
    if error is not None:
        lines += ["**Failed:**", "", "```", error.rstrip(), "```", ""]
    by_benchmark: dict[str, list[Result]] = {}
    for result in results:
        by_benchmark.setdefault(result.benchmark, []).append(result)
    for benchmark, rows in by_benchmark.items():
        lines += [f"### {benchmark}", "", "| setting | value | unit | note |", "|---|---:|---|---|"]
        lines += [f"| {r.setting} | {format_value(r.value)} | {r.unit} | {r.note} |" for r in rows]
        lines.append("")
    lines.append(f"<!-- end module: {name} -->")
    return "\n".join(lines) + "\n"


def read_previous(path: Path) -> tuple[str, dict[str, str]]:
    """The hand-written section and the module sections of an existing results file."""
    if not path.is_file():
        return HAND_TEMPLATE, {}
    text = path.read_text()
    hand = HAND_TEMPLATE
    if HAND_START in text and HAND_END in text:
        hand = text.split(HAND_START, 1)[1].split(HAND_END, 1)[0].strip("\n") + "\n"
    sections = {match["name"]: match.group(0) for match in SECTION.finditer(text)}
    return hand, sections


def write_results(path: Path, hand: str, sections: dict[str, str], machine: str, command: str, date: str) -> None:
    text = "\n".join([
        "# Benchmark results",
        "",
        "Written by `make bench` (`python -m benchmarks.run`); see docs/benchmarks.md for how to read them. "
        "Everything outside the hand-written section is regenerated.",
        "",
        HAND_START,
        hand.rstrip("\n"),
        HAND_END,
        "",
        "## Latest run",
        "",
        f"- date: {date}",
        f"- command: `{command}`",
        f"- machine: {machine}",
        "",
        *sections.values(),
    ])
    path.write_text(text)


def record_section(name: str, results: list[Result], command: str, seconds: float,
                   output: Path = RESULTS_FILE) -> None:
    """Write the table of a benchmark run by its own command (``make bench-peers``) into the results
    file, keeping every other section as it is."""
    machine = machine_description()
    date = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    hand, sections = read_previous(output)
    sections[name] = render_section(name, f"Measured {date}, `{command}`, on {machine}", results, None, seconds)
    write_results(output, hand, dict(sorted(sections.items())), machine, command, date)


def run_module(name: str, quick: bool) -> tuple[list[Result], str | None]:
    """The module's results and, if it failed, its traceback (what ran before is kept)."""
    try:
        runner = load_runner(name)
        if runner is None:
            return [], None
        return list(runner(quick)), None
    except Exception:  # one broken benchmark must not hide the others
        return [], traceback.format_exc(limit=-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in well under a minute each")
    parser.add_argument("--only", nargs="+", metavar="MODULE", help="run only these modules of benchmarks/")
    parser.add_argument("--output", type=Path, default=RESULTS_FILE, help="results file (default: %(default)s)")
    args = parser.parse_args(argv)

    available = discover()
    names = args.only or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        print(f"error: no benchmark module {', '.join(unknown)} in benchmarks/ (have: {', '.join(available)})",
              file=sys.stderr)
        return 2

    command = shlex.join(["python", "-m", "benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
    machine = machine_description()
    date = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    hand, sections = read_previous(args.output)
    sections = {name: text for name, text in sections.items() if name in available}  # drop removed modules
    print(f"{machine}\n")
    failed = []
    for name in names:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        results, error = run_module(name, args.quick)
        seconds = time.perf_counter() - start
        if error is None and not results:
            continue  # not a benchmark module
        for result in results:
            print(f"   {result.benchmark} | {result.setting}: {format_value(result.value)} {result.unit}")
        if error is not None:
            failed.append(name)
            print(f"   FAILED:\n{error}", file=sys.stderr)
        header = f"Measured {date}, {'quick' if args.quick else 'full'} mode, `{command}`, on {machine}"
        sections[name] = render_section(name, header, results, error, seconds)
        write_results(args.output, hand, dict(sorted(sections.items())), machine, command, date)
    print(f"\nwrote {args.output}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
