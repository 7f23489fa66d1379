"""Store a recipe's pretrained weights where its config reads them (see ``common/pytorch/weights.py``).

A folder ``data/weights/<hub repository>/`` is filled from that hub repository when this machine
reaches the hub (``facebook/dinov2-small`` with transformers, ``timm/<model>.<tag>`` or any other
repository with timm), or from a local copy given with ``--weights`` (``WEIGHTS=`` in make): a
folder in the same layout (transformers' ``save_pretrained``, timm's ``save_for_hf``) or, for
timm, a single weights file. The copy is written beside the folder and renamed into place, so an
interrupted prep never leaves a half folder that a run would take for weights.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from omegaconf import DictConfig

from common.errors import UserError
from common.pytorch.weights import WEIGHTS_ROOT, read_state_dict


def recipe_config(recipe: str, overrides: list[str]) -> DictConfig:
    """The recipe's config with these overrides (``+experiment=<preset>``, ...), as a run would see it."""
    from common.entry import compose_config

    return compose_config(recipe, overrides)


def hub_repository(target: Path) -> str:
    """The hub repository a folder under ``data/weights/`` is the local copy of."""
    try:
        return str(target.relative_to(WEIGHTS_ROOT))
    except ValueError:
        raise UserError(f"{target} is not under {WEIGHTS_ROOT}/, so it names no hub repository: give "
                        f"WEIGHTS=<dir or file> to fill it from a local copy") from None


def _store_timm(partial: Path, source: Path | None, target: Path) -> None:
    from safetensors.torch import save_file

    if source is None:
        import timm
        from timm.models import save_for_hf

        repository = hub_repository(target)
        try:
            model = timm.create_model(f"hf-hub:{repository}", pretrained=True)
        except Exception as error:  # hub errors come in many types (offline, missing repository, auth)
            raise _unreachable(repository, error) from error
        save_for_hf(model, str(partial), safe_serialization=True)
        return
    partial.mkdir(parents=True)
    state = {name: tensor.contiguous() for name, tensor in read_state_dict(source).items()}
    save_file(state, str(partial / "model.safetensors"))
    if source.is_dir() and (source / "config.json").is_file():
        shutil.copyfile(source / "config.json", partial / "config.json")


def _store_transformers(partial: Path, source: Path | None, target: Path) -> None:
    from transformers import AutoModel

    if source is not None and not source.is_dir():
        raise UserError(f"WEIGHTS={source} must be a folder written by save_pretrained (config.json and weights)")
    repository = hub_repository(target) if source is None else str(source)
    try:
        model = AutoModel.from_pretrained(repository)
    except (OSError, ValueError) as error:  # offline, no such repository, or not a model folder
        if source is not None:
            raise UserError(f"WEIGHTS={source} is not a save_pretrained folder ({str(error).splitlines()[0]})") \
                from error
        raise _unreachable(repository, error) from error
    model.save_pretrained(partial)


def _unreachable(repository: str, error: Exception) -> UserError:
    return UserError(f"could not fetch {repository} from the hub ({str(error).splitlines()[0]}); run this where the "
                     f"hub is reachable, or give WEIGHTS=<dir or file> with a local copy")


def store(target: Path, library: str, source: Path | None) -> str:
    """Fill ``target`` (timm or transformers layout) and say where the weights came from."""
    if source is None and target.is_dir():
        return "already there"
    if source is not None and not source.exists():
        raise UserError(f"WEIGHTS={source} does not exist")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if library == "transformers":
        _store_transformers(partial, source, target)
    else:
        _store_timm(partial, source, target)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return str(source) if source is not None else f"the hub ({hub_repository(target)})"
