"""torchrun for the recipes, with the exit codes of a single process.

    python -m cluster.torchrun [torchrun options] -m recipes.<recipe>.train [hydra overrides]

``make train-<r> NPROC=n``, ``cluster/launch.sh``, the sbatch and the .isc files start training
through this module, which runs ``torch.distributed.run`` in this process and changes only what
it reports when the workers end:

* the overrides are checked against the recipe's schema once, before any worker starts: a bad
  one is one line on stderr and exit code 2 (torchrun would print each rank's error and its own
  traceback, and exit 1);
* when every worker on this node stopped after its checkpoint (SIGTERM or SIGUSR1, sent to this
  process, which forwards it, or to the workers themselves), the exit code is 75, as for a single
  process; when every worker that ended ended on a user error, it is 2, and when they stopped
  because training diverged (``trainer.nonfinite``), 3. torchrun exits 1 in all these cases.
  Each worker records its exit code in the folder named by :data:`common.entry.EXIT_CODE_DIR`;
* when a worker stopped because a collective hung (``trainer.collective_timeout_s``), the exit
  code is 4. Rank 0 prints the line naming the ranks that did not arrive; when it could not (it
  was frozen, or NCCL aborted it: then NCCL's flight recorder dumped into the run's ``hang/``
  folder), this launcher prints it from the ranks' heartbeat files (``common/records/heartbeat.py``);
* SIGUSR1 (SLURM's usual warning signal) is forwarded to the workers like SIGTERM, and workers
  get 120 s to write their checkpoint before torchrun kills them (its default is 30 s). Both can
  be set as for torchrun: ``--signals-to-handle`` or ``PET_SIGNALS_TO_HANDLE``, and
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, which every close of the workers waits, on every torch
  release (:func:`give_workers_the_shutdown_window`).

Any other failure is reported as torchrun reports it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import determine_local_world_size, parse_args, run

from common.entry import EXIT_CODE_DIR, compose_config, fail
from common.errors import EXIT_DIVERGED, EXIT_HUNG, EXIT_PREEMPTED, EXIT_USER_ERROR, UserError
from common.pytorch.distributed import NCCL_TRACE_PREFIX
from common.records import heartbeat

SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT_S = "120"
RECIPE_MODULE = re.compile(r"^recipes\.(\w+)\.train$")


def recipe_overrides(module: str, script_args: list[str]) -> tuple[str, list[str]] | None:
    """The recipe ``module`` trains and the overrides its workers compose; None for a module that
    is not a recipe, or Hydra's own flags (sweeps, ``--cfg``), which are left to the workers."""
    match = RECIPE_MODULE.match(module)
    if match is None or any(arg.startswith("-") for arg in script_args):
        return None
    return match.group(1), [arg for arg in script_args if not arg.lstrip("+~").startswith("hydra")]


def check_overrides(module: str, script_args: list[str]) -> None:
    """Compose the recipe's config with the overrides, as each worker would; one line and exit 2 if
    they are bad."""
    recipe = recipe_overrides(module, script_args)
    if recipe is None:
        return
    try:
        compose_config(*recipe)
    except UserError as error:
        fail(str(error))


def report_hang(module: str, script_args: list[str], codes: list[int], started: float) -> bool:
    """Whether the workers stopped because a collective hung: one of them recorded
    :data:`EXIT_HUNG`, or NCCL's flight recorder dumped into the run's ``hang/`` folder during this
    launch. Then, unless rank 0 wrote the hang's line (``hang/report.txt``), print it from the
    heartbeat files and write it there."""
    recipe = recipe_overrides(module, script_args)
    try:
        hang_dir = Path(compose_config(*recipe).run_dir) / heartbeat.HANG_DIR if recipe else None
    except UserError:
        hang_dir = None
    traced = hang_dir is not None and any(path.stat().st_mtime >= started
                                          for path in hang_dir.glob(f"{NCCL_TRACE_PREFIX}*"))
    if EXIT_HUNG not in codes and not traced:
        return False
    if hang_dir is not None and not (hang_dir / heartbeat.REPORT_FILE).is_file():
        line = heartbeat.launcher_hang_line(hang_dir.parent)
        print(f"torchrun: error: {line}", file=sys.stderr, flush=True)
        (hang_dir / heartbeat.REPORT_FILE).write_text(line + "\n")
    return True


def give_workers_the_shutdown_window() -> None:
    """Make every close of the workers wait ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds.

    torch 2.11's agent closes them with ``PContext.close(death_sig)``, whose timeout defaults to a
    hard-coded 30 s, so a stop checkpoint that takes longer (the agreement on the stop, then the
    save and fsync of a large model) would be SIGKILLed mid-save. Later releases pass the window
    to the close after a signal only, and still give 30 s after a worker failed. One window for
    every close, on every release: the same stop and the same hang report everywhere.
    """
    value = os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    if not value.isdigit():
        fail(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be whole seconds, not {value!r}")
    seconds = int(value)
    close = PContext.close

    def close_after_the_window(self: PContext, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        close(self, death_sig, seconds)

    PContext.close = close_after_the_window


def recorded_exit_codes(folder: Path) -> list[int]:
    return [int(text) for text in (path.read_text().strip() for path in folder.iterdir()) if text.isdigit()]


@record  # torchrun's own error-file handling for the failures left to it
def main(argv: list[str] | None = None) -> None:
    # torchrun takes these defaults from the environment when it builds its parser.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.module:
        check_overrides(args.training_script, args.training_script_args)
    give_workers_the_shutdown_window()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="torchrun-exit-codes-") as folder:
        os.environ[EXIT_CODE_DIR] = folder
        try:
            run(args)
        except (ChildFailedError, SignalException) as error:
            codes = recorded_exit_codes(Path(folder))
            workers = determine_local_world_size(args.nproc_per_node)
            if len(codes) == workers and set(codes) == {EXIT_PREEMPTED}:
                print(f"torchrun: all {workers} worker(s) checkpointed and stopped; exiting with code "
                      f"{EXIT_PREEMPTED} (run again to resume)", flush=True)
                sys.exit(EXIT_PREEMPTED)
            if codes and set(codes) in ({EXIT_USER_ERROR}, {EXIT_DIVERGED}) and isinstance(error, ChildFailedError):
                sys.exit(codes[0])  # the workers printed their line
            if args.module and report_hang(args.training_script, args.training_script_args, codes, started):
                sys.exit(EXIT_HUNG)
            raise


if __name__ == "__main__":
    main()
