"""zerollm meets users where they are: the DeepSpeed and torchrun command lines they already know start a training
job (`deepspeed --hostfile H --module llm train ...`, `deepspeed --hostfile H $(which zerollm) train ...`,
`torchrun --nproc-per-node N -m llm train ...`), so does `python -m llm.cli`, and ranks started by mpirun
(through `zerollm launch --launcher openmpi|mpich`, here with a stand-in mpirun) take their ranks from the MPI
environment and form one job."""

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO, TINY
from llm.errors import UserError
from llm.runtime import rank_env
from llm.runtime.cpu_threads import cpu_threads_per_rank, ranks_sharing_cpus, threads_asked
from llm.runtime.distributed import _wait_for_rendezvous
from llm.runtime.rank_env import RANK_VARIABLES, free_port, rank_environment
from standins import MPIRUN, OMPI_INFO, SSH, install

BIN = Path(sys.executable).parent


def _job(data, out):
    sets = [a for o in [*TINY, "train.precision=fp32", "train.max_steps=2"] for a in ("--set", o)]
    return ["train", "pretrain", "--recipe", "demo", "--data", str(data), "--out", str(out), *sets]


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run(command, env=None):
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600, cwd=REPO,
                            env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_python_m_llm_cli_is_the_cli():
    result = subprocess.run([sys.executable, "-m", "llm.cli", "--help"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and result.stdout.startswith("usage: zerollm ")
    result = subprocess.run([sys.executable, "-m", "llm.cli", "launch", "--", "generate"], capture_output=True,
                            text=True, cwd=REPO)
    assert result.returncode == 2 and result.stderr.startswith("zerollm: error: `generate` is not a training command")


@pytest.mark.parametrize("program", [["--module", "llm"], [BIN / "zerollm"]], ids=["module", "console-script"])
def test_deepspeed_command_line_trains_on_two_ranks(pretrain_data, tmp_path, program):
    """DeepSpeed's per-node launcher passes --local_rank=N before the command; the ranks accept it."""
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    run = tmp_path / "run"
    result = _run([BIN / "deepspeed", "--hostfile", tmp_path / "hosts", "--no_ssh_check", "--master_addr",
                   "127.0.0.1", "--master_port", free_port(), *program, *_job(pretrain_data, run)])
    assert "--local_rank=0" in result.stdout + result.stderr and "2 rank(s)" in result.stdout
    assert _steps(run) == [1, 2]


def test_torchrun_command_line_trains_on_two_ranks(pretrain_data, tmp_path):
    run = tmp_path / "run"
    result = _run([BIN / "torchrun", "--nproc-per-node", 2, "--master-port", free_port(), "-m", "llm",
                   *_job(pretrain_data, run)])
    assert "2 rank(s)" in result.stdout and _steps(run) == [1, 2]


@pytest.mark.parametrize("flavor", ["openmpi", "mpich"])
def test_zerollm_launch_with_an_mpi_launcher_trains_one_job(pretrain_data, tmp_path, flavor):
    """DeepSpeed's Open MPI runner starts `python -u -m llm` with only OMPI_COMM_WORLD_* to tell ranks apart; its
    MPICH runner starts its helper, which maps PMI_RANK to RANK, and our console script. Two "hosts" of one slot each,
    on this machine."""
    bin_dir = install(tmp_path / "bin", mpirun=MPIRUN, ompi_info=OMPI_INFO, ssh=SSH)  # ssh: every host is here
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    run = tmp_path / "run"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STANDIN_MPI": flavor, "HOME": str(tmp_path)}
    result = _run([sys.executable, "-m", "llm", "launch", "--hostfile", tmp_path / "hosts", "--launcher", flavor,
                   "--master-port", free_port(), "--", *_job(pretrain_data, run)], env=env)
    assert "2 rank(s)" in result.stdout and _steps(run) == [1, 2]
    config = json.loads((run / "ds_config.json").read_text())
    assert config["train_batch_size"] == 2 * config["train_micro_batch_size_per_gpu"]  # one job of two ranks


# ---- which rank am I ---------------------------------------------------------------------------


@pytest.mark.parametrize("environ, expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, ("3", "8", "1", "2")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "MASTER_ADDR": "h",  # DeepSpeed
      "MASTER_PORT": "1"}, ("3", "8", "1", "4")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, ("5", "6", "2", "3")),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0",
      "MV2_COMM_WORLD_LOCAL_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, ("1", "2", "0", "1")),
    ({"PMI_RANK": "7", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, ("7", "8", "3", "4")),
    ({"PMIX_RANK": "2", "WORLD_SIZE": "4", "PALS_LOCAL_RANKID": "0", "LOCAL_SIZE": "1", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, ("2", "4", "0", "1")),
])
def test_ranks_come_from_whichever_launcher_started_the_process(environ, expected):
    found = rank_environment(environ)
    assert (found["RANK"], found["WORLD_SIZE"], found["LOCAL_RANK"], found["LOCAL_WORLD_SIZE"]) == expected
    assert (found["MASTER_ADDR"], found["MASTER_PORT"]) == ("h", "1")


def test_a_process_started_directly_is_a_group_of_one():
    found = rank_environment({})
    assert (found["RANK"], found["WORLD_SIZE"], found["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert rank_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})["WORLD_SIZE"] == "1"
    alone = rank_environment({"RANK": "0", "WORLD_SIZE": "1"})  # a job of one needs no local rank or address
    assert (alone["LOCAL_RANK"], alone["LOCAL_WORLD_SIZE"], alone["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")


def test_a_job_size_that_is_no_number_is_left_for_the_rank_to_report():
    """`--nproc` is weighed against the announced size before any rank starts; a broken size is the ranks' to name
    (`rank_environment`), not an error of that check."""
    assert rank_env.announced_world_size({"RANK": "0", "WORLD_SIZE": "two"}) == 1
    assert rank_env.announced_world_size({"WORLD_SIZE": "4"}) == 1  # a size without a rank
    assert rank_env.announced_world_size({"PMI_RANK": "1", "PMI_SIZE": "4"}) == 4
    with pytest.raises(UserError, match=r"^WORLD_SIZE='two' is not a number; the launcher's environment is broken$"):
        rank_environment({"RANK": "0", "WORLD_SIZE": "two"})


def test_a_chosen_port_is_free_and_below_the_ports_the_kernel_hands_out_itself():
    """A port the kernel handed out (a bind to port 0) and released was soon handed out again, to another process's
    connection or listener, before the rendezvous took it: a launch then failed as "already in use"."""
    low, high = rank_env.port_range({})
    assert (low, high) == (20000, rank_env.ephemeral_low() - 1)  # this machine's kernel range starts above 21000
    for _ in range(20):
        port = free_port({})
        assert low <= port <= high and not rank_env.port_in_use(port)


def test_the_ports_to_choose_from_may_be_given():
    port = free_port()
    assert free_port({"ZEROLLM_PORTS": f" {port} - {port} "}) == port
    assert rank_env.port_range({"ZEROLLM_PORTS": "23000-23003"}) == (23000, 23003)


@pytest.mark.parametrize("kernel_low, chosen", [(32768, (20000, 32767)), (15000, (1024, 14999)),
                                                (1500, (1024, 2024)), (20500, (1024, 20499)), (21001, (20000, 21000))])
def test_below_a_kernel_range_that_starts_low_the_ports_start_at_the_first_unprivileged_one(monkeypatch, kernel_low,
                                                                                            chosen):
    monkeypatch.setattr(rank_env, "ephemeral_low", lambda: kernel_low)
    assert rank_env.port_range({}) == chosen


@pytest.mark.parametrize("given", ["23000", "23000-22000", "80-90", "23000-70000", "a-b", ""])
def test_a_port_range_that_is_not_one_is_refused_naming_it(given):
    with pytest.raises(UserError, match=f"^ZEROLLM_PORTS={given!r}: expected LOW-HIGH, the ports zerollm may choose"):
        free_port({"ZEROLLM_PORTS": given})


@pytest.mark.parametrize("family, address", [(socket.AF_INET, ""), (socket.AF_INET, "127.0.0.1"),
                                             (socket.AF_INET6, "::1")])  # ::1's listener was not seen: a job hung
def test_a_port_in_use_is_passed_over_and_a_range_without_a_free_one_is_one_line(monkeypatch, family, address):
    free = free_port()
    with socket.socket(family) as busy:
        busy.bind((address, free_port()))
        busy.listen()
        port = busy.getsockname()[1]
        assert rank_env.port_in_use(port)
        drawn = iter([port, free])
        with monkeypatch.context() as patched:
            patched.setattr(rank_env.random.SystemRandom, "randint", lambda self, low, high: next(drawn))
            assert free_port() == free
        with pytest.raises(UserError, match=f"^no free port found in {port}-{port} after 64 tries \\(ZEROLLM_PORTS\\); "
                                            "free some, or set ZEROLLM_PORTS=LOW-HIGH to a range with free ports$"):
            free_port({"ZEROLLM_PORTS": f"{port}-{port}"})


def test_without_the_kernel_s_port_range_the_iana_range_is_kept_clear_of(monkeypatch, tmp_path):
    monkeypatch.setattr(rank_env, "EPHEMERAL_RANGE_FILE", str(tmp_path / "absent"))
    assert rank_env.ephemeral_low() == 49152
    assert rank_env.port_range({}) == (20000, 49151)


@pytest.mark.parametrize("environ, message", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     "rank 1 of 2 was started by a launcher that sets OMPI_COMM_WORLD_RANK but not MASTER_ADDR and MASTER_PORT"),
    ({"PMIX_RANK": "1"}, "this process has rank 1 \\(PMIX_RANK\\) but no world size"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "rank 1 \\(PMI_RANK\\) of 2 has no "
                                                                                 "local rank"),
    ({"PMI_RANK": "one", "PMI_SIZE": "2"}, "PMI_RANK='one' is not a number"),
])
def test_an_incomplete_launcher_environment_is_one_clear_error(environ, message):
    with pytest.raises(UserError, match=message):
        rank_environment(environ)


THREADS_OF_A_RANK = ("from llm.runtime.distributed import setup_distributed; import torch; setup_distributed(); "
                     "print(torch.get_num_threads())")


@pytest.mark.parametrize("omp, cpus, expected", [
    ("3", None, 3),  # torchrun, DeepSpeed's --bind_cores_to_rank or the user chose
    (None, 1, 1),  # taskset, numactl or a container's cpuset leaves one CPU
])
def test_a_cpu_rank_runs_the_threads_its_launcher_or_cpu_mask_gives(omp, cpus, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", *RANK_VARIABLES)}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    allowed = sorted(os.sched_getaffinity(0))[:cpus]
    result = subprocess.run([sys.executable, "-c", THREADS_OF_A_RANK], capture_output=True, text=True, timeout=300,
                            cwd=REPO, env=env, preexec_fn=lambda: os.sched_setaffinity(0, allowed))
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) == expected


def test_ranks_share_the_cpus_they_may_use_when_no_thread_count_is_given(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    assert cpu_threads_per_rank(2, {}) == 3
    assert cpu_threads_per_rank(4, {}) == 1  # 6 CPUs over 4 ranks: rounded down, never oversubscribed
    assert cpu_threads_per_rank(8, {}) == 1
    assert cpu_threads_per_rank(2, {"OMP_NUM_THREADS": "4"}) == 4
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS keeps no affinity mask
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads_per_rank(2, {}) == 4


@pytest.mark.parametrize("value, expected", [("4", 4), (" 4 ", 4), ("4,2", 4), ("0", None), ("", None), ("two", None),
                                             ("²", None), ("\u0664", None), ("-1", None)])
def test_omp_num_threads_is_read_as_openmp_reads_its_outer_level(value, expected):
    assert threads_asked({"OMP_NUM_THREADS": value}) == expected


def test_ranks_bound_to_cpus_of_their_own_do_not_share_them():
    a, b = frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})
    shared = [("n0", a | b)] * 4 + [("n1", a | b)] * 4
    assert ranks_sharing_cpus(("n0", a | b), shared) == 4  # one mask for the node's 4 ranks; n1's are elsewhere
    bound = [("n0", a), ("n0", a), ("n0", b), ("n0", b)]  # mpirun --bind-to socket, 2 sockets
    assert ranks_sharing_cpus(("n0", a), bound) == 2 and ranks_sharing_cpus(("n0", b), bound) == 2
    overlapping = [("n0", a | b), ("n0", a)]  # a rank on all 8 CPUs, another on the first 4 of them
    assert ranks_sharing_cpus(("n0", a | b), overlapping) == 2 and ranks_sharing_cpus(("n0", a), overlapping) == 2


@pytest.mark.parametrize("environ, names", [({"PMI_RANK": "0", "PMI_SIZE": "1"}, "PMI_RANK"),
                                            ({"LOCAL_RANK": "0"}, "LOCAL_RANK")])
@pytest.mark.parametrize("command", [["train", "pretrain", "--recipe", "demo", "--data", "d", "--out", "o"],
                                     ["eval", "--model", "m", "--input", "i.txt"]])
def test_nproc_in_a_shell_a_launcher_left_variables_in_is_refused(monkeypatch, capsys, environ, names, command):
    """An interactive `srun` shell (PMI_RANK, PMI_SIZE) or an exported LOCAL_RANK made `--nproc 2` train on one rank
    without a word."""
    from llm.cli import main

    for name in ("LOCAL_RANK", *RANK_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as ended:
        main([*command, "--nproc", "2"])
    assert ended.value.code == 2 and capsys.readouterr().err == (
        f"zerollm: error: --nproc 2, but this process is a rank of a job of 1 (its environment holds a launcher's "
        f"{names}); leave --nproc out under a launcher, or unset those variables to start 2 ranks from here\n")



def test_nproc_under_a_launcher_may_be_the_job_s_size_or_its_ranks_on_this_node():
    """`torchrun --nnodes 2 --nproc-per-node 2 -m llm train ... --nproc 2` gives --nproc as ranks per node."""
    from launch.local import starts_ranks

    environ = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    with pytest.MonkeyPatch.context() as patch:
        for name in ("LOCAL_RANK", *RANK_VARIABLES):
            patch.delenv(name, raising=False)
        for name, value in environ.items():
            patch.setenv(name, value)
        assert [starts_ranks(nproc) for nproc in (1, 2, 4)] == [False] * 3
        with pytest.raises(UserError, match=r"^--nproc 3, but this process is a rank of a job of 4 "):
            starts_ranks(3)


def test_a_rank_waiting_for_rank_0s_store_hands_the_rendezvous_what_is_left_of_its_timeout():
    """The store client retried with the whole timeout at each try; a rank that waited for a late rank 0 then gave
    the rendezvous the whole timeout again (2 to 3 times train.collective_timeout_s in all)."""
    port = free_port()
    listener = socket.socket()
    timer = threading.Timer(1.5, lambda: (listener.bind(("127.0.0.1", port)), listener.listen()))
    timer.start()  # rank 0's store comes 1.5 s late
    try:
        left = _wait_for_rendezvous("127.0.0.1", port, timeout_s=30.0)
    finally:
        timer.join()
        listener.close()
    assert 0 < left <= 30.0 - 1.5
    with pytest.raises(TimeoutError, match=rf"^nothing answered at 127\.0\.0\.1:{port} \(Connection refused\)$"):
        _wait_for_rendezvous("127.0.0.1", port, timeout_s=1.0)


def test_a_launcher_that_names_no_local_size_gives_a_one_node_job():
    found = rank_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                              "MASTER_PORT": "1"})
    assert found["LOCAL_WORLD_SIZE"] == "2"
