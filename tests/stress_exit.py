"""Stress check for issue 23, item 3: a finished 2-rank run never dies at exit.

    python -m tests.stress_exit [--runs 30] [--keep DIR]      (make stress-exit; not part of make test)

A finished run whose process group outlives the interpreter's shutdown could die there with
``terminate called without an active exception`` (SIGABRT, exit -6), so torchrun exited 1 after a
run that had written its summary (see ``common.pytorch.distributed.shutdown_distributed`` and
``common.entry.exit_process``). This runs, ``--runs`` times each, the two launches where that was
seen: dinov2_fsdp on 2 FSDP ranks starting from the export of a sharded run (the init_from test),
and fashion_mnist on 2 DDP ranks with background checkpoints every step. Every launch must exit 0
with no abort in its output; it prints a line per launch and the totals, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common.after_training.export import export_run
from common.after_training.trained import open_run
from tests.conftest import run_recipe
from tests.trained_runs import TINY, cifar_data, dinov2_backbone, fashion_data

ABORT = "terminate called"


class Folders:
    """What ``tests.trained_runs``' shared data makers need of pytest's TempPathFactory."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def mktemp(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.base))
        return path


def launch(name: str, recipe: str, overrides: list[str]) -> bool:
    started = time.monotonic()
    result = run_recipe(recipe, overrides, nproc=2, timeout=600)
    output = result.stdout + result.stderr
    ok = result.returncode == 0 and ABORT not in output
    print(f"{name}: exit {result.returncode} in {time.monotonic() - started:.0f} s"
          + ("" if ok else f"  FAILED\n{output[-2000:]}"), flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="launches of each case (default 30)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stress-exit-") as temporary:
        base = args.keep or Path(temporary)
        base.mkdir(parents=True, exist_ok=True)
        folders = Folders(base)
        cifar, backbone, fashion = cifar_data(folders), dinov2_backbone(folders), fashion_data(folders)
        dinov2 = [f"data.root={cifar}", f"model.weights={backbone}", *TINY["dinov2_fsdp"]]
        source = base / "dinov2-source"
        if not launch("sharded source run", "dinov2_fsdp", [f"run_dir={source}", "trainer.epochs=2", *dinov2]):
            return 1
        export = export_run(open_run(source), base / "dinov2-export")
        cases = {
            "dinov2_fsdp init_from an export, 2 FSDP ranks": (
                "dinov2_fsdp", [*dinov2, f"init_from={export}", "optim.lr=0", "trainer.max_steps=1"]),
            "fashion_mnist, 2 DDP ranks, background checkpoints": (
                "fashion_mnist", [f"data.root={fashion}", *TINY["fashion_mnist"], "trainer.epochs=1",
                                  "checkpoint.async_save=true", "checkpoint.every_steps=1"]),
        }
        failures = {name: 0 for name in cases}
        for attempt in range(1, args.runs + 1):
            for name, (recipe, overrides) in cases.items():
                run_dir = base / f"run-{attempt}-{recipe}"
                failures[name] += not launch(f"{name} #{attempt}", recipe, [f"run_dir={run_dir}", *overrides])
        for name, failed in failures.items():
            print(f"{name}: {args.runs - failed} of {args.runs} launches exited 0 without an abort")
        return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
