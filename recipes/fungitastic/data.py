"""FungiTastic splits (CSV rows with images) and the published baseline's augmentation.

Images go through ``common/data/images.py``: the crop box is drawn from the JPEG's header, libjpeg
decodes at 1/2, 1/4 or 1/8 scale when the image is far larger than the model input (most of
the cost at 500p and above), and the baseline's augmentation (RandomResizedCrop scale 0.8-1,
RandAugment(2, 20)) runs on uint8, in DataLoader workers or on the device (``data.decode``).
Batches cross to the GPU as uint8, a quarter of the float size, and are normalised there.
Draws come from the global RNGs, which :class:`common.data.loaders.PerSampleSeeded` seeds from
(seed, epoch, index), so a resumed run sees exactly the crops of the uninterrupted one.

Each split's rows with a known species and an image are listed once, with their images' sizes and
the labels of every level, and the list saved in ``prepared_dir`` (``common/data/file_index.py``;
``make prep-fungitastic`` writes them): a start reads neither the CSV nor the image folder's listing.
``data.format=shards`` reads the same list's images from shards (``common/data/shards.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset
from torchvision.transforms import v2

from common.config import DataFormat
from common.data import file_index
from common.data.file_index import FileIndex, IndexedFiles, load_or_build
from common.data.images import TrainAugmentation
from common.data.loaders import cpu_cores_per_rank
from common.data.shards import ShardImages, shard_folder
from common.errors import UserError
from recipes.fungitastic import metadata
from recipes.fungitastic.config import DataConfig

PREP = "make prep-fungitastic"
SHARDS = f"{PREP} FORMAT=shards"


@dataclass
class SplitFiles:
    """One split's images (as ``common.data.images.TrainImages`` takes them) and what was left out."""

    name: str
    origin: str  # where the images come from, for the console
    images: Dataset
    unknown_species: int  # rows with species -1: left out of this closed-set split
    skipped_missing: int  # rows whose image is missing, left out with data.skip_missing=true


def split_csv(cfg: DataConfig, split: str) -> Path:
    if cfg.minimal:
        path = Path(cfg.prepared_dir) / metadata.subset_dir(cfg.subset) / metadata.minimal_csv_name(cfg.subset, split)
        if not path.is_file():
            raise UserError(f"{path} not found: run `MINI=1 make prep-fungitastic` or set data.minimal=false")
        return path
    return metadata.find_csv(cfg.root, cfg.subset, split)


def mappings_checksum(mappings: dict) -> str:
    """What the labels were encoded with: a list or shards made with other mappings are another dataset's."""
    return hashlib.sha256(json.dumps(mappings, sort_keys=True).encode()).hexdigest()


def list_split(cfg: DataConfig, split: str, mappings: dict, workers: int) -> FileIndex:
    """Read and check a split's CSV (known species only, every listed image present or skipped with
    ``skip_missing``) and list its images with their headers and the labels of every level."""
    csv = split_csv(cfg, split)
    frame, unknown = metadata.known_species(metadata.read_metadata(csv))
    folder = metadata.image_dir(cfg.root, cfg.subset, split, cfg.size)
    missing = metadata.missing_images(frame, folder)
    described = metadata.describe_missing(missing, len(frame), csv, folder) if missing else ""
    if missing and not cfg.skip_missing:
        raise UserError(described + ": restore them, or set data.skip_missing=true to leave those rows out")
    if missing:
        frame = frame[~frame["filename"].astype(str).isin(set(missing))].reset_index(drop=True)
    if frame.empty:
        raise UserError(f"{csv} has no rows with a known species and an image in {folder}")
    levels = list(mappings["levels"])
    labels = metadata.encode_labels(frame, mappings, levels)
    num_species = mappings["num_classes"]["species"]
    if labels[:, levels.index("species")].max() >= num_species:
        raise UserError(f"{csv}: species label {int(labels[:, 0].max())} is outside the {num_species} species of "
                        f"the training split ({mappings['source']})")
    root = Path(cfg.root)
    mappings_file = Path(cfg.prepared_dir) / metadata.subset_dir(cfg.subset) / metadata.MAPPINGS_FILE
    names = [os.path.relpath(folder / name, root) for name in frame["filename"].astype(str)]
    watched = [os.path.relpath(path, root) for path in (folder, csv, mappings_file)]
    return file_index.build(root, names, labels, watched, workers, f"{csv.name} at {cfg.size}", split=split,
                            levels=levels, mappings=mappings_checksum(mappings), unknown_species=unknown,
                            missing={"count": len(missing), "described": described})


def index_file(cfg: DataConfig, split: str) -> Path:
    """Where a split's list is saved: next to the prepared label spaces, named by its CSV and image size."""
    return Path(cfg.prepared_dir) / metadata.subset_dir(cfg.subset) / f"{split_csv(cfg, split).stem}-{cfg.size}" \
        f"{file_index.SUFFIX}"


def shard_set(cfg: DataConfig) -> str:
    """The name of the shard sets of this subset, size and choice of rows (one folder per split)."""
    return f"{cfg.subset.value}-{cfg.size}" + ("-minimal" if cfg.minimal else "")


def checked_missing(info: dict, cfg: DataConfig) -> int:
    """The rows a list or shard set left out because their image was missing, if data.skip_missing allows."""
    missing = info["missing"]
    if missing["count"] and not cfg.skip_missing:
        raise UserError(missing["described"] + " (left out when the list was made): restore them and list the files "
                        "again (data.rebuild_index=true), or set data.skip_missing=true to leave those rows out")
    return missing["count"]


def split_files(cfg: DataConfig, split: str, mappings: dict, run_dir: str, local_rank: int) -> SplitFiles:
    """A split's images, from its saved list (made and saved when there is none; the run directory
    holds it when ``prepared_dir`` cannot be written) or its shards."""
    if cfg.format == DataFormat.shards:
        images = ShardImages(shard_folder(cfg.shards.root, shard_set(cfg), split), cfg.shards.cache_dir,
                             cfg.shards.cache_limit, {"recipe": "fungitastic", "split": split,
                                                      "mappings": mappings_checksum(mappings)}, SHARDS)
        info, origin = images.metadata, images.describe()
    else:
        index, path = load_or_build(Path(cfg.root), index_file(cfg, split), Path(run_dir),
                                    lambda: list_split(cfg, split, mappings, cpu_cores_per_rank()), cfg.rebuild_index,
                                    local_rank, f"`{PREP}`")
        if index.info["mappings"] != mappings_checksum(mappings):
            raise UserError(f"{path} was listed with other label spaces than {metadata.MAPPINGS_FILE}: list the files "
                            f"again with data.rebuild_index=true (or `{PREP}`)")
        images, info = IndexedFiles(cfg.root, index), index.info
        origin = f"{len(index):,} images of {cfg.root}, listed in {path}"
    missing = checked_missing(info, cfg)
    images.label_columns = [info["levels"].index(level) for level in cfg.levels]
    return SplitFiles(split, origin, images, info["unknown_species"], missing)


def train_augmentation(cfg: DataConfig, size: int) -> TrainAugmentation:
    """RandomResizedCrop(size, scale (crop_scale_min, 1)), an optional flip, RandAugment."""
    policy = v2.RandAugment(num_ops=cfg.randaugment_ops, magnitude=cfg.randaugment_magnitude) \
        if cfg.randaugment_ops > 0 else None
    return TrainAugmentation(size=size, scale=(cfg.crop_scale_min, 1.0),
                             hflip=0.5 if cfg.horizontal_flip else 0.0, per_sample=policy)
