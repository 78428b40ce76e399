"""The project's own exception for user mistakes.

A `UserError` carries one line that names the file, line or key at fault and what to do.
The CLI prints it without a traceback and exits with `EXIT_USER_ERROR`.
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input (file, config, path, tokenizer), not a bug."""
