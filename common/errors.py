"""How a run ends other than by finishing: each kind of stop, its exception and its exit code.

A user error is one line on stderr and a non-zero exit, never a traceback. An exception raised
by every rank after the ranks agreed on it (``agreed=True``) is printed by rank 0 alone, so a
multi-rank run says it once.
"""

EXIT_USER_ERROR = 2
"""Exit code for a :class:`UserError` or an invalid configuration."""

EXIT_DIVERGED = 3
"""Exit code after :class:`Diverged`: running the same command again would diverge again, so
launchers do not requeue or restart it."""

EXIT_HUNG = 4
"""Exit code after a collective waited longer than ``trainer.collective_timeout_s`` (a hang: see
``common/records/heartbeat.py``). Not 75: a rank that hangs once (a deadlock in the code, a bad node) may
hang again, so launchers do not requeue it by themselves."""

EXIT_PREEMPTED = 75
"""Exit code after SIGTERM/SIGUSR1: a checkpoint was written and the run can be resumed
(75 is ``EX_TEMPFAIL`` from sysexits.h, "try again later")."""


class RunStopped(Exception):
    """A stop with its own exit code and one line to print (on rank 0 alone when ``agreed``)."""

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
