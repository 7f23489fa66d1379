"""FungiTastic: label spaces, class weights and an image check from a local copy of the dataset.

    python -m data_prep.fungitastic [--source ROOT] [--out data/fungitastic] [--size 300p]
                                    [--mini] [--per-species 4] [--skip-missing]
                                    [--weights DIR_OR_FILE] [config overrides, e.g. +experiment=...]

``ROOT`` is a FungiTastic download (``metadata/`` and ``FungiTastic/``, ``FungiTastic-Mini/``
image folders, as BohemianVRA's ``dataset/download.py`` writes them). Without ``--source``,
``--out`` itself must hold one. For each subset whose training CSV is present this writes, into
``OUT/prepared/<subset>/``:

* ``taxonomic_mappings.json``: name -> index per level (species keep their ``category_id``),
  each species' parents, the class count per level;
* ``class_weights.pt``: per level, scikit-learn's "balanced" weights from the training split;
* with ``--mini`` (or ``MINI=1`` in the environment): ``<CSV name>-Minimal.csv`` per split,
  the first ``--per-species`` rows of every species whose image is present.

It then checks that every image the CSVs list exists at ``--size``; missing images are an error
(the count and the first few names) unless ``--skip-missing`` is given, which only reports them
(train with ``data.skip_missing=true`` then). The images are never copied: ``OUT`` gets symbolic
links to the source folders. Each split's rows are then listed with their images' sizes and saved
next to the mappings (``<CSV name>-<size>.index.npz``, for the minimal CSVs too), so that no
training process reads the CSVs or lists the image folders again (``common/data/file_index.py``).
``--format shards`` also writes each of those lists' images as litdata shards in
``OUT/shards/<subset>-<size>[-minimal]/<split>`` (``--shards`` elsewhere), for ``data.format=shards``.

Last, it stores the pretrained weights that the config (with the given overrides) reads from
``model.pretrained`` under ``data/weights/``: from the hub, or from ``--weights`` (a timm folder
or a weights file), so that runs never download them at start-up (see ``data_prep/weights.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from common.data.shards import write_shards
from common.errors import UserError
from data_prep import weights
from data_prep.files import run_cli, write_bytes_atomic
from recipes.fungitastic import metadata
from recipes.fungitastic.config import DataConfig, Subset
from recipes.fungitastic.data import index_file, list_split, shard_set, split_csv

HOW_TO_GET = ("download FungiTastic with https://github.com/BohemianVRA/FungiTastic dataset/download.py "
              "(e.g. --metadata --images --subset m --size 300) and run `make prep-fungitastic SOURCE=<its folder>`")
LINKED = ("metadata", *metadata.SUBSET_DIRS.values())


def link_source(source: Path, out: Path) -> None:
    """Make ``out/<entry>`` point at ``source/<entry>`` for the dataset's folders."""
    if not source.is_dir():
        raise UserError(f"source folder {source} does not exist")
    out.mkdir(parents=True, exist_ok=True)
    if source.resolve() == out.resolve():
        return
    for name in LINKED:
        target, link = (source / name).resolve(), out / name
        if not target.is_dir():
            continue
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            raise UserError(f"{link} exists and is not a link; move it away or use --out elsewhere")
        link.symlink_to(target, target_is_directory=True)


def prepare_subset(root: Path, prepared: Path, subset: str, size: str, mini: bool, per_species: int) -> list[str]:
    """Write the subset's mappings, weights (and minimal CSVs); return a line per missing-image problem."""
    folder = prepared / metadata.subset_dir(subset)
    folder.mkdir(parents=True, exist_ok=True)
    train_csv = metadata.find_csv(root, subset, "train")
    train = metadata.read_metadata(train_csv)
    mappings = metadata.build_mappings(train, str(train_csv))
    write_bytes_atomic(folder / metadata.MAPPINGS_FILE, (json.dumps(mappings, indent=1) + "\n").encode())
    weights_file = folder / metadata.CLASS_WEIGHTS_FILE
    torch.save(metadata.class_weights(train, mappings), weights_file)
    counts = ", ".join(f"{level} {count}" for level, count in mappings["num_classes"].items())
    print(f"{metadata.subset_dir(subset)}: classes per level: {counts}")
    if mappings["parent_conflicts"]:
        print(f"  note: {mappings['parent_conflicts']} species/level pairs list more than one parent; "
              f"the most frequent is kept")
    problems = []
    for split in metadata.SPLIT_NAMES:
        try:
            csv = metadata.find_csv(root, subset, split)
        except UserError:
            print(f"  {split}: no CSV, skipped")
            continue
        frame = metadata.read_metadata(csv)
        images = metadata.image_dir(root, subset, split, size)
        missing = metadata.missing_images(frame, images)
        unknown = int((frame["label"] == metadata.UNKNOWN).sum())
        print(f"  {split}: {len(frame)} rows in {csv.name}, {len(frame) - len(missing)} images present in {images}"
              + (f", {unknown} with unknown species (-1)" if unknown else ""))
        if missing:
            problems.append(metadata.describe_missing(missing, len(frame), csv, images))
        if mini:
            present = frame[~frame["filename"].astype(str).isin(set(missing))]
            subset_rows = metadata.minimal_subset(present, per_species)
            target = folder / metadata.minimal_csv_name(subset, split)
            write_bytes_atomic(target, subset_rows.to_csv(index=False).encode())
            print(f"  {split}: wrote {target} ({len(subset_rows)} rows, up to {per_species} per species)")
    return problems


def save_lists(out: Path, subset: str, size: str, mini: bool, skip_missing: bool, shards: Path | None) -> None:
    """List each split of ``subset`` (its full CSV, and its minimal one with ``mini``), save the lists
    and, given ``shards``, write their images as shards there."""
    mappings = metadata.load_mappings(out / "prepared", subset)
    workers = os.cpu_count() or 1
    for minimal in (False, True) if mini else (False,):
        cfg = DataConfig(root=str(out), prepared_dir=str(out / "prepared"), subset=Subset(subset), size=size,
                         minimal=minimal, skip_missing=skip_missing)
        for split in metadata.SPLIT_NAMES:
            try:
                csv = split_csv(cfg, split)
            except UserError:
                continue
            index = list_split(cfg, split, mappings, workers)
            index.save(index_file(cfg, split))
            print(f"  {split}: listed {len(index)} images of {csv.name} in {index_file(cfg, split)}")
            if shards is not None:
                kept = ("split", "levels", "mappings", "unknown_species", "missing")
                target = shards / shard_set(cfg) / split
                chunks = write_shards(index, out, target, {"recipe": "fungitastic",
                                                           **{key: index.info[key] for key in kept}}, workers)
                print(f"  {split}: wrote {len(index)} images as {chunks} shards in {target}")


def prepare(out: Path, source: Path | None, size: str, mini: bool, per_species: int, skip_missing: bool,
            shards: Path | None = None) -> None:
    if source is not None:
        link_source(source, out)
    subsets = [subset for subset in metadata.SUBSET_DIRS
               if any((out / "metadata" / metadata.subset_dir(subset) / name).is_file()
                      for name in metadata.csv_names(subset, "train"))]
    if not subsets:
        raise UserError(f"{out / 'metadata'} holds no FungiTastic training CSV; {HOW_TO_GET}")
    problems = []
    for subset in subsets:
        problems += prepare_subset(out, out / "prepared", subset, size, mini, per_species)
    if problems and not skip_missing:
        raise UserError("; ".join(problems) + " (--skip-missing reports them without failing; train with "
                        "data.skip_missing=true to leave them out)")
    for problem in problems:
        print(f"warning: {problem}")
    for subset in subsets:
        save_lists(out, subset, size, mini, skip_missing, shards)


def prepare_weights(overrides: list[str], source: Path | None) -> str:
    """Store the weights ``model.pretrained`` names; say what was done."""
    pretrained = weights.recipe_config("fungitastic", overrides).model.pretrained
    if not pretrained:
        return "none needed (model.pretrained is empty: random initialisation)"
    from recipes.fungitastic.model import is_hub_name  # timm's models: only when there are weights to store

    if is_hub_name(pretrained) and not Path(pretrained).exists():
        if source is not None:
            raise UserError(f"model.pretrained={pretrained} is a hub name: point it at a folder under "
                            f"{weights.WEIGHTS_ROOT}/ to store --weights there")
        return f"{pretrained} is a hub name, fetched when the run starts"
    origin = weights.store(Path(pretrained), "timm", source)
    return f"{pretrained} ({origin})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="a FungiTastic download: metadata/ and the image folders")
    parser.add_argument("--out", type=Path, default=Path("data/fungitastic"))
    parser.add_argument("--size", default="300p", choices=metadata.IMAGE_SIZES)
    parser.add_argument("--mini", action="store_true", default=os.environ.get("MINI", "0") == "1",
                        help="also write *-Minimal.csv subsets (default when MINI=1 is in the environment)")
    parser.add_argument("--per-species", type=int, default=4, help="rows per species in the minimal subsets")
    parser.add_argument("--skip-missing", action="store_true", help="report missing images without failing")
    parser.add_argument("--weights", type=Path, help="a local copy of the pretrained weights (timm folder or file)")
    parser.add_argument("--format", choices=("files", "shards"), default="files",
                        help="shards: also write each split's images as litdata shards (data.format=shards)")
    parser.add_argument("--shards", type=Path, help="where the shards go (default: OUT/shards)")
    parser.add_argument("overrides", nargs="*", help="recipe config overrides that choose the weights "
                        "(e.g. +experiment=fungi_beit_finetune)")
    args = parser.parse_args()
    if args.per_species < 1:
        raise UserError("--per-species must be at least 1")
    shards = (args.shards or args.out / "shards") if args.format == "shards" else None
    prepare(args.out, args.source, args.size, args.mini, args.per_species, args.skip_missing, shards)
    print(f"fungitastic: {args.out / 'prepared'} is ready (train with data.root={args.out})")
    print(f"fungitastic: pretrained weights: {prepare_weights(args.overrides, args.weights)}")


if __name__ == "__main__":
    run_cli(main)
