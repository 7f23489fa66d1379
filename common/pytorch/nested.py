"""The tensors inside nested containers: batches, state dicts, optimizer states."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, through dicts, lists and tuples. A DTensor (FSDP2's parameters and
    their optimizer state) is this rank's shard: what this rank holds and can read without talking."""
    if isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
