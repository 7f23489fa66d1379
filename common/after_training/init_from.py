"""``init_from=<run dir | checkpoint folder | checkpoint | export>``: a new run's first weights.

- Takes the weights ``make export`` would write (the EMA where kept, FSDP shards consolidated),
  renamed through the export's names, so a run can start from another recipe's run of the same
  backbone (fungitastic from timm_imagenet).
- Every tensor of the model must be there with its shape, and nothing else; ``init_skip_head=true``
  leaves the classifier head (the recipe's ``head_names``) out, for a source trained on other classes.
- Only weights: optimizer, LR schedule, sampler and step start afresh, and a run resuming its own
  checkpoint never reads the source (:meth:`common.run.training_run.TrainingRun.resume`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.after_training.export import is_export, read_export_weights, read_metadata, rename
from common.after_training.trained import LATEST, checkpoint_weights, open_run
from common.errors import UserError
from common.recipes import load_recipe


def _source_weights(source: str) -> tuple[dict[str, torch.Tensor], str]:
    """The weights of ``source`` in export names, and a line saying what they are."""
    path = Path(source)
    if is_export(path):
        metadata = read_metadata(path)
        return read_export_weights(path, metadata), (f"the {metadata['weights']} weights of the {metadata['recipe']} "
                                                     f"export {path}")
    run = open_run(path, LATEST)
    weights, kind = checkpoint_weights(run.checkpoint)
    spec = load_recipe(run.recipe)
    weights = {key: value for key, value in weights.items() if not key.startswith(spec.training_only)}
    exported = rename(weights, spec.export_names(run.cfg.model), to_export=True)
    return exported, f"the {kind} weights of {run.checkpoint} ({run.recipe}, step {run.manifest['step']})"


def _model_shapes(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Size]:
    """Every tensor of the model's state and its whole shape (an FSDP shard's global shape)."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {key: value.shape for key, value in get_model_state_dict(model).items()}
    return {key: value.shape for key, value in model.state_dict().items()}


def initialize_model(model: torch.nn.Module, model_cfg: Any, recipe: str, source: str, skip_head: bool,
                     sharded: bool = False) -> str:
    """Load ``source``'s weights into ``model`` and return a line saying what was loaded.

    - ``model``: of ``recipe``, built from ``model_cfg``; ``sharded``: FSDP-sharded, then collective on every rank.
    - Raises ``UserError`` (one line) on the first tensor missing, misshapen or extra.
    """
    try:
        exported, description = _source_weights(source)
        target = load_recipe(recipe)
        renamed = rename(exported, target.export_names(model_cfg), to_export=False)
    except UserError as error:
        raise UserError(f"init_from={source}: {error}") from error
    head = tuple(target.head_names(model_cfg))
    heads = head if skip_head else ()
    state = {key: value for key, value in renamed.items() if not key.startswith(heads)}
    all_shapes = _model_shapes(model, sharded)
    kept = heads + target.training_only  # tensors the model keeps as built (training-only ones: the probe's heads)
    shapes = {key: shape for key, shape in all_shapes.items() if not key.startswith(kept)}
    strict = len(shapes) == len(all_shapes)  # every tensor of the model loaded
    for key, shape in shapes.items():
        hint = "; init_skip_head=true leaves the classifier head out" if key.startswith(head) else ""
        if key not in state:
            raise UserError(f"init_from={source} does not fit this model: it has no {key}{hint}")
        if state[key].shape != shape:
            raise UserError(f"init_from={source} does not fit this model: {key} is {list(state[key].shape)} there and "
                            f"{list(shape)} here{hint}")
    extra = [key for key in state if key not in shapes]
    if extra:
        raise UserError(f"init_from={source} does not fit this model: it has {extra[0]}, which this model has not"
                        f"{' (and ' + str(len(extra) - 1) + ' more)' if len(extra) > 1 else ''}")
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
    else:
        model.load_state_dict(state, strict=strict)
    left_out = f", without the classifier head ({', '.join(heads)})" if heads else ""
    return f"{description}{left_out}"
