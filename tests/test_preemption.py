"""Stop requests inside a rank (llm.runtime.preemption): what reaches the rank, and what its forked children keep.
The stop of whole jobs (a checkpoint and exit 75, a second signal at once) is tested in test_train and test_grpo."""

import subprocess
import sys

RANK = """
import multiprocessing, os, signal, time
import torch
from llm.runtime.distributed import DistInfo
from llm.runtime.preemption import Preemption

def wait(ready):
    ready.set()
    time.sleep(60)

stop = Preemption(DistInfo(0, 0, 1, 1, torch.device("cpu")))
stop.install()
fork = multiprocessing.get_context("fork")
ready = fork.Event()
worker = fork.Process(target=wait, args=(ready,))
worker.start()
ready.wait(30)
worker.terminate()  # as DataLoader ends a worker that is slow to leave at the end of an epoch
worker.join(10)
time.sleep(0.5)
print("worker", worker.exitcode, "stop", stop.requested, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("stop", stop.requested, flush=True)
"""


def test_a_forked_worker_s_signals_are_its_own():
    """A data-loader worker forked after the rank set its stop signals ignored SIGTERM and passed it to the rank
    (they shared its wakeup pipe): DataLoader's terminate() of a slow worker asked the whole job to stop."""
    result = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["worker -15 stop False", "stop True"]
    assert result.stderr.count("zerollm: stopping with a checkpoint when this step ends") == 1
