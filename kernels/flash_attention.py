"""Flash attention (FlashAttention-2 schedule) in Triton: forward and backward, grouped-query heads, causal
masks aligned bottom-right, and packed sequences (segment ids) without a dense mask.

Layouts: q `[batch, n_heads, seq_q, head_dim]`, k and v `[batch, n_kv_heads, seq_k, head_dim]`, any strides;
query head h reads key/value head h // (n_heads // n_kv_heads), so repeated K/V are never materialised.
A query row i sees key j when j <= i + (seq_k - seq_q) (if causal) and j lies in i's segment (if
segment ids are given: a segment is a run of equal consecutive ids, seq_q == seq_k). A row that sees no
key gives 0, not NaN.

Design (after Triton's fused-attention tutorial and FlashAttention-2's Triton port):
- Each program walks a range of key blocks (forward, dQ) or query blocks (dK/dV) computed from the
  causal diagonal and the segment bounds; blocks entirely out of sight are never visited. The range is
  split into blocks that need no mask (every row sees every key: plain loads, one multiply-add for the
  scale, no -inf handling) and the few masked blocks at the diagonal, the segment edges and the ragged end.
- The softmax scale and log2(e) are folded into one factor applied by a multiply-add inside exp2;
  the log-sum-exp is kept in the log2 domain (fp32) for the backward.
- Backward: a preprocessing kernel computes delta = rowsum(dO * O). The dK/dV kernel works in the
  transposed space (S^T = K Q^T), so P^T and dS^T come out of the matmuls in the layout the next matmul
  takes. Nothing is transposed in registers: computed tiles are used as they come, and every loaded
  operand is loaded in the orientation its matmul takes (Q and Q^T, dO and dO^T are two loads of the same
  cached tile; `tl.trans` of a loaded tile compiled to a register transpose that replicates the whole
  operand in each warp). The compile check counts `tt.trans` in each kernel's TTGIR: zero. The dK/dV
  kernel sums dK, dV over every query head of a GQA group in registers.
  Deterministic (the default): a second kernel computes dQ (3 matmuls), 7 matmuls per block pair in all,
  no atomics, bitwise reproducible. deterministic=False: dQ is accumulated with fp32 atomics inside the
  dK/dV kernel (5 matmuls per block pair, the order of the additions varies from run to run).
- Tiles are autotuned per family of shared memory a block (`TILES`, `kernels.runtime.arch_family`): 80 (A100
  class, 163 KiB), 86 (99 KiB: sm_86, sm_89, consumer Blackwell) and 90 (227 KiB: Hopper, B200); under the
  interpreter one small tile is used. Dot products accumulate in fp32; fp32 inputs use IEEE dots.
- Head dims: multiples of 16 from 32 to 128, passed at run time; the tile width is the next power of two,
  so 48 runs the 64-wide kernels and 96 the 128-wide ones (Triton specialises head_dim on divisibility
  by 16, so they share cubins).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.hardware import SHARED_MEMORY_LIMIT
from kernels.runtime import (
    ATTENTION_HEAD_DIMS,
    HEAD_DIMS_TEXT,
    KERNEL_DTYPES,
    Launch,
    arch_family,
    check_dtypes,
    check_rows_addressable,
    device_arch,
    interpreting,
    rows_addressable,
)
from kernels.segments import run_bounds

LOG2E = 1.4426950408889634
INTERPRETED = interpreting()  # the process's mode, fixed as Triton was imported above
BLOCK_DS = {32: "32", 64: "48,64", 128: "96,128"}  # tile width -> the head dims it serves (compile-check labels)
DELTA_ROWS = 16 if INTERPRETED else 64


def _tile(m: int, n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)


# (BLOCK_M, BLOCK_N, warps, stages) per kernel, architecture family and class of input: 16-bit inputs with
# head dims up to 64 ("small") or above ("large"), fp32 inputs likewise ("fp32-small", "fp32-large"). The
# autotuner times the candidates of the device's family on first use (per power-of-two sequence length, tile
# width, dtype, causal, segments). Candidates are chosen to compile without register spills on their architecture
# (python -m kernels.compile_check); BENCHMARKS.md ("Spills") lists those that spill (from the full check: the
# default tiles by 4-60 bytes a thread, the atomic-dQ option's by up to 96). Ampere keeps the B
# operand of every matmul whole in each warp's registers, so its dK/dV tiles are narrow in the query
# dimension (the K dimension of the dK/dV matmuls); Hopper's wgmma reads operands from shared memory, which allows
# wider dK/dV tiles at head dims up to 64; at 128 only M16 N64 (no spills) and M32 N64 (under 64 bytes a thread)
# keep the dK/dV accumulators in registers, where M64 N128 spilled 0.3-1.4 KiB a thread. fp32 inputs multiply on the
# CUDA cores (IEEE dots): at head dims 96-128 on sm_90 the forward and dQ tile M16 N32 spilled 0.3-1.4 KiB a thread
# with 4 warps and none with 8 (or as M16 N16 with 4), the dK/dV tile M16 N32 44-60 bytes, M16 N16 none.
# On an H200 with Triton 3.6 the atomic-dQ tile M16 N128 (which spilled 184 bytes a thread) gave dQ errors about 490
# times the reference's at head dim 128 (tests/test_kernels_gpu.py); M16 N64 with 2 stages passes there. It spills
# 8 bytes a thread without segment ids and 68 with them (Triton 3.9; 0 and 68 with 3.6). sm_80 keeps M16 N128 (never
# run on a device).
TILES: dict[str, dict[int, dict[str, list[triton.Config]]]] = {
    "fwd": {
        80: {"small": [_tile(128, 64, 8, 3), _tile(64, 64, 4, 3)],
             "large": [_tile(128, 32, 8, 3), _tile(64, 64, 8, 3)],
             "fp32-small": [_tile(32, 32, 8, 2)], "fp32-large": [_tile(16, 32, 4, 2)]},
        90: {"small": [_tile(128, 128, 8, 3), _tile(128, 64, 8, 3)],
             "large": [_tile(128, 64, 8, 3), _tile(128, 32, 8, 3)],
             "fp32-small": [_tile(32, 32, 8, 2)], "fp32-large": [_tile(16, 32, 8, 2), _tile(16, 16, 4, 2)]},
    },
    "kv": {
        80: {"small": [_tile(32, 64, 8, 2), _tile(32, 64, 4, 1)],
             "large": [_tile(16, 64, 8, 2), _tile(32, 64, 8, 1)],
             "fp32-small": [_tile(32, 32, 8, 1)], "fp32-large": [_tile(16, 32, 8, 2)]},
        90: {"small": [_tile(64, 128, 8, 2), _tile(32, 64, 8, 2)],
             "large": [_tile(16, 64, 8, 2), _tile(32, 64, 8, 2)],
             "fp32-small": [_tile(32, 32, 8, 1)], "fp32-large": [_tile(16, 16, 4, 2), _tile(16, 16, 8, 2)]},
    },
    "kv_atomic": {
        80: {"small": [_tile(16, 64, 4, 2)], "large": [_tile(16, 128, 8, 1)],
             "fp32-small": [_tile(32, 32, 8, 1)], "fp32-large": [_tile(16, 32, 8, 2)]},
        90: {"small": [_tile(16, 64, 4, 2)], "large": [_tile(16, 64, 8, 2)],
             "fp32-small": [_tile(32, 32, 8, 1)], "fp32-large": [_tile(16, 32, 8, 2)]},
    },
    "q": {
        80: {"small": [_tile(128, 32, 8, 3), _tile(64, 32, 4, 3)],
             "large": [_tile(64, 32, 8, 3), _tile(64, 64, 8, 2)],
             "fp32-small": [_tile(16, 32, 4, 2)], "fp32-large": [_tile(16, 32, 4, 2)]},
        90: {"small": [_tile(128, 64, 8, 2), _tile(128, 32, 8, 3)],
             "large": [_tile(128, 32, 8, 3), _tile(64, 32, 8, 3)],
             "fp32-small": [_tile(16, 32, 4, 2)], "fp32-large": [_tile(16, 32, 8, 2), _tile(16, 16, 4, 2)]},
    },
}
# sm_86 / sm_89 and others with 99 KiB of shared memory a block (arch_family 86): Ampere's tiles but where those need
# more (the 16-bit atomic-dQ tile M16 N128 at head dims 96-128 takes 112 KiB)
SMALL_SHARED_MEMORY_TILES = {"kv_atomic": {"large": [_tile(16, 64, 8, 2), _tile(16, 64, 8, 1)]}}
for _name, _families in TILES.items():
    _families[86] = {**_families[80], **SMALL_SHARED_MEMORY_TILES.get(_name, {})}
# under the interpreter: small, unequal tiles, so that multi-block paths and M != N masks are exercised
INTERPRETER_TILES = {"fwd": _tile(32, 16, 4, 1), "kv": _tile(16, 32, 4, 1), "kv_atomic": _tile(16, 32, 4, 1),
                     "q": _tile(32, 16, 4, 1)}


def tiles(kernel: str, arch: int, dtype: torch.dtype, block_d: int) -> list[triton.Config]:
    """The tile candidates of `kernel` ('fwd', 'kv', 'kv_atomic', 'q') for an architecture family, input dtype and
    tile width."""
    size = "small" if block_d <= 64 else "large"
    return TILES[kernel][arch]["fp32-" + size if dtype == torch.float32 else size]


# ---- device helpers ------------------------------------------------------------------------------------------

@triton.jit
def _program(seq, BLOCK: tl.constexpr):
    """(first row of this program's block, its batch x head index) on the one-axis grid of `grid`."""
    n_blocks = tl.cdiv(seq, BLOCK)
    pid = tl.program_id(0)
    return (pid % n_blocks) * BLOCK, (pid // n_blocks).to(tl.int64)


@triton.jit
def _load_tile(base, idx, n, stride_idx, stride_d, head_dim, CHECK: tl.constexpr, TRANS: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Rows `idx` of an [n, head_dim] matrix as a [len(idx), BLOCK_D] tile ([BLOCK_D, len(idx)] when TRANS),
    zero outside it; CHECK=False promises every idx < n. (head_dim is a multiple of 16, which Triton knows from
    its argument specialisation, so the column mask does not break vector loads.)"""
    offs_d = tl.arange(0, BLOCK_D)
    if TRANS:
        ptrs = base + idx[None, :] * stride_idx + offs_d[:, None] * stride_d
        in_rows = idx[None, :] < n
        in_dims = offs_d[:, None] < head_dim
    else:
        ptrs = base + idx[:, None] * stride_idx + offs_d[None, :] * stride_d
        in_rows = idx[:, None] < n
        in_dims = offs_d[None, :] < head_dim
    if CHECK:
        in_dims = in_dims & in_rows
    return tl.load(ptrs, mask=in_dims, other=0.0)


@triton.jit
def _store_tile(base, idx, n, stride_idx, stride_d, head_dim, value, BLOCK_D: tl.constexpr):
    """Store a [len(idx), BLOCK_D] tile into rows `idx` < n of an [n, head_dim] matrix."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(base + idx[:, None] * stride_idx + offs_d[None, :] * stride_d, value,
             mask=(idx[:, None] < n) & (offs_d[None, :] < head_dim))


@triton.jit
def _load_segments(seg_base, idx, n, SEGMENTS: tl.constexpr):
    """Segment of each index (its run's start), or the indices themselves when there are no segments."""
    if SEGMENTS:
        seg = tl.load(seg_base + idx, mask=idx < n, other=0)
    else:
        seg = idx
    return seg


@triton.jit
def _visible(q_idx, k_idx, q_seg, k_seg, seq_k, diag, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr):
    """Whether query q_idx sees key k_idx (broadcasting operands)."""
    ok = k_idx < seq_k
    if CAUSAL:
        ok = ok & (k_idx <= q_idx + diag)
    if SEGMENTS:
        ok = ok & (q_seg == k_seg)
    return ok


@triton.jit
def _ranges(lo, full_lo, full_hi, hi):
    """Clamp to lo <= full_lo <= full_hi <= hi."""
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_range(seg_start, seg_end, start_m, seq_q, seq_k, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys that query rows [start_m, start_m + BLOCK_M) see lie in [lo, hi); blocks of [full_lo, full_hi)
    are seen whole by every row (no mask). lo, full_lo, full_hi are multiples of BLOCK_N."""
    last = tl.minimum(start_m + BLOCK_M, seq_q) - 1
    diag = seq_k - seq_q
    lo = 0
    hi = seq_k
    full_lo = 0
    full_hi = seq_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(hi, last + diag + 1)
        full_hi = tl.minimum(full_hi, tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N)
    if SEGMENTS:
        first_start = tl.load(seg_start + start_m)
        one_segment = first_start == tl.load(seg_start + last)
        lo = first_start // BLOCK_N * BLOCK_N
        hi = tl.minimum(hi, tl.load(seg_end + last))
        full_lo = tl.cdiv(first_start, BLOCK_N) * BLOCK_N
        full_hi = tl.where(one_segment, tl.minimum(full_hi, tl.load(seg_end + start_m) // BLOCK_N * BLOCK_N), 0)
    return _ranges(lo, full_lo, full_hi, hi)


@triton.jit
def _query_range(seg_start, seg_end, start_n, seq_q, seq_k, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query rows that see some key of [start_n, start_n + BLOCK_N) lie in [lo, hi); rows of [full_lo, full_hi)
    see all of them (no mask). lo, full_lo, full_hi are multiples of BLOCK_M."""
    last = tl.minimum(start_n + BLOCK_N, seq_k) - 1
    diag = seq_k - seq_q
    lo = 0
    hi = seq_q
    full_lo = 0
    full_hi = seq_q // BLOCK_M * BLOCK_M
    if CAUSAL:
        lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last - diag, 0), BLOCK_M) * BLOCK_M
    if SEGMENTS:
        first_start = tl.load(seg_start + start_n)
        one_segment = first_start == tl.load(seg_start + last)
        lo = tl.maximum(lo, first_start // BLOCK_M * BLOCK_M)
        hi = tl.load(seg_end + last)
        full_lo = tl.maximum(full_lo, tl.cdiv(first_start, BLOCK_M) * BLOCK_M)
        full_hi = tl.where(one_segment, tl.minimum(full_hi, tl.load(seg_end + start_n) // BLOCK_M * BLOCK_M), 0)
    return _ranges(lo, full_lo, full_hi, hi)


# ---- forward -------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, rows, q_seg, k_base, v_base, seg_k, stride_kn, stride_kd, stride_vn, stride_vd,
                start, end, seq_k, head_dim, diag, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                SEGMENTS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over key blocks [start, end)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_t = _load_tile(k_base, cols, seq_k, stride_kn, stride_kd, head_dim, MASKED, True, BLOCK_D)
        s = tl.dot(q, k_t, input_precision=PRECISION)
        if MASKED:
            k_seg = _load_segments(seg_k, cols, seq_k, SEGMENTS)
            visible = _visible(rows[:, None], cols[None, :], q_seg[:, None], k_seg[None, :], seq_k, diag, CAUSAL,
                               SEGMENTS)
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            p = tl.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])  # scale and shift in one multiply-add
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, cols, seq_k, stride_vn, stride_vd, head_dim, MASKED, False, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_heads", "group", "seq_q", "seq_k"])
def _attn_fwd(Q, K, V, OUT, LSE, SEG_START, SEG_END,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              n_heads, group, seq_q, seq_k, seq_bucket, head_dim, qk_scale,
              BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m, bh = _program(seq_q, BLOCK_M)
    b = bh // n_heads
    h = bh % n_heads
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows, seq_q, stride_qm, stride_qd, head_dim, True, False,
                   BLOCK_D)
    seg_start = SEG_START + b * seq_q
    lo, full_lo, full_hi, hi = _key_range(seg_start, SEG_END + b * seq_q, start_m, seq_q, seq_k, CAUSAL, SEGMENTS,
                                          BLOCK_M, BLOCK_N)
    q_seg = _load_segments(seg_start, rows, seq_q, SEGMENTS)
    k_base = K + b * stride_kb + (h // group) * stride_kh
    v_base = V + b * stride_vb + (h // group) * stride_vh
    diag = seq_k - seq_q
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if SEGMENTS:  # the block where the first row's segment starts (lo == full_lo without segments)
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, q_seg, k_base, v_base, seg_start, stride_kn, stride_kd,
                                    stride_vn, stride_vd, lo, full_lo, seq_k, head_dim, diag, qk_scale, True, CAUSAL,
                                    SEGMENTS, BLOCK_D, BLOCK_N, PRECISION)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, q_seg, k_base, v_base, seg_start, stride_kn, stride_kd,
                                stride_vn, stride_vd, full_lo, full_hi, seq_k, head_dim, diag, qk_scale, False, CAUSAL,
                                SEGMENTS, BLOCK_D, BLOCK_N, PRECISION)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, q_seg, k_base, v_base, seg_start, stride_kn, stride_kd,
                                stride_vn, stride_vd, full_hi, hi, seq_k, head_dim, diag, qk_scale, True, CAUSAL,
                                SEGMENTS, BLOCK_D, BLOCK_N, PRECISION)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    _store_tile(OUT + b * stride_ob + h * stride_oh, rows, seq_q, stride_om, stride_od, head_dim,
                (acc / l_safe[:, None]).to(OUT.dtype.element_ty), BLOCK_D)
    tl.store(LSE + bh * seq_q + rows, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=rows < seq_q)


# ---- backward ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["n_heads", "seq_q"])
def _attn_bwd_delta(OUT, DO, DELTA,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_dob, stride_doh, stride_dom, stride_dod,
                    n_heads, seq_q, head_dim, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, the softmax-gradient term every backward block needs."""
    start_m, bh = _program(seq_q, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)
    b = bh // n_heads
    h = bh % n_heads
    o = _load_tile(OUT + b * stride_ob + h * stride_oh, rows, seq_q, stride_om, stride_od, head_dim, True, False,
                   BLOCK_D)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, rows, seq_q, stride_dom, stride_dod, head_dim, True, False,
                    BLOCK_D)
    tl.store(DELTA + bh * seq_q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < seq_q)


@triton.jit
def _kv_blocks(dk, dv, k, v, k_t, cols, k_seg, q_base, do_base, lse_base, delta_base, dq_base, seg_q,
               stride_qm, stride_qd, stride_dom, stride_dod, start, end, seq_q, seq_k, head_dim, diag, qk_scale, scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, ATOMIC_DQ: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV (and with ATOMIC_DQ dQ) contributions of query blocks [start, end), in the transposed space."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_t = _load_tile(q_base, rows, seq_q, stride_qm, stride_qd, head_dim, MASKED, True, BLOCK_D)
        q = _load_tile(q_base, rows, seq_q, stride_qm, stride_qd, head_dim, MASKED, False, BLOCK_D)
        do = _load_tile(do_base, rows, seq_q, stride_dom, stride_dod, head_dim, MASKED, False, BLOCK_D)
        do_t = _load_tile(do_base, rows, seq_q, stride_dom, stride_dod, head_dim, MASKED, True, BLOCK_D)
        if MASKED:
            lse = tl.load(lse_base + rows, mask=rows < seq_q, other=0.0)
            delta = tl.load(delta_base + rows, mask=rows < seq_q, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        s_t = tl.dot(k, q_t, input_precision=PRECISION)
        p_t = tl.exp2(s_t * qk_scale - lse[None, :])
        if MASKED:
            q_seg = _load_segments(seg_q, rows, seq_q, SEGMENTS)
            visible = _visible(rows[None, :], cols[:, None], q_seg[None, :], k_seg[:, None], seq_k, diag, CAUSAL,
                               SEGMENTS)
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, do_t, input_precision=PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q_t.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
        if ATOMIC_DQ:
            # key rows past seq_k (zero in k_t) may hold an infinite ds_t where they are not masked (MASKED false):
            # p_t = exp2(0 - lse) overflows for a row whose logits all lie far below zero, and 0 * inf is NaN
            ds_t = tl.where(cols[:, None] < seq_k, ds_t, 0.0)
            dq_t = tl.dot(k_t, ds_t, input_precision=PRECISION) * scale
            tl.atomic_add(dq_base + rows[None, :] * head_dim + offs_d[:, None], dq_t,
                          mask=(rows[None, :] < seq_q) & (offs_d[:, None] < head_dim))
    return dk, dv


@triton.jit(do_not_specialize=["n_heads", "n_kv_heads", "group", "seq_q", "seq_k"])
def _attn_bwd_kv(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, SEG_START, SEG_END,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                 stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                 n_heads, n_kv_heads, group, seq_q, seq_k, seq_bucket, head_dim, qk_scale, scale,
                 BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK and dV of one key block, summed over the query heads of its group (dQ too with ATOMIC_DQ)."""
    start_n, bhk = _program(seq_k, BLOCK_N)
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(K + b * stride_kb + hk * stride_kh, cols, seq_k, stride_kn, stride_kd, head_dim, True, False,
                   BLOCK_D)
    v = _load_tile(V + b * stride_vb + hk * stride_vh, cols, seq_k, stride_vn, stride_vd, head_dim, True, False,
                   BLOCK_D)
    k_t = k  # K^T, the first operand of the atomic dQ matmul: loaded only when used
    if ATOMIC_DQ:
        k_t = _load_tile(K + b * stride_kb + hk * stride_kh, cols, seq_k, stride_kn, stride_kd, head_dim, True, True,
                         BLOCK_D)
    seg_start = SEG_START + b * seq_k
    lo, full_lo, full_hi, hi = _query_range(seg_start, SEG_END + b * seq_k, start_n, seq_q, seq_k, CAUSAL, SEGMENTS,
                                            BLOCK_M, BLOCK_N)
    k_seg = _load_segments(seg_start, cols, seq_k, SEGMENTS)
    diag = seq_k - seq_q
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for g in range(group):
        h = hk * group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        stats = (b * n_heads + h) * seq_q
        dq_base = DQ + stats * head_dim
        if SEGMENTS or CAUSAL:  # the blocks before full_lo (lo == full_lo when neither)
            dk, dv = _kv_blocks(dk, dv, k, v, k_t, cols, k_seg, q_base, do_base, LSE + stats, DELTA + stats, dq_base,
                                seg_start, stride_qm, stride_qd, stride_dom, stride_dod, lo, full_lo, seq_q, seq_k,
                                head_dim, diag, qk_scale, scale, True, CAUSAL, SEGMENTS, ATOMIC_DQ, BLOCK_D, BLOCK_M,
                                PRECISION)
        dk, dv = _kv_blocks(dk, dv, k, v, k_t, cols, k_seg, q_base, do_base, LSE + stats, DELTA + stats, dq_base,
                            seg_start, stride_qm, stride_qd, stride_dom, stride_dod, full_lo, full_hi, seq_q, seq_k,
                            head_dim, diag, qk_scale, scale, False, CAUSAL, SEGMENTS, ATOMIC_DQ, BLOCK_D, BLOCK_M,
                            PRECISION)
        dk, dv = _kv_blocks(dk, dv, k, v, k_t, cols, k_seg, q_base, do_base, LSE + stats, DELTA + stats, dq_base,
                            seg_start, stride_qm, stride_qd, stride_dom, stride_dod, full_hi, hi, seq_q, seq_k,
                            head_dim, diag, qk_scale, scale, True, CAUSAL, SEGMENTS, ATOMIC_DQ, BLOCK_D, BLOCK_M,
                            PRECISION)
    _store_tile(DK + b * stride_dkb + hk * stride_dkh, cols, seq_k, stride_dkn, stride_dkd, head_dim,
                (dk * scale).to(DK.dtype.element_ty), BLOCK_D)
    _store_tile(DV + b * stride_dvb + hk * stride_dvh, cols, seq_k, stride_dvn, stride_dvd, head_dim,
                dv.to(DV.dtype.element_ty), BLOCK_D)


@triton.jit
def _q_blocks(dq, q, do, lse, delta, rows, q_seg, k_base, v_base, seg_k, stride_kn, stride_kd, stride_vn, stride_vd,
              start, end, seq_k, head_dim, diag, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              SEGMENTS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """dQ contributions of key blocks [start, end)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_t = _load_tile(k_base, cols, seq_k, stride_kn, stride_kd, head_dim, MASKED, True, BLOCK_D)
        s = tl.dot(q, k_t, input_precision=PRECISION)
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            k_seg = _load_segments(seg_k, cols, seq_k, SEGMENTS)
            visible = _visible(rows[:, None], cols[None, :], q_seg[:, None], k_seg[None, :], seq_k, diag, CAUSAL,
                               SEGMENTS)
            p = tl.where(visible, p, 0.0)
        v_t = _load_tile(v_base, cols, seq_k, stride_vn, stride_vd, head_dim, MASKED, True, BLOCK_D)
        dp = tl.dot(do, v_t, input_precision=PRECISION)
        k = _load_tile(k_base, cols, seq_k, stride_kn, stride_kd, head_dim, MASKED, False, BLOCK_D)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["n_heads", "group", "seq_q", "seq_k"])
def _attn_bwd_q(Q, K, V, DO, LSE, DELTA, DQ, SEG_START, SEG_END,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_dob, stride_doh, stride_dom, stride_dod,
                stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                n_heads, group, seq_q, seq_k, seq_bucket, head_dim, qk_scale, scale,
                BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of one query block (the deterministic backward)."""
    start_m, bh = _program(seq_q, BLOCK_M)
    b = bh // n_heads
    h = bh % n_heads
    rows = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows, seq_q, stride_qm, stride_qd, head_dim, True, False,
                   BLOCK_D)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, rows, seq_q, stride_dom, stride_dod, head_dim, True, False,
                    BLOCK_D)
    lse = tl.load(LSE + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    delta = tl.load(DELTA + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    seg_start = SEG_START + b * seq_q
    lo, full_lo, full_hi, hi = _key_range(seg_start, SEG_END + b * seq_q, start_m, seq_q, seq_k, CAUSAL, SEGMENTS,
                                          BLOCK_M, BLOCK_N)
    q_seg = _load_segments(seg_start, rows, seq_q, SEGMENTS)
    k_base = K + b * stride_kb + (h // group) * stride_kh
    v_base = V + b * stride_vb + (h // group) * stride_vh
    diag = seq_k - seq_q
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if SEGMENTS:  # the block where the first row's segment starts (lo == full_lo without segments)
        dq = _q_blocks(dq, q, do, lse, delta, rows, q_seg, k_base, v_base, seg_start, stride_kn, stride_kd, stride_vn,
                       stride_vd, lo, full_lo, seq_k, head_dim, diag, qk_scale, True, CAUSAL, SEGMENTS, BLOCK_D,
                       BLOCK_N, PRECISION)
    dq = _q_blocks(dq, q, do, lse, delta, rows, q_seg, k_base, v_base, seg_start, stride_kn, stride_kd, stride_vn,
                   stride_vd, full_lo, full_hi, seq_k, head_dim, diag, qk_scale, False, CAUSAL, SEGMENTS, BLOCK_D,
                   BLOCK_N, PRECISION)
    dq = _q_blocks(dq, q, do, lse, delta, rows, q_seg, k_base, v_base, seg_start, stride_kn, stride_kd, stride_vn,
                   stride_vd, full_hi, hi, seq_k, head_dim, diag, qk_scale, True, CAUSAL, SEGMENTS, BLOCK_D, BLOCK_N,
                   PRECISION)
    _store_tile(DQ + b * stride_dqb + h * stride_dqh, rows, seq_q, stride_dqm, stride_dqd, head_dim,
                (dq * scale).to(DQ.dtype.element_ty), BLOCK_D)


# ---- autotuning ----------------------------------------------------------------------------------------------

def _autotuned(kernel, name: str, key: list[str], reset_to_zero: list[str] | None = None):
    """`kernel` autotuned over the tiles of the running device's family (one fixed tile under the interpreter)."""
    if INTERPRETED:
        return triton.autotune([INTERPRETER_TILES[name]], key=key)(kernel)
    candidates = list({str(c): c for family in TILES[name].values() for size in family.values() for c in size}.values())

    def prune(configs, named_args, **kwargs):
        q = named_args["Q"]
        return tiles(name, device_arch(q), q.dtype, kwargs["BLOCK_D"])

    return triton.autotune(candidates, key=key, prune_configs_by={"early_config_prune": prune},
                           reset_to_zero=reset_to_zero)(kernel)


_KEY = ["seq_bucket", "BLOCK_D", "CAUSAL", "SEGMENTS"]
attn_fwd = _autotuned(_attn_fwd, "fwd", _KEY)
attn_bwd_kv = _autotuned(_attn_bwd_kv, "kv", [*_KEY, "ATOMIC_DQ"])
attn_bwd_kv_atomic = _autotuned(_attn_bwd_kv, "kv_atomic", [*_KEY, "ATOMIC_DQ"], reset_to_zero=["DQ"])
attn_bwd_q = _autotuned(_attn_bwd_q, "q", _KEY)


# ---- launches ------------------------------------------------------------------------------------------------

def grid(seq: int, block: str, heads: int):
    """The launch grid of a kernel with one program per block of `seq` rows (of the tile's `block` size) and per
    (batch, head) of `heads` = batch x heads: one axis, the blocks of a head consecutive, for CUDA allows 2^31 - 1
    programs on axis 0 but 65535 on axes 1 and 2, which batch x heads passes (e.g. 4096 x 32)."""
    return lambda meta: (triton.cdiv(seq, meta[block]) * heads,)


def block_d(head_dim: int) -> int:
    """Tile width for a head dim: 48 and 64 share the 64-wide kernels, 96 and 128 the 128-wide ones."""
    return triton.next_power_of_2(head_dim)


def supports(head_dim: int) -> bool:
    """Head dims the kernels take: multiples of 16 from 32 to 128 (what the compile check covers)."""
    return head_dim in ATTENTION_HEAD_DIMS


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _shapes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    """batch, n_heads, n_kv_heads, seq_q, seq_k."""
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]


def _heads(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    """n_heads and the GQA group size."""
    return q.shape[1], q.shape[1] // k.shape[1]


def _common(q, k, causal: bool, segments: bool) -> tuple[tuple, dict]:
    """The scalar tail shared by the attention kernels' arguments (seq_q, seq_k, seq_bucket, head_dim), and their
    constexprs."""
    seq_q, seq_k, head_dim = q.shape[2], k.shape[2], q.shape[3]
    constexprs = {"BLOCK_D": block_d(head_dim), "CAUSAL": causal, "SEGMENTS": segments,
                  "PRECISION": _precision(q.dtype)}
    return (seq_q, seq_k, triton.next_power_of_2(max(seq_q, seq_k, 16)), head_dim), constexprs


def fwd_args(q, k, v, o, lse, seg_start, seg_end, scale: float, causal: bool, segments: bool):
    seqs, constexprs = _common(q, k, causal, segments)
    args = (q, k, v, o, lse, seg_start, seg_end, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *_heads(q, k),
            *seqs, scale * LOG2E)
    return args, constexprs


def delta_args(o, do, delta):
    args = (o, do, delta, *o.stride(), *do.stride(), o.shape[1], o.shape[2], o.shape[3])
    return args, {"BLOCK_D": block_d(o.shape[3]), "BLOCK_M": DELTA_ROWS}


def kv_args(q, k, v, do, lse, delta, dk, dv, dq, seg_start, seg_end, scale: float, causal: bool, segments: bool,
            atomic_dq: bool):
    seqs, constexprs = _common(q, k, causal, segments)
    n_heads, group = _heads(q, k)
    args = (q, k, v, do, lse, delta, dk, dv, dq, seg_start, seg_end, *q.stride(), *k.stride(), *v.stride(),
            *do.stride(), *dk.stride(), *dv.stride(), n_heads, k.shape[1], group, *seqs, scale * LOG2E, scale)
    return args, dict(constexprs, ATOMIC_DQ=atomic_dq)


def q_args(q, k, v, do, lse, delta, dq, seg_start, seg_end, scale: float, causal: bool, segments: bool):
    seqs, constexprs = _common(q, k, causal, segments)
    args = (q, k, v, do, lse, delta, dq, seg_start, seg_end, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            *dq.stride(), *_heads(q, k), *seqs, scale * LOG2E, scale)
    return args, constexprs


def addressable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether 32-bit offsets reach every element of q, k, v and of the output, which is laid out [batch, seq, heads,
    dim] whatever q's layout (a contiguous [batch, heads, seq, dim] q passed where its output's offsets wrapped)."""
    return rows_addressable(q, k, v, _output_layout(q))


def _output_layout(q: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as attention's output for q (`_empty_like_layout`)."""
    return _empty_like_layout(torch.empty(q.shape, device="meta"))


def _empty_like_layout(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor with x's shape, in [batch, seq, heads, dim] memory order (a free transpose back)."""
    batch, heads, seq, dim = x.shape
    return torch.empty((batch, seq, heads, dim), dtype=x.dtype, device=x.device).transpose(1, 2)


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, segment_ids: torch.Tensor | None, deterministic: bool):
        batch, n_heads, _, seq_q, _ = _shapes(q, k)
        segments = segment_ids is not None
        if segments:
            seg_start, seg_end = run_bounds(segment_ids)
        else:
            seg_start = seg_end = torch.empty(0, dtype=torch.int32, device=q.device)
        o = _empty_like_layout(q)
        lse = torch.empty((batch, n_heads, seq_q), dtype=torch.float32, device=q.device)
        if o.numel():
            args, constexprs = fwd_args(q, k, v, o, lse, seg_start, seg_end, scale, causal, segments)
            attn_fwd[grid(seq_q, "BLOCK_M", batch * n_heads)](*args, **constexprs)
        ctx.save_for_backward(q, k, v, o, lse, seg_start, seg_end)
        ctx.causal, ctx.scale, ctx.segments, ctx.deterministic = causal, scale, segments, deterministic
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, seg_start, seg_end = ctx.saved_tensors
        do = do if rows_addressable(do) else do.contiguous()  # laid out as q (checked) once contiguous
        batch, n_heads, n_kv_heads, seq_q, seq_k = _shapes(q, k)
        common = {"scale": ctx.scale, "causal": ctx.causal, "segments": ctx.segments}
        delta = torch.empty_like(lse)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        if ctx.deterministic:
            dq = torch.empty_like(q)
            dq_acc = torch.empty(0, dtype=torch.float32, device=q.device)
        else:
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if q.numel():
            args, constexprs = delta_args(o, do, delta)
            _attn_bwd_delta[grid(seq_q, "BLOCK_M", batch * n_heads)](*args, **constexprs)
        if k.numel():
            kernel = attn_bwd_kv if ctx.deterministic else attn_bwd_kv_atomic
            args, constexprs = kv_args(q, k, v, do, lse, delta, dk, dv, dq_acc, seg_start, seg_end,
                                       atomic_dq=not ctx.deterministic, **common)
            kernel[grid(seq_k, "BLOCK_N", batch * n_kv_heads)](*args, **constexprs)
        if not ctx.deterministic:
            dq = dq_acc.to(q.dtype)
        elif q.numel():
            args, constexprs = q_args(q, k, v, do, lse, delta, dq, seg_start, seg_end, **common)
            attn_bwd_q[grid(seq_q, "BLOCK_M", batch * n_heads)](*args, **constexprs)
        return dq, dk, dv, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
              segment_ids: torch.Tensor | None = None, deterministic: bool = True) -> torch.Tensor:
    """softmax(q k^T * scale) v with grouped-query heads, bottom-right causal alignment and optional segment ids."""
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         "[batch, heads, seq, head_dim]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if not supports(q.shape[-1]):
        raise ValueError(f"attention: the Triton kernel takes head dims {HEAD_DIMS_TEXT}, got {q.shape[-1]}")
    check_dtypes("attention", q, k, v)
    check_rows_addressable("attention", q, k, v, _output_layout(q))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if scale <= 0:
        raise ValueError(f"attention: scale must be positive, got {scale}")
    return AttentionFunction.apply(q, k, v, causal, scale, segment_ids, deterministic)


# ---- the compile check's view --------------------------------------------------------------------------------

def launches(arch: int) -> list[Launch]:
    """Every launch configuration the dispatcher can choose on sm_<arch>, on meta tensors."""
    family = arch_family(divmod(arch, 10), SHARED_MEMORY_LIMIT[arch])
    out = []
    batch, heads, kv_heads, seq = 2, 8, 2, 256
    for dtype in KERNEL_DTYPES:
        for width, head_dims in BLOCK_DS.items():
            def t(*shape, dt=dtype):
                return torch.empty(shape, dtype=dt, device="meta")
            q, o, do = (t(batch, seq, heads, width).transpose(1, 2) for _ in range(3))
            k, v = (t(batch, seq, kv_heads, width).transpose(1, 2) for _ in range(2))
            lse, delta = t(batch, heads, seq, dt=torch.float32), t(batch, heads, seq, dt=torch.float32)
            dq_acc = t(batch, heads, seq, width, dt=torch.float32)
            seg = t(batch, seq, dt=torch.int32)
            labels = {"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dims}
            args, constexprs = delta_args(o, do, delta)
            out.append(Launch("attn_bwd_delta", _attn_bwd_delta, args, constexprs,
                              [triton.Config({}, num_warps=4, num_stages=1)], labels))
            for causal in (True, False):
                for segments in (False, True):
                    mode = dict(labels, causal=causal, segments=segments)
                    common = {"scale": 0.125, "causal": causal, "segments": segments}
                    args, constexprs = fwd_args(q, k, v, o, lse, seg, seg, **common)
                    out.append(Launch("attn_fwd", _attn_fwd, args, constexprs, tiles("fwd", family, dtype, width),
                                      mode))
                    for atomic in (False, True):
                        args, constexprs = kv_args(q, k, v, do, lse, delta, k, v, dq_acc, seg, seg, atomic_dq=atomic,
                                                   **common)
                        out.append(Launch("attn_bwd_kv_atomic_dq" if atomic else "attn_bwd_kv", _attn_bwd_kv, args,
                                          constexprs, tiles("kv_atomic" if atomic else "kv", family, dtype, width),
                                          mode))
                    args, constexprs = q_args(q, k, v, do, lse, delta, q, seg, seg, **common)
                    out.append(Launch("attn_bwd_q", _attn_bwd_q, args, constexprs, tiles("q", family, dtype, width),
                                      mode))
    return out
