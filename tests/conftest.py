"""Shared fixtures: a small tokenizer and prepared data built once per session, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def shared(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared test data not found at {path}")
    return path


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`zerollm ARGS` in a fresh interpreter, output captured as text."""
    return subprocess.run([sys.executable, "-m", "llm", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A 512-token tokenizer trained on English and Chinese shared text."""
    out = tmp_path_factory.mktemp("tokenizer")
    result = run_cli("tokenizer", "train", "--input", shared("pretrain", "en_tinyshakespeare.txt"),
                     shared("pretrain", "fortunes_zh_song100.jsonl"), "--vocab-size", 512, "--out", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def pretrain_data(tokenizer_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    result = run_cli("data", "prepare", "--input", shared("pretrain", "en_tinyshakespeare.txt"),
                     "--tokenizer", tokenizer_dir, "--out", out, "--val-fraction", 0.05, "--workers", 2)
    assert result.returncode == 0, result.stderr
    return out
