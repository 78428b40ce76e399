"""Whether every host of a hostfile answers over ssh, as pdsh will reach it, before the job starts.

DeepSpeed's runner asks the first host alone (`ssh -o PasswordAuthentication=no HOST hostname`) and fails with a
traceback; a later host that cannot be reached stalls or fails the job once the others have started. `zerollm
launch` asks every host at once, in parallel, without any prompt, and says in one line which cannot be reached
and why (ssh's own words)."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from llm.errors import UserError

SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
"""No password or host-key prompt (pdsh could not answer one either), and an answer within 10 s of connecting."""
NAMED = 5
"""Hosts named in the message; the rest are counted."""


def ssh_problem(host: str) -> str | None:
    """Why `ssh HOST true` fails (ssh's last line of error, or its exit status), None when it succeeds."""
    try:
        result = subprocess.run(["ssh", *SSH_OPTIONS, host, "true"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, errors="replace", timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "no answer in 60 s"
    if result.returncode == 0:
        return None
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"ssh exited with status {result.returncode}"


def check_reachable(hosts: list[str], hostfile: str) -> None:
    """Refuse the job, naming the hosts of `hostfile` that `ssh` cannot reach without a prompt, and why."""
    if shutil.which("ssh") is None:
        raise UserError(f"--hostfile {hostfile}: pdsh reaches the hosts over ssh, and no ssh program is on PATH; "
                        "install an ssh client, or choose another --launcher")
    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        problems = {host: problem for host, problem in zip(hosts, pool.map(ssh_problem, hosts)) if problem}
    if problems:
        named = "; ".join(f"{host}: {problem}" for host, problem in list(problems.items())[:NAMED])
        more = f"; and {len(problems) - NAMED} more" if len(problems) > NAMED else ""
        raise UserError(f"--hostfile {hostfile}: {len(problems)} of {len(hosts)} host(s) cannot be reached over ssh "
                        f"without a prompt, as pdsh needs ({named}{more}); check the names, or set up "
                        "passwordless ssh (`ssh HOST true` must work)")
