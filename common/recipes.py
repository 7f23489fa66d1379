"""Each recipe as the shared tools see it, declared in one place: ``recipes/<recipe>/spec.py``.

- ``SPEC = RecipeSpec(...)`` (as torchtitan's ``ModelSpec``): the config schema, the model as
  training builds it, the evaluation of a split, the names its tensors have outside it.
- Read by ``python -m recipes.<r>.train`` (schema, process group), ``make eval``, ``make export``,
  ``make predict``, ``make average`` and ``init_from=``.
- The functions it points at live in the recipe: the model in ``model.py``; the model as
  trained, the splits and their evaluation in ``spec.py`` itself, which ``train.py`` imports (one
  direction: ``spec.py`` imports nothing of ``train.py``, so the tools and the loop share one of each).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from common.config import RunConfig
from common.errors import UserError
from common.pytorch.distributed import DistInfo


class Evaluate(Protocol):
    """A split's evaluation, its data ready: the metrics of ``model`` over the whole split.

    - Each sample counted once across ranks.
    - ``of_ema``: ``model`` holds an EMA of the weights; the metrics are named for it (``eval_ema/top1``).
    """

    def __call__(self, model: nn.Module, of_ema: bool = False) -> dict[str, float]: ...


@dataclass(frozen=True, kw_only=True)
class PredictInput:
    """How ``make predict`` feeds a recipe's model image files and reads its output, from an export's
    ``metadata.json`` alone (a run's is what its export would write): the recipe's evaluation transform.

    - ``decode``: one ``common.data.images.EncodedImage`` to uint8 ``[C, H, W]`` (in loader workers); raises
      ``UserError`` naming the file when it is not a readable image.
    - ``prepare``: a uint8 batch on the host to the model's input on the device.
    - ``scores``: the model's output to ``{level: scores}``, ``[B, classes]`` (or ``[B, classes, H, W]`` for a
      model with ``palette``), the class names of each level in ``classes``.
    - ``palette``: a per-pixel model's: the PNG palette its masks are written with (256 RGB triples, flat).
    - ``pad``: the uint8 colour that pads images of different sizes into one batch (None: they are all one size).
    """

    decode: Callable[[Any], torch.Tensor]
    prepare: Callable[[torch.Tensor], torch.Tensor]
    classes: dict[str, list[str]]
    scores: Callable[[Any], dict[str, torch.Tensor]]
    palette: list[int] | None = None
    pad: tuple[int, ...] | None = None


CLASS = "class"  # the level of a recipe with one classifier


def one_classifier(metadata: dict[str, Any], decode: Callable[[Any], torch.Tensor],
                   prepare: Callable[[torch.Tensor], torch.Tensor]) -> PredictInput:
    """The ``PredictInput`` of a model whose output is one ``[B, classes]`` tensor, named by ``metadata["classes"]``.
    (Here, not in ``make predict``'s module: a recipe's spec needs it, and training must not import the tool.)"""
    return PredictInput(decode=decode, prepare=prepare, classes={CLASS: list(metadata["classes"])},
                        scores=_one_level)


def _one_level(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    return {CLASS: logits}


def _no_process_group_options(cfg: Any) -> dict[str, Any]:
    return {}


def same_names(model_cfg: Any) -> list[tuple[str, str]]:
    """``export_names`` of a model whose export keeps its own tensor names: no prefix renamed."""
    return [("", "")]


@dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    """What the entry point and the shared tools call of a recipe (``cfg``: the recipe's schema, typed)."""

    schema: type[RunConfig]  # config.py's dataclass: every key and default of the recipe
    model_as_trained: Callable[[Any, DistInfo, bool], nn.Module]
    """``(cfg, dist_info, pretrained)``: the model as training holds it before DDP and compile.

    - On the device, FSDP-sharded where training shards it.
    - ``pretrained=False``: without the pretrained weights a checkpoint replaces anyway.
    """
    splits: tuple[str, ...]  # the splits its data has; the first is the one training evaluates
    evaluator: Callable[[Any, DistInfo, str], Evaluate]  # ``(cfg, dist_info, split)``: data ready, model to come
    export_names: Callable[[Any], list[tuple[str, str]]] = same_names
    """``(model_cfg)``: ``(prefix in the model, prefix in an export)`` pairs.

    - The export's names are those of the library the model comes from (timm, torchvision, transformers).
    - Default :func:`same_names`: the model's own names, nothing renamed.
    """
    head_names: Callable[[Any], list[str]]  # ``(model_cfg)``: the classifier's prefixes, in the model's names
    # prefixes of tensors only training uses (dinov2_fsdp's probe heads): an export and init_from leave them out
    training_only: tuple[str, ...] = ()
    export_metadata: Callable[[Any], dict[str, Any]]  # ``(cfg)``: input, classes, how a library loads it
    model_from_export: Callable[[Any, dict[str, Any], Path], nn.Module]  # ``(model_cfg, metadata, folder)``
    export_files: dict[str, str] = field(default_factory=dict)  # export name prefix -> file, beside model.safetensors
    predict_input: Callable[[dict[str, Any], torch.device], PredictInput]  # ``(export metadata, device)``
    write_export_extras: Callable[[Any, Path, dict[str, Any]], None] | None = None  # e.g. transformers' config.json
    train_inputs: Callable[[Any, DistInfo], Iterator[torch.Tensor]] | None = None
    """``(cfg, dist_info)``: training inputs as the model takes them, on the device, in the training sampler's order.

    - The recipe's normalisation without random augmentation: ``make average`` recomputes BatchNorm
      statistics from them (``common/after_training/average.py``). None: the recipe gives none.
    """
    process_group: Callable[[Any], dict[str, Any]] = _no_process_group_options
    """``(cfg)``: options for ``common.pytorch.distributed.init_distributed`` the model needs (FSDP2 on one GPU)."""


def load_recipe(recipe: str) -> RecipeSpec:
    """``recipes/<recipe>/spec.py``'s ``SPEC``, checked.

    - Raises :class:`UserError` in one line when the spec is missing, lacks a hook, or declares
      another recipe's schema (what a copied recipe may lack).
    """
    try:
        module = importlib.import_module(f"recipes.{recipe}.spec")
    except ModuleNotFoundError as error:
        if error.name not in (f"recipes.{recipe}", f"recipes.{recipe}.spec"):
            raise
        raise UserError(f"there is no recipe {recipe!r}: recipes/{recipe}/spec.py is missing "
                        f"(copy a recipe with `make new-recipe`)") from error
    except TypeError as error:  # RecipeSpec(...) without one of its hooks
        raise UserError(f"recipes/{recipe}/spec.py: {error}; every hook is described in common/recipes.py, and "
                        f"recipes/fashion_mnist/spec.py shows each one") from error
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, RecipeSpec):
        raise UserError(f"recipes/{recipe}/spec.py defines no SPEC = RecipeSpec(...) "
                        f"(see recipes/fashion_mnist/spec.py)")
    if spec.schema.recipe != recipe:
        raise UserError(f"recipes/{recipe}/spec.py declares the schema of {spec.schema.recipe!r}")
    return spec
