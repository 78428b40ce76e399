"""Inference placement: the best device present (CUDA, then MPS, then the CPU), a dtype it computes well in,
`--device`/`--dtype` on every inference command, and a clear error for a device that is not there."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from llm import cli, devices
from llm.config import ModelConfig
from llm.errors import UserError
from llm.model import Transformer


@pytest.mark.parametrize("cuda, mps, expected", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_the_best_device_present_is_chosen(cuda, mps, expected):
    assert devices.best_device(cuda, mps) == expected


def test_mps_is_chosen_when_available(monkeypatch):
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "mps_available", lambda: True)
    assert devices.resolve("auto", "auto") == (torch.device("mps"), torch.float16)


@pytest.mark.parametrize("device, bf16, expected", [("cuda", True, "bf16"), ("cuda", False, "fp16"),
                                                     ("mps", False, "fp16"), ("cpu", False, "fp32")])
def test_default_dtype_per_device(device, bf16, expected):
    assert devices.default_dtype(device, bf16) == expected


def test_a_missing_device_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="no CUDA device is available here"):
        devices.resolve("cuda", "auto")


def test_the_cli_offers_exactly_the_devices_and_dtypes_llm_devices_knows():
    assert set(cli.DEVICE_CHOICES) == set(devices.DEVICES)
    assert set(cli.DTYPE_CHOICES) == {"auto", *devices.DTYPES}


def test_place_casts_parameters_and_keeps_rope_tables_in_fp32():
    model = devices.place(Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)),
                          torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32 and model.rope_sin.dtype == torch.float32


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["chat"], ["serve"], ["bench", "generate"]])
def test_every_inference_command_takes_device_and_dtype(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0 and "--device" in result.stdout and "--dtype" in result.stdout


def test_generate_in_bf16_on_the_cpu_and_a_missing_gpu_is_one_line(zero_runs):
    result = run_cli("generate", "--model", zero_runs[2], "--prompt", "To be", "--max-new-tokens", 4,
                     "--device", "cpu", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr[-2000:]
    if not torch.cuda.is_available():
        result = run_cli("generate", "--model", zero_runs[2], "--prompt", "x", "--device", "cuda")
        assert result.returncode == 2 and "no CUDA device" in result.stderr and "Traceback" not in result.stderr


def test_bench_generate_runs_on_the_chosen_device_and_dtype(zero_runs):
    result = run_cli("bench", "generate", "--model", zero_runs[2], "--prompt-tokens", 8, "--new-tokens", 4,
                     "--repeats", 1, "--device", "cpu", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cpu bfloat16" in result.stdout
    assert {"zerollm, KV cache", "zerollm, no cache", "transformers generate"} <= {
        line[2:26].strip() for line in result.stdout.splitlines() if line.startswith("  ")}


@pytest.mark.parametrize("local_rank, announced", [(1, True), (2, False)])
def test_more_ranks_than_gpus_on_a_node_is_one_line_naming_both(monkeypatch, local_rank, announced):
    """`--nproc 3` on a one-GPU machine ended ranks 1 and 2 in a raw "CUDA error: invalid device ordinal"."""
    from llm.runtime import distributed  # noqa: PLC0415

    for name, value in dict(RANK=local_rank, WORLD_SIZE=3, LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE=3,
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=29999).items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(distributed, "ensure_accelerator_env", lambda: None)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 1)
    chosen = []

    def set_device(index: int) -> None:  # as torch does where there is no such GPU
        if index >= 1:
            raise RuntimeError("CUDA error: invalid device ordinal")
        chosen.append(index)

    monkeypatch.setattr(distributed.torch.cuda, "set_device", set_device)
    with pytest.raises(UserError) as raised:
        distributed.setup_distributed()
    assert str(raised.value) == ("this node starts 3 ranks but has 1 visible CUDA GPU(s), one per rank (local rank 1 "
                                 "and up have none): start no more ranks per node than it has GPUs (--nproc 1; under "
                                 "zerollm launch, --nproc-per-node 1), or make more GPUs visible "
                                 "(CUDA_VISIBLE_DEVICES)")
    assert raised.value.announce is announced and chosen == []  # printed by one rank of the node


def test_place_never_holds_an_fp32_copy_of_a_parameter_on_the_device():
    """Moved before the cast, the device held the whole fp32 model for a moment (an imported 8B model: 32 GB where
    bf16 needs 16 GB). The meta device stands for the GPU: every tensor made there is recorded as it is made."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(t for t in (out if isinstance(out, tuple | list) else [out])
                        if isinstance(t, torch.Tensor) and t.device.type == "meta")
            return out

    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16))
    buffers = sum(b.numel() for b in model.buffers())
    with Record():
        devices.place(model, torch.device("meta"), torch.bfloat16)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert sum(t.numel() for t in made if t.dtype == torch.float32) == buffers  # the RoPE tables, nothing else
