"""The variables a job's ranks get on other hosts, and the env file that carries them through DeepSpeed's runner.

For a job on several hosts DeepSpeed's runner exports three kinds of variables: those of the launching
environment whose names start with one of `DEEPSPEED_FORWARDED_PREFIXES` (with the working directory put first in
PYTHONPATH), the lines of its env files (`~/.deepspeed_env`, `./.deepspeed_env`, or the name in DS_ENV_FILE), and,
through our own env file, `--env NAME=VALUE`. `zerollm launch` gathers all three, checks them, and hands DeepSpeed
one env file in which every value is written so that it arrives unchanged (see remote_shell.py for why that takes
care). A value that cannot arrive unchanged is refused with its origin named.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import Path

from launch.own_module import ROOT
from launch.remote_shell import BARE_VALUE_RULE, DEEPSPEED_BARE_VALUE, check_one_line, pdsh_export
from llm.errors import UserError, not_utf8

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DEEPSPEED_FORWARDED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
"""Names DeepSpeed's runner forwards from the launching environment (its EXPORT_ENVS, and `export_envs()` of the
CUDA accelerator)."""
DEEPSPEED_ENV_FILE = ".deepspeed_env"


@dataclass(frozen=True)
class Export:
    value: str
    origin: str
    """Where the variable comes from, for messages: '--env', 'FILE:LINE' or 'your environment'."""
    expands: bool = False
    """Whether the hosts' shells expand its `$NAME` references, as DeepSpeed has them do for its env files' lines."""


def _check_value(value: str, where: str) -> None:
    """A variable's value must be one line of UTF-8 text, as an env file holds it (a byte of the command line or the
    environment that is not UTF-8 reaches Python as a lone surrogate, which no UTF-8 file can hold)."""
    check_one_line(value, where)
    found = not_utf8(value)
    if found is not None:
        raise UserError(f"{where} is not UTF-8 text ({found[1]} at position {found[0] + 1})")


def parse_env(items: list[str]) -> dict[str, str]:
    """`--env NAME=VALUE` items as {name: value}; a name must be a shell variable name and a value one line of UTF-8
    text."""
    env = {}
    for item in items:
        name, separator, value = item.partition("=")
        if not separator or not ENV_NAME.fullmatch(name):
            raise UserError(f"--env {item!r}: expected NAME=VALUE, NAME made of letters, digits and '_' and not "
                            "starting with a digit")
        _check_value(value, f"--env {name}")
        env[name] = value
    return env


def _read_env_file(path: Path) -> dict[str, Export]:
    """NAME=VALUE lines as DeepSpeed reads them (name and value stripped); blank lines and '#' comments, which
    DeepSpeed's own reader would fail on, are skipped, and so is a byte order mark (a Windows editor's). A comment
    after a value is refused: it is the value's to DeepSpeed."""
    found = {}
    for number, raw in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).splitlines(), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise UserError(f"{where}: not UTF-8 text") from None
        if not line or line.startswith("#"):
            continue
        name, separator, value = line.partition("=")
        if not separator or not ENV_NAME.fullmatch(name.strip()):
            raise UserError(f"{where}: expected NAME=VALUE, got {line!r}")
        check_one_line(value, where)
        if re.search(r"\s#", value):  # looks like a comment after the value, and was sent as part of it
            raise UserError(f"{where}: a '#' after a blank is part of the value here, as DeepSpeed reads the file (it "
                            f"would reach {name.strip()} on every host); put a comment on a line of its own (a value "
                            f"that holds ' #' goes with --env {name.strip()}=VALUE)")
        found[name.strip()] = Export(value.strip(), where, expands=True)
    return found


def deepspeed_env_files(environ: dict[str, str], cwd: Path, home: Path) -> dict[str, Export]:
    """The variables of the env files DeepSpeed's runner would read, the working directory's overriding home's."""
    name = environ.get("DS_ENV_FILE", DEEPSPEED_ENV_FILE)
    found: dict[str, Export] = {}
    for path in dict.fromkeys([home / name, cwd / name]):  # one file when DS_ENV_FILE is an absolute path
        if path.is_file():
            found.update(_read_env_file(path))
    return found


def remote_exports(cli_env: dict[str, str], environ: dict[str, str], cwd: Path, home: Path) -> dict[str, Export]:
    """Every variable DeepSpeed's runner exports to the hosts of a multi-host job, later sources overriding earlier
    ones as in DeepSpeed: forwarded variables, env files, then `--env`."""
    forwarded = {name: Export(value, "your environment") for name, value in environ.items()
                 if name.startswith(DEEPSPEED_FORWARDED_PREFIXES)}
    # DeepSpeed's runner puts the working directory first in it, where an llm.py or llm/ of the user's took the place
    # of zerollm on every rank of every host: zerollm's own folder goes before it
    first = dict.fromkeys([str(ROOT), str(cwd)])
    pythonpath = ":".join([*first, *([environ["PYTHONPATH"]] if "PYTHONPATH" in environ else [])])
    forwarded["PYTHONPATH"] = Export(pythonpath, "zerollm's folder and the working directory, which DeepSpeed's "
                                                 "runner puts first in it")
    return {**forwarded, **deepspeed_env_files(environ, cwd, home),
            **{name: Export(value, "--env") for name, value in cli_env.items()}}


def env_file_text(exports: dict[str, Export], launcher: str) -> str:
    """The env file handed to DeepSpeed's runner (DS_ENV_FILE): each value written so that `launcher` delivers it
    unchanged, or refused."""
    lines = []
    for name, export in exports.items():
        where = f"{name} (from {export.origin})"
        if not ENV_NAME.fullmatch(name):
            raise UserError(f"{where}: DeepSpeed's runner would export this variable, but its name is not a shell "
                            "variable name; rename or unset it")
        _check_value(export.value, where)
        if export.value != export.value.strip():
            raise UserError(f"{where}: DeepSpeed's runner strips the blanks around an exported value; remove them")
        if launcher == "pdsh":
            value = pdsh_export(export.value, export.expands)
        elif DEEPSPEED_BARE_VALUE.fullmatch(export.value):
            value = export.value
        else:
            raise UserError(f"{where}: --launcher {launcher} passes exported values through DeepSpeed, which wraps "
                            f"one with characters other than {BARE_VALUE_RULE} in literal double quotes that end up "
                            "in the variable; set it on the hosts instead (their shell startup files), or use "
                            "--launcher pdsh or per-node mode")
        lines.append(f"{name}={value}\n")
    return "".join(lines)
