"""Stop requests inside a rank (llm.runtime.preemption): what reaches the rank, and what its forked children keep.
The stop of whole jobs (a checkpoint and exit 75, a second signal at once) is tested in test_train and test_grpo."""

import subprocess
import sys

import pytest

START = """
import asyncio, multiprocessing, os, signal, time
import torch
from torch.utils.data import DataLoader
import llm.runtime.preemption as preemption
from llm.runtime.distributed import DistInfo

stop = preemption.Preemption(DistInfo(0, 0, 1, 1, torch.device("cpu")))
stop.install()
"""


def _rank(script: str, exit_code: int = 0) -> subprocess.CompletedProcess:
    """START then `script` in a process of its own group (a Ctrl-C there reaches only it and its children)."""
    result = subprocess.run([sys.executable, "-c", START + script], capture_output=True, text=True, timeout=120,
                            start_new_session=True)
    assert result.returncode == exit_code, result.stderr[-3000:]
    return result


def test_a_forked_worker_s_signals_are_its_own():
    """A worker forked after the rank set its stop signals shared its wakeup pipe: a SIGTERM to the worker (with
    SIGTERM's default, or a handler it set itself) was read as one to the rank."""
    result = _rank("""
def wait(ready, handled):
    if handled:  # a helper that ends itself on SIGTERM, through a Python handler of its own
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ready.set()
    time.sleep(60)

fork = multiprocessing.get_context("fork")
for handled in (False, True):
    ready = fork.Event()
    worker = fork.Process(target=wait, args=(ready, handled))
    worker.start()
    ready.wait(30)
    worker.terminate()
    worker.join(10)
    time.sleep(0.5)
    print("worker", worker.exitcode, "stop", stop.requested, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("stop", stop.requested, flush=True)
""")
    assert result.stdout.splitlines() == ["worker -15 stop False", "worker 0 stop False", "stop True"]
    assert result.stderr.count("zerollm: stopping with a checkpoint when this step ends") == 1


def test_a_ctrl_c_leaves_the_data_loader_workers_running():
    """A Ctrl-C reaches the terminal's whole process group: data-loader workers (2 by default on a GPU) ended by a
    KeyboardInterrupt crashed the rank's next draw, before the stop's checkpoint."""
    result = _rank("""
draws = iter(DataLoader(range(10**6), batch_size=4, num_workers=2))
next(draws)
time.sleep(1)
os.killpg(os.getpgrp(), signal.SIGINT)
time.sleep(0.5)
print(sum(1 for _, _ in zip(range(16), draws)), "draws", "stop", stop.requested, preemption.Preemption.stopped_by,
      flush=True)
""")
    assert result.stdout.splitlines() == ["16 draws stop True 2"]  # bench learn ends with 128 + SIGINT's 2


def test_a_stop_is_not_lost_to_an_asyncio_loop_that_took_the_wakeup_descriptor():
    """A reward running an asyncio loop with a signal handler left Python with no wakeup descriptor: every later
    SIGTERM and SIGINT was swallowed."""
    result = _rank("""
async def handler_set():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: None)

asyncio.run(handler_set())
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("stop", stop.requested, flush=True)
""")
    assert result.stdout.splitlines() == ["stop True"]


def test_a_second_stop_after_an_asyncio_loop_took_the_wakeup_descriptor_stops_the_rank_at_once():
    """The step after a reward whose asyncio loop took the wakeup descriptor takes it back; unpinned: without it a
    second SIGTERM (a hung job's) left the rank running."""
    result = _rank("""
preemption.FORCE_AFTER_S = 0.0  # a second request stops at once however soon it follows the first
async def handler_set():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: None)

asyncio.run(handler_set())
stop.agreed()  # the step after the reward
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("still running", flush=True)
""", exit_code=143)
    assert result.stdout == "" and "zerollm: stopped at once by a second signal, without a checkpoint" in result.stderr


def test_a_step_that_fails_before_a_forced_exit_is_left_unsaid():
    """A step before a forced exit that raised (wandb's end, its network gone) printed its traceback after the
    rank's last line."""
    result = _rank("""
from llm.runtime.forced_exit import before_forced_exit

preemption.FORCE_AFTER_S = 0.0  # a second request stops at once however soon it follows the first
with before_forced_exit(lambda code: 1 / 0):
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
""", exit_code=143)
    assert "stopped at once by a second signal" in result.stderr
    assert "Traceback" not in result.stderr and "ZeroDivisionError" not in result.stderr


def test_one_ctrl_c_is_not_taken_for_two_when_the_error_stream_is_slow():
    """One Ctrl-C reaches a rank of `--nproc` twice, ms apart; the acknowledgement's write held the signal reader
    while the error stream did not drain, so the second copy was read a second later: a stop at once, exit 143."""
    result = _rank("""
write = os.write
def slow_write(fd, data):
    if fd == 2:
        time.sleep(1.5)
    return write(fd, data)

os.write = slow_write
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.01)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(3)
print("stop", stop.requested, flush=True)
""")
    assert result.stdout.splitlines() == ["stop True"]


def test_signals_after_the_stop_s_checkpoint_ask_nothing_more():
    """A launcher ends the other ranks once one exits 75: their SIGTERM, a second or more after the stop request,
    was read as a second request and ended a rank with 143 and 'without a checkpoint' after its checkpoint."""
    result = _rank("""
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
stop.saved()
time.sleep(1.2)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("alive", flush=True)
""")
    assert result.stdout.splitlines() == ["alive"] and "without a checkpoint" not in result.stderr


def test_the_steps_before_a_forced_exit_run_newest_first_and_none_holds_the_exit(monkeypatch):
    """A second signal or the watchdog ends a rank with os._exit, which skipped the wandb run's end."""
    from llm.runtime import forced_exit

    monkeypatch.setattr(forced_exit, "STEP_WAIT_S", 2.0)  # time enough to start each step
    import threading

    ran, finished, release = [], [], threading.Event()

    def hangs(code):
        ran.append(("hangs", code))
        release.wait(10)
        finished.append(code)

    def fails(code):
        ran.append(("fails", code))
        raise RuntimeError("wandb is gone")

    with forced_exit.before_forced_exit(lambda code: ran.append(("first", code))), \
            forced_exit.before_forced_exit(hangs), forced_exit.before_forced_exit(fails):
        forced_exit.run_before_forced_exit(143)
        assert finished == []  # it returned while `hangs` still waited
    release.set()
    assert ran == [("fails", 143), ("hangs", 143), ("first", 143)]
    forced_exit.run_before_forced_exit(143)  # the blocks are left: nothing more runs
    assert len(ran) == 3
    with pytest.raises(RuntimeError), forced_exit.before_forced_exit(lambda code: ran.append(("failed job", code))):
        raise RuntimeError("the job failed")
    forced_exit.run_before_forced_exit(143)  # a block left by an exception: its step does not run either
    assert len(ran) == 3
