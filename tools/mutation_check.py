"""Check that the test suite catches the bugs that would hurt users most: apply each mutation in
``tools/mutations.py`` to a copy of the repository, run the tests named for it, and report which
mutations survive (their tests still pass).

    python -m tools.mutation_check [--only ID ...] [--list] [--keep DIR]
    make mutation-check [ONLY="id1 id2"]

A mutation replaces one exact piece of source text (it must occur exactly once, so a mutation
that no longer applies after a change is reported, not silently skipped). The copy is made once,
from the working tree (tracked and untracked-but-not-ignored files), and each mutated file is
restored after its run; ``.venv`` is linked, not copied. The named tests are first run on the
unmutated copy: they must pass, or a failure would prove nothing. Exit code 0 only when every
mutation was killed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools.mutations import MUTATIONS, Mutation

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200


@dataclass
class Outcome:
    mutation: Mutation
    verdict: str  # killed | survived | does not apply | timed out | error <pytest exit code>
    seconds: float
    detail: str = ""


def copy_repository(target: Path) -> None:
    """The working tree's files git knows or would add, and a link to the virtual environment."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for relative in filter(None, listed):
        source = REPO / relative
        if source.is_file() and not source.is_symlink():
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    (target / ".venv").symlink_to(REPO / ".venv")


def apply(mutation: Mutation, root: Path) -> str:
    """Mutate the copy and return the file's original text; a mutation that does not apply
    exactly once, or leaves Python that does not compile (which any test would catch), raises."""
    path = root / mutation.file
    original = path.read_text()
    if original.count(mutation.old) != 1:
        raise ValueError(f"the text to replace occurs {original.count(mutation.old)} times, not once")
    mutated = original.replace(mutation.old, mutation.new)
    if path.suffix == ".py":
        try:
            compile(mutated, str(path), "exec")
        except SyntaxError as error:
            raise ValueError(f"the mutated file does not compile ({error.msg}, line {error.lineno})") from error
    path.write_text(mutated)
    return original


def pytest(tests: list[str], root: Path) -> tuple[int | None, str]:
    """Run ``tests`` in the copy: pytest's exit code (None: timed out) and its last line."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    command = [str(root / ".venv" / "bin" / "python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"tests still running after {TIMEOUT_S} s"
    return result.returncode, (result.stdout.strip().splitlines() or [""])[-1]


def run_tests(mutation: Mutation, root: Path) -> tuple[str, str]:
    """``killed`` when a named test fails, ``survived`` when all pass."""
    code, last = pytest(list(mutation.tests), root)
    verdicts = {None: "timed out", 0: "survived", 1: "killed"}  # pytest's exit codes: all passed, some failed
    return verdicts.get(code, f"error {code}"), last


def check_baseline(mutations: list[Mutation], root: Path) -> None:
    """The named tests must pass on the unmutated copy, or a failure would say nothing of a mutation."""
    tests = list(dict.fromkeys(test for mutation in mutations for test in mutation.tests))
    print(f"baseline: {len(tests)} tests on the unmutated copy", flush=True)
    code, last = pytest(tests, root)
    if code != 0:
        raise SystemExit(f"error: the tests fail without any mutation ({last}); fix them first")


def check(mutations: list[Mutation], keep: Path | None) -> list[Outcome]:
    root = keep or Path(tempfile.mkdtemp(prefix="mutation-check-"))
    copy_repository(root)
    outcomes = []
    try:
        check_baseline(mutations, root)
        for number, mutation in enumerate(mutations, 1):
            print(f"[{number}/{len(mutations)}] {mutation.id}: {mutation.file}", flush=True)
            start = time.monotonic()
            try:
                original = apply(mutation, root)
            except ValueError as error:
                outcomes.append(Outcome(mutation, "does not apply", 0.0, str(error)))
                print(f"    does not apply: {error}", flush=True)
                continue
            try:
                verdict, detail = run_tests(mutation, root)
            finally:
                (root / mutation.file).write_text(original)
            outcomes.append(Outcome(mutation, verdict, time.monotonic() - start, detail))
            print(f"    {verdict} ({outcomes[-1].seconds:.0f} s): {detail}", flush=True)
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return outcomes


def report(outcomes: list[Outcome]) -> str:
    width = max(len(outcome.mutation.id) for outcome in outcomes)
    lines = [f"{'mutation':<{width}}  {'verdict':<14}  seconds  what it breaks", "-" * (width + 40)]
    for outcome in outcomes:
        lines.append(f"{outcome.mutation.id:<{width}}  {outcome.verdict:<14}  {outcome.seconds:7.0f}  "
                     f"{outcome.mutation.breaks}")
    survivors = [outcome for outcome in outcomes if outcome.verdict != "killed"]
    lines.append(f"\n{len(outcomes) - len(survivors)} of {len(outcomes)} mutations killed; "
                 f"{len(survivors)} not: {', '.join(o.mutation.id for o in survivors) or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mutation_check", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=[], help="mutation ids to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--keep", type=Path, default=None, help="make the copy here and keep it")
    args = parser.parse_args(argv)
    unknown = set(args.only) - {mutation.id for mutation in MUTATIONS}
    if unknown:
        print(f"error: no mutation named {', '.join(sorted(unknown))} (see --list)", file=sys.stderr)
        return 2
    selected = [mutation for mutation in MUTATIONS if not args.only or mutation.id in args.only]
    if args.list:
        for mutation in selected:
            print(f"{mutation.id}: {mutation.file}: {mutation.breaks}\n    tests: {' '.join(mutation.tests)}")
        return 0
    outcomes = check(selected, args.keep)
    print(report(outcomes))
    return 0 if all(outcome.verdict == "killed" for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
