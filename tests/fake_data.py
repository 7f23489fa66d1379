"""Tiny datasets in each dataset's real on-disk format, written by the tests."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray) -> Path:
    """An IDX file of unsigned bytes (the MNIST/Fashion-MNIST format)."""
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + array.tobytes())
    return path


def write_fashion_mnist(root: Path, n_train: int = 256, n_test: int = 64, seed: int = 0) -> Path:
    """Four IDX files whose classes are learnable (each class brightens its own band of rows)."""
    rng = np.random.default_rng(seed)
    for prefix, count in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        images = rng.integers(0, 60, size=(count, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 * label + 4 : 2 * label + 7, :] = 220
        write_idx(root / f"{prefix}-images-idx3-ubyte", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels)
    return root


def _cifar_pickle(count: int, rng: np.random.Generator) -> bytes:
    fine = rng.integers(0, 100, size=count)
    entry = {
        b"data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
        b"fine_labels": fine.tolist(),
        b"coarse_labels": (fine // 5).tolist(),
        b"filenames": [f"img_{i}.png".encode() for i in range(count)],
        b"batch_label": b"fake batch",
    }
    return pickle.dumps(entry, protocol=2)


def write_cifar100_tarball(path: Path, n_train: int = 48, n_test: int = 16, seed: int = 0) -> Path:
    """``cifar-100-python.tar.gz`` with train/test/meta pickles laid out like the original."""
    rng = np.random.default_rng(seed)
    members = {
        "cifar-100-python/train": _cifar_pickle(n_train, rng),
        "cifar-100-python/test": _cifar_pickle(n_test, rng),
        "cifar-100-python/meta": pickle.dumps(
            {
                b"fine_label_names": [f"class_{i}".encode() for i in range(100)],
                b"coarse_label_names": [f"super_{i}".encode() for i in range(20)],
            },
            protocol=2,
        ),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path
