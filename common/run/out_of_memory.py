"""``trainer.out_of_memory=halve``: a step that runs out of CUDA memory is done again with half the micro-batch.

Why: the same config then runs on a smaller GPU (a requeue onto another partition, a mixed ISC queue)
without hand-tuning, as Composer's ``device_train_microbatch_size="auto"`` does.

- The loader still hands out ``trainer.batch_size`` samples; the run cuts them into micro-batches of the
  size in use (:class:`common.run.steps.MicroBatches`). Global batch and step plan are the config's.
- The redone step is the one a run started with the smaller micro-batch would take (bit for bit on a
  CPU): gradients dropped, and generators, buffers and metric sums put back (:class:`StepStart`).
- Only ``torch.OutOfMemoryError`` in the forward and backward passes is retried; any other error, or
  one in the optimizer step, ends the run as before.
- No collective in forward/backward (DDP, reduced after the step by
  :func:`common.pytorch.distributed.all_reduce_gradients`): the rank that ran out redoes its step
  alone; the others take its size at the next checkpoint-cadence agreement.
- Collectives in forward/backward (FSDP2, synchronised BatchNorm): every rank must run out in the same
  micro-batch; they check, then all redo the step. A rank that ran out alone there ends the run as
  hung (exit 4) after ``trainer.collective_timeout_s``.
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
    """What a micro-batch size found to fit holds for: GPU model, its memory, and the number of ranks.

    (FSDP2's shards, and so each rank's memory, depend on the number of ranks.)
    """
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        where = f"{properties.name} ({properties.total_memory / 2**30:.1f} GiB)"
    else:
        where = device.type
    return f"{where} x {world_size} rank{'s' if world_size > 1 else ''}"


def communicates_in_forward(model: nn.Module) -> bool:
    """Whether ``model``'s forward or backward passes make collective calls of their own.

    FSDP2's gathers, ``nn.SyncBatchNorm``, or a module that sets ``collective_in_forward = True``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, (FSDPModule, nn.SyncBatchNorm)) or getattr(module, "collective_in_forward", False)
               for module in model.modules())


class StepStart:
    """What a step changes before its optimizer step, as it was when the step began.

    - Holds the global random generators (Python, NumPy, torch CPU, this rank's CUDA), the model's
      buffers and the metric sums.
    - Taken every step without a host sync; put back only when a step is redone.
    """

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
    """Forget the gradients a failed step accumulated.

    Under FSDP2 also its unsharded gradients, gathered weights and per-iteration state, through
    ``FSDPModule.reset_iter_state`` (PyTorch's recovery after an error in forward or backward; torch >= 2.14)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reset_iter_state()
    for parameter in model.parameters():
        parameter.grad = None
