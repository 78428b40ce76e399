"""Meeting users where they are: YAML's on/off stay words, a recipe that does not pin a vocabulary takes the
tokenizer's, training picks CUDA, then MPS for one rank, then the CPU, and installing needs triton only where it has
wheels (Linux); without triton the model runs on PyTorch's ops."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from forked_ranks import run_job
from packaging.markers import Marker
from packaging.requirements import Requirement

from conftest import REPO, TINY, train_args
from llm.config import build_config
from llm.runtime.accelerator import ensure_accelerator_env, training_device_type
from llm.runtime.rank_env import CHOSEN_ACCELERATOR


@pytest.mark.parametrize("text", ["wandb.mode=off", "wandb.mode=offline"])
def test_wandb_modes_are_words_in_overrides(text):
    assert build_config("demo", [text]).wandb.mode == text.split("=")[1]


def test_yaml_off_in_a_recipe_file_is_a_word(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  dim: 64\n  n_heads: 4\nwandb:\n  mode: off\ntrain:\n  max_steps: 3\n")
    cfg = build_config(str(recipe))
    assert cfg.wandb.mode == "off" and cfg.model.dim == 64


def test_wandb_off_on_the_command_line_trains(pretrain_data, tmp_path):
    result = run_job(*train_args(pretrain_data, tmp_path, "train.max_steps=1", "train.eval_every=0",
                                 extra=["--wandb", "off"]))
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_recipe_without_a_vocabulary_takes_the_tokenizers(pretrain_data, tmp_path):
    overrides = [o for o in TINY if not o.startswith("model.vocab_size")]
    sets = [a for o in [*overrides, "train.max_steps=1", "train.eval_every=0"] for a in ("--set", o)]
    result = run_job("train", "pretrain", "--recipe", "demo", "--data", pretrain_data, "--out", tmp_path, *sets)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["vocab_size"] == 512  # the session tokenizer's size


@pytest.mark.parametrize("cuda, mps, world, expected", [(True, True, 1, "cuda"), (False, True, 1, "mps"),
                                                        (False, True, 2, "cpu"), (False, False, 1, "cpu")])
def test_training_picks_cuda_then_mps_for_one_rank_then_the_cpu(cuda, mps, world, expected):
    assert training_device_type(cuda, mps, world) == expected


def _triton_requirement() -> Requirement:
    requires = [Requirement(r) for r in importlib.metadata.requires("zerollm")]
    return next(r for r in requires if r.name == "triton")


@pytest.mark.parametrize("platform, needed", [("linux", True), ("darwin", False), ("win32", False)])
def test_triton_is_required_only_on_linux(platform, needed):
    marker = _triton_requirement().marker
    assert marker is not None and marker.evaluate({"sys_platform": platform}) is needed
    assert Marker("sys_platform == 'linux'").evaluate({"sys_platform": platform}) is needed


def test_the_model_trains_a_step_without_triton_installed():
    script = ("import sys; sys.modules['triton'] = None\n"  # any `import triton` now fails as if not installed
              "import torch\nfrom llm.config import ModelConfig\nfrom llm.model import Transformer\n"
              "m = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16))\n"
              "x = torch.randint(0, 64, (2, 8))\nm(x, x).loss.backward()\n"
              "seg = torch.tensor([[1, 1, 2, 2, 2, 3, 3, 0]] * 2)\nm(x, x, segment_ids=seg).loss.backward()\n"
              "print('ok')")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_another_package_named_kernels_is_named_at_import(tmp_path):
    """Hugging Face's `kernels` (required by transformers 5.25 and later), installed ahead of zerollm's kernels/,
    is named in one line with what to do, not met later as a missing attribute: for `zerollm` and `python -m llm`
    as their error, exit 2, --help included (it was an import traceback, exit 1: they import the package before
    their own error handling exists), and as an ImportError where zerollm is imported as a library."""
    (tmp_path / "elsewhere" / "kernels").mkdir(parents=True)
    (tmp_path / "elsewhere" / "kernels" / "__init__.py").write_text("def get_kernel(name):\n    return name\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "elsewhere")}
    said = f"`import kernels` finds {tmp_path / 'elsewhere' / 'kernels'}, not zerollm's {REPO / 'kernels'}: another"
    for command in ([sys.executable, "-m", "llm", "--help"], [sys.executable, "-u", "-m", "llm", "--help"],  # a rank
                    [Path(sys.executable).parent / "zerollm", "--help"]):
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
        assert (result.returncode, result.stdout, result.stderr.count("\n")) == (2, "", 1), result.stderr
        assert result.stderr.startswith(f"zerollm: error: {said}")
        assert "pip uninstall -y kernels && pip install 'transformers<5.25'" in result.stderr
    result = subprocess.run([sys.executable, "-c", "import llm"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 1 and f"ImportError: zerollm: {said}" in result.stderr


def test_a_folder_named_kernels_in_the_working_directory_does_not_hide_zerollms(tmp_path):
    """`python -m llm` puts the working directory first on sys.path: an empty kernels/ there (a user's project)
    was 'import kernels finds nothing', advising to uninstall Hugging Face's package."""
    (tmp_path / "kernels").mkdir()
    result = subprocess.run([sys.executable, "-m", "llm", "--help"], cwd=tmp_path, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0 and result.stdout.startswith("usage: zerollm"), result.stderr


ACCELERATOR_VARIABLES = ("DS_ACCELERATOR", CHOSEN_ACCELERATOR, "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                         "OMPI_COMM_WORLD_SIZE")


def _on_a_mac(monkeypatch) -> None:
    for name in ACCELERATOR_VARIABLES:  # restored after the test
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)


def _choice_of_a_rank(monkeypatch, inherited: dict[str, str], **launcher_sets: str) -> str:
    """DS_ACCELERATOR as a rank sets it before importing DeepSpeed, given what it inherited and its launcher set."""
    environ = {**inherited, **launcher_sets}
    for name in ACCELERATOR_VARIABLES:
        if name in environ:
            monkeypatch.setenv(name, environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    ensure_accelerator_env()
    return os.environ["DS_ACCELERATOR"]


def test_every_rank_chooses_its_accelerator_for_its_own_job(monkeypatch, tmp_path):
    """On a Mac one rank trains on MPS and two train on the CPU. The process that starts a job's ranks is a job of
    one itself, and its choice (DeepSpeed's DS_ACCELERATOR) reaches the ranks: `zerollm launch` chooses for
    DeepSpeed's runner, and `train grpo`, `train distill` and `bench train` load DeepSpeed before they start local
    ranks. Each rank makes the choice again for its job's size, however the launcher announces it; a
    DS_ACCELERATOR the user set reaches every rank as it is."""
    import launch.launcher as launcher
    import launch.local as local

    _on_a_mac(monkeypatch)
    ensure_accelerator_env()
    assert os.environ["DS_ACCELERATOR"] == "mps"  # right for this process, a job of one
    started = []  # the environments of the processes started (local ranks, or DeepSpeed's runner)
    monkeypatch.setattr(local.subprocess, "Popen", lambda command, env, **options: started.append(env) or
                        SimpleNamespace(pid=0, wait=lambda: 0))
    monkeypatch.setattr(local, "wait_for_ranks", lambda ranks, advice: 0)
    assert local.relaunch_local(2, ["train", "grpo", "--nproc", "2"]) == 0
    assert [_choice_of_a_rank(monkeypatch, env) for env in started] == ["cpu", "cpu"]

    _on_a_mac(monkeypatch)  # zerollm launch, in a shell of its own
    started.clear()
    assert launcher.run_plan(launcher.Plan(["true"], []), tmp_path) == 0
    runner = started.pop()
    assert runner["DS_ACCELERATOR"] == "mps"  # DeepSpeed's runner: a process of one
    assert _choice_of_a_rank(monkeypatch, runner, RANK="1", WORLD_SIZE="2") == "cpu"  # its ranks
    mpirun_sets = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert _choice_of_a_rank(monkeypatch, runner, **mpirun_sets) == "cpu"
    assert _choice_of_a_rank(monkeypatch, runner, RANK="0", WORLD_SIZE="1") == "mps"
    # a size without a rank is a job of one, as `rank_environment` reads it
    assert _choice_of_a_rank(monkeypatch, runner, OMPI_COMM_WORLD_SIZE="2") == "mps"
    # the user's DS_ACCELERATOR, set after zerollm's choice (in the command `zerollm launch` runs), is the user's
    assert _choice_of_a_rank(monkeypatch, runner, DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1") == "cpu"

    user = {"DS_ACCELERATOR": "cpu"}
    assert _choice_of_a_rank(monkeypatch, user) == "cpu"
    assert local.relaunch_local(2, ["train", "grpo", "--nproc", "2"]) == 0
    assert [_choice_of_a_rank(monkeypatch, env, RANK="0", WORLD_SIZE="1") for env in started] == ["cpu", "cpu"]


def test_a_ds_accelerator_deepspeed_does_not_know_is_one_line(pretrain_data, tmp_path):
    """DS_ACCELERATOR=Cpu (a typo) was DeepSpeed's ValueError traceback as it was imported, in train, generate and
    eval."""
    env = {**os.environ, "DS_ACCELERATOR": "Cpu"}
    result = subprocess.run([sys.executable, "-m", "llm", *map(str, train_args(pretrain_data, tmp_path / "run"))],
                            env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and result.stderr.startswith("zerollm: error: DS_ACCELERATOR=Cpu is not one "
                                                               "DeepSpeed knows (cuda, cpu, "), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "run").exists()
    (tmp_path / "c.txt").write_text("a b c\n" * 50)
    tokenizer = subprocess.run([sys.executable, "-m", "llm", "tokenizer", "train", "--input", tmp_path / "c.txt",
                                "--vocab-size", "300", "--out", tmp_path / "tok"], env=env, capture_output=True,
                               text=True, check=False)
    assert tokenizer.returncode == 0, tokenizer.stderr  # no DeepSpeed there: the variable is not its to refuse
