"""Words that cross DeepSpeed's launchers to other hosts, prepared so that the rank receives exactly what the user
typed, and checks for what cannot cross at all.

How DeepSpeed 0.19's runner (deepspeed/launcher/runner.py, multinode_runner.py) treats what we hand it:

- pdsh: the whole remote command is the training arguments and `export NAME=VALUE;` items joined with spaces and
  run by the remote login shell (a POSIX shell), after pdsh replaced `%h`, `%u`, `%n` and `%%` in it. DeepSpeed
  wraps an argument that contains a space in double quotes (escaping only `"`), passes any other argument as it is,
  and wraps an exported value that has a character outside `[\\w@%+=:,./-]` in double quotes without escaping
  anything. Unprepared, `$(...)`, backticks and `;` run on every host.
- MPI launchers (openmpi, mvapich, mpich, impi): arguments reach the ranks without a shell, but exported values
  get the same literal double quotes, which then end up inside the variable.
- Its env file (`DS_ENV_FILE`, `.deepspeed_env`) is read line by line as NAME=VALUE: a value with a newline would
  add a variable, and values are stripped of surrounding blanks.
"""

from __future__ import annotations

import re

from llm.errors import UserError

_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
"""Needs no quoting in any POSIX shell (or zsh, as long as it does not start with '=')."""
DEEPSPEED_BARE_VALUE = re.compile(r"[\w@%+=:,./-]*")
"""An exported value DeepSpeed passes without adding quotes (its `add_export`)."""
BARE_VALUE_RULE = "letters, digits and _@%+=:,./-"
_DOUBLE_QUOTE_SPECIAL = re.compile(r'([\\$`"])')
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_one_line(text: str, what: str) -> None:
    """Refuse newlines and other control characters, which no env file or remote command line carries intact."""
    found = _CONTROL.search(text)
    if found:
        raise UserError(f"{what} contains the control character {found.group()!r}; launchers pass one line of "
                        "printable text to other hosts")


def _pdsh_escape(word: str) -> str:
    """pdsh replaces %h, %u, %n and %% in the remote command before the shell sees it; '%%' stays one '%'."""
    return word.replace("%", "%%")


def pdsh_argument(arg: str) -> str:
    """A training argument as DeepSpeed's pdsh runner must receive it for the remote shell to rebuild `arg`."""
    check_one_line(arg, f"the training argument {arg!r}")
    if " " in arg:  # DeepSpeed puts it in double quotes and escapes '"': escape the rest of what is special there
        word = re.sub(r"([\\$`])", r"\\\1", arg)
    elif _PLAIN_WORD.fullmatch(arg) and not arg.startswith("="):
        word = arg
    else:  # no space, so DeepSpeed leaves it alone: single quotes make every character literal
        word = "'" + arg.replace("'", "'\\''") + "'"
    return _pdsh_escape(word)


_RUNS_A_COMMAND = re.compile(r'([\\`"]|\$(?=\())')
"""What stays literal in an env file's value inside DeepSpeed's double quotes where `$NAME` is still expanded: a
command substitution ($(...), $((...)), backticks) and the quote and backslash that would end or bend the quoting."""


def pdsh_export(value: str, expand_variables: bool = False) -> str:
    """An exported value as it must stand in DeepSpeed's env file for `export NAME=...;` on the remote shell to set
    exactly `value` (DeepSpeed adds the double quotes itself whenever the result is not bare); with
    `expand_variables`, its `$NAME` and `${NAME}` as the remote shell expands them (as DeepSpeed sends a
    .deepspeed_env line: `PATH=/opt/x/bin:$PATH`), and still nothing in it runs."""
    if DEEPSPEED_BARE_VALUE.fullmatch(value):
        return _pdsh_escape(value)
    return _pdsh_escape((_RUNS_A_COMMAND if expand_variables else _DOUBLE_QUOTE_SPECIAL).sub(r"\\\1", value))


def check_shell_word(word: str, what: str) -> None:
    """Something DeepSpeed writes unquoted into pdsh's remote command (the working directory, the Python path)."""
    if not _PLAIN_WORD.fullmatch(word):
        raise UserError(f"{what} {word!r} goes unquoted into the remote shell command of DeepSpeed's pdsh launcher; "
                        "use a path made of letters, digits and _@+=:,./- only")
