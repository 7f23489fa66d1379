"""ImageNet-style ImageFolder data with timm's augmentation, fed to the device as uint8.

Layout: ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG`` (``make prep-timm_imagenet``
checks it and sorts a flat val folder). Each split's files are listed once, in ImageFolder's order
and with its labels, and the list saved as ``<root>/<split>.index.npz`` (``common/data/file_index.py``);
``data.format=shards`` reads the same list's files from shards instead (``common/data/shards.py``).
Training images go through ``common/data/images.py``: timm's
random-resized crop, flip and policy (RandAugment, AutoAugment, AugMix, or torchvision's
TrivialAugmentWide) per sample, in DataLoader workers or on the device (``data.decode``); timm's
colour jitter, normalisation and random erasing on the device, a batch at a time, as timm's
``--prefetcher`` does. Evaluation keeps timm's transform (resize, centre crop) and hands over
uint8 too. :class:`common.data.loaders.PerSampleSeeded` seeds each sample's draws from (seed, epoch,
index), so the augmentations of a resumed run are those of the uninterrupted run.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.data.random_erasing import RandomErasing
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
from torchvision.transforms import v2

from common.config import DataFormat
from common.data import file_index
from common.data.encoded import EncodedImage
from common.data.file_index import FileIndex, IndexedFiles, load_or_build
from common.data.images import INTERPOLATIONS, TrainAugmentation
from common.data.loaders import cpu_cores_per_rank
from common.data.shards import ShardImages, shard_folder
from common.errors import UserError
from recipes.timm_imagenet.config import DataConfig

PREP = "make prep-timm_imagenet"
SHARDS = f"{PREP} FORMAT=shards"


class UnreadableImage(UserError):
    """An image that does not decode. Stays one line when a DataLoader worker re-raises it
    (PyTorch prefixes the worker's traceback to the message)."""

    def __init__(self, message: str) -> None:
        last_line = message.strip().splitlines()[-1]
        super().__init__(last_line.split(f"{type(self).__name__}: ", 1)[-1])


def load_rgb(data: bytes | Any, name: str) -> Image.Image:
    """The encoded image ``data`` as an RGB PIL image (what ImageFolder's loader gives timm's transform)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as error:
        raise UnreadableImage(
            f"{name} is not a readable image ({error}); `make prep-timm_imagenet SOURCE=...` lists every such file"
        ) from error


def check_layout(root: str | Path, train_split: str, val_split: str) -> tuple[Path, Path]:
    """The train and val folders, after checking they exist and hold the same classes."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist: run `make prep-timm_imagenet SOURCE=<dir>` "
                        "or set data.root")
    folders = []
    for split in (train_split, val_split):
        folder = root / split
        if not folder.is_dir():
            raise UserError(f"{folder} does not exist: data.root must hold {train_split}/<class>/ and "
                            f"{val_split}/<class>/ folders (run `make prep-timm_imagenet SOURCE=<dir>`)")
        folders.append(folder)
    train_classes = {p.name for p in folders[0].iterdir() if p.is_dir()}
    val_classes = {p.name for p in folders[1].iterdir() if p.is_dir()}
    if not train_classes:
        raise UserError(f"{folders[0]} has no class folders")
    if val_classes != train_classes:
        missing, extra = sorted(train_classes - val_classes), sorted(val_classes - train_classes)
        raise UserError(f"{folders[1]} and {folders[0]} hold different classes (missing in val: {missing[:3]}, "
                        f"only in val: {extra[:3]}); a flat val folder is sorted by `make prep-timm_imagenet`")
    return folders[0], folders[1]


def class_names(cfg: DataConfig) -> list[str]:
    """The class folders (the model's outputs, in order): the val folder's listing, or what its shards say."""
    if cfg.format == DataFormat.shards:
        return open_shards(cfg, cfg.val_split).metadata["classes"]
    _, val_dir = check_layout(cfg.root, cfg.train_split, cfg.val_split)
    return sorted(path.name for path in val_dir.iterdir() if path.is_dir())


def list_split(root: Path, split: str, workers: int) -> FileIndex:
    """The files of ``<root>/<split>`` in ImageFolder's order, with its labels (torchvision's own
    ``find_classes`` and ``make_dataset``) and their headers read in ``workers`` processes, watching
    the folders they are in."""
    folder = root / split
    try:
        classes, class_to_idx = find_classes(str(folder))
        samples = make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS)
    except FileNotFoundError as error:
        raise UserError(f"{folder}: {error}") from error
    names = [os.path.relpath(path, root) for path, _ in samples]
    folders = {split, *(os.path.join(split, name) for name in classes), *(os.path.dirname(name) for name in names)}
    return file_index.build(root, names, [label for _, label in samples], sorted(folders), workers, str(folder),
                            classes=classes)


def index_file(root: Path, split: str) -> Path:
    return root / f"{split}{file_index.SUFFIX}"


def split_files(cfg: DataConfig, split: str, root: Path, run_dir: str, local_rank: int) -> tuple[IndexedFiles, Path]:
    """The split's files from its saved list (listed and saved first when there is none), and the list's path."""
    index, path = load_or_build(root, index_file(root, split), Path(run_dir),
                                lambda: list_split(root, split, cpu_cores_per_rank()), cfg.rebuild_index, local_rank,
                                f"`{PREP} SOURCE=...`")
    return IndexedFiles(root, index), path


def open_shards(cfg: DataConfig, split: str) -> ShardImages:
    return ShardImages(shard_folder(cfg.shards.root, split), cfg.shards.cache_dir, cfg.shards.cache_limit,
                       {"recipe": "timm_imagenet", "split": split}, SHARDS)


def split_images(cfg: DataConfig, split: str, run_dir: str, local_rank: int) -> tuple[Dataset, list[str], str]:
    """A split's images (as ``common.data.images.TrainImages`` takes them), its classes and where they
    come from: the tree's saved file list (``data.format=files``) or the split's shards."""
    if cfg.format == DataFormat.shards:
        shards = open_shards(cfg, split)
        return shards, shards.metadata["classes"], shards.describe()
    files, path = split_files(cfg, split, Path(cfg.root), run_dir, local_rank)
    return files, files.index.info["classes"], f"{len(files):,} images of {cfg.root}, listed in {path}"


class EvalImages(Dataset):
    """``(timm's evaluation transform of the image, label)`` for each image of a source."""

    def __init__(self, images: Dataset, transform: Any) -> None:
        self.images = images
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        image = self.images[index]
        return self.decoded(image), image.label

    def decoded(self, image: EncodedImage) -> torch.Tensor:
        """One image through the transform (``make predict`` calls this alone)."""
        return self.transform(load_rgb(image.data, image.name))


def resolve(model: torch.nn.Module, size: int, crop_pct: float, interpolation: str) -> dict[str, Any]:
    """timm's data config for ``model`` (input size, interpolation, mean/std, crop), with overrides."""
    return resolve_data_config(
        {
            "input_size": (3, size, size) if size else None,
            "crop_pct": crop_pct or None,
            "interpolation": interpolation or None,
        },
        model=model,
    )


def train_augmentation(cfg: DataConfig, data_config: dict[str, Any]) -> TrainAugmentation:
    """timm's training augmentation (``create_transform(is_training=True)``) in ``common.data.images``'
    terms. ``ta_wide`` is torchvision's TrivialAugmentWide, which the torchvision reference recipes
    use and timm's factory does not offer; like timm's policies it turns the colour jitter off."""
    size, interpolation = data_config["input_size"][-1], data_config["interpolation"]
    policy, policy_takes_pil = None, False
    if cfg.auto_augment == "ta_wide":
        policy = v2.TrivialAugmentWide(interpolation=INTERPOLATIONS.get(interpolation, INTERPOLATIONS["bilinear"]))
    elif cfg.auto_augment:
        try:  # timm builds its policies (PIL operations) with parameters that depend on the size and mean
            _, policy, _ = create_transform(data_config["input_size"], is_training=True, interpolation=interpolation,
                                            mean=data_config["mean"], std=data_config["std"], color_jitter=None,
                                            auto_augment=cfg.auto_augment, separate=True)
        except (AssertionError, KeyError, ValueError) as error:
            raise UserError(f"data.auto_augment={cfg.auto_augment!r} is not a timm policy ({error})") from error
        policy_takes_pil = True
    jitter_on = not cfg.auto_augment or "3a" in cfg.auto_augment  # timm keeps it only with its 3-augment
    return TrainAugmentation(size=size, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio), hflip=cfg.hflip,
                             interpolation=interpolation, colour_jitter=cfg.color_jitter if jitter_on else 0.0,
                             per_sample=policy, per_sample_takes_pil=policy_takes_pil)


def random_erasing(cfg: DataConfig, device: torch.device) -> RandomErasing | None:
    """timm's random erasing, on a normalised batch on the device (as timm's prefetcher does)."""
    if cfg.re_prob <= 0:
        return None
    return RandomErasing(cfg.re_prob, mode=cfg.re_mode, max_count=cfg.re_count, device=device)


def eval_transform(data_config: dict[str, Any]) -> Any:
    """timm's evaluation transform (resize, centre crop) ending in uint8, normalised on the device."""
    return create_transform(**data_config, is_training=False, use_prefetcher=True)


def describe_input(data_config: dict[str, Any], with_crop: bool) -> str:
    text = f"{data_config['input_size'][-1]}px {data_config['interpolation']}"
    return f"{text} (crop_pct {data_config['crop_pct']:.4g})" if with_crop else text
