"""Tiny datasets in each dataset's real on-disk format, for the tests, the benchmarks and `make gpu-check`."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from pathlib import Path

import numpy as np

from recipes.tv_segmentation.coco import voc_palette  # the masks' colours; labels are the indices


def write_idx(path: Path, array: np.ndarray) -> Path:
    """An IDX file of unsigned bytes (the MNIST/Fashion-MNIST format)."""
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + array.tobytes())
    return path


def write_fashion_mnist(root: Path, n_train: int = 256, n_test: int = 64, seed: int = 0) -> Path:
    """Four IDX files whose classes are learnable (each class brightens its own band of rows)."""
    rng = np.random.default_rng(seed)
    for prefix, count in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        images = rng.integers(0, 60, size=(count, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 * label + 4 : 2 * label + 7, :] = 220
        write_idx(root / f"{prefix}-images-idx3-ubyte", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels)
    return root


def _cifar_pickle(count: int, rng: np.random.Generator) -> bytes:
    fine = rng.integers(0, 100, size=count)
    entry = {
        b"data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
        b"fine_labels": fine.tolist(),
        b"coarse_labels": (fine // 5).tolist(),
        b"filenames": [f"img_{i}.png".encode() for i in range(count)],
        b"batch_label": b"fake batch",
    }
    return pickle.dumps(entry, protocol=2)


def write_cifar100_tarball(path: Path, n_train: int = 48, n_test: int = 16, seed: int = 0) -> Path:
    """``cifar-100-python.tar.gz`` with train/test/meta pickles laid out like the original."""
    rng = np.random.default_rng(seed)
    members = {
        "cifar-100-python/train": _cifar_pickle(n_train, rng),
        "cifar-100-python/test": _cifar_pickle(n_test, rng),
        "cifar-100-python/meta": pickle.dumps(
            {
                b"fine_label_names": [f"class_{i}".encode() for i in range(100)],
                b"coarse_label_names": [f"super_{i}".encode() for i in range(20)],
            },
            protocol=2,
        ),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def _object_image(rng: np.random.Generator, height: int, width: int, boxes: list[tuple[int, int, int, int, int]]):
    """A noisy RGB image with one colour per class inside each box (y0, x0, y1, x1, class)."""
    from PIL import Image

    pixels = rng.integers(0, 50, size=(height, width, 3)).astype(np.uint8)
    for y0, x0, y1, x1, label in boxes:
        pixels[y0:y1, x0:x1] = (np.array(voc_palette()[3 * label : 3 * label + 3]) * 0.8 + 40).astype(np.uint8)
    return Image.fromarray(pixels)


def write_voc(root: Path, n_train: int = 16, n_val: int = 4, classes: tuple[int, ...] = (1, 7, 15),
              seed: int = 0) -> Path:
    """A Pascal VOC 2012 segmentation tree: JPEGImages/*.jpg, SegmentationClass/*.png (palette
    PNGs whose object outlines are 255, like VOC's) and ImageSets/Segmentation/{train,val}.txt.
    Images come in three sizes so evaluation sees varying shapes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(40, 56), (56, 40), (48, 48)]
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n_train), ("val", n_val)):
        names = []
        for i in range(count):
            name = f"2007_{split}_{i:04d}"
            height, width = sizes[i % len(sizes)]
            label = int(classes[i % len(classes)])
            y0, x0 = int(rng.integers(2, height // 3)), int(rng.integers(2, width // 3))
            y1, x1 = int(rng.integers(2 * height // 3, height - 2)), int(rng.integers(2 * width // 3, width - 2))
            _object_image(rng, height, width, [(y0, x0, y1, x1, label)]).save(
                root / "JPEGImages" / f"{name}.jpg", quality=95)
            mask = np.zeros((height, width), dtype=np.uint8)
            mask[y0 - 1 : y1 + 1, x0 - 1 : x1 + 1] = 255
            mask[y0:y1, x0:x1] = label
            png = Image.fromarray(mask)
            png.putpalette(voc_palette())
            png.save(root / "SegmentationClass" / f"{name}.png")
            names.append(name)
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{n}\n" for n in names))
    return root


def coco_rle(mask: np.ndarray) -> dict:
    """A bool mask as COCO's uncompressed RLE (column-major runs, starting with zeros)."""
    flat = mask.T.reshape(-1).astype(np.uint8)
    changes = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], changes, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat[0] == 1:
        counts = [0, *counts]
    return {"counts": counts, "size": list(mask.shape)}


def _box_polygon(y0: int, x0: int, y1: int, x1: int) -> list[list[float]]:
    return [[x0, y0, x1, y0, x1, y1, x0, y1]]


def write_coco(root: Path, n_extra_train: int = 8, seed: int = 0) -> Path:
    """A COCO 2017 tree: {train,val}2017/*.jpg and annotations/instances_{train,val}2017.json.

    Images 1-4 of train are the hand-made cases (48x40 each):
    1. person (COCO 1, VOC 15) box y4-30 x4-30 and car (COCO 3, VOC 7) box y10-36 x20-44,
       overlapping on y10-30 x20-30: overlap becomes 255;
    2. a crowd dog (COCO 18, VOC 12) as uncompressed RLE on y5-35 x5-40, and a traffic light
       (COCO 10, not a VOC class) polygon on y0-4 x0-48: ignored;
    3. only the traffic light: dropped from train (no VOC object);
    4. a 10x10 person: dropped from train (VOC objects cover <= 1000 pixels).
    Then ``n_extra_train`` images with one large box each. Val: one person image and one image
    without annotations (kept: val keeps every image).
    """
    rng = np.random.default_rng(seed)
    height, width = 40, 48
    categories = [{"id": i, "name": n, "supercategory": "x"}
                  for i, n in ((1, "person"), (3, "car"), (10, "traffic light"), (18, "dog"), (44, "bottle"))]
    voc_of = {1: 15, 3: 7, 10: 0, 18: 12, 44: 5}

    def box(image_id: int, ann_id: int, category: int, y0: int, x0: int, y1: int, x1: int, crowd: bool = False):
        mask = np.zeros((height, width), dtype=bool)
        mask[y0:y1, x0:x1] = True
        segmentation = coco_rle(mask) if crowd else _box_polygon(y0, x0, y1, x1)
        return {"id": ann_id, "image_id": image_id, "category_id": category, "segmentation": segmentation,
                "area": float((y1 - y0) * (x1 - x0)), "bbox": [x0, y0, x1 - x0, y1 - y0], "iscrowd": int(crowd)}

    splits = {
        "train": {
            1: [(1, 4, 4, 30, 30, False), (3, 10, 20, 36, 44, False)],
            2: [(18, 5, 5, 35, 40, True), (10, 0, 0, 4, 48, False)],
            3: [(10, 0, 0, 4, 48, False)],
            4: [(1, 10, 10, 20, 20, False)],
        },
        "val": {101: [(1, 6, 6, 34, 40, False)], 102: []},
    }
    for offset in range(n_extra_train):
        category = (1, 3, 18, 44)[offset % 4]
        y0, x0 = int(rng.integers(1, 8)), int(rng.integers(1, 8))
        splits["train"][5 + offset] = [(category, y0, x0, y0 + 30, x0 + 36, False)]
    ann_id = 1
    for split, images in splits.items():
        folder = root / f"{split}2017"
        folder.mkdir(parents=True, exist_ok=True)
        image_entries, annotations = [], []
        for image_id, boxes in images.items():
            file_name = f"{image_id:012d}.jpg"
            _object_image(rng, height, width, [(y0, x0, y1, x1, voc_of[c]) for c, y0, x0, y1, x1, _ in boxes]).save(
                folder / file_name, quality=95)
            image_entries.append({"id": image_id, "file_name": file_name, "height": height, "width": width})
            for category, y0, x0, y1, x1, crowd in boxes:
                annotations.append(box(image_id, ann_id, category, y0, x0, y1, x1, crowd))
                ann_id += 1
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        (root / "annotations" / f"instances_{split}2017.json").write_text(
            json.dumps({"images": image_entries, "annotations": annotations, "categories": categories}))
    return root


def write_image_folder(
    root: Path,
    n_classes: int = 3,
    train_per_class: int = 12,
    val_per_class: int = 4,
    size: int = 40,
    flat_val: bool = False,
    seed: int = 0,
) -> Path:
    """An ImageNet-style tree of JPEGs: ``train/<wnid>/<wnid>_<i>.JPEG`` and ``val/<wnid>/...``.

    Each of the first three classes has its own dominant colour, so a tiny model can learn them.
    With ``flat_val`` the val images lie directly in ``val/`` as ``ILSVRC2012_val_<n>.JPEG`` and
    their classes are in ``LOC_val_solution.csv`` next to ``train/`` (the Kaggle ImageNet layout).
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    wnids = [f"n{1440764 + 1000 * c:08d}" for c in range(n_classes)]
    solution_rows = ["ImageId,PredictionString"]
    val_number = 0
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label, wnid in enumerate(wnids):
            colour = np.zeros(3)
            colour[label % 3] = 200
            for i in range(count):
                pixels = np.clip(colour + rng.normal(0, 40, size=(size, size, 3)), 0, 255).astype(np.uint8)
                if split == "val" and flat_val:
                    val_number += 1
                    name = f"ILSVRC2012_val_{val_number:08d}"
                    path = root / "val" / f"{name}.JPEG"
                    solution_rows.append(f"{name},{wnid} 1 2 {size - 2} {size - 1} {wnid} 0 0 5 5")
                else:
                    path = root / split / wnid / f"{wnid}_{i}.JPEG"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(path, format="JPEG", quality=90)
    if flat_val:
        (root / "LOC_val_solution.csv").write_text("\n".join(solution_rows) + "\n")
    return root


# category_id, species, genus, family, order, class, phylum; the last one stands for an unknown species
FUNGI_TAXA = [
    (0, "Amanita muscaria", "Amanita", "Amanitaceae", "Agaricales", "Agaricomycetes", "Basidiomycota"),
    (1, "Amanita phalloides", "Amanita", "Amanitaceae", "Agaricales", "Agaricomycetes", "Basidiomycota"),
    (2, "Russula emetica", "Russula", "Russulaceae", "Russulales", "Agaricomycetes", "Basidiomycota"),
    (3, "Russula cyanoxantha", "Russula", "Russulaceae", "Russulales", "Agaricomycetes", "Basidiomycota"),
]
FUNGI_UNKNOWN = (-1, "Boletus edulis", "Boletus", "Boletaceae", "Boletales", "Agaricomycetes", "Basidiomycota")
FUNGI_COLOURS = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40), (120, 120, 120)]


def write_fungitastic(
    root: Path,
    mini: bool = True,
    closed_set_names: bool = False,
    label_column: str = "category_id",
    per_species: dict[str, int] | None = None,
    unknown_rows: dict[str, int] | None = None,
    size: str = "300p",
    image_shape: tuple[int, int] = (40, 48),
    seed: int = 0,
) -> Path:
    """A FungiTastic(-Mini) folder: ``metadata/<subset>/<subset>[-ClosedSet]-{Train,Val,Test}.csv``
    and JPEGs in ``<subset>/{train,val,test}/<size>/``; four species in two genera, each a
    learnable colour, plus ``unknown_rows`` rows of an unknown species (label -1) per split."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    subset = "FungiTastic-Mini" if mini else "FungiTastic"
    per_species = per_species or {"train": 6, "val": 2, "test": 2}
    unknown_rows = unknown_rows if unknown_rows is not None else {"val": 1, "test": 1}
    columns = ["observationID", "filename", label_column, "species", "genus", "family", "order", "class",
               "phylum", "kingdom", "scientificName", "year", "countryCode"]
    serial = 0
    for split, count in per_species.items():
        rows = []
        taxa = [taxon for taxon in FUNGI_TAXA for _ in range(count)] + [FUNGI_UNKNOWN] * unknown_rows.get(split, 0)
        for position in rng.permutation(len(taxa)):
            taxon = taxa[position]
            serial += 1
            filename = f"{serial}-{3032614300 + serial}.JPG"
            colour = np.array(FUNGI_COLOURS[taxon[0]], dtype=np.int16)
            pixels = colour + rng.integers(-30, 30, size=(*image_shape, 3))
            folder = root / subset / split / size
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / filename, quality=90)
            rows.append([serial, filename, taxon[0], *taxon[1:], "Fungi", f"{taxon[1]} L.", 2022, "DK"])
        kind = "-ClosedSet" if closed_set_names else ""
        name = f"{subset}{kind}-{split.capitalize()}.csv"
        csv = root / "metadata" / subset / name
        csv.parent.mkdir(parents=True, exist_ok=True)
        lines = [",".join(columns)] + [",".join(str(value) for value in row) for row in rows]
        csv.write_text("\n".join(lines) + "\n")
    return root


def photo(width: int, height: int, rng: np.random.Generator):
    """A photo-like RGB PIL image: smooth colour fields plus grain, so its JPEG has a realistic
    size and resampling it is not trivially exact."""
    from PIL import Image

    coarse = rng.integers(0, 256, size=(height // 24 + 1, width // 24 + 1, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    grain = rng.integers(-12, 13, size=smooth.shape, dtype=np.int16)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def write_jpeg_cases(folder: Path, width: int = 120, height: int = 90, seed: int = 0) -> dict[str, Path]:
    """The files a JPEG folder can hold, each named by its case: ``rgb`` (a YCbCr JPEG), ``large``
    (4x the size: decoded at a reduced scale), ``greyscale`` and ``cmyk`` JPEGs, ``png`` (a PNG
    named .JPEG, as one ImageNet file is) and ``truncated`` (the header intact, the data cut)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    cases = {name: folder / f"{name}.JPEG" for name in ("rgb", "large", "greyscale", "cmyk", "png", "truncated")}
    photo(width, height, rng).save(cases["rgb"], quality=90)
    photo(4 * width, 4 * height, rng).save(cases["large"], quality=90)
    photo(width, height, rng).convert("L").save(cases["greyscale"], quality=90)
    photo(width, height, rng).convert("CMYK").save(cases["cmyk"], quality=90)
    photo(width, height, rng).save(cases["png"], format="PNG")
    photo(width, height, rng).save(cases["truncated"], quality=90)
    data = cases["truncated"].read_bytes()
    cases["truncated"].write_bytes(data[: len(data) // 2])
    return cases
