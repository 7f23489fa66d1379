"""Resume cost: wall time from process start to the end of the first training step.

Every figure comes from a real ``python -m recipes.<r>.train``-equivalent subprocess: the
recipe's ``main()`` runs unchanged, with a probe in the run contract's cadence check that prints
the time when the first step has finished and then ends the process. The parent takes the
time just before spawning it, so a figure covers interpreter start, imports, config checking,
data loading, model set-up and, when resuming, finding, verifying (sha256) and loading the
newest checkpoint and restoring it.

Cases: fashion_mnist (a small CNN) and cifar100_resnet50 (a ResNet-50 with SGD momentum, the
checkpoint size of an ImageNet ResNet-50), both on generated data in their real formats.
A fresh start (no checkpoint) is measured the same way, so "resume - fresh" is what resuming
adds. The checkpoint was just written, so it is read from the page cache; a job restarted on
another node reads it from storage, at that storage's speed.

With ``trainer.compile=true`` (fashion_mnist), every process gets an empty Inductor cache folder
of its own, as on a node that never ran the job: a cold resume starts from a checkpoint without a
compile cache (written by an eager run) and compiles; a warm one starts from the checkpoint of a
compiled run and takes the compiled code from it (``common/run/compile_cache.py``). Not in ``--quick``:
a cold compile alone takes about a minute on a CPU.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.results import Result
from common.checkpoint.manager import CheckpointManager
from common.run.compile_cache import ARCHIVE_FILE, CACHE_DIR_VARIABLE
from tools.tiny_data import write_cifar100_tarball, write_fashion_mnist

BENCHMARK = "resume cost (process start to end of first step)"
REPO = Path(__file__).resolve().parents[1]

# Runs a recipe as ``python -m`` does, with a probe at the end of every step: it prints the wall-clock time
# after the first step and ends the process after ``exit_after`` steps (without cleaning up).
PROBE = """
import os, sys, time
import torch
import common.run.training_run
from common.run.training_run import CheckpointCadence
import importlib.util, runpy

exit_after, steps_seen = int(sys.argv[1]), 0

class FirstStepProbe(CheckpointCadence):
    def after_step(self, step, nonfinite, micro_batch):
        global steps_seen
        steps_seen += 1
        if steps_seen == 1:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            print(f"FIRST_STEP_DONE {{time.time()!r}}", flush=True)
        if steps_seen >= exit_after:
            os._exit(0)
        return super().after_step(step, nonfinite, micro_batch)

common.run.training_run.CheckpointCadence = FirstStepProbe
sys.argv = [importlib.util.find_spec("recipes.{recipe}.train").origin, *sys.argv[2:]]
runpy.run_module("recipes.{recipe}.train", run_name="__main__")
"""


def seconds_to_first_step(recipe: str, overrides: list[str], exit_after: int,
                          env: dict[str, str] | None = None) -> float:
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(recipe=recipe), str(exit_after), *overrides], cwd=REPO,
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    for line in result.stdout.splitlines():
        if line.startswith("FIRST_STEP_DONE "):
            return float(line.split()[1]) - started
    raise RuntimeError(f"{recipe} never finished a step (exit {result.returncode}): {result.stderr.strip()[-800:]}")


def fashion_mnist_case(workdir: Path) -> tuple[str, list[str]]:
    data = write_fashion_mnist(workdir / "fashion_mnist", n_train=2048, n_test=256)
    return "fashion_mnist", [f"data.root={data}"]


def cifar100_case(workdir: Path) -> tuple[str, list[str]]:
    root = workdir / "cifar100"
    with tarfile.open(write_cifar100_tarball(workdir / "cifar-100-python.tar.gz", n_train=512, n_test=64)) as tar:
        tar.extractall(root, filter="data")
    return "cifar100_resnet50", [f"data.root={root}", "trainer.batch_size=8", "trainer.precision=fp32"]


def measure(case, repeats: int, workdir: Path) -> dict:
    recipe, overrides = case(workdir)
    common = [*overrides, "logging.backend=none", "logging.progress_bar=false", "checkpoint.every_steps=1",
              "checkpoint.every_seconds=0"]
    fresh, resumed = [], []
    for attempt in range(repeats):  # fresh and resumed runs alternate, so both see the same machine
        run_dir = f"run_dir={workdir / f'run-{attempt}'}"
        # The fresh run finishes a second step, so its checkpoint of step 1 is complete on disk.
        fresh.append(seconds_to_first_step(recipe, [*common, run_dir], exit_after=2))
        resumed.append(seconds_to_first_step(recipe, [*common, run_dir], exit_after=1))
    start = time.perf_counter()
    loaded = CheckpointManager(workdir / "run-0" / "checkpoints").load_latest()
    load_seconds = time.perf_counter() - start
    if loaded is None or loaded.step != 1:
        raise RuntimeError(f"{recipe}: expected a checkpoint of step 1 to resume from")
    size = sum(f.stat().st_size for f in loaded.path.rglob("*") if f.is_file()) / 2**20
    return {"recipe": recipe, "fresh": fresh, "resumed": resumed, "load": load_seconds, "megabytes": size}


def measure_compiled(repeats: int, workdir: Path) -> dict:
    """Resumed compiled fashion_mnist runs, cold and warm (see the module), each process with an
    empty Inductor cache of its own."""
    recipe, overrides = fashion_mnist_case(workdir)
    common = [*overrides, "logging.backend=none", "logging.progress_bar=false", "checkpoint.every_steps=1",
              "checkpoint.every_seconds=0"]
    caches = itertools.count()

    def empty_cache() -> dict[str, str]:
        return {CACHE_DIR_VARIABLE: str(workdir / f"inductor-{next(caches)}")}

    cold, warm = [], []
    for attempt in range(repeats):  # alternating, so both see the same machine
        eager_dir = f"run_dir={workdir / f'eager-{attempt}'}"
        compiled_dir = f"run_dir={workdir / f'compiled-{attempt}'}"
        seconds_to_first_step(recipe, [*common, eager_dir], exit_after=2, env=empty_cache())
        cold.append(seconds_to_first_step(recipe, [*common, eager_dir, "trainer.compile=true"], exit_after=1,
                                          env=empty_cache()))
        seconds_to_first_step(recipe, [*common, compiled_dir, "trainer.compile=true"], exit_after=2, env=empty_cache())
        warm.append(seconds_to_first_step(recipe, [*common, compiled_dir, "trainer.compile=true"], exit_after=1,
                                          env=empty_cache()))
    loaded = CheckpointManager(workdir / "compiled-0" / "checkpoints").load_latest()
    if loaded is None or ARCHIVE_FILE not in loaded.attachments:
        raise RuntimeError("the compiled run's checkpoint holds no compile cache")
    return {"cold": cold, "warm": warm, "megabytes": loaded.attachments[ARCHIVE_FILE]["size"] / 2**20}


def run(quick: bool) -> list[Result]:
    repeats = 2 if quick else 5
    results = []
    for case in (fashion_mnist_case, cifar100_case):
        with tempfile.TemporaryDirectory() as workdir:
            figures = measure(case, repeats, Path(workdir))
        recipe, fresh, resumed = figures["recipe"], min(figures["fresh"]), min(figures["resumed"])
        runs = f"best of {repeats} processes (a busy machine only adds time)"
        results += [
            Result(BENCHMARK, f"{recipe}: fresh start", fresh, "s", f"no checkpoint; {runs}"),
            Result(BENCHMARK, f"{recipe}: resume", resumed, "s",
                   f"checkpoint of {figures['megabytes']:.0f} MiB; {runs}"),
            Result(BENCHMARK, f"{recipe}: resume - fresh", resumed - fresh, "s", "what resuming adds"),
            Result(BENCHMARK, f"{recipe}: CheckpointManager.load_latest", figures["load"], "s",
                   "in this process: sha256 verification and torch.load, from the page cache"),
        ]
    if quick:  # a cold compile alone takes about a minute on a CPU
        return results
    compiled_repeats = 3
    with tempfile.TemporaryDirectory() as workdir:
        figures = measure_compiled(compiled_repeats, Path(workdir))
    cold, warm = min(figures["cold"]), min(figures["warm"])
    runs = f"best of {compiled_repeats} processes, each with an empty Inductor cache"
    results += [
        Result(BENCHMARK, "fashion_mnist, trainer.compile=true: resume, cold", cold, "s",
               f"checkpoint without a compile cache: compiles; {runs}"),
        Result(BENCHMARK, "fashion_mnist, trainer.compile=true: resume, warm", warm, "s",
               f"compiled code from the checkpoint's {figures['megabytes']:.1f} MiB compile_cache.tar; {runs}"),
        Result(BENCHMARK, "fashion_mnist, trainer.compile=true: cold / warm", cold / warm, "x", "goal >= 3"),
    ]
    return results
