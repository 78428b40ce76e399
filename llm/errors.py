"""The project's own exception for user mistakes, and every exit code a zerollm process ends with.

A `UserError` carries one line that names the file, line or key at fault and what to do.
The CLI prints it without a traceback and exits with `EXIT_USER_ERROR`.
"""

EXIT_OK = 0
EXIT_USER_ERROR = 2
"""Bad input (file, config, path, tokenizer), or ranks that disagree at rendezvous; nothing was trained."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM/SIGINT (or a lost `zerollm launch`) after saving a checkpoint; rerun with --resume auto."""
EXIT_RANK_LOST = 76
"""A rank died, hung or could not be reached; the job was ended on every rank and the message names the rank."""


class UserError(Exception):
    """A mistake in the user's input (file, config, path, tokenizer), not a bug. One that every rank of a job raises
    is printed once per node: `announce` is true on one rank of each."""

    def __init__(self, message: str, announce: bool = True) -> None:
        super().__init__(message)
        self.announce = announce
