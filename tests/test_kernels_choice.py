"""model.kernels=triton where Triton cannot run (a CPU without the interpreter): a training job is refused in one
line, and a run trained with it on a GPU still generates here. Each runs in a process without TRITON_INTERPRET,
which tests/test_kernels.py sets in this one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import train_args

NO_INTERPRETER = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def zerollm(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm", *map(str, args)], capture_output=True, text=True,
                          env={**NO_INTERPRETER, "DS_ACCELERATOR": "cpu"}, timeout=600, check=False)


def test_training_with_triton_kernels_on_the_cpu_is_one_line_and_writes_nothing(pretrain_data, tmp_path):
    """It was a KernelUnavailableError traceback in the first forward pass, exit 1."""
    run = tmp_path / "run"
    result = zerollm(*train_args(pretrain_data, run, "train.max_steps=1", "model.n_heads=2", "model.kernels=triton"))
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (2, (
        "zerollm: error: model.kernels=triton needs a CUDA GPU (this job runs on cpu); use auto or torch here"))
    assert "Traceback" not in result.stderr and not run.exists()


def test_training_with_triton_kernels_at_a_head_dim_they_refuse_is_one_line_and_writes_nothing(pretrain_data,
                                                                                              tmp_path):
    """Head dim 64 / 4 heads = 16: it passed validation and job setup, then the attention kernel's ValueError ended
    step 1 (on a GPU)."""
    run = tmp_path / "run"
    result = zerollm(*train_args(pretrain_data, run, "train.max_steps=1", "model.kernels=triton"))
    assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (2, (
        "zerollm: error: model.kernels=triton: the attention kernel takes head dims 32 to 128 in steps of 16, got "
        "model.dim/model.n_heads = 64/4 = 16; use model.kernels=auto or torch"))
    assert "Traceback" not in result.stderr and not run.exists()


def _trained_with_triton(run, copy, kernels="triton"):
    """A copy of `run` as if trained with model.kernels=`kernels` (triton: on a GPU), its 4 heads of 16 (2 KV heads)
    read as 2 of 32 (1 KV head), a head dim the attention kernel takes, with the same weights."""
    shutil.copytree(run, copy)
    config = copy / "config.yaml"
    text = config.read_text()
    for old, new in (("kernels: auto", f"kernels: {kernels}"), ("n_heads: 4", "n_heads: 2"),
                     ("n_kv_heads: 2", "n_kv_heads: 1")):
        assert old in text
        text = text.replace(old, new)
    config.write_text(text)
    return copy


def test_a_run_trained_with_triton_kernels_generates_where_triton_cannot_run(zero_runs, tmp_path):
    """A run trained on a GPU with model.kernels=triton, then chatted with on a laptop: generate, chat, serve and
    eval failed with a KernelUnavailableError traceback. Here it computes what the same run does with auto."""
    runs = [_trained_with_triton(zero_runs[0], tmp_path / kernels, kernels) for kernels in ("auto", "triton")]
    outputs = [zerollm("generate", "--model", run, "--prompt", "Once upon", "--max-new-tokens", 8) for run in runs]
    assert [r.returncode for r in outputs] == [0, 0], outputs[1].stderr[-2000:]
    assert outputs[1].stdout == outputs[0].stdout


def test_a_triton_model_placed_on_the_cpu_of_a_gpu_machine_runs_pytorchs_ops():
    """`generate --device cpu` where a GPU is: the choice followed whether CUDA was there, not the model's device."""
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from llm.config import ModelConfig; from llm.devices import place; from llm.model import Transformer\n"
            "model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, kernels='triton'))\n"
            "place(model, torch.device('cpu'), torch.float32)\n"
            "print(model.cfg.kernels, tuple(model(torch.arange(8)[None]).logits.shape))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=NO_INTERPRETER,
                            timeout=300, check=False)
    assert (result.returncode, result.stdout) == (0, "auto (1, 8, 64)\n"), result.stderr[-2000:]


def test_a_teacher_trained_with_triton_kernels_teaches_where_triton_cannot_run(zero_runs, pretrain_data, tmp_path):
    """The teacher runs its ops as the distillation job does (model.kernels of this job, checked for its device)."""
    teacher = _trained_with_triton(zero_runs[0], tmp_path / "teacher")
    args = train_args(pretrain_data, tmp_path / "student", "model.dim=32", "model.n_layers=1", "train.max_steps=1",
                      "train.precision=fp32", extra=["--teacher", teacher])
    args[1] = "distill"
    result = zerollm(*args)
    assert result.returncode == 0, result.stderr[-2000:]
