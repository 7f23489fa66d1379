"""How an epoch's samples become optimizer steps: micro-batches, gradient accumulation, the epoch's tail.

- The sampler hands this rank the rest of the epoch in micro-batches of ``trainer.batch_size``;
  ``accumulate`` of them make a step, keeping ``trainer.global_batch_size`` on any number of ranks.
- Each recipe says once, with an :class:`EpochTail`, what an uneven epoch does with its last samples;
  the steps per epoch, the steps left after a resume and the epoch's end follow from it.
- ``trainer.out_of_memory=halve`` cuts each batch into smaller pieces (:class:`MicroBatches`); the
  step counts stay the config's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import Any

import torch

from common.data.loaders import split_micro_batch
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from common.pytorch.optim import accumulation_steps
from common.records import heartbeat


class EpochTail(str, Enum):
    """What an epoch does with the samples that do not fill a last micro-batch or step."""

    keep = "keep"  # every sample: the last micro-batch may be shorter, the last step have fewer micro-batches
    drop_partial_batch = "drop_partial_batch"  # full micro-batches only (BatchNorm); the last step may have fewer
    drop_partial_step = "drop_partial_step"  # full optimizer steps only; the rest of the epoch is left out


def compile_static(model: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` for ``trainer.compile``, with static shapes.

    Why: with :attr:`EpochTail.keep` an epoch ends with a shorter micro-batch; by default the compiler
    would recompile with a dynamic batch dimension and run every later full batch on that slower graph.
    Static, the short batch gets a graph of its own and full batches keep theirs.
    """
    return torch.compile(model, dynamic=False)


class MicroBatches:
    """The micro-batches of one optimizer step, taken from the epoch's iterator as they are used.

    - ``len()`` and ``samples`` (on this rank) are known before the first; the heartbeat says whether
      the rank waits for a batch or works on it.
    - ``loaded``: the sizes of this step's batches from ``source``; a ``size`` below them cuts each batch
      into micro-batches of ``size`` (``trainer.out_of_memory=halve``, ``common/run/out_of_memory.py``).
    - ``keep``: batches are kept until the step ends, so :meth:`restart` can hand them out again.
    - The loop runs the step inside ``with group:``; an error goes to ``on_error`` (set by the run),
      which swallows it by returning True. ``after_last`` (set by the run) follows the last micro-batch.
    """

    def __init__(self, source: Iterator[Any], loaded: list[int], size: int, keep: bool = False) -> None:
        self._source = source
        self._loaded = loaded
        self.samples = sum(loaded)
        self.size = size
        self._keep = keep
        self._kept: list[Any] = []
        self.taken = 0  # batches taken from the epoch's iterator
        self.handed_out = 0  # micro-batches handed out since the step (re)started
        self.on_error: Callable[[BaseException], bool] | None = None
        self.after_last: Callable[[], None] | None = None

    def __len__(self) -> int:
        return sum(math.ceil(samples / self.size) for samples in self._loaded)

    def __iter__(self) -> Iterator[Any]:
        self.handed_out = 0
        for index in range(len(self._loaded)):
            if index < len(self._kept):
                batch = self._kept[index]
            else:
                self.taken += 1
                heartbeat.enter(heartbeat.DATA)
                batch = next(self._source)
                if self._keep:
                    self._kept.append(batch)
            heartbeat.enter(heartbeat.FORWARD_BACKWARD)
            for micro_batch in [batch] if self._loaded[index] <= self.size else split_micro_batch(batch, self.size):
                self.handed_out += 1
                yield micro_batch
        if self.after_last is not None:
            self.after_last()

    def restart(self, size: int) -> None:
        """Hand the step's samples out again, in micro-batches of ``size``."""
        self.size = size

    def __enter__(self) -> MicroBatches:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> bool:
        return error is not None and self.on_error is not None and self.on_error(error)


class StepPlan:
    """The optimizer steps of a run: ``accumulate`` micro-batches of ``micro_batch`` samples per rank a step.

    ``per_epoch`` steps make an epoch, ``total`` the run (``max_steps`` caps it); ``tail``: :class:`EpochTail`."""

    def __init__(self, sampler: ResumableDistributedSampler, micro_batch: int, accumulate: int, world_size: int,
                 epochs: int, max_steps: int = 0, tail: EpochTail = EpochTail.keep) -> None:
        self.sampler = sampler
        self.micro_batch = micro_batch
        self.accumulate = accumulate
        self.world_size = world_size
        self.epochs = epochs
        self.tail = EpochTail(tail)
        self.per_epoch = self.steps_in(sampler.samples_per_rank_in_epoch())
        if self.per_epoch == 0:
            raise UserError(f"an epoch has {sampler.samples_per_rank_in_epoch()} samples per rank, too few for one "
                            f"optimizer step of {self.describe()}: lower trainer.batch_size or "
                            f"trainer.global_batch_size")
        self.total = self.per_epoch * epochs
        if max_steps:
            self.total = min(self.total, max_steps)

    @classmethod
    def from_config(cls, cfg: Any, sampler: ResumableDistributedSampler, world_size: int,
                    tail: EpochTail = EpochTail.keep) -> StepPlan:
        """From a recipe's ``trainer`` node (:class:`common.config.TrainerConfig`)."""
        accumulate = accumulation_steps(cfg.global_batch_size, cfg.batch_size, world_size)
        return cls(sampler, cfg.batch_size, accumulate, world_size, cfg.epochs, cfg.max_steps, tail)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.accumulate

    @property
    def drop_last(self) -> bool:
        """``drop_last`` for a DataLoader that makes this plan's micro-batches."""
        return self.tail != EpochTail.keep

    def describe(self) -> str:
        return (f"global batch {self.global_batch} ({self.micro_batch} x {self.world_size} ranks x "
                f"{self.accumulate} accumulation)")

    def micro_batches_in(self, samples: int) -> int:
        """The micro-batches ``samples`` samples of one rank make, by the tail rule."""
        if self.tail == EpochTail.keep:
            return math.ceil(samples / self.micro_batch)
        return samples // self.micro_batch

    def steps_in(self, samples: int) -> int:
        """The optimizer steps ``samples`` samples of one rank make, by the tail rule."""
        if self.tail == EpochTail.drop_partial_step:
            return samples // (self.micro_batch * self.accumulate)
        return math.ceil(self.micro_batches_in(samples) / self.accumulate)

    def steps_left(self) -> int:
        """Steps left in the sampler's epoch: all of them at its start, none when it is done."""
        return self.steps_in(len(self.sampler))

    def epoch_done(self) -> bool:
        return self.steps_left() == 0

    def _steps_left(self, samples_left: int | None = None) -> Iterator[tuple[int, int]]:
        """``(micro-batches, samples on this rank)`` of each step left in the epoch (or in ``samples_left``)."""
        samples_left = len(self.sampler) if samples_left is None else samples_left
        for _ in range(self.steps_in(samples_left)):
            count = min(self.accumulate, self.micro_batches_in(samples_left))
            samples = min(count * self.micro_batch, samples_left)
            yield count, samples
            samples_left -= samples

    def epoch_batches(self) -> EpochBatches:
        """A DataLoader ``batch_sampler`` of this plan's micro-batches that runs past epoch ends."""
        return EpochBatches(self)

    def groups(self, micro_batches: Iterable[Any], keep: bool = False) -> Iterator[MicroBatches]:
        """The :class:`MicroBatches` of each step left in the epoch.

        - ``micro_batches``: the rest of the epoch (index tensors or a DataLoader) in batches of :attr:`micro_batch`.
        - ``keep``: see :class:`MicroBatches`. Raises ``RuntimeError`` if a step leaves micro-batches unused.
        """
        source = iter(micro_batches)
        for count, samples in self._steps_left():
            loaded = [self.micro_batch] * (count - 1) + [samples - self.micro_batch * (count - 1)]
            group = MicroBatches(source, loaded, self.micro_batch, keep)
            yield group
            if group.taken != count:
                raise RuntimeError(f"a step used {group.taken} of its {count} micro-batches; iterate over all of them")

    def skip(self, steps: int) -> None:
        """Move the sampler past the next ``steps`` steps of its epoch untrained: a rollback's bad batches."""
        skipped = [samples for _, samples in itertools.islice(self._steps_left(), max(0, steps))]
        self.sampler.advance(sum(skipped))


class EpochBatches:
    """A plan's micro-batches as lists of sampler keys, from the sampler's position to the run's end.

    - A DataLoader ``batch_sampler`` whose one iterator lasts the run
      (:meth:`common.run.training_run.TrainingRun.steps`): workers decode the next epoch's first
      batches while this one ends and evaluates.
    - Each epoch's micro-batches are exactly the plan's (tail rule included): none straddles two
      epochs, and the order is the sampler's alone.
    """

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __iter__(self) -> Iterator[list[Any]]:
        sampler, micro_batch = self.plan.sampler, self.plan.micro_batch
        start_epoch, consumed = sampler.epoch, sampler.consumed
        for epoch in range(start_epoch, self.plan.epochs):
            start = consumed if epoch == start_epoch else 0
            keys = sampler.keys(epoch, start)
            taken = 0
            for _, samples in self.plan._steps_left(sampler.remaining(start)):
                step_keys = keys[taken:taken + samples]
                taken += samples
                for first in range(0, samples, micro_batch):
                    yield step_keys[first:first + micro_batch]

    def __len__(self) -> int:
        """Micro-batches from the sampler's position to the end of the last epoch."""
        sampler = self.plan.sampler
        left = sum(count for count, _ in self.plan._steps_left())
        whole_epochs = max(0, self.plan.epochs - sampler.epoch - 1)
        return left + whole_epochs * sum(count for count, _ in self.plan._steps_left(sampler.remaining(0)))
