"""FungiTastic images for training: JPEG decoding and augmentation in DataLoader workers.

A worker decodes a JPEG (letting libjpeg decode at 1/2, 1/4 or 1/8 scale when the image is
far larger than the model input, which is most of the cost at 500p and above), applies the
published baseline's augmentation (RandomResizedCrop scale 0.8-1, RandAugment(2, 20)) on a
uint8 tensor and hands over uint8: batches cross to the GPU at a quarter of the float size
and are normalised there. Augmentation draws only from the global RNGs, which
:class:`common.data.PerSampleSeeded` seeds from (seed, epoch, index), so a resumed run sees
exactly the crops of the uninterrupted one whatever the number of workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.transforms import v2

from common.data import channel_constants
from common.errors import UserError
from recipes.fungitastic import metadata
from recipes.fungitastic.config import DataConfig


@dataclass
class Split:
    """One split's image paths and labels (``[N, len(ranks)]``, -1 where a rank is unknown)."""

    name: str
    csv: Path
    paths: list[str]
    labels: np.ndarray
    unknown_species: int  # rows with species -1: left out of this closed-set split
    skipped_missing: int  # rows whose image is missing, left out with data.skip_missing=true


def split_csv(cfg: DataConfig, split: str) -> Path:
    if cfg.minimal:
        path = Path(cfg.prepared_dir) / metadata.subset_dir(cfg.subset) / metadata.minimal_csv_name(cfg.subset, split)
        if not path.is_file():
            raise UserError(f"{path} not found: run `MINI=1 make prep-fungitastic` or set data.minimal=false")
        return path
    return metadata.find_csv(cfg.root, cfg.subset, split)


def load_split(cfg: DataConfig, split: str, mappings: dict) -> Split:
    """Read and check a split: known species only, every listed image present (or skipped)."""
    csv = split_csv(cfg, split)
    frame, unknown = metadata.known_species(metadata.read_metadata(csv))
    folder = metadata.image_dir(cfg.root, cfg.subset, split, cfg.size)
    missing = metadata.missing_images(frame, folder)
    if missing and not cfg.skip_missing:
        raise UserError(metadata.describe_missing(missing, len(frame), csv, folder)
                        + ": restore them, or set data.skip_missing=true to leave those rows out")
    if missing:
        frame = frame[~frame["filename"].astype(str).isin(set(missing))].reset_index(drop=True)
    if frame.empty:
        raise UserError(f"{csv} has no rows with a known species and an image in {folder}")
    labels = metadata.encode_labels(frame, mappings, list(cfg.ranks))
    num_species = mappings["num_classes"]["species"]
    if "species" in cfg.ranks:
        species = labels[:, list(cfg.ranks).index("species")]
        if species.max() >= num_species:
            raise UserError(f"{csv}: species label {int(species.max())} is outside the {num_species} species of "
                            f"the training split ({mappings['source']})")
    paths = [str(folder / name) for name in frame["filename"].astype(str)]
    return Split(split, csv, paths, labels, unknown, len(missing))


def decode(path: str, min_side: int = 0) -> torch.Tensor:
    """An RGB JPEG as uint8 ``[3, H, W]``; with ``min_side``, decoded at the smallest 1/2^k scale
    whose both sides stay at least ``min_side`` (libjpeg's DCT scaling, far cheaper than resizing)."""
    try:
        with Image.open(path) as image:
            if min_side:
                image.draft("RGB", (min_side, min_side))
            pixels = np.array(image.convert("RGB"))
    except (UnidentifiedImageError, OSError) as error:
        raise UserError(f"{path} is not a readable image ({error})") from error
    return torch.from_numpy(pixels).permute(2, 0, 1)


def train_transform(cfg: DataConfig) -> v2.Transform:
    steps: list[v2.Transform] = [
        v2.RandomResizedCrop(cfg.image_size, scale=(cfg.crop_scale_min, 1.0), antialias=True)
    ]
    if cfg.horizontal_flip:
        steps.append(v2.RandomHorizontalFlip())
    if cfg.randaugment_ops > 0:
        steps.append(v2.RandAugment(num_ops=cfg.randaugment_ops, magnitude=cfg.randaugment_magnitude))
    return v2.Compose(steps)


def eval_transform(cfg: DataConfig) -> v2.Transform:
    return v2.Resize((cfg.image_size, cfg.image_size), antialias=True)


class FungiImages(Dataset):
    """``(uint8 image [3, S, S], labels [len(ranks)])`` for each row of a split."""

    def __init__(self, split: Split, transform: v2.Transform, draft_min_side: int = 0) -> None:
        self.paths = split.paths
        self.labels = torch.from_numpy(split.labels)
        self.transform = transform
        self.draft_min_side = draft_min_side

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(decode(self.paths[index], self.draft_min_side)), self.labels[index]


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 ``[B, 3, H, W]`` to float normalised with the backbone's mean and std (on its device)."""
    mean_t = channel_constants(tuple(255 * value for value in mean), images.device)
    std_t = channel_constants(tuple(255 * value for value in std), images.device)
    return (images.float() - mean_t) / std_t
