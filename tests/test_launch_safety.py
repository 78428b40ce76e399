"""What `zerollm launch` hands to other hosts arrives exactly as typed and runs nothing else: host names, `--env`
values, DeepSpeed's env files, inherited variables DeepSpeed forwards and training arguments, through DeepSpeed's
pdsh runner (checked with a stand-in pdsh that runs the remote command under sh and bash) and its MPI runners."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from deepspeed.launcher.multinode_runner import PDSHRunner

from conftest import REPO, TINY, run_cli
from launch.environment import Export, deepspeed_env_files, parse_env, remote_exports
from launch.hostfile import active_slots, check_filter, read_hostfile
from launch.launcher import LAUNCHER_PROGRAMS, plan_launch
from launch.options import LaunchOptions
from launch.own_module import ROOT
from launch.remote_shell import pdsh_argument, pdsh_export
from llm.cli import build_parser, launch_options
from llm.command_line import is_zerollm_command
from llm.errors import UserError
from llm.runtime.rank_env import free_port
from standins import PDSH, SSH, install, pdsh_substitute

REAL_PYTHON = sys.executable
"""This environment's interpreter, beside which pip wrote the console script."""

def _launch_args(*argv):
    return launch_options(build_parser().parse_args(["launch", *argv, "--", "train"]))


def _plan(tmp_path, *argv, hosts="node-a slots=2\nnode-b slots=2\n", environ=None):
    (tmp_path / "hosts").write_text(hosts)
    return plan_launch(_launch_args("--hostfile", str(tmp_path / "hosts"), "--master-addr", "10.0.0.1", *argv),
                       ["train", "pretrain"], {"HOME": str(tmp_path), **(environ or {})})


@pytest.mark.parametrize("argv, hosts, origin", [
    (["--master-addr", "127.0.0.1"], "localhost slots=1\nnode-b slots=1\n", "--master-addr 127.0.0.1"),
    (["--master-addr", "localhost"], "localhost slots=1\nnode-b slots=1\n", "--master-addr localhost"),
    (["--master-addr", "::1"], "localhost slots=1\nnode-b slots=1\n", "--master-addr ::1"),
    (["--master-addr", "::ffff:127.0.0.1"], "localhost slots=1\nnode-b slots=1\n", "--master-addr ::ffff:127.0.0.1"),
    (["--master-addr", "127.1"], "localhost slots=1\nnode-b slots=1\n", "--master-addr 127.1"),  # 127.0.0.1
    (["--launcher", "openmpi", "--master-addr", "localhost"], "localhost slots=1\nnode-b slots=1\n",
     "--master-addr localhost"),
])
def test_a_loopback_rendezvous_for_ranks_on_other_hosts_is_refused(tmp_path, argv, hosts, origin):
    """node-b's ranks looked for the rendezvous at their own loopback, and waited there until the collective
    timeout (600 s by default, more with its retries)."""
    with pytest.raises(UserError, match=rf"^{re.escape(origin)} is a loopback address, which the ranks on node-b "
                                        "cannot reach"):
        _plan(tmp_path, *argv, hosts=hosts)


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "::ffff:0.0.0.0", "0"])
def test_an_unspecified_rendezvous_address_for_ranks_on_other_hosts_is_refused(tmp_path, address):
    """A host that connects to 0.0.0.0 (or ::) reaches itself: node-b's ranks waited for a rendezvous on their own
    host until the collective timeout."""
    with pytest.raises(UserError, match=rf"^--master-addr {re.escape(address)} is the unspecified address \(a host "
                                        r"connecting to it reaches itself\), which the ranks on node-b cannot reach"):
        _plan(tmp_path, "--master-addr", address, hosts="localhost slots=1\nnode-b slots=1\n")


def test_mpi_placing_rank_0_on_a_first_host_named_by_loopback_is_refused(tmp_path):
    """MPI's ranks meet at the first host, named as the hostfile names it: `localhost` went to every host as
    MASTER_ADDR."""
    (tmp_path / "hosts").write_text("localhost slots=1\nnode-b slots=1\n")
    with pytest.raises(UserError, match=rf"^the first host of {re.escape(str(tmp_path / 'hosts'))}, where MPI places "
                                        "rank 0 \\(the rendezvous\\), localhost is a loopback address"):
        plan_launch(_launch_args("--hostfile", str(tmp_path / "hosts"), "--launcher", "openmpi"),
                    ["train", "pretrain"], {"HOME": str(tmp_path)})


@pytest.mark.parametrize("master, hosts", [
    ("127.0.0.1", "localhost slots=1\n127.0.0.1 slots=1\n"),  # every host is this one
    ("127.0.0.1", "node-b slots=2\n"),  # every rank on node-b, rank 0 too
    (socket.gethostname(), "localhost slots=1\nnode-b slots=1\n"),  # its own name, perhaps 127.0.1.1 here alone
])
def test_a_rendezvous_address_every_rank_reaches_is_kept(tmp_path, master, hosts):
    plan = _plan(tmp_path, "--master-addr", master, hosts=hosts)
    assert plan.command[plan.command.index("--master_addr") + 1] == master


# ---- host names and hostfiles ------------------------------------------------------------------


@pytest.mark.parametrize("host", ["-Fevil", "-oProxyCommand=sh", "node[1-4]", "root@node1", "a,b", "fe80::1",
                                  "node;reboot", "node$(id)", ".hidden", "node-"])
def test_host_names_a_shell_ssh_or_pdsh_would_misread_are_refused(tmp_path, host):
    (tmp_path / "hosts").write_text(f"good slots=1\n{host} slots=2\n")
    with pytest.raises(UserError, match=r"hosts:2: .* is not a usable host name \(letters, digits"):
        read_hostfile(tmp_path / "hosts")


def test_ordinary_host_names_and_addresses_pass(tmp_path):
    (tmp_path / "hosts").write_text("gpu-01.cluster.example.org slots=8\n10.0.0.7 slots=8\nnode_3 slots=1\n")
    assert read_hostfile(tmp_path / "hosts") == {"gpu-01.cluster.example.org": 8, "10.0.0.7": 8, "node_3": 1}


@pytest.mark.parametrize("backend", [[], ["--backend", "torchrun"]])
def test_a_master_address_another_node_cannot_resolve_is_one_line_at_once(monkeypatch, backend):
    """That node waited train.collective_timeout_s (10 minutes by default) before it said so."""
    def unknown(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(UserError, match=r"^--master-addr node0\.cluster: this node cannot resolve it \(Name or service "
                                        r"not known\); give node 0's IP address"):
        plan_launch(_launch_args(*backend, "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0.cluster",
                                 "--nproc-per-node", "1"), ["train", "pretrain"], {})


@pytest.mark.parametrize("address", ["-Fevil", "1.2.3.4;reboot", "$(id)", "a b", "127.0.0.1\n", "fd00::1\n",
                                     "fe80::1%$(id)", "::g"])
def test_master_addresses_that_are_not_addresses_are_refused(tmp_path, address):
    with pytest.raises(UserError, match="is not a host name or IP address"):
        plan_launch(_launch_args("--nnodes", "2", "--node-rank", "1", f"--master-addr={address}"), ["train"], {})
    for address in ("fd00::1", "::ffff:10.0.0.1"):
        plan_launch(_launch_args("--nnodes", "2", "--node-rank", "1", "--master-addr", address), ["train"], {})


@pytest.mark.parametrize("address, host", [("10.0.0.1:29500", "10.0.0.1"), ("node0.cluster:6000", "node0.cluster")])
def test_a_master_address_with_a_port_is_told_to_give_it_with_master_port(address, host):
    """10.0.0.1:29500 passed for an IPv6 address; node 1 then said it could not resolve it."""
    port = address.rpartition(":")[2]
    said = f"--master-addr '{address}' holds a port: give the host alone (--master-addr {host}) and the port with " \
           f"--master-port {port}"
    with pytest.raises(UserError, match=f"^{re.escape(said)}$"):
        plan_launch(_launch_args("--nnodes", "2", "--node-rank", "1", f"--master-addr={address}"), ["train"], {})


def test_a_hostfile_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path):
    (tmp_path / "hosts").write_bytes(b"node1 slots=2\nn\xe9ud2 slots=2\n")
    with pytest.raises(UserError) as err:
        read_hostfile(tmp_path / "hosts")
    assert str(err.value) == (f"{tmp_path}/hosts:2: not UTF-8 text (byte 0xe9 at column 2); a hostfile is plain "
                              "text, one 'HOST slots=N' per line")
    result = run_cli("launch", "--hostfile", tmp_path / "hosts", "--", "train", "pretrain", "--recipe", "demo",
                     "--data", tmp_path, "--out", tmp_path / "run")
    assert result.returncode == 2 and result.stderr.strip() == f"zerollm: error: {err.value}"


def test_signals_go_to_the_ranks_not_the_launchers_between():
    python, script = sys.executable, "/venv/bin/zerollm"
    assert is_zerollm_command([python, "-u", "-m", "llm", "train"])
    assert is_zerollm_command([python, "-u", script, "train"])  # under DeepSpeed's MPICH helper
    assert is_zerollm_command([python, "-X", "dev", "-W", "ignore", "-m", "llm"])  # options taking the next word
    assert not is_zerollm_command([python, "-X", "-m", "llm"])  # -m is -X's value here, as Python reads it
    assert not is_zerollm_command([python, "-m", "deepspeed.launcher.runner", "--launcher", "mpich", script])
    assert not is_zerollm_command([python, "-u", "/ds/launcher_helper.py", "--launcher", "mpich", script])
    assert not is_zerollm_command([python, "-u", "-m", "deepspeed.launcher.launch", "--module", "llm"])


def test_selected_slots_are_resolved_as_deepspeed_does():
    hosts = {"a": 4, "b": 2, "c": 1}
    assert active_slots(hosts) == {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0]}
    assert active_slots(hosts, include="c@a:2,0") == {"a": [0, 2], "c": [0]}
    assert active_slots(hosts, exclude="a@b:1") == {"b": [0], "c": [0]}
    assert active_slots(hosts, exclude="b:0,1") == {"a": [0, 1, 2, 3], "c": [0]}
    assert active_slots(hosts, nproc_per_node=1) == {"a": [0], "b": [0], "c": [0]}


def test_host_names_that_differ_only_in_case_are_one_host(tmp_path):
    (tmp_path / "hosts").write_text("NODE1 slots=1\nnode2 slots=1\nnode1 slots=1\n")
    with pytest.raises(UserError) as err:
        read_hostfile(tmp_path / "hosts")
    assert str(err.value) == (f"{tmp_path}/hosts:3: host 'node1' is listed twice (first at line 1 as 'NODE1'; host "
                              "names ignore case)")


@pytest.mark.parametrize("slots, message", [
    ("99999999999999999999999", "has slots=99999999999999999999999; at most 1024 ranks run on one host"),
    ("1025", "has slots=1025; at most 1024 ranks run on one host"),
    ("٣", "expected 'HOST slots=N'"),  # an Arabic-Indic 3, which int() and \d take
    ("9" * 5000, "expected 'HOST slots=N'"),  # more digits than int() reads
])
def test_hostfile_slots_are_ascii_numbers_up_to_1024(tmp_path, slots, message):
    (tmp_path / "hosts").write_text(f"node1 slots=1024\nnode2 slots={slots}\n")
    with pytest.raises(UserError, match=rf"^{tmp_path}/hosts:2: .*{message}"):
        read_hostfile(tmp_path / "hosts")


@pytest.mark.parametrize("slot", ["²", "٣", "1_0", " 1", "-1", "2", "0" * 5000])
def test_include_and_exclude_slots_are_ascii_indices_of_the_host(slot):
    with pytest.raises(UserError) as err:
        check_filter({"node1": 2}, f"node1:0,{slot}", "--include", "hosts")
    assert str(err.value) == f"--include node1:0,{slot}: host 'node1' has slots 0-1, not '{slot}'"
    check_filter({"node1": 2}, "node1:1,0", "--exclude", "hosts")


# ---- numbers: counts and the master port ----------------------------------------------------------


@pytest.mark.parametrize("port", ["70000", "65536", "-1", "0"])
@pytest.mark.parametrize("mode", [["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"],
                                  ["--backend", "torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                   "10.0.0.1"],
                                  ["--hostfile", "{hosts}", "--master-addr", "10.0.0.1"]])
def test_master_ports_outside_1_to_65535_are_refused(tmp_path, mode, port):
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    argv = [arg.format(hosts=tmp_path / "hosts") for arg in mode]
    with pytest.raises(UserError) as err:
        plan_launch(_launch_args(*argv, "--master-port", port), ["train"], {"HOME": str(tmp_path)})
    assert str(err.value) == f"--master-port must be a TCP port, 1..65535, got {port}"
    plan_launch(_launch_args(*argv, "--master-port", "65535"), ["train"], {"HOME": str(tmp_path)})


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--nproc-per-node", "0"],
     "--nproc-per-node must be at least 1, got 0"),
    (["--hostfile", "{hosts}", "--nproc-per-node", "-3"], "--nproc-per-node must be at least 1, got -3"),
    (["--hostfile", "{hosts}", "--nproc-per-node", "1025"],
     "--nproc-per-node 1025: at most 1024 ranks run on one node"),
    (["--nnodes", "0", "--node-rank", "0", "--master-addr", "127.0.0.1"], "--nnodes must be at least 1, got 0"),
    (["--nnodes", "0"], "--nnodes must be at least 1, got 0"),  # without --node-rank it ran one local node
    (["--nnodes", "65537", "--node-rank", "1", "--master-addr", "10.0.0.1"],
     "--nnodes 65537: at most 65536 nodes run one job"),  # DeepSpeed per node: it wrote a hostfile of 65537 hosts
    (["--backend", "torchrun", "--nnodes", "99999999999999999999", "--node-rank", "1", "--master-addr", "10.0.0.1"],
     "--nnodes 99999999999999999999: at most 65536 nodes run one job"),  # torchrun waited for them for ever
    (["--backend", "torchrun", "--nnodes", "3", "--node-rank", "3", "--master-addr", "10.0.0.1"],
     "--node-rank 3 is outside 0..2 (--nnodes 3)"),
])
def test_node_and_rank_counts_must_be_at_least_1(tmp_path, argv, message):
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    with pytest.raises(UserError) as err:
        plan_launch(_launch_args(*[arg.format(hosts=tmp_path / "hosts") for arg in argv]), ["train"], {})
    assert str(err.value) == message


@pytest.mark.parametrize("argv, hosts, message", [
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "70000"], None,
     "--master-port must be a TCP port, 1..65535, got 70000"),
    (["--hostfile", "{hosts}"], "node1 slots=99999999999999999999999\n",
     "{hosts}:1: host 'node1' has slots=99999999999999999999999; at most 1024 ranks run on one host"),
    (["--hostfile", "{hosts}", "--include", "node1:²"], "node1 slots=2\n",
     "--include node1:²: host 'node1' has slots 0-1, not '²'"),
    (["--hostfile", "{hosts}", "--env", os.fsdecode(b"A=\xff")], "node1 slots=2\nnode2 slots=2\n",
     "--env A is not UTF-8 text (byte 0xff at position 1)"),
])
def test_bad_numbers_and_bytes_are_one_line_exit_2_before_anything_starts(tmp_path, argv, hosts, message):
    (tmp_path / "hosts").write_text(hosts or "")
    argv = [arg.format(hosts=tmp_path / "hosts") for arg in argv]
    result = run_cli("launch", *argv, "--", "train", "pretrain", "--recipe", "demo", "--data", tmp_path, "--out",
                     tmp_path / "run")
    assert (result.returncode, result.stderr, result.stdout) == \
        (2, f"zerollm: error: {message.format(hosts=tmp_path / 'hosts')}\n", "")


def test_up_to_65536_nodes_run_one_job():
    def plan(backend):
        return plan_launch(_launch_args("--backend", backend, "--nnodes", "65536", "--node-rank", "65535",
                                        "--master-addr", "10.0.0.1"), ["train"], {})

    assert len(plan("deepspeed").files["hostfile"].splitlines()) == 65536
    assert plan("torchrun").command[plan("torchrun").command.index("--nnodes") + 1] == "65536"


SLURM = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}
NODES = "SLURM_JOB_NUM_NODES is {value!r}; expected the number of nodes of the job step, a whole number in 1..65536"
NODE_ID = "SLURM_NODEID is {value!r}; expected this node's index among SLURM_JOB_NUM_NODES=2, a whole number in 0..1"
GPUS = "SLURM_GPUS_ON_NODE is {value!r}; expected the GPUs of this node (or give --nproc-per-node), a whole number " \
    "in 1..1024"


@pytest.mark.parametrize("variable, value, message", [
    *[("SLURM_JOB_NUM_NODES", value, NODES) for value in ("abc", "", "0", "-2", "65537", "٢", " 2", "9" * 5000)],
    *[("SLURM_NODEID", value, NODE_ID) for value in ("abc", "", "2", "-1", "1.0", "²")],
    *[("SLURM_GPUS_ON_NODE", value, GPUS) for value in ("abc", "", "0", "2(x2)", "1025", "٣")],
    ("SLURM_JOB_NUM_NODES", "3", "SLURM_JOB_NODELIST 'n[1-2]' names 2 host(s) but SLURM_JOB_NUM_NODES is 3"),
    ("SLURM_JOB_NODELIST", "n[1-3]", "SLURM_JOB_NODELIST 'n[1-3]' names 3 host(s) but SLURM_JOB_NUM_NODES is 2"),
])
def test_slurm_variables_are_checked_naming_the_variable_and_its_value(tmp_path, variable, value, message):
    """What SLURM sets is read like the options: a value that is not a count in range was a ValueError traceback
    (int('abc'), int('')), or a plan for 0 nodes, node 2 of 2, 0 or '٣' ranks, or a rendezvous at the first of
    2 hosts for 3 nodes."""
    with pytest.raises(UserError) as err:
        plan_launch(_launch_args("--backend", "slurm"), ["train"],
                    {**SLURM, "PATH": str(tmp_path), variable: value})
    assert str(err.value) == message.format(value=value)


def test_slurm_ranks_per_node_come_from_slurm_gpus_on_node_or_the_option(tmp_path):
    def nproc(*argv, **variables):
        plan = plan_launch(_launch_args("--backend", "slurm", *argv), ["train"],
                           {**SLURM, "PATH": str(tmp_path), **variables})
        return plan.command[plan.command.index("--nproc-per-node") + 1]

    assert nproc() == "1" and nproc(SLURM_GPUS_ON_NODE="8") == "8"
    assert nproc("--nproc-per-node", "2", SLURM_GPUS_ON_NODE="abc") == "2"  # the variable is not read then


def test_a_bad_slurm_variable_is_one_line_exit_2(tmp_path):
    env = {**os.environ, **SLURM, "PATH": str(Path(sys.executable).parent) + os.pathsep + str(tmp_path),
           "SLURM_NODEID": "abc"}
    result = subprocess.run([sys.executable, "-m", "llm", "launch", "--backend", "slurm", "--", "train", "pretrain",
                             "--recipe", "demo", "--data", tmp_path, "--out", tmp_path / "run"],
                            capture_output=True, text=True, env=env, timeout=300, check=False)
    assert (result.returncode, result.stderr, result.stdout) == \
        (2, f"zerollm: error: {NODE_ID.format(value='abc')}\n", "")


# ---- variables ---------------------------------------------------------------------------------


@pytest.mark.parametrize("item, message", [
    ("A=1\nB=2", r"--env A contains the control character '\\n'"),
    ("A=1\r", r"--env A contains the control character '\\r'"),
    ("A B=1", "expected NAME=VALUE, NAME made of letters"),
    ("A;id=1", "expected NAME=VALUE"),
    ("=1", "expected NAME=VALUE"),
])
def test_env_items_must_be_a_variable_name_and_one_line(item, message):
    with pytest.raises(UserError, match=message):
        parse_env([item])


def test_values_that_are_not_utf8_are_refused_naming_their_origin(tmp_path):
    """A byte that is not UTF-8 (`--env $'A=\\xff'`) reaches Python as a lone surrogate, which the env file for
    DeepSpeed cannot hold."""
    with pytest.raises(UserError, match=r"^--env A is not UTF-8 text \(byte 0xff at position 2\)$"):
        parse_env([os.fsdecode(b"A=x\xff")])
    with pytest.raises(UserError, match=r"^NCCL_X \(from your environment\) is not UTF-8 text \(byte 0xfe at "):
        _plan(tmp_path, environ={"NCCL_X": os.fsdecode(b"\xfe")})


def test_deepspeed_env_files_are_read_like_deepspeed_and_checked_line_by_line(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("# cluster settings\n\nNCCL_IB_HCA = mlx5_0 \nA=home\n")
    (cwd / ".deepspeed_env").write_text("\ufeffA=work=1\n")  # its byte order mark was 'expected NAME=VALUE'
    found = deepspeed_env_files({}, cwd, home)
    assert {name: export.value for name, export in found.items()} == {"NCCL_IB_HCA": "mlx5_0", "A": "work=1"}
    assert found["A"].origin == f"{cwd}/.deepspeed_env:1"
    (cwd / "other").write_text("B=1\nnot a variable\n")
    with pytest.raises(UserError, match=rf"^{cwd}/other:2: expected NAME=VALUE, got 'not a variable'$"):
        deepspeed_env_files({"DS_ENV_FILE": "other"}, cwd, home)
    (cwd / "other").write_bytes(b"B=\xff\n")
    with pytest.raises(UserError, match=rf"^{cwd}/other:1: not UTF-8 text$"):
        deepspeed_env_files({"DS_ENV_FILE": str(cwd / "other")}, cwd, home)
    # the comment reached every rank as part of the value: NCCL found no interface "eth0   # the fast NIC"
    (cwd / "other").write_text("NCCL_SOCKET_IFNAME=eth0   # the fast NIC\nC=a#b\n")
    with pytest.raises(UserError, match=rf"^{cwd}/other:1: a '#' after a blank is part of the value here, as "
                                        "DeepSpeed reads the file \\(it would reach NCCL_SOCKET_IFNAME on every "
                                        "host\\); put a comment on a line of its own \\(a value that holds ' #' "
                                        "goes with --env NCCL_SOCKET_IFNAME=VALUE\\)$"):
        deepspeed_env_files({"DS_ENV_FILE": "other"}, cwd, home)
    (cwd / "other").write_text("C=a#b\n")  # a '#' inside a value is the value's
    assert deepspeed_env_files({"DS_ENV_FILE": "other"}, cwd, home)["C"].value == "a#b"


def test_values_mpirun_would_receive_with_literal_quotes_are_refused_naming_their_origin(tmp_path):
    with pytest.raises(UserError, match=r"^NCCL_SOCKET_IFNAME \(from --env\): --launcher openmpi passes exported "
                                        "values through DeepSpeed, which wraps"):
        _plan(tmp_path, "--launcher", "openmpi", "--env", "NCCL_SOCKET_IFNAME=^docker0,lo")
    with pytest.raises(UserError, match=r"^PYTHONWARNINGS \(from your environment\): --launcher mpich"):
        _plan(tmp_path, "--launcher", "mpich", environ={"PYTHONWARNINGS": "ignore::UserWarning:a b"})
    plan = _plan(tmp_path, "--env", "NCCL_SOCKET_IFNAME=^docker0,lo")  # pdsh: quoted for the remote shell
    assert 'NCCL_SOCKET_IFNAME=^docker0,lo\n' in plan.files["deepspeed_env"]


def test_exported_values_with_blanks_around_them_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"^A \(from --env\): DeepSpeed's runner strips the blanks"):
        _plan(tmp_path, "--env", "A= x")


def test_deepspeeds_slurm_runner_is_refused_for_backend_slurm_which_keeps_commas(tmp_path):
    """DeepSpeed's slurm runner passes exports as `srun --export=ALL,K=V,...` (a comma in a value splits it) and
    cannot start a module; `--backend slurm` hands the environment to torchrun as it is."""
    result = run_cli("launch", "--hostfile", tmp_path / "hosts", "--launcher", "slurm", "--", "train")
    assert result.returncode == 2
    assert "DeepSpeed's slurm runner cannot start zerollm's ranks; on SLURM use `srun zerollm launch --backend " \
           "slurm`" in result.stderr
    (tmp_path / "hosts").write_text("node-a slots=1\n")
    with pytest.raises(UserError, match="^--launcher slurm: DeepSpeed's slurm runner cannot start"):
        plan_launch(LaunchOptions(hostfile=str(tmp_path / "hosts"), launcher="slurm"), ["train"], {})
    slurm = {**SLURM, "PATH": str(tmp_path)}
    plan = plan_launch(_launch_args("--backend", "slurm", "--env", "NCCL_SOCKET_IFNAME=^docker0,lo,ib0"),
                       ["train"], slurm)
    assert plan.env["NCCL_SOCKET_IFNAME"] == "^docker0,lo,ib0" and plan.files == {}


# ---- MPI launchers: what DeepSpeed's MPI runners cannot express ----------------------------------


@pytest.mark.parametrize("launcher, argv, hosts, message", [
    ("openmpi", ["--include", "node-a"], None, "DeepSpeed's MPI runners take no --include/--exclude"),
    ("impi", ["--nproc-per-node", "1"], None, "DeepSpeed's MPI runners take no --include/--exclude"),
    ("mpich", [], "node-a slots=2\nnode-b slots=1\n", "needs the same slots on every host .* node-a slots=2, "
                                                      "node-b slots=1"),
])
def test_mpi_launchers_refuse_what_their_runners_cannot_do(tmp_path, launcher, argv, hosts, message):
    with pytest.raises(UserError, match=message):
        _plan(tmp_path, "--launcher", launcher, *argv, **({"hosts": hosts} if hosts else {}))


@pytest.mark.parametrize("launcher", ["mpich", "openmpi"])
def test_an_mpi_launcher_for_a_hostfile_of_this_node_alone_is_used_not_dropped(tmp_path, launcher):
    """DeepSpeed starts the ranks of one local host itself: the --launcher asked for went unused (exit 0, without
    mpirun installed). It is used, as for one remote host, so a missing mpirun is said before anything starts."""
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    plan = plan_launch(_launch_args("--hostfile", str(tmp_path / "hosts"), "--launcher", launcher,
                                    "--master-port", str(free_port())), ["train"], {"HOME": str(tmp_path)})
    assert plan.command[plan.command.index("--launcher") + 1] == launcher and "--force_multi" in plan.command
    assert plan.programs == LAUNCHER_PROGRAMS[launcher]


def test_mpi_plans_export_the_rendezvous_and_start_the_console_script(tmp_path):
    """Every launcher starts the ranks as the console script (`python -u -m llm` ran a user's llm.py from the working
    directory); DeepSpeed's MPICH runner takes no module at all."""
    plan = _plan(tmp_path, "--launcher", "mvapich", "--master-port", "29123")
    assert plan.files["deepspeed_env"].endswith("MASTER_ADDR=10.0.0.1\nMASTER_PORT=29123\n")
    for launcher in ("mvapich", "mpich", "pdsh"):
        command = _plan(tmp_path, "--launcher", launcher).command
        assert command[-1] == str(Path(sys.executable).with_name("zerollm")) and "--module" not in command, launcher


def test_ranks_start_as_the_console_script_pip_wrote_or_as_the_module(tmp_path, monkeypatch):
    """A `zerollm` that is a user's shell wrapper (activating an environment) would be read as Python by every rank,
    and one elsewhere on PATH may be another installation's: the ranks then start as `python -m llm`, as where no
    script is installed."""
    from launch.own_module import zerollm_command

    bin_dir, elsewhere = tmp_path / "bin", tmp_path / "elsewhere"
    bin_dir.mkdir()
    elsewhere.mkdir()
    (elsewhere / "zerollm").write_text(Path(REAL_PYTHON).with_name("zerollm").read_text())
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(elsewhere))
    assert zerollm_command("-u") == [str(bin_dir / "python"), "-u", "-m", "llm"]  # none beside the interpreter
    (bin_dir / "zerollm").write_text("#!/bin/sh\n. ~/venv/bin/activate && exec zerollm \"$@\"\n")
    assert zerollm_command("-u") == [str(bin_dir / "python"), "-u", "-m", "llm"]
    (bin_dir / "zerollm").write_text(Path(REAL_PYTHON).with_name("zerollm").read_text())
    assert zerollm_command("-u") == [str(bin_dir / "python"), "-u", str(bin_dir / "zerollm")]


# ---- pdsh: the remote shell rebuilds exactly what was typed ---------------------------------------


def test_the_working_directory_must_be_a_plain_word_for_pdsh(tmp_path, monkeypatch):
    odd = tmp_path / "my runs;x"
    odd.mkdir()
    monkeypatch.chdir(odd)
    with pytest.raises(UserError, match="the working directory .* goes unquoted into the remote shell command"):
        _plan(tmp_path)


@pytest.mark.parametrize("text", ["plain", "a b", "$(id)", "`id`", "a;b", "it's", 'say "hi"', "back\\slash",
                                  "50%n", "%h %u %%", "=x", "~/x", "*", "ü 中文", "", "a\\ $(x) `y` \"z\" 'w' %n"])
@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_pdsh_words_survive_deepspeed_pdsh_and_the_shell(text, shell):
    """DeepSpeed's own treatment of an argument and of an exported value (its PDSHRunner), then pdsh's substitution,
    then the remote shell: the program sees `text` in both places."""
    runner = PDSHRunner.__new__(PDSHRunner)
    runner.args, runner.exports = SimpleNamespace(user_args=[pdsh_argument(text)]), {}
    runner.add_export("V", pdsh_export(text))
    command = f"export V={runner.exports['V']}; printf '%s|' {runner.parse_user_args()[0]} \"$V\""
    out = subprocess.run([shell, "-c", pdsh_substitute(command, "host-a", 0)], capture_output=True, check=True)
    assert out.stdout.decode() == f"{text}|{text}|"


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_an_env_files_variables_are_expanded_on_the_hosts_and_nothing_in_it_runs(shell, tmp_path):
    """DeepSpeed's env file lines reach the hosts' shells in double quotes, where `PATH=/opt/x/bin:$PATH` takes the
    host's PATH: zerollm sent `$PATH` as text, and the ranks lost the host's paths. Commands in them still never
    run."""
    texts = {"/opt/nccl/lib:$HOME": "/opt/nccl/lib:/home/zz", "${HOME}/lib": "/home/zz/lib", "50%n": "50%n",
             f"$(touch {tmp_path}/a) `touch {tmp_path}/b` $((1+1)) ${{HOME:-$(touch {tmp_path}/c)}} \"q\" \\ %h":
             f"$(touch {tmp_path}/a) `touch {tmp_path}/b` $((1+1)) /home/zz \"q\" \\ %h"}
    for text, expected in texts.items():
        runner = PDSHRunner.__new__(PDSHRunner)
        runner.exports = {}
        runner.add_export("V", pdsh_export(text, expand_variables=True))
        command = f"export V={runner.exports['V']}; printf '%s' \"$V\""
        out = subprocess.run([shell, "-c", pdsh_substitute(command, "host-a", 0)], capture_output=True, check=True,
                             env={"HOME": "/home/zz", "PATH": os.environ["PATH"]})
        assert out.stdout.decode() == expected, text
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def pdsh_dry_run(tmp_path_factory, pretrain_data):
    """`zerollm launch --hostfile` on two hosts through DeepSpeed's pdsh runner and a stand-in pdsh that runs the
    remote command under sh (host 0) and bash (host 1) with the training launcher replaced by printf: what each
    host's shell built, and the variables it exported."""
    tmp = tmp_path_factory.mktemp("pdsh-dry")
    bin_dir = install(tmp / "bin", pdsh=PDSH, ssh=SSH)
    (tmp / "home").mkdir()
    (tmp / "home" / ".deepspeed_env").write_text(f"# from the home directory\nZL_FILE = $(touch {tmp}/pwned-file) x\n"
                                                 "ZL_EXPANDED=$HOME/x\n")
    (tmp / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    job = ["train", "pretrain", "--recipe", "demo", "--data", str(pretrain_data),
           "--out", f"{tmp}/run $(touch {tmp}/pwned-subshell); touch {tmp}/pwned-semicolon `touch {tmp}/pwned-tick` "
                    "\"dq\" 'sq' \\ 50%n %h",
           "--set", f"wandb.name=x;touch {tmp}/pwned-nospace", "--set", f"wandb.project=$(touch {tmp}/pwned-x)%n"]
    env = {"ZL_SUBSHELL": f"$(touch {tmp}/pwned-env) `touch {tmp}/pwned-env2` \"q\" 'q' \\ %h %n $HOME",
           "ZL_BARE": "50%n", "ZL_NOSPACE": f"a;touch${{IFS}}{tmp}/pwned-env3"}
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp / "home"),
               "STANDIN_RECORD": str(tmp), "STANDIN_DRY": "1", "STANDIN_SHELLS": "sh bash",
               "NCCL_ZL_PROBE": f"$(touch {tmp}/pwned-forwarded)", "UCX_ZL_PROBE": f"$(touch {tmp}/pwned-ucx)"}
    result = subprocess.run([sys.executable, "-m", "llm", "launch", "--hostfile", tmp / "hosts", "--master-addr",
                             "127.0.0.1", "--master-port", str(free_port()),
                             *[a for name, value in env.items() for a in ("--env", f"{name}={value}")], "--", *job],
                            env=environ, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    hosts = []
    for rank in (0, 1):
        words = (tmp / f"argv.{rank}").read_bytes().decode().split("\0")[:-1]
        variables = dict(item.split("=", 1) for item in (tmp / f"env.{rank}").read_bytes().decode().split("\0")
                         if "=" in item)
        hosts.append((words, variables))
    return tmp, job, env, hosts


def test_pdsh_training_arguments_arrive_exactly_under_sh_and_bash(pdsh_dry_run):
    tmp, job, _, hosts = pdsh_dry_run
    for words, _ in hosts:
        script = words.index(str(Path(sys.executable).with_name("zerollm")))
        assert words[script + 1:] == job  # python -u -m deepspeed.launcher.launch ... PATH/zerollm, then the job
    assert sorted(p.name for p in tmp.glob("pwned*")) == []


def test_pdsh_env_values_arrive_exactly_and_run_nothing(pdsh_dry_run):
    tmp, _, env, hosts = pdsh_dry_run
    for _, variables in hosts:
        assert {name: variables.get(name) for name in env} == env
    assert sorted(p.name for p in tmp.glob("pwned-env*")) == []


def test_pdsh_forwarded_variables_and_env_files_arrive_exactly(pdsh_dry_run):
    """DeepSpeed forwards NCCL_* (and PYTHON*, UCX*, ...) of the launching shell in double quotes, where $(...) runs;
    zerollm re-exports them through its env file, which DeepSpeed reads last."""
    tmp, _, _, hosts = pdsh_dry_run
    for _, variables in hosts:
        assert variables["NCCL_ZL_PROBE"] == f"$(touch {tmp}/pwned-forwarded)"
        assert variables["UCX_ZL_PROBE"] == f"$(touch {tmp}/pwned-ucx)"
        assert variables["ZL_FILE"] == f"$(touch {tmp}/pwned-file) x"
        assert variables["ZL_EXPANDED"] == f"{tmp}/home/x"  # an env file's $NAME is the host's, as in DeepSpeed
    assert sorted(p.name for p in tmp.glob("pwned*")) == []


def test_remote_exports_are_deepspeeds_in_its_order(tmp_path):
    """What DeepSpeed's runner would export, each source overriding the one before: the forwarded prefixes (UCX too),
    PYTHONPATH with zerollm's folder and the working directory first (a user's llm.py there took zerollm's place on
    every host), the env files, then --env."""
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (cwd / ".deepspeed_env").write_text("HF_HOME=/data/hf\nNCCL_DEBUG=INFO\n")
    environ = {"UCX_TLS": "rc", "MV2_X": "1", "MLFLOW_X": "1", "NCCL_DEBUG": "WARN", "PYTHONPATH": "/opt/lib",
               "HOME_X": "kept here"}
    exports = remote_exports({"HF_HOME": "/cli/hf"}, environ, cwd, home)
    assert sorted(exports) == ["HF_HOME", "MLFLOW_X", "MV2_X", "NCCL_DEBUG", "PYTHONPATH", "UCX_TLS"]
    assert exports["PYTHONPATH"].value == f"{ROOT}:{cwd}:/opt/lib"
    assert exports["HF_HOME"] == Export("/cli/hf", "--env")
    assert exports["NCCL_DEBUG"] == Export("INFO", f"{cwd / '.deepspeed_env'}:2", expands=True)
    assert remote_exports({}, {}, cwd, home)["PYTHONPATH"].value == f"{ROOT}:{cwd}"
    assert remote_exports({}, {}, ROOT, home)["PYTHONPATH"].value == str(ROOT)  # run from zerollm's checkout


def test_pdsh_job_trains_with_a_hostile_run_directory(pretrain_data, tmp_path):
    """The real thing: two hosts through DeepSpeed's pdsh runner, each running DeepSpeed's per-node launcher with one
    rank, into a run directory whose name is full of shell syntax."""
    bin_dir = install(tmp_path / "bin", pdsh=PDSH, ssh=SSH)
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    run = tmp_path / f"run $(touch {tmp_path}/pwned-a);touch {tmp_path}/pwned-b `touch {tmp_path}/pwned-c` 50%n"
    probe = f"$(touch {tmp_path}/pwned-env) 'q' \"q\" %h"
    sets = [a for o in [*TINY, "train.precision=fp32", "train.max_steps=2"] for a in ("--set", o)]
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
               "STANDIN_RECORD": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "llm", "launch", "--hostfile", tmp_path / "hosts",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--env",
                             f"ZL_PROBE={probe}", "--", "train", "pretrain", "--recipe", "demo", "--data",
                             pretrain_data, "--out", run, *sets],
                            env=environ, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 rank(s)" in result.stdout
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    for rank in (0, 1):
        exported = (tmp_path / f"env.{rank}").read_bytes().decode().split("\0")
        assert f"ZL_PROBE={probe}" in exported
    assert sorted(p.name for p in tmp_path.glob("pwned*")) == []


def test_a_missing_deepspeed_config_is_one_line_before_any_host_is_reached(tmp_path):
    (tmp_path / "hosts").write_text("node1 slots=2\nnode2 slots=2\n")
    result = run_cli("launch", "--hostfile", tmp_path / "hosts", "--", "train", "pretrain", "--recipe", "demo",
                     "--data", tmp_path, "--out", tmp_path / "run", "--deepspeed", tmp_path / "ds.json", timeout=120)
    assert (result.returncode, result.stderr, result.stdout) == \
        (2, f"zerollm: error: {tmp_path / 'ds.json'}: DeepSpeed config not found (give a JSON file, or a shipped "
            "one by name: distill, dpo, grpo, pretrain, pretrain_zero3, sft)\n", "")


SSH_TO_SOME = r'''
"""ssh that reaches every host on port 2222 but those named down-*, as ssh fails on a host that refuses the
connection."""
import sys

args, port = sys.argv[1:], "22"
while args and args[0].startswith("-"):
    port = args[1] if args[0] == "-p" else port
    args = args[2:] if args[0] in ("-o", "-p", "-l") else args[1:]
if args[0].startswith("down-") or port != "2222":
    sys.exit(print(f"ssh: connect to host {args[0]} port {port}: Connection refused", file=sys.stderr) or 255)
'''


def _launch_pdsh_dry(tmp_path, data, programs: dict[str, str], hosts: str,
                     master: tuple[str, ...] = ("--master-addr", "127.0.0.1"),
                     **environ) -> subprocess.CompletedProcess:
    """`zerollm launch --hostfile` of `hosts` training on `data` with stand-ins of `programs` first on PATH (alone on
    it without an ssh), pdsh recording instead of starting the ranks."""
    bin_dir = install(tmp_path / "bin", **programs)
    (tmp_path / "hosts").write_text(hosts)
    path = f"{bin_dir}:{os.environ['PATH']}" if "ssh" in programs else str(bin_dir)
    return subprocess.run([sys.executable, "-m", "llm", "launch", "--hostfile", tmp_path / "hosts", *master,
                           "--master-port", str(free_port()), "--", "train", "pretrain", "--recipe",
                           "demo", "--data", data, "--out", tmp_path / "run"],
                          env={**os.environ, "PATH": path, "STANDIN_RECORD": str(tmp_path), "STANDIN_DRY": "1",
                               **environ}, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("programs, message", [
    ({"pdsh": PDSH, "ssh": SSH_TO_SOME},
     "--hostfile {hosts}: 2 of 3 host(s) cannot be reached over ssh without a prompt, as pdsh needs (down-1: ssh: "
     "connect to host down-1 port 2222: Connection refused; down-2: ssh: connect to host down-2 port 2222: "
     "Connection refused); check the names, or set up passwordless ssh (`ssh HOST true` must work)"),
    ({"pdsh": PDSH},
     "--hostfile {hosts}: pdsh reaches the hosts over ssh, and no ssh program is on PATH; install an ssh client, or "
     "choose another --launcher"),
])
def test_hosts_pdsh_cannot_reach_are_named_in_one_line_before_anything_starts(tmp_path, pretrain_data, programs,
                                                                              message):
    """Every host is asked (DeepSpeed's runner asks the first alone, and fails with a traceback); nothing starts."""
    result = _launch_pdsh_dry(tmp_path, pretrain_data, programs, "localhost slots=1\ndown-1 slots=1\ndown-2 slots=1\n",
                              master=(), PDSH_SSH_ARGS_APPEND="-p 2222")
    assert (result.returncode, result.stderr, result.stdout) == \
        (2, f"zerollm: error: {message.format(hosts=tmp_path / 'hosts')}\n", "")
    assert not list(tmp_path.glob("argv.*"))  # pdsh never ran


@pytest.mark.parametrize("variables, reached", [
    ({"PDSH_SSH_ARGS_APPEND": "-p 2222"}, True),
    ({"PDSH_SSH_ARGS": "-x -l%u -p 2222 %h"}, True),  # in place of pdsh's own: every host was refused
    ({"PDSH_SSH_ARGS": "-l %u %h", "PDSH_SSH_ARGS_APPEND": "-p 2222"}, True),
    ({"PDSH_SSH_ARGS_APPEND": ""}, False),
])
def test_hosts_are_asked_with_the_ssh_options_pdsh_adds(tmp_path, pretrain_data, variables, reached):
    """A port or key in PDSH_SSH_ARGS_APPEND or PDSH_SSH_ARGS reaches pdsh's ssh; the check uses it too
    (DeepSpeed's own check, now skipped, did not, and refused a job pdsh could run)."""
    result = _launch_pdsh_dry(tmp_path, pretrain_data, {"pdsh": PDSH, "ssh": SSH_TO_SOME},
                              "localhost slots=1\n127.0.0.1 slots=1\n", **variables)
    assert result.returncode == (0 if reached else 2), result.stderr[-3000:]
    assert len(list(tmp_path.glob("argv.*"))) == (2 if reached else 0)


SSH_GIVING_ADDRESSES = SSH_TO_SOME + r'''
if args[1:] == ["hostname", "-I"]:
    print(__import__("os").environ["STANDIN_ADDRESSES"])
'''
"""SSH_TO_SOME, answering `hostname -I` with STANDIN_ADDRESSES."""


def test_without_a_master_address_the_first_host_gives_its_own_with_pdshs_ssh_options(tmp_path, pretrain_data):
    """DeepSpeed's runner asked the first host with a bare ssh, which fails where the hosts need
    PDSH_SSH_ARGS_APPEND's options (a traceback); such a launch was refused, asking for --master-addr."""
    result = _launch_pdsh_dry(tmp_path, pretrain_data, {"pdsh": PDSH, "ssh": SSH_GIVING_ADDRESSES},
                              "localhost slots=1\n127.0.0.1 slots=1\n", master=(), PDSH_SSH_ARGS_APPEND="-p 2222",
                              STANDIN_ADDRESSES="127.0.0.1 fd00::2")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert "--master_addr=127.0.0.1" in (tmp_path / f"argv.{rank}").read_text().split("\0")


@pytest.mark.parametrize("addresses, problem", [
    ("", "it printed no address"),  # DeepSpeed: an IndexError traceback
    ("a;touch pwned", "it printed 'a;touch', not an IP address"),
    ("Welcome 10.0.0.1", "it printed 'Welcome', not an IP address"),  # a login banner: a host name's shape
])
def test_a_first_host_that_gives_no_usable_address_is_one_line(tmp_path, pretrain_data, addresses, problem):
    result = _launch_pdsh_dry(tmp_path, pretrain_data, {"pdsh": PDSH, "ssh": SSH_GIVING_ADDRESSES},
                              "localhost slots=1\n127.0.0.1 slots=1\n", master=(), PDSH_SSH_ARGS_APPEND="-p 2222",
                              STANDIN_ADDRESSES=addresses)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"zerollm: error: --hostfile {tmp_path / 'hosts'}: the first host, localhost, "
                                    "where rank 0 runs, cannot give its address with `hostname -I` over ssh "
                                    f"({problem}")
    assert result.stderr.endswith("; give --master-addr\n") and not list(tmp_path.glob("argv.*"))  # pdsh never ran




# ---- options that would be dropped, programs that are missing ----------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--hostfile", "{hosts}", "--backend", "torchrun"],
     "--hostfile is for --backend deepspeed; torchrun nodes meet at --master-addr: start `zerollm launch --backend "
     "torchrun --nnodes N --node-rank R --master-addr A` on every node"),
    (["--hostfile", "{hosts}", "--nnodes", "1"],
     "--nnodes without --node-rank: a --hostfile job runs on every host of {hosts} (choose them with "
     "--include/--exclude); per-node mode needs --nnodes, --node-rank and --master-addr on every node"),
    (["--hostfile", "{hosts}", "--rdzv-id", "job7"],
     "--rdzv-id names a torchrun rendezvous (--backend torchrun or slurm); DeepSpeed's launcher takes none: drop it"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--hostfile", "{hosts}", "--exclude",
      "node-b"],
     "--include/--exclude select the hosts DeepSpeed's launcher reaches from one node; in per-node mode every host "
     "of {hosts} runs: list only the nodes to use"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--hostfile", "{hosts}", "--launcher",
      "openmpi"],
     "--launcher openmpi is how DeepSpeed's launcher reaches the hosts of a --hostfile from one node; in per-node "
     "mode every node starts its own ranks: drop it"),
    (["--launcher", "mpich", "--nproc-per-node", "2"],
     "--launcher mpich is how DeepSpeed's launcher reaches the hosts of a --hostfile from one node; give a --hostfile"),
    (["--backend", "slurm", "--launcher", "openmpi", "--exclude", "node-b"],
     "--backend slurm takes the nodes from SLURM; drop --exclude/--launcher"),
])
def test_options_a_mode_would_drop_are_refused(tmp_path, argv, message):
    """They were ignored: a --hostfile launch ran DeepSpeed's pdsh launcher whatever --backend, --nnodes or --rdzv-id
    said, and per-node mode with a hostfile ran every slot of it whatever --include/--exclude or --launcher said."""
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    with pytest.raises(UserError) as err:
        plan_launch(_launch_args(*[arg.format(hosts=tmp_path / "hosts") for arg in argv]), ["train"],
                    {"HOME": str(tmp_path)})
    assert str(err.value) == message.format(hosts=tmp_path / "hosts")


def test_per_node_mode_with_a_hostfile_runs_nproc_per_node_ranks_on_each(tmp_path):
    """--nproc-per-node was dropped there: every node ran its hostfile slots (2 ranks where 1 was asked)."""
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    plan = plan_launch(_launch_args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--hostfile",
                                    str(tmp_path / "hosts"), "--nproc-per-node", "1"), ["train"], {})
    assert plan.files == {"hostfile": "node-a slots=1\nnode-b slots=1\n"}


def test_a_master_address_elsewhere_than_the_local_first_host_is_refused(tmp_path):
    """The local ranks started and failed 40 s later with C++ frames and a rendezvous error."""
    for hosts in ("localhost slots=2\n", "localhost slots=1\nnode-b slots=1\n"):
        (tmp_path / "hosts").write_text(hosts)
        with pytest.raises(UserError) as err:
            plan_launch(_launch_args("--hostfile", str(tmp_path / "hosts"), "--master-addr", "192.0.2.1"), ["train"],
                        {"HOME": str(tmp_path)})
        assert str(err.value) == (f"--master-addr 192.0.2.1 is not an address of this node, but the first host of "
                                  f"{tmp_path / 'hosts'}, localhost, is this node and hosts the rendezvous (rank 0); "
                                  "give its own address, or drop --master-addr")


@pytest.mark.parametrize("spec", ["node-b:0@node-b:1", "node-b:1@node-a@node-b:0", "node-b@node-b:1", "node-b:1,1"])
def test_a_host_named_twice_in_include_or_exclude_is_merged_as_deepspeed_merges_it(spec):
    """Only the last part naming a host counted: `--exclude node-b:0@node-b:1` kept node-b's slot 0."""
    from deepspeed.launcher.runner import parse_resource_filter  # noqa: PLC0415

    hosts = {"node-a": 2, "node-b": 2}
    slots = {host: list(range(count)) for host, count in hosts.items()}
    for option in ("include", "exclude"):
        check_filter(hosts, spec, f"--{option}", "hosts")
        assert active_slots(hosts, **{option: spec}) == parse_resource_filter(slots, **{f"{option}_str": spec})
    assert active_slots(hosts, exclude="node-b:0@node-b:1") == {"node-a": [0, 1]}


def test_open_mpi_hostfile_words_after_the_slots_are_ignored_as_deepspeed_ignores_them(tmp_path):
    (tmp_path / "hosts").write_text("node1 slots=4 max_slots=4\nnode2 slots=2  # spare\n")
    assert read_hostfile(tmp_path / "hosts") == {"node1": 4, "node2": 2}
    (tmp_path / "hosts").write_text("node1 slots=4x max_slots=4\n")
    with pytest.raises(UserError, match="hosts:1: expected 'HOST slots=N'"):
        read_hostfile(tmp_path / "hosts")


def test_a_hostfile_that_is_a_directory_is_called_one(tmp_path):
    with pytest.raises(UserError) as err:
        read_hostfile(tmp_path)
    assert str(err.value) == (f"{tmp_path}: is a directory, not a hostfile; give the file with one 'HOST slots=N' "
                              "per line")


@pytest.mark.parametrize("launcher, missing", [
    ("pdsh", "pdsh (e.g. `apt install pdsh`)"), ("openmpi", "Open MPI"), ("mpich", "MPICH"),
])
def test_a_missing_launcher_program_is_one_line_before_anything_starts(tmp_path, launcher, missing):
    """It passed the checks, then DeepSpeed's runner ended in a traceback (`launcher 'pdsh' not installed`), exit 1.
    PATH holds an ssh that reaches every host, and nothing else."""
    bin_dir = install(tmp_path / "bin", ssh="import sys\nsys.exit(0)\n")
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    result = subprocess.run([sys.executable, "-m", "llm", "launch", "--hostfile", tmp_path / "hosts", "--launcher",
                             launcher, "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--", "train",
                             "pretrain", "--recipe", "demo", "--data", tmp_path, "--out", tmp_path / "run"],
                            env={**os.environ, "PATH": str(bin_dir), "HOME": str(tmp_path)},
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    program = {"pdsh": "pdsh", "openmpi": "ompi_info and mpirun", "mpich": "mpirun"}[launcher]
    others = ", ".join(name for name in ("pdsh", "openmpi", "mvapich", "mpich", "impi") if name != launcher)
    verb = "they are" if " and " in program else "it is"
    assert (result.returncode, result.stdout, result.stderr) == (2, "", (
        f"zerollm: error: --launcher {launcher} reaches the hosts of {tmp_path / 'hosts'} with {program}, and {verb} "
        f"not on PATH; install {missing} on this node, or choose another --launcher ({others}), or start `zerollm "
        "launch --nnodes N --node-rank R --master-addr A` on every node\n"))


def test_an_abbreviated_launch_option_is_not_taken_for_another():
    """`zerollm launch --nproc 2` (the option of `zerollm train`) was taken as --nproc-per-node."""
    result = run_cli("launch", "--nproc", "2", "--", "train", "pretrain", "--recipe", "demo", "--data", "d", "--out",
                     "r")
    assert result.returncode == 2 and "unrecognized arguments: --nproc" in result.stderr
