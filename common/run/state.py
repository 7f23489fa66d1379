"""What a checkpoint holds of a run, captured and restored: the step's objects, RNGs, sums, progress.

- ``state.pt``: :func:`capture` (collective; rank 0 writes it) and :func:`restore`.
- Sharded runs (FSDP2): the model and optimizer go through ``torch.distributed.checkpoint``
  (:func:`sharded_state`), so a checkpoint resumes on another number of ranks.
- The functions read and fill a run's objects in place: what they use of a
  :class:`~common.run.training_run.TrainingRun` is :class:`TrackedRun`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Protocol

import torch

from common.checkpoint.manager import CheckpointManager, LoadedCheckpoint
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from common.pytorch import distributed
from common.pytorch.distributed import DistInfo
from common.pytorch.metrics import SumMetrics
from common.pytorch.rng import rng_state, set_rng_state
from common.records import heartbeat
from common.records.summary import state_digest
from common.run.out_of_memory import MicroBatchHalving
from common.run.progress import Progress


class TrackedRun(Protocol):
    """What these functions read and fill of a run, a :class:`~common.run.training_run.TrainingRun`:
    named here, as that module imports this one."""

    dist_info: DistInfo
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    sampler: ResumableDistributedSampler
    train_sums: SumMetrics
    extra_state: dict[str, Any]
    sharded: bool
    checkpoints: CheckpointManager
    out_of_memory: MicroBatchHalving

    @property
    def progress(self) -> Progress: ...

    @property
    def micro_batch(self) -> int: ...


def _merged_sums(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several ranks' :meth:`~common.pytorch.metrics.SumMetrics.state_dict` added into one."""
    merged: dict[str, torch.Tensor] = {}
    for sums in per_rank:
        for name, value in sums.items():
            merged[name] = merged[name] + value.cpu() if name in merged else value.cpu()
    return merged


def load_latest(run: TrackedRun) -> tuple[LoadedCheckpoint | None, dict[str, Any] | None]:
    """The newest valid checkpoint, loaded to the CPU, and (sharded) the model's shards read from it. Collective."""
    sharded_model = None
    if run.sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sharded_model = {"model": get_model_state_dict(run.model)}
    return run.checkpoints.load_latest(map_location="cpu", sharded_state=sharded_model), sharded_model


def restore(run: TrackedRun, loaded: LoadedCheckpoint, sharded_model: dict[str, Any] | None) -> None:
    """Load ``loaded`` into the tracked objects, one resume later.

    - Same world size: each rank's RNG states and partial metric sums.
    - Another world size: rank 0's RNG states everywhere (not bit-exact); rank 0 takes every
      saved rank's metric sums, the others none, so the totals are kept.
    """
    state = loaded.state
    if run.sharded:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(run.model, sharded_model["model"])
    else:
        run.model.load_state_dict(state["model"])
    if run.optimizer is not None:
        restore_optimizer(run, loaded)
    if run.scaler is not None and "scaler" in state:
        run.scaler.load_state_dict(state["scaler"])
    for name, obj in run.extra_state.items():
        if name not in state.get("extra", {}):
            raise UserError(f"{loaded.path} holds no {name} state: it was saved by a run without it")
        obj.load_state_dict(state["extra"][name])
    run.sampler.load_state_dict(state["sampler"])
    rank, world_size = run.dist_info.rank, run.dist_info.world_size
    rngs, saved_sums = state["rng"], state["metrics"]
    same_world = len(rngs) == world_size
    if same_world:
        run.train_sums.load_state_dict(saved_sums[rank])
    else:
        run.train_sums.load_state_dict(_merged_sums(saved_sums) if rank == 0 else {})
    set_rng_state(rngs[rank] if same_world else rngs[0])
    run.progress.load_state_dict(state["progress"])
    run.progress.resumes += 1
    heartbeat.at_step(run.progress.step)


def restore_optimizer(run: TrackedRun, loaded: LoadedCheckpoint) -> None:
    """Load ``loaded``'s optimizer and schedule into the run's (sharded: from the DCP folder)."""
    if run.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        from common.checkpoint.layout import SHARDED_DIR

        shards = {"optimizer": get_optimizer_state_dict(run.model, run.optimizer)}
        dcp.load(shards, checkpoint_id=str(loaded.path / SHARDED_DIR))
        set_optimizer_state_dict(run.model, run.optimizer, shards["optimizer"])
    else:
        run.optimizer.load_state_dict(loaded.state["optimizer"])
    if run.scheduler is not None:
        run.scheduler.load_state_dict(loaded.state["scheduler"])


def sharded_state(run: TrackedRun) -> dict[str, Any] | None:
    """A sharded run's model and optimizer shards, for ``torch.distributed.checkpoint``; None unsharded."""
    if not run.sharded:
        return None
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_shards, optimizer_shards = get_state_dict(run.model, run.optimizer)
    return {"model": model_shards, "optimizer": optimizer_shards}


def capture(run: TrackedRun) -> dict[str, Any]:
    """The checkpoint's ``state.pt``. Collective: rank 0 writes every rank's RNG states and metric sums."""
    per_rank = distributed.all_gather_object({"rng": rng_state(), "metrics": run.train_sums.state_dict(),
                                              "micro_batch": run.micro_batch,
                                              "out_of_memory": run.progress.out_of_memory})
    run.out_of_memory.agree([own["micro_batch"] for own in per_rank], [own["out_of_memory"] for own in per_rank])
    state: dict[str, Any] = {
        "progress": asdict(run.progress),
        "rng": [own["rng"] for own in per_rank],
        "metrics": [own["metrics"] for own in per_rank],
        "sampler": run.sampler.state_dict(),
    }
    if not run.sharded:
        state["model"] = run.model.state_dict()
        state["optimizer"] = run.optimizer.state_dict()
    if run.scheduler is not None:
        state["scheduler"] = run.scheduler.state_dict()
    if run.scaler is not None:
        state["scaler"] = run.scaler.state_dict()
    if run.extra_state:
        state["extra"] = {name: obj.state_dict() for name, obj in run.extra_state.items()}
    return state


def model_digest(run: TrackedRun) -> str | None:
    """The summary's ``model_digest`` (on rank 0; collective for a sharded model)."""
    if run.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state_digest(full) if run.dist_info.is_main else None
    return state_digest(run.model.state_dict()) if run.dist_info.is_main else None
