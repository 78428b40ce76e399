"""`zerollm launch`: preflight checks, and real multi-"node" jobs on one machine (two launcher processes meeting
on 127.0.0.1) through DeepSpeed's launcher in per-node and hostfile mode, torchrun c10d and the SLURM template."""

import collections.abc
import contextlib
import json
import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from forked_ranks import run_job
from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from conftest import REPO, SHADOWING, TINY, folder_shadowing_zerollm, run_cli
from launch.deepspeed_launcher import through_here
from launch.hostfile import check_filter, read_hostfile
from launch.launcher import (
    Plan,
    deepspeed_runner,
    deepspeed_signal,
    is_local_address,
    plan_launch,
    run_plan,
    slurm_rendezvous,
)
from launch.local import wait_for_ranks
from launch.nodelist import expand_nodelist, nodelist_size, slurm_hosts
from launch.own_module import ROOT
from launch.torchrun import lost_rank, passed_on_code, quiet_code
from llm.cli import build_parser, launch_options
from llm.command_line import is_zerollm_command
from llm.errors import EXIT_PIPE_CLOSED, EXIT_PREEMPTED, EXIT_RANK_LOST, UserError
from llm.jsonl import jsonl_lines
from llm.runtime import shared_run_dir, supervisor, watchdog
from llm.runtime.cpu_threads import usable_cpus
from llm.runtime.fingerprint import mismatch_message
from llm.runtime.rank_env import free_port

ZEROLLM = str(Path(sys.executable).with_name("zerollm"))
"""The console script every launcher starts the ranks as."""
ZEROLLM_FIRST = ":".join(dict.fromkeys([str(ROOT), str(Path.cwd())]))
"""The PYTHONPATH the hosts of a multi-host job get: zerollm's folder, then the working directory (one where the
tests run from the checkout)."""

def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _job(data, out, *overrides):
    sets = [a for o in [*TINY, "train.precision=fp32", *overrides] for a in ("--set", o)]
    return ["train", "pretrain", "--recipe", "demo", "--data", str(data), "--out", str(out), *sets]


# ---- preflight, no processes -------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("node1 slots=2\nnode1 slots=4\n", "bad:2: host 'node1' is listed twice (first at line 1)"),
    ("node1 slots=2\nnode2 slots=0\n", "bad:2: host 'node2' has slots=0; it needs at least 1"),
    ("# cluster\nnode1 slots=2\nnode2 gpus=4\n", "bad:3: expected 'HOST slots=N', got 'node2 gpus=4'"),
    ("# only a comment\n\n", "bad: no hosts listed"),
    # DeepSpeed's runner reads the first host alone: node2 was left out without a word (max_slots=4 stays fine)
    ("node1 slots=2 max_slots=4\nnode2 slots=2 node3 slots=2\n",
     "bad:2: one host per line; 'node3 slots=2' after host 'node2' would be ignored"),
])
def test_bad_hostfiles_name_file_and_line(tmp_path, text, message):
    (tmp_path / "bad").write_text(text)
    with pytest.raises(UserError) as err:
        read_hostfile(tmp_path / "bad")
    assert str(err.value) == f"{tmp_path}/{message}"


def test_a_hostfile_from_a_pipe_is_read(tmp_path):
    """`--hostfile <(...)` (a pipe, as process substitution gives) was said not to be found."""
    pipe = tmp_path / "hosts"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_text, args=("worker-1 slots=2\n",), daemon=True)  # blocked until
    writer.start()  # the pipe is read, which the refusal never did
    assert read_hostfile(pipe) == {"worker-1": 2}
    writer.join(timeout=10)
    with pytest.raises(UserError, match=rf"^{tmp_path}/nowhere: hostfile not found$"):
        read_hostfile(tmp_path / "nowhere")


def test_hostfile_with_comments_and_filters(tmp_path):
    (tmp_path / "hosts").write_text("# two nodes\nworker-1 slots=8  # first\n\nworker-2 slots=4\n")
    hosts = read_hostfile(tmp_path / "hosts")
    assert hosts == {"worker-1": 8, "worker-2": 4}
    (tmp_path / "saved-on-windows").write_text("\ufeffworker-1 slots=8\r\nworker-2 slots=4\r\n")
    assert read_hostfile(tmp_path / "saved-on-windows") == hosts  # '\ufeffworker-1' was not a usable host name
    check_filter(hosts, "worker-1@worker-2:0,3", "--include", "hosts")
    with pytest.raises(UserError, match="host 'worker-3' is not in hosts"):
        check_filter(hosts, "worker-3", "--include", "hosts")
    with pytest.raises(UserError, match="host 'worker-2' has slots 0-3, not '4'"):
        check_filter(hosts, "worker-2:4", "--exclude", "hosts")
    with pytest.raises(UserError, match="host 'worker-2' has slots 0-3, not ''"):  # DeepSpeed: int('') traceback
        check_filter(hosts, "worker-2:", "--include", "hosts")


def test_bad_hostfile_through_the_cli_is_one_line_exit_2(tmp_path):
    (tmp_path / "hosts").write_text("node1 slots=2\nnode1 slots=2\n")
    result = run_cli("launch", "--hostfile", tmp_path / "hosts", "--", *_job(tmp_path, tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip() == \
        f"zerollm: error: {tmp_path / 'hosts'}:2: host 'node1' is listed twice (first at line 1)"


def test_busy_master_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("launch", "--nnodes", 2, "--node-rank", 0, "--master-addr", "127.0.0.1", "--master-port", port,
                         "--", *_job(tmp_path, tmp_path / "run"))
    assert result.returncode == 2
    assert f"master port {port} is already in use on this node" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_training_command_is_checked_before_launching(tmp_path):
    result = run_cli("launch", "--", "train", "pretrain", "--recipe", "demo", "--data", tmp_path, "--out", tmp_path,
                     "--set", "train.no_such_key=1")
    assert result.returncode == 2 and "train.no_such_key" in result.stderr
    result = run_cli("launch", "--", "generate", "--model", tmp_path)
    assert (result.returncode, result.stderr) == (2, "zerollm: error: `generate` is not a training command: give "
                                                     "the training command after '--', e.g. zerollm launch ... -- "
                                                     "train pretrain --recipe demo --data DATA --out RUN\n")
    result = run_cli("launch", "--", *_job(tmp_path, tmp_path), "--nproc", 2)
    assert result.returncode == 2 and "--nproc-per-node" in result.stderr


@pytest.mark.parametrize("mode", [["--hostfile", "{hosts}"], ["--nnodes", "1", "--node-rank", "0", "--master-addr",
                                                                 "127.0.0.1"]])
def test_data_the_ranks_of_this_node_would_read_is_checked_before_the_launcher_starts(tmp_path, mode):
    """A wrong --data was found by each rank once DeepSpeed's launchers had started (16 s, and their kill lines
    around the message)."""
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    result = run_cli("launch", *[a.format(hosts=tmp_path / "hosts") for a in mode], "--master-port", free_port(),
                     "--", *_job(tmp_path / "nowhere", tmp_path / "run"))
    assert (result.returncode, result.stderr) == (2, f"zerollm: error: {tmp_path / 'nowhere'}: no such directory; "
                                                     "pass the folder `zerollm data prepare --out` wrote\n")
    assert result.stdout == "" and not (tmp_path / "run").exists()  # no launcher was started


def test_a_hostfile_of_other_hosts_only_runs_no_rank_here_and_its_inputs_are_left_to_them(tmp_path, monkeypatch):
    """Its data is read there (a login node need not hold it), so it is not checked here."""
    import launch.launcher as launcher

    def ranks_here(hosts: str) -> bool:
        (tmp_path / "hosts").write_text(hosts)
        args = ["--hostfile", str(tmp_path / "hosts"), "--master-addr", "10.0.0.1", "--master-port", str(free_port())]
        return plan_launch(launch_options(build_parser().parse_args(["launch", *args, "--", "train"])), ["train"],
                           {"HOME": str(tmp_path)}).ranks_here

    assert ranks_here("node-a.invalid slots=1\nlocalhost slots=1\n")
    assert not ranks_here("node-a.invalid slots=1\nnode-b.invalid slots=2\n")
    checked, started = [], []
    for name in ("check_programs", "check_reachable"):
        monkeypatch.setattr(launcher, name, lambda *args: None)
    monkeypatch.setattr(launcher, "run_plan", lambda plan, run_dir: started.append(plan) or 0)
    options = launch_options(build_parser().parse_args(["launch", "--hostfile", str(tmp_path / "hosts"),
                                                        "--master-addr", "10.0.0.1", "--", "train"]))
    assert launcher.launch(options, ["train"], tmp_path / "run", lambda: checked.append(1)) == 0
    assert checked == [] and len(started) == 1
    (tmp_path / "hosts").write_text("node-a.invalid slots=1\nlocalhost slots=1\n")
    assert launcher.launch(options, ["train"], tmp_path / "run", lambda: checked.append(1)) == 0
    assert checked == [1] and len(started) == 2


def test_a_refused_launch_answers_without_loading_torch(tmp_path):
    """torch (about 2 s to import) is loaded only to count GPUs or start the launcher, not to refuse bad options."""
    script = "import sys\nfrom llm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n" \
             "    print(e.code, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script, "launch", "--nnodes", "2", "--", *_job(tmp_path, tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "per-node mode needs --nnodes, --node-rank and --master-addr" in result.stderr
    assert result.stdout.split() == ["2", "False"]


STARTED_WITH = """
import sys
import launch.launcher
from llm.cli import main

def started(command, **options):  # the launcher, not started: what this process had loaded by then
    if "deepspeed.launcher.runner" not in command:  # another program (h5py asks the platform, reading the data)
        return popen(command, **options)
    print(command[3], 'torch' in sys.modules)
    sys.exit(0)

popen, launch.launcher.subprocess.Popen = launch.launcher.subprocess.Popen, started
main(sys.argv[1:])
"""


@pytest.mark.parametrize("chosen, loaded", [("cpu", False), (None, True)])
def test_a_launch_loads_torch_only_to_look_for_a_gpu_where_the_user_chose_no_accelerator(pretrain_data, tmp_path,
                                                                                         chosen, loaded):
    """`zerollm launch` imported torch (3 CPU-s, before DeepSpeed's runner imports it again) to choose DeepSpeed's
    accelerator even where DS_ACCELERATOR gave it."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update({"DS_ACCELERATOR": chosen} if chosen else {})
    result = subprocess.run([sys.executable, "-c", STARTED_WITH, "launch", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "--", *_job(pretrain_data, tmp_path)], capture_output=True,
                            text=True, timeout=120, cwd=REPO, env=env)
    assert result.stdout.splitlines()[-1].split() == ["deepspeed.launcher.runner", str(loaded)], result.stderr[-3000:]


def _launch_args(*argv):
    return launch_options(build_parser().parse_args(["launch", *argv, "--", "train"]))


def test_plans_for_each_mode(tmp_path):
    job = ["train", "pretrain"]
    per_node = plan_launch(_launch_args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                        "--master-port", "29555", "--nproc-per-node", "4"), job, {})
    cmd = " ".join(per_node.argv("{dir}"))
    assert "deepspeed.launcher.runner --hostfile {dir}/hostfile --no_ssh --node_rank 1" in cmd
    assert f"--master_addr 10.0.0.1 --master_port 29555 --no_local_rank {ZEROLLM} train pretrain" in cmd
    assert per_node.files == {"hostfile": "node0 slots=4\nnode1 slots=4\n"}

    torchrun = plan_launch(_launch_args("--backend", "torchrun", "--nnodes", "3", "--node-rank", "2",
                                        "--master-addr", "10.0.0.1", "--nproc-per-node", "8"), job, {})
    assert " ".join(torchrun.argv("{dir}")).endswith(
        "run_module('launch.torchrun', run_name='__main__', alter_sys=True) --nnodes 3 --nproc-per-node 8 "
        "--rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 "
        f"--rdzv-id zerollm --rdzv-conf is_host=0,join_timeout=600 --max-restarts 0 {ZEROLLM} train pretrain")
    # torchrun would run each rank on one thread; the ranks share the CPUs instead, unless OMP_NUM_THREADS is given
    assert torchrun.env == {"OMP_NUM_THREADS": str(max(1, len(usable_cpus()) // 8))}
    given = ["--backend", "torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]
    assert plan_launch(_launch_args(*given, "--env", "OMP_NUM_THREADS=5"), job, {}).env == {"OMP_NUM_THREADS": "5"}
    assert plan_launch(_launch_args(*given), job, {"OMP_NUM_THREADS": "3"}).env == {}

    (tmp_path / "hosts").write_text("a slots=8  # comment\nb   slots = 8\n")
    hostfile = plan_launch(_launch_args("--hostfile", str(tmp_path / "hosts"), "--master-addr", "10.0.0.1",
                                        "--include", "a@b:0,1", "--env", "NCCL_DEBUG=INFO",
                                        "--env", "HF_HOME=/data/hf"), job, {"HOME": str(tmp_path)})
    cmd = " ".join(hostfile.argv("/tmp/x"))
    assert "--hostfile /tmp/x/hostfile --launcher pdsh --master_port 29500 --include a@b:0,1" in cmd
    assert f"--master_addr 10.0.0.1 --no_local_rank {ZEROLLM} train pretrain" in cmd
    assert hostfile.env == {} and hostfile.environment("/tmp/x") == {"DS_ENV_FILE": "/tmp/x/deepspeed_env"}
    assert hostfile.files == {"hostfile": "a slots=8\nb slots=8\n",  # the form DeepSpeed and mpirun both parse
                              "deepspeed_env": f"PYTHONPATH={ZEROLLM_FIRST}\nNCCL_DEBUG=INFO\nHF_HOME=/data/hf\n"}

    mpi = plan_launch(_launch_args("--hostfile", str(tmp_path / "hosts"), "--launcher", "openmpi", "--master-port",
                                   "29555", "--env", "NCCL_DEBUG=INFO"), job,
                      {"NCCL_SOCKET_IFNAME": "eth0", "HOME": str(tmp_path)})
    assert " --launcher openmpi " in " ".join(mpi.command) and "--no_ssh_check" in mpi.command
    assert mpi.files["deepspeed_env"] == (f"NCCL_SOCKET_IFNAME=eth0\nPYTHONPATH={ZEROLLM_FIRST}\nNCCL_DEBUG=INFO\n"
                                          "MASTER_ADDR=a\nMASTER_PORT=29555\n")
    # a stop before the ranks start goes to the launcher's whole process group, but for pdsh and mpirun, which stop
    # their hosts' processes themselves (their ssh helpers are not sent it)
    (tmp_path / "here").write_text("localhost slots=2\n")
    local = plan_launch(_launch_args("--hostfile", str(tmp_path / "here")), job, {"HOME": str(tmp_path)})
    assert [plan.reaches_hosts for plan in (per_node, torchrun, local, hostfile, mpi)] == [False] * 3 + [True] * 2


@pytest.mark.parametrize("argv, environ", [
    ([], {"CUDA_VISIBLE_DEVICES": "2,3"}),
    (["--env", "CUDA_VISIBLE_DEVICES=2,3"], {}),
    (["--env", "CUDA_VISIBLE_DEVICES=2,3"], {"CUDA_VISIBLE_DEVICES": "0,1"}),  # --env's wins, as for the ranks
])
def test_per_node_ranks_keep_the_gpus_cuda_visible_devices_chose(argv, environ):
    """DeepSpeed's launcher gave the ranks GPUs 0 and 1 of our hostfile's slots (`Setting CUDA_VISIBLE_DEVICES=0,1`),
    perhaps another job's: the chosen ones become the slots selected."""
    plan = plan_launch(_launch_args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", *argv),
                       ["train", "pretrain"], environ)
    assert plan.command[plan.command.index("--include") + 1] == "node0:2,3@node1:2,3"
    # an option of DeepSpeed's launcher, not of the training command after zerollm's script: each rank failed on it
    assert plan.command.index("--include") < plan.command.index(str(Path(sys.executable).with_name("zerollm")))
    assert plan.files == {"hostfile": "node0 slots=4\nnode1 slots=4\n"}
    one = plan_launch(_launch_args("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                   "--nproc-per-node", "1", "--master-port", str(free_port())),
                      ["train", "pretrain"], {"CUDA_VISIBLE_DEVICES": "5,1"})
    assert one.command[one.command.index("--include") + 1] == "node0:5" and one.files == {"hostfile": "node0 slots=6\n"}
    for visible, chosen in (("2,3,", "node0:2"), (" 7 , 2,,3", "node0:7"), ("4,x", "node0:4")):  # as CUDA reads it
        plan = plan_launch(_launch_args("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                        "--nproc-per-node", "1", "--master-port", str(free_port())),
                           ["train", "pretrain"], {"CUDA_VISIBLE_DEVICES": visible})
        assert plan.command[plan.command.index("--include") + 1] == chosen, visible  # "2,3," was taken for no GPU


@pytest.mark.parametrize("given, ranks", [("2,3", 2), ("GPU-5d3f,GPU-77a1,MIG-0c1d", 3), ("1,x,2", 1), ("-1", 1)])
def test_torchrun_runs_a_rank_per_gpu_that_env_leaves_visible(monkeypatch, given, ranks):
    """On a node of 8 GPUs, `--env CUDA_VISIBLE_DEVICES=2,3` started 8 ranks, six of them without a GPU (torch
    counted this process's GPUs); one rank where it names none (a CPU job)."""
    import launch.launcher as launcher

    monkeypatch.setattr(launcher, "_local_devices", lambda: 8)
    plan = plan_launch(_launch_args("--backend", "torchrun", "--env", f"CUDA_VISIBLE_DEVICES={given}"),
                       ["train", "pretrain"], {})
    assert plan.command[plan.command.index("--nproc-per-node") + 1] == str(ranks)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == given
    plan = plan_launch(_launch_args("--backend", "torchrun"), ["train", "pretrain"], {})
    assert plan.command[plan.command.index("--nproc-per-node") + 1] == "8"


@pytest.mark.parametrize("argv, environ", [
    (["--backend", "torchrun"], {"CUDA_VISIBLE_DEVICES": "GPU-5d3f,GPU-77a1"}),  # torchrun leaves it alone
    ([], {"CUDA_VISIBLE_DEVICES": "-1"}),  # no GPU (a CPU node): as before
    ([], {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}),  # SLURM's, for a step without GPUs
])
def test_a_cuda_visible_devices_of_no_gpu_indices_is_left_as_it_was(argv, environ):
    plan = plan_launch(_launch_args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                    "--nproc-per-node", "2", *argv), ["train", "pretrain"], environ)
    assert "--include" not in plan.command


def test_gpus_chosen_in_hostfile_mode_are_selected_with_include(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=4\n")
    plan = plan_launch(_launch_args("--hostfile", str(tmp_path / "hosts"), "--include", "localhost:2,3",
                                    "--master-port", str(free_port())), ["train", "pretrain"],
                       {"CUDA_VISIBLE_DEVICES": "2,3"})  # exported by SLURM, say: the --include chooses
    assert plan.command[plan.command.index("--include") + 1] == "localhost:2,3"


@pytest.mark.parametrize("argv, environ, message", [
    (["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1"], {"CUDA_VISIBLE_DEVICES": "GPU-5d3f,GPU-77a1"},
     "CUDA_VISIBLE_DEVICES=GPU-5d3f,GPU-77a1: DeepSpeed's launcher gives the ranks GPUs by index and would replace it; "
     "give each GPU's index once (as nvidia-smi numbers them), or use --backend torchrun"),
    (["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1"], {"CUDA_VISIBLE_DEVICES": "2,2"},
     "CUDA_VISIBLE_DEVICES=2,2: DeepSpeed's launcher gives the ranks GPUs by index"),
    (["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--nproc-per-node", "3"],
     {"CUDA_VISIBLE_DEVICES": "2,3"}, "3 ranks per node, but CUDA_VISIBLE_DEVICES=2,3 names 2 GPUs"),
    (["--hostfile", "{hosts}", "--exclude", "localhost:1"], {"CUDA_VISIBLE_DEVICES": "2,3"},
     "CUDA_VISIBLE_DEVICES=2,3, but DeepSpeed's launcher gives each host's ranks the GPUs of its slots in {hosts}, "
     "from 0 (it replaces the variable): select them with --include instead, e.g. --include localhost:2,3 (the "
     "hostfile giving localhost at least 4 slots)"),
])
def test_gpus_chosen_in_a_way_the_launch_cannot_keep_are_refused(tmp_path, argv, environ, message):
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    argv = [arg.format(hosts=tmp_path / "hosts") for arg in argv]
    with pytest.raises(UserError, match=f"^{re.escape(message.format(hosts=tmp_path / 'hosts'))}"):
        plan_launch(_launch_args(*argv, "--master-port", str(free_port())), ["train", "pretrain"], environ)


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"], "--node-rank 2 is outside 0..1"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1"], "needs --nnodes, --node-rank and --master-addr"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.1"], "is not an address of this node"),
    (["--include", "a"], "select hosts of a --hostfile"),
    (["--env", "1BAD=x"], "expected NAME=VALUE"),
    (["--env", "A=1\nB=2"], "--env A contains the control character"),  # would add B in DeepSpeed's env file
    (["--backend", "slurm"], "SLURM_JOB_NUM_NODES, SLURM_NODEID, SLURM_JOB_NODELIST not set"),
])
def test_bad_launch_options(argv, message):
    with pytest.raises(UserError, match=message):
        plan_launch(_launch_args(*argv), ["train"], {})


@pytest.mark.parametrize("option, value", [("--master-port", "1_0000"), ("--nnodes", "²"), ("--node-rank", "٠"),
                                           ("--nproc-per-node", " 2")])
def test_launch_numbers_are_ascii_digits_as_a_hostfiles_slots_are(option, value, capsys):
    """int() read '1_0000' as 10000 and '²' as 2: `--master-port 1_0000` ran the job on port 10000."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["launch", option, value, "--", "train"])
    assert exited.value.code == 2
    assert f"argument {option}: expects a whole number in decimal digits, got {value!r}" in capsys.readouterr().err


def test_slurm_environment(tmp_path):
    env = {"SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "gpu[07-09,12]",
           "PATH": str(tmp_path)}
    assert slurm_rendezvous(env) == (4, 3, "gpu07")
    assert slurm_rendezvous({**env, "SLURM_JOB_NODELIST": "node-[1-4]-ib"})[2] == "node-1-ib"
    plan = plan_launch(_launch_args("--backend", "slurm"), ["train"], {**env, "SLURM_JOB_ID": "777",
                                                                       "SLURM_GPUS_ON_NODE": "8"})
    assert "--nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu07:29500 --rdzv-id 777" in \
        " ".join(plan.command)


def test_a_slurm_rendezvous_host_that_is_not_this_node_is_named_as_slurm_s(tmp_path):
    """It was called '--master-addr node01', an option the user never gave."""
    env = {"SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[01-02]",
           "PATH": str(tmp_path)}
    with pytest.raises(UserError, match=r"^node01 \(the first host of SLURM's node list\) is not an address of this "
                                        r"node, but node rank 0 hosts the rendezvous; give node 0's own address with "
                                        r"--master-addr$"):
        plan_launch(_launch_args("--backend", "slurm"), ["train"], env)


def test_an_ipv6_address_of_this_node_hosts_the_rendezvous():
    """An IPv4 socket was bound to '::1', so node rank 0 refused every IPv6 --master-addr as not its own."""
    def binds(family, address):
        try:
            with socket.socket(family) as s:
                s.bind((address, 0))
            return True
        except OSError:
            return False

    assert is_local_address("127.0.0.1") and is_local_address("localhost") and not is_local_address("192.0.2.1")
    assert is_local_address("::1") == binds(socket.AF_INET6, "::1")  # False only where the node has no IPv6
    assert not is_local_address("2001:db8::1") and not is_local_address("no host.invalid")


def test_a_slurm_step_on_part_of_the_allocation_rendezvous_on_its_own_nodes(tmp_path):
    """`salloc -N4`, then `srun -N2` on gpu09 and gpu12: the job's variables describe all four nodes, SLURM_NODEID
    the step's. Before, the step's first node refused itself ('--master-addr gpu07 is not an address of this node')
    and the second waited for four nodes until the rendezvous timed out."""
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-09,12]", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "gpu[09,12]", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0", "PATH": str(tmp_path)}
    assert slurm_rendezvous(env) == (2, 1, "gpu09")
    with pytest.raises(UserError, match=r"^SLURM_NODEID is '2'; expected this node's index among "
                                        r"SLURM_STEP_NUM_NODES=2, a whole number in 0..1$"):
        slurm_rendezvous({**env, "SLURM_NODEID": "2"})
    assert slurm_rendezvous({**env, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"}) == (2, 1, "gpu09")


def test_a_multi_node_slurm_launch_outside_a_job_step_is_refused(tmp_path):
    """Run from the batch script itself (no srun), one launch ran, on the first node, and waited for the others until
    train.collective_timeout_s (600 s by default), then advised checking that node 0 is reachable."""
    batch_script = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "16",
                    "SLURM_JOB_NODELIST": "node[1-2]", "PATH": str(tmp_path)}  # sbatch sets no SLURM_STEP_* variable
    with pytest.raises(UserError, match=r"^--backend slurm on the 2 nodes of SLURM_JOB_NUM_NODES runs once on each "
                                        r"node: start it with srun --ntasks-per-node=1 \(as launch/slurm/zerollm"):
        slurm_rendezvous(batch_script)
    assert slurm_rendezvous({**batch_script, "SLURM_STEP_ID": "0"}) == (2, 0, "node1")


def test_two_slurm_tasks_on_a_node_are_refused_naming_the_task_count(tmp_path):
    """The second task on a node was told its --master-port was taken ('choose a free --master-port'). A batch
    script's own SLURM_NTASKS (GPUs of a one-node job, its launch run without srun) is not a step's."""
    env = {"SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": "2",
           "SLURM_STEP_NUM_TASKS": "2", "PATH": str(tmp_path)}
    with pytest.raises(UserError, match=r"^SLURM_STEP_NUM_TASKS is '2' but the step runs on 1 node\(s\): zerollm "
                                        r"launch is one task per node, which starts the node's ranks itself; run it "
                                        r"with srun --ntasks-per-node=1"):
        slurm_rendezvous(env)
    assert slurm_rendezvous({key: value for key, value in env.items() if key != "SLURM_STEP_NUM_TASKS"})[0] == 1


@pytest.mark.parametrize("nodelist, hosts", [
    ("node-[1-4]-ib", ["node-1-ib", "node-2-ib", "node-3-ib", "node-4-ib"]),  # a suffix after the brackets
    ("gpu[07-09,12]", ["gpu07", "gpu08", "gpu09", "gpu12"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # zero padding keeps the first number's width
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),  # several groups
    ("login1,gpu[1-2]-ib,n001", ["login1", "gpu1-ib", "gpu2-ib", "n001"]),  # a comma list
    ("a.example.org", ["a.example.org"]),
    ("node[3-3]", ["node3"]),  # a range of one
    ("gpu[07-07,09]", ["gpu07", "gpu09"]),
    (" node[1-2]\n", ["node1", "node2"]),  # blanks around it, as a variable read from a file keeps them
])
def test_slurm_node_lists_expand_fully(nodelist, hosts, tmp_path):
    assert expand_nodelist(nodelist) == hosts
    assert slurm_hosts(nodelist, path=str(tmp_path)) == hosts  # no scontrol on that PATH: expanded here


@pytest.mark.parametrize("nodelist", ["gpu[1-", "gpu[3-1]", "gpu[a-b]", "gpu1,", "gpu]1", "", "gpu[1-2\n]"])
def test_bad_slurm_node_lists_are_one_line_errors(nodelist):
    with pytest.raises(UserError, match="SLURM node list"):
        expand_nodelist(nodelist)


def test_a_node_list_of_more_hosts_than_the_job_step_has_is_refused_before_it_is_expanded(tmp_path):
    """`node[1-20000000]` was expanded in full (gigabytes, then a MemoryError traceback) before its length was
    compared with the node count."""
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[1-20000000],rack[1-2]-n[1-3]",
           "PATH": str(tmp_path)}
    said = (r"^SLURM_JOB_NODELIST 'node\[1-20000000\],rack\[1-2\]-n\[1-3\]' names 20,000,006 host\(s\) but "
            "SLURM_JOB_NUM_NODES is 2$")
    with pytest.raises(UserError, match=said):  # no scontrol on PATH: it was expanded here
        slurm_rendezvous(env)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\ntouch {tmp_path}/asked\n")
    scontrol.chmod(0o755)
    with pytest.raises(UserError, match=said):
        slurm_rendezvous(env)
    assert not (tmp_path / "asked").exists()  # scontrol would have listed 20,000,006 names
    assert nodelist_size("rack[1-2]-n[1-3],login") == len(expand_nodelist("rack[1-2]-n[1-3],login")) == 7


def test_scontrol_is_the_authority_on_node_lists(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && echo \"$3\" > \"$0.args\" && "
                        "printf 'nodeA-ib\\nnodeB-ib\\n'\n")
    scontrol.chmod(0o755)
    assert slurm_hosts("node[A-B]-ib", path=str(tmp_path)) == ["nodeA-ib", "nodeB-ib"]
    assert (tmp_path / "scontrol.args").read_text() == "node[A-B]-ib\n"
    env = {"SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[A-B]-ib",
           "PATH": str(tmp_path)}
    assert slurm_rendezvous(env) == (2, 0, "nodeA-ib")


@pytest.mark.parametrize("script, said", [
    ("exit 0", "exit code 0, no output"),  # no host named: not a list of none
    ("echo 'warning: config file old' >&2; echo 'error: Invalid hostlist: node[' >&2; exit 1",
     "error: Invalid hostlist: node["),  # the last line it wrote, not a warning before it
])
def test_a_node_list_scontrol_fails_on_is_one_line_naming_its_last_words(script, said, tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\n{script}\n")
    scontrol.chmod(0o755)
    with pytest.raises(UserError) as failed:
        slurm_hosts("node[1-2]", path=str(tmp_path))
    assert str(failed.value) == f"scontrol show hostnames 'node[1-2]' failed: {said}"


def test_fingerprint_mismatch_message_names_fields_and_ranks():
    same = {"code": "abc", "data": "d1", "config.train.lr": "0.001"}
    prints = [same, same, {**same, "config.train.lr": "0.002"}, {**same, "data": "d2"}]
    assert mismatch_message([same, same]) is None
    assert mismatch_message(prints) == (
        "ranks disagree, nothing was trained: config.train.lr: 0.001 on ranks 0,1,3; 0.002 on rank 2 | "
        "data: d1 on ranks 0,1,2; d2 on rank 3. Start every node with the same code, config, data and tokenizer")
    precision = [same, {**same, "config.train.precision": "'fp32'"}, {**same, "config.train.precision": "'bf16'"}]
    assert mismatch_message(precision).endswith(
        "config.train.precision: <missing> on rank 0; 'fp32' on rank 1; 'bf16' on rank 2. Start every node with the "
        "same code, config, data and tokenizer (train.precision=auto chooses by each node's hardware: set "
        "train.precision=bf16 or fp32 for the whole job)")
    assert mismatch_message([same, same, {**same, "data": "d2"}]) == (
        "ranks disagree, nothing was trained: data: d1 on ranks 0,1; d2 on rank 2. Start every node with the same "
        "code, config, data and tokenizer")
    long = ["x" * 50 + "AAAAAAAAAA", "x" * 50 + "BBBBBBBBBB"]  # digests, paths: told apart by their 60 characters
    assert mismatch_message([{**same, "data": value} for value in long]).startswith(
        f"ranks disagree, nothing was trained: data: {long[0]} on rank 0; {long[1]} on rank 1. ")


@pytest.mark.parametrize("node_0, node_1, said", [
    (({}, {"zero_optimization": {"stage": 2}}, "d", "t"), ({}, {"zero_optimization": {"stage": 3}}, "d", "t"),
     "ds_config.zero_optimization.stage: 2 on rank 0; 3 on rank 1"),
    (({}, {}, "d", "tokA"), ({}, {}, "d", "tokB"), "tokenizer: tokA on rank 0; tokB on rank 1"),
    (({"data": {"path": "/scratch/a", "seq_len": 128}}, {}, "d", "t"),
     ({"data": {"path": "/local/b", "seq_len": 256}}, {}, "d", "t"),
     "config.data.seq_len: 128 on rank 0; 256 on rank 1"),
    (({"data": {"path": "/scratch/a"}}, {}, "d", "t"), ({"data": {"path": "/local/b"}}, {}, "d", "t"), None),
])
def test_ranks_compare_their_deepspeed_config_tokenizer_and_config_but_not_where_their_data_lies(node_0, node_1, said):
    """Unpinned: ranks under ZeRO stages 2 and 3, or with other tokenizers, agreeing; nodes holding the same data at
    paths of their own (a node-local disk) refused as disagreeing."""
    from llm.runtime.fingerprint import fingerprint

    message = mismatch_message([fingerprint(*node_0), fingerprint(*node_1)])
    assert message == (said and f"ranks disagree, nothing was trained: {said}. Start every node with the same code, "
                                "config, data and tokenizer")


# ---- real jobs on one machine ------------------------------------------------------------------


def _start(argv, log: Path, env=None):
    return subprocess.Popen([sys.executable, "-m", "llm", *map(str, argv)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _two_nodes(tmp_path, job_for_node, name="node"):
    port = free_port()
    procs = []
    for rank in (0, 1):
        argv = ["launch", "--backend", "deepspeed", "--nnodes", 2, "--node-rank", rank, "--master-addr", "127.0.0.1",
                "--master-port", port, "--", *job_for_node(rank)]
        procs.append(_start(argv, tmp_path / f"{name}{rank}.log"))
    return procs


def _kill_tree(proc):
    """SIGKILL a node's `zerollm launch` and everything under it (the launcher runs in its own session)."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _wait_all(procs, timeout=240):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)


def _wait_for_steps(run, count, procs, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        metrics = run / "metrics.jsonl"  # rows written whole (one being written may be seen in part)
        if metrics.is_file() and sum(line.ended for line in jsonl_lines(metrics)) >= count:
            return
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)
    raise AssertionError("timed out waiting for training steps")


def _rank_process(node):
    """The one training process under a node's `zerollm launch` (not the launchers between them)."""
    ranks = [p for p in psutil.Process(node.pid).children(recursive=True) if is_zerollm_command(p.cmdline())]
    assert len(ranks) == 1, ranks
    return ranks[0]


SLOW = ["data.seq_len=128", "train.micro_batch_size=16", "train.eval_every=0", "train.max_steps=400"]


def test_two_nodes_per_node_mode_sigterm_saves_on_every_rank_and_resume_continues(pretrain_data, tmp_path):
    run = tmp_path / "run"
    procs = _two_nodes(tmp_path, lambda rank: _job(pretrain_data, run, *SLOW, "train.save_every=0"))
    _wait_for_steps(run, 2, procs)
    procs[0].send_signal(signal.SIGTERM)  # preemption reaches one node; the ranks agree to stop together
    assert _wait_all(procs) == [75, 75]
    tag = (run / "checkpoints" / "latest").read_text()
    step = int(tag.removeprefix("global_step"))
    saved = run / "checkpoints" / tag
    assert sorted(p.name for p in saved.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert len(list(saved.glob("zero_pp_rank_*_optim_states.pt"))) == 2
    assert json.loads((saved / "client_state.json").read_text())["stopped_by_signal"] is True
    assert "stopped by signal" in (tmp_path / "node0.log").read_text()

    procs = _two_nodes(tmp_path, lambda rank: [*_job(pretrain_data, run, *SLOW, f"train.max_steps={step + 2}"),
                                               "--resume", "auto"], name="again")
    assert _wait_all(procs) == [0, 0]
    assert f"resumed at step {step}" in (tmp_path / "again0.log").read_text()
    assert [r["step"] for r in _metrics(run)] == list(range(1, step + 3))


SAYING = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch.distributed as dist
    import llm.runtime.distributed as distributed
    from llm.errors import UserError
    rank, said = int(os.environ["RANK"]), Path(sys.argv[1])
    say = distributed.report

    def slow_say(message):  # rank 0 is descheduled just before it prints
        time.sleep(1)
        say(message)
        said.write_text("said")

    distributed.report = slow_say
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        distributed.refuse_together("bad input" if rank == 1 else None, announce=rank == 0)
    except UserError as error:
        print("refused", error.announce, "after rank 0 said it" if said.exists() else "before rank 0 said it")
    finally:  # a group left to the interpreter's exit may abort it ("terminate called without an active exception")
        dist.destroy_process_group()
""")


def test_a_refusal_every_rank_raises_is_said_before_any_rank_leaves(tmp_path):
    """Only rank 0 says it; a rank that left first could have its launcher kill rank 0 (as --nproc and DeepSpeed's
    launcher stop the others at the first failure) before it had, and the job ended with exit 2 and no message."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SAYING, str(tmp_path / "said")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank)}) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [out for out, _ in outputs] == ["refused False after rank 0 said it\n"] * 2, outputs
    assert [err for _, err in outputs] == ["zerollm: error: bad input\n", ""]


def test_nproc_ends_the_job_when_any_rank_fails_not_only_the_first():
    """`--nproc`'s wait polled the ranks only up to the first still running: a later rank's failure went unnoticed
    while rank 0 ran on (into a collective that only the watchdog's timeout ended)."""
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"]),
             subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])]
    assert wait_for_ranks(ranks) == 3
    assert ranks[0].returncode == -signal.SIGTERM  # the others are stopped at the first failure


def test_the_ranks_refusal_is_the_jobs_code_though_a_rank_aborted_as_the_job_came_down():
    """Both ranks refused the job together (exit 2); rank 1 aborted in its teardown once rank 0, which hosts the
    rendezvous store, had left ("terminate called without an active exception"), and the job, seeing both at once,
    named rank 1 as ended by SIGABRT and exited 76 (a CI run of `eval --nproc 2` with a bad --stride)."""
    ranks = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"]),
             subprocess.Popen([sys.executable, "-c", "import os, resource\n"
                               "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file\nos.abort()"])]
    for rank in ranks:
        rank.wait()  # both seen ending at once
    assert wait_for_ranks(ranks) == 2


def test_a_job_stopped_at_once_by_ctrl_c_exits_130_and_so_do_its_ranks(tmp_path):
    """Each rank gets a Ctrl-C twice (the terminal's SIGINT, and the copy this process forwards) and ends by the first
    it reads: the copy was a SIGTERM, so on a loaded machine a rank ended 143 for a Ctrl-C, as its wandb run recorded
    (a CI run of the GRPO test of a second Ctrl-C). Here the ranks read only the forwarded copy."""
    ready = [tmp_path / f"{i}.ready" for i in range(2)]
    rank = ("import os, pathlib, signal, sys, time\n"
            "for signum in (signal.SIGINT, signal.SIGTERM):\n"
            "    signal.signal(signum, lambda signum, frame: os._exit(128 + signum))\n"
            "pathlib.Path(sys.argv[1]).touch()\ntime.sleep(20)\n")
    ranks = [subprocess.Popen([sys.executable, "-c", rank, path]) for path in ready]
    for path in ready:
        _wait_for(path)
    _ctrl_c_once_handled()
    assert wait_for_ranks(ranks) == 128 + signal.SIGINT
    assert [r.returncode for r in ranks] == [128 + signal.SIGINT] * 2


STUCK = ("import pathlib, signal, sys, time\nfor signum in (signal.SIGINT, signal.SIGTERM):\n"
         "    signal.signal(signum, signal.SIG_IGN)\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(60)\n")
"""A rank stuck in a collective with a frozen one: it passes every stop over."""
EXITS_ON_STOP = ("import pathlib, signal, sys, time\n"
                 "signal.signal(signal.SIGINT, lambda *_: sys.exit(int(sys.argv[2])))\n"
                 "pathlib.Path(sys.argv[1]).touch()\ntime.sleep(60)\n")
"""A rank that ends on a stop with the exit code its second argument gives (75: saved and stopped as asked)."""


@pytest.mark.parametrize("first, stops, grace, since", [
    (STUCK, [signal.SIGINT], {"stop_grace_s": 1}, "1 s of the stop"),
    # a second stop allows grace_s, not the stop's 600 s (a SIGTERM: two SIGINTs at once may arrive as one)
    (STUCK, [signal.SIGINT, signal.SIGTERM], {"grace_s": 1}, "1 s of the last stop"),
    # its 75 started the failure clock, and the frozen rank was killed without a word
    (EXITS_ON_STOP, [signal.SIGINT], {"grace_s": 1}, "1 s of a rank's stop with its checkpoint"),
])
def test_ranks_that_do_not_end_after_a_stop_are_killed_and_named(tmp_path, capfd, first, stops, grace, since):
    """A rank frozen (SIGSTOP) as the job was stopped, and another stuck in a collective with it or saving and
    stopping as asked: the job waited for the frozen one until a rank's watchdog ended its collective, or for ever
    where none could. Ranks left once the stop's grace period has passed are killed, and named."""
    ready = tmp_path / "ready"
    ranks = [subprocess.Popen([sys.executable, "-c", first, ready, str(EXIT_PREEMPTED)]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    os.kill(ranks[1].pid, signal.SIGSTOP)
    _wait_for(ready)
    for signum in stops:
        _ctrl_c_once_handled(signum=signum)
    assert wait_for_ranks(ranks, **{"stop_grace_s": 60, **grace}) == EXIT_RANK_LOST
    left = ranks if first is STUCK else ranks[1:]
    assert [rank.returncode for rank in left] == [-signal.SIGKILL] * len(left)
    named = ", ".join(f"rank {ranks.index(rank)} (pid {rank.pid})" for rank in left)
    assert capfd.readouterr().err == (f"zerollm: error: {named} did not end within {since} (frozen, or stuck in a "
                                      f"collective), and {'were' if len(left) == 2 else 'was'} killed; the job is "
                                      "ended on every rank: rerun with --resume auto to continue from its last "
                                      "complete checkpoint\n")


def test_a_rank_failing_after_a_stop_is_not_hidden_by_another_that_saved_and_stopped(tmp_path, capfd):
    """Rank 0's 75 (saved and stopped as asked) sorted before rank 1's failure: the failure clock never started, and
    the job waited the stop's whole grace period, then called the frozen rank 2 the cause."""
    ranks = [subprocess.Popen([sys.executable, "-c", EXITS_ON_STOP, tmp_path / f"ready{i}", str(code)])
             for i, code in enumerate((EXIT_PREEMPTED, 1))]
    ranks.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    os.kill(ranks[2].pid, signal.SIGSTOP)
    _wait_for(tmp_path / "ready0")
    _wait_for(tmp_path / "ready1")
    _ctrl_c_once_handled()
    assert wait_for_ranks(ranks, grace_s=1, stop_grace_s=60) == 1
    assert [rank.returncode for rank in ranks] == [EXIT_PREEMPTED, 1, -signal.SIGKILL]
    assert capfd.readouterr().err == ""


def test_nproc_names_a_rank_a_signal_ended_and_exits_76(capfd):
    """A rank the OOM killer ends: the job said nothing of it and exited 137 (once its wait polled every rank, the
    others were stopped before their watchdogs could name it)."""
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"]),
             subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])]
    assert wait_for_ranks(ranks) == EXIT_RANK_LOST
    assert capfd.readouterr().err == (f"zerollm: error: rank 1 (pid {ranks[1].pid}) was ended by SIGKILL (signal 9); "
                                      "the job is ended on every rank: rerun with --resume auto to continue from its "
                                      "last complete checkpoint\n")


def test_ranks_that_refuse_under_torchrun_end_the_launch_with_exit_2_and_their_line(pretrain_data, tmp_path):
    """Both ranks refuse the job after torchrun started them (a vocabulary smaller than the data's tokenizer, which
    only the ranks compare): the launch ends as under DeepSpeed's launcher, exit 2 and the ranks' one line, not with
    torchrun's ChildFailedError traceback and exit 1."""
    result = run_cli("launch", "--backend", "torchrun", "--nproc-per-node", 2, "--master-port", free_port(), "--",
                     "train", "pretrain", "--recipe", "demo", "--data", pretrain_data, "--out", tmp_path / "run",
                     "--set", "model.vocab_size=100", cwd=folder_shadowing_zerollm(tmp_path / "project"),
                     as_script=True)  # a user's llm.py there ran on every rank (`-m llm`), which exited 0
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--rdzv-backend c10d" in result.stdout  # torchrun started the ranks: the refusal is theirs
    assert re.search(r"^zerollm: error: .*model\.vocab_size", result.stderr, re.MULTILINE), result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr


def failed(*codes):
    """torchrun's report of ranks 0, 1, ... that ended with `codes`, in that order."""
    return ChildFailedError("llm", {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>")
                                    for rank, code in enumerate(codes)})


def test_torchrun_is_quiet_only_when_the_failed_ranks_refused():
    """Ranks that torchrun ended itself after the first refusal (SIGTERM, SIGKILL) are passed over; any other
    failure keeps torchrun's report."""
    def refused(failure):
        return quiet_code(failure) == 2

    assert refused(failed(2)) and refused(failed(2, 2)) and refused(failed(2, -signal.SIGTERM, -signal.SIGKILL))
    assert not any(refused(failed(*codes)) for codes in [(1,), (2, 1), (76, 2), (2, 75), (-signal.SIGTERM,),
                                                         (-signal.SIGKILL, -signal.SIGTERM), (-signal.SIGSEGV, 2)])
    assert quiet_code(failed(141, 141)) == 141  # a closed output pipe: torchrun printed its failure table


def test_hostfile_mode_on_this_machine(pretrain_data, tmp_path):
    """Started from a folder holding a user's llm.py, which DeepSpeed's launcher ran on every rank (as `python -u -m
    llm`) in place of zerollm: the job exited 0 untrained."""
    (tmp_path / "hosts").write_text("# this machine\nlocalhost slots=2\n")
    result = run_cli("launch", "--hostfile", tmp_path / "hosts", "--master-port", free_port(), "--env",
                     "ZEROLLM_EXAMPLE=1", "--", *_job(pretrain_data, tmp_path / "run", "train.max_steps=2"),
                     cwd=folder_shadowing_zerollm(tmp_path / "project"), as_script=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert SHADOWING not in result.stdout
    assert "deepspeed.launcher.runner --hostfile" in result.stdout and "2 rank(s)" in result.stdout
    assert [r["step"] for r in _metrics(tmp_path / "run")] == [1, 2]


def test_launchers_start_from_a_folder_holding_a_launch_py_and_a_kernels_folder(tmp_path):
    """They ran as `python -m launch.deepspeed_launcher` (and torchrun as `python -m launch.torchrun`), which found a
    user's launch.py in the working directory (and ran it) in place of zerollm's launch/, and its kernels/ in place of
    zerollm's (an ImportError advising to uninstall Hugging Face's)."""
    (tmp_path / "launch.py").write_text("print('my own launch script')\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    per_node = through_here([sys.executable, "-u", "-m", "deepspeed.launcher.launch", "--help"])
    torchrun = plan_launch(_launch_args("--backend", "torchrun", "--nnodes", "1", "--node-rank", "0", "--master-addr",
                                        "127.0.0.1"), ["train"], {}).command[:-1] + ["--help"]  # no zerollm
    for command in (deepspeed_runner("--help"), per_node, torchrun):
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
        assert (result.returncode, result.stdout.startswith("usage: ")) == (0, True), result.stderr[-2000:]
        assert "my own launch script" not in result.stdout


@pytest.mark.parametrize("read_to, code", [("zerollm launch: ", EXIT_PIPE_CLOSED), ("step 2/", EXIT_PREEMPTED)])
def test_a_launch_whose_output_reader_leaves_ends_quietly(pretrain_data, tmp_path, read_to, code):
    """`zerollm launch ... | head`: DeepSpeed's runner and per-node launcher log to standard output, and each line
    they wrote after the reader left (every rank started, every rank stopped) printed a '--- Logging error ---'
    traceback. The launch ends as the rest of the CLI does: 141 without a word before the ranks train, else a stop
    with a checkpoint."""
    run = tmp_path / "run"
    job = _job(pretrain_data, run, "train.max_steps=500", "train.save_every=400")
    with open(tmp_path / "stderr", "w") as stderr_file:  # a pipe, unread, would fill up and hold the launch
        launch = subprocess.Popen([sys.executable, "-m", "llm", "launch", "--nnodes", "1", "--node-rank", "0",
                                   "--master-addr", "127.0.0.1", "--nproc-per-node", "2", "--master-port",
                                   str(free_port()), "--", *map(str, job)], stdout=subprocess.PIPE,
                                  stderr=stderr_file, text=True)
    reader = threading.Thread(target=lambda: next((line for line in launch.stdout if line.startswith(read_to)), None),
                              daemon=True)  # as head reads its lines
    reader.start()
    reader.join(timeout=300)
    if reader.is_alive():
        launch.kill()
        pytest.fail(f"no line starting {read_to!r} in 300 s")
    launch.stdout.close()
    launch.wait(timeout=300)
    stderr = (tmp_path / "stderr").read_text()
    assert launch.returncode == code, stderr[-3000:]
    assert "Logging error" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert (run / "checkpoints" / "latest").is_file() == (code == EXIT_PREEMPTED)


def test_fingerprint_mismatch_stops_every_node_with_one_message(pretrain_data, tmp_path):
    run = tmp_path / "run"
    procs = _two_nodes(tmp_path, lambda rank: _job(pretrain_data, run, "train.max_steps=2",
                                                   f"train.lr={0.003 if rank == 0 else 0.001}"))
    assert _wait_all(procs) == [2, 2]
    for rank in (0, 1):
        log = (tmp_path / f"node{rank}.log").read_text()
        assert log.count("zerollm: error: ranks disagree") == 1, log[-3000:]
        assert "config.train.lr: 0.003 on rank 0; 0.001 on rank 1" in log and "Traceback" not in log
    assert not run.exists()


def test_ranks_given_different_run_directories_are_refused_before_training(pretrain_data, tmp_path):
    """Nodes given different --outs (or node-local storage) trained to the end, exit 0, each node's checkpoint files
    in a folder of its own: every checkpoint incomplete, none resumable, nothing said."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "llm", *_job(pretrain_data, tmp_path / f"out{rank}",
                                                                          "train.max_steps=2")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    host = socket.gethostname()
    line = (f"zerollm: error: the ranks do not share one run directory: rank 1 on {host} (--out {tmp_path / 'out1'}) "
            f"cannot see the file rank 0 on {host} wrote into {tmp_path / 'out0'}; give every node the same --out, on "
            "a file system they all see")
    assert all(out.count(line) == 1 and "Traceback" not in out for out in outputs), outputs
    assert not (tmp_path / "out0").exists() and not (tmp_path / "out1").exists()  # its file too was removed


def test_ranks_that_disagree_exit_2_even_with_a_heartbeat_in_flight(pretrain_data, tmp_path):
    """Every rank raises the refusal with its gloo groups open and its watchdog beating: each ends with exit 2,
    never an abort (before the fix, a beat caught by interpreter teardown aborted a rank in 2 of 3 runs)."""
    port, run = free_port(), tmp_path / "run"
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
        job = _job(pretrain_data, run, "train.max_steps=2", f"train.lr={0.003 if rank == 0 else 0.001}")
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "probes" / "fast_heartbeat.py"), *job],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert all(out.count("zerollm: error: ranks disagree") == 1 for out in outputs), outputs
    assert not run.exists()


def test_a_killed_rank_ends_the_job_naming_it_and_one_node_resumes(pretrain_data, tmp_path):
    run, timeout = tmp_path / "run", 20
    procs = _two_nodes(tmp_path, lambda rank: _job(pretrain_data, run, *SLOW, "train.save_every=2",
                                                   f"train.collective_timeout_s={timeout}"))
    _wait_for_steps(run, 3, procs)
    victim = _rank_process(procs[1])
    victim.kill()
    killed_at = time.monotonic()
    code = procs[0].wait(timeout=timeout + 30)
    assert time.monotonic() - killed_at < timeout + 10
    log = (tmp_path / "node0.log").read_text()
    assert code == 76, log[-3000:]
    assert f"rank 1 (host {socket.gethostname()}, pid {victim.pid}) ended" in log  # same machine: named at once
    assert "Traceback" not in log  # the collective that failed for want of its peer is not the news

    step = int((run / "checkpoints" / "latest").read_text().removeprefix("global_step"))
    job = _job(pretrain_data, run, *SLOW, f"train.max_steps={step + 2}", "train.micro_batch_size=32")
    _wait_all(procs)
    result = run_job(*job, "--resume", "auto")  # one node, one rank: a universal checkpoint is made
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed at step {step}" in result.stdout and "converting it to a universal checkpoint" in result.stdout
    assert [r["step"] for r in _metrics(run)][-2:] == [step + 1, step + 2]


def _diagnosis(monkeypatch, world_size: int, registered: dict[int, tuple[str, str, bool]]) -> str | None:
    """Rank 0's watchdog diagnosis in a job of `world_size` ranks whose rendezvous store holds, for each rank of
    `registered`, its identity, its process key and (True) one heartbeat."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for rank, (identity, process, beat) in registered.items():
        store.set(watchdog._identity_key(rank), identity)
        store.set(watchdog._process_key(rank), process)
        if beat:
            store.add(watchdog._counter_key(rank), 1)
    dog = watchdog.Watchdog(0, world_size, timeout_s=15, announce=True)
    try:
        return dog.diagnose()
    finally:
        dog.stop()


def test_a_step_past_the_timeout_says_what_stuck_it_or_to_allow_it_longer(monkeypatch):
    """With every heartbeat alive, a step past train.collective_timeout_s was called stuck outside communication
    only: a GRPO step of a large model generating long completions legitimately takes longer, and the message did
    not say which setting allows it."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 - the job's store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    said = []
    monkeypatch.setattr(watchdog.Watchdog, "_exit",
                        lambda self, message, code: (said.append(message), self._stopped.set()))
    dog = watchdog.Watchdog(0, 1, timeout_s=1.0, announce=True)
    try:
        with dog.watching("step 3"):
            deadline = time.monotonic() + 30
            while not said and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        dog.stop()
    assert said and said[0].startswith("rank 0: step 3 did not finish within train.collective_timeout_s=1 s: every "
                                       "rank's heartbeat is alive")
    assert "raise train.collective_timeout_s" in said[0]


class _Sleeps:
    """`time.sleep` for a watchdog test: records the seconds asked for, sleeps them up to 0.25 s (a poll: the time
    asked for is then about the time waited, however loaded the machine; a long wait is cut)."""

    def __init__(self, real=time.sleep):
        self.asked, self._real = 0.0, real

    def __call__(self, seconds: float) -> None:
        self.asked += seconds
        self._real(min(seconds, 0.25))


@contextlib.contextmanager
def _two_watchdogs(monkeypatch, said: list) -> collections.abc.Iterator[tuple[watchdog.Watchdog, watchdog.Watchdog]]:
    """Rank 0's watchdog with the default heartbeat interval (10 s) and rank 1's beating every 0.5 s, in a job of
    two ranks; a rank that would end its process appends (rank, message, exit code) to `said` and stops beating
    instead."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(watchdog.Watchdog, "_exit",
                        lambda self, message, code: (said.append((self.rank, message, code)), self._stopped.set()))
    dogs = watchdog.Watchdog(0, 2, timeout_s=600, announce=True), watchdog.Watchdog(1, 2, timeout_s=15, announce=True)
    try:
        yield dogs
    finally:
        for dog in dogs:
            dog.stop()
        del store


def test_a_diagnosis_ends_once_every_other_rank_has_beaten(monkeypatch):
    """A rank whose own error ended a job (a bad optimizer setting) first waited three heartbeat intervals (30 s by
    default) to rule out a lost peer, though every peer had beaten long before."""
    sleeps = _Sleeps()
    with _two_watchdogs(monkeypatch, []) as dogs:
        monkeypatch.setattr(watchdog.time, "sleep", sleeps)
        assert dogs[0].diagnose() is None
    assert sleeps.asked < dogs[0].stale_after / 2  # 30 s


@pytest.mark.parametrize("both", [False, True], ids=["one-rank-ends-it", "both-end-it"])
def test_the_rank_ending_a_job_leaves_once_every_other_rank_knows(monkeypatch, both):
    """The rank that ended a job stayed 1.5 heartbeat intervals (15 s by default), whether or not its peers had
    seen the news, in case the store lived in its process; so did every rank where all ended it at once (each
    failed on its own, as they do on a bad setting)."""
    said = []
    sleeps = _Sleeps()
    with _two_watchdogs(monkeypatch, said) as dogs:
        monkeypatch.setattr(watchdog.time, "sleep", sleeps)
        peer = threading.Thread(target=dogs[1].end_job, args=("failed with RuntimeError: boom", "Fix it."))
        if both:  # rank 1 ends it first (else its heartbeat may see rank 0's news and leave, the lock held)
            peer.start()
            while not dogs[1]._ending.locked():
                time.sleep(0.01)
        dogs[0].end_job("failed with RuntimeError: boom", advice="Fix it.")
        if both:
            peer.join(timeout=30)
            assert not peer.is_alive()
    news = "{}: failed with RuntimeError: boom; the job is ended on every rank. Fix it."
    assert sorted(said) == [(0, news.format("rank 0"), 76), (1, news.format("rank 1" if both else "rank 0"), 76)]
    assert sleeps.asked < 1.5 * dogs[0].interval / 2  # 15 s


def test_a_job_ended_without_a_word_ends_every_rank_with_its_code(monkeypatch):
    """A closed output pipe on rank 0 ends the job as it ends one process: 141 on every rank, and nothing said."""
    said = []
    with _two_watchdogs(monkeypatch, said) as dogs:
        monkeypatch.setattr(watchdog.time, "sleep", _Sleeps())
        dogs[0].end_job(None, code=141)
        deadline = time.monotonic() + 30
        while len(said) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sorted(said) == [(0, "", 141), (1, "", 141)]


def _ended_pid() -> int:
    """The pid of a process of this machine that has ended."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


@pytest.mark.parametrize("same_namespace", [True, False])
def test_a_rank_of_this_machine_whose_process_ended_is_named_at_once(monkeypatch, same_namespace):
    """A peer killed on the same machine was diagnosed only after its heartbeat had been silent for 3 intervals
    (30 s by default) and called a rank that stopped responding. A pid of another pid namespace (a container with
    the host's network) says nothing: its heartbeat decides."""
    pid = _ended_pid()
    boot, namespace, _ = watchdog._this_process().split(" ")
    process = f"{boot} {namespace if same_namespace else 'elsewhere'} {pid}"
    assert _diagnosis(monkeypatch, 2, {1: (f"host h1, pid {pid}", process, True)}) == (
        f"rank 1 (host h1, pid {pid}) ended" if same_namespace else
        f"rank 1 (host h1, pid {pid}) stopped responding (no heartbeat for 2 s)")


def test_a_rank_still_exiting_when_its_peer_looks_is_named_as_ended(monkeypatch):
    """A killed rank closes its sockets before it is a zombie: a peer whose collective failed at once could find it
    still exiting, and called it a rank that stopped responding (a CI run on a loaded machine)."""
    looks = iter([False, True])  # still exiting at the first look, gone at the second
    monkeypatch.setattr(watchdog, "_ended", lambda process, here: next(looks))
    process = f"{watchdog._this_process().rsplit(' ', 1)[0]} 7"
    assert _diagnosis(monkeypatch, 2, {1: ("host h1, pid 7", process, True)}) == "rank 1 (host h1, pid 7) ended"


def test_an_ended_rank_is_named_while_other_ranks_never_registered(monkeypatch):
    """A rank may fail before every other rank registered its process: the ranks that did are still looked up."""
    pid = _ended_pid()
    boot, namespace, _ = watchdog._this_process().split(" ")
    registered = {2: (f"host h2, pid {pid}", f"{boot} {namespace} {pid}", False)}  # ranks 1 and 3 never registered
    assert _diagnosis(monkeypatch, 4, registered) == f"rank 2 (host h2, pid {pid}) ended"


def test_no_pid_is_looked_up_in_a_proc_of_another_pid_namespace(monkeypatch):
    """In a pid namespace without its own /proc (unshare --pid without --mount-proc), /proc shows the host's pids:
    live ranks were named as ended after unrelated host processes."""
    assert watchdog._this_process().endswith(f" {os.getpid()}")
    monkeypatch.setattr(watchdog.os, "readlink", lambda path: "1")  # what /proc/self reads there
    assert watchdog._this_process() == ""


def test_a_frozen_rank_ends_the_job_at_the_timeout_naming_it(pretrain_data, tmp_path):
    run, timeout = tmp_path / "run", 20  # also the limit of the rendezvous and of each step before the freeze
    procs = _two_nodes(tmp_path, lambda rank: _job(pretrain_data, run, *SLOW, f"train.collective_timeout_s={timeout}"))
    try:
        _wait_for_steps(run, 3, procs)
        frozen = _rank_process(procs[1])
        frozen.suspend()  # SIGSTOP: alive, connections open, no progress and no heartbeat
        stopped_at = time.monotonic()
        code = procs[0].wait(timeout=timeout + 60)
        # the timeout, then the node's teardown: seconds on a loaded 2-core machine (16.1 s was seen in a full suite
        # with a timeout of 10 s)
        assert time.monotonic() - stopped_at < timeout + 20
    finally:
        _kill_tree(procs[1])
        _wait_all(procs)
    log = (tmp_path / "node0.log").read_text()
    assert code == 76, log[-3000:]
    assert f"rank 1 (host {socket.gethostname()}, pid {frozen.pid}) stopped responding" in log


def test_a_node_that_never_comes_is_reported_at_the_timeout(pretrain_data, tmp_path):
    result = run_cli("launch", "--nnodes", 2, "--node-rank", 0, "--master-addr", "127.0.0.1", "--master-port",
                     free_port(), "--", *_job(pretrain_data, tmp_path / "run", "train.collective_timeout_s=5"))
    assert result.returncode == 2
    assert "rank 0: the 2 ranks did not all meet at 127.0.0.1:" in result.stderr
    assert "start every node with the same node count, ranks per node (--nproc-per-node), master" in result.stderr
    assert "1/2 clients joined" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_a_master_port_another_job_holds_is_said_so(tmp_path):
    """Under deepspeed or torchrun, a second job on the default port 29500 was told the ranks 'did not all meet ...
    within train.collective_timeout_s=600 s' (at once) and to check that node 0 is reachable."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
        result = subprocess.run([sys.executable, "-c", "from llm.runtime.distributed import setup_distributed\n"
                                 "from llm.errors import UserError\ntry:\n    setup_distributed(600)\n"
                                 "except UserError as e:\n    print(e)"], env=env, cwd=tmp_path, capture_output=True,
                                text=True, timeout=120, check=False)
    assert result.stdout == (f"rank 0: port {port} of 127.0.0.1 is taken (another job's rendezvous?); start the job "
                             "with another master port (--master_port P for deepspeed, --master-port P for torchrun "
                             "and zerollm launch), or with zerollm train --nproc N, which picks a free one\n")


def test_a_node_waiting_for_node_0_is_reported_at_the_timeout_without_cpp_traces(pretrain_data, tmp_path):
    """torch's store client retried with the whole timeout at each try (two to three times
    train.collective_timeout_s) and printed a C++ stack trace at each."""
    port = free_port()
    result = run_cli("launch", "--nnodes", 2, "--node-rank", 1, "--master-addr", "127.0.0.1", "--master-port",
                     port, "--", *_job(pretrain_data, tmp_path / "run", "train.collective_timeout_s=3"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"rank 1: the 2 ranks did not all meet at 127.0.0.1:{port} within train.collective_timeout_s=3 s "
            f"(nothing answered at 127.0.0.1:{port} (Connection refused)); start every node") in result.stderr
    assert "Exception raised from" not in result.stderr and "frame #" not in result.stderr, result.stderr[-3000:]


def test_nodes_told_different_node_counts_each_say_so_in_one_line(pretrain_data, tmp_path):
    """Node 0, told 2 nodes, met its store with node 1's rank (told 3), then timed out in the first collective: a
    gloo 'Timed out waiting ... for send operation' traceback, exit 1, where node 1 said the nodes did not all meet."""
    port = free_port()
    procs = [_start(["launch", "--nnodes", nodes, "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port",
                     port, "--", *_job(pretrain_data, tmp_path / "run", "train.collective_timeout_s=3")],
                    tmp_path / f"node{rank}.log") for rank, nodes in ((0, 2), (1, 3))]
    assert _wait_all(procs) == [2, 2]
    for rank in (0, 1):
        log = (tmp_path / f"node{rank}.log").read_text()
        assert f"did not all meet at 127.0.0.1:{port} within train.collective_timeout_s=3 s" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_killing_the_launch_process_stops_the_ranks_cleanly(pretrain_data, tmp_path):
    """SIGKILL to `zerollm launch` forwards nothing; its ranks notice, save a checkpoint and stop, and nothing is
    left running."""
    run = tmp_path / "run"
    node = _start(["launch", "--master-port", free_port(), "--",
                   *_job(pretrain_data, run, *SLOW, "train.save_every=0", "train.max_steps=100000")],
                  tmp_path / "node.log")
    try:
        _wait_for_steps(run, 2, [node])
        family = psutil.Process(node.pid).children(recursive=True)
        assert len(family) == 3  # deepspeed runner -> launch -> rank
        node.kill()
        node.wait()
        _, alive = psutil.wait_procs(family, timeout=60)
        assert alive == []
    finally:
        _kill_tree(node)
    log = (tmp_path / "node.log").read_text()
    assert f"rank 0: zerollm launch (pid {node.pid}) ended; saving a checkpoint and stopping" in log
    tag = (run / "checkpoints" / "latest").read_text()
    assert json.loads((run / "checkpoints" / tag / "client_state.json").read_text())["stopped_by_signal"] is True


def test_slurm_template_starts_one_launcher_per_node(zero_runs, pretrain_data, tmp_path):
    """The sbatch script run as SLURM would, with a stand-in `srun` that starts its command once per node: each a
    torchrun node of a c10d rendezvous, whose two ranks train as the session's ZeRO-2 job of two ranks does.
    `--backend torchrun` plans the same torchrun command with the node count, rank and master given instead of read
    from SLURM's variables (its plans: test_plans_for_each_mode; a real two-node start up to the rendezvous:
    test_a_node_that_never_comes_under_torchrun_is_one_line_at_the_timeout)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text("#!/bin/bash\n"
                    "echo \"$@\" > \"$SRUN_LOGS/srun.args\"\n"
                    "while [[ $1 == --* ]]; do shift; done\n"
                    "for node in 0 1; do\n"
                    "  SLURM_STEP_ID=0 SLURM_NODEID=$node \"$@\" > \"$SRUN_LOGS/node$node.log\" 2>&1 &\n"
                    "done\n"
                    "code=0; for job in $(jobs -p); do wait $job || code=$?; done; exit $code\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_LOGS": str(tmp_path),
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_JOB_ID": "4242",
           "MASTER_PORT": str(free_port()), "ZEROLLM": f"{sys.executable} -m llm", "SLURM_CPUS_PER_TASK": "3"}
    run = tmp_path / "run"
    result = subprocess.run(["bash", REPO / "launch" / "slurm" / "zerollm.sbatch",
                             *_job(pretrain_data, run, "train.max_steps=4", "train.eval_every=2")],
                            env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, (tmp_path / "node0.log").read_text()[-3000:]
    # sbatch's --cpus-per-task, which srun inherits no more (SLURM 22.05 on): each node's task had 1 CPU
    srun_options = (tmp_path / "srun.args").read_text().split()
    assert srun_options[:3] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=3"]
    assert "--rdzv-id 4242" in (tmp_path / "node1.log").read_text()
    assert "--rdzv-backend c10d" in (tmp_path / "node0.log").read_text()
    rows, reference = _metrics(run), _metrics(zero_runs[2])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-6)


@pytest.fixture
def second_address():
    """A network namespace joined to this one by a veth pair: (our address, its address, run-in-it prefix)."""
    ns, host_if, ns_if = f"zl{os.getpid()}", f"zlh{os.getpid()}", f"zln{os.getpid()}"
    setup = [["ip", "netns", "add", ns], ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
             ["ip", "link", "set", ns_if, "netns", ns], ["ip", "addr", "add", "10.77.0.1/24", "dev", host_if],
             ["ip", "link", "set", host_if, "up"],
             ["ip", "netns", "exec", ns, "ip", "addr", "add", "10.77.0.2/24", "dev", ns_if],
             ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for command in setup:
            if subprocess.run(command, capture_output=True).returncode != 0:
                pytest.skip(f"network namespaces are not available here ({' '.join(command)} failed)")
        yield host_if, ns_if, ["ip", "netns", "exec", ns]
    except FileNotFoundError:
        pytest.skip("the ip command is not installed")
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_meet_across_a_real_interface(second_address, pretrain_data, tmp_path):
    """Node 1 lives in its own network namespace: the rendezvous, gloo and the watchdog's store cross a veth pair
    (each node's gloo interface is passed with --env, and a thread count that each rank's run record shows)."""
    host_if, ns_if, in_namespace = second_address
    port, run = free_port(), tmp_path / "run"
    threads = len(usable_cpus()) + 1  # neither the CPUs of a node's one rank nor what this process inherited
    procs = []
    for rank, (prefix, interface) in enumerate([([], host_if), (in_namespace, ns_if)]):
        argv = [*prefix, sys.executable, "-m", "llm", "launch", "--nnodes", "2", "--node-rank", str(rank),
                "--master-addr", "10.77.0.1", "--master-port", str(port), "--env", f"GLOO_SOCKET_IFNAME={interface}",
                "--env", f"OMP_NUM_THREADS={threads}", "--", *_job(pretrain_data, run, "train.max_steps=2")]
        with open(tmp_path / f"node{rank}.log", "w") as log:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    assert _wait_all(procs) == [0, 0], (tmp_path / "node1.log").read_text()[-3000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2] and "2 rank(s)" in (tmp_path / "node0.log").read_text()
    (record,) = [json.loads(line) for line in (run / "run_record.jsonl").read_text().splitlines()]
    assert [r["cpu_threads"] for r in record["ranks"]] == [threads, threads]  # --env reached both nodes' ranks


# ---- how a job ends: a rank a signal ended, a node that never comes, a stop while remote ranks save ------------

RANK_KILLED_BY_SIGNAL = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[1], f"pid.{rank}"), "w").write(str(os.getpid()))
if rank == 1:
    time.sleep(2)  # seen running by the launch first
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""
"""A two-rank job whose rank 1 the kernel kills (as the OOM killer does); rank 0 waits to be stopped."""


def _lost_rank_line(who):
    return (f"zerollm: error: {who} was ended by SIGKILL (signal 9); the job is ended on every rank: rerun with "
            "--resume auto to continue from its last complete checkpoint")


def test_a_rank_a_signal_ends_under_deepspeeds_launcher_is_said_and_exits_76(tmp_path, capfd):
    """DeepSpeed's per-node launcher exits with the rank's return code, -9, which reached the shell as 247, with no
    word (hostfile mode on one host, per-node mode). Which rank it was, DeepSpeed's launcher does not say."""
    script = tmp_path / "zerollm"  # a name `zerollm launch` knows as a rank's
    script.write_text(RANK_KILLED_BY_SIGNAL)
    command = deepspeed_runner("--hostfile", "{dir}/hostfile", "--no_ssh_check", "--master_addr", "127.0.0.1",
                               "--master_port", str(free_port()), program=(str(script),))
    plan = Plan(command, [str(tmp_path)], files={"hostfile": "localhost slots=2\n"})
    assert run_plan(plan, tmp_path / "run") == EXIT_RANK_LOST
    assert _lost_rank_line("a rank") in capfd.readouterr().err.splitlines()


def test_a_launch_stopped_at_once_by_a_second_ctrl_c_exits_130(tmp_path):
    """The ranks are sent SIGTERM for each stop `zerollm launch` is given (its launcher runs in a session of its own),
    so a second Ctrl-C ended the job with their 143."""
    ready = tmp_path / "ready"
    launcher = ("import os, pathlib, signal, sys, time\n"  # DeepSpeed's launcher passes the rank's code on
                "signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))\n"
                f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(20)\n")
    _ctrl_c_once_handled(after=ready)
    assert run_plan(Plan([sys.executable, "-c", launcher], []), tmp_path / "run") == 128 + signal.SIGINT


def test_a_launch_stopped_while_its_ranks_start_exits_as_the_stop_was_sent(tmp_path):
    """Ranks still importing (no handler set) end by the forwarded SIGTERM itself, which torchrun, as DeepSpeed's
    launcher does, passes on as 256 - 15: the launch exited 241 for a Ctrl-C."""
    ready = tmp_path / "ready"
    launcher = ("import os, pathlib, signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: os._exit(256 - signal.SIGTERM))\n"
                f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(20)\n")
    _ctrl_c_once_handled(after=ready)
    assert run_plan(Plan([sys.executable, "-c", launcher], []), tmp_path / "run") == 128 + signal.SIGINT


@pytest.mark.parametrize("reaches_hosts", [False, True])
def test_a_launch_stopped_before_its_ranks_start_stops_what_its_launcher_started(tmp_path, reaches_hosts):
    """DeepSpeed's runner, stopped before it set its handler, died and left its per-node launcher, which started the
    ranks after `zerollm launch` had exited 130: they trained and saved a checkpoint. A launcher that reaches other
    hosts itself (pdsh, mpirun) is left to stop them: its helpers (ssh) are not sent the stop."""
    ready, started = tmp_path / "ready", tmp_path / "ranks started"
    per_node = f"import pathlib, time\ntime.sleep(3)\npathlib.Path({str(started)!r}).touch()\n"
    runner = ("import pathlib, subprocess, sys, time\n"  # no handler: SIGTERM ends it, not its child
              f"subprocess.Popen([sys.executable, '-c', {per_node!r}])\n"
              f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(20)\n")
    _ctrl_c_once_handled(after=ready)
    plan = Plan([sys.executable, "-c", runner], [], reaches_hosts=reaches_hosts)
    assert run_plan(plan, tmp_path / "run") == 128 + signal.SIGINT
    time.sleep(4)
    assert started.exists() == reaches_hosts


def test_a_multi_host_launch_stopped_before_any_checkpoint_exits_as_the_stop_was_sent(tmp_path, capsys):
    """DeepSpeed's pdsh runner exits 1 on a stop signal (its handler's sys.exit(1)); stopped while its ranks started,
    the launch waited for a checkpoint of the stop, then exited 1, as if it had failed."""
    ready = tmp_path / "ready"
    runner = ("import pathlib, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))\n"
              f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(20)\n")
    _ctrl_c_once_handled(after=ready)
    plan = Plan([sys.executable, "-c", runner], [], stop_wait_s=0.5, reaches_hosts=True)
    assert run_plan(plan, tmp_path / "run") == 128 + signal.SIGINT
    assert capsys.readouterr().out.endswith(f"zerollm launch: stopped; no checkpoint of the stop appeared in "
                                            f"{tmp_path / 'run'} (where the hosts do not share it, their ranks' "
                                            "checkpoints are not seen here)\n")


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.01)


def _ctrl_c_once_handled(after: Path | None = None, signum: int = signal.SIGINT) -> None:
    """Send this process a SIGINT (a Ctrl-C), or `signum`, once the code under test has set its own handler for SIGINT
    (and `after` exists): pytest's own would end the whole session."""
    pytest_handler = signal.getsignal(signal.SIGINT)

    def interrupt() -> None:
        if after is not None:
            _wait_for(after)
        while signal.getsignal(signal.SIGINT) is pytest_handler:
            time.sleep(0.01)
        os.kill(os.getpid(), signum)

    threading.Thread(target=interrupt, daemon=True).start()


def test_a_rank_a_signal_ends_under_torchrun_is_named_and_exits_76(tmp_path):
    """torchrun reported it as its ChildFailedError traceback, exit 1."""
    (tmp_path / "rank.py").write_text(RANK_KILLED_BY_SIGNAL)
    result = subprocess.run([sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "0", tmp_path / "rank.py", tmp_path], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == EXIT_RANK_LOST, result.stderr[-3000:]
    assert _lost_rank_line(f"rank 1 (pid {(tmp_path / 'pid.1').read_text()})") in result.stderr.splitlines()
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


RANK_FAILS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    time.sleep(2)  # seen running by torchrun first
    if sys.argv[1] == "SIGTERM":
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(int(sys.argv[1]))
time.sleep(120)
"""
"""A two-rank job whose rank 1 exits with the code given, or is sent SIGTERM from outside; rank 0 waits to be
stopped."""


def test_an_ssh_connection_lost_under_pdsh_is_said_and_exits_76(tmp_path, capfd):
    """pdsh passes ssh's 255 on (a host unreachable mid-run, a dropped connection): the launch exited 255 with no
    word of its own."""
    plan = Plan([sys.executable, "-c", "import sys; sys.exit(255)"], [], ssh_hosts=["node-a", "node-b"])
    assert run_plan(plan, tmp_path / "run") == EXIT_RANK_LOST
    assert ("zerollm: error: a host's ssh connection failed or ended (exit 255; the lines above name the host), or a "
            "rank there was ended by SIGHUP; the job is ended on every rank: rerun with --resume auto to continue "
            "from its last complete checkpoint") in capfd.readouterr().err.splitlines()
    assert run_plan(replace(plan, ssh_hosts=[]), tmp_path / "run") == 255  # no ssh: the code as it came


@pytest.mark.parametrize("ending, code, line", [
    ("3", 3, None),
    ("SIGTERM", EXIT_RANK_LOST, "zerollm: error: a rank was ended by SIGTERM (signal 15); the job is ended on every "
                                "rank: rerun with --resume auto to continue from its last complete checkpoint")])
def test_a_rank_failing_under_torchrun_ends_the_launch_as_under_deepspeeds_launcher(tmp_path, capfd, ending, code,
                                                                                     line):
    """torchrun exits 1 whichever code or signal ended the rank (`--backend torchrun` and `slurm` ended so, after
    its traceback); DeepSpeed's launcher passes the code on (3) and a signal as 256 - N, said in one line, 76."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_FAILS)
    options = _launch_args("--backend", "torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()))
    plan = plan_launch(options, ["train", "pretrain"], {})
    assert plan.command[-1] == ZEROLLM
    plan = replace(plan, command=[*plan.command[:-1], str(script)], job=[ending])
    assert run_plan(plan, tmp_path / "run") == code
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    root_cause = err.split("Root Cause (first observed failure):")[1]  # torchrun's table: the rank and how it ended
    assert "rank      : 1 (local_rank: 1)" in root_cause
    assert f"exitcode  : {3 if ending == '3' else -signal.SIGTERM}" in root_cause
    assert line is None or line in err.splitlines()


def test_torchrun_passes_the_first_failure_on_as_deepspeeds_launcher_does():
    assert passed_on_code(failed(3, -signal.SIGTERM)) == 3  # rank 0's code, not torchrun's 1
    assert passed_on_code(failed(1, 3)) == 1
    assert passed_on_code(failed(-signal.SIGTERM, -signal.SIGKILL)) == 256 - signal.SIGTERM  # read by zerollm launch
    assert deepspeed_signal(passed_on_code(failed(-signal.SIGTERM))) == signal.SIGTERM


def test_torchrun_stopped_itself_ends_without_a_traceback(monkeypatch, capsys):
    """A SIGTERM to torchrun (with its ranks: a job step's processes signalled at once) was its SignalException's
    traceback, thirty lines, though the ranks saved."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    import launch.torchrun

    def stopped(argv):
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(launch.torchrun, "torchrun_main", stopped)
    assert launch.torchrun.main([]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ""


def test_torchrun_s_rendezvous_lost_while_the_job_ran_ends_as_a_lost_node(monkeypatch, capsys):
    """Node 0 ended (or was cut off) after the nodes had met: torchrun's agent, asking its store whether nodes wait
    to join, raised RendezvousConnectionError, and every other node exited 2 (bad input, not to be retried) with
    'start node 0 (--node-rank 0) first'. Before the nodes meet, that line and exit 2 are still right."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    import launch.torchrun

    def num_nodes_waiting():
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    def joining():
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    argv = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-conf", "is_host=0,join_timeout=3", "-m",
            "llm"]
    monkeypatch.setattr(launch.torchrun, "torchrun_main", lambda argv: num_nodes_waiting())
    assert launch.torchrun.main(argv) == EXIT_RANK_LOST
    assert capsys.readouterr().err == (
        "zerollm: error: the rendezvous at 127.0.0.1:29500 stopped answering while the job ran (The connection to the "
        "C10d store has failed.): node 0 ended or cannot be reached; the job is ended on this node: rerun with "
        "--resume auto to continue from its last complete checkpoint\n")
    monkeypatch.setattr(launch.torchrun, "torchrun_main", lambda argv: joining())
    assert launch.torchrun.main(argv) == 2
    assert "start node 0 (--node-rank 0) first" in capsys.readouterr().err


def test_torchrun_failures_are_read_like_the_ranks_own_ending():
    assert quiet_code(failed(76, -signal.SIGTERM)) == EXIT_RANK_LOST  # a watchdog named the rank it lost
    assert quiet_code(failed(EXIT_PREEMPTED, EXIT_PREEMPTED)) == EXIT_PREEMPTED  # stopped and saved: no failure table
    assert quiet_code(failed(2, -signal.SIGKILL)) == 2 and quiet_code(failed(76, 2)) is None
    assert lost_rank(failed(-signal.SIGKILL, -signal.SIGTERM)) == (0, 1000, signal.SIGKILL)  # the OOM killer's
    assert lost_rank(failed(-signal.SIGSEGV, 1)) == (0, 1000, signal.SIGSEGV)
    assert lost_rank(failed(1, -signal.SIGTERM)) is None  # torchrun closed rank 1 after rank 0 failed
    assert lost_rank(failed(1, -signal.SIGKILL)) is None  # ... and killed it 30 s later: not the cause
    assert lost_rank(failed(-signal.SIGTERM, -signal.SIGKILL)) is None  # a stop: rank 0 ended, rank 1 closed


@pytest.mark.parametrize("others", [EXIT_RANK_LOST, EXIT_PREEMPTED, -signal.SIGKILL])
def test_a_rank_the_oom_killer_ended_first_is_named_whatever_the_others_said(monkeypatch, capsys, others):
    """Rank 0 killed, then rank 1 closed by torchrun: where rank 1's watchdog said the job lost a rank (76), or its
    SIGTERM handler saved (75), the killed rank went unnamed and the job ended with rank 1's code."""
    import launch.torchrun

    def job(argv):
        raise failed(-signal.SIGKILL, others)

    monkeypatch.setattr(launch.torchrun, "torchrun_main", job)
    assert launch.torchrun.main(["--nproc-per-node", "2", "rank.py"]) == EXIT_RANK_LOST
    assert capsys.readouterr().err.splitlines() == [_lost_rank_line("rank 0 (pid 1000)")]


def test_torchrun_nodes_wait_for_each_other_train_collective_timeout_s(tmp_path):
    """torchrun's rendezvous waited its own 600 s whatever the config said."""
    argv = ["--backend", "torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]
    plan = plan_launch(_launch_args(*argv), _job(tmp_path, tmp_path / "run", "train.collective_timeout_s=42.5"), {})
    assert "is_host=0,join_timeout=43" in plan.command
    plan = plan_launch(_launch_args(*argv), _job(tmp_path, tmp_path / "run"), {})
    assert "is_host=0,join_timeout=600" in plan.command


def test_a_node_that_never_comes_under_torchrun_is_one_line_at_the_timeout(pretrain_data, tmp_path):
    """608 s of silence, then torchrun's RendezvousTimeoutError traceback and exit 1."""
    port = free_port()
    result = run_cli("launch", "--backend", "torchrun", "--nnodes", 2, "--node-rank", 0, "--master-addr",
                     "127.0.0.1", "--master-port", port, "--",
                     *_job(pretrain_data, tmp_path / "run", "train.collective_timeout_s=3"), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        f"zerollm: error: the 2 nodes did not all meet at 127.0.0.1:{port} within train.collective_timeout_s=3 s "
        "(torchrun's rendezvous); start every node with the same --nnodes, --master-addr, --master-port and "
        "--rdzv-id, and check that node 0 is reachable from the others")
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


SAVING_A_STOPS_CHECKPOINT = """
import json, os, sys, time
run = sys.argv[1]
time.sleep(3)  # still saving after the runner is gone
os.makedirs(os.path.join(run, "checkpoints", "global_step3"))
state = {"step": 3, "run_id": "r", "world_size": 2, "stopped_by_signal": True,
         "sampler": {"epoch": 0, "consumed": 8, "seed": 1, "num_samples": 100}}
open(os.path.join(run, "checkpoints", "global_step3", "client_state.json"), "w").write(json.dumps(state))
open(os.path.join(run, "checkpoints", "latest"), "w").write("global_step3")
"""
"""A rank of a stopped job (`python -c THIS RUN_DIR`): the checkpoint of its stop, published 3 s later."""

PDSH_RUNNER_STOPPED = f"""
import json, os, signal, subprocess, sys, time
run, ready = sys.argv[1], sys.argv[2]

def stop(signum, frame):  # DeepSpeed's pdsh runner: pdsh kills the ranks' launchers, 1 s later it exits 1
    subprocess.Popen([sys.executable, "-c", {SAVING_A_STOPS_CHECKPOINT!r}, run], start_new_session=True)
    sys.exit(1)

signal.signal(signal.SIGTERM, stop)
time.sleep(0.5)
open(ready, "w").close()
time.sleep(120)
"""
"""Stands in for DeepSpeed's runner on several hosts under pdsh, whose ranks, elsewhere, save after it has exited."""

RANK_SAVING_ON_A_STOP = f"""
import os, signal, subprocess, sys, time
rank = os.getpid()
if os.fork() == 0:  # a data-loader worker: forked, with the rank's command line; it ends with the rank
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as zerollm's do (`data_loader_worker_init`)
    while os.getppid() == rank:
        time.sleep(0.05)
    os._exit(0)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
open(sys.argv[2], "w").close()
while not stop:
    time.sleep(0.05)
subprocess.run([sys.executable, "-c", {SAVING_A_STOPS_CHECKPOINT!r}, sys.argv[1]])
sys.exit(75)
"""
"""A rank (`python .../zerollm RUN_DIR READY`, as the launchers start it), with a forked data-loader worker: marks
READY, and on SIGTERM saves, then exits 75."""

LOCAL_RUNNER_SIGNALLED_WITH_ITS_RANK = """
import subprocess, sys, time
subprocess.Popen([sys.executable, *sys.argv[1:]])
time.sleep(120)  # a SIGTERM ends it at once: DeepSpeed's runner on this node sets no handler
"""
"""Stands in for DeepSpeed's runner of ranks on this node (`python THIS RANK_SCRIPT RUN_DIR READY`): a stop signal
ends it at once, its rank saves after."""


def test_a_stop_sent_to_every_process_of_the_job_waits_for_the_ranks_here(tmp_path):
    """SIGTERM to every process at once (`systemctl stop`, SLURM signalling a job step): DeepSpeed's runner died of it
    and the launch exited 143 at once, while its ranks were still saving (a wrapper that requeues on 75 did not)."""
    (tmp_path / "runner.py").write_text(LOCAL_RUNNER_SIGNALLED_WITH_ITS_RANK)
    (tmp_path / "zerollm").write_text(RANK_SAVING_ON_A_STOP)
    run, ready = tmp_path / "run", tmp_path / "ready"
    script = textwrap.dedent(f"""
        import sys
        from launch.launcher import Plan, run_plan
        from pathlib import Path
        command = [sys.executable, {str(tmp_path / "runner.py")!r}, {str(tmp_path / "zerollm")!r}, {str(run)!r},
                   {str(ready)!r}]
        print("code", run_plan(Plan(command, []), Path({str(run)!r})))
    """)
    launch = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(ready)
        for process in [psutil.Process(launch.pid), *psutil.Process(launch.pid).children(recursive=True)]:
            process.send_signal(signal.SIGTERM)
        out, _ = launch.communicate(timeout=120)
    finally:
        _kill_tree(launch)
    assert "zerollm launch: waiting up to 60 s for the 1 rank on this node to save a checkpoint" in out, out
    assert out.splitlines()[-1] == f"code {EXIT_PREEMPTED}"


def test_a_stop_waits_for_the_checkpoint_ranks_on_other_hosts_still_save(tmp_path):
    """DeepSpeed's pdsh runner exits 1 a second after a stop, while the ranks of the other hosts are still saving;
    the launch exited 1 rather than 75 when the save took longer."""
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    (tmp_path / "runner.py").write_text(PDSH_RUNNER_STOPPED)
    run, job = tmp_path / "run", _job(tmp_path, tmp_path / "run")
    script = textwrap.dedent(f"""
        import dataclasses, sys
        from launch.launcher import plan_launch, run_plan
        from llm.cli import build_parser, launch_options
        from pathlib import Path
        job = {job!r}
        options = launch_options(build_parser().parse_args(
            ["launch", "--hostfile", {str(tmp_path / "hosts")!r}, "--master-addr", "10.0.0.1", "--", *job]))
        plan = plan_launch(options, job, {{"HOME": {str(tmp_path)!r}}})
        plan = dataclasses.replace(plan, command=[sys.executable, {str(tmp_path / "runner.py")!r}, {str(run)!r},
                                                  {str(tmp_path / "ready")!r}], job=[])
        print("code", run_plan(plan, Path({str(run)!r})))
    """)
    launch = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and launch.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        launch.send_signal(signal.SIGTERM)
        out, _ = launch.communicate(timeout=120)
    finally:
        _kill_tree(launch)
    assert "waiting up to 60 s for the ranks of the other hosts to publish the checkpoint" in out, out
    assert "on this node" not in out, out  # its saving process is no rank of this node
    assert out.splitlines()[-1] == f"code {EXIT_PREEMPTED}"


def _supervised_by(process, monkeypatch, host=None):
    """What `watch_supervisor` says, in a queue, where `process` is the `zerollm eval --nproc 2` that started this
    rank (on `host`, if not this one)."""
    from launch.local import rank_environments
    environment = {**rank_environments(2, free_port(), "eval")[0], supervisor.PID_ENV: str(process.pid),
                   supervisor.STARTED_ENV: repr(supervisor.started_at(psutil.Process(process.pid)))}
    for name in (supervisor.PID_ENV, supervisor.HOST_ENV, supervisor.STARTED_ENV, supervisor.NAME_ENV):
        monkeypatch.setenv(name, environment[name])
    if host is not None:
        monkeypatch.setenv(supervisor.HOST_ENV, host)
    said = queue.Queue()
    supervisor.watch_supervisor(said.put, interval_s=0.05)
    return said


def test_ranks_name_the_command_that_started_them_when_it_is_gone(monkeypatch):
    """Ranks of `zerollm train --nproc 2` whose parent was killed said 'zerollm launch (pid N) ended'; it is said
    once, not at every look after."""
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    said = _supervised_by(gone, monkeypatch)
    gone.wait()
    assert said.get(timeout=30) == f"zerollm eval --nproc 2 (pid {gone.pid}) ended"
    with pytest.raises(queue.Empty):
        said.get(timeout=0.5)  # ten more looks


def test_a_rank_on_another_host_than_its_launch_does_not_look_for_the_launch_here(monkeypatch):
    """Unpinned: a rank on another host looked for its launch's pid where no such process runs, and stopped the job
    (those ranks have a launch of their own on their host)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    said = _supervised_by(gone, monkeypatch, host="node-that-is-not-this-one")
    gone.wait()
    with pytest.raises(queue.Empty):
        said.get(timeout=1.0)


def test_the_processes_of_a_launch_are_found_and_not_those_of_an_earlier_one_that_had_its_pid():
    """Unpinned: a process left by an earlier launch that had this launch's pid (another start time) was taken for
    one of this launch's, and a stop waited for it."""
    env = {**os.environ, **supervisor.supervisor_env()}
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={**env, supervisor.STARTED_ENV: "12345.0"})
    try:
        deadline = time.monotonic() + 30
        while ours.pid not in (found := [p.pid for p in supervisor.started_here()]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ours.pid in found and earlier.pid not in found, (ours.pid, earlier.pid, found)
    finally:
        for process in (ours, earlier):
            process.kill()
            process.wait()


@pytest.fixture
def rank_1_of_2(monkeypatch):
    """`check_one_run_dir` on rank 1 of a job of two whose rank 0 wrote its file into /shared/run on the host given:
    what rank 1 saw is gathered after rank 0's view."""
    def check(run_dir, first_host, collective_timeout_s):
        monkeypatch.setattr(shared_run_dir.dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(shared_run_dir.dist, "broadcast_object_list",
                            lambda sent, src: sent.__setitem__(slice(None), [shared_run_dir.PREFIX + "0a", first_host]))
        rank_0_saw = (True, first_host, "/shared/run")
        monkeypatch.setattr(shared_run_dir.dist, "all_gather_object",
                            lambda views, mine: views.__setitem__(slice(None), [rank_0_saw, mine]))
        shared_run_dir.check_one_run_dir(run_dir, 1, False, collective_timeout_s)

    return check


@pytest.mark.parametrize("other_host, collective_timeout_s, wait_s", [(True, 60.0, 30.0), (True, 1800.0, 70.0),
                                                                      (False, 60.0, 0.0)])
def test_a_rank_on_another_host_waits_for_the_run_directory_half_the_collective_timeout_at_most(
        rank_1_of_2, monkeypatch, tmp_path, other_host, collective_timeout_s, wait_s):
    """Unpinned: a rank on another host than rank 0's waited for a network file system the whole collective timeout,
    while rank 0 waited for it in a collective of that timeout."""
    waits = []
    monkeypatch.setattr(shared_run_dir, "_seen", lambda path, wait_s: waits.append(wait_s) or True)
    rank_1_of_2(tmp_path, "node-a" if other_host else socket.gethostname(), collective_timeout_s)
    assert waits == [wait_s]


def test_a_rank_given_a_relative_run_directory_is_refused_naming_its_absolute_path(rank_1_of_2, monkeypatch, tmp_path):
    """Unpinned: the refusal named a relative --out as given ('--out run'), not where it lies on that node."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match=re.escape(f"rank 1 on {socket.gethostname()} (--out {tmp_path.resolve()}/run) "
                                                  "cannot see the file rank 0 on node-a wrote into /shared/run; ")):
        rank_1_of_2(Path("run"), "node-a", 0.0)


def test_a_step_of_the_wall_clock_leaves_the_launch_alive_to_its_ranks(monkeypatch):
    """psutil's create_time() adds the boot time /proc/stat gives at the moment, which a step or slew of the wall
    clock (NTP) moves by a second: the ranks took their live launch for another process and stopped the job."""
    import psutil._pslinux

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        said = _supervised_by(alive, monkeypatch)
        booted = psutil._pslinux.boot_time()
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 1.0)  # the clock stepped a second
        with pytest.raises(queue.Empty):
            said.get(timeout=1.0)
    finally:
        alive.kill()
        alive.wait()


def test_a_launch_killed_but_not_yet_reaped_is_gone(monkeypatch):
    """A SIGKILLed launch whose parent had not reaped it yet (a zombie, as long as the parent waits on something
    else) counted as alive: its ranks trained on, to the end, instead of saving and stopping."""
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        said = _supervised_by(killed, monkeypatch)
        with pytest.raises(queue.Empty):
            said.get(timeout=0.5)  # alive
        killed.kill()  # and not waited for
        assert said.get(timeout=30) == f"zerollm eval --nproc 2 (pid {killed.pid}) ended"
        assert psutil.Process(killed.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        killed.wait()


def test_ranks_with_other_deepspeed_versions_disagree(monkeypatch):
    import importlib.metadata

    from llm.runtime import fingerprint

    mine = fingerprint.fingerprint({"train": {"lr": 1}}, {}, "digest", "tok")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "deepspeed" else real(name))
    said = fingerprint.mismatch_message([mine, fingerprint.fingerprint({"train": {"lr": 1}}, {}, "digest", "tok")])
    assert said is not None and said.startswith("ranks disagree, nothing was trained: software: ")
