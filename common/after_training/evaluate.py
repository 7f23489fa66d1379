"""Evaluation: how every recipe's evaluation handles its model, and ``make eval``.

    make eval RUN=<run dir | checkpoint folder | checkpoint> [WHICH=latest|best|<name>] [SPLIT=...] [ARGS=...]
    python -m common.after_training.evaluate RUN [--which W] [--split S] [key=value ...]     (also under torchrun)

- The recipe comes from the run's own config (``common/after_training/trained.py``); its ``SPEC``
  (``recipes/<recipe>/spec.py``) builds the model and evaluates the split as training does.
- docs/after-training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from common.after_training.trained import TrainedRun, add_run_arguments, load_model, open_run, read_state
from common.entry import distributed_process, exit_after, fail, user_message
from common.errors import UserError
from common.jsonfiles import write_json
from common.pytorch.distributed import DistInfo, broadcast_buffers
from common.pytorch.fsdp import is_sharded
from common.pytorch.metrics import SumMetrics, add_classification, classification_metrics
from common.pytorch.precision import autocast
from common.recipes import RecipeSpec, load_recipe


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The block a recipe's ``evaluate`` runs in: eval mode and no gradients, the mode restored after.

    Broadcasts rank 0's buffers first (collective): BatchNorm statistics differ across ranks after a step, and rank
    0's are the ones checkpointed."""
    was_training = model.training
    broadcast_buffers(model)
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def most_batches(num_samples: int, world_size: int, batch_size: int) -> int:
    """How many batches rank 0, the busiest rank, evaluates under ``ResumableDistributedSampler(drop_last=False)``."""
    return math.ceil(math.ceil(num_samples / world_size) / batch_size)


def model_outputs(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, Any]], device: torch.device,
                  precision: str, channels_last: bool, forwards: int = 0) -> Iterator[tuple[Any, Any]]:
    """The loop of every recipe's evaluation: yields ``(model output, targets)`` for each batch.

    - Runs in :func:`evaluating`'s block, channels-last where the run trains so, under the run's autocast.
    - ``forwards`` (:func:`most_batches`): an FSDP2-sharded model gathers its weights collectively in
      every forward, so a rank with fewer batches repeats its last input (output unused) up to that many.
    - Raises ``UserError`` when a sharded rank has no sample at all.
    """
    last = None
    made = 0
    with evaluating(model):
        for x, targets in batches:
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with autocast(device, precision):
                output = model(x)
            last, made = x, made + 1
            yield output, targets
        if made < forwards and is_sharded(model):
            if last is None:
                raise UserError("this rank has no sample of the split to evaluate, and the other ranks' sharded "
                                "model needs its forward passes: evaluate on fewer ranks")
            for _ in range(forwards - made):
                with autocast(device, precision):
                    model(last)


def classification_scores(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                          device: torch.device, precision: str, channels_last: bool, prefix: str,
                          forwards: int = 0) -> dict[str, float]:
    """``<prefix>/loss``, ``/top1`` and ``/top5`` over ``batches`` of (input, labels), each sample once.

    Collective: summed over ranks; a rank with no batch still joins. ``forwards``: see :func:`model_outputs`."""
    sums = SumMetrics(device)
    sums.add(loss=0.0, top1=0, top5=0, count=0)
    for logits, labels in model_outputs(model, batches, device, precision, channels_last, forwards):
        add_classification(sums, logits, labels)
    return classification_metrics(sums.reduce(), prefix)


def metric_prefix(of_ema: bool, name: str = "eval") -> str:
    """How an evaluation's metrics are named: ``eval/top1``, or ``eval_ema/top1`` for the EMA's."""
    return f"{name}_ema" if of_ema else name


def _evaluate_run(run: TrainedRun, spec: RecipeSpec, split: str, dist_info: DistInfo) -> dict[str, Any]:
    """Evaluate the checkpoint's model (and its EMA, if kept) on ``split`` on every rank; the report."""
    evaluate = spec.evaluator(run.cfg, dist_info, split)
    model = spec.model_as_trained(run.cfg, dist_info, False)
    state = read_state(run.checkpoint)
    ema_state = state.get("extra", {}).get("ema")
    ema_model = copy.deepcopy(model) if ema_state is not None else None
    load_model(model, run.checkpoint, state)
    metrics = evaluate(model)
    if ema_model is not None:
        ema_model.load_state_dict(ema_state)
        metrics |= evaluate(ema_model, of_ema=True)
    return {"recipe": run.recipe, "split": split, "which": run.which, "checkpoint": str(run.checkpoint.resolve()),
            "step": run.manifest["step"], "metrics_at_save": run.manifest.get("metrics", {}), "metrics": metrics,
            "world_size": dist_info.world_size}


def eval_file_name(split: str, which: str) -> str:
    return f"eval-{split}-{which}.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.after_training.evaluate",
                                     description="Evaluate a checkpoint of a run on one split of its data.")
    add_run_arguments(parser)
    parser.add_argument("--split", default="", help="a split of the recipe's data (default: the one training uses)")
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        run = open_run(args.run, args.which, args.overrides)
        spec = load_recipe(run.recipe)
        split = args.split or spec.splits[0]
        if split not in spec.splits:
            raise UserError(f"{run.recipe} has no {split} split to evaluate: its data has {', '.join(spec.splits)}")
        with distributed_process(run.cfg, **spec.process_group(run.cfg)) as dist_info:
            report = _evaluate_run(run, spec, split, dist_info)
            if dist_info.is_main:
                path = write_json(run.run_dir / eval_file_name(split, run.which), report)
                print(path.read_text(), end="")
                print(f"written to {path}", flush=True)
    except UserError as error:
        fail(user_message(error))


if __name__ == "__main__":
    exit_after(main)
