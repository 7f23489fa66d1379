"""Average a run's kept checkpoints into one (timm's ``avg_checkpoints.py``), BatchNorm statistics recomputed.

    make average RUN=<run dir | checkpoint folder> (LAST=k | BEST=k) [BN_BATCHES=n] [ARGS=...]
    python -m common.after_training.average RUN (--last K | --best K) [--bn-batches N] [key=value ...]

- ``LAST=k``: the ``k`` newest steps kept (``checkpoint.keep_last``); ``BEST=k``: the ``k`` best by
  ``checkpoint.best_metric`` (kept with ``checkpoint.keep_best_k``).
- Their weights, the EMA where the run keeps one (what ``make export`` takes), are averaged elementwise in
  float64 and cast back; integer buffers (BatchNorm's ``num_batches_tracked``) are the newest's.
- A model with BatchNorm then gets its statistics recomputed for the averaged weights over ``--bn-batches``
  training batches (``torch.optim.swa_utils.update_bn``, the recipe's ``train_inputs``); 0 keeps the averages.
- Written as ``<checkpoint folder>/average-last-<k>`` (``average-best-<k>``), replaced whole: a checkpoint
  ``make eval``, ``make export`` and ``init_from=`` read by name, outside the AtomicDirectory layout, so
  no resume takes it and no retention deletes it.
- Checkpoints of another recipe, another model config or other tensors: one line, exit 2. docs/after-training.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import update_bn

from common.after_training.trained import LATEST, checkpoint_weights, open_run
from common.checkpoint.layout import (
    TMP_PREFIX,
    CheckpointDir,
    CheckpointError,
    best_checkpoints,
    committed_checkpoints,
    fsync_dir,
    verify_checkpoint,
)
from common.checkpoint.writer import write_checkpoint_files
from common.entry import distributed_process, exit_after, fail, user_message
from common.errors import UserError
from common.recipes import load_recipe

BN_BATCHES = 100  # default of --bn-batches: training batches for BatchNorm's statistics


def average_name(how: str, count: int) -> str:
    """``average-last-<k>`` or ``average-best-<k>``: the checkpoint directory an average is written to."""
    return f"average-{how}-{count}"


def newest_steps(folder: Path) -> list[CheckpointDir]:
    """The committed checkpoints of ``folder``, newest first, one per step (a step saved again: its newer one)."""
    steps_seen, newest = set(), []
    for found_dir in reversed(committed_checkpoints(folder)):
        if found_dir.step not in steps_seen:
            steps_seen.add(found_dir.step)
            newest.append(found_dir)
    return newest


def chosen_checkpoints(folder: Path, how: str, count: int, metric: str, mode: str) -> list[CheckpointDir]:
    """The ``count`` checkpoints ``how`` (``last`` or ``best``) names in ``folder``, newest first, verified."""
    if count < 1:
        raise UserError(f"{how.upper()}={count}: average at least one checkpoint")
    if how == "last":
        found = newest_steps(folder)
        hint = f"checkpoint.keep_last={count}"
    else:
        found = best_checkpoints(newest_steps(folder), metric, mode)
        hint = f"checkpoint.keep_best_k={count}"
    if len(found) < count:
        raise UserError(f"{how.upper()}={count}: {folder} keeps {len(found)} such checkpoint(s); train with "
                        f"{hint} to keep {count}, or average fewer")
    chosen = sorted(found[:count], key=lambda found_dir: found_dir.step, reverse=True)
    for found_dir in chosen:
        try:
            verify_checkpoint(found_dir.path)
        except CheckpointError as error:
            raise UserError(f"checkpoint {found_dir.path} is damaged ({error}): average others") from error
    return chosen


def _check_same_run(reference: CheckpointDir, other: CheckpointDir) -> None:
    """One line when ``other`` was saved by another recipe or with another model config than ``reference``."""
    config, other_config = reference.manifest.get("config", {}), other.manifest.get("config", {})
    if config.get("recipe") != other_config.get("recipe"):
        raise UserError(f"{other.path.name} is a {other_config.get('recipe')} checkpoint and {reference.path.name} a "
                        f"{config.get('recipe')} one: average checkpoints of one model")
    model, other_model = config.get("model", {}), other_config.get("model", {})
    for key in sorted(set(model) | set(other_model)):
        if model.get(key) != other_model.get(key):
            raise UserError(f"{other.path.name} has model.{key}={other_model.get(key)} and {reference.path.name} "
                            f"model.{key}={model.get(key)}: average checkpoints of one model")


def _check_same_tensors(reference: str, weights: dict[str, torch.Tensor], other: str,
                        other_weights: dict[str, torch.Tensor]) -> None:
    """One line naming the first tensor that one of two checkpoints lacks or holds in another shape."""
    for key in sorted(set(weights) | set(other_weights)):
        if key not in weights or key not in other_weights:
            has, lacks = (other, reference) if key in other_weights else (reference, other)
            raise UserError(f"{has} has the tensor {key} and {lacks} has not: average checkpoints of one model")
        if weights[key].shape != other_weights[key].shape:
            raise UserError(f"{key} is {list(other_weights[key].shape)} in {other} and {list(weights[key].shape)} "
                            f"in {reference}: average checkpoints of one model")


def average_weights(states: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The elementwise mean of ``states`` (same keys and shapes), accumulated in float64, in each tensor's dtype.

    - Read one at a time: the first state and the float64 sums are all that is held.
    - Tensors that are not floating point (counters) are the first state's: ``states`` come newest first.
    """
    first, totals, count = None, {}, 0
    for state in states:
        if first is None:
            first = state
            totals = {key: value.to(torch.float64) for key, value in state.items() if value.is_floating_point()}
        else:
            for key, total in totals.items():
                total += state[key].to(torch.float64)
        count += 1
    return {key: (totals[key] / count).to(value.dtype) if key in totals else value.clone()
            for key, value in first.items()}


def has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules())


def recompute_batchnorm(model: torch.nn.Module, inputs: Iterator[torch.Tensor], batches: int,
                        channels_last: bool, seed: int) -> int:
    """BatchNorm's statistics of ``model`` over the first ``batches`` of ``inputs`` (``update_bn``); how many it saw.
    The model runs in training mode, so dropout before a BatchNorm (DeepLabV3's head) draws from the global
    generators: seeded with ``seed``, the same checkpoints average to the same statistics every time."""
    seen = 0
    torch.manual_seed(seed)

    def counted() -> Iterator[torch.Tensor]:
        nonlocal seen
        for x in itertools.islice(inputs, batches):
            seen += 1
            yield x.contiguous(memory_format=torch.channels_last) if channels_last else x

    update_bn(counted(), model)
    return seen


def _write(folder: Path, name: str, state: dict[str, Any], manifest: dict[str, Any]) -> Path:
    """``state`` and ``manifest`` as the checkpoint directory ``folder/name``, replacing one of that name whole."""
    tmp, final = folder / f"{TMP_PREFIX}{name}", folder / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_checkpoint_files(tmp, state, manifest)
    if final.exists():
        doomed = folder / f"{TMP_PREFIX}deleting-{name}"
        os.rename(final, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(folder)
    return final


def average_run(source: str | Path, how: str, count: int, bn_batches: int = BN_BATCHES,
                overrides: tuple[str, ...] | list[str] = ()) -> Path:
    """Average ``count`` checkpoints of the run ``source`` (``how``: ``last`` or ``best``); the checkpoint written.

    - ``bn_batches``: training batches for BatchNorm's statistics; 0 keeps the averaged ones.
    - ``overrides``: ``key=value`` changes to the run's config (``data.root=`` where the data moved).
    """
    run = open_run(source, LATEST, overrides)
    folder = Path(run.cfg.checkpoint.dir)
    chosen = chosen_checkpoints(folder, how, count, run.cfg.checkpoint.best_metric, run.cfg.checkpoint.best_mode)
    newest, kind = checkpoint_weights(chosen[0].path)

    def checked_states() -> Iterator[dict[str, torch.Tensor]]:
        """Each chosen checkpoint's weights, read when the average reaches it, checked against the newest's."""
        yield newest
        for found_dir in chosen[1:]:
            _check_same_run(chosen[0], found_dir)
            weights, its_kind = checkpoint_weights(found_dir.path)
            _check_same_tensors(chosen[0].path.name, newest, found_dir.path.name, weights)
            if its_kind != kind:
                raise UserError(f"{found_dir.path.name} holds {its_kind} weights and {chosen[0].path.name} {kind} "
                                f"weights: average checkpoints of one run")
            yield weights

    averaged = average_weights(checked_states())
    bn_seen = 0
    if bn_batches:
        spec = load_recipe(run.recipe)
        with distributed_process(run.cfg, **spec.process_group(run.cfg)) as dist_info:
            model = spec.model_as_trained(run.cfg, dist_info, False)
            if has_batchnorm(model):
                if spec.train_inputs is None:
                    raise UserError(f"recipes/{run.recipe}/spec.py gives no train_inputs to recompute BatchNorm's "
                                    f"statistics from: average with BN_BATCHES=0 (--bn-batches 0) to keep the "
                                    f"averaged statistics")
                try:
                    model.load_state_dict(averaged)
                except RuntimeError as error:
                    raise UserError(f"the checkpoints of {folder} do not fit the model their config builds: "
                                    f"{str(error).strip().splitlines()[-1].strip()}") from error
                bn_seen = recompute_batchnorm(model, spec.train_inputs(run.cfg, dist_info), bn_batches,
                                              run.cfg.trainer.channels_last, run.cfg.seed)
                averaged = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    manifest = {"format": 2, "step": chosen[0].step, "metrics": {}, "milestone": None,
                "config": chosen[0].manifest.get("config"),
                "average": {"checkpoints": [found_dir.path.name for found_dir in chosen],
                            "steps": [found_dir.step for found_dir in chosen], "weights": kind,
                            "bn_batches": bn_seen}}
    return _write(folder, average_name(how, count), {"model": averaged}, manifest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.after_training.average", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the run directory or its checkpoint folder")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, help="average the K newest checkpoints")
    which.add_argument("--best", type=int, help="average the K best checkpoints by checkpoint.best_metric")
    parser.add_argument("--bn-batches", type=int, default=BN_BATCHES,
                        help=f"training batches to recompute BatchNorm statistics on (default {BN_BATCHES}; 0: none)")
    parser.add_argument("overrides", nargs="*", help="key=value changes to the run's config, e.g. data.root=...")
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    how, count = ("last", args.last) if args.last is not None else ("best", args.best)
    try:
        if args.bn_batches < 0:
            raise UserError(f"--bn-batches {args.bn_batches}: give 0 or more training batches")
        written = average_run(args.run, how, count, args.bn_batches, args.overrides)
    except UserError as error:
        fail(user_message(error))
    average = verify_checkpoint(written)["average"]
    bn = f", BatchNorm statistics from {average['bn_batches']} training batches" if average["bn_batches"] else ""
    print(f"averaged the {average['weights']} weights of {', '.join(average['checkpoints'])} (steps "
          f"{', '.join(map(str, average['steps']))}){bn} into {written}; read it with WHICH={written.name}")


if __name__ == "__main__":
    exit_after(main)
