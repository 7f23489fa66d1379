"""The entry point every recipe uses: Hydra main, typed schema, one-line errors, exit codes.

``python -m recipes.<r>.train [overrides]`` behaves the same alone or under torchrun. Hydra composes
the config once against the recipe's schema (:func:`recipe_main`); a bad override or a
:class:`~common.errors.UserError` is one line on stderr and exit 2, a stop signal exit 75 once the
checkpoint is written, a hang exit 4 (README "Exit codes"). Hydra's own flags work as usual
(``--cfg job`` prints the resolved config), and the run directory is the deterministic
``run_dir``, so a restarted job finds its checkpoints.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.config import RunConfig, config_record, plain_config
from common.errors import EXIT_HUNG, EXIT_USER_ERROR, Preempted, RunStopped, UserError
from common.pytorch import distributed
from common.pytorch.determinism import configure_determinism
from common.pytorch.distributed import DistInfo
from common.records import heartbeat
from common.records.profiling import out_of_memory_error, record_memory_history
from common.run_lock import RunLockHeld, run_locks

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
CONFIG_FOLDER = ".hydra"  # in the run directory: the config a run used (common/after_training/trained.py reads it)
CONFIG_ERRORS = (HydraException, OmegaConfBaseException, ValueError)  # ValueError: a value no schema type takes
EXIT_CODE_DIR = "RECIPES_EXIT_CODE_DIR"
"""Set by ``cluster/torchrun.py``: the folder where each worker records why it stopped (a file per rank)."""


def record_exit_code(code: int) -> None:
    """Leave ``code`` where the launcher looks for it (see :data:`EXIT_CODE_DIR`), if it does."""
    folder = os.environ.get(EXIT_CODE_DIR)
    if folder and os.path.isdir(folder):
        Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(str(code))


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    record_exit_code(EXIT_USER_ERROR)
    sys.exit(EXIT_USER_ERROR)


def _report_stop(stop: RunStopped) -> None:
    """Print ``stop``'s line (on rank 0 alone when the ranks agreed on it) and record its exit code
    for the launcher; once."""
    if getattr(stop, "reported", False):
        return
    if not stop.agreed or distributed.launch_rank() == 0:
        if isinstance(stop, Preempted):
            print(f"{stop}; exiting with code {stop.exit_code} (run again to resume)", flush=True)
        else:
            print(f"error: {user_message(stop)}", file=sys.stderr, flush=True)
    record_exit_code(stop.exit_code)
    stop.reported = True


def stop_run(stop: RunStopped) -> NoReturn:
    """Report ``stop`` (:func:`_report_stop`) and exit with its code."""
    _report_stop(stop)
    sys.exit(stop.exit_code)


def exit_code(stop: SystemExit) -> int:
    """The exit code ``sys.exit`` would give for ``stop``."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


def exit_process(code: int) -> NoReturn:
    """End an entry point's process with ``code`` once its work is saved and its files closed.

    A process that joined a process group ends without Python's interpreter shutdown, as
    ``multiprocessing`` ends the children it forks: PyTorch may still hold the group (DTensor's
    caches keep FSDP2's device mesh and with it the group), and a gloo worker thread that frees a
    tensor during that shutdown aborts the process after a run that finished (see
    :func:`common.pytorch.distributed.shutdown_distributed`). Everything the run writes is already written
    and closed by then; the ``atexit`` handlers still run (logging's flush among them, while the
    interpreter is whole) and the standard streams are flushed.
    """
    if not distributed.joined_a_group():
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_hung_process() -> NoReturn:
    """End a process of a hung run (:mod:`common.records.heartbeat`) at once with :data:`EXIT_HUNG`, recorded
    for the launcher. Its process group is broken: tearing it down, or an ``atexit`` handler that
    uses it, could wait for ever. Every committed checkpoint is intact, and the standard streams
    are flushed."""
    record_exit_code(EXIT_HUNG)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_HUNG)


def user_message(error: Exception) -> str:
    """The error's message. A DataLoader re-raises a worker's error with the worker's traceback
    in its message; the original message is then the last line, which is what the user needs."""
    text = str(error).strip()
    prefix = f"{type(error).__module__}.{type(error).__qualname__}: "
    last = text.splitlines()[-1] if text else text
    return last[len(prefix) :] if "\n" in text and last.startswith(prefix) else text


def config_error_line(error: BaseException) -> str:
    """The most specific message of a Hydra/OmegaConf error chain, on one line."""
    messages = []
    while error is not None:
        text = str(error).strip()
        if text and "$" not in text:  # OmegaConf repeats its messages as templates ($VALUE ...)
            messages.append(text.splitlines()[0].rstrip("."))
        error = error.__cause__ or error.__context__
    return ": ".join(list(dict.fromkeys(messages))[:2]) or "invalid configuration"


def _schema_name(recipe: str) -> str:
    """The name a recipe's schema has in Hydra's ConfigStore; ``conf/<recipe>.yaml`` lists it first."""
    return f"{recipe}_schema"


def register_schema(schema: type[RunConfig]) -> str:
    """Store ``schema`` in Hydra's ConfigStore under :func:`_schema_name`; return its recipe."""
    recipe = schema.recipe
    ConfigStore.instance().store(name=_schema_name(recipe), node=schema)
    return recipe


def recipe_schema(recipe: str) -> type[RunConfig]:
    """The schema of ``recipe``: the ``RunConfig`` dataclass of ``recipes/<recipe>/config.py``."""
    try:
        module = importlib.import_module(f"recipes.{recipe}.config")
    except ModuleNotFoundError as error:
        raise UserError(f"there is no recipe {recipe!r} (recipes/{recipe}/config.py is missing)") from error
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, RunConfig) and getattr(value, "recipe", None) == recipe:
            return value
    raise UserError(f"recipes/{recipe}/config.py defines no RunConfig dataclass whose recipe is {recipe!r}")


def check_resolves(cfg: DictConfig) -> None:
    """Every value of ``cfg`` resolves (interpolations, environment variables, no ``???`` left)."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except CONFIG_ERRORS as error:
        raise UserError(config_error_line(error)) from error


def typed_config(cfg: DictConfig) -> RunConfig:
    """``cfg`` as its schema's dataclasses (enums as enum members): what a recipe's code receives.
    Converted once, where Hydra hands the config over; attribute reads then cost nothing."""
    return OmegaConf.to_object(cfg)


def compose_config(recipe: str, overrides: list[str]) -> DictConfig:
    """The config ``python -m recipes.<recipe>.train *overrides`` would run with, resolvable, for
    tools and tests; a bad override is a one-line :class:`UserError`."""
    register_schema(recipe_schema(recipe))
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name=recipe, overrides=overrides)
    except CONFIG_ERRORS as error:
        raise UserError(config_error_line(error)) from error
    check_resolves(cfg)
    return cfg


def _print_job_config_resolved() -> None:
    """Make ``--cfg job`` print the config as the run will see it (Hydra's ``--resolve``), read
    with Hydra's own argument parser. (Hydra's own config cannot be resolved outside a run.)"""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(sys.argv[1:])
    if args.cfg == "job" and not args.resolve:
        sys.argv.append("--resolve")


@contextlib.contextmanager
def distributed_process(cfg: RunConfig, **process_group: Any) -> Iterator[DistInfo]:
    """This process set up to run ``cfg``'s model: PyTorch's determinism and speed switches (before
    CUDA starts), then its device and process group (``common.pytorch.distributed.init_distributed``, with
    ``trainer.collective_timeout_s``; ``process_group``'s options go there too); the group is
    destroyed at the end."""
    configure_determinism(cfg.trainer.deterministic, cfg.device)
    dist_info = distributed.init_distributed(cfg.device, timeout_s=cfg.trainer.collective_timeout_s, **process_group)
    try:
        yield dist_info
    finally:
        distributed.shutdown_distributed()


@contextlib.contextmanager
def training_process(cfg: RunConfig, **process_group: Any) -> Iterator[DistInfo]:
    """A :func:`distributed_process` that trains into ``cfg.run_dir``: rank 0 holds the run's lock
    (``common/run_lock.py``) for the job's ranks before anything reads a checkpoint, then records
    the config in ``.hydra/`` and prints it, resolved, once per segment (SLURM's and the ISC's logs
    are where people look). A run held by another launch is a one-line error on every rank,
    printed once, and nothing is written. A stop every rank agreed on (a refused lock, a divergence)
    is reported before any rank exits: a launcher that sees one rank end stops the others. Every
    rank then keeps a heartbeat in the run directory, and a collective's timeout ends the run as
    hung (:func:`common.records.heartbeat.beating`, :func:`_end_hung_process`). A CUDA out-of-memory error
    becomes a one-line error (``common/records/profiling.py``; with ``profile.memory_on_oom`` the allocation
    history is recorded from here on, and dumped then)."""
    with distributed_process(cfg, hang_dir=Path(cfg.run_dir) / heartbeat.HANG_DIR, **process_group) as dist_info:
        if cfg.profile.memory_on_oom and not record_memory_history(dist_info.device) and dist_info.is_main:
            print(f"profile.memory_on_oom: no memory history, it records CUDA allocations and this run is on "
                  f"{dist_info.device.type}", flush=True)
        refusal = None
        try:
            with contextlib.ExitStack() as held:
                if dist_info.is_main:
                    try:
                        held.enter_context(run_locks([cfg.run_dir, cfg.checkpoint.dir], log=print))
                    except RunLockHeld as error:
                        refusal = str(error)
                    else:
                        heartbeat.clear(cfg.run_dir)
                refusal = distributed.broadcast_object(refusal)
                if refusal is not None:
                    raise UserError(refusal, agreed=True)
                if dist_info.is_main:
                    path = _record_config(cfg)
                    print(f"config ({path}):\n{OmegaConf.to_yaml(plain_config(cfg))}", end="", flush=True)
                held.enter_context(heartbeat.beating(cfg.run_dir, dist_info.rank, dist_info.world_size,
                                                     cfg.trainer.collective_timeout_s, _end_hung_process))
                yield dist_info
        except RunStopped as stop:
            if stop.agreed:
                _report_stop(stop)
                distributed.barrier()
            raise
        except torch.OutOfMemoryError as error:
            raise out_of_memory_error(error, cfg.run_dir, dist_info, cfg.trainer.batch_size,
                                      cfg.trainer.global_batch_size, cfg.trainer.out_of_memory.value) from error


def _record_config(cfg: RunConfig) -> Path:
    """``.hydra/config.yaml`` (and ``overrides.yaml`` when Hydra composed ``cfg``) in the run
    directory, where Hydra would write them (:func:`common.config.config_record`); written here,
    once the run's lock is held, so that a launch refused by the lock leaves the running one's
    files alone (``conf/run_layout.yaml`` turns Hydra's own copy off). Returns the config's path."""
    folder = Path(cfg.run_dir) / CONFIG_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config_record(cfg)), folder / "config.yaml")
    if HydraConfig.initialized():
        OmegaConf.save(OmegaConf.create(list(HydraConfig.get().overrides.task)), folder / "overrides.yaml")
    return folder / "config.yaml"


def exit_after(main: Callable[[], Any]) -> NoReturn:
    """Run an entry point's ``main`` and end the process with its exit code (:func:`exit_process`)."""
    try:
        main()
    except SystemExit as stop:
        exit_process(exit_code(stop))
    exit_process(0)


def recipe_main(schema: type[RunConfig], train: Callable[[Any, DistInfo], Any],
                process_group: Callable[[Any], dict[str, Any]] | None = None) -> NoReturn:
    """Run a recipe from the command line: compose ``conf/<recipe>.yaml`` with the overrides in
    ``sys.argv`` against ``schema``, then ``train(cfg, dist_info)`` with the config typed
    (:func:`typed_config`) inside a :func:`training_process` (with the options ``process_group(cfg)``
    gives, where the recipe needs some); end the process (:func:`exit_after`)."""
    import hydra

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=schema.recipe)
    def hydra_task(cfg: DictConfig) -> Any:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            cfg.run_dir = HydraConfig.get().runtime.output_dir
        try:
            check_resolves(cfg)
            typed = typed_config(cfg)
            with training_process(typed, **(process_group(typed) if process_group else {})) as dist_info:
                return train(typed, dist_info)
        except RunStopped as stop:
            stop_run(stop)
        except CONFIG_ERRORS as error:  # a bug in the recipe, not a bad override: keep its traceback
            error.raised_by_recipe = True
            raise

    register_schema(schema)
    _print_job_config_resolved()
    reported_here = os.environ.get("HYDRA_FULL_ERROR") != "1"  # a user who set it wants Hydra's trace
    os.environ["HYDRA_FULL_ERROR"] = "1"

    def compose_and_run() -> None:
        try:
            hydra_task()
        except CONFIG_ERRORS as error:
            if not reported_here or getattr(error, "raised_by_recipe", False):
                raise
            fail(config_error_line(error))

    exit_after(compose_and_run)
