"""FSDP2 (``fully_shard``) for the recipes that shard their model: dinov2_fsdp, and others with ``fsdp.enabled``.

- Each block (those ``trainer.activation_checkpointing`` recomputes) is one FSDP unit; the root holds the
  rest (stem, norms, heads). A unit's weights are gathered only while it runs.
- The run contract saves the shards with ``torch.distributed.checkpoint`` (``TrainingRun(sharded=True)``):
  a run resumes, and ``make eval``, ``make export`` and ``init_from`` read it, on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from common.errors import UserError


def fully_shard_blocks(model: nn.Module, blocks: Iterable[nn.Module], *, bf16_parameters: bool,
                       reshard_after_forward: bool, cpu_offload: bool) -> None:
    """FSDP2 in place: every one of ``blocks`` is a unit, then ``model`` holds the rest.

    - ``bf16_parameters``: compute with bf16 copies of the fp32 parameters, reduce gradients in fp32,
      in place of autocast (dinov2_fsdp); else the recipe's autocast computes as without FSDP2.
    - ``reshard_after_forward``: free gathered weights after each unit's forward.
    - ``cpu_offload``: shards, gradients and optimizer state live in host memory (CUDA).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_parameters \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mp_policy=mixed, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=mixed, offload_policy=offload, reshard_after_forward=reshard_after_forward)


def is_sharded(model: Any) -> bool:
    """Whether ``model`` (or the module a ``torch.compile`` wrapper holds) is FSDP2-sharded."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def process_group_options(shard_on_one_rank: bool, cpu_offload: bool) -> dict[str, bool]:
    """The ``init_distributed`` options FSDP2 needs.

    - ``shard_on_one_rank``: a process group even of one rank.
    - ``cpu_offload``: gloo beside nccl, since gradient clipping reduces offloaded gradients on the host.
    """
    return {"cpu_collectives": cpu_offload, "group_of_one": shard_on_one_rank}


def check_fsdp_settings(enabled: bool, cpu_offload: bool, device: torch.device, precision: str) -> None:
    """Refuse ``fsdp.*`` settings no run can honour, before any work (``UserError``)."""
    if cpu_offload and not enabled:
        raise UserError("fsdp.cpu_offload offloads FSDP2's shards: it needs fsdp.enabled=true")
    if not enabled:
        return
    if cpu_offload and device.type != "cuda":
        raise UserError("fsdp.cpu_offload moves GPU state to host memory: it needs device=cuda")
    if precision == "fp16":
        raise UserError("trainer.precision=fp16 is not supported with FSDP2: use bf16 (no loss scaling needed) or fp32")
