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

import gc
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from common.config import TrainerConfig
from common.data.loaders import halved
from common.errors import UserError
from common.pytorch import distributed
from common.pytorch.distributed import DistInfo, all_reduce_gradients
from common.pytorch.metrics import SumMetrics
from common.records import heartbeat
from common.records.profiling import out_of_memory_error
from common.run.progress import Progress
from common.run.steps import MicroBatches


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


def _merged_halvings(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several ranks' records of halvings (:attr:`Progress.out_of_memory`) as one list, a halving
    of several ranks once, with all of them."""
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for records in per_rank:
        for record in records:
            kept = merged.setdefault((record["step"], record["micro_batch_size"]), {**record, "ranks": []})
            kept["ranks"] = sorted(set(kept["ranks"]) | set(record["ranks"]))
    return [merged[key] for key in sorted(merged)]


class MicroBatchHalving:
    """A run's micro-batch in use, and with ``trainer.out_of_memory=halve`` the redo of a step that ran out.

    - ``trainer``: its ``out_of_memory`` (``mode``) and ``batch_size`` (``full``, the plan's micro-batch).
    - Records live in ``progress`` (``micro_batch_size``, ``micro_batch_found_on``, ``out_of_memory``).
    - Raises :class:`UserError` at construction where halving could not recover (:func:`check_can_halve`).
    """

    def __init__(self, trainer: TrainerConfig, full: int, model: nn.Module, sums: SumMetrics, dist_info: DistInfo,
                 progress: Progress, console: Callable[..., None], run_dir: Any, sharded: bool) -> None:
        self.mode = trainer.out_of_memory.value
        self.full = full
        self.micro_batch = full  # in use: trainer.batch_size, or less once halved
        self.model, self.dist_info, self.progress, self.console, self.run_dir = (model, dist_info, progress,
                                                                                 console, run_dir)
        self.device_key = device_description(dist_info.device, dist_info.world_size)
        if self.halves:
            check_can_halve(model)
        self.step_start = StepStart(model, sums, dist_info.device) if self.halves else None
        self.reduces_gradients = self.halves and dist_info.distributed and not sharded  # common.pytorch.distributed
        self.in_forward_backward = False  # inside a step, before its gradients are reduced, clipped or applied
        self.redo = False  # the step that was just handed out ran out of memory: hand it out again

    @property
    def halves(self) -> bool:
        return self.mode == "halve"

    def resume(self) -> None:
        """After a resume: the halved micro-batch where it was found to fit (the same GPU model and
        memory, the same number of ranks); elsewhere ``trainer.batch_size`` again."""
        saved, progress = self.progress.micro_batch_size, self.progress
        if not saved or saved >= self.full:
            return
        if self.mode == "halve" and progress.micro_batch_found_on == self.device_key:
            self.micro_batch = saved
            self.console(f"micro-batches of {saved} (trainer.batch_size={self.full} halved after running "
                         f"out of memory on {self.device_key}): each batch is cut in "
                         f"{math.ceil(self.full / saved)}, the global batch kept")
            return
        self.console(f"trainer.batch_size={self.full} again: the run had halved it to {saved} on "
                     f"{progress.micro_batch_found_on}, and runs on {self.device_key} now")
        progress.micro_batch_size, progress.micro_batch_found_on = 0, ""

    def step_starting(self, group: MicroBatches) -> None:
        """Before a step is handed out: its start kept, its errors and last micro-batch watched."""
        group.size = self.micro_batch
        if self.step_start is not None:
            self.step_start.take()
            group.on_error = self._out_of_memory
        if self.reduces_gradients:
            group.after_last = self._reduce_gradients
        self.in_forward_backward = True

    def past_forward_backward(self) -> None:
        """The step's gradients are complete: an out-of-memory error is no longer retried."""
        self.in_forward_backward = False

    def _out_of_memory(self, error: BaseException) -> bool:
        """A step's ``with group:`` ended in ``error``: True (swallowed, the step is handed out
        again) for an out-of-memory error in its forward or backward passes; a one-line error
        once the micro-batch is one sample."""
        if not isinstance(error, torch.OutOfMemoryError) or not self.in_forward_backward:
            return False
        self.in_forward_backward = False
        if self.micro_batch == 1:
            raise out_of_memory_error(error, self.run_dir, self.dist_info, self.full, 0, "halve",
                                      micro_batch=1) from error
        self.redo = True
        return True

    def redo_step(self, group: MicroBatches, step: int) -> None:
        """Make the step that ran out start again with half the micro-batch: gradients dropped,
        generators, buffers and metric sums as they were when it began, the same samples.

        - Raises :class:`UserError` (on every rank) where ranks whose forward passes communicate
          ran out at different points.
        """
        self.redo = False
        ranks = [self.dist_info.rank]
        if self.dist_info.distributed and communicates_in_forward(self.model):
            with heartbeat.phase(heartbeat.OUT_OF_MEMORY):  # every rank ran out here too, or the others wait
                where = distributed.all_gather_object((step, self.micro_batch, group.handed_out))
            if len(set(where)) > 1:
                raise UserError(f"the ranks ran out of memory at different points ((step, micro-batch size, "
                                f"micro-batches begun) by rank: {where}), and their model's forward passes make "
                                f"collective calls: they cannot redo the step apart; use a smaller trainer.batch_size",
                                agreed=True)
            ranks = list(range(self.dist_info.world_size))
        drop_gradients(self.model)
        self.step_start.restore()
        gc.collect()  # the failed attempt's activations, held in cycles through its traceback
        if self.dist_info.device.type == "cuda":
            torch.cuda.empty_cache()
        before, self.micro_batch = self.micro_batch, halved(self.micro_batch)
        group.restart(self.micro_batch)
        self._note_halving(step, ranks, self.micro_batch)
        self.console(f"out of memory in step {step} on rank(s) {', '.join(map(str, ranks))} with micro-batches of "
                     f"{before}: the step again with {self.micro_batch} ({len(group)} per step on each rank, the "
                     f"global batch kept)", everywhere=len(ranks) == 1)
        self.in_forward_backward = True

    def _note_halving(self, step: int, ranks: list[int], size: int) -> None:
        """Record a halving in the progress (merged with the other ranks' where they agree)."""
        record = {"step": step, "ranks": ranks, "micro_batch_size": size, "found_on": self.device_key}
        records = self.progress.out_of_memory
        if not records or (records[-1]["step"], records[-1]["micro_batch_size"]) != (step, size):
            records.append(record)
        self.progress.micro_batch_size, self.progress.micro_batch_found_on = size, self.device_key

    def agree(self, micro_batches: Sequence[int], records: list[list[dict[str, Any]]] | None = None) -> None:
        """Where the ranks agree (the checkpoint cadence, every save): when a rank halved alone,
        every rank takes the smallest micro-batch and the ranks' records (``records``, or gathered
        now: collective, only then) are merged."""
        if len(set(micro_batches)) <= 1:
            return
        size = min(micro_batches)
        if records is None:
            records = distributed.all_gather_object(self.progress.out_of_memory)
        self.progress.out_of_memory = _merged_halvings(records)
        if size < self.micro_batch:
            self.micro_batch = size
        self.progress.micro_batch_size, self.progress.micro_batch_found_on = size, self.device_key
        self.console(f"every rank now cuts its batches in micro-batches of {size} (rank(s) "
                     f"{', '.join(str(rank) for rank, own in enumerate(micro_batches) if own == size)} ran out of "
                     f"memory)")

    def _reduce_gradients(self) -> None:
        """After a step's last micro-batch: the gradients averaged over the ranks (DDP's work, done
        outside the backward pass so a rank may redo its micro-batches alone)."""
        self.in_forward_backward = False
        all_reduce_gradients(self.model)
