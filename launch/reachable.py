"""Whether every host of a hostfile answers over ssh, as pdsh will reach it, before the job starts.

DeepSpeed's runner asks the first host alone (`ssh -o PasswordAuthentication=no HOST hostname`) and fails with a
traceback; a later host that cannot be reached stalls or fails the job once the others have started. `zerollm
launch` asks every host it will start ranks on, in parallel, without any prompt and with the options pdsh gives
(PDSH_SSH_ARGS, PDSH_SSH_ARGS_APPEND: a port, a key), and says in one line which cannot be reached and why (ssh's
own words)."""

from __future__ import annotations

import ipaddress
import os
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from llm.errors import UserError

SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
"""No password or host-key prompt (pdsh could not answer one either), and an answer within 10 s of connecting."""
NAMED = 5
"""Hosts named in the message; the rest are counted."""
MAX_ASKING = 256
"""Hosts asked at once."""


def pdsh_ssh_options(environ: dict[str, str]) -> list[str]:
    """The ssh options pdsh gives, as words: PDSH_SSH_ARGS in place of its own (`-2 -a -x -l%u %h`), less the user
    and host it fills in (%u, the user running it, as ssh's own default; %h, the host asked here), then
    PDSH_SSH_ARGS_APPEND. A site whose ssh needs its port in PDSH_SSH_ARGS had every host refused as unreachable."""
    words = []
    for name in ("PDSH_SSH_ARGS", "PDSH_SSH_ARGS_APPEND"):
        try:
            words += shlex.split(environ.get(name, ""))
        except ValueError as exc:
            raise UserError(f"{name} cannot be split into ssh options ({exc})") from None
    options: list[str] = []
    for word in words:
        if word == "%u" and options[-1:] == ["-l"]:
            options.pop()  # -l %u
        elif word not in ("%h", "-l%u"):
            options.append(word)
    return options


def _ssh(host: str, options: list[str], *command: str) -> tuple[str | None, str]:
    """Run `ssh OPTIONS HOST COMMAND`: why it failed (ssh's last line of error, or its exit status; None when it
    succeeded), and what it printed."""
    try:
        result = subprocess.run(["ssh", *SSH_OPTIONS, *options, host, *command], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, errors="replace", timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "no answer in 60 s", ""
    if result.returncode == 0:
        return None, result.stdout
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"ssh exited with status {result.returncode}", result.stdout


def ssh_problem(host: str, options: list[str]) -> str | None:
    """Why `ssh OPTIONS HOST true` fails, None when it succeeds."""
    return _ssh(host, options, "true")[0]


def host_address(host: str, hostfile: str) -> str:
    """The first address `hostname -I` gives on `host`, asked over ssh with pdsh's options: where the other hosts
    meet rank 0 when no --master-addr is given. DeepSpeed's runner asks it with a bare ssh (which fails where the
    hosts need PDSH_SSH_ARGS_APPEND) and fails with a traceback when the command fails or prints nothing."""
    problem, printed = _ssh(host, pdsh_ssh_options(dict(os.environ)), "hostname", "-I")
    words = printed.split()
    if problem is None and not words:
        problem = "it printed no address"
    if problem is None:
        try:
            return str(ipaddress.ip_address(words[0]))
        except ValueError:  # a login banner's word, or worse: `hostname -I` prints IP addresses only
            problem = f"it printed {words[0][:40]!r}, not an IP address"
    raise UserError(f"--hostfile {hostfile}: the first host, {host}, where rank 0 runs, cannot give its address with "
                    f"`hostname -I` over ssh ({problem}); give --master-addr")


def check_reachable(hosts: list[str], hostfile: str) -> None:
    """Refuse the job, naming the hosts of `hostfile` that `ssh` cannot reach without a prompt, and why."""
    if shutil.which("ssh") is None:
        raise UserError(f"--hostfile {hostfile}: pdsh reaches the hosts over ssh, and no ssh program is on PATH; "
                        "install an ssh client, or choose another --launcher")
    options = pdsh_ssh_options(dict(os.environ))
    with ThreadPoolExecutor(max_workers=min(MAX_ASKING, len(hosts))) as pool:
        answers = pool.map(lambda host: ssh_problem(host, options), hosts)
        problems = {host: problem for host, problem in zip(hosts, answers) if problem}
    if problems:
        named = "; ".join(f"{host}: {problem}" for host, problem in list(problems.items())[:NAMED])
        more = f"; and {len(problems) - NAMED} more" if len(problems) > NAMED else ""
        raise UserError(f"--hostfile {hostfile}: {len(problems)} of {len(hosts)} host(s) cannot be reached over ssh "
                        f"without a prompt, as pdsh needs ({named}{more}); check the names, or set up "
                        "passwordless ssh (`ssh HOST true` must work)")
