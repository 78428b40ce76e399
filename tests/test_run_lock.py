"""One training job per run directory (`llm.train.run_lock`)."""

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import FIXTURES, REPO, run_cli, zerollm_here
from conftest import train_args as _args
from llm.errors import EXIT_RANK_LOST, UserError
from llm.runtime.rank_env import RANK_VARIABLES, free_port
from llm.train.run_lock import LOCK_FILE, check_run_unlocked, run_locked, take_run_lock

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from llm.train.run_lock import take_run_lock
    take_run_lock(Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def held(tmp_path):
    """`tmp_path / "run"` locked by another process, as by a training job that is running there."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline() == "held\n"
    yield run, holder.pid
    holder.kill()
    holder.wait()


def test_a_run_another_job_holds_is_refused_and_free_again_when_it_ends(held):
    run, pid = held
    message = f"{run}: another training job is writing there (pid {pid} on {socket.gethostname()}); wait for it to " \
              "end (or stop it), or choose another --out"
    for check in (check_run_unlocked, take_run_lock):
        with pytest.raises(UserError) as error:
            check(run)
        assert str(error.value) == message
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    check_run_unlocked(run)  # the kernel released the killed job's lock
    os.close(take_run_lock(run))


def test_a_process_the_holder_forked_does_not_keep_the_lock_after_it_dies(tmp_path):
    """A data loader worker outlives its killed rank for a few seconds: a resume started then is not refused."""
    run = tmp_path / "run"
    forking = HOLDER.replace('print("held"', 'import os\nif os.fork() == 0:\n    time.sleep(600)\nprint("held"')
    holder = subprocess.Popen([sys.executable, "-c", forking, str(run)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              start_new_session=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UserError):
            check_run_unlocked(run)
        holder.kill()
        holder.wait()
        check_run_unlocked(run)  # while the forked child still runs
    finally:
        os.killpg(holder.pid, 9)


def test_checks_made_at_the_same_moment_do_not_refuse_each_other(tmp_path):
    """The launchers of a job's nodes and its ranks all check the run as they start, on several nodes at once. With
    an exclusive lock for the check, one of them found another's check holding it and refused its own job."""
    run = tmp_path / "run"
    os.close(take_run_lock(run))  # a run trained before: its lock file is there, unlocked
    checking = textwrap.dedent("""
        import fcntl, os, sys, time
        fd = os.open(sys.argv[1], os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_SH)  # a check under way in another process
        print("checking", flush=True)
        time.sleep(600)
    """)
    other = subprocess.Popen([sys.executable, "-c", checking, str(run / LOCK_FILE)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout.readline() == "checking\n"
        check_run_unlocked(run)
    finally:
        other.kill()
        other.wait()


def test_checking_a_new_run_writes_nothing(tmp_path):
    check_run_unlocked(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_a_second_training_job_into_a_running_one_is_refused_before_its_ranks_start(held, pretrain_data, monkeypatch,
                                                                                      capsys):
    """Two jobs wrote one run directory side by side, interleaving checkpoints, `latest` and metrics."""
    run, pid = held
    assert zerollm_here(monkeypatch, *_args(pretrain_data, run, nproc=2)) == 2
    assert capsys.readouterr().err == f"zerollm: error: {run}: another training job is writing there (pid {pid} on " \
                                      f"{socket.gethostname()}); wait for it to end (or stop it), or choose another " \
                                      "--out\n"
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]


RACED = textwrap.dedent("""
    import sys
    import llm.train.run_lock as run_lock
    from llm.cli import main
    take = run_lock.take_run_lock

    def after_another_job(run_dir):  # another job into the same new --out ran to its end in the meantime
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "latest").write_text("global_step6")
        (run_dir / "metrics.jsonl").write_text('{"step": 6}\\n')
        return take(run_dir)

    run_lock.take_run_lock = after_another_job
    main(sys.argv[1:])
""")


@pytest.mark.parametrize("resume, said", [
    ([], "{run} already holds checkpoints; pass --resume auto to continue it, or choose another --out"),
    # resumed unchecked: neither its data, its shape nor its DeepSpeed settings were compared with them
    (["--resume", "auto"], "{run}: another training job saved checkpoints there while this one started; start this "
                           "one again to resume them (it checks them first)"),
])
def test_a_job_that_finished_there_before_this_one_took_the_lock_is_left_alone(pretrain_data, tmp_path, resume, said):
    """A job into a new --out passed its checks; another job into the same --out then ran to its end before the
    first took the lock: the first trained from scratch over the finished run (its metrics, config.yaml and
    `latest` replaced)."""
    run = tmp_path / "raced"
    env = {name: value for name, value in os.environ.items() if name not in ("LOCAL_RANK", *RANK_VARIABLES)}
    done = subprocess.run([sys.executable, "-c", RACED, *map(str, _args(pretrain_data, run, extra=resume))],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.endswith(f"zerollm: error: {said.format(run=run)}\n")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "checkpoints", "metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == '{"step": 6}\n'


RANK = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch.distributed as dist
    from llm.errors import UserError
    from llm.runtime.distributed import refuse_together
    from llm.train.run_lock import run_locked
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        with run_locked(Path(sys.argv[1]), rank, lambda problem: refuse_together(problem, rank == 0)):
            print("entered")
    except UserError as error:
        print("refused", error)
    finally:  # a group left to the interpreter's exit may abort it ("terminate called without an active exception")
        dist.destroy_process_group()
""")


@pytest.mark.parametrize("locked", [False, True])
def test_every_rank_enters_or_every_rank_refuses_as_rank_0_finds_the_lock(tmp_path, locked):
    """Rank 0 takes the lock; the other ranks, which cannot see it, learn of a refusal from rank 0."""
    run = tmp_path / "run"
    fd = take_run_lock(run) if locked else None
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, env={**os.environ, "MASTER_ADDR": "127.0.0.1",
                                                        "MASTER_PORT": str(port), "RANK": str(rank)})
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    if fd is not None:
        os.close(fd)
    if not locked:
        assert [out for out, _ in outputs] == ["entered\n", "entered\n"]
        return
    reason = f"{run}: another training job is writing there (pid {os.getpid()} on {socket.gethostname()})"
    assert all(out.startswith(f"refused {reason}") for out, _ in outputs)
    assert outputs[0][1].startswith(f"zerollm: error: {reason}") and outputs[1][1] == ""  # said by rank 0 alone


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path):
    """A folder named .train.lock (or another user's lock file) was ignored by the check and a traceback on rank 0,
    with the other ranks waiting for it in a collective."""
    run = tmp_path / "run"
    (run / LOCK_FILE).mkdir(parents=True)
    for check in (check_run_unlocked, take_run_lock):
        with pytest.raises(UserError, match=rf"^{run}: cannot lock {LOCK_FILE} there \(Is a directory\)"):
            check(run)


def test_a_refused_job_leaves_none_of_the_folders_it_created(tmp_path):
    (tmp_path / "kept").mkdir()
    run = tmp_path / "kept" / "new" / "deeper" / "run"
    with pytest.raises(UserError, match="ranks disagree"), run_locked(run, 0, lambda problem: None):
        assert (run / LOCK_FILE).is_file()
        raise UserError("ranks disagree")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]
    with run_locked(run, 0, lambda problem: None):
        (run / "config.yaml").write_text("written")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "config.yaml"]


ENDED = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch.distributed as dist
    from llm.runtime.distributed import refuse_together
    from llm.runtime.watchdog import Watchdog
    from llm.train.run_lock import run_locked
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with run_locked(Path(sys.argv[1]), rank, lambda problem: refuse_together(problem, rank == 0)) as tidy:  # as run
        watchdog = Watchdog(rank, 2, 30, announce=rank == 0, before_exit=tidy)
        if rank == 0:
            watchdog.end_job("failed before writing anything")  # ends the process with os._exit
        dist.barrier()  # rank 1: ended by its heartbeat thread reading the abort, or by the barrier failing
""")


def test_a_job_the_watchdog_ends_leaves_none_of_the_folders_it_created(tmp_path):
    """A job that failed on some rank before writing anything left a new folder holding only the lock file: the
    watchdog ends every rank with os._exit, which skips the lock's own tidying up."""
    run = tmp_path / "new" / "run"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", ENDED, str(run)], stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank)}) for rank in (0, 1)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[0].returncode == EXIT_RANK_LOST and procs[1].returncode != 0, errors
    assert "rank 0: failed before writing anything; the job is ended on every rank" in errors[0]
    assert list(tmp_path.iterdir()) == []


def test_a_demo_into_the_folder_of_a_running_demo_leaves_its_runs_alone(held, monkeypatch):
    """The demo removed its run folders before training them again, while the other demo was writing them."""
    import llm.demo

    def stop(corpus):  # the demo's first step after its clean-up: go no further
        raise RuntimeError("the demo went on")

    monkeypatch.setattr(llm.demo, "write_corpus", stop)
    sft_run, pid = held
    sft_run.rename(sft_run.with_name("sft_run"))  # the holder's lock stays on the renamed folder's file
    sft_run = sft_run.with_name("sft_run")
    (sft_run / "metrics.jsonl").write_text('{"step": 1}\n')
    (sft_run.parent / llm.demo.DEMO_MARKER).touch()  # an earlier demo's folder
    with pytest.raises(UserError, match=rf"^{sft_run}: another training job is writing there \(pid {pid} on "):
        llm.demo.run_demo(sft_run.parent)
    assert (sft_run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_the_file_it_names_kept(tmp_path, tokenizer_dir):
    """A `.train.lock` (or `.prepare.lock`, or the demo's marker) planted as a link, in a run folder handed over or
    a shared /tmp, made zerollm empty the file it named and write its pid there."""
    from llm.data.output import LOCK_FILE as PREPARE_LOCK
    from llm.held_locks import held_folder

    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    run, data, demo = tmp_path / "run", tmp_path / "data", tmp_path / "demo"
    for folder, name in ((run, LOCK_FILE), (data, PREPARE_LOCK), (demo, ".marker")):
        folder.mkdir()
        (folder / name).symlink_to(victim)
    said = f"cannot lock {LOCK_FILE} there ({LOCK_FILE} is a symbolic link, not a lock file; remove it)"
    for take in (take_run_lock, check_run_unlocked):
        with pytest.raises(UserError, match=rf"^{run}: {re.escape(said)}; training keeps it locked"):
            take(run)
    with pytest.raises(UserError, match=r"^--out .*demo: cannot write there \(.marker is a symbolic link, not a lock "
                                        r"file; remove it\)$"), held_folder(demo, ".marker", "zerollm demo"):
        pass
    result = run_cli("data", "prepare", "--input", FIXTURES / "pretrain" / "en_stories.txt", "--tokenizer",
                     tokenizer_dir, "--out", data)
    assert result.returncode == 2 and f"{PREPARE_LOCK} is a symbolic link, not a lock file; remove it" in result.stderr
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / LOCK_FILE)
    with pytest.raises(UserError, match=r"\(.train.lock is not a regular file, so not a lock file; remove it\)"):
        take_run_lock(fifo)
    assert victim.read_text() == "precious"
    from llm.demo import DEMO_MARKER, take_output_dir

    (tmp_path / "demo2").mkdir()
    (tmp_path / "demo2" / DEMO_MARKER).symlink_to(tmp_path / "created")  # the demo's own check made the file
    with pytest.raises(UserError, match=r"is a symbolic link, not a lock file; remove it\)$"):
        take_output_dir(tmp_path / "demo2")
    assert not (tmp_path / "created").exists()
