"""Compiled Triton kernels on a CUDA device, against references computed on the same device (GPU-marked).

Triton's interpreter is a mode of the whole process (kernels.runtime). When this file is collected in a process
that interprets -- the whole suite, where tests/test_kernels.py sets TRITON_INTERPRET=1 -- its tests run in a
fresh process without it, through test_gpu_suite_in_a_compiling_process; run alone
(`pytest -m gpu tests/test_kernels_gpu.py`) they run here. Passing on a device of compute capability X, and
beating the torch path there in `python -m kernels.bench`, is what lets (op, X) into kernels.VERIFIED (see
docs/kernels.md).
"""

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import reference, runtime, torch_attention
from kernels.testing import compare, nan_filled_allocations, oracle_attention, packed_segment_ids, random_seed
from llm.config import ModelConfig
from llm.model import Transformer
from llm.model.rope import rope_tables

INTERPRETING = runtime.interpreting()
DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
compiled = pytest.mark.skipif(INTERPRETING, reason="this process interprets Triton kernels; "
                                                   "test_gpu_suite_in_a_compiling_process runs these tests")


@pytest.mark.skipif(not INTERPRETING, reason="the GPU tests run in this process")
def test_gpu_suite_in_a_compiling_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", __file__]
    result = subprocess.run(command, env=env,
                            capture_output=True, text=True, timeout=3600, check=False)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]


@pytest.fixture
def seed():
    return random_seed()


@pytest.fixture
def nan_outputs():
    with nan_filled_allocations():
        yield


def _rand(*shape):
    return torch.randn(*shape, device=DEVICE)


@compiled
def test_kernels_are_compiled_not_interpreted():
    from kernels import flash_attention, rmsnorm

    kernels.rms_norm(_rand(4, 64), _rand(64), 1e-6, backend="triton")
    assert not runtime.interpreting()
    assert type(rmsnorm._rmsnorm_fwd).__name__ == "JITFunction"
    assert type(flash_attention.attn_fwd.fn).__name__ == "JITFunction"


@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 4096), (2048, 16384), (8192, 768), (3, 1000, 512), (7, 130)])
def test_rms_norm(shape, dtype, seed, nan_outputs):
    compare(lambda x, w: kernels.rms_norm(x, w, 1e-6, backend="triton"),
            lambda x, w: reference.rms_norm(x, w, 1e-6), [_rand(*shape) * 3, _rand(shape[-1])], dtype, seed)


@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch, heads, kv_heads, seq, head_dim", [
    (1, 32, 8, 4096, 128), (4, 8, 4, 2048, 96), (4, 8, 2, 2048, 64), (2, 6, 3, 777, 48), (2, 4, 1, 513, 32),
])
def test_rope(batch, heads, kv_heads, seq, head_dim, dtype, seed, nan_outputs):
    cos, sin = (t.to(DEVICE) for t in rope_tables(ModelConfig(dim=head_dim, n_heads=1, max_seq_len=seq + 8)))
    q = _rand(batch, seq, heads, head_dim).transpose(1, 2)
    k = _rand(batch, seq, kv_heads, head_dim).transpose(1, 2)
    compare(lambda q, k: kernels.apply_rope(q, k, cos, sin, 8, backend="triton"),
            lambda q, k: reference.apply_rope(q, k, cos, sin, 8), [q, k], dtype, seed)
    positions = (torch.arange(seq, device=DEVICE) % 300).expand(batch, seq)
    compare(lambda q, k: kernels.apply_rope(q, k, cos, sin, positions=positions, backend="triton"),
            lambda q, k: reference.apply_rope(q, k, cos, sin, positions=positions), [q, k], dtype, seed)


@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu(dtype, seed, nan_outputs):
    compare(lambda a, b: kernels.swiglu(a, b, backend="triton"), reference.swiglu,
            [_rand(4, 4096, 14336), _rand(4, 4096, 14336)], dtype, seed)


ATTENTION_CASES = [
    # batch, heads, kv_heads, seq_q, seq_k, head_dim, causal
    (1, 32, 8, 4096, 4096, 128, True),
    (2, 8, 4, 2048, 2048, 96, True),
    (2, 8, 2, 4096, 4096, 64, True),
    (2, 4, 2, 1000, 1000, 48, True),
    (2, 4, 1, 777, 777, 32, False),
    (1, 8, 2, 100, 3000, 128, True),  # chunked prefill: bottom-right alignment
    (3, 8, 2, 1, 513, 64, True),  # a decode step
    (1, 4, 4, 300, 20, 64, True),  # early rows see no key
]


@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, heads, kv_heads, seq_q, seq_k, head_dim, causal", ATTENTION_CASES)
def test_attention(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal, dtype, seed, nan_outputs):
    q = _rand(batch, seq_q, heads, head_dim).transpose(1, 2)
    k, v = _rand(batch, kv_heads, seq_k, head_dim), _rand(batch, kv_heads, seq_k, head_dim)
    compare(lambda q, k, v: kernels.attention(q, k, v, causal, backend="triton"),
            lambda q, k, v: oracle_attention(q, k, v, causal), [q, k, v], dtype, seed)


@compiled
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_attention_fp32(head_dim, seed, nan_outputs):
    q, k, v = _rand(2, 4, 700, head_dim), _rand(2, 2, 700, head_dim), _rand(2, 2, 700, head_dim)
    compare(lambda q, k, v: kernels.attention(q, k, v, backend="triton"),
            lambda q, k, v: oracle_attention(q, k, v, True), [q, k, v], torch.float32, seed)


@compiled
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_atomic_dq_backward(head_dim, seed, nan_outputs):
    from kernels.flash_attention import attention

    q, k, v = _rand(2, 8, 2048, head_dim), _rand(2, 2, 2048, head_dim), _rand(2, 2, 2048, head_dim)
    compare(lambda q, k, v: attention(q, k, v, True, deterministic=False),
            lambda q, k, v: oracle_attention(q, k, v, True), [q, k, v], torch.bfloat16, seed, deterministic=False)


def _packed(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Segment ids of samples 1 to 1500 tokens long filling each row but for a short padding tail."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(batch):
        row = []
        while sum(row) < seq - 100:
            row.append(min(int(torch.randint(1, 1500, (1,), generator=gen)), seq - sum(row)))
        lengths.append(row)
    return packed_segment_ids(batch, seq, lengths, DEVICE)


@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, causal", [(8, 2, 128, True), (8, 4, 64, True), (4, 4, 96, False)])
def test_segment_attention_matches_dense_block_diagonal_sdpa(heads, kv_heads, head_dim, causal, dtype, seed,
                                                             nan_outputs):
    ids = _packed(2, 4096, seed)
    q = _rand(2, 4096, heads, head_dim).transpose(1, 2)
    k, v = _rand(2, kv_heads, 4096, head_dim), _rand(2, kv_heads, 4096, head_dim)

    def dense(q, k, v):
        return reference.attention(q, k, v, causal, segment_ids=ids)

    compare(lambda q, k, v: kernels.attention(q, k, v, causal, segment_ids=ids, backend="triton"), dense, [q, k, v],
            dtype, seed)
    compare(lambda q, k, v: kernels.attention(q, k, v, causal, segment_ids=ids, backend="torch"), dense, [q, k, v],
            dtype, seed)


@compiled
def test_flex_route_is_compiled_flex_attention_on_cuda(seed):
    ids = _packed(1, 1024, seed)
    q, k, v = _rand(1, 4, 1024, 64), _rand(1, 2, 1024, 64), _rand(1, 2, 1024, 64)
    got = torch_attention.attention(q, k, v, True, None, ids)
    assert torch_attention._compiled_flex is not None
    assert torch.allclose(got, reference.attention(q, k, v, True, segment_ids=ids), atol=2e-5)


@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autotuner_picks_tiles_of_this_devices_family(dtype, seed):
    from kernels import flash_attention

    arch = runtime.device_arch(_rand(1))
    for seq in (300, 2048):
        q = _rand(1, 8, seq, 128).to(dtype).requires_grad_()
        k, v = (_rand(1, 2, seq, 128).to(dtype).requires_grad_() for _ in range(2))
        kernels.attention(q, k, v, backend="triton").sum().backward()
        for name, kernel in (("fwd", flash_attention.attn_fwd), ("kv", flash_attention.attn_bwd_kv),
                             ("q", flash_attention.attn_bwd_q)):
            assert str(kernel.best_config) in map(str, flash_attention.tiles(name, arch, dtype, 128))


@compiled
def test_attention_with_more_than_65535_batch_times_heads(seed, nan_outputs):
    """4096 x 17 heads: batch x heads was grid axis 1, which CUDA limits to 65535 (a launch error)."""
    q, k, v = _rand(4096, 17, 16, 32), _rand(4096, 17, 16, 32), _rand(4096, 17, 16, 32)
    compare(lambda q, k, v: kernels.attention(q, k, v, backend="triton"),
            lambda q, k, v: oracle_attention(q, k, v, True), [q, k, v], torch.bfloat16, seed)


@compiled
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() >= runtime.MIN_CAPABILITY,
                    reason="a device below compute capability 8.0 (T4, V100)")
def test_triton_is_refused_below_compute_capability_8():
    """A T4 ran the attention backward into OutOfResources (64 KiB of shared memory)."""
    with pytest.raises(kernels.KernelUnavailableError, match="^kernels: the Triton kernels need compute capability "
                                                             "8.0 or newer; .* use model.kernels=torch$"):
        kernels.swiglu(_rand(8), _rand(8), backend="triton")
    assert "SwiGLUFunction" not in kernels.swiglu(_rand(8).requires_grad_(), _rand(8)).grad_fn.name()


@compiled
def test_tiny_model_trains_the_same_with_triton_and_torch_kernels(seed):
    results = {}
    for choice in ("triton", "torch"):
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=301, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256,
                          kernels=choice)
        model = Transformer(cfg).to(DEVICE)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, 301, (4, 257), generator=gen, device=DEVICE)
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        results[choice] = losses
    assert results["triton"] == pytest.approx(results["torch"], rel=1e-4), f"seed={seed}"
