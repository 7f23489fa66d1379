"""What a training checkpoint holds, captured and restored in one place for every recipe.

A recipe calls :func:`capture` to build the state for :class:`common.checkpoint.CheckpointManager`
and :func:`restore` after loading it. Everything needed for a bit-exact continuation is here:
model, optimizer, LR scheduler, grad scaler, sampler position, RNG states of every rank
(Python, NumPy, torch, CUDA), progress counters and partially accumulated metrics.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from common import distributed


@dataclass
class Progress:
    """Counters that survive restarts."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    resumes: int = 0  # how many times this run was resumed from a checkpoint
    train_seconds: float = 0.0  # wall time spent in earlier segments of this run
    best_metric: float | None = None
    finished: bool = False  # the final checkpoint: restarting only rewrites the summary
    extra: dict[str, Any] = field(default_factory=dict)  # recipe-specific counters (e.g. stage)


class SegmentTimer:
    """Wall time of the current process segment, added to ``Progress.train_seconds`` at each save."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def lap(self) -> float:
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        return elapsed


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP and ``torch.compile`` wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
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
    """Restore :func:`rng_state`'s result, whatever device its tensors were loaded to (the
    generators take CPU byte tensors only)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    keys = saved["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([cuda_state.cpu() for cuda_state in state["cuda"]])


def capture(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    sampler: Any,
    progress: Progress,
    metrics: Any = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint state. Collective: every rank must call it (each rank's RNG states and
    partial metric sums are gathered, since only rank 0 writes ``state.pt``).

    Pass ``model=None`` and ``optimizer=None`` when they are saved sharded (FSDP).
    """
    per_rank = distributed.all_gather_object(
        {"rng": rng_state(), "metrics": metrics.state_dict() if metrics is not None else None}
    )
    state: dict[str, Any] = {
        "progress": asdict(progress),
        "rng": [own["rng"] for own in per_rank],
    }
    if model is not None:
        state["model"] = unwrap_model(model).state_dict()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    if metrics is not None:
        state["metrics"] = [own["metrics"] for own in per_rank]
    if extra:
        state["extra"] = extra
    return state


def restore(
    state: dict[str, Any],
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    sampler: Any,
    metrics: Any = None,
) -> Progress:
    """Load ``state`` into the live objects and return the saved progress, one resume later.

    ``state`` may have been loaded to any device. RNG states and partial metric sums are
    restored per rank when the world size is unchanged. On a different world size every rank
    takes rank 0's RNG states (the run continues, but cannot be bit-exact), and rank 0 takes the
    metric sums of all saved ranks while the others start from zero, so the totals are kept.
    """
    if model is not None:
        unwrap_model(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    if sampler is not None:
        sampler.load_state_dict(state["sampler"])
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rngs = state["rng"]
    same_world = len(rngs) == world_size
    if metrics is not None and "metrics" in state:
        saved_sums = state["metrics"]
        if same_world:
            metrics.load_state_dict(saved_sums[rank])
        else:
            metrics.load_state_dict(merged_sums(saved_sums) if rank == 0 else {})
    set_rng_state(rngs[rank] if same_world else rngs[0])
    progress = Progress(**state["progress"])
    progress.resumes += 1
    return progress


def merged_sums(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several ranks' :meth:`~common.metrics.SumMetrics.state_dict` added into one."""
    merged: dict[str, torch.Tensor] = {}
    for sums in per_rank:
        for name, value in sums.items():
            merged[name] = merged[name] + value.cpu() if name in merged else value.cpu()
    return merged


def state_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict: keys in sorted order, each key, dtype, shape and raw bytes."""
    sha = hashlib.sha256()
    for key in sorted(state_dict):
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().to("cpu").contiguous()
        sha.update(key.encode())
        sha.update(str(tensor.dtype).encode())
        sha.update(str(tuple(tensor.shape)).encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """The ``model_digest`` of ``summary.json`` for an unsharded model."""
    return state_digest(unwrap_model(model).state_dict())
