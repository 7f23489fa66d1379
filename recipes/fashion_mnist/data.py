"""Fashion-MNIST from its original IDX files, straight into uint8 tensors.

The whole dataset (55 MB) lives on the training device, so a batch is one gather and the
augmentation (random crop with zero padding, horizontal flip: ``common.data.image_batches``) runs on
whole batches of tensors: no DataLoader workers, no PIL, nothing for the GPU to wait on.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import torch

from common.errors import UserError

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_DTYPE_UBYTE = 0x08
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
MEAN, STD = 0.2860, 0.3530  # of the training images, in [0, 1]
BLACK = (0 - MEAN) / STD  # a black pixel, normalised: what random crops pad with


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (raw or .gz) as a uint8 tensor of the shape its header declares."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise UserError(f"{path} is not an IDX file (bad magic number)")
    if data[2] != IDX_DTYPE_UBYTE:
        raise UserError(f"{path} holds IDX type 0x{data[2]:02x}; Fashion-MNIST files are unsigned bytes (0x08)")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UserError(f"{path} is truncated: its header is incomplete")
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(torch.tensor(shape).prod())
    if len(data) != expected:
        raise UserError(f"{path} is truncated or padded: {len(data)} bytes, its header declares {expected}")
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).reshape(shape)


def _find(root: Path, name: str) -> Path:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise UserError(
        f"{root / name} not found: run `make prep-fashion_mnist` or set data.root to a folder with the IDX files"
    )


def load_split(root: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``[N, 28, 28]`` uint8 and labels ``[N]`` int64 of ``split`` (train or test)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist: run `make prep-fashion_mnist` or set data.root")
    images_file, labels_file = FILES[split]
    images = read_idx(_find(root, images_file))
    labels = read_idx(_find(root, labels_file))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise UserError(
            f"{root}: {split} images {tuple(images.shape)} and labels {tuple(labels.shape)} do not match"
        )
    if int(labels.max()) > 9:
        raise UserError(f"{root}: {split} labels go up to {int(labels.max())}; Fashion-MNIST has 10 classes")
    return images, labels.long()


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, 28, 28]`` to normalized float ``[B, 1, 28, 28]``."""
    return ((images.float() / 255.0 - MEAN) / STD).unsqueeze(1)
