"""``trainer.out_of_memory=halve``: a step that runs out of CUDA memory is done again with half the micro-batch.

The same config then runs on a smaller GPU (a requeue onto another partition, a mixed ISC queue)
without hand-tuning, as Composer's ``device_train_microbatch_size="auto"`` does. The data loader
keeps handing out ``trainer.batch_size`` samples at a time and the run cuts each such batch into
micro-batches of the size in use (:class:`common.run.steps.MicroBatches`), so the global batch, the
step's samples and the plan of steps stay those of the config; only the accumulation is deeper.

What makes the redone step the step a run started with the smaller micro-batch would have taken
(bit for bit on a CPU) is restored by :class:`StepStart`: the gradients are dropped, and the
random generators, the model's buffers (BatchNorm's running statistics) and the metric sums are
put back as they were when the step began; per-step seeded generators are made again by the loop.
Only an out-of-memory error (``torch.OutOfMemoryError``) inside the step's forward and backward
passes is retried: any other error, or one in the optimizer step, ends the run as before.

Several ranks: where the step's forward and backward passes make no collective call (DDP, whose
gradients this mode reduces once after the last micro-batch instead of during its backward pass,
:func:`common.pytorch.distributed.all_reduce_gradients`), the rank that ran out redoes its step
alone and the others take its size where they next agree on the checkpoint cadence, so no step
waits for another rank's host. Where they make collective calls (FSDP2, synchronised BatchNorm),
every rank must run out in the same micro-batch (their shards and batches are the same size): they
check it, then all redo the step. A rank that ran out alone there waits for the others in that
check while they wait in the model's next collective, and the run ends as hung (exit 4) after
``trainer.collective_timeout_s``.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from common.errors import UserError
from common.pytorch.metrics import SumMetrics


def halved(size: int) -> int:
    """The micro-batch after one more out-of-memory error: half, rounded up."""
    return math.ceil(size / 2)


def device_description(device: torch.device, world_size: int) -> str:
    """What a micro-batch size found to fit is kept for: the GPU model and its memory, and the
    number of ranks (FSDP2's shards, and so each rank's memory, depend on it)."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        where = f"{properties.name} ({properties.total_memory / 2**30:.1f} GiB)"
    else:
        where = device.type
    return f"{where} x {world_size} rank{'s' if world_size > 1 else ''}"


def communicates_in_forward(model: nn.Module) -> bool:
    """Whether ``model``'s forward or backward passes make collective calls of their own: FSDP2's
    gathers, BatchNorm synchronised across ranks (``nn.SyncBatchNorm``, or a module that says so
    with ``collective_in_forward = True``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, (FSDPModule, nn.SyncBatchNorm)) or getattr(module, "collective_in_forward", False)
               for module in model.modules())


class StepStart:
    """What a step changes before its optimizer step, as it was when the step began: the global
    random generators (Python's, NumPy's, torch's CPU one and this rank's CUDA one), the model's
    buffers and the metric sums. Taken at every step (host copies of the generator states, one
    device copy of the buffers, references to the sums: no host sync), put back only when a step
    is redone."""

    def __init__(self, model: nn.Module, sums: SumMetrics, device: torch.device) -> None:
        self.model, self.sums, self.device = model, sums, device
        self._buffers = [buffer for buffer in model.buffers() if buffer.numel()]
        self._kept = [buffer.detach().clone() for buffer in self._buffers]
        self._generators: tuple[Any, ...] = ()
        self._sums: Any = None

    def take(self) -> None:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self._generators = (random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)
        if self._buffers:
            torch._foreach_copy_(self._kept, self._buffers)
        self._sums = self.sums.snapshot()

    def restore(self) -> None:
        python, numpy, cpu, cuda = self._generators
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        if self._buffers:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, self._kept)
        self.sums.restore(self._sums)


def check_can_halve(model: nn.Module) -> None:
    """Refuse, before training, what :func:`drop_gradients` could not recover from."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and not hasattr(model, "reset_iter_state"):
        raise UserError(f"trainer.out_of_memory=halve with FSDP2 needs FSDPModule.reset_iter_state (torch >= 2.14), "
                        f"which torch {torch.__version__} lacks: use trainer.out_of_memory=stop")


def drop_gradients(model: nn.Module) -> None:
    """Forget the gradients a failed step accumulated; under FSDP2 also its unsharded ones, the
    weights it had gathered and its per-iteration state (``FSDPModule.reset_iter_state``, PyTorch's
    recovery after an error in a forward or backward pass; torch >= 2.14)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reset_iter_state()
    for parameter in model.parameters():
        parameter.grad = None
