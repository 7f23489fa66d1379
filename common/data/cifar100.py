"""CIFAR-100 in its original "python version" format, read into uint8 tensors.

- The one reader for ``cifar100_resnet50``, ``dinov2_fsdp`` and ``data_prep/cifar100_resnet50.py``.
- The unpickler admits only the NumPy types the format needs: a tampered file cannot run code.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from common.errors import UserError

FOLDER = "cifar-100-python"
SPLITS = ("train", "test")
IMAGE_SIZE = 32  # pixels a side
_IMAGE_SHAPE = (3, IMAGE_SIZE, IMAGE_SIZE)
NUM_CLASSES = 100
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR-100 pickle")
        return super().find_class(module, name)


def read_pickle(handle: BinaryIO) -> dict[bytes, Any]:
    return _NumpyOnlyUnpickler(handle, encoding="bytes").load()


@dataclass
class Cifar100Split:
    images: torch.Tensor  # [N, 3, 32, 32] uint8
    labels: torch.Tensor  # [N] int64, fine labels 0..99
    coarse_labels: torch.Tensor  # [N] int64, superclasses 0..19


def _find_folder(root: str | Path, prep: str = "cifar100_resnet50") -> Path:
    """``root`` itself or ``root/cifar-100-python``, whichever holds the pickles; else an error
    that names ``make prep-<prep>``."""
    root = Path(root)
    for folder in (root / FOLDER, root):
        if (folder / "train").is_file() and (folder / "test").is_file():
            return folder
    raise UserError(
        f"no CIFAR-100 pickles (train, test, meta) under {root}: run `make prep-{prep}` "
        "or set data.root to the folder that holds cifar-100-python/"
    )


def load_split(root: str | Path, split: str, prep: str = "cifar100_resnet50") -> Cifar100Split:
    """One split's images (uint8) and labels, checked: any problem is one line naming the file
    (missing pickles: the one naming ``make prep-<prep>``, the recipe's data prep)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    path = _find_folder(root, prep) / split
    try:
        with open(path, "rb") as handle:
            entry = read_pickle(handle)
        data = np.asarray(entry[b"data"], dtype=np.uint8)
        fine = np.asarray(entry[b"fine_labels"], dtype=np.int64)
        coarse = np.asarray(entry[b"coarse_labels"], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as error:
        raise UserError(f"{path} is not a valid CIFAR-100 pickle ({error})") from error
    if data.ndim != 2 or data.shape[1] != int(np.prod(_IMAGE_SHAPE)) or len(data) != len(fine):
        raise UserError(f"{path}: data has shape {data.shape}, expected [N, 3072] with {len(fine)} labels")
    if not len(fine):
        raise UserError(f"the CIFAR-100 {split} split under {root} holds no images")
    if fine.min() < 0 or fine.max() >= NUM_CLASSES:
        raise UserError(f"{path}: fine labels outside 0..{NUM_CLASSES - 1}")
    return Cifar100Split(
        images=torch.from_numpy(data.reshape(-1, *_IMAGE_SHAPE).copy()),
        labels=torch.from_numpy(fine),
        coarse_labels=torch.from_numpy(coarse),
    )


def class_names(root: str | Path) -> list[str]:
    with open(_find_folder(root) / "meta", "rb") as handle:
        meta = read_pickle(handle)
    return [name.decode() for name in meta[b"fine_label_names"]]
