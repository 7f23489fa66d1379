"""Pascal VOC 2012 segmentation and COCO 2017 (masks of the 20 VOC classes) for tv_segmentation.

    python -m data_prep.tv_segmentation [--dataset voc|coco] [--source PATH] [--out data/tv_segmentation]
    make prep-tv_segmentation [SOURCE=PATH]

Without ``--source`` it downloads (``--dataset voc`` by default, ``--dataset coco`` for the
presets) and checks the archives' md5. With ``--source`` it uses a local copy, and the
dataset is recognised from it:

* VOC: the original ``VOCtrainval_11-May-2012.tar`` (md5-checked), or a folder that is or
  holds ``VOCdevkit/VOC2012``; the segmentation subset is copied to ``<out>/voc``.
* COCO: a folder with ``annotations/instances_{train,val}2017.json`` and ``{train,val}2017/``;
  the image folders are linked (not copied) from ``<out>/coco``, the annotation files copied.

COCO's instance annotations are then converted once into VOC-class masks
(``<out>/coco/voc_masks``), as described in ``recipes/tv_segmentation/coco.py``. Every listed
image and mask is checked to exist and to have matching sizes.
"""

from __future__ import annotations

import argparse
import os
import tarfile
import zipfile
from pathlib import Path

from PIL import Image

from common.errors import UserError
from data_prep.files import copy_file, download, file_digest, run_cli
from recipes.tv_segmentation import coco

VOC_URL = "http://host.robots.ox.ac.uk/pascal/VOC/voc2012/VOCtrainval_11-May-2012.tar"
VOC_TAR = "VOCtrainval_11-May-2012.tar"
VOC_MD5 = "6cd6e144f989b92b3379bac3b3de84fd"
VOC_MEMBER_PREFIX = "VOCdevkit/VOC2012/"
VOC_FOLDERS = ("JPEGImages/", "SegmentationClass/", "ImageSets/Segmentation/")
COCO_ARCHIVES = {  # name: (url, md5)
    "annotations_trainval2017.zip": ("http://images.cocodataset.org/annotations/annotations_trainval2017.zip",
                                     "f4bbac642086de4f52a3fdda2de5fa2c"),
    "val2017.zip": ("http://images.cocodataset.org/zips/val2017.zip", "442b8da7639aecaf257c1dceb8ba8c80"),
    "train2017.zip": ("http://images.cocodataset.org/zips/train2017.zip", "cced6f7f71b7629ddf16f17bbcfab6b2"),
}


# ------------------------------------------------------------------------------------- VOC


def find_voc_folder(source: Path) -> Path | None:
    for candidate in (source, source / "VOC2012", source / "VOCdevkit" / "VOC2012"):
        if (candidate / "ImageSets" / "Segmentation").is_dir():
            return candidate
    return None


def voc_names(voc: Path) -> list[str]:
    names: list[str] = []
    for split in ("train", "val"):
        listing = voc / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            raise UserError(f"{listing} not found: not a VOC2012 segmentation folder")
        names += listing.read_text().split()
    return sorted(set(names))


def verify_voc(voc: Path) -> int:
    """Check that every listed image has a palette mask of its size; return the image count."""
    names = voc_names(voc)
    for name in names:
        image, mask = voc / "JPEGImages" / f"{name}.jpg", voc / "SegmentationClass" / f"{name}.png"
        try:
            with Image.open(image) as rgb, Image.open(mask) as labels:
                if labels.mode not in ("P", "L") or labels.size != rgb.size:
                    raise UserError(f"{mask} is a {labels.mode} image of {labels.size}; expected a palette "
                                    f"PNG of {rgb.size} like {image}")
        except OSError as error:
            raise UserError(f"cannot read {image} or {mask}: {error}") from error
    return len(names)


def copy_voc_folder(source: Path, out: Path) -> None:
    names = voc_names(source)
    for split in ("train", "val", "trainval"):
        listing = source / "ImageSets" / "Segmentation" / f"{split}.txt"
        if listing.is_file():
            copy_file(listing, out / "ImageSets" / "Segmentation" / listing.name)
    for name in names:
        for folder, suffix in (("JPEGImages", ".jpg"), ("SegmentationClass", ".png")):
            path = source / folder / f"{name}{suffix}"
            if not path.is_file():
                raise UserError(f"{path} is listed in {source}/ImageSets/Segmentation but missing")
            copy_file(path, out / folder / path.name)


def extract_voc_tar(tar_path: Path, out: Path) -> None:
    if file_digest(tar_path) != VOC_MD5:
        raise UserError(f"{tar_path} has md5 {file_digest(tar_path)}, not {VOC_TAR}'s {VOC_MD5}")
    with tarfile.open(tar_path) as tar:
        for member in tar:
            relative = member.name.removeprefix(VOC_MEMBER_PREFIX)
            if member.isfile() and member.name.startswith(VOC_MEMBER_PREFIX) and relative.startswith(VOC_FOLDERS):
                target = out / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(target.name + ".part")
                with tar.extractfile(member) as data, open(partial, "wb") as handle:  # type: ignore[union-attr]
                    handle.write(data.read())
                os.replace(partial, target)


def prepare_voc(out: Path, source: Path | None) -> str:
    voc = out / "voc"
    if source is None:
        tar_path = out / "downloads" / VOC_TAR
        if not (tar_path.is_file() and file_digest(tar_path) == VOC_MD5):
            download(VOC_URL, tar_path, md5=VOC_MD5)
        extract_voc_tar(tar_path, voc)
        origin = VOC_URL
    elif source.is_file():
        extract_voc_tar(source, voc)
        origin = str(source)
    else:
        folder = find_voc_folder(source)
        if folder is None:
            raise UserError(f"{source} holds neither VOC2012 (ImageSets/Segmentation) nor COCO (annotations/)")
        if folder.resolve() != voc.resolve():
            copy_voc_folder(folder, voc)
        origin = str(folder)
    return f"{voc} holds {verify_voc(voc)} verified VOC images and masks ({origin})"


# ------------------------------------------------------------------------------------ COCO


def is_coco_folder(source: Path) -> bool:
    return any(coco.annotation_file(source, split).is_file() for split in coco.SPLITS)


def link_coco_folder(source: Path, out: Path) -> list[str]:
    """Link the image folders and copy the annotation files of every split ``source`` has."""
    splits = [split for split in coco.SPLITS if coco.annotation_file(source, split).is_file()]
    for split in splits:
        images = coco.image_folder(source, split)
        if not images.is_dir():
            raise UserError(f"{images} not found next to {coco.annotation_file(source, split)}")
        link = coco.image_folder(out, split)
        if link.is_symlink():
            link.unlink()
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(images.resolve(), target_is_directory=True)
        copy_file(coco.annotation_file(source, split), coco.annotation_file(out, split))
    return splits


def download_coco(out: Path) -> None:
    downloads = out / "downloads"
    for name, (url, md5) in COCO_ARCHIVES.items():
        archive = downloads / name
        if not (archive.is_file() and file_digest(archive) == md5):
            download(url, archive, md5=md5)
        with zipfile.ZipFile(archive) as zipped:
            members = [m for m in zipped.namelist() if not m.startswith("annotations/") or "instances_" in m]
            zipped.extractall(out, members=members)


def prepare_coco(out: Path, source: Path | None, workers: int) -> str:
    root = out / "coco"
    if source is None:
        download_coco(root)
        splits, origin = list(coco.SPLITS), "images.cocodataset.org"
    elif source.resolve() == root.resolve():
        splits, origin = [s for s in coco.SPLITS if coco.annotation_file(root, s).is_file()], str(source)
    else:
        splits, origin = link_coco_folder(source, root), str(source)
    counts = {split: coco.convert_split(root, split, workers) for split in splits}
    kept = ", ".join(f"{count} {split}" for split, count in counts.items())
    return f"{root} holds VOC-class masks of {kept} images ({origin})"


def prepare(out: Path, dataset: str | None, source: Path | None, workers: int) -> str:
    """Make ``out`` hold the chosen dataset ready for training; return what was done."""
    if source is not None and not source.exists():
        raise UserError(f"source {source} does not exist")
    if dataset is None:
        dataset = "coco" if source is not None and source.is_dir() and is_coco_folder(source) else "voc"
    if dataset == "coco":
        return prepare_coco(out, source, workers)
    return prepare_voc(out, source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("voc", "coco"), help="default: recognised from --source, else voc")
    parser.add_argument("--source", type=Path, help="VOC tar or folder, or COCO folder, to use instead of downloading")
    parser.add_argument("--out", type=Path, default=Path("data/tv_segmentation"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes converting COCO masks")
    args = parser.parse_args()
    print(f"tv_segmentation: {prepare(args.out, args.dataset, args.source, args.workers)}")


if __name__ == "__main__":
    run_cli(main)
