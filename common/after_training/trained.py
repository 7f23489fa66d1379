"""A trained run read back: its config, its checkpoints, the weights in them.

``make eval-<recipe>``, ``make export`` and ``init_from=`` name a run in one of three ways:

- its run directory (``runs/<recipe>/<name>``, holding ``.hydra/config.yaml``);
- its checkpoint folder (``<run>/checkpoints``, or the ISC's ``CHECKPOINT_ARTIFACT_PATH``
  downloaded on its own), holding ``AtomicDirectory_checkpoint_<N>`` directories;
- one checkpoint directory (``AtomicDirectory_checkpoint_<N>[_force]``, or ``average-last-<k>`` /
  ``average-best-<k>``, which ``make average`` writes into the checkpoint folder).

The config is the run's own (``.hydra/config.yaml``, else the checkpoints' copy), checked against the
recipe's schema as it is now, overrides on top. Nothing here writes: a run still training can be read.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from common.checkpoint.layout import (
    AVERAGE_DIR,
    CHECKPOINT_DIR,
    MANIFEST_FILE,
    NAME,
    SHARDED_DIR,
    STATE_FILE,
    CheckpointError,
    best_checkpoint,
    checkpoint_dirs,
    committed_checkpoints,
    newest_valid_checkpoint,
    verify_checkpoint,
)
from common.config import RunConfig
from common.entry import CONFIG_ERRORS, CONFIG_FOLDER, check_resolves, config_error_line, recipe_schema, typed_config
from common.errors import UserError
from common.pytorch.fsdp import is_sharded

CONFIG_FILE = Path(CONFIG_FOLDER) / "config.yaml"
LATEST, BEST = "latest", "best"  # WHICH=: the newest valid checkpoint, the best by checkpoint.best_metric


@dataclass
class TrainedRun:
    """A run and the checkpoint chosen from it."""

    cfg: RunConfig  # the run's config (its recipe's schema), with ``run_dir`` and ``checkpoint.dir`` where they are now
    checkpoint: Path  # the chosen checkpoint directory (verified)
    manifest: dict[str, Any]  # its manifest: step, metrics, files and their sha256
    which: str  # latest, best or the checkpoint's name, as asked

    @property
    def recipe(self) -> str:
        return self.cfg.recipe

    @property
    def run_dir(self) -> Path:
        """Where files about the run go: the run directory, the checkpoint folder that came alone, or ``run_dir=``."""
        return Path(self.cfg.run_dir)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every command on a trained run takes: the run, ``--which`` checkpoint, and
    ``key=value`` overrides of its config (for :func:`open_run`)."""
    parser.add_argument("run", help="the run directory, its checkpoint folder, or one checkpoint directory")
    parser.add_argument("--which", default=LATEST, help="latest (default), best, or a checkpoint directory's name "
                                                         "(average-last-<k> too)")
    parser.add_argument("overrides", nargs="*", help="key=value changes to the run's config, e.g. data.root=...")


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is one a checkpoint directory is read by: a saved one's, or an average's."""
    return bool(CHECKPOINT_DIR.match(name) or AVERAGE_DIR.match(name))


def open_run(source: str | Path, which: str = LATEST, overrides: Sequence[str] = ()) -> TrainedRun:
    """The run ``source`` names (see the module) and its chosen checkpoint.

    - ``which``: ``latest`` (newest valid), ``best`` (by ``checkpoint.best_metric``) or a checkpoint's name
      (an average's too: never ``latest`` or ``best``).
    - ``overrides``: ``key=value`` changes to the run's config.
    - Raises a one-line :class:`UserError` for every problem.
    """
    path = Path(source)
    if not path.exists():
        raise UserError(f"{path} does not exist: name a run directory, its checkpoint folder or one checkpoint")
    named = None
    if is_checkpoint_name(path.name) and (path / MANIFEST_FILE).is_file():
        if which not in (LATEST, path.name):
            raise UserError(f"{path} is one checkpoint, so WHICH={which} does not apply: name its folder "
                            f"{path.parent} instead")
        folder, named = path.parent, path.name
    elif checkpoint_dirs(path):
        folder = path
    elif (path / CONFIG_FILE).is_file():
        folder = None
    else:
        raise UserError(f"{path} is neither a run directory (no {CONFIG_FILE}), a checkpoint folder nor a checkpoint "
                        f"({NAME}_checkpoint_<N>)")
    if folder is None:
        run_dir, saved = path, OmegaConf.load(path / CONFIG_FILE)
    elif (folder.parent / CONFIG_FILE).is_file():
        run_dir, saved = folder.parent, OmegaConf.load(folder.parent / CONFIG_FILE)
    else:
        run_dir, saved = folder, _saved_config(folder)
    cfg = _run_config(saved, run_dir, folder, overrides)
    checkpoints = Path(cfg.checkpoint.dir)
    chosen = named or which
    checkpoint, manifest = _choose_checkpoint(checkpoints, chosen, cfg.checkpoint.best_metric, cfg.checkpoint.best_mode)
    return TrainedRun(cfg=typed_config(cfg), checkpoint=checkpoint, manifest=manifest, which=chosen)


def _saved_config(folder: Path) -> dict[str, Any]:
    """The config the newest checkpoint of ``folder`` that holds one was saved with."""
    for found in reversed(committed_checkpoints(folder)):
        if isinstance(found.manifest.get("config"), dict):
            return found.manifest["config"]
    raise UserError(f"the checkpoints in {folder} hold no config (they were saved before checkpoints did): name "
                    f"the run directory instead, with checkpoint.dir={folder} among the overrides")


def _run_config(saved: Any, run_dir: Path, checkpoint_dir: Path | None, overrides: Sequence[str]) -> DictConfig:
    """``saved`` checked against its recipe's schema, relocated to ``run_dir`` (and ``checkpoint_dir``), overridden."""
    recipe = saved.get("recipe") if hasattr(saved, "get") else None
    if not isinstance(recipe, str):
        raise UserError(f"the config of {run_dir} names no recipe")
    schema = recipe_schema(recipe)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), saved)
        cfg.run_dir = str(run_dir)
        if checkpoint_dir is not None:
            cfg.checkpoint.dir = str(checkpoint_dir)
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override.removeprefix("+") for override in overrides]))
    except CONFIG_ERRORS as error:
        raise UserError(f"the config of {run_dir} with {' '.join(overrides) or 'no overrides'}: "
                        f"{config_error_line(error)}") from error
    check_resolves(cfg)
    return cfg


def _choose_checkpoint(folder: Path, which: str, best_metric: str, best_mode: str) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory ``which`` names in ``folder`` and its verified manifest."""
    if not checkpoint_dirs(folder):
        raise UserError(f"no checkpoints in {folder}: where they lie elsewhere (the ISC's CHECKPOINT_ARTIFACT_PATH), "
                        f"name that folder, or set checkpoint.dir=<it> among the overrides")
    if which == LATEST:
        found = newest_valid_checkpoint(folder)
        if found is None:
            raise UserError(f"no valid checkpoint in {folder}: every one is damaged or incomplete")
        return found
    if which == BEST:
        best = best_checkpoint(committed_checkpoints(folder), best_metric, best_mode)
        if best is None:
            raise UserError(f"no checkpoint in {folder} has {best_metric} (checkpoint.best_metric): use WHICH=latest")
        path = best.path
    else:
        path = folder / which
        if not is_checkpoint_name(which) or not path.is_dir():
            names = ", ".join([*(found.path.name for found in committed_checkpoints(folder)),
                               *sorted(found.name for found in folder.iterdir() if AVERAGE_DIR.match(found.name))])
            raise UserError(f"WHICH={which} is not latest, best or a checkpoint in {folder} ({names})")
    try:
        return path, verify_checkpoint(path)
    except CheckpointError as error:
        raise UserError(f"checkpoint {path} is damaged ({error})") from error


# ---- weights ----------------------------------------------------------------------------------


def read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's ``state.pt`` on the CPU (tensors and plain data only)."""
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)


def _consolidated_shards(sharded: Path, key: str = "model") -> dict[str, torch.Tensor]:
    """Entry ``key`` of a ``torch.distributed.checkpoint`` folder as whole CPU tensors; no collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(sharded))
    prefix = f"{key}."
    state = {name[len(prefix) :]: torch.empty(item.size, dtype=item.properties.dtype)
             for name, item in reader.read_metadata().state_dict_metadata.items()
             if name.startswith(prefix) and isinstance(item, TensorStorageMetadata)}
    with warnings.catch_warnings():  # no_dist=True is this reader's choice, not a mistake to warn about
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: state}, storage_reader=reader, no_dist=True)
    return state


def checkpoint_weights(checkpoint: Path, state: dict[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """A checkpoint's weights for use elsewhere, whole on the CPU: the EMA (``"ema"``) if kept, else ``"model"``.

    ``state``: the checkpoint's ``state.pt`` if already read.
    """
    state = read_state(checkpoint) if state is None else state
    ema = state.get("extra", {}).get("ema")
    if ema is not None:
        return dict(ema), "ema"
    if (checkpoint / SHARDED_DIR).is_dir():
        return _consolidated_shards(checkpoint / SHARDED_DIR), "model"
    return dict(state["model"]), "model"


def load_model(model: torch.nn.Module, checkpoint: Path, state: dict[str, Any]) -> None:
    """Load a checkpoint's model weights into ``model`` as the run saved them.

    - FSDP shards go through ``torch.distributed.checkpoint`` (collective, any number of ranks), else
      ``state["model"]`` is loaded (whole, into a sharded model too).
    - Raises a one-line :class:`UserError` when the weights do not fit the model.
    """
    try:
        if (checkpoint / SHARDED_DIR).is_dir():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

            shards = {"model": get_model_state_dict(model)}
            with warnings.catch_warnings():  # one process without a group reads every shard itself, as meant
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(shards, checkpoint_id=str(checkpoint / SHARDED_DIR))
            set_model_state_dict(model, shards["model"])
        elif is_sharded(model):  # whole weights (an average's) into a sharded model: each rank takes its shard
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(state["model"])
    except (RuntimeError, KeyError, ValueError) as error:
        raise UserError(f"checkpoint {checkpoint} does not fit the model its config builds: "
                        f"{str(error).strip().splitlines()[-1].strip()}") from error
