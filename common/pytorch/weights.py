"""Pretrained weights read from a local copy, so a run (every ISC cycle) starts without the hub.

- ``make prep-<recipe>`` stores them in ``data/weights/<hub repository>/`` (``data_prep/weights.py``):
  transformers' ``save_pretrained`` layout, or timm's ``save_for_hf`` (``model.safetensors``, ``config.json``).
- The configs name that folder; this module reads it, or a single weights file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.errors import UserError

WEIGHTS_ROOT = Path("data/weights")
_WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")  # the first found is read


def missing(setting: str, value: str, recipe: str) -> UserError:
    """The one-line error for weights that are neither here nor reachable."""
    return UserError(f"{setting}={value} is not here: run `make prep-{recipe}` (it stores the weights there, from the "
                     f"hub, or from WEIGHTS=<dir or file> on a machine without it)")


def weights_file(path: Path) -> Path:
    """``path`` itself if it is a file, else the weights file of the folder."""
    if path.is_file():
        return path
    for name in _WEIGHTS_FILES:
        if (path / name).is_file():
            return path / name
    raise UserError(f"{path} holds no weights file ({', '.join(_WEIGHTS_FILES[:2])}, ...)")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a weights file, or of a folder's; ``UserError`` when there is none or it is unreadable.

    ``.safetensors``, or a torch file holding it at the top level or under ``model``/``state_dict``."""
    file = weights_file(path)
    try:
        state = load_file(str(file)) if file.suffix == ".safetensors" else torch.load(file, map_location="cpu",
                                                                                      weights_only=True)
    except Exception as error:  # a truncated or foreign file: report it, whatever the loader raised
        raise UserError(f"{file} is not a readable state dict ({str(error).splitlines()[0]})") from error
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise UserError(f"{file} does not hold a state dict")
    return state


def read_pretrained_cfg(path: Path) -> dict | None:
    """timm's ``pretrained_cfg`` (input size, mean, std, ...) from a folder's ``config.json``, if any."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("pretrained_cfg")
    except (json.JSONDecodeError, AttributeError) as error:
        raise UserError(f"{config} is not a timm config.json ({error})") from error
