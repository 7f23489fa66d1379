"""timm_imagenet end to end: training images/s of the real recipe on an ImageFolder of JPEGs.

Everything a real run does is in the figure: JPEG decoding and timm's augmentation in DataLoader
workers, host-to-device copies, forward/backward/step, checkpoint cadence. The recipe logs
``train/images_per_s`` per log interval to TensorBoard; the first interval (start-up, worker
spawn, cuDNN/compile warm-up) is dropped and the median of the others is reported.

On CPU (``quick``) it is a tiny model on 48 px images; with a GPU it is ResNet-50 at 224 px in bf16
with channels_last on ImageNet-sized (500x375) JPEGs.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.results import Result

REPO = Path(__file__).resolve().parents[1]


def write_jpegs(root: Path, classes: int, per_class: int, width: int, height: int) -> None:
    """train/ and val/ class folders of noisy JPEGs (content does not matter for throughput)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", max(1, per_class // 8))):
        for label in range(classes):
            folder = root / split / f"n{label:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.JPEG", quality=85)


def steady_images_per_s(log_dir: Path) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    values = [event.value for event in events.Scalars("train/images_per_s")]
    if len(values) < 2:
        raise RuntimeError(f"only {len(values)} throughput log(s) in {log_dir}; train for longer")
    return statistics.median(values[1:])


def run(quick: bool) -> list[Result]:
    on_gpu = torch.cuda.is_available()
    workers = min(16, os.cpu_count() or 1) if on_gpu else 2
    if on_gpu:
        setting = dict(model="resnet50", size=224, batch=256, precision="bf16", steps=30, log_every=5)
        data = dict(classes=4, per_class=2048, width=500, height=375)  # 32 steps in the first epoch
    else:
        steps = 16 if quick else 40  # within the first epoch, so no evaluation falls inside a log interval
        setting = dict(model="test_resnet", size=48, batch=16, precision="fp32", steps=steps, log_every=steps // 4)
        data = dict(classes=3, per_class=steps * 16 // 3 + 16, width=64, height=64)
    with tempfile.TemporaryDirectory(prefix="bench_timm_imagenet_") as scratch:
        root = Path(scratch)
        write_jpegs(root / "data", **data)
        command = [
            sys.executable, "-m", "recipes.timm_imagenet.train",
            f"data.root={root / 'data'}", f"run_dir={root / 'run'}", f"model.name={setting['model']}",
            f"data.train_size={setting['size']}", f"data.eval_size={setting['size']}",
            f"trainer.batch_size={setting['batch']}", f"trainer.precision={setting['precision']}",
            f"trainer.max_steps={setting['steps']}", f"trainer.log_every_steps={setting['log_every']}",
            f"trainer.num_workers={workers}", "trainer.channels_last=true", "trainer.epochs=1000",
            "logging.backend=tensorboard", "logging.progress_bar=false", "checkpoint.every_seconds=0",
        ]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"timm_imagenet run failed ({result.returncode}):\n{result.stderr[-2000:]}")
        images_per_s = steady_images_per_s(root / "run" / "tensorboard")
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    return [Result(
        benchmark="timm_imagenet end-to-end training",
        setting=f"{setting['model']} {setting['size']}px {setting['precision']} channels_last, batch "
                f"{setting['batch']}, {workers} workers, {device}",
        value=round(images_per_s, 1),
        unit="images/s",
        note="ImageFolder JPEGs decoded and augmented in DataLoader workers; median after the first log interval",
    )]


if __name__ == "__main__":
    for measured in run(quick="--full" not in sys.argv):
        print(measured)
