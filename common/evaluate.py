"""Evaluate a checkpoint of a finished (or running) run on one split, without training.

    make eval-<recipe> RUN=<run dir | checkpoint folder | checkpoint> [WHICH=latest|best|<name>] [SPLIT=...] [ARGS=...]
    python -m recipes.<recipe>.evaluate RUN [--which W] [--split S] [key=value ...]
    torchrun --nproc-per-node N -m recipes.<recipe>.evaluate RUN ...

The run's own config (``common/trained.py``) builds the model and the split's data with the
recipe's own code: ``recipes/<recipe>/evaluate.py`` returns an :class:`Evaluation` (the model,
built as training builds it, and the recipe's ``evaluate`` over the split with its evaluation
transform). The checkpoint's weights are loaded into it (FSDP shards on any number of ranks), its
EMA of the weights too when it keeps one (``eval_ema/*``), and the metrics, reduced exactly
across ranks, are written to ``eval-<split>-<which>.json`` in the run directory and printed.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.distributed import DistInfo
from common.entry import distributed_process, fail, user_message
from common.errors import UserError
from common.jsonfiles import write_json
from common.trained import LATEST, TrainedRun, load_model, open_run, read_state


@dataclass
class Evaluation:
    """What a recipe hands :func:`main` for one split."""

    model: torch.nn.Module  # built as training builds it (FSDP-sharded where training shards it)
    evaluate: Callable[[torch.nn.Module], dict[str, float]]  # the recipe's evaluation of this split
    evaluate_ema: Callable[[torch.nn.Module], dict[str, float]] | None = None  # ... of the EMA weights, if kept


def eval_file(run_dir: Path, split: str, which: str) -> Path:
    return Path(run_dir) / f"eval-{split}-{which}.json"


def parse_args(recipe: str, splits: tuple[str, ...], argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m recipes.{recipe}.evaluate",
                                     description=f"Evaluate a checkpoint of a {recipe} run on one split.")
    parser.add_argument("run", help="the run directory, its checkpoint folder, or one checkpoint directory")
    parser.add_argument("--which", default=LATEST, help="latest (default), best, or a checkpoint directory's name")
    parser.add_argument("--split", default=splits[0], help=f"{' or '.join(splits)} (default {splits[0]})")
    parser.add_argument("overrides", nargs="*", help="key=value changes to the run's config, e.g. data.root=...")
    return parser.parse_intermixed_args(argv)


def evaluate_run(run: TrainedRun, split: str, build: Callable[[Any, DistInfo, str], Evaluation],
                 dist_info: DistInfo) -> dict[str, Any]:
    """Build the recipe's evaluation of ``split``, load the checkpoint into it, evaluate (every
    rank) and return the report (metrics and where they came from)."""
    evaluation = build(run.cfg, dist_info, split)
    state = read_state(run.checkpoint)
    ema_state = state.get("extra", {}).get("ema")
    ema_model = copy.deepcopy(evaluation.model) if evaluation.evaluate_ema is not None and ema_state else None
    load_model(evaluation.model, run.checkpoint, state)
    metrics = evaluation.evaluate(evaluation.model)
    if ema_model is not None:
        ema_model.load_state_dict(ema_state)
        metrics |= evaluation.evaluate_ema(ema_model)
    return {"recipe": run.recipe, "split": split, "which": run.which, "checkpoint": str(run.checkpoint.resolve()),
            "step": run.manifest["step"], "metrics_at_save": run.manifest.get("metrics", {}), "metrics": metrics,
            "world_size": dist_info.world_size}


def main(recipe: str, splits: tuple[str, ...], build: Callable[[Any, DistInfo, str], Evaluation],
         process_group: Callable[[Any], dict[str, Any]] | None = None, argv: list[str] | None = None) -> None:
    """The entry point of ``recipes/<recipe>/evaluate.py``: ``splits`` are the ones its data has
    (the first is the default), ``build(cfg, dist_info, split)`` makes its :class:`Evaluation`;
    ``process_group(cfg)``: the process-group options its training uses
    (:func:`common.entry.distributed_process`)."""
    args = parse_args(recipe, splits, sys.argv[1:] if argv is None else argv)
    try:
        if args.split not in splits:
            raise UserError(f"{recipe} has no {args.split} split to evaluate: its data has {', '.join(splits)}")
        run = open_run(args.run, args.which, args.overrides)
        if run.recipe != recipe:
            raise UserError(f"{args.run} is a {run.recipe} run: use make eval-{run.recipe}")
        with distributed_process(run.cfg, **(process_group(run.cfg) if process_group else {})) as dist_info:
            report = evaluate_run(run, args.split, build, dist_info)
            if dist_info.is_main:
                path = write_json(eval_file(run.run_dir, args.split, run.which), report)
                print(path.read_text(), end="")
                print(f"written to {path}", flush=True)
    except UserError as error:
        fail(user_message(error))

