"""Triton kernels against the torch references, in Triton's CPU interpreter (compiled kernels: test_kernels_gpu.py).

The interpreter is a mode of the whole process, fixed when Triton is first imported (kernels.runtime), so
this file sets TRITON_INTERPRET=1 before anything imports Triton. Criterion and helpers: kernels.testing.
Inputs are fresh random each run (the seed is in every message); outputs are allocated NaN-filled so an
element a kernel fails to write shows up; backward runs twice and must be bitwise identical.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported in this process

import math
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import reference, runtime, torch_attention
from kernels.hardware import peak_tflops
from kernels.testing import compare, nan_filled_allocations, oracle_attention, packed_segment_ids, random_seed
from llm.config import ModelConfig
from llm.model import Transformer
from llm.model.rope import rope_tables

if not runtime.interpreting():
    raise RuntimeError("tests/test_kernels.py: Triton was imported in compiled mode before this file set "
                       "TRITON_INTERPRET=1; run it in its own process (pytest tests/test_kernels.py)")

DTYPES = [torch.float32, torch.float16]


@pytest.fixture
def seed():
    return random_seed()


@pytest.fixture
def nan_outputs():
    with nan_filled_allocations():
        yield


def _triton(name):
    return lambda *a, **k: getattr(kernels, name)(*a, **k, backend="triton")


NAN_FILLED_THEN_META = """
import torch
from kernels.testing import nan_filled_allocations

class Unwritten(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)  # as a kernel's wrapper allocates its output

with nan_filled_allocations():
    filled = [t.isnan().all().item() for t in (torch.empty(3), Unwritten.apply(torch.ones(2)))]
    whole = torch.empty(2, dtype=torch.int64).dtype  # an integer tensor is left as it is
    with torch.device("cpu"):  # as rope_tables builds its tables: the first torch.device block of the process
        torch.zeros(1)
with torch.device("meta"):
    print(filled, whole, torch.empty(2).device)
"""


def test_nan_filled_allocations_fill_and_leave_torch_device_blocks_working_after_them():
    """torch.empty was replaced while filling: the process's first torch.device block, inside, took the replacement
    as the constructor to put on its device, and torch.empty under torch.device("meta") made CPU tensors ever after
    (tests/test_from_weights.py's meta-device tests failed after this file in one worker)."""
    result = subprocess.run([sys.executable, "-c", NAN_FILLED_THEN_META], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.stdout.split("] ") == ["[True, True", "torch.int64 meta\n"], result.stderr[-3000:]


# ---- RMSNorm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 7, 123), (5, 512), (2, 1000), (4, 3, 64)])
def test_rms_norm(shape, dtype, seed, nan_outputs):
    x = torch.randn(shape) * 3
    w = torch.randn(shape[-1])
    compare(lambda x, w: kernels.rms_norm(x, w, 1e-6, backend="triton"),
            lambda x, w: reference.rms_norm(x, w, 1e-6), [x, w], dtype, seed)


def test_rms_norm_non_contiguous_input(seed, nan_outputs):
    x = torch.randn(6, 40, 9).transpose(1, 2)[:, ::2]  # strided rows, last dim not contiguous
    w = torch.randn(40)
    compare(lambda x, w: kernels.rms_norm(x, w, 1e-5, backend="triton"),
            lambda x, w: reference.rms_norm(x, w, 1e-5), [x, w], torch.float32, seed)


def test_rms_norm_strided_weight(seed, nan_outputs):
    """The kernel read the weight as if contiguous: a weight of stride 2 gave a relative error of 1.5."""
    x, w = torch.randn(5, 64), torch.randn(128)[::2]
    compare(lambda x, w: kernels.rms_norm(x, w, 1e-6, backend="triton"),
            lambda x, w: reference.rms_norm(x, w, 1e-6), [x, w], torch.float32, seed)


@pytest.mark.parametrize("length", [128, 32])
def test_rms_norm_refuses_a_weight_of_another_length(length):
    """A longer weight was accepted (its first 64 used); a shorter one was read past its end."""
    with pytest.raises(ValueError) as refused:
        kernels.rms_norm(torch.randn(3, 64), torch.randn(length), 1e-6, backend="triton")
    assert str(refused.value) == f"rms_norm: weight ({length},) must be [64], the last dim of x (3, 64)"


def test_rms_norm_of_rows_of_width_zero_is_empty_as_on_the_torch_path():
    """The Triton path failed to reshape 0 elements into rows of width 0."""
    x, w = torch.randn(4, 0, requires_grad=True), torch.randn(0, requires_grad=True)
    y = kernels.rms_norm(x, w, 1e-6, backend="triton")
    assert y.shape == (4, 0)
    y.sum().backward()
    assert x.grad.shape == (4, 0) and w.grad.shape == (0,)


def test_rms_norm_backward_covers_more_row_blocks_than_programs(seed, nan_outputs):
    """The persistent backward strides over row blocks: 4 programs x 4 rows, 37 rows, ragged last block."""
    x, w = torch.randn(37, 24), torch.randn(24)
    compare(lambda x, w: kernels.rms_norm(x, w, 1e-6, backend="triton"),
            lambda x, w: reference.rms_norm(x, w, 1e-6), [x, w], torch.float32, seed)


# ---- RoPE ------------------------------------------------------------------------------------

def _tables(max_pos, head_dim):
    return rope_tables(ModelConfig(dim=head_dim, n_heads=1, max_seq_len=max_pos))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, heads, kv_heads, seq, offset", [
    (64, 4, 2, 1, 0), (96, 8, 4, 13, 0), (128, 4, 1, 17, 7), (48, 3, 3, 5, 100), (32, 2, 1, 9, 3),
])
def test_rope(head_dim, heads, kv_heads, seq, offset, dtype, seed, nan_outputs):
    cos, sin = _tables(128, head_dim)
    q = torch.randn(2, seq, heads, head_dim).transpose(1, 2)  # the model's non-contiguous layout
    k = torch.randn(2, seq, kv_heads, head_dim).transpose(1, 2)
    compare(lambda q, k: kernels.apply_rope(q, k, cos, sin, offset, backend="triton"),
            lambda q, k: reference.apply_rope(q, k, cos, sin, offset), [q, k], dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_positions_per_token(dtype, seed, nan_outputs):
    """Packed samples: each token's table row restarts at 0 with its sample."""
    cos, sin = _tables(64, 64)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]])
    q = torch.randn(2, 11, 4, 64).transpose(1, 2)
    k = torch.randn(2, 2, 11, 64)
    compare(lambda q, k: kernels.apply_rope(q, k, cos, sin, positions=positions, backend="triton"),
            lambda q, k: reference.apply_rope(q, k, cos, sin, positions=positions), [q, k], dtype, seed)


@pytest.mark.parametrize("with_positions", [False, True])
def test_rope_launch_puts_the_batch_on_grid_axis_0(monkeypatch, with_positions):
    """The batch was grid axis 1, which CUDA limits to 65535: a batch of 70000 failed to launch. The launch is
    recorded, not run (70000 interpreted programs would take minutes); the flat grid's decoding is tested below."""
    import kernels.rope

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            launched.append(tuple(grid))
            return lambda *args, **kwargs: None

    monkeypatch.setattr(kernels.rope, "_rope", Recorder())
    batch, seq = 70000, 20  # interpreted tiles hold 8 tokens: 3 blocks a row
    cos, sin = _tables(32, 32)
    q, k = torch.randn(batch, 1, seq, 32), torch.randn(batch, 1, seq, 32)
    positions = torch.zeros(batch, seq, dtype=torch.long) if with_positions else None
    kernels.apply_rope(q, k, cos, sin, positions=positions, backend="triton")
    assert launched == [(3 * batch,)]


@pytest.mark.parametrize("with_positions", [False, True])
def test_rope_flat_grid_maps_every_program_to_its_token_block_and_batch_row(with_positions, seed, nan_outputs):
    """Programs walk (block of tokens, batch row) from one grid axis: 5 rows of 19 tokens, 3 blocks a row (ragged)."""
    cos, sin = _tables(64, 32)
    positions = torch.randint(0, 64, (5, 19)) if with_positions else None
    q, k = torch.randn(5, 3, 19, 32), torch.randn(5, 1, 19, 32)
    offset = 0 if with_positions else 40
    compare(lambda q, k: kernels.apply_rope(q, k, cos, sin, offset, positions, backend="triton"),
            lambda q, k: reference.apply_rope(q, k, cos, sin, offset, positions), [q, k], torch.float32, seed)


def test_rope_positions_match_the_models_gather():
    cos, sin = _tables(32, 64)
    positions = torch.tensor([[0, 1, 0, 1, 2, 3]])
    q, k = torch.randn(1, 2, 6, 64), torch.randn(1, 1, 6, 64)
    gathered = reference.rotate(q, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    assert torch.allclose(kernels.apply_rope(q, k, cos, sin, positions=positions, backend="triton")[0], gathered,
                          atol=1e-6)


def test_rope_refuses_positions_past_the_table_and_positions_with_an_offset():
    cos, sin = _tables(8, 64)
    q = torch.randn(1, 2, 5, 64)
    with pytest.raises(ValueError, match="exceed"):
        kernels.apply_rope(q, q, cos, sin, position_offset=4, backend="triton")
    with pytest.raises(ValueError, match="not both"):
        kernels.apply_rope(q, q, cos, sin, position_offset=1, positions=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rope_refuses_a_negative_offset_unlike_tables_and_three_dim_heads(backend):
    """A negative offset made the kernel read before the table (values of 1e34) and the torch path rotate by the
    table's last rows; a sin table of another length was broadcast; [b, s, d] heads were an internal TypeError."""
    cos, sin = _tables(300, 64)
    q = torch.randn(1, 2, 4, 64)
    cases = [((q, q, cos, sin, -5), "apply_rope: position_offset must be >= 0, got -5"),
             ((q, q, cos, sin[:4]), "apply_rope: q (1, 2, 4, 64), k (1, 2, 4, 64) and tables (300, 32), (4, 32) "
                                     "disagree"),
             ((q[0], q[0], cos, sin), "apply_rope: q and k must be [batch, heads, seq, head_dim], got (2, 4, 64) "
                                      "and (2, 4, 64)")]
    for args, message in cases:
        with pytest.raises(ValueError) as refused:
            kernels.apply_rope(*args, backend=backend)
        assert str(refused.value) == message


# ---- SwiGLU ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 7, 123), (2, 1500)])
def test_swiglu(shape, dtype, seed, nan_outputs):
    a, b = torch.randn(shape) * 2, torch.randn(shape)
    compare(_triton("swiglu"), reference.swiglu, [a, b], dtype, seed)


# ---- attention -------------------------------------------------------------------------------
# Interpreter tiles are 32x16 (forward, dQ) and 16x32 (dK/dV), so these lengths span unmasked blocks, the
# diagonal and ragged ends.

ATTENTION_CASES = [
    # batch, heads, kv_heads, seq_q, seq_k, head_dim, causal
    (1, 2, 2, 1, 1, 64, True),
    (1, 4, 2, 50, 50, 64, True),  # GQA
    (1, 2, 1, 67, 67, 96, True),  # odd length, padded head dim
    (1, 4, 2, 3, 40, 48, True),  # q shorter than k: bottom-right causal alignment
    (1, 2, 1, 17, 70, 128, True),
    (1, 2, 1, 45, 45, 32, False),
    (1, 2, 2, 40, 3, 64, True),  # q longer than k: early rows see no key
]


@pytest.mark.parametrize("batch, heads, kv_heads, seq_q, seq_k, head_dim, causal", ATTENTION_CASES)
def test_attention(batch, heads, kv_heads, seq_q, seq_k, head_dim, causal, seed, nan_outputs):
    q = torch.randn(batch, seq_q, heads, head_dim).transpose(1, 2)
    k = torch.randn(batch, kv_heads, seq_k, head_dim)
    v = torch.randn(batch, kv_heads, seq_k, head_dim)
    compare(lambda q, k, v: kernels.attention(q, k, v, causal, backend="triton"),
            lambda q, k, v: oracle_attention(q, k, v, causal), [q, k, v], torch.float32, seed)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_backward_with_atomic_dq_matches(causal, seed, nan_outputs):
    """deterministic=False: dQ accumulated by the dK/dV kernel (5 matmuls per block pair)."""
    from kernels.flash_attention import attention

    q, k, v = torch.randn(1, 4, 37, 64), torch.randn(1, 2, 37, 64), torch.randn(1, 2, 37, 64)
    compare(lambda q, k, v: attention(q, k, v, causal, deterministic=False),
            lambda q, k, v: oracle_attention(q, k, v, causal), [q, k, v], torch.float32, seed, deterministic=False)


def test_attention_backward_with_atomic_dq_is_finite_where_every_logit_is_far_below_zero():
    """A partial last key block is unmasked in the middle query blocks: its rows past seq_k, zero keys, got
    p = exp2(0 - lse), infinite where a row's logits all lie below about -88, and 0 * inf put NaN into dQ."""
    from kernels.flash_attention import attention

    q = (torch.randn(1, 1, 20, 64) * 0.1 + 5).requires_grad_()  # every logit about -1600 (softmax is the same)
    k = (torch.randn(1, 1, 37, 64) * 0.1 - 5).requires_grad_()
    v = torch.randn(1, 1, 37, 64).requires_grad_()
    attention(q, k, v, causal=False, deterministic=False).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    oracle_attention(*exact, False).sum().backward()
    for t, oracle in zip((q, k, v), exact, strict=True):
        assert torch.allclose(t.grad.double(), oracle.grad, atol=1e-4), (t.grad - oracle.grad).abs().max()


def test_attention_matches_reference_module_when_every_row_sees_a_key(seed):
    q, k, v = torch.randn(1, 4, 9, 64), torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64)
    assert torch.allclose(kernels.attention(q, k, v, backend="triton"), reference.attention(q, k, v), atol=1e-5)


def test_rows_that_see_no_key_are_zero_not_nan(seed):
    q, k, v = torch.randn(1, 1, 6, 64, requires_grad=True), torch.randn(1, 1, 2, 64), torch.randn(1, 1, 2, 64)
    out = kernels.attention(q, k, v, causal=True, backend="triton")
    assert torch.equal(out[0, 0, :4], torch.zeros(4, 64)) and not torch.isnan(out).any()
    out.sum().backward()
    assert not torch.isnan(q.grad).any() and torch.equal(q.grad[0, 0, :4], torch.zeros(4, 64))


def test_attention_grid_puts_batch_times_heads_on_axis_0():
    """Batch x heads was grid axis 1, which CUDA limits to 65535: 4096 x 32 heads failed to launch."""
    from kernels.flash_attention import grid

    for block in ("BLOCK_M", "BLOCK_N"):
        assert grid(4096, block, 4096 * 32)({block: 128}) == (32 * 4096 * 32,)
    assert grid(1000, "BLOCK_M", 3)({"BLOCK_M": 64}) == (16 * 3,)  # ragged: 16 blocks per head


@pytest.mark.parametrize("segments", [False, True])
def test_attention_flat_grid_maps_every_program_to_its_block_and_head(segments, seed, nan_outputs):
    """Programs walk (query or key block, batch x head) from one grid axis: 2 x 2 heads (GQA), 2-3 blocks a head."""
    ids = packed_segment_ids(2, 40, [[25, 15], [7, 20]]) if segments else None
    q, k, v = torch.randn(2, 2, 40, 32), torch.randn(2, 1, 40, 32), torch.randn(2, 1, 40, 32)
    compare(lambda q, k, v: kernels.attention(q, k, v, segment_ids=ids, backend="triton"),
            lambda q, k, v: oracle_attention(q, k, v, True, ids), [q, k, v], torch.float32, seed)


def test_auto_sends_head_dims_the_kernel_refuses_to_torch(monkeypatch):
    """auto where Triton is chosen (a verified device) and head dim 40: the torch path, not the kernel's ValueError."""
    q = torch.randn(1, 2, 9, 40)
    monkeypatch.setattr(kernels, "choose_backend", lambda op, t, backend, *others: "triton")
    assert torch.equal(kernels.attention(q, q, q, backend="auto"), kernels.attention(q, q, q, backend="torch"))
    with pytest.raises(ValueError, match="^attention: the Triton kernel takes head dims 32 to 128 in steps of 16, "
                                         "got 40$"):
        kernels.attention(q, q, q, backend="triton")


def _laid_past_32_bit_offsets(seq: int, head_dim: int) -> torch.Tensor:
    """q `[1, 1, seq, head_dim]` as the model lays it out (a transposed `[b, s, h, d]`), with so many heads that
    position p sits p * 2^28 elements in: past 2^31 from position 8 (meta: nothing is allocated)."""
    return torch.empty(1, seq, 2**28 // head_dim, head_dim, device="meta").transpose(1, 2)[:, :1]


def test_offsets_past_32_bits_are_refused_by_the_kernels_and_left_to_torch_by_auto(monkeypatch):
    """The kernels computed a position's offset in 32-bit integers: past 2^31 elements (512k positions of 32 heads of
    128) RoPE and attention read and wrote other memory, silently (auto runs RoPE's kernel on sm_90)."""
    from kernels import flash_attention, rope

    assert runtime.rows_addressable(_laid_past_32_bit_offsets(8, 32))
    q = _laid_past_32_bit_offsets(9, 32)
    assert not runtime.rows_addressable(q)
    contiguous = torch.empty(1, 64, 300_000, 128, device="meta")  # RoPE steps its heads in 32 bits, attention not
    assert runtime.rows_addressable(contiguous) and not runtime.rows_addressable(contiguous, dims=3)
    table = torch.empty(16, 16, device="meta")
    for call, op in ((lambda: rope.apply_rope(q, q, table, table), "apply_rope"),
                     (lambda: flash_attention.attention(q, q, q), "attention")):
        with pytest.raises(ValueError, match=f"^{op}: the Triton kernel addresses a head's positions in 32-bit "
                                             "offsets, which .* pass; use model.kernels=torch \\(or auto\\)"):
            call()
    monkeypatch.setattr(kernels, "choose_backend", lambda op, t, backend, *others: "triton")  # a verified device
    assert kernels.apply_rope(q, q, table, table, backend="auto")[0].shape == q.shape
    assert kernels.attention(q, q, q, backend="auto").shape == q.shape


def test_attention_checks_its_output_s_offsets_too():
    """The output is laid out [batch, seq, heads, dim] whatever q's layout: a contiguous [batch, heads, seq, dim] q of
    600k positions of 32 heads of 128 passed the check while the output's offsets reached 2.46e9 and wrapped (the
    kernel would have written other memory); auto sends it to torch."""
    from kernels import flash_attention

    q = torch.empty(1, 32, 600_000, 128, device="meta")
    kv = torch.empty(1, 8, 600_000, 128, device="meta")
    assert runtime.rows_addressable(q, kv, kv) and not flash_attention.addressable(q, kv, kv)
    with pytest.raises(ValueError, match="^attention: the Triton kernel addresses a head's positions in 32-bit"):
        flash_attention.attention(q, kv, kv)


@pytest.mark.parametrize("op, call", [
    ("rms_norm", lambda x: kernels.rms_norm(x, torch.ones(8, dtype=x.dtype), 1e-6, backend="triton")),
    ("apply_rope", lambda x: kernels.apply_rope(x, x, torch.ones(4, 4), torch.zeros(4, 4), backend="triton")),
    ("swiglu", lambda x: kernels.swiglu(x, x, backend="triton")),
    ("attention", lambda x: kernels.attention(x, x, x, backend="triton")),
])
def test_the_kernels_refuse_float64_which_they_computed_in_fp32(op, call):
    """float64 was taken and computed in fp32 (errors of 1e-7 where a float64 caller expects 1e-16; gradcheck failed),
    and attention's failed to compile on a GPU."""
    x = torch.randn(1, 2, 4, 8 if op != "attention" else 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"^{op}: the Triton kernel takes tensors of one dtype, float32, bfloat16 or "
                                         "float16, got float64"):
        call(x)


def test_attention_refuses_q_k_v_of_different_dtypes():
    """fp32 q with fp16 k and v was the interpreter's 'Both operands must be same dtype', a compile error on a GPU."""
    q, kv = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="^attention: .* got float32, float16, float16; use the torch backend"):
        kernels.attention(q, kv, kv, backend="triton")


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


# ---- segment ids (packed sequences) ------------------------------------------------------------

SEGMENT_CASES = [
    # batch, heads, kv_heads, seq, head_dim, causal, sample lengths per row (the rest is padding, id 0)
    (2, 2, 1, 64, 64, True, [[20, 9, 30], [64]]),  # a segment spans whole unmasked blocks
    (1, 2, 1, 70, 48, True, [[1, 33, 17, 2]]),  # one-token segment, padding tail, odd length
    (2, 2, 2, 40, 96, False, [[16, 16], [5, 35]]),  # non-causal: a token sees its whole segment
    (1, 2, 1, 33, 128, True, [[33]]),  # one segment: the same as plain causal attention
]


@pytest.mark.parametrize("batch, heads, kv_heads, seq, head_dim, causal, lengths", SEGMENT_CASES)
def test_segment_attention_matches_dense_block_diagonal_sdpa(batch, heads, kv_heads, seq, head_dim, causal, lengths,
                                                             seed, nan_outputs):
    """Triton and the torch route against SDPA with the dense [seq, seq] block-diagonal mask, values and grads;
    FlexAttention's eager route (no backward on the CPU) on values."""
    ids = packed_segment_ids(batch, seq, lengths)
    q = torch.randn(batch, seq, heads, head_dim).transpose(1, 2)
    k, v = torch.randn(batch, kv_heads, seq, head_dim), torch.randn(batch, kv_heads, seq, head_dim)

    def dense(q, k, v):
        return reference.attention(q, k, v, causal, segment_ids=ids)

    compare(lambda q, k, v: kernels.attention(q, k, v, causal, segment_ids=ids, backend="triton"), dense,
            [q, k, v], torch.float32, seed)
    compare(lambda q, k, v: kernels.attention(q, k, v, causal, segment_ids=ids, backend="torch"), dense,
            [q, k, v], torch.float32, seed)
    flex = torch_attention.flex_segment_attention(q, k, v, causal, None, ids, compiled=False)
    assert torch.allclose(flex, dense(q, k, v), atol=1e-5), f"seed={seed}"


def test_packed_attention_runs_flexattention_only_where_it_compiles(monkeypatch):
    """Before Ampere (V100 sm_70, T4 and RTX 20xx sm_75) FlexAttention has no compiled kernel: PyTorch's eager
    fallback built the whole score matrix and its fp16 backward failed on mixed dtypes. Those GPUs, as the CPU,
    take one SDPA call per segment."""
    for capability, flex in [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert torch_attention.flex_attention_compiles(torch.device("cuda", 0)) is flex, capability
    assert torch_attention.flex_attention_compiles(torch.device("cpu")) is False


@pytest.mark.parametrize("causal", [True, False])
def test_an_id_that_comes_back_starts_another_segment(causal, seed, nan_outputs):
    """A segment is a run of equal ids: with ids 1 1 1 2 2 1 1 1 the last three tokens do not see the first three.
    The oracles treated equal ids anywhere as one segment and differed from Triton and the torch path by 1.9."""
    ids = torch.tensor([[1, 1, 1, 2, 2, 1, 1, 1] * 3, [0, 0, 3, 3, 3, 3, 0, 0] * 3])
    q, k, v = torch.randn(2, 2, 24, 32), torch.randn(2, 1, 24, 32), torch.randn(2, 1, 24, 32)
    runs = packed_segment_ids(2, 24, [[3, 2, 6, 2, 6, 2, 3], [2, 4, 4, 4, 4, 4, 2]])  # the same runs, distinct ids

    def oracle(q, k, v):
        return oracle_attention(q, k, v, causal, ids)

    assert torch.allclose(oracle(q, k, v), oracle_attention(q, k, v, causal, runs), atol=1e-6)
    assert torch.allclose(reference.attention(q, k, v, causal, segment_ids=ids), oracle(q, k, v), atol=1e-5)
    for backend in ("triton", "torch"):
        compare(lambda q, k, v, backend=backend: kernels.attention(q, k, v, causal, segment_ids=ids, backend=backend),
                oracle, [q, k, v], torch.float32, seed)


def test_segment_attention_never_builds_a_seq_by_seq_mask(monkeypatch, seed):
    """The Triton and CPU torch routes allocate nothing of size seq x seq (the issue: an O(seq^2) boolean mask)."""
    seq = 300
    ids = packed_segment_ids(1, seq, [[100, 150]])
    q, k, v = torch.randn(1, 1, seq, 32), torch.randn(1, 1, seq, 32), torch.randn(1, 1, seq, 32)
    sizes = []
    for name in ("ones", "zeros", "empty", "full"):
        original = getattr(torch, name)

        def record(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            sizes.append(out.numel())
            return out

        monkeypatch.setattr(torch, name, record)
    for backend in ("triton", "torch"):
        kernels.attention(q, k, v, segment_ids=ids, backend=backend)
    assert sizes and max(sizes) < seq * seq, sizes


@pytest.mark.parametrize("causal", [True, False])
def test_flex_block_mask_covers_every_visible_pair_and_full_blocks_are_full(causal):
    ids = packed_segment_ids(2, 300, [[100, 28, 150], [1, 200, 40]])
    mask = torch_attention.segment_block_mask(ids, causal, block=32)
    dense = ids[:, :, None] == ids[:, None, :]
    if causal:
        dense = dense & torch.ones(300, 300, dtype=torch.bool).tril()
    def by_block(pad_value):  # [batch, q block, 32, kv block, 32], positions past 300 filled with pad_value
        return torch.nn.functional.pad(dense, (0, 20, 0, 20), value=pad_value).view(2, 10, 32, 10, 32)

    any_pair, all_pairs = by_block(False).any(4).any(2), by_block(True).all(4).all(2)
    partial, full = mask.kv_num_blocks[:, 0], mask.full_kv_num_blocks[:, 0]
    listed = torch.zeros(2, 10, 10, dtype=torch.bool)
    for b in range(2):
        for m in range(10):
            for indices, count in ((mask.kv_indices, partial), (mask.full_kv_indices, full)):
                listed[b, m, indices[b, 0, m, :count[b, m]].long()] = True
            full_blocks = mask.full_kv_indices[b, 0, m, :full[b, m]].long()
            assert all_pairs[b, m, full_blocks].all()
    assert torch.equal(listed, any_pair)


def test_segment_ids_must_fit_the_sequence():
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="segment_ids"):
        kernels.attention(q, q, q, segment_ids=torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_ids"):
        kernels.attention(q, torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64),
                          segment_ids=torch.zeros(1, 8, dtype=torch.long))


# ---- masks and dropout go to SDPA ---------------------------------------------------------------

def test_attn_mask_and_dropout_route_to_sdpa(seed):
    q, k, v = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    mask[0, :, :, :3] = False  # left padding of the first sequence
    got = kernels.attention(q, k, v, attn_mask=mask, backend="triton")
    causal = torch.ones(5, 9, dtype=torch.bool).tril(4)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask & causal, enable_gqa=True)
    assert torch.allclose(got, expected, atol=1e-6)
    k, v = k[:, :, :5], v[:, :, :5]
    runs = []
    for _ in range(2):
        torch.manual_seed(seed)
        runs.append(kernels.attention(q, k, v, dropout_p=0.5, backend="triton"))
    assert torch.equal(runs[0], runs[1]) and not torch.allclose(runs[0], kernels.attention(q, k, v), atol=1e-3)



@pytest.mark.parametrize("seq_q", [1, 5])  # a decode step, a prefill over left-padded prompts
def test_masked_gqa_on_cuda_repeats_kv_so_sdpa_can_leave_the_math_backend(monkeypatch, seq_q, seed):
    """torch documents enable_gqa for the flash and math backends only, and flash takes no mask: a masked GQA call
    (batched generation over padded prompts; a prefill on top of a KV cache, which the reference path masks) ran on
    the math backend, its fp32 scores [b, h, s_q, s_k] in memory. Here the CUDA branch runs on CPU tensors: k/v
    come with q's head count, no enable_gqa, and the same output."""
    q, k, v = torch.randn(3, 8, seq_q, 64), torch.randn(3, 2, 9, 64), torch.randn(3, 2, 9, 64)
    mask = torch.ones(3, 1, seq_q, 9, dtype=torch.bool)
    mask[0, :, :, :4] = False  # left padding of the first prompt
    paths = {"padded": lambda: torch_attention.masked_attention(q, k, v, True, None, mask, 0.0),
             "on a cache": lambda: reference.attention(q, k, v, causal=True)}
    expected = {name: path() for name, path in paths.items()}
    assert reference.grouped_kv(q, k, v, mask, "cpu")[2]  # the CPU's flash kernel takes a mask with GQA
    assert reference.grouped_kv(q, k, v, None, "cuda")[2]  # and CUDA's without a mask
    calls = []
    sdpa, grouped_kv = torch.nn.functional.scaled_dot_product_attention, reference.grouped_kv

    def recorded(q, k, v, **kwargs):
        calls.append((k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(reference, "grouped_kv", lambda q, k, v, mask, _: grouped_kv(q, k, v, mask, "cuda"))
    for name, path in paths.items():
        calls.clear()
        got = path()
        unmasked = seq_q == 1 and name == "on a cache"  # a decode step sees every key: no mask, flash takes GQA
        assert calls == [(2, 2, True) if unmasked else (8, 8, False)], name
        assert torch.allclose(got, expected[name], atol=1e-6), (name, seed)


# ---- dispatch ---------------------------------------------------------------------------------

def test_auto_means_torch_on_the_cpu_even_when_interpreting():
    x, w = torch.randn(2, 8), torch.ones(8, requires_grad=True)
    assert "RMSNormFunction" not in kernels.rms_norm(x, w, 1e-6).grad_fn.name()
    assert "RMSNormFunction" in kernels.rms_norm(x, w, 1e-6, backend="triton").grad_fn.name()
    assert "RMSNormFunction" not in kernels.rms_norm(x, w, 1e-6, backend="torch").grad_fn.name()
    with pytest.raises(ValueError, match="backend must be"):
        kernels.rms_norm(x, w, 1e-6, backend="cuda")


class _FakeCuda:
    is_cuda = True
    device = torch.device("cuda", 0)
    dtype = torch.bfloat16


@pytest.mark.parametrize("op", kernels.OPS)
def test_auto_on_cuda_picks_triton_only_for_verified_capabilities(op, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "VERIFIED", frozenset())
    assert kernels.choose_backend(op, _FakeCuda(), "auto") == "torch"
    monkeypatch.setattr(kernels, "VERIFIED", frozenset({(op, (9, 0))}))
    assert kernels.choose_backend(op, _FakeCuda(), "auto") == "triton"
    double = _FakeCuda()
    double.dtype = torch.float64  # which the kernels refuse: auto leaves it to torch, and mixed dtypes too
    assert kernels.choose_backend(op, double, "auto") == "torch"
    assert kernels.choose_backend(op, _FakeCuda(), "auto", double) == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernels.choose_backend(op, _FakeCuda(), "auto") == "torch"
    monkeypatch.setattr(kernels, "interpreting", lambda: True)  # auto never chooses the interpreter
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kernels.choose_backend(op, _FakeCuda(), "auto") == "torch"


def test_verified_names_ops_and_capabilities_the_kernels_run_on():
    """A misspelt op in VERIFIED would leave `auto` on the torch path without a word."""
    assert kernels.VERIFIED, "the H200 run of tests/test_kernels_gpu.py put entries here"
    for op, capability in kernels.VERIFIED:
        assert op in kernels.OPS, op
        assert capability >= runtime.MIN_CAPABILITY, capability


@pytest.mark.parametrize("op", kernels.OPS)
def test_triton_is_refused_below_compute_capability_8_and_auto_uses_torch_there(op, monkeypatch):
    """A T4 (7.5) was treated as Ampere: its 64 KiB of shared memory ran out in the attention backward."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.setattr(kernels, "VERIFIED", frozenset({(op, (7, 5))}))
    assert kernels.choose_backend(op, _FakeCuda(), "auto") == "torch"
    assert not runtime.triton_runs_on(_FakeCuda.device)
    with pytest.raises(kernels.KernelUnavailableError) as refused:
        runtime.triton_module_for("swiglu_gate", _FakeCuda())
    assert str(refused.value) == ("kernels: the Triton kernels need compute capability 8.0 or newer; Tesla T4 is 7.5: "
                                  "use model.kernels=torch")


class _Properties:
    def __init__(self, major, minor, shared):
        self.major, self.minor, self.shared_memory_per_block_optin = major, minor, shared


@pytest.mark.parametrize("capability, shared, family", [
    ((8, 0), 166912, 80),  # A100
    ((8, 7), 166912, 80),  # Jetson Orin
    ((8, 6), 101376, 86),  # A10, A40, RTX 3090
    ((8, 9), 101376, 86),  # L4, L40, RTX 4090
    ((9, 0), 232448, 90),  # H100, H200
    ((10, 0), 232448, 90),  # B200
    ((12, 0), 101376, 86),  # RTX 5090
])
def test_each_device_gets_tiles_that_fit_its_shared_memory(capability, shared, family, monkeypatch):
    """sm_86 / sm_89 (99 KiB a block) got the A100's tiles: the atomic-dQ one needs 112 KiB."""
    from kernels.flash_attention import TILES
    from kernels.hardware import SHARED_MEMORY_LIMIT

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Properties(*capability, shared))
    assert runtime.device_arch(_FakeCuda()) == family
    assert all(family in table for table in TILES.values())
    assert SHARED_MEMORY_LIMIT[family] <= shared  # what the compile check holds the family's tiles to


@pytest.mark.parametrize("capability, family", [((9, 0), 90), ((8, 0), 80), ((8, 9), 86), ((7, 5), 86)])
def test_a_torch_that_does_not_report_shared_memory_still_gets_tiles(capability, family, monkeypatch):
    """torch before 2.7 (and ROCm builds) has no shared_memory_per_block_optin: the first attention launch was an
    AttributeError."""
    class OlderProperties:
        major, minor = capability

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: OlderProperties())
    assert runtime.device_arch(_FakeCuda()) == family


def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import torch, kernels; kernels.swiglu(torch.ones(3), torch.ones(3), backend='triton')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    assert result.returncode == 1
    assert "KernelUnavailableError: kernels: backend 'triton' needs CUDA tensors" in result.stderr


def test_peak_tflops_table_matches_device_names_and_dtypes():
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.5
    assert peak_tflops("NVIDIA H100 PCIe", torch.float16) == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5
    assert peak_tflops("NVIDIA A10", torch.bfloat16) == 125.0
    assert peak_tflops("NVIDIA H200", torch.bfloat16) == 989.5
    assert math.isnan(peak_tflops("Some Future GPU", torch.bfloat16))



@pytest.mark.parametrize("name, half, single", [  # as torch.cuda.get_device_name() spells them
    ("Tesla V100-SXM2-32GB", 125.0, 15.7), ("Tesla V100-PCIE-16GB", 112.0, 14.0),
    ("Tesla V100S-PCIE-32GB", 130.0, 16.4), ("Tesla T4", 65.0, 8.1), ("NVIDIA A10G", 70.0, 35.0),
    ("NVIDIA A10", 125.0, 31.2), ("NVIDIA A30", 165.0, 10.3), ("NVIDIA A40", 149.7, 37.4),
    ("NVIDIA A100-SXM4-40GB", 312.0, 19.5), ("NVIDIA A100 80GB PCIe", 312.0, 19.5),
    ("NVIDIA RTX A6000", 154.8, 38.7), ("NVIDIA RTX A5000", 111.1, 27.8), ("NVIDIA RTX A4000", 76.7, 19.2),
    ("NVIDIA L4", 121.0, 30.3), ("NVIDIA L40", 181.05, 90.5), ("NVIDIA L40S", 362.05, 91.6),
    ("NVIDIA RTX 6000 Ada Generation", 364.2, 91.1), ("NVIDIA GeForce RTX 4090", 165.2, 82.6),
    ("NVIDIA GeForce RTX 3090", 71.0, 35.6), ("NVIDIA H100 80GB HBM3", 989.5, 67.0),
    ("NVIDIA H100 NVL", 835.5, 60.0), ("NVIDIA H200 NVL", 835.5, 60.0), ("NVIDIA GH200 480GB", 989.5, 67.0),
    ("NVIDIA H800 PCIe", 756.0, 51.2), ("NVIDIA H20", 148.0, 44.0), ("NVIDIA B200", 2250.0, 75.0),
    ("NVIDIA GB200", 2500.0, 80.0),
])
def test_common_gpus_have_their_dense_peaks(name, half, single):
    """A GPU missing from the table, or missed by its pattern (AWS's A10G by the A10's), had an MFU of NaN."""
    assert (peak_tflops(name, torch.bfloat16), peak_tflops(name, torch.float16)) == (half, half)
    assert peak_tflops(name, torch.float32) == single


# ---- the model ---------------------------------------------------------------------------------

def test_tiny_model_trains_the_same_with_triton_and_torch_kernels(seed):
    results = {}
    for choice in ("triton", "torch"):
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=61, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32, kernels=choice)
        model = Transformer(cfg)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(2):
            tokens = torch.randint(0, 61, (2, 17), generator=gen)
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


def test_packed_sft_trains_the_same_through_varlen_triton_per_segment_torch_and_the_dense_mask(monkeypatch, seed):
    """Packed SFT windows: the Triton varlen kernel and the torch backend's per-segment SDPA (no [seq, seq] mask)
    give the losses and gradients of the dense block-diagonal mask the model used before."""
    gen = torch.Generator().manual_seed(seed)
    segment_ids = packed_segment_ids(2, 24, [[7, 9, 5], [11, 12]])
    tokens, targets = (torch.randint(0, 61, (2, 24), generator=gen) for _ in range(2))
    loss_mask = (torch.rand(2, 24, generator=gen) < 0.7).float() * (segment_ids > 0)

    def train(choice: str):
        torch.manual_seed(seed)
        cfg = ModelConfig(vocab_size=61, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32,
                          kernels="torch" if choice == "dense" else choice)
        model = Transformer(cfg)
        loss = model(tokens, targets, loss_mask, segment_ids=segment_ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    routes = {choice: train(choice) for choice in ("triton", "torch")}
    with monkeypatch.context() as m:  # the dense mask: reference attention over the block-diagonal causal mask
        m.setattr(kernels, "attention", lambda q, k, v, causal=True, scale=None, segment_ids=None, **_:
                  reference.attention(q, k, v, causal, scale, segment_ids))
        dense_loss, dense_grads = train("dense")
    for choice, (loss, grads) in routes.items():
        assert loss == pytest.approx(dense_loss, rel=1e-5), f"{choice} seed={seed}"
        for name, grad in dense_grads.items():
            assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), f"{choice} {name} seed={seed}"


# ---- the benchmark tool ------------------------------------------------------------------------

def test_bench_smoke_prints_every_op_forward_and_backward():
    result = subprocess.run([sys.executable, "-m", "kernels.bench", "--smoke"], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()[3:]
    ops = sorted(line.split()[0] for line in lines)
    assert ops == ["attention"] * 4 + ["rmsnorm"] * 2 + ["rope"] * 2 + ["swiglu"] * 2, result.stdout
    assert sum(" fwd " in line for line in lines) == 5 and sum(" bwd " in line for line in lines) == 5
    assert all("xeager" in line for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_bench_without_gpu_says_so_and_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kernels.bench", "--op", "rmsnorm"], capture_output=True,
                            text=True, env=env, timeout=300, check=False)
    assert result.returncode == 2 and "no CUDA device" in result.stderr
