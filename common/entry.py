"""The entry point every recipe uses: Hydra main + typed schema + one-line errors.

``python -m recipes.<r>.train [overrides]`` behaves the same alone or under torchrun:
* the overrides are checked against the recipe's schema first, so an unknown key or a value
  of the wrong type ends with one line on stderr and exit code 2, before any work;
* Hydra's own flags (``--cfg job``, ``--help``, ``-m`` sweeps with a launcher) work as usual;
* a :class:`~common.errors.UserError` raised by the recipe ends the same way;
* SIGTERM/SIGUSR1 end with exit code 75 once the recipe has written its checkpoint; under
  ``cluster/torchrun.py`` each worker also records its exit code for the launcher (torchrun
  itself turns any worker's non-zero exit into its own exit code 1);
* the run directory is the deterministic ``run_dir`` (in a sweep: the sweep directory plus
  the job's overrides), so a restarted job finds its checkpoints.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, Preempted, UserError

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
EXIT_CODE_DIR = "RECIPES_EXIT_CODE_DIR"
"""Set by ``cluster/torchrun.py``: the folder where each worker records why it stopped (a file per rank)."""

# Hydra flags that take a value in the next argument.
_FLAGS_WITH_VALUE = {
    "--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p",
    "--experimental-rerun",
}
_INFO_FLAGS = {"--info", "-i"}
_INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
_SWEEP_FLAGS = {"-m", "--multirun"}


def record_exit_code(code: int) -> None:
    """Leave ``code`` where the launcher looks for it (see :data:`EXIT_CODE_DIR`), if it does."""
    folder = os.environ.get(EXIT_CODE_DIR)
    if folder and os.path.isdir(folder):
        Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(str(code))


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    record_exit_code(EXIT_USER_ERROR)
    sys.exit(EXIT_USER_ERROR)


def user_message(error: UserError) -> str:
    """The error's message. A DataLoader re-raises a worker's error with the worker's traceback
    in its message; the original message is then the last line, which is what the user needs."""
    text = str(error).strip()
    prefix = f"{type(error).__module__}.{type(error).__qualname__}: "
    last = text.splitlines()[-1] if text else text
    return last[len(prefix) :] if "\n" in text and last.startswith(prefix) else text


def _first_line(error: BaseException) -> str:
    """The most specific message of a Hydra/OmegaConf error chain, on one line."""
    messages = []
    while error is not None:
        text = str(error).strip()
        if text and "$" not in text:  # OmegaConf repeats its messages as templates ($VALUE ...)
            messages.append(text.splitlines()[0].rstrip("."))
        error = error.__cause__ or error.__context__
    return ": ".join(list(dict.fromkeys(messages))[:2]) or "invalid configuration"


def split_argv(argv: list[str], config_name: str) -> tuple[str, list[str], bool]:
    overrides, sweep, previous = [], False, ""
    args = iter(argv)
    for arg in args:
        if arg in _INFO_FLAGS or (previous in _INFO_FLAGS and arg in _INFO_TOPICS):
            pass
        elif arg in _SWEEP_FLAGS:
            sweep = True
        elif arg in ("--config-name", "-cn"):
            config_name = next(args, config_name)
        elif arg in _FLAGS_WITH_VALUE:
            next(args, None)
        elif arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif not arg.startswith("-") and not arg.lstrip("+~").startswith("hydra"):
            overrides.append(arg)
        previous = arg
    return config_name, overrides, sweep


def _prints_job_config(argv: list[str]) -> bool:
    """``--cfg job`` (the job's config only: Hydra's own config cannot be resolved outside a run)."""
    return any(flag in ("--cfg", "-c") and value == "job" for flag, value in zip(argv, argv[1:]))


def validate_overrides(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose and resolve the config; a bad override is a one-line :class:`UserError`."""
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        raise UserError(_first_line(error)) from error
    return cfg


def recipe_main(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], None]]:
    """Decorate a recipe's ``main(cfg)``; the result takes its arguments from ``sys.argv``."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], None]:
        import hydra

        @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)
        def hydra_task(cfg: DictConfig) -> Any:
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                cfg.run_dir = HydraConfig.get().runtime.output_dir
            try:
                return task(cfg)
            except UserError as error:
                fail(user_message(error))
            except Preempted as stop:
                print(f"{stop}; exiting with code {EXIT_PREEMPTED} (run again to resume)", flush=True)
                record_exit_code(EXIT_PREEMPTED)
                sys.exit(EXIT_PREEMPTED)

        def main() -> None:
            if _prints_job_config(sys.argv) and "--resolve" not in sys.argv:
                sys.argv.append("--resolve")  # print the config as the run will see it
            name, overrides, sweep = split_argv(sys.argv[1:], config_name)
            if not sweep:
                try:
                    validate_overrides(name, overrides)
                except UserError as error:
                    fail(str(error))
            hydra_task()

        return main

    return decorate
