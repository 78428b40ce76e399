"""Triton kernels against the torch references, under Triton's CPU interpreter (GPU-marked tests run on CUDA).

Criterion: with the float64 reference as oracle, the kernel's max error is at most 2x (forward) or
3x (backward) the error of the same-dtype torch reference, plus a small floor (relative to the
output's magnitude when that exceeds 1, so a lucky reference on a one-element tensor is no failure). Inputs are fresh
random each run (the seed is in every message); outputs are allocated NaN-filled so an element a
kernel fails to write shows up; backward is run twice and must be bitwise identical.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import random

import pytest
import torch

import kernels
from kernels import reference
from llm.config import ModelConfig
from llm.model import Transformer

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]


@pytest.fixture
def seed():
    value = random.randrange(2**31)
    torch.manual_seed(value)
    return value


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every float tensor torch.empty / empty_like allocates starts as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def _check(name, got, ref_same_dtype, oracle, factor, floor, seed):
    assert not torch.isnan(got).any(), f"{name}: NaN in output (unwritten element?) seed={seed}"
    got, ref_same_dtype, oracle = got.double(), ref_same_dtype.double(), oracle.double()
    err, ref_err = (got - oracle).abs().max().item(), (ref_same_dtype - oracle).abs().max().item()
    # the floor scales with the output's magnitude: one rounding of a value near 8 in fp16 is ~4e-3
    floor *= max(1.0, oracle.abs().max().item())
    assert err <= factor * ref_err + floor, f"{name}: error {err:.3g} vs reference {ref_err:.3g} seed={seed}"


def _compare(op_kernel, op_ref, inputs, dtype, seed):
    """Forward and backward of op_kernel vs op_ref (same dtype), both against op_ref in float64."""
    runs = {}
    for tag, op, cast in (("kernel", op_kernel, dtype), ("ref", op_ref, dtype), ("oracle", op_ref, torch.float64)):
        xs = [x.detach().to(cast).requires_grad_(x.is_floating_point()) if torch.is_tensor(x) else x for x in inputs]
        out = op(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator(device=outs[0].device).manual_seed(seed)
        grads_out = [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64).to(o.dtype) for o in outs]
        tensors = [x for x in xs if torch.is_tensor(x) and x.requires_grad]
        grads = torch.autograd.grad(outs, tensors, grads_out, retain_graph=True)
        if tag == "kernel":
            again = torch.autograd.grad(outs, tensors, grads_out)
            for g1, g2 in zip(grads, again):
                assert torch.equal(g1, g2), f"backward not deterministic, seed={seed}"
        runs[tag] = (outs, grads)
    for i, (got, ref, oracle) in enumerate(zip(*(runs[t][0] for t in ("kernel", "ref", "oracle")))):
        _check(f"output {i}", got, ref, oracle, 2.0, FLOOR[dtype], seed)
    for i, (got, ref, oracle) in enumerate(zip(*(runs[t][1] for t in ("kernel", "ref", "oracle")))):
        _check(f"grad {i}", got, ref, oracle, 3.0, FLOOR[dtype], seed)


def _triton(fn_name):
    return lambda *a: getattr(kernels, fn_name)(*a, backend="triton")


# ---- RMSNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 7, 123), (5, 512), (2, 1000), (4, 3, 64)])
def test_rms_norm(shape, dtype, seed, nan_outputs):
    x = torch.randn(shape) * 3
    w = torch.randn(shape[-1])
    _compare(lambda x, w: kernels.rms_norm(x, w, 1e-6, backend="triton"),
             lambda x, w: reference.rms_norm(x, w, 1e-6), [x, w], dtype, seed)


def test_rms_norm_non_contiguous_input(seed, nan_outputs):
    x = torch.randn(6, 40, 9).transpose(1, 2)[:, ::2]  # strided rows, last dim not contiguous
    w = torch.randn(40)
    _compare(lambda x, w: kernels.rms_norm(x, w, 1e-5, backend="triton"),
             lambda x, w: reference.rms_norm(x, w, 1e-5), [x, w], torch.float32, seed)


# ---- RoPE ------------------------------------------------------------------------------------

def _tables(max_pos, head_dim):
    cfg = ModelConfig(dim=head_dim, n_heads=1, max_seq_len=max_pos)
    from llm.model.rope import rope_tables

    return rope_tables(cfg)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim, heads, kv_heads, seq, offset", [
    (64, 4, 2, 1, 0), (96, 8, 4, 113, 0), (128, 4, 1, 17, 7), (96, 3, 3, 5, 100),
])
def test_rope(head_dim, heads, kv_heads, seq, offset, dtype, seed, nan_outputs):
    cos, sin = _tables(128, head_dim)
    q = torch.randn(2, seq, heads, head_dim).transpose(1, 2)  # the model's non-contiguous layout
    k = torch.randn(2, seq, kv_heads, head_dim).transpose(1, 2)
    _compare(lambda q, k: kernels.apply_rope(q, k, cos, sin, offset, backend="triton"),
             lambda q, k: reference.apply_rope(q, k, cos, sin, offset), [q, k], dtype, seed)


def test_rope_refuses_positions_past_the_table():
    cos, sin = _tables(8, 64)
    q = torch.randn(1, 2, 5, 64)
    with pytest.raises(ValueError, match="exceed"):
        kernels.apply_rope(q, q, cos, sin, position_offset=4, backend="triton")


# ---- SwiGLU ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 7, 123), (2, 1500)])
def test_swiglu(shape, dtype, seed, nan_outputs):
    a, b = torch.randn(shape) * 2, torch.randn(shape)
    _compare(_triton("swiglu"), reference.swiglu, [a, b], dtype, seed)


# ---- attention -------------------------------------------------------------------------------

ATTENTION_CASES = [
    # batch, heads, kv_heads, seq_q, seq_k, head_dim, causal
    (1, 2, 2, 1, 1, 64, True),
    (2, 4, 2, 113, 113, 64, True),
    (1, 2, 1, 203, 203, 96, True),
    (1, 4, 2, 3, 40, 96, True),  # q shorter than k: bottom-right causal alignment
    (1, 2, 1, 17, 113, 128, True),
    (2, 2, 2, 45, 45, 64, False),
    (1, 2, 2, 40, 3, 64, True),  # q longer than k: early rows see no key
]


@pytest.mark.parametrize("batch, heads, kv_heads, seq_q, seq_k, head_dim, causal", ATTENTION_CASES)
def test_attention(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal, seed, nan_outputs):
    q = torch.randn(batch, seq_q, heads, head_dim).transpose(1, 2)
    k = torch.randn(batch, kv_heads, seq_k, head_dim)
    v = torch.randn(batch, kv_heads, seq_k, head_dim)
    _compare(lambda q, k, v: kernels.attention(q, k, v, causal, backend="triton"),
             lambda q, k, v: _oracle_attention(q, k, v, causal), [q, k, v], torch.float32, seed)


def _oracle_attention(q, k, v, causal):
    """Reference attention that, like the kernel, gives 0 (not NaN) for a row that sees no key."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool).tril(seq_k - seq_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ v


def test_attention_matches_reference_module_when_every_row_sees_a_key(seed):
    q, k, v = torch.randn(1, 4, 9, 64), torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64)
    assert torch.allclose(kernels.attention(q, k, v, backend="triton"), reference.attention(q, k, v), atol=1e-5)


def test_rows_that_see_no_key_are_zero_not_nan(seed):
    q, k, v = torch.randn(1, 1, 6, 64, requires_grad=True), torch.randn(1, 1, 2, 64), torch.randn(1, 1, 2, 64)
    out = kernels.attention(q, k, v, causal=True, backend="triton")
    assert torch.equal(out[0, 0, :4], torch.zeros(4, 64)) and not torch.isnan(out).any()
    out.sum().backward()
    assert not torch.isnan(q.grad).any() and torch.equal(q.grad[0, 0, :4], torch.zeros(4, 64))


def test_gqa_never_materialises_repeated_kv(monkeypatch, seed):
    def refuse(*args, **kwargs):
        raise AssertionError("repeated K/V materialised")

    for name in ("repeat_interleave", "expand", "repeat"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    q = torch.randn(1, 8, 20, 64, requires_grad=True)
    k = torch.randn(1, 2, 20, 64, requires_grad=True)
    v = torch.randn(1, 2, 20, 64, requires_grad=True)
    kernels.attention(q, k, v, backend="triton").sum().backward()
    assert k.grad.shape == (1, 2, 20, 64) and v.grad.shape == (1, 2, 20, 64)


# ---- dispatch and the model --------------------------------------------------------------------

def test_dispatch_picks_triton_under_the_interpreter_and_torch_on_request():
    x, w = torch.randn(2, 8), torch.ones(8, requires_grad=True)
    assert "RMSNormFunction" in kernels.rms_norm(x, w, 1e-6).grad_fn.name()
    assert "RMSNormFunction" not in kernels.rms_norm(x, w, 1e-6, backend="torch").grad_fn.name()
    with pytest.raises(ValueError, match="backend must be"):
        kernels.rms_norm(x, w, 1e-6, backend="cuda")


def test_tiny_model_trains_the_same_with_triton_and_torch_kernels(seed):
    results = {}
    for choice in ("triton", "torch"):
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, kernels=choice)
        model = Transformer(cfg)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, 61, (2, 21), generator=gen)
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        results[choice] = (losses, {n: p.grad.clone() for n, p in model.named_parameters()})
    (triton_losses, triton_grads), (torch_losses, torch_grads) = results["triton"], results["torch"]
    assert triton_losses == pytest.approx(torch_losses, rel=1e-5, abs=1e-6), f"seed={seed}"
    for name, grad in torch_grads.items():
        assert torch.allclose(triton_grads[name], grad, rtol=1e-4, atol=1e-6), f"{name} seed={seed}"


# ---- GPU only: bf16 and large shapes -------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 4096), (2048, 16384), (8192, 768)])
def test_gpu_rms_norm_large(shape, dtype, seed):
    x, w = torch.randn(shape, device=DEVICE), torch.randn(shape[-1], device=DEVICE)
    _compare(lambda x, w: kernels.rms_norm(x, w, 1e-6, backend="triton"),
             lambda x, w: reference.rms_norm(x, w, 1e-6), [x, w], dtype, seed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, seq, head_dim", [(32, 8, 4096, 128), (8, 4, 2048, 96), (8, 2, 4096, 64)])
def test_gpu_attention_and_rope_large(heads, kv_heads, seq, head_dim, dtype, seed):
    q = torch.randn(1, heads, seq, head_dim, device=DEVICE)
    k = torch.randn(1, kv_heads, seq, head_dim, device=DEVICE)
    v = torch.randn(1, kv_heads, seq, head_dim, device=DEVICE)
    _compare(lambda q, k, v: kernels.attention(q, k, v, True, backend="triton"),
             lambda q, k, v: _oracle_attention(q, k, v, True), [q, k, v], dtype, seed)
    cos, sin = (t.to(DEVICE) for t in _tables(seq, head_dim))
    _compare(lambda q, k: kernels.apply_rope(q, k, cos, sin, 0, backend="triton"),
             lambda q, k: reference.apply_rope(q, k, cos, sin, 0), [q, k], dtype, seed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_swiglu_large(dtype, seed):
    a, b = torch.randn(8, 4096, 14336, device=DEVICE), torch.randn(8, 4096, 14336, device=DEVICE)
    _compare(_triton("swiglu"), reference.swiglu, [a, b], dtype, seed)


# ---- the benchmark tool ----------------------------------------------------------------------------

def test_bench_smoke_prints_every_op_forward_and_backward():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "kernels.bench", "--smoke"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()[3:]
    assert sorted(line.split()[0] for line in lines) == ["attention"] * 2 + ["rmsnorm"] * 2 + ["rope"] * 2 + ["swiglu"] * 2
    assert sum(" fwd " in line for line in lines) == 4 and sum(" bwd " in line for line in lines) == 4
    assert all("xeager" in line for line in lines)


@pytest.mark.skipif(ON_GPU, reason="checks the message on machines without a GPU")
def test_bench_without_gpu_says_so_and_exits_2():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.bench", "--op", "rmsnorm"], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 2 and "no CUDA device" in result.stderr
