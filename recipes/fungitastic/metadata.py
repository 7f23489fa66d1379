"""FungiTastic metadata with pandas: where the CSVs and images are, the label space of every
taxonomic level, class weights, and the checks `make prep-fungitastic` and the recipe share.

Layout of a FungiTastic download (both file-name forms of the releases are accepted)::

    {root}/metadata/FungiTastic/FungiTastic[-ClosedSet]-{Train,Val,Test}.csv
    {root}/metadata/FungiTastic-Mini/FungiTastic-Mini[-ClosedSet]-{Train,Val,Test}.csv
    {root}/{FungiTastic,FungiTastic-Mini}/{train,val,test}/{300p,500p,720p,fullsize}/{filename}

The species label is the ``category_id`` (or ``class_id``) column; ``-1`` marks an unknown
species (open-set rows). Every other level is indexed by its name in ``taxonomic_mappings.json``,
built from the training CSV.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from common.errors import UserError

SUBSET_DIRS = {"full": "FungiTastic", "mini": "FungiTastic-Mini"}
IMAGE_SIZES = ("300p", "500p", "720p", "fullsize")
SPLIT_NAMES = {"train": "Train", "val": "Val", "test": "Test"}
LEVEL_COLUMNS = ("species", "genus", "family", "order", "class", "phylum")
LABEL_COLUMNS = ("category_id", "class_id")
UNKNOWN = -1
MAPPINGS_FILE = "taxonomic_mappings.json"
CLASS_WEIGHTS_FILE = "class_weights.pt"
MISSING_SHOWN = 5  # how many missing file names an error message lists


def subset_dir(subset: str) -> str:
    if subset not in SUBSET_DIRS:
        raise UserError(f"data.subset must be one of {sorted(SUBSET_DIRS)}, not {subset!r}")
    return SUBSET_DIRS[subset]


def csv_names(subset: str, split: str) -> list[str]:
    """The names a split's CSV has had across releases, e.g. ``FungiTastic-Mini-Val.csv`` and
    ``FungiTastic-Mini-ClosedSet-Val.csv``."""
    prefix, split_name = subset_dir(subset), SPLIT_NAMES[split]
    return [f"{prefix}-{split_name}.csv", f"{prefix}-ClosedSet-{split_name}.csv"]


def minimal_csv_name(subset: str, split: str) -> str:
    return f"{subset_dir(subset)}-{SPLIT_NAMES[split]}-Minimal.csv"


def find_csv(root: str | Path, subset: str, split: str) -> Path:
    """The split's CSV under ``{root}/metadata/{subset folder}/``, in either naming form."""
    folder = Path(root) / "metadata" / subset_dir(subset)
    for name in csv_names(subset, split):
        if (folder / name).is_file():
            return folder / name
    raise UserError(f"no {' or '.join(csv_names(subset, split))} in {folder}: set data.root to the FungiTastic "
                    f"folder (with metadata/ and the image folders) or run `make prep-fungitastic SOURCE=<it>`")


def image_dir(root: str | Path, subset: str, split: str, size: str) -> Path:
    if size not in IMAGE_SIZES:
        raise UserError(f"the image size must be one of {', '.join(IMAGE_SIZES)}, not {size!r}")
    return Path(root) / subset_dir(subset) / split / size


def read_metadata(path: Path) -> pd.DataFrame:
    """The CSV with a ``label`` column (int, from ``category_id`` or ``class_id``) added."""
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not a readable CSV ({str(error).splitlines()[0]})") from error
    label_column = next((column for column in LABEL_COLUMNS if column in frame.columns), None)
    missing = [column for column in ("filename", "species") if column not in frame.columns]
    if label_column is None:
        missing.append(" or ".join(LABEL_COLUMNS))
    if missing:
        raise UserError(f"{path} has no {', '.join(missing)} column (is it a FungiTastic metadata CSV?)")
    labels = pd.to_numeric(frame[label_column], errors="coerce")
    if labels.isna().any():
        row = int(labels.isna().to_numpy().argmax())
        value = frame[label_column].iloc[row]
        raise UserError(f"{path}: {label_column} of row {row + 2} is not an integer ({value!r})")
    frame["label"] = labels.astype(np.int64)
    return frame


def known_species(frame: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The rows whose species is known, and how many rows with ``label == -1`` were left out."""
    known = frame["label"] != UNKNOWN
    return frame[known].reset_index(drop=True), int((~known).sum())


def missing_images(frame: pd.DataFrame, folder: Path) -> list[str]:
    """File names listed in ``frame`` that are not in ``folder`` (one directory listing, no stat per file)."""
    try:
        present = set(os.listdir(folder))
    except FileNotFoundError:
        present = set()
    return [name for name in frame["filename"].astype(str) if name not in present]


def describe_missing(missing: list[str], listed: int, csv: Path, folder: Path) -> str:
    shown = ", ".join(missing[:MISSING_SHOWN]) + (", ..." if len(missing) > MISSING_SHOWN else "")
    return f"{len(missing)} of {listed} images listed in {csv.name} are missing from {folder} ({shown})"


# ---------------------------------------------------------------------------- label spaces


def build_mappings(train: pd.DataFrame, source: str, levels: tuple[str, ...] = LEVEL_COLUMNS) -> dict[str, Any]:
    """Name -> index for every level, and each species' parents, from the training metadata.

    Species keep their ``category_id`` as index (the label space of the published models);
    the other levels are numbered in sorted name order. A species listed under two parents of
    one level (a data error) keeps its most frequent parent; the count is recorded.
    """
    missing = [level for level in levels if level not in train.columns]
    if missing:
        raise UserError(f"{source} has no {', '.join(missing)} column")
    train, _ = known_species(train)
    if train.empty:
        raise UserError(f"{source} has no rows with a known species")
    species_ids = train.groupby("species")["label"].agg(lambda ids: ids.mode().iloc[0])
    if species_ids.duplicated().any():
        clash = int(species_ids[species_ids.duplicated()].iloc[0])
        names = sorted(species_ids[species_ids == clash].index)
        raise UserError(f"{source}: species {names} share the label {clash}")
    species_index = {str(name): int(label) for name, label in species_ids.sort_values().items()}
    name_to_index: dict[str, dict[str, int]] = {"species": species_index}
    for level in levels:
        if level != "species":
            names = sorted(str(name) for name in train[level].dropna().unique())
            name_to_index[level] = {name: index for index, name in enumerate(names)}
    parents: dict[str, dict[str, str]] = {}
    conflicts = 0
    for species, rows in train.groupby("species"):
        parents[str(species)] = {}
        for level in levels:
            if level == "species":
                continue
            values = rows[level].dropna().astype(str)
            if values.empty:
                continue
            conflicts += int(values.nunique() > 1)
            parents[str(species)][level] = values.mode().iloc[0]
    num_classes = {level: len(name_to_index[level]) for level in levels}
    num_classes["species"] = int(species_ids.max()) + 1
    return {
        "source": source,
        "levels": list(levels),
        "num_classes": num_classes,
        "name_to_index": name_to_index,
        "species_parents": parents,
        "parent_conflicts": conflicts,
    }


def load_mappings(prepared_dir: str | Path, subset: str) -> dict[str, Any]:
    path = Path(prepared_dir) / subset_dir(subset) / MAPPINGS_FILE
    if not path.is_file():
        raise UserError(f"{path} not found: run `make prep-fungitastic` (it builds the label spaces from the "
                        f"training CSV) or set data.prepared_dir")
    try:
        mappings = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not valid JSON ({error}): rerun `make prep-fungitastic`") from error
    if "levels" not in mappings:
        raise UserError(f"{path} was written by an older `make prep-fungitastic` (it has no \"levels\"): rerun it")
    return mappings


def encode_labels(frame: pd.DataFrame, mappings: dict[str, Any], levels: list[str]) -> np.ndarray:
    """``[N, len(levels)]`` int64 class indices; a name the training split never had is -1 (ignored)."""
    columns = []
    for level in levels:
        if level == "species":
            columns.append(frame["label"].to_numpy(dtype=np.int64))
        elif level in frame.columns:
            index = mappings["name_to_index"][level]
            columns.append(frame[level].map(lambda name: index.get(str(name), UNKNOWN)).to_numpy(dtype=np.int64))
        else:
            columns.append(np.full(len(frame), UNKNOWN, dtype=np.int64))
    return np.stack(columns, axis=1)


def parent_table(mappings: dict[str, Any], level: str) -> torch.Tensor:
    """``[num_species]`` index of each species' parent at ``level`` (-1 where unknown)."""
    table = torch.full((mappings["num_classes"]["species"],), UNKNOWN, dtype=torch.long)
    level_index = mappings["name_to_index"][level]
    for species, index in mappings["name_to_index"]["species"].items():
        parent = mappings["species_parents"].get(species, {}).get(level)
        if parent is not None and parent in level_index:
            table[index] = level_index[parent]
    return table


def class_weights(train: pd.DataFrame, mappings: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Per level, ``n_samples / (n_classes * count[c])`` (scikit-learn's "balanced"); a class with
    no training sample gets weight 0."""
    train, _ = known_species(train)
    weights = {}
    for level in mappings["levels"]:
        labels = encode_labels(train, mappings, [level])[:, 0]
        labels = labels[labels != UNKNOWN]
        classes = mappings["num_classes"][level]
        counts = np.bincount(labels, minlength=classes).astype(np.float64)
        present = counts > 0
        weight = np.zeros(classes, dtype=np.float64)
        weight[present] = len(labels) / (present.sum() * counts[present])
        weights[level] = torch.from_numpy(weight).float()
    return weights


def load_class_weights(prepared_dir: str | Path, subset: str) -> dict[str, torch.Tensor]:
    path = Path(prepared_dir) / subset_dir(subset) / CLASS_WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"{path} not found: run `make prep-fungitastic` or set loss.class_weighted_levels=[]")
    return torch.load(path, weights_only=True)


def minimal_subset(frame: pd.DataFrame, per_species: int) -> pd.DataFrame:
    """The first ``per_species`` rows of every label (in file order): a quick-run subset."""
    return frame.groupby("label", sort=False).head(per_species).drop(columns="label")
