"""The entry point every recipe uses: Hydra's command line, the typed schema, one-line errors, exit codes.

- ``python -m recipes.<r>.train [overrides]`` runs :func:`recipe_main`, alone or under torchrun.
- Exit codes (``common/errors.py``, docs/run-contract.md, "Exit codes"): 0 done, 2 user error or bad override,
  3 diverged, 4 hung, 75 pre-empted (checkpoint written, run again to resume); 1 is a bug, with
  its traceback.
- The run directory is the deterministic ``run_dir``: a restarted job finds its checkpoints.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
import traceback
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
from common.recipes import RecipeSpec
from common.records import heartbeat
from common.records.profiling import out_of_memory_error, record_memory_history
from common.run_lock import RunLockHeld, run_locks

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
CONFIG_FOLDER = ".hydra"  # in the run directory: the config a run used (common/after_training/trained.py reads it)
CONFIG_ERRORS = (HydraException, OmegaConfBaseException, ValueError)  # ValueError: a value no schema type takes
EXIT_CODE_DIR = "RECIPES_EXIT_CODE_DIR"
"""Set by ``cluster/torchrun.py``: the folder where each worker records why it stopped (a file per rank)."""


def record_exit_code(code: int) -> None:
    """Leave ``code`` in ``$RECIPES_EXIT_CODE_DIR/rank<RANK>`` for the launcher; nothing when it is unset."""
    folder = os.environ.get(EXIT_CODE_DIR)
    if folder and os.path.isdir(folder):
        Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(str(code))


def report_user_error(message: str) -> int:
    """Print ``error: <message>`` on stderr and record exit code 2 (:func:`record_exit_code`).

    - Returns :data:`~common.errors.EXIT_USER_ERROR`, the code to exit with.
    """
    print(f"error: {message}", file=sys.stderr, flush=True)
    record_exit_code(EXIT_USER_ERROR)
    return EXIT_USER_ERROR


def fail(message: str) -> NoReturn:
    """End an entry point with ``error: <message>`` and exit code 2 (:func:`report_user_error`)."""
    sys.exit(report_user_error(message))


def report_stop(stop: RunStopped) -> int:
    """Print ``stop``'s one line and record its exit code for the launcher; returns that code.

    - A :class:`~common.errors.Preempted` prints ``...; exiting with code 75 (run again to resume)`` on
      stdout; any other stop ``error: <message>`` on stderr.
    - A stop the ranks agreed on is printed by rank 0 alone; a stop is reported once, however often
      this is called.
    """
    if getattr(stop, "reported", False):
        return stop.exit_code
    if not stop.agreed or distributed.launch_rank() == 0:
        if isinstance(stop, Preempted):
            print(f"{stop}; exiting with code {stop.exit_code} (run again to resume)", flush=True)
        else:
            print(f"error: {user_message(stop)}", file=sys.stderr, flush=True)
    record_exit_code(stop.exit_code)
    stop.reported = True
    return stop.exit_code


def exit_code(stop: SystemExit) -> int:
    """The exit code ``sys.exit`` would give for ``stop``."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


def exit_process(code: int) -> NoReturn:
    """End an entry point's process with ``code``, once its work is saved and its files closed.

    - Not in a process group: ``sys.exit(code)``.
    - Joined a process group: the ``atexit`` handlers run and the standard streams are flushed,
      then ``os._exit(code)``, skipping the interpreter's shutdown, as ``multiprocessing`` ends the
      children it forks. PyTorch may still hold the group there (DTensor caches FSDP2's device
      mesh), and a gloo thread freeing a tensor during that shutdown aborts a finished run
      (:func:`common.pytorch.distributed.shutdown_distributed`).
    """
    if not distributed.joined_a_group():
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_hung_process() -> NoReturn:
    """End a process of a hung run (:mod:`common.records.heartbeat`) at once with exit code 4.

    - Records the code for the launcher and flushes the standard streams; nothing else runs: the
      broken process group could make a teardown or an ``atexit`` handler wait for ever.
    - Every committed checkpoint is intact.
    """
    record_exit_code(EXIT_HUNG)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_HUNG)


def user_message(error: Exception) -> str:
    """The message of ``error`` a user needs, on one line where the error gives one.

    - A DataLoader re-raises a worker's error with the worker's traceback in its message: the last
      line, the original message, is returned without its ``module.Type: `` prefix.
    """
    text = str(error).strip()
    prefix = f"{type(error).__module__}.{type(error).__qualname__}: "
    last = text.splitlines()[-1] if text else text
    return last[len(prefix) :] if "\n" in text and last.startswith(prefix) else text


def config_error_line(error: BaseException) -> str:
    """The most specific message of a Hydra/OmegaConf error chain, on one line (its first two, joined)."""
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
    """Store ``schema`` in Hydra's ConfigStore as ``<recipe>_schema``; returns its recipe."""
    recipe = schema.recipe
    ConfigStore.instance().store(name=_schema_name(recipe), node=schema)
    return recipe


def recipe_schema(recipe: str) -> type[RunConfig]:
    """The schema of ``recipe``: the ``RunConfig`` dataclass of ``recipes/<recipe>/config.py``.

    - Raises :class:`UserError` when there is no such recipe or dataclass.
    """
    try:
        module = importlib.import_module(f"recipes.{recipe}.config")
    except ModuleNotFoundError as error:
        raise UserError(f"there is no recipe {recipe!r} (recipes/{recipe}/config.py is missing)") from error
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, RunConfig) and getattr(value, "recipe", None) == recipe:
            return value
    raise UserError(f"recipes/{recipe}/config.py defines no RunConfig dataclass whose recipe is {recipe!r}")


def check_resolves(cfg: DictConfig) -> None:
    """Check that every value of ``cfg`` resolves: interpolations, environment variables, no ``???`` left.

    - Raises :class:`UserError` with the error's one line (:func:`config_error_line`).
    """
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except CONFIG_ERRORS as error:
        raise UserError(config_error_line(error)) from error


def typed_config(cfg: DictConfig) -> RunConfig:
    """``cfg`` as its schema's dataclasses (enums as enum members): what a recipe's code receives.

    - Converted once, where Hydra hands the config over; attribute reads then cost nothing.
    """
    return OmegaConf.to_object(cfg)


def compose_config(recipe: str, overrides: list[str]) -> DictConfig:
    """The config ``python -m recipes.<recipe>.train *overrides`` would run with, for tools and tests.

    - Resolvable (:func:`check_resolves`); Hydra's own ``hydra`` node left out.
    - Raises :class:`UserError` with one line for a bad override or an unknown recipe.
    """
    register_schema(recipe_schema(recipe))
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name=recipe, overrides=overrides)
    except CONFIG_ERRORS as error:
        raise UserError(config_error_line(error)) from error
    check_resolves(cfg)
    return cfg


@contextlib.contextmanager
def distributed_process(cfg: RunConfig, **process_group: Any) -> Iterator[DistInfo]:
    """This process set up to run ``cfg``'s model; yields its :class:`DistInfo`.

    - First PyTorch's determinism and speed switches (``trainer.deterministic``; before CUDA starts).
    - Then the device and process group (:func:`common.pytorch.distributed.init_distributed`, with
      ``trainer.collective_timeout_s`` and the ``process_group`` options); destroyed at the end.
    """
    configure_determinism(cfg.trainer.deterministic, cfg.device)
    dist_info = distributed.init_distributed(cfg.device, timeout_s=cfg.trainer.collective_timeout_s, **process_group)
    try:
        yield dist_info
    finally:
        distributed.shutdown_distributed()


@contextlib.contextmanager
def training_process(cfg: RunConfig, **process_group: Any) -> Iterator[DistInfo]:
    """A :func:`distributed_process` that trains into ``cfg.run_dir``; yields its :class:`DistInfo`.

    - Rank 0 holds the run's lock (``common/run_lock.py``) for the job's ranks before anything reads
      a checkpoint. A run held by another launch raises :class:`UserError` (agreed) on every rank,
      and nothing is written.
    - Rank 0 then records the config in ``.hydra/`` and prints it resolved, once per segment
      (SLURM's and the ISC's logs are where people look).
    - Every rank keeps a heartbeat in the run directory; a collective's timeout ends the process as
      hung, exit code 4 (:func:`common.records.heartbeat.beating`).
    - A stop the ranks agreed on (a refused lock, a divergence) is reported before any rank exits:
      a launcher that sees one rank end stops the others.
    - Raises a CUDA out-of-memory error as a one-line :class:`UserError`
      (``common/records/profiling.py``); ``profile.memory_on_oom`` records the allocation history
      from here on, and dumps it then.
    """
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
                report_stop(stop)
                distributed.barrier()
            raise
        except torch.OutOfMemoryError as error:
            raise out_of_memory_error(error, cfg.run_dir, dist_info, cfg.trainer.batch_size,
                                      cfg.trainer.global_batch_size, cfg.trainer.out_of_memory.value) from error


def _record_config(cfg: RunConfig) -> Path:
    """Write ``.hydra/config.yaml`` (``overrides.yaml`` too under Hydra) in the run directory; returns its path.

    - Paths inside the run directory are written relative to it (:func:`common.config.config_record`).
    - Written here, once the run's lock is held, so that a launch the lock refuses leaves the
      running one's files alone (``conf/run_layout.yaml`` turns Hydra's own copy off).
    """
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


def _with_resolve_for_cfg_job(argv: list[str]) -> list[str]:
    """``argv`` with ``--resolve`` added to ``--cfg job``, so that it prints the config as the run sees it.

    - Read with Hydra's own argument parser; Hydra's own config (``--cfg hydra|all``) cannot be
      resolved outside a run, and is left alone.
    """
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv[1:])
    return [*argv, "--resolve"] if args.cfg == "job" and not args.resolve else argv


def _raised_in(error: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``error`` was raised while ``function`` ran: its traceback passes through it."""
    return any(frame.f_code is function.__code__ for frame, _ in traceback.walk_tb(error.__traceback__))


def recipe_main(spec: RecipeSpec, train: Callable[[Any, DistInfo], Any]) -> int:
    """Run a recipe from its command line; returns the process's exit code.

    - ``spec``: the recipe's ``SPEC``; ``conf/<recipe>.yaml`` is composed against ``spec.schema``
      with the command line's overrides, and ``spec.process_group(cfg)`` gives the process group's options.
    - ``train(cfg, dist_info)``: the recipe's loop, called with the config typed (:func:`typed_config`)
      inside a :func:`training_process`.
    - Hydra's command line as usual: overrides, ``--cfg job`` (printed resolved), ``--help``, ``-m``
      (each sweep job in its own ``run_dir``, the sweep's output directory).
    - Returns 0 when the run is done, 2 after a bad override's one line, a stop's code after its one
      line (:func:`report_stop`), or the code Hydra's own flags exit with (``--help`` 0).
    - A hang ends the process from its heartbeat thread, with exit code 4 (:func:`_end_hung_process`).
    - Raises a bug's exception (a traceback, exit code 1), and a bad override's when the user set
      ``HYDRA_FULL_ERROR=1`` (Hydra's traceback).
    - Its caller ends the process with the code: ``exit_process(recipe_main(SPEC, train))``.
    """
    import hydra

    def run_task(cfg: DictConfig) -> None:  # Hydra's task: cfg composed from the command line, in its output dir
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            cfg.run_dir = HydraConfig.get().runtime.output_dir
        try:
            check_resolves(cfg)
            typed = typed_config(cfg)
            with training_process(typed, **spec.process_group(typed)) as dist_info:
                train(typed, dist_info)
        except RunStopped as stop:  # user error 2, diverged 3, pre-empted 75: its line, out past Hydra as SystemExit
            raise SystemExit(report_stop(stop))

    register_schema(spec.schema)
    sys.argv = _with_resolve_for_cfg_job(sys.argv)  # @hydra.main reads its command line from sys.argv
    hydra_traces = os.environ.get("HYDRA_FULL_ERROR") == "1"  # the user asked for Hydra's traceback of a bad override
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's switch: it raises errors to here, not printing them and exiting 1
    try:
        hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=spec.schema.recipe)(run_task)()
    except SystemExit as end:  # a stop of run_task (its line printed), --help (0), a bad flag (argparse's usage, 2)
        return exit_code(end)
    except CONFIG_ERRORS as error:  # a bad override or flag: "error: <Hydra's message>", exit 2
        if hydra_traces or _raised_in(error, run_task):  # HYDRA_FULL_ERROR=1, or the recipe's own bug: traceback, 1
            raise
        return report_user_error(config_error_line(error))
    return 0  # the run is done (under -m: every sweep job)
