"""The GPU check's smoke mode: every step of the script runs on the CPU and streams its file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO


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
