"""Inference placement: the best device present (CUDA, then MPS, then the CPU), a dtype it computes well in,
`--device`/`--dtype` on every inference command, and a clear error for a device that is not there."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import run_cli, train_args, zerollm_here
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


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_a_missing_device_is_refused(monkeypatch, device):
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "mps_available", lambda: False)
    with pytest.raises(UserError, match=f"^--device {device}: no {device.upper()} device is available here; use "
                                        "--device cpu or auto$"):
        devices.resolve(device, "auto")


@pytest.mark.parametrize("device, dtype, message", [
    ("tpu", "auto", "--device must be one of auto, cuda, mps, cpu, got 'tpu'"),
    ("cpu", "fp8", "--dtype must be auto or one of fp32, bf16, fp16, got 'fp8'"),
])
def test_a_device_or_dtype_llm_devices_does_not_know_is_one_line(device, dtype, message):
    """resolve's callers outside the CLI (whose choices catch a wrong name first) got a KeyError for a dtype."""
    with pytest.raises(UserError) as refused:
        devices.resolve(device, dtype)
    assert str(refused.value) == message


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


def test_generate_in_bf16_on_the_cpu_and_a_missing_gpu_is_one_line(zero_runs, cli_here):
    result = cli_here("generate", "--model", zero_runs[2], "--prompt", "To be", "--max-new-tokens", 4,
                      "--device", "cpu", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr[-2000:]
    if not torch.cuda.is_available():
        result = cli_here("generate", "--model", zero_runs[2], "--prompt", "x", "--device", "cuda")
        assert result.returncode == 2 and "no CUDA device" in result.stderr and "Traceback" not in result.stderr


def test_bench_generate_runs_on_the_chosen_device_and_dtype(zero_runs, cli_here):
    result = cli_here("bench", "generate", "--model", zero_runs[2], "--prompt-tokens", 8, "--new-tokens", 4,
                      "--repeats", 1, "--device", "cpu", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cpu bfloat16" in result.stdout
    assert {"zerollm, KV cache", "zerollm, no cache", "transformers generate"} <= {
        line[2:26].strip() for line in result.stdout.splitlines() if line.startswith("  ")}


def _rank_env(monkeypatch, rank: int, world: int, local_rank: int, local_world: int) -> None:
    for name, value in dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE=local_world,
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=29999).items():
        monkeypatch.setenv(name, str(value))


def _visible_gpus(monkeypatch, distributed, count: int, uuid: str = "0a1b") -> list[int]:
    """torch.cuda as a rank that sees `count` GPUs (each with `uuid`) finds it; the indices it sets, recorded."""
    chosen = []

    def set_device(index: int) -> None:  # as torch does where there is no such GPU
        if index >= count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        chosen.append(index)

    monkeypatch.setattr(distributed, "ensure_accelerator_env", lambda: None)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(distributed.torch.cuda, "set_device", set_device)
    monkeypatch.setattr(distributed.torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=uuid))
    return chosen


@pytest.mark.parametrize("local_rank, announced", [(2, True), (3, False)])
def test_more_ranks_than_the_several_gpus_a_rank_sees_is_one_line_naming_both(monkeypatch, local_rank, announced):
    """`--nproc 4` on a two-GPU machine ended ranks 2 and 3 in a raw "CUDA error: invalid device ordinal"."""
    from llm.runtime import distributed  # noqa: PLC0415

    _rank_env(monkeypatch, local_rank, 4, local_rank, 4)
    chosen = _visible_gpus(monkeypatch, distributed, 2)
    with pytest.raises(UserError) as raised:
        distributed.setup_distributed()
    assert str(raised.value) == ("this node starts 4 ranks but has 2 visible CUDA GPU(s), one per rank (local rank 2 "
                                 "and up have none): start no more ranks per node than it has GPUs (--nproc 2; under "
                                 "zerollm launch, --nproc-per-node 2), or make more GPUs visible "
                                 "(CUDA_VISIBLE_DEVICES), or bind one to each rank (a CUDA_VISIBLE_DEVICES set per "
                                 "rank; under srun, --gpus-per-task=1 with a wrapper that exports each task's RANK and "
                                 "LOCAL_RANK: docs/gpu.md)")
    assert raised.value.announce is announced and chosen == []  # printed by one rank of the node


@pytest.mark.parametrize("local_rank, local_world, gpus, index", [
    (0, 1, 1, 0), (3, 4, 8, 3), (3, 4, 4, 3),
    (1, 4, 2, 1),  # the node's ranks 2 and 3 are refused (above); rank 1 has its GPU
    (1, 2, 1, 0), (7, 8, 1, 0),  # a GPU bound to each rank (CUDA_VISIBLE_DEVICES per rank), or ranks sharing one
])
def test_a_rank_uses_the_gpu_of_its_local_rank_or_the_one_it_sees(local_rank, local_world, gpus, index):
    from llm.runtime.distributed import cuda_device_index  # noqa: PLC0415

    assert cuda_device_index(local_rank, local_world, gpus) == index


def _ranks_claim_gpus(claims: list[tuple[str, str]], store: torch.distributed.Store | None = None) -> list[str | None]:
    """`refuse_shared_gpus` on one store (a new one, or `store`) from a thread per rank, each claiming its (host,
    gpu): what each raised."""
    from llm.runtime.distributed import refuse_shared_gpus  # noqa: PLC0415

    if store is None:
        store = torch.distributed.HashStore()
        store.set_timeout(timedelta(seconds=20))
    outcome: list[str | None] = [None] * len(claims)

    def rank(r: int) -> None:
        try:
            refuse_shared_gpus(store, r, len(claims), claims[r][1], claims[r][0])
        except UserError as exc:
            outcome[r] = f"{exc} (announce={exc.announce})"

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(claims))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    return outcome


def test_ranks_that_each_have_a_gpu_of_their_own_pass(capsys):
    claims = [(host, f"GPU-{host}{i}") for host in "ab" for i in range(3)] + [("c", "GPU-x")]
    assert _ranks_claim_gpus(claims) == [None] * 7
    assert capsys.readouterr().err == ""


def test_ranks_that_share_a_gpu_are_refused_on_every_rank_in_one_line_said_once(capsys):
    """On a one-GPU node started with --nproc 2 (or a wrapper that gave two ranks the same GPU), NCCL ended every
    rank with "Duplicate GPU detected" tracebacks, or hung."""
    claims = [("a", "GPU-1"), ("a", "GPU-2"), ("a", "GPU-3"), ("b", "GPU-4"), ("b", "GPU-5"), ("b", "GPU-4")]
    message = ("ranks 3 and 5 on b use the same CUDA GPU (GPU-4), and NCCL needs a GPU per rank: start at most as "
               "many ranks per node as it has GPUs (--nproc, or --nproc-per-node under zerollm launch), or give each "
               "rank a GPU of its own (a CUDA_VISIBLE_DEVICES set per rank; under srun, --gpus-per-task=1 with a "
               "wrapper that exports each task's RANK and LOCAL_RANK: docs/gpu.md)")
    assert _ranks_claim_gpus(claims) == [f"{message} (announce=False)"] * 6
    assert capsys.readouterr().err == f"zerollm: error: {message}\n"


def test_each_attempt_of_a_restarted_job_checks_its_own_gpus(monkeypatch, capsys):
    """torchrun with --max-restarts keeps the agent's store, its workers' rendezvous store, across restarts: the
    first attempt's counters made the second say "ranks 0 and 0 on a use the same CUDA GPU" of ranks that each have
    their own, and its verdict let a third whose ranks do share one through (to NCCL's "Duplicate GPU detected")."""
    store = torch.distributed.HashStore()
    store.set_timeout(timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    own, shared = [("a", "GPU-1"), ("a", "GPU-2")], [("a", "GPU-1"), ("a", "GPU-1")]
    refused = ("ranks 0 and 1 on a use the same CUDA GPU (GPU-1), and NCCL needs a GPU per rank: start at most as many "
               "ranks per node as it has GPUs")
    for restart, claims in ((None, own), ("1", own), ("2", shared), ("3", own)):
        if restart is None:
            monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        outcome, err = _ranks_claim_gpus(claims, store), capsys.readouterr().err
        if claims is own:
            assert (outcome, err) == ([None, None], ""), (restart, outcome, err)
        else:
            assert all(o is not None and o.startswith(refused) for o in outcome), (restart, outcome)
            assert err.startswith(f"zerollm: error: {refused}") and err.count("\n") == 1, err


def test_a_gpu_that_cannot_be_read_is_not_said_to_be_a_failure_to_meet(monkeypatch):
    """Reading the GPU's identity ran inside the rendezvous' try: a CUDA error there was reported as "the 2 ranks did
    not all meet at 127.0.0.1:29999 ... check that node 0 is reachable"."""
    import deepspeed  # noqa: PLC0415, F401 - imported before torch.cuda pretends to have a GPU

    from llm.runtime import distributed  # noqa: PLC0415

    _rank_env(monkeypatch, 1, 2, 1, 2)
    _visible_gpus(monkeypatch, distributed, 1)

    def broken(index: int):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(distributed.torch.cuda, "get_device_properties", broken)
    met = []
    monkeypatch.setattr(distributed.torch.distributed, "rendezvous", lambda *args, **kwargs: met.append(1) or iter(
        [(torch.distributed.HashStore(), 1, 2)]))
    with pytest.raises(RuntimeError, match="^CUDA error: unspecified launch failure$"):
        distributed.setup_distributed()
    assert met == []


SRUN_PROBE = ("import json, os; from llm.runtime.rank_env import rank_environment; "
              "print(json.dumps(rank_environment(dict(os.environ))))")


def test_the_srun_wrapper_of_the_gpu_guide_gives_each_task_its_rank(monkeypatch):
    """srun sets only SLURM_* variables, which zerollm does not read (a plain srun task trains alone: `srun
    --ntasks-per-node=4 --gpus-per-task=1 zerollm train` started four jobs of one rank, where the guide promised one
    job); the guide's wrapper turns them into the rank variables. Its task script, run as srun would run it for the
    second task of the second node of two."""
    from llm.runtime.rank_env import RANK_VARIABLES, rank_environment  # noqa: PLC0415

    slurm = dict(SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4",
                 SLURM_NODEID="1", SLURM_JOB_NODELIST="node-[1-2]")
    bare = {name: value for name, value in os.environ.items()
            if name not in (*RANK_VARIABLES, "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                            "MASTER_PORT")}
    alone = rank_environment({**bare, **slurm})
    assert (alone["RANK"], alone["WORLD_SIZE"], alone["LOCAL_RANK"]) == ("0", "1", "0")  # without the wrapper
    guide = (Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text(encoding="utf-8")
    srun = next((line.strip() for line in guide.splitlines() if line.strip().startswith("srun --ntasks-per-node=")),
                "no srun line")
    assert "--gpus-per-task=1 bash -c '" in srun and srun.endswith("'"), srun
    task = srun.split("bash -c '", 1)[1][:-1]
    assert " exec zerollm train " in task
    task = task.split(" exec zerollm train ")[0] + f" exec {sys.executable} -c '{SRUN_PROBE}'"
    env = {**bare, **slurm, "MASTER_ADDR": "node-1", "MASTER_PORT": "29500",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run(["bash", "-c", task], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                                             MASTER_ADDR="node-1", MASTER_PORT="29500")


@pytest.mark.parametrize("shared", [False, True])
def test_a_rank_that_sees_one_gpu_of_many_ranks_on_its_node_uses_it(monkeypatch, shared):
    """Under a CUDA_VISIBLE_DEVICES set per rank (or GPUs isolated by cgroups) every rank sees one GPU, cuda:0, while
    LOCAL_RANK goes 0..N-1: local rank 1 was refused ("this node starts 2 ranks but has 1 visible CUDA GPU(s)"), so
    such jobs could not run. It uses its GPU, named to DeepSpeed (which takes LOCAL_RANK for the GPU) as 0, unless
    its node's other rank uses the same GPU. Rank 0 is a thread here, sharing the rendezvous store."""
    import deepspeed  # noqa: PLC0415 - imported before torch.cuda pretends to have a GPU

    from llm.runtime import distributed  # noqa: PLC0415

    _rank_env(monkeypatch, 1, 2, 1, 2)
    chosen = _visible_gpus(monkeypatch, distributed, 1, uuid="0a1b")
    store = torch.distributed.HashStore()
    store.set_timeout(timedelta(seconds=20))
    monkeypatch.setattr(distributed, "_wait_for_rendezvous", lambda address, port, timeout_s: timeout_s)
    monkeypatch.setattr(distributed.torch.distributed, "rendezvous", lambda url, rank, world, timeout: iter(
        [(store, rank, world)]))
    groups = []
    monkeypatch.setattr(distributed.torch.distributed, "init_process_group",
                        lambda backend, **kwargs: groups.append((backend, kwargs["rank"], kwargs["device_id"])))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kwargs: None)
    rank0 = threading.Thread(target=_ranks_sharing_or_not, args=(store, "GPU-0a1b" if shared else "GPU-ffff"))
    rank0.start()
    try:
        if shared:
            with pytest.raises(UserError) as raised:
                distributed.setup_distributed(timeout_s=20)
            assert str(raised.value).startswith("ranks 0 and 1 on ") and " use the same CUDA GPU (GPU-0a1b)" in str(
                raised.value) and not raised.value.announce and groups == []
        else:
            info = distributed.setup_distributed(timeout_s=20)
            assert (info.rank, info.local_rank, info.device) == (1, 1, torch.device("cuda", 0))
            assert chosen == [0] and os.environ["LOCAL_RANK"] == "0"
            assert groups == [("nccl", 1, torch.device("cuda", 0))]
    finally:
        rank0.join(30)


def _ranks_sharing_or_not(store, gpu: str) -> None:
    """Rank 0 of the test above, on this host."""
    from llm.runtime.distributed import refuse_shared_gpus  # noqa: PLC0415

    with contextlib.suppress(UserError):
        refuse_shared_gpus(store, 0, 2, gpu, socket.gethostname())


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


@pytest.mark.parametrize("chosen, lacking", [("cuda", "CUDA GPU"), ("mps", "Apple MPS device")])
def test_a_deepspeed_accelerator_this_machine_lacks_is_one_line(pretrain_data, tmp_path, monkeypatch, capsys, chosen,
                                                                 lacking):
    """DS_ACCELERATOR=cuda (or mps) carried over from a GPU cluster ended in DeepSpeed's AttributeError traceback as
    its engine set the device (exit 1, or 76 on two ranks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setenv("DS_ACCELERATOR", chosen)
    assert zerollm_here(monkeypatch, *train_args(pretrain_data, tmp_path / "run", nproc=2)) == 2
    assert capsys.readouterr().err == (f"zerollm: error: DS_ACCELERATOR={chosen}, but this machine has no {lacking}; "
                                       "unset it (zerollm then trains on a CUDA GPU where there is one, else on the "
                                       "CPU), or set it to cpu\n")
    assert not (tmp_path / "run").exists()
