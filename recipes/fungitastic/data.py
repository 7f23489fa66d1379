"""FungiTastic splits (CSV rows with images) and the published baseline's augmentation.

Images go through ``common/data/images.py``: the crop box is drawn from the JPEG's header, libjpeg
decodes at 1/2, 1/4 or 1/8 scale when the image is far larger than the model input (most of
the cost at 500p and above), and the baseline's augmentation (RandomResizedCrop scale 0.8-1,
RandAugment(2, 20)) runs on uint8, in DataLoader workers or on the device (``data.decode``).
Batches cross to the GPU as uint8, a quarter of the float size, and are normalised there.
Draws come from the global RNGs, which :class:`common.data.loaders.PerSampleSeeded` seeds from
(seed, epoch, index), so a resumed run sees exactly the crops of the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torchvision.transforms import v2

from common.data.images import TrainAugmentation
from common.errors import UserError
from recipes.fungitastic import metadata
from recipes.fungitastic.config import DataConfig


@dataclass
class SplitFiles:
    """One split's image paths and labels (``[N, len(levels)]``, -1 where a level is unknown)."""

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


def split_files(cfg: DataConfig, split: str, mappings: dict) -> SplitFiles:
    """Read and check a split's CSV: known species only, every listed image present (or skipped)."""
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
    labels = metadata.encode_labels(frame, mappings, list(cfg.levels))
    num_species = mappings["num_classes"]["species"]
    if "species" in cfg.levels:
        species = labels[:, list(cfg.levels).index("species")]
        if species.max() >= num_species:
            raise UserError(f"{csv}: species label {int(species.max())} is outside the {num_species} species of "
                            f"the training split ({mappings['source']})")
    paths = [str(folder / name) for name in frame["filename"].astype(str)]
    return SplitFiles(split, csv, paths, labels, unknown, len(missing))


def train_augmentation(cfg: DataConfig) -> TrainAugmentation:
    """RandomResizedCrop(image_size, scale (crop_scale_min, 1)), an optional flip, RandAugment."""
    policy = v2.RandAugment(num_ops=cfg.randaugment_ops, magnitude=cfg.randaugment_magnitude) \
        if cfg.randaugment_ops > 0 else None
    return TrainAugmentation(size=cfg.image_size, scale=(cfg.crop_scale_min, 1.0),
                             hflip=0.5 if cfg.horizontal_flip else 0.0, per_sample=policy)
