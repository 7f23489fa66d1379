"""``make bench-peers``: the recipes side by side with the tools a researcher would run instead, on
the same GPU and the same data, each figure defined the same way for both.

    python -m benchmarks.peers --timm <pytorch-image-models checkout> [--tiny] [--out DIR]

1. **ResNet-50 on a folder of JPEGs**: timm_imagenet against timm's own ``train.py`` with the same
   settings (``SETTINGS``): a folder of photo-like JPEGs of ImageNet sizes, batch 256, bf16 autocast,
   channels_last, SGD, label smoothing 0.1, RandomResizedCrop + flip + colour jitter 0.4, an
   evaluation after each epoch. Both log every ``log_every`` steps; the harness reads when each log
   was written (the recipe's ``metrics.jsonl`` times, the arrival of each of timm's ``Train:`` lines)
   and derives for both:

   - steady images/s: the median over the log windows after the first epoch that hold no epoch's end
     (the evaluation and checkpoint of an epoch are in the whole run's time, not in a window);
   - seconds from process start to the end of the fifth step;
   - the whole run's wall time, process start to exit;
   - the data wait: the share of each window's step time spent waiting for the next batch (the
     recipe's ``train/data_wait_frac``; timm's ``Data`` time over its ``Time``), the largest of the
     steady windows and the largest of the first windows of the epochs after the first (the stall
     at an epoch boundary).

2. **ViT-L/14's training step** on a synthetic batch: ``benchmarks/dinov2_fsdp.py``'s step (eager,
   then each block compiled) against timm's ``benchmark.py --bench train`` (eager, ``--torchcompile``).

timm's scripts run as an outside reference from the checkout ``--timm`` names (as its own working
directory, so they import the timm beside them); nothing of them is in this project. With
``--tiny`` everything is small enough for a CPU and ``benchmarks/peer_stand_in.py``, a bare loop
that logs as timm's scripts do, stands in for them: what the test suite runs, so that the harness
cannot rot. Figures go to ``<out>/peers.json`` and, on a GPU, into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.results import Result

REPO = Path(__file__).resolve().parents[1]
STAND_IN = REPO / "benchmarks" / "peer_stand_in.py"
BENCHMARK = "side by side with timm (make bench-peers)"
FIFTH_STEP = 5
# timm's train.py: "Train: 1 [  5/32 ( 19%)]  Loss: ...  Time: 0.055s, 4650.9/s  (...)  LR: ...  Data: 0.001 (0.002)"
TIMM_LINE = re.compile(r"Train: (?P<epoch>\d+) \[\s*(?P<index>\d+)/(?P<per_epoch>\d+) .*?Time: (?P<time>[\d.]+)s,"
                       r".*?Data: (?P<data>[\d.]+) ")


@dataclass(frozen=True)
class Settings:
    """One side-by-side comparison's settings, the same for both runs."""

    model: str
    image_size: int
    batch: int
    images: int  # training images; a tenth as many validation images
    classes: int
    epochs: int
    log_every: int
    workers: int
    precision: str  # bf16 | fp32
    device: str  # cuda | cpu
    vit_model: str  # timm's name for the ViT of part 2
    vit_batch: int


GPU = Settings(model="resnet50", image_size=224, batch=256, images=8192, classes=128, epochs=3, log_every=5,
               workers=14, precision="bf16", device="cuda", vit_model="vit_large_patch14_dinov2", vit_batch=64)
TINY = Settings(model="test_resnet", image_size=32, batch=8, images=64, classes=4, epochs=2, log_every=2,
                workers=1, precision="fp32", device="cpu", vit_model="test_vit", vit_batch=4)


@dataclass
class Window:
    """The steps between two logs: ``first``..``last`` (global, from 1), their seconds and data wait."""

    first: int
    last: int
    seconds: float
    data_wait_frac: float
    holds_epoch_end: bool


@dataclass
class RunFigures:
    name: str
    steady_images_per_s: float
    seconds_to_fifth_step: float
    wall_s: float
    steady_data_wait_frac: float  # the largest over the steady windows
    epoch_start_data_wait_frac: float  # the largest over the first window of each epoch after the first
    windows: list[Window] = field(default_factory=list)


# ---- the data ---------------------------------------------------------------------------------------


def _write_class(job: tuple[Path, int, int, int]) -> None:
    from tools.tiny_data import photo

    folder, label, count, seed = job
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        width, height = int(rng.integers(400, 641)), int(rng.integers(300, 481))  # ImageNet's usual sizes
        photo(width, height, rng).save(folder / f"{label}_{i}.JPEG", quality=90)


def write_jpeg_folder(root: Path, settings: Settings) -> Path:
    """``train/`` and ``val/`` class folders of photo-like JPEGs (quality 90), written in parallel."""
    per_class = settings.images // settings.classes
    jobs = [(root / split / f"n{label:08d}", label, count, 1000 * split_index + label)
            for split_index, (split, count) in enumerate((("train", per_class), ("val", max(1, per_class // 10))))
            for label in range(settings.classes)]
    with multiprocessing.Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.map(_write_class, jobs)
    return root


# ---- the runs ---------------------------------------------------------------------------------------


def windows_of(logs: list[tuple[int, float, float]], steps_per_epoch: int) -> list[Window]:
    """Windows between consecutive logs ``(global step, time, data wait fraction)``."""
    return [Window(first=before[0] + 1, last=after[0], seconds=after[1] - before[1], data_wait_frac=after[2],
                   holds_epoch_end=(before[0] // steps_per_epoch) != ((after[0] - 1) // steps_per_epoch)
                   or after[0] % steps_per_epoch == 0)
            for before, after in zip(logs, logs[1:])]


def figures(name: str, windows: list[Window], settings: Settings, steps_per_epoch: int, seconds_to_fifth: float,
            wall_s: float) -> RunFigures:
    steady = [w for w in windows if w.first > steps_per_epoch and not w.holds_epoch_end]
    if not steady:
        raise RuntimeError(f"{name}: no log window after the first epoch without an epoch's end; train for longer")
    epoch_starts = [w for w in windows
                    if w.first > steps_per_epoch and (w.first - 1) % steps_per_epoch < settings.log_every]
    return RunFigures(
        name=name,
        steady_images_per_s=statistics.median(settings.batch * (w.last - w.first + 1) / w.seconds for w in steady),
        seconds_to_fifth_step=seconds_to_fifth, wall_s=wall_s,
        steady_data_wait_frac=max(w.data_wait_frac for w in steady),
        epoch_start_data_wait_frac=max((w.data_wait_frac for w in epoch_starts), default=float("nan")),
        windows=windows,
    )


def recipe_command(settings: Settings, data: Path, run_dir: Path, compile_model: bool) -> list[str]:
    return [
        sys.executable, "-m", "recipes.timm_imagenet.train", f"data.root={data}", f"run_dir={run_dir}",
        f"model.name={settings.model}", f"data.train_size={settings.image_size}",
        f"data.eval_size={settings.image_size}", f"trainer.batch_size={settings.batch}",
        f"trainer.precision={settings.precision}", "trainer.channels_last=true",
        f"trainer.num_workers={settings.workers}", f"trainer.epochs={settings.epochs}",
        f"trainer.log_every_steps={settings.log_every}", f"trainer.compile={str(compile_model).lower()}",
        f"device={settings.device}", "optim.opt=sgd", "optim.label_smoothing=0.1", "optim.warmup_epochs=0",
        "data.color_jitter=0.4", "logging.backend=none", "logging.progress_bar=false",
        "checkpoint.every_seconds=0",
    ]


def at_fifth_step(logs: list[tuple[int, float]], started: float, step_seconds: list[float]) -> float:
    """Seconds from ``started`` to the end of step 5: the first log at or past it, less the steps it
    ran past step 5 (each as long as ``step_seconds`` of that log says)."""
    index = next(i for i, (step, _) in enumerate(logs) if step >= FIFTH_STEP)
    step, logged_at = logs[index]
    return logged_at - (step - FIFTH_STEP) * step_seconds[index] - started


def run_recipe(settings: Settings, data: Path, workdir: Path, compile_model: bool = False) -> RunFigures:
    """timm_imagenet's run; its windows from the times of its ``metrics.jsonl`` records."""
    from common.records.loggers import METRICS_FILE, read_metrics_file

    run_dir = workdir / f"recipe{'-compiled' if compile_model else ''}"
    started = time.time()
    result = subprocess.run(recipe_command(settings, data, run_dir, compile_model), cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall_s = time.time() - started
    (workdir / f"{run_dir.name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"timm_imagenet exited {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
    total = re.search(r", (\d+) steps$", result.stdout, re.M)  # the recipe's first line: "..., N steps"
    steps_per_epoch = int(total[1]) // settings.epochs
    records = [record for record in read_metrics_file(run_dir / "tensorboard" / METRICS_FILE)
               if "train/data_wait_frac" in record]
    logs = [(0, started, 0.0)] + [(r["step"], r["time"], r["train/data_wait_frac"]) for r in records]
    windows = windows_of(logs, steps_per_epoch)
    fifth = at_fifth_step([(step, at) for step, at, _ in logs[1:]], started,
                          [w.seconds / (w.last - w.first + 1) for w in windows])
    return figures(f"timm_imagenet{' compiled' if compile_model else ''}", windows, settings, steps_per_epoch, fifth,
                   wall_s)


def timm_train_command(settings: Settings, data: Path, output: Path, compile_model: bool,
                       script: Path) -> list[str]:
    return [
        sys.executable, str(script), "--data-dir", str(data), "--train-split", "train", "--val-split", "val",
        "--model", settings.model, "--num-classes", str(settings.classes), "--img-size", str(settings.image_size),
        "-b", str(settings.batch), "-j", str(settings.workers), "--epochs", str(settings.epochs),
        "--log-interval", str(settings.log_every), "--opt", "sgd", "--smoothing", "0.1", "--color-jitter", "0.4",
        "--warmup-epochs", "0", "--channels-last", "--pin-mem", "--output", str(output), "--device", settings.device,
        *(["--amp", "--amp-dtype", "bfloat16"] if settings.precision == "bf16" else []),
        *(["--torchcompile"] if compile_model else []),
    ]


def run_timm_train(settings: Settings, data: Path, workdir: Path, script: Path, compile_model: bool = False) -> \
        RunFigures:
    """timm's ``train.py`` (or the stand-in); its windows from when each ``Train:`` line arrived."""
    name = ("timm train.py" if script.name == "train.py" else f"{script.name} (stand-in for timm train.py)") + \
        (" --torchcompile" if compile_model else "")
    output = workdir / f"timm{'-compiled' if compile_model else ''}"
    started = time.time()
    process = subprocess.Popen(timm_train_command(settings, data, output, compile_model, script), cwd=script.parent,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, logs, steps_per_epoch = [], [(0, started, 0.0, 0.0)], 0
    for line in process.stdout:
        lines.append(line)
        match = TIMM_LINE.search(line)
        if match:
            steps_per_epoch = int(match["per_epoch"])
            step = int(match["epoch"]) * steps_per_epoch + int(match["index"]) + 1
            logs.append((step, time.time(), float(match["data"]) / max(float(match["time"]), 1e-9),
                         float(match["time"])))
    process.wait()
    wall_s = time.time() - started
    (workdir / f"{output.name}.log").write_text("".join(lines))
    if process.returncode != 0 or not steps_per_epoch:
        raise RuntimeError(f"{name} exited {process.returncode}: {''.join(lines[-5:])}")
    fifth = at_fifth_step([(step, at) for step, at, _, _ in logs[1:]], started, [log[3] for log in logs[1:]])
    windows = windows_of([(step, at, wait) for step, at, wait, _ in logs], steps_per_epoch)
    return figures(name, windows, settings, steps_per_epoch, fifth, wall_s)


def vit_step(settings: Settings, timm_script: Path) -> list[Result]:
    """ViT-L/14's training step: benchmarks/dinov2_fsdp.py's against timm's benchmark.py."""
    import torch

    from benchmarks import dinov2_fsdp

    results = []
    device = torch.device(settings.device)
    if device.type == "cuda":
        ours = dinov2_fsdp.measure(dinov2_fsdp.FULL[-1], device, compiled_too=True, warmup=10, steps=30)
    else:
        ours = dinov2_fsdp.measure(dinov2_fsdp.QUICK[0], device, compiled_too=False, warmup=1, steps=3)
    results += [Result(BENCHMARK, f"ViT step, this project's: {r.setting}", r.value, r.unit, r.note)
                for r in ours if r.unit in ("images/s", "% MFU")]
    size = 224 if device.type == "cuda" else 32  # the model's own size too: timm's DINOv2 ViTs default to 518 px
    for compiled in (False, True) if device.type == "cuda" else (False,):
        command = [sys.executable, str(timm_script), "--bench", "train", "--model", settings.vit_model,
                   "--img-size", str(size), "--model-kwargs", f"img_size={size}", "--num-classes", "100",
                   "-b", str(settings.vit_batch),
                   "--opt", "adamw", "--device", settings.device,
                   *(["--amp", "--amp-dtype", "bfloat16"] if device.type == "cuda" else []),
                   *(["--torchcompile"] if compiled else [])]
        done = subprocess.run(command, cwd=timm_script.parent, capture_output=True, text=True)
        if done.returncode != 0 or "--result" not in done.stdout:
            raise RuntimeError(f"{timm_script.name} exited {done.returncode}: {done.stderr[-1000:]}")
        measured = json.loads(done.stdout.split("--result", 1)[1])
        measured = measured[0] if isinstance(measured, list) else measured
        results.append(Result(BENCHMARK, f"ViT step, timm {timm_script.name}: {settings.vit_model}, "
                                         f"compile {'on' if compiled else 'off'}",
                              float(measured["train_samples_per_sec"]), "images/s", settings.device))
    return results


def compare(settings: Settings, timm_dir: Path | None, workdir: Path) -> tuple[list[RunFigures], list[Result]]:
    """Every run of both parts; their figures, and the rows for ``RESULTS.md``."""
    train_script = timm_dir / "train.py" if timm_dir else STAND_IN
    bench_script = timm_dir / "benchmark.py" if timm_dir else STAND_IN
    data = write_jpeg_folder(workdir / "data", settings)
    pairs = (False, True) if settings.device == "cuda" else (False,)
    runs = []
    for compile_model in pairs:
        for run in (lambda: run_recipe(settings, data, workdir, compile_model),
                    lambda: run_timm_train(settings, data, workdir, train_script, compile_model)):
            runs.append(run())
            print(f"{runs[-1].name}: {runs[-1].steady_images_per_s:.1f} images/s steady, "
                  f"{runs[-1].seconds_to_fifth_step:.1f} s to step 5, {runs[-1].wall_s:.1f} s in all, data wait "
                  f"{runs[-1].steady_data_wait_frac:.3f} steady and {runs[-1].epoch_start_data_wait_frac:.3f} at an "
                  f"epoch's start", flush=True)
    setting = (f"{settings.model} {settings.image_size}px, batch {settings.batch}, {settings.precision}, "
               f"{settings.workers} workers, {settings.images} JPEGs, {settings.epochs} epochs")
    rows = []
    for run in runs:
        rows += [Result(BENCHMARK, f"{run.name}: steady images/s", run.steady_images_per_s, "images/s", setting),
                 Result(BENCHMARK, f"{run.name}: process start to the end of step 5", run.seconds_to_fifth_step,
                        "s", setting),
                 Result(BENCHMARK, f"{run.name}: whole run", run.wall_s, "s", setting),
                 Result(BENCHMARK, f"{run.name}: data wait, steady windows (largest)", run.steady_data_wait_frac,
                        "fraction", setting),
                 Result(BENCHMARK, f"{run.name}: data wait, first window of epochs 2+ (largest)",
                        run.epoch_start_data_wait_frac, "fraction", setting)]
    return runs, rows + vit_step(settings, bench_script)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timm", type=Path, help="a pytorch-image-models checkout (its train.py, benchmark.py)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU, with the stand-in for timm")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-peers")
    args = parser.parse_args(argv)
    if not args.tiny and (args.timm is None or not (args.timm / "train.py").is_file()):
        print("error: --timm (TIMM= for make bench-peers) must name a pytorch-image-models checkout with train.py "
              "and benchmark.py; --tiny runs the CPU stand-in instead", file=sys.stderr)
        return 2
    settings = TINY if args.tiny else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs, rows = compare(settings, None if args.tiny else args.timm.resolve(), args.out)
    (args.out / "peers.json").write_text(json.dumps({"settings": asdict(settings), "runs": [asdict(r) for r in runs],
                                                     "results": [asdict(r) for r in rows]}, indent=1))
    for row in rows:
        print(f"{row.setting}: {row.value:.4g} {row.unit}")
    if settings.device == "cuda":
        from benchmarks.run import record_section

        record_section("peers", rows, shlex.join(["python", "-m", "benchmarks.peers", *(argv or sys.argv[1:])]),
                       time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
