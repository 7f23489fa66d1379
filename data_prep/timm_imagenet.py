"""ImageNet (or any ImageFolder dataset) for timm_imagenet: check the layout, sort a flat val folder.

    python -m data_prep.timm_imagenet --source DIR [--out data/imagenet] [--val-solution CSV] [--copy]

ImageNet needs an account to download (image-net.org or the Kaggle "ImageNet Object Localization
Challenge"), so ``--source`` is required. Accepted source layouts:

1. ``DIR/train/<wnid>/*.JPEG`` and ``DIR/val/<wnid>/*.JPEG`` (already sorted);
2. ``DIR/train/<wnid>/*.JPEG`` and a flat ``DIR/val/*.JPEG`` whose classes are in
   ``LOC_val_solution.csv`` (``--val-solution``, or found in ``DIR`` or its parent);
3. the Kaggle download: ``DIR/ILSVRC/Data/CLS-LOC/{train,val}`` with ``DIR/LOC_val_solution.csv``.

``--out`` becomes ``train/<wnid>`` and ``val/<wnid>`` folders of symlinks to the source (or copies
with ``--copy``). Checked before anything is written: train and val hold the same classes, no
class is empty, every val image listed in the CSV exists, and every image opens (PIL's verify,
in parallel; ``--skip-image-check`` skips this). Class and image counts are reported. Then each
split's file list is saved as ``OUT/<split>.index.npz`` (``common/data/file_index.py``), so that no
training process lists the tree again.

``--format shards`` also writes each split as litdata shards in ``OUT/shards/<split>``
(``--shards`` elsewhere; ``common/data/shards.py``), for ``data.format=shards``. Without
``--source`` it shards the tree ``--out`` already holds.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from PIL import Image

from common.data.file_index import FileIndex
from common.data.shards import write_shards
from common.errors import UserError
from data_prep.files import run_cli
from recipes.timm_imagenet.data import index_file, list_split

IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}
KAGGLE_IMAGES = Path("ILSVRC/Data/CLS-LOC")
SOLUTION_FILE = "LOC_val_solution.csv"
ILSVRC2012 = {"classes": 1000, "train": 1_281_167, "val": 50_000}


def is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES


def class_folders(split: Path) -> dict[str, list[Path]]:
    """``{wnid: sorted images}`` of a sorted split folder."""
    return {folder.name: sorted(p for p in folder.iterdir() if is_image(p))
            for folder in sorted(split.iterdir()) if folder.is_dir()}


def read_val_solution(csv_path: Path) -> dict[str, str]:
    """``{image id: wnid}`` from Kaggle's ``LOC_val_solution.csv`` (the first box's class)."""
    try:
        with open(csv_path, newline="") as handle:
            rows = list(csv.DictReader(handle))
        return {row["ImageId"]: row["PredictionString"].split()[0] for row in rows}
    except (KeyError, IndexError, csv.Error, UnicodeDecodeError) as error:
        raise UserError(f"{csv_path} is not a LOC_val_solution.csv (ImageId,PredictionString): {error}") from error


def find_solution(source: Path, given: Path | None) -> Path:
    candidates = [given] if given else [source / SOLUTION_FILE, source.parent / SOLUTION_FILE]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UserError(f"{source / 'val'} holds unsorted images and no {SOLUTION_FILE} was found; "
                    f"pass it with --val-solution")


def sort_flat_val(val: Path, solution: dict[str, str], classes: set[str]) -> dict[str, list[Path]]:
    images = {p.stem: p for p in val.iterdir() if is_image(p)}
    missing = sorted(set(solution) - set(images))
    if missing:
        raise UserError(f"{len(missing)} val images listed in {SOLUTION_FILE} are not in {val}, e.g. {missing[:3]}")
    unlisted = sorted(set(images) - set(solution))
    if unlisted:
        raise UserError(f"{len(unlisted)} images in {val} have no class in {SOLUTION_FILE}, e.g. {unlisted[:3]}")
    unknown = sorted(set(solution.values()) - classes)
    if unknown:
        raise UserError(f"{SOLUTION_FILE} names classes that train/ does not have, e.g. {unknown[:3]}")
    by_class: dict[str, list[Path]] = {wnid: [] for wnid in sorted(classes)}
    for image_id, wnid in sorted(solution.items()):
        by_class[wnid].append(images[image_id])
    return by_class


def unreadable(path: Path) -> str | None:
    """None if ``path`` opens as an image, else the reason."""
    try:
        with Image.open(path) as image:
            image.verify()
        return None
    except Exception as error:  # PIL raises many types for damaged files; all mean "unreadable"
        return f"{path} ({type(error).__name__}: {error})"


def check_images(paths: list[Path], workers: int) -> None:
    with ProcessPoolExecutor(max_workers=workers) as pool:
        problems = [reason for reason in pool.map(unreadable, paths, chunksize=256) if reason]
    if problems:
        listed = "; ".join(problems[:5])
        raise UserError(f"{len(problems)} unreadable image(s): {listed}. Remove or replace them and rerun")


def plan(source: Path, val_solution: Path | None) -> dict[str, dict[str, list[Path]]]:
    """``{split: {wnid: images}}`` of the source, after checking its layout."""
    if not source.is_dir():
        raise UserError(f"source folder {source} does not exist")
    images_root = source / KAGGLE_IMAGES if (source / KAGGLE_IMAGES).is_dir() else source
    train, val = images_root / "train", images_root / "val"
    for split in (train, val):
        if not split.is_dir():
            raise UserError(f"{split} does not exist: the source must hold train/ and val/ (see --help)")
    train_classes = class_folders(train)
    if not train_classes:
        raise UserError(f"{train} has no class folders")
    if any(is_image(p) for p in val.iterdir()):
        solution = read_val_solution(find_solution(source, val_solution))
        val_classes = sort_flat_val(val, solution, set(train_classes))
    else:
        val_classes = class_folders(val)
        if set(val_classes) != set(train_classes):
            different = sorted(set(val_classes) ^ set(train_classes))
            raise UserError(f"{train} and {val} hold different classes, e.g. {different[:3]}")
    for split, classes in (("train", train_classes), ("val", val_classes)):
        empty = [wnid for wnid, images in classes.items() if not images]
        if empty:
            raise UserError(f"{split} classes without images: {empty[:5]}")
    return {"train": train_classes, "val": val_classes}


def write_tree(layout: dict[str, dict[str, list[Path]]], out: Path, copy: bool) -> None:
    """Build ``out`` next to itself and swap it in, so a failed run leaves the old tree intact."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for split, classes in layout.items():
        for wnid, images in classes.items():
            folder = partial / split / wnid
            folder.mkdir(parents=True)
            for image in images:
                if copy:
                    shutil.copyfile(image, folder / image.name)
                else:
                    os.symlink(image.resolve(), folder / image.name)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def prepare(source: Path, out: Path, val_solution: Path | None = None, copy: bool = False,
            check: bool = True, workers: int = 8) -> dict[str, int]:
    """Check ``source``, write ``out`` and its file lists; return the class and image counts."""
    layout = plan(source, val_solution)
    if check:
        check_images([image for classes in layout.values() for images in classes.values() for image in images],
                     workers)
    write_tree(layout, out, copy)
    for split in layout:
        list_split(out, split, workers).save(index_file(out, split))
    return {"classes": len(layout["train"]),
            **{split: sum(len(images) for images in classes.values()) for split, classes in layout.items()}}


def shard(out: Path, shards: Path, workers: int) -> None:
    """Write each split of the tree ``out`` as shards in ``shards/<split>``, from its saved list
    (listed first when there is none)."""
    for split in ("train", "val"):
        if not (out / split).is_dir():
            raise UserError(f"{out / split} does not exist: prepare the tree first with --source")
        saved = index_file(out, split)
        index = FileIndex.load(saved) if saved.is_file() else list_split(out, split, workers)
        if not saved.is_file():
            index.save(saved)
        changed = index.changes(out)
        if changed:
            raise UserError(f"{out} changed since {saved} was saved: {index.describe_changes(out, changed)}; "
                            f"prepare it again with --source")
        chunks = write_shards(index, out, shards / split, {"recipe": "timm_imagenet", "split": split,
                                                           "classes": index.info["classes"]}, workers)
        print(f"timm_imagenet: {split}: {len(index):,} images in {chunks} shards in {shards / split}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="the ImageNet folder (see the layouts above); without it, "
                        "--format shards shards the tree --out holds")
    parser.add_argument("--out", type=Path, default=Path("data/imagenet"))
    parser.add_argument("--format", choices=("files", "shards"), default="files",
                        help="shards: also write each split as litdata shards (data.format=shards)")
    parser.add_argument("--shards", type=Path, help="where the shards go (default: OUT/shards)")
    parser.add_argument("--val-solution", type=Path, help=f"{SOLUTION_FILE} for a flat val folder")
    parser.add_argument("--copy", action="store_true", help="copy the images instead of linking to them")
    parser.add_argument("--skip-image-check", action="store_true", help="do not open every image")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args()
    if args.source is None and args.format == "files":
        raise UserError("--source is required (ImageNet needs an account to download: see --help)")
    if args.source is not None:
        counts = prepare(args.source, args.out, args.val_solution, args.copy, not args.skip_image_check,
                         args.workers)
        per_class = {wnid: len(os.listdir(args.out / "train" / wnid)) for wnid in os.listdir(args.out / "train")}
        fewest, most = min(per_class.values()), max(per_class.values())
        matches = " (the full ILSVRC-2012 set)" if counts == ILSVRC2012 else ""
        print(f"timm_imagenet: {args.out} holds {counts['classes']} classes, {counts['train']} train images "
              f"({fewest}-{most} per class), {counts['val']} val images{matches}")
    if args.format == "shards":
        shard(args.out, args.shards or args.out / "shards", args.workers)


if __name__ == "__main__":
    run_cli(main)
