"""How a run ends other than by finishing: each kind of stop, its exception and its exit code.

- Every stop is one line (``common.entry.report_stop``), never a traceback, and its exit code.
- ``agreed=True``: every rank raised it after the ranks agreed on it; rank 0 alone prints it.
"""

EXIT_USER_ERROR = 2
"""Exit code for a :class:`UserError` or an invalid configuration."""

EXIT_DIVERGED = 3
"""Exit code after :class:`Diverged`.

- Launchers do not requeue or restart it: the same command would diverge again.
"""

EXIT_HUNG = 4
"""Exit code after a collective waited longer than ``trainer.collective_timeout_s`` (``common/records/heartbeat.py``).

- Not 75: a rank that hung once (a deadlock, a bad node) may hang again; launchers do not requeue it.
"""

EXIT_PREEMPTED = 75
"""Exit code after SIGTERM/SIGUSR1, once the checkpoint they asked for is written.

- Run the same command again to resume; 75 is ``EX_TEMPFAIL`` from sysexits.h, "try again later".
"""


class RunStopped(Exception):
    """A stop with its own exit code and one line to print.

    - ``message``: the line; ``agreed``: every rank raises it, rank 0 alone prints it.
    """

    exit_code = 1

    def __init__(self, message: str, agreed: bool = False) -> None:
        super().__init__(message)
        self.agreed = agreed


class UserError(RunStopped):
    """Bad input the user can fix: a missing path, a bad config value, corrupt data."""

    exit_code = EXIT_USER_ERROR


class Diverged(RunStopped):
    """The training became non-finite (``trainer.nonfinite``): no checkpoint was written from it."""

    exit_code = EXIT_DIVERGED


class Preempted(RunStopped):
    """Raised after the checkpoint a SIGTERM/SIGUSR1 asked for was written."""

    exit_code = EXIT_PREEMPTED
