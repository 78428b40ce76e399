"""`--nproc N` on one machine: start the same `zerollm` command on N local ranks and wait for them.

The ranks are started here, directly, with the variables DeepSpeed's per-node launcher gives them (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): going through DeepSpeed's runner and per-node
launcher would start two more interpreters, each importing DeepSpeed, before the first rank starts. The behaviour
is the per-node launcher's, with stop signals handled the way `zerollm launch` handles them:

- SIGTERM/SIGINT to this process is forwarded, as it came, to every rank: they agree to stop, save a checkpoint and
  exit 75; a second one stops them at once, and the job exits 128 + the signal this process was sent last (130 for
  Ctrl-C); ranks that have not ended STOP_GRACE_S after the first stop, or GRACE_S after a second or after another
  rank saved and stopped (one frozen, or stuck in a collective with it), are killed and named in one line, and the
  job exits 76 (EXIT_RANK_LOST);
- when a rank fails, the others are sent SIGTERM and killed after GRACE_S; the job's exit code is the first
  failing rank's, or 76 (EXIT_RANK_LOST) where that rank was ended by a signal (SIGKILL from the kernel's OOM
  killer, a segfault), which is named in one line; the ranks' agreed refusal (2) wins over a rank that ended as the
  job came down;
- if this process is killed outright, the ranks notice (`llm.runtime.supervisor`) and stop as on SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time

from launch.own_module import zerollm_command
from llm.errors import EXIT_PREEMPTED, EXIT_RANK_LOST, EXIT_USER_ERROR, STOP_SIGNALS, UserError, report
from llm.runtime.rank_env import LOCAL_SIZE_VARIABLES, RANK_VARIABLES, announced_world_size, free_port
from llm.runtime.supervisor import supervisor_env

COMMAND_VARIABLE = "ZEROLLM_COMMAND"
"""The command as the user typed it (with --nproc), given to the ranks for their run record
(`llm.train.run_record`)."""
GRACE_S = 30.0
"""How long the other ranks get to end by themselves after one failed, before they are killed."""
STOP_GRACE_S = 600.0
"""How long the ranks get after a stop to finish their step, save its checkpoint and end, before those left are
killed: every rank frozen (SIGSTOP) held the job for ever, and a second stop did not end it. As long as the default
train.collective_timeout_s, after which a rank's watchdog ends a collective stuck with a frozen rank: torchrun and
DeepSpeed's per-node launcher allow 30 s, less than a large model's save takes (a second stop allows GRACE_S)."""
POLL_S = 0.05
RESUME_ADVICE = "rerun with --resume auto to continue from its last complete checkpoint"
"""What to do when a training job's rank was lost (`report_rank_ended`)."""


def under_launcher() -> bool:
    """True inside a process started by a launcher: deepspeed and torchrun set LOCAL_RANK, mpirun its rank
    variables."""
    return "LOCAL_RANK" in os.environ or any(name in os.environ for name in RANK_VARIABLES)


def starts_ranks(nproc: int) -> bool:
    """Whether this process is to start `nproc` (--nproc) local ranks and wait for them. A process that a launcher
    started is a rank itself (False), and an --nproc other than 1 there must be its job's size: in a shell that an
    interactive `srun` or an exported LOCAL_RANK left launcher variables in, `--nproc 2` trained on one rank without
    a word."""
    if not under_launcher():
        return nproc > 1
    size = announced_world_size(os.environ)
    here = next((int(os.environ[name]) for name in LOCAL_SIZE_VARIABLES if os.environ.get(name, "").isdigit()), size)
    if nproc not in (1, size, here):  # the job's size, or its ranks on this node (torchrun --nproc-per-node)
        names = ", ".join(name for name in ("LOCAL_RANK", *RANK_VARIABLES) if name in os.environ)
        raise UserError(f"--nproc {nproc}, but this process is a rank of a job of {size} (its environment holds a "
                        f"launcher's {names}); leave --nproc out under a launcher, or unset those variables to start "
                        f"{nproc} ranks from here")
    return False


def strip_option(argv: list[str], option: str) -> list[str]:
    """argv without `option VALUE` / `option=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def rank_environments(nproc: int, port: int, command: str = "train") -> list[dict[str, str]]:
    """The environment of each local rank of an `nproc`-rank job meeting at 127.0.0.1:`port`, started by `zerollm
    COMMAND --nproc`."""
    shared = {**os.environ, **supervisor_env(f"zerollm {command} --nproc {nproc}"), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "CROSS_RANK": "0",
              "CROSS_SIZE": "1"}
    return [{**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(nproc)]


def exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it: a death by signal N is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def _signal_all(ranks: list[subprocess.Popen], signum: int) -> None:
    for rank in ranks:
        if rank.poll() is None:
            with contextlib.suppress(OSError):  # ended meanwhile
                rank.send_signal(signum)


STOPPED_AT_ONCE = (*(128 + signum for signum in STOP_SIGNALS), *(-signum for signum in STOP_SIGNALS))
"""The return codes of a rank a second stop request ended at once (`llm.runtime.preemption`), or a stop request
before its handlers were set (still importing)."""


def wait_for_ranks(ranks: list[subprocess.Popen], grace_s: float = GRACE_S, advice: str = RESUME_ADVICE,
                   stop_grace_s: float = STOP_GRACE_S) -> int:
    """Wait for every rank; the job's exit code (module docstring). Forwards SIGTERM/SIGINT while waiting. `advice`
    ends the line naming a rank a signal ended, or ranks killed `stop_grace_s` after a stop (`waited_for`)."""
    stopping: list[int] = []  # a stop forwarded: a rank it ends before its handler is set is not a lost rank
    last_stop_at = 0.0

    def forward(signum, frame):
        nonlocal last_stop_at
        stopping.append(signum)
        last_stop_at = time.monotonic()
        _signal_all(ranks, signum)  # as sent: a rank a terminal's Ctrl-C reaches reads two copies of one signal, and
        # ends (its wandb run records it) as the job does, by whichever it reads first

    def first_failure() -> int | None:
        """Of the ranks seen failing at once: one that refused the job (exit 2: the ranks agree on a refusal before
        any leaves, so another ending meanwhile, by a signal too, followed it as the job came down), else one a
        signal ended (the others followed it), else any but one that saved and stopped after a stop (75)."""
        failed = sorted((rank.returncode != EXIT_USER_ERROR, rank.returncode >= 0,
                         bool(stopping) and rank.returncode == EXIT_PREEMPTED, i)
                        for i, rank in enumerate(ranks) if rank.returncode not in (None, 0))
        return _failure(failed[0][-1], ranks[failed[0][-1]], named=not stopping, advice=advice) if failed else None

    def waited_for() -> str | None:
        """Where the ranks left have waited too long after a stop: STOP_GRACE_S after the first, GRACE_S after a
        second or after a rank saved and stopped (the save is collective: the others are done with it too)."""
        now = time.monotonic()
        if saved_at is not None and now > saved_at + grace_s:
            return f"{grace_s:g} s of a rank's stop with its checkpoint"
        if len(stopping) == 1 and now > last_stop_at + stop_grace_s:
            return f"{stop_grace_s:g} s of the stop"
        if len(stopping) > 1 and now > last_stop_at + grace_s:
            return f"{grace_s:g} s of the last stop"
        return None

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failure, kill_at, saved_at, hung, waited = None, None, None, [], None
        while None in [rank.poll() for rank in ranks]:  # every rank polled: a later one may have failed
            code = first_failure() if kill_at is None else None
            if code is not None and stopping and code == EXIT_PREEMPTED:  # saved and stopped as asked: no failure
                saved_at = saved_at or time.monotonic()
            elif code is not None:
                failure, kill_at = code, time.monotonic() + grace_s
                _signal_all(ranks, signal.SIGTERM)
            if not hung and (waited := waited_for()):
                hung = [f"rank {i} (pid {rank.pid})" for i, rank in enumerate(ranks) if rank.poll() is None]
            if hung or kill_at is not None and time.monotonic() > kill_at:
                _signal_all(ranks, signal.SIGKILL)
            time.sleep(POLL_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if hung:
        report(f"{', '.join(hung)} did not end within {waited} (frozen, or stuck in a collective), and "
               f"{'was' if len(hung) == 1 else 'were'} killed; the job is ended on every rank: {advice}")
        return EXIT_RANK_LOST
    if failure is None:
        failure = first_failure() or 0
    if stopping and failure in STOPPED_AT_ONCE:  # a rank ends by whichever stop it reads first (a SIGTERM sent
        failure = 128 + stopping[-1]  # here, then a Ctrl-C), or before its handler was set: said as the last was sent
    return exit_code(failure)


def _failure(index: int, rank: subprocess.Popen, named: bool, advice: str) -> int:
    """The job's return code for its first failing rank: that rank's, or (`named`) EXIT_RANK_LOST for a rank ended
    by a signal, named here (the others' watchdogs would only see it stop responding, and be stopped first)."""
    if rank.returncode >= 0 or not named:
        return rank.returncode
    return report_rank_ended(f"rank {index} (pid {rank.pid})", -rank.returncode, advice)


def report_rank_ended(who: str, signum: int, advice: str = RESUME_ADVICE) -> int:
    """Say in one line that `who` ('rank 1 (pid 42)') was ended by signal `signum` (the OOM killer's SIGKILL, a
    segfault), and what to do (`advice`), and return EXIT_RANK_LOST: how a job ends for it, whichever way its ranks
    were started."""
    try:
        name = f"{signal.Signals(signum).name} (signal {signum})"
    except ValueError:
        name = f"signal {signum}"
    report(f"{who} was ended by {name}; the job is ended on every rank: {advice}")
    return EXIT_RANK_LOST


def relaunch_local(nproc: int, argv: list[str], advice: str = RESUME_ADVICE) -> int:
    """Start `zerollm <argv>` (without --nproc) on `nproc` local ranks and wait (`wait_for_ranks`, with `advice`);
    returns the job's exit code. Each rank chooses its own accelerator (`llm.runtime.accelerator.
    ensure_accelerator_env`, knowing the job's size, and making again a choice this process made for itself), so
    this process does not need torch."""
    command = [*zerollm_command("-u"), *strip_option(argv, "--nproc")]
    typed = shlex.join(["zerollm", *argv])
    ranks = [subprocess.Popen(command, env={**env, COMMAND_VARIABLE: typed})
             for env in rank_environments(nproc, free_port(), argv[0])]
    return wait_for_ranks(ranks, advice=advice)
