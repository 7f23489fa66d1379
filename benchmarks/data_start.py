"""From process start to the first training batch on an ImageNet-sized tree: listed by torchvision's
``ImageFolder`` (what timm_imagenet did in every process at every start before issue 37), read
through its saved file list, and read from its shards.

The tree has ImageNet's 1,281,167 training files in 1,000 class folders (``--quick``: 64,000 in
100), each a hard link to one of a few small JPEGs: a listing meets every name, and the saved list
and the shards are made from the tree as ``make prep-timm_imagenet`` makes them (their one-off cost
is reported too). Each way runs in a fresh Python process, timed from just before it starts to its
first batch of 32 images (timm_imagenet's default augmentation, decoded in that process: the
DataLoader has no worker), three times, the median kept. The page cache is warm (the tree was just
made); a cold cache makes the listing slower, and a network filesystem, whose metadata server
answers every directory read, slower still, while the list and the shards read a few large files.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.results import Result
from tools.tiny_data import photo

BENCHMARK = "Process start to first batch, ImageNet-sized tree"
REPO = Path(__file__).resolve().parents[1]
IMAGENET_TRAIN, IMAGENET_CLASSES = 1_281_167, 1000
REPEATS = 3

# Every way imports the same modules (the recipe imports them all), so that they differ by their work alone.
CHILD = """
import sys, time
start = float(sys.argv[1]); root = sys.argv[2]; way = sys.argv[3]
from pathlib import Path
import litdata
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from common.config import Decode
from common.data.images import PathImages, TrainAugmentation, TrainImages, collate_train
from common.data.loaders import PerSampleSeeded
from common.data.sampler import ResumableDistributedSampler
from common.data.shards import ShardImages
from recipes.timm_imagenet.config import DataConfig
from recipes.timm_imagenet.data import split_files
imported = time.time()
if way == "ImageFolder":
    folder = ImageFolder(root + "/train")
    images = PathImages([path for path, _ in folder.samples], folder.targets)
elif way == "saved list":
    images, _ = split_files(DataConfig(root=root), "train", Path(root), root + "/run", 0)
else:
    images = ShardImages(root + "/shards/train", "", "1GB", {"recipe": "timm_imagenet"}, "")
dataset = PerSampleSeeded(TrainImages(images, TrainAugmentation(224, colour_jitter=0.4), Decode.cpu), seed=0)
sampler = ResumableDistributedSampler(len(images), seed=0, yield_epoch=True)
next(iter(DataLoader(dataset, batch_size=32, sampler=sampler, collate_fn=collate_train)))
print(time.time() - start, time.time() - imported)
"""


def make_tree(root: Path, files: int, classes: int) -> None:
    """``files`` hard links in ``classes`` folders of ``train/`` (and one per class in ``val/``), each
    folder's to a small JPEG of its own (a file takes at most 65,000 links on ext4)."""
    rng = np.random.default_rng(0)
    originals = []
    for c in range(classes):
        originals.append(root / f"original-{c}.JPEG")
        photo(48 + 8 * (c % 4), 64 - 8 * (c % 3), rng).save(originals[-1], quality=90)
    for split, count in (("train", files), ("val", classes)):
        for c in range(classes):
            (root / split / f"n{c:08d}").mkdir(parents=True)
        for i in tqdm(range(count), desc=f"linking {split}", unit="files", file=sys.stderr, mininterval=5):
            os.link(originals[i % classes], root / split / f"n{i % classes:08d}" / f"{i}.JPEG")


def first_batch_seconds(root: Path, way: str) -> tuple[float, float]:
    """Seconds from just before the process starts to its first batch, and from its imports' end."""
    start = time.time()
    result = subprocess.run([sys.executable, "-c", CHILD, str(start), str(root), way], cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    if result.returncode:
        raise RuntimeError(f"{way}: {result.stderr[-2000:]}")
    total, after_imports = result.stdout.strip().splitlines()[-1].split()
    return float(total), float(after_imports)


def run(quick: bool) -> list[Result]:
    from common.data.shards import write_shards
    from recipes.timm_imagenet.data import index_file, list_split

    files, classes = (64_000, 100) if quick else (IMAGENET_TRAIN, IMAGENET_CLASSES)
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    size = f"{files:,} files in {classes:,} folders"
    with tempfile.TemporaryDirectory(prefix="bench_data_start_", dir=os.environ.get("BENCH_DIR")) as scratch:
        root = Path(scratch)
        make_tree(root, files, classes)
        started = time.perf_counter()
        index = list_split(root, "train", workers)
        index.save(index_file(root, "train"))
        listed = time.perf_counter() - started
        started = time.perf_counter()
        write_shards(index, root, root / "shards" / "train", {"recipe": "timm_imagenet", "split": "train",
                                                              "classes": index.info["classes"]}, workers)
        sharded = time.perf_counter() - started
        shard_bytes = sum(path.stat().st_size for path in (root / "shards").rglob("*.bin"))
        results = [Result(BENCHMARK, f"once: listing {size} and reading their headers", listed, "s",
                          f"{workers} processes; what make prep-timm_imagenet (or the first start) pays"),
                   Result(BENCHMARK, "once: writing them as shards", sharded, "s",
                          f"{workers} litdata workers, {shard_bytes / 1e9:.2g} GB")]
        seconds = {way: [] for way in ("ImageFolder", "saved list", "shards")}
        for _ in range(REPEATS):  # interleaved, so that a busy spell hits every way alike
            for way, measured in seconds.items():
                measured.append(first_batch_seconds(root, way))
        baseline = statistics.median(after for _, after in seconds["ImageFolder"])
        for way, measured in seconds.items():
            total, after = (statistics.median(values) for values in zip(*measured))
            note = "what every process paid at every start" if way == "ImageFolder" else \
                f"{baseline / after:.1f}x less than ImageFolder's"
            results.append(Result(BENCHMARK, f"{way}, {size}", total, "s",
                                  f"median of {REPEATS}, fresh process, warm page cache; {after:.2f} s after the "
                                  f"imports (the same for every way), {note}"))
    return results


if __name__ == "__main__":
    for measured in run(quick=True):
        print(measured)
