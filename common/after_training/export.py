"""Export a run's weights for use elsewhere: safetensors files and a small ``metadata.json``.

    make export RUN=<run dir | checkpoint folder | checkpoint> [WHICH=latest|best|<name>] [OUT=<folder>] [ARGS=...]
    python -m common.after_training.export RUN [--which W] [--out DIR] [key=value ...]

- Weights are named as the model's library names them (timm, torchvision and transformers load the
  file as it is), FSDP shards consolidated, the EMA where the recipe keeps one.
- ``metadata.json`` holds what rebuilding needs and where the weights came from; :func:`load_export`
  rebuilds the model from the folder alone, and the export reads itself back so before it reports success.
- Recipe-specific parts come from the recipe's ``SPEC`` (``recipes/<recipe>/spec.py``). docs/after-training.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from common import jsonfiles
from common.after_training.trained import TrainedRun, add_run_arguments, checkpoint_weights, open_run, read_state
from common.checkpoint.layout import MANIFEST_FILE
from common.config import plain_config
from common.entry import CONFIG_ERRORS, config_error_line, exit_after, fail, recipe_schema, user_message
from common.errors import UserError
from common.recipes import load_recipe
from common.records.summary import state_digest

_METADATA_FILE = "metadata.json"
_WEIGHTS_FILE = "model.safetensors"
_EXPORT_FORMAT = 2  # 2: fungitastic names taxonomic levels "levels" (was "ranks")


def rename(state: dict[str, Any], prefixes: list[tuple[str, str]], to_export: bool) -> dict[str, Any]:
    """``state`` with each key's longest matching prefix replaced: model to export names (``to_export``) or back."""
    pairs = sorted(((model, export) if to_export else (export, model) for model, export in prefixes),
                   key=lambda pair: len(pair[0]), reverse=True)
    renamed = {}
    for key, value in state.items():
        match = next((pair for pair in pairs if key.startswith(pair[0])), None)
        if match is None:
            raise UserError(f"the tensor {key} has none of the expected name prefixes "
                            f"({', '.join(repr(pair[0]) for pair in pairs)})")
        renamed[match[1] + key[len(match[0]) :]] = value
    return renamed


def _model_config(recipe: str, saved: dict[str, Any]) -> Any:
    """A recipe's ``model`` node (its schema's dataclass) from plain data, checked against the schema."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(recipe_schema(recipe)).model, saved))
    except CONFIG_ERRORS as error:
        raise UserError(f"the model config of this {recipe} export: {config_error_line(error)}") from error


def timm_classifiers(model_name: str) -> tuple[str, ...]:
    """The classifier names of a timm model (``pretrained_cfg["classifier"]``: ``fc``, ``head``, ...)."""
    import timm
    from timm.models import get_pretrained_cfg_value

    try:
        classifier = get_pretrained_cfg_value(model_name, "classifier")
    except RuntimeError:  # a name with no registered config (hf-hub:...): build it without weights to ask
        with torch.device("meta"):
            classifier = timm.create_model(model_name, pretrained=False).pretrained_cfg.get("classifier")
    classifier = classifier or "head"
    return (classifier,) if isinstance(classifier, str) else tuple(classifier)


def timm_loading(model_name: str, num_classes: int, input_size: list[int], mean: Any, std: Any,
                 kwargs: dict[str, Any] | None = None, **data_config: Any) -> dict[str, Any]:
    """The ``timm`` entry of ``metadata.json``, from which timm rebuilds the model alone.

    - ``timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=dict(file=<model.safetensors>,
      **pretrained_cfg_overlay), **kwargs)`` builds it with these weights (``num_classes`` keeps the head).
    - ``timm.data.resolve_data_config(model=...)`` then returns this normalisation and ``data_config``.
    """
    return {"model_name": model_name, "kwargs": dict(kwargs or {}),
            "pretrained_cfg_overlay": {"num_classes": num_classes, "input_size": list(input_size),
                                       "mean": list(mean), "std": list(std), **data_config}}


def _safetensors_ready(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses that)."""
    seen: set[int] = set()
    ready = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        ready[key] = tensor
    return ready


def _readable_as_umask_allows(folder: Path) -> None:
    """Give ``folder``'s files the umask's permissions: safetensors writes 0600, and exports are shared."""
    umask = os.umask(0)
    os.umask(umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def export_run(run: TrainedRun, out: Path) -> Path:
    """Write ``run``'s chosen checkpoint as an export in ``out`` (replaced whole, atomically)."""
    from safetensors.torch import save_file

    spec = load_recipe(run.recipe)
    weights, kind = checkpoint_weights(run.checkpoint, read_state(run.checkpoint))
    weights = {key: value for key, value in weights.items() if not key.startswith(spec.training_only)}
    exported = rename(weights, spec.export_names(run.cfg.model), to_export=True)
    files: dict[str, dict[str, torch.Tensor]] = {}
    routes = sorted(spec.export_files.items(), key=lambda route: len(route[0]), reverse=True)
    for key, tensor in exported.items():
        file = next((name for prefix, name in routes if key.startswith(prefix)), _WEIGHTS_FILE)
        files.setdefault(file, {})[key] = tensor
    manifest_sha = hashlib.sha256((run.checkpoint / MANIFEST_FILE).read_bytes()).hexdigest()
    metadata = {
        "format": _EXPORT_FORMAT,
        "recipe": run.recipe,
        "weights": kind,
        "files": sorted(files),
        "model": plain_config(run.cfg.model),
        **spec.export_metadata(run.cfg),
        "metrics": run.manifest.get("metrics", {}),
        "source": {"run_dir": str(run.run_dir.resolve()), "checkpoint": str(run.checkpoint.resolve()),
                   "step": run.manifest["step"], "manifest_sha256": manifest_sha,
                   "weights_digest": state_digest(weights)},
    }
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    header = {"format": "pt", "recipe": run.recipe, "weights": kind}  # "format": what transformers' loader expects
    for file, state in files.items():
        save_file(_safetensors_ready(state), str(tmp / file), metadata=header)
    if spec.write_export_extras is not None:
        spec.write_export_extras(run.cfg, tmp, metadata)
    (tmp / _METADATA_FILE).write_text(jsonfiles.dumps(metadata, indent=2) + "\n")
    _readable_as_umask_allows(tmp)
    model, _ = load_export(tmp)  # the export rebuilds the model by itself, with exactly these weights
    if state_digest(model.state_dict()) != metadata["source"]["weights_digest"]:
        raise RuntimeError(f"the model rebuilt from {tmp} does not hold the checkpoint's weights")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def is_export(folder: Path) -> bool:
    return (folder / _METADATA_FILE).is_file() and (folder / _WEIGHTS_FILE).is_file()


def read_metadata(folder: Path) -> dict[str, Any]:
    try:
        metadata = json.loads((folder / _METADATA_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{folder / _METADATA_FILE} is not readable ({error}): export the run again") from error
    if metadata.get("format") != _EXPORT_FORMAT:
        raise UserError(f"{folder} is an export of format {metadata.get('format')}; this version reads "
                        f"{_EXPORT_FORMAT}: export the run again")
    return metadata


def read_export_weights(folder: Path, metadata: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of an export, in its export names."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in metadata["files"]:
        try:
            state |= load_file(str(folder / file))
        except (OSError, ValueError, RuntimeError) as error:  # missing, truncated or not safetensors
            raise UserError(f"{folder / file} is not a readable safetensors file ({error})") from error
    return state


def load_export(folder: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of an export, rebuilt from the folder alone, with its weights, in eval mode; and its metadata."""
    folder = Path(folder)
    metadata = read_metadata(folder)
    spec = load_recipe(metadata["recipe"])
    model_cfg = _model_config(metadata["recipe"], metadata["model"])
    model = spec.model_from_export(model_cfg, metadata, folder)
    state = rename(read_export_weights(folder, metadata), spec.export_names(model_cfg), to_export=False)
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise UserError(f"{folder} does not fit the {metadata['recipe']} model its metadata describes: "
                        f"{str(error).strip().splitlines()[-1].strip()}") from error
    return model.eval(), metadata


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.after_training.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--out", default="", help="the export folder (default: <run dir>/export-<which>)")
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        run = open_run(args.run, args.which, args.overrides)
        out = export_run(run, Path(args.out) if args.out else run.run_dir / f"export-{run.which}")
    except UserError as error:
        fail(user_message(error))
    metadata = read_metadata(out)
    print(f"exported {metadata['weights']} weights of {run.checkpoint} (step {run.manifest['step']}) to {out}: "
          f"{', '.join(metadata['files'])}, {_METADATA_FILE}")


if __name__ == "__main__":
    exit_after(main)
