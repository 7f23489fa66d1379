"""COCO instance annotations turned into semantic masks of the 20 Pascal VOC classes.

This follows torchvision's ``references/segmentation/coco_utils.py``: annotations of other
categories are dropped, the VOC ones are renumbered 1..20, instance masks are merged into one
class map, pixels where instances overlap become 255 (ignored), and training keeps only images
whose VOC annotations cover more than 1000 pixels. Unlike the reference, which decodes the
polygons again every time an image is loaded, the masks are written once as palette PNGs
(``make prep-tv_segmentation``) and training reads them like VOC masks.

Cache layout under the COCO root::

    train2017/ val2017/                     the COCO images
    annotations/instances_{train,val}2017.json
    voc_masks/{train,val}2017/<image>.png   one mask per kept image
    voc_masks/{train,val}2017.txt           the kept images, one file stem a line; written last

Polygons are rasterised with PIL (pycocotools is not a dependency), so pixels on an object's
boundary can differ from pycocotools' rasteriser; interiors, RLE regions and overlaps match.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from common.errors import UserError

# COCO category id of each VOC class, in VOC order (0 is background).
VOC_CATEGORY_IDS = [0, 5, 2, 16, 9, 44, 6, 3, 17, 62, 21, 67, 18, 19, 4, 1, 64, 20, 63, 7, 72]
MIN_TRAIN_AREA = 1000  # torchvision drops training images whose VOC objects cover fewer pixels
IGNORE_INDEX = 255
MASKS_DIR = "voc_masks"
SPLITS = ("train", "val")


def voc_palette() -> list[int]:
    """The Pascal VOC colour map (256 RGB entries), so converted masks look like VOC's."""
    palette = []
    for index in range(256):
        red = green = blue = 0
        value = index
        for bit in range(8):
            red |= ((value >> 0) & 1) << (7 - bit)
            green |= ((value >> 1) & 1) << (7 - bit)
            blue |= ((value >> 2) & 1) << (7 - bit)
            value >>= 3
        palette += [red, green, blue]
    return palette


def image_folder(root: Path, split: str) -> Path:
    return root / f"{split}2017"


def annotation_file(root: Path, split: str) -> Path:
    return root / "annotations" / f"instances_{split}2017.json"


def masks_folder(root: Path, split: str) -> Path:
    return root / MASKS_DIR / f"{split}2017"


def list_file(root: Path, split: str) -> Path:
    return root / MASKS_DIR / f"{split}2017.txt"


def decode_segmentation(segmentation: Any, height: int, width: int) -> np.ndarray:
    """One annotation's ``segmentation`` (polygons or uncompressed RLE) as a bool mask."""
    if isinstance(segmentation, list):
        canvas = Image.new("1", (width, height), 0)
        draw = ImageDraw.Draw(canvas)
        for polygon in segmentation:
            if len(polygon) >= 6:
                draw.polygon([(polygon[i], polygon[i + 1]) for i in range(0, len(polygon) - 1, 2)], fill=1)
        return np.array(canvas, dtype=bool)
    counts = segmentation.get("counts") if isinstance(segmentation, dict) else None
    if not isinstance(counts, list):
        raise UserError("only polygon and uncompressed RLE segmentations are supported (COCO's instances files)")
    if list(segmentation["size"]) != [height, width] or sum(counts) != height * width:
        raise UserError(f"an RLE segmentation of size {segmentation['size']} does not fit a {height}x{width} image")
    runs = np.repeat(np.arange(len(counts)) % 2, counts).astype(bool)  # alternating 0/1 runs, from 0
    return runs.reshape(width, height).T  # RLE runs down the columns


def semantic_mask(annotations: Iterable[dict[str, Any]], height: int, width: int) -> np.ndarray:
    """The VOC class map of one image: overlapping instances become 255 (ignored)."""
    target = np.zeros((height, width), dtype=np.uint8)
    covered = np.zeros((height, width), dtype=np.uint8)
    for annotation in annotations:
        mask = decode_segmentation(annotation["segmentation"], height, width)
        voc_class = VOC_CATEGORY_IDS.index(annotation["category_id"])
        target = np.maximum(target, mask.astype(np.uint8) * voc_class)
        covered += mask
    target[covered > 1] = IGNORE_INDEX
    return target


def _keep(annotations: list[dict[str, Any]], split: str) -> bool:
    return split != "train" or sum(a["area"] for a in annotations) > MIN_TRAIN_AREA


def _write_mask(job: tuple[Path, Path, int, int, list[dict[str, Any]]]) -> None:
    image_path, mask_path, height, width, annotations = job
    with Image.open(image_path) as image:
        if image.size != (width, height):
            raise UserError(f"{image_path} is {image.size[0]}x{image.size[1]}, its annotations say {width}x{height}")
    mask = Image.fromarray(semantic_mask(annotations, height, width))
    mask.putpalette(voc_palette())  # mode L becomes P with the values kept as palette indices
    partial = mask_path.with_name(mask_path.name + ".part")
    mask.save(partial, format="PNG")
    os.replace(partial, mask_path)


def convert_split(root: Path, split: str, workers: int = 1) -> int:
    """Write the masks of ``split`` (skipping ones already written) and its list; return how many."""
    annotations_path = annotation_file(root, split)
    if not annotations_path.is_file():
        raise UserError(f"{annotations_path} not found: the COCO root needs annotations/instances_{split}2017.json")
    try:
        instances = json.loads(annotations_path.read_text())
        images = instances["images"]
        by_image: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for annotation in instances["annotations"]:
            if annotation["category_id"] in VOC_CATEGORY_IDS:
                by_image[annotation["image_id"]].append(annotation)
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise UserError(f"{annotations_path} is not a COCO instances file ({error!r})") from error
    out = masks_folder(root, split)
    out.mkdir(parents=True, exist_ok=True)
    kept, jobs = [], []
    for image in sorted(images, key=lambda item: item["id"]):
        annotations = by_image.get(image["id"], [])
        if not _keep(annotations, split):
            continue
        image_path = image_folder(root, split) / image["file_name"]
        if not image_path.is_file():
            raise UserError(f"{image_path} is listed in {annotations_path} but missing")
        stem = Path(image["file_name"]).stem
        kept.append(stem)
        mask_path = out / f"{stem}.png"
        if not mask_path.is_file():
            jobs.append((image_path, mask_path, image["height"], image["width"], annotations))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_write_mask, jobs, chunksize=64))
    else:
        for job in jobs:
            _write_mask(job)
    partial = list_file(root, split).with_suffix(".txt.part")
    partial.write_text("".join(f"{stem}\n" for stem in kept))
    os.replace(partial, list_file(root, split))
    return len(kept)
