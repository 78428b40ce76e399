"""`python -m launch.torchrun ARGS`: torchrun (`torch.distributed.run`) with ARGS, ending as a job under DeepSpeed's
launcher or `zerollm train --nproc` ends, in one line where torchrun would print a traceback.

torchrun reports any failed rank as its ChildFailedError, a traceback and a table of the failures, and exits 1;
DeepSpeed's launcher passes the rank's code on. Here:

- when the ranks of this node that failed all exited 2 (refused their job with one line, `zerollm: error: ...`, see
  llm/errors.py) or all exited 76 (a rank's watchdog named a lost or hung rank), this exits with that code, after
  the ranks' lines and torchrun's log lines (the ranks it stopped, the exit code), without its traceback;
- when a rank was ended by a signal (SIGKILL from the kernel's OOM killer, a segfault), it is named in one line and
  this exits 76 (EXIT_RANK_LOST), as `zerollm train --nproc` does;
- when the nodes do not all meet within the rendezvous's join timeout (`--rdzv-conf join_timeout=S`, which
  `zerollm launch` sets to train.collective_timeout_s) or node 0's rendezvous cannot be reached, one line and exit 2;
  where it stops answering once the nodes have met and trained (node 0 ended or was cut off: torchrun's agent asks
  it, as the ranks run, whether nodes wait to join), one line and exit 76, as a lost rank ends a job;
- any other failed rank: torchrun's table of the failures (each failed rank, its exit code or signal), without
  its traceback, and this exits as DeepSpeed's per-node launcher would, with the code of the rank that failed
  first, or 256 - N where signal N (a SIGTERM from outside) ended it, which `zerollm launch` reads as DeepSpeed's
  (launch.launcher.deepspeed_signal: one line and 76, unless it forwarded a stop);
- any other torchrun failure is torchrun's own report, unchanged.

A rank that torchrun itself ended because another failed (SIGTERM, then SIGKILL after its timeout: a rank still
importing when the first one refused) counts among its failures too, and is passed over.
"""

from __future__ import annotations

import signal
import sys
import traceback

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun_main

from launch.local import RESUME_ADVICE, report_rank_ended
from llm.errors import EXIT_PIPE_CLOSED, EXIT_PREEMPTED, EXIT_RANK_LOST, EXIT_USER_ERROR, report

CLOSING_CODES = (-signal.SIGTERM, -signal.SIGKILL)
"""Exit codes of a rank that torchrun ended after another rank failed."""
QUIET_CODES = (EXIT_USER_ERROR, EXIT_RANK_LOST, EXIT_PREEMPTED, EXIT_PIPE_CLOSED)
"""Exit codes of ranks that said why in one line themselves (a stop: that they saved; a closed output pipe: nothing
to say)."""


def _codes(failure: ChildFailedError) -> list[int]:
    return [process.exitcode for process in failure.failures.values()]


def quiet_code(failure: ChildFailedError) -> int | None:
    """The code every failed rank in `failure` ended with after saying why (2 or 76), apart from ranks torchrun
    ended; None when they did not all end so. Asked after `lost_rank`: a rank the OOM killer ended first is the
    cause, even where the ranks torchrun closed then said why they stopped (a watchdog's 76, a save's 75)."""
    codes = _codes(failure)
    for code in QUIET_CODES:
        if code in codes and all(c in (code, *CLOSING_CODES) for c in codes):
            return code
    return None


def first_failure(failure: ChildFailedError) -> tuple[int, ProcessFailure]:
    """(rank, failure) of the first failure torchrun saw: it records them in that order (their timestamps are whole
    seconds)."""
    return next(iter(failure.failures.items()))


def passed_on_code(failure: ChildFailedError) -> int:
    """The exit code DeepSpeed's per-node launcher ends with for `failure`: the return code of the rank that failed
    first, -N for signal N, which the process reports as 256 - N."""
    return first_failure(failure)[1].exitcode % 256


def lost_rank(failure: ChildFailedError) -> tuple[int, int, int] | None:
    """(rank, pid, signal) of the rank whose ending ended the job, where a signal other than SIGTERM ended it (the
    OOM killer's SIGKILL, a segfault): the first failure torchrun saw. None where that was a rank's own exit, or a
    SIGTERM, perhaps a stop `zerollm launch` forwarded (`passed_on_code` leaves that to it): torchrun then closed the
    others with SIGTERM, and SIGKILL 30 s later a rank that had not ended yet (still starting, or blocked in a
    collective), which is not the cause."""
    rank, process = first_failure(failure)
    return (rank, process.pid, -process.exitcode) if process.exitcode < 0 and process.exitcode != -signal.SIGTERM \
        else None


def _while_running(exc: BaseException) -> bool:
    """Whether torchrun's agent raised `exc` while its ranks ran (asking the rendezvous whether nodes wait to join),
    not while the nodes met."""
    return any(frame.name == "num_nodes_waiting" for frame in traceback.extract_tb(exc.__traceback__))


def _rendezvous(argv: list[str]) -> tuple[str, str, str, bool]:
    """(nodes, endpoint, join timeout in seconds, whether this node hosts it) of the torchrun command line `argv`,
    for messages."""
    args, _ = get_args_parser().parse_known_args(argv)
    conf = dict(item.partition("=")[::2] for item in (args.rdzv_conf or "").split(",") if item)
    return args.nnodes, args.rdzv_endpoint, conf.get("join_timeout", "600"), conf.get("is_host") == "1"


def main(argv: list[str]) -> int:
    try:
        torchrun_main(argv)
    except ChildFailedError as failure:
        lost = lost_rank(failure)  # first: the ranks torchrun closed after it may have said why they ended too
        if lost is not None:
            rank, pid, signum = lost
            return report_rank_ended(f"rank {rank} (pid {pid})", signum)
        code = quiet_code(failure)
        if code is not None:
            return code
        print(failure.format_msg().strip("\n"), file=sys.stderr, flush=True)
        return passed_on_code(failure)
    except SignalException as stopped:  # a stop sent to torchrun itself (to every process of a job step at once):
        return 128 + stopped.sigval  # it has closed its ranks, which save; `zerollm launch` says how the job ended
    except RendezvousTimeoutError:
        nodes, endpoint, timeout, _ = _rendezvous(argv)
        report(f"the {nodes} nodes did not all meet at {endpoint} within train.collective_timeout_s={timeout} s "
               "(torchrun's rendezvous); start every node with the same --nnodes, --master-addr, --master-port and "
               "--rdzv-id, and check that node 0 is reachable from the others")
        return EXIT_USER_ERROR
    except RendezvousConnectionError as exc:
        _, endpoint, _, hosting = _rendezvous(argv)
        reason = (str(exc).strip().splitlines() or ["no answer"])[-1]
        if _while_running(exc):  # node 0 ended (or was cut off) after the nodes met: 'start node 0 first', exit 2,
            # told a scheduler not to retry
            report(f"the rendezvous at {endpoint} stopped answering while the job ran ({reason}): node 0 ended or "
                   f"cannot be reached; the job is ended on this node: {RESUME_ADVICE}")
            return EXIT_RANK_LOST
        report(f"cannot open the rendezvous at {endpoint} on this node ({reason}); choose a free --master-port"
               if hosting else
               f"cannot reach the rendezvous at {endpoint} ({reason}); start node 0 (--node-rank 0) first, with "
               "the same --master-addr and --master-port, and check that it is reachable from this node")
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
