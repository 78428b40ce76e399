"""Stand-ins for the cluster programs DeepSpeed's runner calls (pdsh, ssh, mpirun, ompi_info), written into a
directory put first on PATH. Each does on this machine what the real one does across hosts, as far as a job
started by `zerollm launch` can tell."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path


def pdsh_substitute(text: str, host: str, rank: int) -> str:
    """pdsh's expansion of the remote command (src/common/pipecmd.c): %h host, %u user, %n rank, %% a '%'."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "%" and i + 1 < len(text):
            out.append({"h": host, "u": "user", "n": str(rank), "%": "%"}.get(text[i + 1], text[i:i + 2]))
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


PDSH = inspect.getsource(pdsh_substitute) + r'''
"""pdsh: the remote command is the arguments after the options joined with spaces; pdsh replaces %h, %u, %n and %%
in it, then each host's login shell runs it. Here every host is this machine; each shell in STANDIN_SHELLS runs
the command for every host (host rank n runs with shell n modulo their number). With STANDIN_DRY the training
launcher is not started: printf records the words the shell built. After the command, `env -0` records the
variables the shell exported."""
import os
import subprocess
import sys

args, hosts = sys.argv[1:], []
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-w", "-f", "-R", "-l", "-u"):
        value = args.pop(0)
        hosts = value.split(",") if flag == "-w" else hosts
command = " ".join(args)
if command.startswith("pkill"):  # DeepSpeed's clean-up after a signal: this stand-in kills nothing by name
    sys.exit(0)

record, shells = os.environ["STANDIN_RECORD"], os.environ.get("STANDIN_SHELLS", "sh").split()
launch = " " + sys.executable + " -u -m deepspeed.launcher.launch "
procs = []
for rank, host in enumerate(hosts):
    shell = shells[rank % len(shells)]
    script = pdsh_substitute(command, host, rank)
    out = None
    if os.environ.get("STANDIN_DRY"):
        assert launch in script, script
        script = script.replace(launch, " printf '%s\\0'" + launch, 1)
        out = open(f"{record}/argv.{rank}", "wb")
    script += f'\nstatus=$?\nenv -0 > "{record}/env.{rank}"\nexit $status\n'
    procs.append(subprocess.Popen([shell, "-c", script], stdout=out))
sys.exit(max(p.wait() for p in procs))
'''

SSH = r'''
"""ssh for DeepSpeed's reachability check (`ssh -o ... HOST hostname`): every host is this machine."""
import subprocess
import sys

args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-o", "-p", "-l") else args[1:]
sys.exit(subprocess.run(args[1:]).returncode)
'''

MPIRUN = r'''
"""mpirun as DeepSpeed's MPI runners call it: starts the command -n times on this machine with the variables of
the MPI named by STANDIN_MPI (openmpi: OMPI_COMM_WORLD_*, mpich: PMI_RANK/PMI_SIZE/MPI_LOCALRANKID/
MPI_LOCALNRANKS) and those given with -x/-genv/-env; ranks are placed on the hosts of -hostfile (by slots) or
-hosts (by -ppn) in order."""
import os
import subprocess
import sys

args, env, count, per_host, host_slots = sys.argv[1:], dict(os.environ), None, None, None
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-n", "-np"):
        count = int(args.pop(0))
    elif flag == "-ppn":
        per_host = int(args.pop(0))
    elif flag in ("-hostfile", "--hostfile"):
        host_slots = [int(line.split("slots=")[1]) for line in open(args.pop(0)) if "slots=" in line]
    elif flag == "-hosts":
        args.pop(0)
    elif flag == "--mca":
        del args[:2]
    elif flag in ("-x", "-genv", "-env"):
        item = args.pop(0)
        name, value = item.split("=", 1) if "=" in item else (item, args.pop(0))
        env[name] = value
    else:
        sys.exit(f"stand-in mpirun: unknown option {flag}")
host_slots = host_slots or [per_host] * (count // per_host)
places = [(local, slots) for slots in host_slots for local in range(slots)]
flavor = os.environ["STANDIN_MPI"]
procs = []
for rank in range(count):
    local, local_size = places[rank]
    names = {"openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                         "OMPI_COMM_WORLD_LOCAL_SIZE"),
             "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")}[flavor]
    values = dict(zip(names, map(str, (rank, count, local, local_size))))
    procs.append(subprocess.Popen(args, env={**env, **values}))
sys.exit(max(p.wait() for p in procs))
'''

OMPI_INFO = r'''
"""ompi_info: DeepSpeed's Open MPI runner only asks whether it exists."""
'''


def install(bin_dir: Path, **programs: str) -> Path:
    """Write each program (name=source) into `bin_dir` as an executable run by this Python; returns `bin_dir`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, source in programs.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source.lstrip()}")
        path.chmod(0o755)
    return bin_dir
