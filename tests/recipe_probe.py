"""A recipe's real ``train()`` run in this process and stopped early, with what it built and did
recorded: what the tests of config keys, gradient equivalences and augmentation draws read.

:class:`Configs` composes a recipe's config once with Hydra (a fifth of a second) and makes its
variants by merging more overrides the way Hydra merges them (typed, checked against the schema;
milliseconds). :func:`probe` runs ``recipes.<r>.train.train(cfg, dist_info)`` as
``python -m recipes.<r>.train`` would, minus the subprocess and the run lock. Nothing of the loop
is replaced; the probe watches it through :class:`~common.run.training_run.TrainingRun`, which every recipe
builds from what a checkpoint holds (so the probe sees the model, optimizer, LR schedule, sampler
and plan the recipe made), and through hooks on the model and the optimizer:

* ``steps=0``: stop when the loop asks for its first step, everything built;
* ``steps=n``: stop after the ``n``-th optimizer step (counted from the run's start, so a resumed
  run stops where an uninterrupted one would), with every training input the model saw, the
  loss summed over each step's samples, the gradients each optimizer step applied (after
  clipping), the samples each input holds and the steps at which training metrics were logged;
* ``steps=None``: run to the end (finish, summary), recording the evaluation's inputs too.

``nonfinite_at=k`` makes the model's output NaN in the first training forward of optimizer step
``k``, once: what a diverging step does to the loss, for a run that may roll back.
``error_at=k`` raises ``error`` (default ``torch.OutOfMemoryError``, as CUDA would) in the first
training forward of step ``k`` (``error_in="forward"``, once the model's output is computed) or in
its backward pass (``"backward"``, as the gradient of that output is computed), once.

A :class:`~common.errors.UserError` the recipe raises is recorded, not raised. The process is left
as it was found: signal handlers, open log files, the global random generators and determinism
switch, the recipe module's ``compile_static`` (which the probe records instead of compiling).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf, open_dict

from common.data.loaders import PerSampleSeeded
from common.entry import compose_config, typed_config
from common.errors import UserError
from common.pytorch.distributed import DistInfo
from common.run.training_run import TrainingRun

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="single")


def tiny_settings(recipe: str, factory: Any) -> list[str]:
    """``recipe``'s tiny test settings and its tiny data, made once per session (both declared in
    ``recipes/<recipe>/testing.py``; ``factory``: pytest's ``tmp_path_factory``)."""
    from tests import trained_runs

    data = trained_runs.tiny_files(recipe, factory)
    return [*trained_runs.TINY[recipe], *(f"{key}={path}" for key, path in data.items())]


class Configs:
    """``recipe``'s config composed once (``overrides`` on top of its schema), and variants of it:
    ``configs("optim.lr=0.5")`` is that config with ``optim.lr=0.5`` merged in and a run directory
    of its own under ``root`` (``default_run_dir=True`` keeps the schema's ``runs/<recipe>/<name>``,
    relative to the working directory). ``+key=value`` adds a key, as in Hydra (``model.kwargs``)."""

    def __init__(self, recipe: str, root: Path, overrides: list[str]) -> None:
        self.recipe, self.root = recipe, root
        self.base = compose_config(recipe, overrides)
        self._made = 0

    def __call__(self, *overrides: str, default_run_dir: bool = False) -> Any:
        self._made += 1
        run_dir = [] if default_run_dir else [f"run_dir={self.root / f'run{self._made}'}"]
        cfg = OmegaConf.merge(self.base, OmegaConf.from_dotlist([*run_dir, *(o for o in overrides if o[0] != "+")]))
        added = [override[1:] for override in overrides if override[0] == "+"]
        if added:
            with open_dict(cfg):
                cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(added))
        return typed_config(cfg)


@dataclass
class Probe:
    """What a probed run built and did (see the module)."""

    cfg: Any
    run: TrainingRun | None = None
    held_progress: Any = None  # what run.resume() returned: the progress the recipe's loop holds
    error: str | None = None  # the UserError the recipe stopped with
    micro_batches: Any = None  # what the loop first handed run.steps(): a DataLoader or index tensors
    compiled: list[Any] = field(default_factory=list)  # what the recipe handed compile_static
    inputs: list[torch.Tensor] = field(default_factory=list)  # every training forward's input, in order
    epochs: list[int] = field(default_factory=list)  # the epoch of each of them
    steps: list[int] = field(default_factory=list)  # and the optimizer step it is part of (1 for the first)
    eval_inputs: list[torch.Tensor] = field(default_factory=list)  # every evaluation forward's input
    losses: list[float] = field(default_factory=list)  # per step: the loss summed over its samples
    gradients: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step, by parameter name
    indices: list[list[int]] = field(default_factory=list)  # per micro-batch, in-memory recipes only
    sample_keys: list[tuple[int, int]] = field(default_factory=list)  # (epoch, index) each loaded sample was seeded by
    logged_at: list[int] = field(default_factory=list)  # steps at which training metrics were logged
    attempts: list[int] = field(default_factory=list)  # per training input: how many times its step was handed out
    errors_raised: list[int] = field(default_factory=list)  # the steps error_at raised in
    # per optimizer step, in order (a step a rollback undoes included): its number, the LR of the
    # optimizer's first group and which optimizer took it (0 for the first the run tracked, then 1, ...)
    optimizer_steps: list[tuple[int, float, int]] = field(default_factory=list)
    stepping: bool = False
    loss_logged: float = 0.0  # the loss sums as the previous step left them

    def samples(self) -> list[list[int]]:
        """The sample indices of each training input, in order (in-memory recipes: the index
        tensors the loop gathered with; the others: the keys their PerSampleSeeded dataset got)."""
        if self.indices:
            return self.indices[: len(self.inputs)]
        keys, batches = iter(self.sample_keys), []
        for batch in self.inputs:
            batches.append([next(keys)[1] for _ in range(len(batch))])
        return batches

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((Path(self.cfg.run_dir) / "summary.json").read_text())


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """The global generators, the determinism switch and the thread count as they were before."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests' subprocesses run (OMP_NUM_THREADS=1): tiny tensors, shared cores
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def _whole(gradient: torch.Tensor) -> torch.Tensor:
    """A gradient as one plain CPU tensor (an FSDP2 shard is gathered: collective)."""
    full_tensor = getattr(gradient, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else gradient).detach().cpu().clone()


def _made_nan(output: Any) -> Any:
    """``output`` (a tensor, or a dict, tuple or list of them) with every floating-point tensor NaN."""
    if isinstance(output, torch.Tensor):
        return output * float("nan") if output.is_floating_point() else output
    if isinstance(output, dict):
        return type(output)((key, _made_nan(value)) for key, value in output.items())
    if isinstance(output, (tuple, list)):
        return type(output)(_made_nan(value) for value in output)
    return output


def _raising_in_backward(output: Any, error: BaseException) -> None:
    """Make the backward pass raise ``error`` when it reaches ``output`` (its first tensor that has a gradient)."""
    tensors = [output] if isinstance(output, torch.Tensor) else list(output.values()) if isinstance(output, dict) \
        else list(output)
    tensor = next(tensor for tensor in tensors if isinstance(tensor, torch.Tensor) and tensor.requires_grad)

    def hook(gradient: torch.Tensor) -> None:
        raise error

    tensor.register_hook(hook)


def probe(recipe: str, cfg: Any, steps: int | None = 0, dist_info: DistInfo = CPU,
          fixed_statistics: bool = False, nonfinite_at: int | None = None, error_at: int | None = None,
          error_in: str = "backward", error: type[BaseException] = torch.OutOfMemoryError) -> Probe:
    """Run ``recipe``'s ``train(cfg)`` until ``steps`` optimizer steps are done (0: until it asks
    for its first; None: to its end) and return what it built and did.

    ``fixed_statistics``: every training forward runs in eval mode (BatchNorm normalises with its
    running statistics; dropout and drop path are off), so that a step's gradient is the mean of
    per-sample gradients however its samples are cut into micro-batches and ranks."""
    train = importlib.import_module(f"recipes.{recipe}.train")
    seen = Probe(cfg)
    hooked: list[torch.optim.Optimizer] = []  # in the order the run tracked them (held: no id is reused)
    nonfinite_fired: list[int] = []
    handed_out: dict[int, int] = {}  # step: how many times run.steps() handed it out
    originals = {name: getattr(TrainingRun, name) for name in ("resume", "steps", "step_done", "log_train")}
    originals["load_sample"] = PerSampleSeeded.__getitem__
    compile_static = train.compile_static

    def record_compile(function: Any) -> Any:
        seen.compiled.append(function)
        return function  # not compiled: that the recipe asked for it is what is recorded

    def resume(run: TrainingRun) -> Any:
        seen.run = run
        seen.held_progress = originals["resume"](run)
        return seen.held_progress

    def before_forward(module: torch.nn.Module, args: tuple) -> None:
        if not seen.stepping:
            seen.eval_inputs.append(args[0].detach().clone())
            return
        if fixed_statistics:
            module.eval()
        seen.inputs.append(args[0].detach().clone())
        seen.epochs.append(seen.run.progress.epoch)
        seen.steps.append(seen.run.progress.step + 1)
        seen.attempts.append(handed_out.get(seen.run.progress.step + 1, 0))

    def after_forward(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        step = seen.run.progress.step + 1
        if seen.stepping and step == error_at and not seen.errors_raised:
            seen.errors_raised.append(step)
            raised = error("CUDA out of memory. Tried to allocate 2.00 GiB (raised by the test)")
            if error_in == "forward":
                raise raised
            _raising_in_backward(output, raised)
        if not seen.stepping or step != nonfinite_at or nonfinite_fired:
            return output
        nonfinite_fired.append(step)
        return _made_nan(output)

    def steps_of(run: TrainingRun, micro_batches: Any, to_device: Any = None) -> Iterator[Any]:
        if seen.micro_batches is None:
            seen.micro_batches = micro_batches
            if steps == 0:
                raise _Stop
            run.model.register_forward_pre_hook(before_forward)
            if nonfinite_at is not None or error_at is not None:
                run.model.register_forward_hook(after_forward)
        if not any(optimizer is run.optimizer for optimizer in hooked):  # dinov2's stages start a new one
            hooked.append(run.optimizer)
            names = {id(param): name for name, param in run.model.named_parameters()}
            ordinal = len(hooked) - 1

            def before_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
                seen.gradients.append({names[id(param)]: _whole(param.grad) for group in optimizer.param_groups
                                       for param in group["params"] if param.grad is not None})
                seen.optimizer_steps.append((seen.run.progress.step + 1, optimizer.param_groups[0]["lr"], ordinal))

            run.optimizer.register_step_pre_hook(before_optimizer_step)
        if isinstance(micro_batches, tuple):  # an in-memory recipe's index tensors: the rest of the epoch
            del seen.indices[len(seen.inputs):]  # handed out before a mid-epoch return or a rollback, never trained
            seen.indices += [batch.tolist() for batch in micro_batches]
        seen.stepping = True
        groups = originals["steps"](run, micro_batches, to_device)
        try:
            for group in groups:
                handed_out[run.progress.step + 1] = handed_out.get(run.progress.step + 1, 0) + 1
                yield group
        finally:
            groups.close()
            seen.stepping = False

    def step_done(run: TrainingRun, samples: int, grad_norm: torch.Tensor | None = None, *,
                  loss: torch.Tensor | None) -> None:
        summed = float(run.train_sums.state_dict().get("loss", torch.zeros(())).sum())
        seen.losses.append(summed - seen.loss_logged)
        seen.loss_logged = summed
        originals["step_done"](run, samples, grad_norm, loss=loss)
        if steps is not None and run.progress.step >= steps:
            raise _Stop

    def load_sample(dataset: PerSampleSeeded, key: tuple[int, int]) -> Any:
        if seen.stepping:
            seen.sample_keys.append(tuple(key))
        return originals["load_sample"](dataset, key)

    def log_train(run: TrainingRun, metrics: dict[str, float]) -> None:
        seen.logged_at.append(run.progress.step)
        seen.loss_logged = 0.0  # the loop has just reset its sums
        originals["log_train"](run, metrics)

    with _process_state_kept():
        for name, replacement in (("resume", resume), ("steps", steps_of), ("step_done", step_done),
                                  ("log_train", log_train)):
            setattr(TrainingRun, name, replacement)
        train.compile_static = record_compile
        PerSampleSeeded.__getitem__ = load_sample
        try:
            train.train(cfg, dist_info)
        except _Stop:
            pass
        except UserError as error:
            seen.error = str(error)
        finally:
            PerSampleSeeded.__getitem__ = originals.pop("load_sample")
            for name, original in originals.items():
                setattr(TrainingRun, name, original)
            train.compile_static = compile_static
            if seen.run is not None:
                seen.run.checkpoints.wait()
                seen.run.cadence.close()  # the SIGTERM/SIGUSR1 handlers it installed
                if seen.run.logger is not None:
                    seen.run.logger.close()
    return seen


class _Stop(Exception):
    """Raised inside the loop once the probe has seen what it was asked to."""
