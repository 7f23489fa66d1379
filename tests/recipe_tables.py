"""The shared tests' entries for each recipe, read from the recipe itself: ``recipes/<r>/testing.py``.

The checks the suite runs for every recipe it finds (the key checks of ``tests/test_config_keys.py``
and the probes and tiny runs of ``tests/recipe_probe.py`` and ``tests/trained_runs.py``) take each
recipe's entries from the recipe's folder, not from a table under ``tests/`` keyed by its name: a
recipe copied with ``make new-recipe`` carries its original's declaration and is checked as the
original is, with no edit here. (Tests about chosen recipes, such as FSDP2 on timm_imagenet and
fungitastic, still name them.) ``testing.py`` holds plain data (it imports nothing) under these names:

* ``TINY``: overrides for tiny, fast runs on a CPU (this module adds :data:`COMMON`);
* ``TINY_DATA``: ``{key: maker}``, the keys that point at the tiny data and, for each, the function
  of ``tests/trained_runs.py`` that writes it once per session (``{"data.root": "fashion_data"}``);
* ``TINY_SHARDS`` (the recipes that read shards): the function of ``tests/trained_runs.py`` that
  writes the tiny data as shards (``{shards}`` in a check's overrides);
* ``KEY_CHECKS``: ``{key: (observable, override)}`` or ``{key: (observable, override, context)}``:
  changing the key by ``override`` must change ``observable`` (an observable of
  ``tests/test_config_keys.py``), both runs having the overrides of the tuple ``context``. Keys that
  every recipe shares have their checks in ``tests/test_config_keys.py`` (``CHECKS``); one named
  here replaces the shared one for this recipe;
* ``NO_EFFECT_ON_A_CPU``: ``{key: why}``, the keys whose effect no CPU run can show.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(path.parent.name for path in (REPO / "recipes").glob("*/spec.py"))
COMMON = ["logging.backend=none", "logging.progress_bar=false", "checkpoint.every_seconds=0"]


def declaration(recipe: str) -> ModuleType | None:
    """``recipes/<recipe>/testing.py``, or None where the recipe has none."""
    try:
        return importlib.import_module(f"recipes.{recipe}.testing")
    except ModuleNotFoundError as error:
        if error.name != f"recipes.{recipe}.testing":
            raise
        return None


DECLARED = {recipe: module for recipe in RECIPES if (module := declaration(recipe)) is not None}

# recipe -> its tiny settings (the recipe's own, then the shared ones)
TINY: dict[str, list[str]] = {recipe: [*module.TINY, *COMMON] for recipe, module in DECLARED.items()}


def _declared(recipe: str) -> ModuleType:
    if recipe not in DECLARED:
        raise KeyError(f"recipes/{recipe}/testing.py is missing: copy one from a recipe like it "
                       f"(tests/recipe_tables.py says what it holds)")
    return DECLARED[recipe]


def tiny_data(recipe: str) -> dict[str, str]:
    """``{key: maker}``: the keys of ``recipe`` that point at its tiny data, and the function of
    ``tests/trained_runs.py`` that writes each."""
    return dict(_declared(recipe).TINY_DATA)


def tiny_shards(recipe: str) -> str:
    """The function of ``tests/trained_runs.py`` that writes ``recipe``'s tiny data as shards."""
    maker = getattr(_declared(recipe), "TINY_SHARDS", None)
    if maker is None:
        raise KeyError(f"recipes/{recipe}/testing.py names no TINY_SHARDS: the recipe reads no shards")
    return maker


def key_checks(recipe: str) -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """``{key: (observable, change, context)}`` from ``recipe``'s ``KEY_CHECKS``; a declaration
    of another form is named, with its recipe."""
    checks = {}
    for key, declared in _declared(recipe).KEY_CHECKS.items():
        parts = declared if isinstance(declared, tuple) and len(declared) in (2, 3) else (None, None)
        observable, change, context = (*parts, ())[:3]
        if not (isinstance(observable, str) and isinstance(change, str) and isinstance(context, tuple)
                and all(isinstance(override, str) for override in context)):
            raise TypeError(f"recipes/{recipe}/testing.py: KEY_CHECKS[{key!r}] is {declared!r}, not "
                            f"(observable, override) or (observable, override, (context overrides, ...))")
        checks[key] = (observable, (change,), context)
    return checks


def no_effect_on_a_cpu(recipe: str) -> dict[str, Any]:
    """``{key: why}`` from ``recipe``'s ``NO_EFFECT_ON_A_CPU``."""
    return dict(_declared(recipe).NO_EFFECT_ON_A_CPU)
