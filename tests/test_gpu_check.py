"""The GPU check's smoke mode: every step of the script runs on the CPU and streams its file."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_gpu_check_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run for real")
    result = subprocess.run([sys.executable, "-m", "llm.gpu_check", "--out", "unused"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 2 and "no CUDA device" in result.stderr


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
