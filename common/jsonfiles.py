"""JSON as RFC 8259 has it: every JSON file the project writes goes through here.

- Never ``NaN`` or ``Infinity`` (Python's ``json`` writes them; ``jq``, JavaScript and strict
  parsers reject the whole file): a value that is not finite, a diverged loss, is ``null``.
- An object that had any lists their paths under ``"non_finite"`` (``["metrics.eval/loss"]``): a
  reader tells such a ``null`` from a value that was never there.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

NON_FINITE_KEY = "non_finite"


def _finite_or_none(value: Any, path: str, replaced: list[str]) -> Any:
    """``value`` with every float that is not finite (nested in dicts, lists, tuples) as None.

    - Appends the dotted path of each one replaced to ``replaced``.
    """
    if isinstance(value, float) and not math.isfinite(value):
        replaced.append(path)
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item, f"{path}.{key}" if path else str(key), replaced)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item, f"{path}[{index}]", replaced) for index, item in enumerate(value)]
    return value


def dumps(obj: Any, **options: Any) -> str:
    """``json.dumps`` that never writes NaN or Infinity (see the module)."""
    replaced: list[str] = []
    converted = _finite_or_none(obj, "", replaced)
    if replaced and isinstance(converted, dict):
        converted[NON_FINITE_KEY] = replaced
    return json.dumps(converted, allow_nan=False, **options)


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` to ``path`` as indented JSON (:func:`dumps`, keys sorted); returns ``path``.

    - Atomic: a temporary file of this process's own, renamed over ``path``; processes writing the
      same file (the workers of a search, its study.json) each replace it whole.
    - Creates the parent folders.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
