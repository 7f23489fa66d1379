"""CIFAR-100 (as for cifar100_resnet50) and the DINOv2 backbone's pretrained weights.

    python -m data_prep.dinov2_fsdp [--source FILE_OR_DIR] [--out data/cifar100]
                                    [--weights DIR_OR_FILE] [config overrides, e.g. +experiment=...]

The data step is ``data_prep.cifar100_resnet50``'s: ``--source`` is the CIFAR-100 tarball or its
folder (else the original download), md5-checked and extracted into ``<out>/cifar-100-python/``.
The weights step stores what the config (with the given overrides) reads from ``model.weights``,
from the hub or from ``--weights`` (a save_pretrained folder; for timm also a weights file), so
that runs never download them at start-up (see ``data_prep/weights.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.data import cifar100
from data_prep import cifar100_resnet50, weights
from data_prep.files import run_cli


def prepare_weights(overrides: list[str], source: Path | None) -> str:
    """Store the weights ``model.weights`` names; say what was done."""
    model = weights.recipe_config("dinov2_fsdp", overrides).model
    if not model.pretrained:
        return "none needed (model.pretrained=false: random initialisation)"
    if not model.weights:
        return f"{model.name} is fetched from the hub when the run starts (model.weights is empty)"
    return f"{model.weights} ({weights.store(Path(model.weights), model.library.value, source)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help=f"{cifar100_resnet50.TARBALL} or a folder that holds it")
    parser.add_argument("--out", type=Path, default=Path("data/cifar100"))
    parser.add_argument("--weights", type=Path, help="a local copy of the pretrained weights (folder or file)")
    parser.add_argument("overrides", nargs="*", help="recipe config overrides that choose the backbone "
                        "(e.g. +experiment=dinov2_large)")
    args = parser.parse_args()
    origin = cifar100_resnet50.prepare(args.out, args.source)
    train = cifar100.load_split(args.out, "train")
    print(f"dinov2_fsdp: {args.out / cifar100.FOLDER} holds {len(train.labels)} train images ({origin})")
    print(f"dinov2_fsdp: pretrained weights: {prepare_weights(args.overrides, args.weights)}")


if __name__ == "__main__":
    run_cli(main)
