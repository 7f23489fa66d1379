"""User-facing errors: reported as one line on stderr with a non-zero exit, never a traceback."""


class UserError(Exception):
    """Bad input the user can fix: a missing path, a bad config value, corrupt data."""


class Preempted(Exception):
    """Raised by a recipe after it saved a checkpoint because SIGTERM/SIGUSR1 arrived."""


EXIT_USER_ERROR = 2
"""Exit code for a :class:`UserError` or an invalid configuration."""

EXIT_PREEMPTED = 75
"""Exit code after SIGTERM/SIGUSR1: a checkpoint was written and the run can be resumed
(75 is ``EX_TEMPFAIL`` from sysexits.h, "try again later")."""
