"""The GPU check's smoke mode: every step of the script runs on the CPU and streams its file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from conftest import REPO
from llm import gpu_check


def test_gpu_check_smoke_runs_every_step_and_writes_its_files(tmp_path):
    out = tmp_path / "gpu"
    result = subprocess.run([sys.executable, "-m", "llm.gpu_check", "--smoke", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    for step in ("versions", "kernel tests", "kernel table", "training", "profile"):
        assert f"- {step}: ok" in summary or f"- {step}: demo/torch ok" in summary, summary
    assert "deepspeed" in (out / "versions.txt").read_text()
    assert "tokens/s" in (out / "training.txt").read_text()
    assert "aten::" in (out / "profile.txt").read_text()
    assert (out / "done.json").is_file()


def test_gpu_check_without_a_gpu_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run for real")
    result = subprocess.run([sys.executable, "-m", "llm.gpu_check", "--out", str(tmp_path / "out")], cwd=REPO,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and "no CUDA device" in result.stderr and not (tmp_path / "out").exists()


def test_the_kernel_tests_step_runs_the_compiled_gpu_tests_alone_and_lists_each_outcome(tmp_path, monkeypatch):
    """The step once collected tests/test_kernels.py too, which sets TRITON_INTERPRET=1 as it is imported: every
    compiled test of tests/test_kernels_gpu.py was skipped, and the one that reruns them in a compiling child ran out
    of the step's 96 s. Here, on the CPU, the step the GPU check builds runs for real: its tests are skipped for want
    of a device, not for an interpreting process, and -rA lists each one."""
    has_gpu = torch.cuda.is_available()
    real_run_command = gpu_check.run_command
    calls = []

    def run_command(command, log, timeout_s, env=None):
        calls.append((command, timeout_s, env or {}))
        if "pytest" in command and not has_gpu:  # on a GPU it would run the whole compiled suite
            return real_run_command(command, log, timeout_s, env)
        return "ok"

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as this process may have it (tests/test_kernels.py sets it)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "run_command", run_command)
    monkeypatch.setattr(gpu_check, "versions", lambda smoke: "versions")
    monkeypatch.setattr(gpu_check, "profile_step", lambda recipe, smoke: "profile")
    monkeypatch.setattr(gpu_check, "kernel_test_workers", lambda: 1, raising=False)  # (-n N where xdist is: a GPU)
    assert gpu_check.main(["--out", str(tmp_path), "--budget-s", "480"]) == 0
    [(command, timeout_s, env)] = [call for call in calls if "pytest" in call[0]]
    assert [arg for arg in command if arg.startswith("tests/")] == ["tests/test_kernels_gpu.py"], command
    assert "-rA" in command and "-m" in command and command[command.index("-m", 3) + 1] == "gpu", command
    assert {**os.environ, **env}["TRITON_INTERPRET"] in (None, "0"), env
    assert timeout_s >= 0.3 * 480, timeout_s  # a few hundred compiles: about a third of the budget
    assert "- kernel tests: ok" in (tmp_path / "summary.md").read_text()
    if not has_gpu:
        log = (tmp_path / "kernel_tests.txt").read_text()
        assert "SKIPPED" in log and "needs a CUDA device" in log, log[-3000:]
        assert "this process interprets" not in log, log[-3000:]


def test_the_fp16_kernel_table_gets_the_time_the_bf16_one_leaves(tmp_path, monkeypatch):
    """On an H200 the fp16 attention table had a fixed quarter of the step (24 s) and was cut off after 10 of its 16
    rows while the bf16 table's share had gone unused."""
    timeouts = {}

    def run_command(command, log, timeout_s, env=None):
        if "kernels.bench" in command:
            timeouts["fp16" if "fp16" in command else "bf16"] = timeout_s
        return "ok"  # at once: the bf16 table leaves nearly all of its time

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "run_command", run_command)
    monkeypatch.setattr(gpu_check, "versions", lambda smoke: "versions")
    monkeypatch.setattr(gpu_check, "profile_step", lambda recipe, smoke: "profile")
    monkeypatch.setattr(gpu_check, "kernel_test_workers", lambda: 1, raising=False)
    assert gpu_check.main(["--out", str(tmp_path), "--budget-s", "480"]) == 0
    table_budget = timeouts["bf16"] / gpu_check.BF16_TABLE_SHARE
    assert timeouts["fp16"] >= 0.95 * table_budget, timeouts


def test_a_command_of_the_gpu_check_runs_without_the_variables_it_unsets(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    log = tmp_path / "log.txt"
    command = [sys.executable, "-c", "import os; print('interpret:', os.environ.get('TRITON_INTERPRET'))"]
    assert gpu_check.run_command(command, log, 60, {"TRITON_INTERPRET": None}) == "ok"
    assert "interpret: None" in log.read_text()


def test_a_steps_unused_time_goes_to_the_later_steps():
    assert sum(gpu_check.SHARES.values()) == pytest.approx(1.0)
    assert gpu_check.step_budget("versions", 480, 0) == pytest.approx(480 * gpu_check.SHARES["versions"])
    after_versions = 480 - 1  # it took 1 s of its 9.6
    shares_left = 1 - gpu_check.SHARES["versions"]
    assert gpu_check.step_budget("kernel tests", 480, 1) == \
        pytest.approx(after_versions * gpu_check.SHARES["kernel tests"] / shares_left)
    assert gpu_check.step_budget("profile", 480, 470) == pytest.approx(10)  # the last step gets all that is left
    assert gpu_check.step_budget("profile", 480, 500) == 0


def test_ctrl_c_stops_the_running_steps_command_too(tmp_path):
    """The command runs in a session of its own (a timeout kills its whole group), so Ctrl-C never reached it: it
    ran on after the check had stopped."""
    log = tmp_path / "log.txt"
    script = ("import sys; from pathlib import Path; from llm.gpu_check import run_command; "
              "run_command([sys.executable, '-c', 'import os, time; print(os.getpid(), flush=True); time.sleep(300)'], "
              "Path(sys.argv[1]), 300)")
    # SIGINT as a command in a terminal has it: a suite started in the background ignores it, and so did the check
    check = subprocess.Popen([sys.executable, "-c", script, str(log)], cwd=REPO, stderr=subprocess.DEVNULL,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (log.is_file() and log.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = psutil.Process(int(log.read_text().splitlines()[1]))
    check.send_signal(signal.SIGINT)
    assert check.wait(timeout=60) != 0
    try:
        assert child.wait(timeout=10) is not None or not child.is_running()
    except psutil.TimeoutExpired:
        child.kill()
        pytest.fail("the step's command outlived the check stopped by Ctrl-C")


def test_ctrl_c_inside_popens_wait_ends_the_step_without_hanging(tmp_path):
    """A Ctrl-C that lands in Popen.wait(timeout) between its taking and its releasing of its waitpid lock leaves the
    lock held; the check's own wait() for the killed command then hung (once, on a loaded machine: the check did not
    end in 60 s)."""
    script = textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path
        from llm.gpu_check import run_command
        original = subprocess.Popen._wait
        def interrupted_holding_the_lock(self, timeout):
            subprocess.Popen._wait = original
            self._waitpid_lock.acquire()
            raise KeyboardInterrupt
        subprocess.Popen._wait = interrupted_holding_the_lock
        try:
            run_command([sys.executable, "-c", "import time; time.sleep(300)"], Path({str(tmp_path / "log.txt")!r}),
                        300)
        except KeyboardInterrupt:
            print("interrupted")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout == "interrupted\n", result.stdout + result.stderr[-2000:]


def test_a_rerun_replaces_the_earlier_results(tmp_path, monkeypatch):
    """A rerun into the same --out appended to each step's file and kept the earlier run's done.json, so a rerun cut
    short looked finished."""
    (tmp_path / "kernel_tests.txt").write_text("EARLIER RUN\n")
    (tmp_path / gpu_check.DONE_FILE).write_text("{}")
    (tmp_path / "mine.txt").write_text("a user's file\n")
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "versions", lambda smoke: "versions")
    monkeypatch.setattr(gpu_check, "run_command", lambda *args, **kwargs: "ok")

    def stopped(recipe, smoke):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check, "profile_step", stopped)
    monkeypatch.setattr(gpu_check, "kernel_test_workers", lambda: 1)
    assert gpu_check.main(["--out", str(tmp_path)]) == 130
    assert not (tmp_path / "kernel_tests.txt").exists()  # the stand-in command wrote nothing this time
    assert not (tmp_path / gpu_check.DONE_FILE).exists()
    assert (tmp_path / "mine.txt").read_text() == "a user's file\n"
    assert "- training: minimind-26m/triton ok" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize(("args", "said"), [
    (["--budget-s", "nan"], "'nan' is not a positive number of seconds"),
    (["--budget-s", "-5"], "'-5' is not a positive number of seconds"),
    (["--budget-s", "inf"], "'inf' is not a positive number of seconds"),
])
def test_a_budget_that_is_not_a_positive_time_is_refused(args, said, capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--out", str(tmp_path / "out"), "--smoke", *args])
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_a_file_as_out_is_one_line(tmp_path, capsys):
    out = tmp_path / "results"
    out.write_text("mine\n")
    assert gpu_check.main(["--out", str(out), "--smoke"]) == 2
    assert capsys.readouterr().err == f"llm.gpu_check: --out {out} is a file; give a directory for the results\n"
    assert out.read_text() == "mine\n"
