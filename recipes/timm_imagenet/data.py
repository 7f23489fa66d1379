"""ImageNet-style ImageFolder data with timm's augmentation, fed to the device as uint8.

Layout: ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG`` (``make prep-timm_imagenet``
checks it and sorts a flat val folder). Training images go through ``common/data/images.py``: timm's
random-resized crop, flip and policy (RandAugment, AutoAugment, AugMix, or torchvision's
TrivialAugmentWide) per sample, in DataLoader workers or on the device (``data.decode``); timm's
colour jitter, normalisation and random erasing on the device, a batch at a time, as timm's
``--prefetcher`` does. Evaluation keeps timm's transform (resize, centre crop) and hands over
uint8 too. :class:`common.data.loaders.PerSampleSeeded` seeds each sample's draws from (seed, epoch,
index), so the augmentations of a resumed run are those of the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.data.random_erasing import RandomErasing
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from common.data.images import INTERPOLATIONS, TrainAugmentation
from common.errors import UserError
from recipes.timm_imagenet.config import DataConfig


class UnreadableImage(UserError):
    """An image that does not decode. Stays one line when a DataLoader worker re-raises it
    (PyTorch prefixes the worker's traceback to the message)."""

    def __init__(self, message: str) -> None:
        last_line = message.strip().splitlines()[-1]
        super().__init__(last_line.split(f"{type(self).__name__}: ", 1)[-1])


def load_rgb(path: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as error:
        raise UnreadableImage(
            f"{path} is not a readable image ({error}); `make prep-timm_imagenet SOURCE=...` lists every such file"
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
    """The class folders (the model's outputs, in order), read from the val folder's listing."""
    _, val_dir = check_layout(cfg.root, cfg.train_split, cfg.val_split)
    return sorted(path.name for path in val_dir.iterdir() if path.is_dir())


def image_folder(folder: Path, transform: Any) -> ImageFolder:
    try:
        return ImageFolder(str(folder), transform=transform, loader=load_rgb)
    except FileNotFoundError as error:
        raise UserError(f"{folder}: {error}") from error


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
