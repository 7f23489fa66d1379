"""Random number generators: a resumed run draws from step ``s`` on what the uninterrupted run drew.

- Every rank's generator states are in each checkpoint (:func:`rng_state`, :func:`set_rng_state`).
- Draws that would depend on when something happened in the process (a DataLoader iterator seeding
  its workers) come from generators seeded by what they are for: step, rank, sample
  (:func:`seeded_generator`, :func:`seeded_global_rng`).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (model initialisation, dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _sample_seed(*keys: int) -> int:
    """A 63-bit seed that depends only on ``keys`` (e.g. seed, epoch, index)."""
    digest = hashlib.blake2b(":".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on ``device`` for batch-level augmentation, seeded from ``keys`` (e.g. seed, step, rank)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(_sample_seed(*keys))
    return generator


@contextlib.contextmanager
def seeded_global_rng(*keys: int) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's CPU global generators from ``keys`` for the block; restore them after.

    - For library code that draws only from global state (timm's Mixup, drop path, torchvision's RandAugment).
    - CUDA generators are left alone: their state is in every checkpoint, and reseeding costs a device call.
    """
    seed = _sample_seed(*keys)
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that reseeds CUDA too
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def rng_state() -> dict[str, Any]:
    """This process's generator states in a form ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s result, whatever device its tensors were loaded to."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    keys = saved["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([cuda_state.cpu() for cuda_state in state["cuda"]])
