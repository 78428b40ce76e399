"""Flash-style attention (FlashAttention-2 schedule), forward and backward, with grouped-query heads.

- q `[batch, n_heads, seq_q, head_dim]`, k and v `[batch, n_kv_heads, seq_k, head_dim]`, any strides;
  query head h reads key/value head h // (n_heads // n_kv_heads): repeated K/V are never materialised.
- Forward: per (query block, batch x head) an online softmax over key blocks; no seq_q x seq_k matrix
  is ever stored. The log-sum-exp of each query row is kept (fp32) for backward.
- Causal masking is aligned bottom-right: query i sees keys j <= i + (seq_k - seq_q), as when a
  short query (decoding, chunked prefill) follows a longer cached key sequence. A query row that
  sees no key gives 0, not NaN.
- Backward: delta = rowsum(dO * O); one kernel walks key blocks and sums dK, dV over every query
  head of the group in registers; another walks query blocks for dQ. No atomics: deterministic.
Exponentials use exp2 with log2(e) folded into the scale. Dot products accumulate in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.runtime import interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om,
              n_heads, group, seq_q, seq_k, head_dim, qk_scale,
              CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(rows[:, None] < seq_q) & d_ok[None, :], other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    diag = seq_k - seq_q
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, (start_m + 1) * BLOCK_M + diag)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=(cols[None, :] < seq_k) & d_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        valid = cols[None, :] < seq_k
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=(cols[:, None] < seq_k) & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=(rows[:, None] < seq_q) & d_ok[None, :])
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(LSE + bh * seq_q + rows, lse, mask=rows < seq_q)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom,
                   stride_dkb, stride_dkh, stride_dkn,
                   n_heads, n_kv_heads, group, seq_q, seq_k, head_dim, qk_scale, scale,
                   CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr):
    start_n = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    kv_mask = (cols[:, None] < seq_k) & d_ok[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    diag = seq_k - seq_q
    lo = 0
    if CAUSAL:  # the first query row that sees this key block
        lo = tl.maximum(start_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
    for g in range(0, group):
        h = hk * group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        stat_base = (b * n_heads + h) * seq_q
        for start_m in range(lo, seq_q, BLOCK_M):
            rows = start_m + offs_m
            row_mask = rows < seq_q
            q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                        mask=row_mask[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_base + rows[:, None] * stride_dom + offs_d[None, :],
                         mask=row_mask[:, None] & d_ok[None, :], other=0.0)
            lse2 = tl.load(LSE + stat_base + rows, mask=row_mask, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + stat_base + rows, mask=row_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            valid = row_mask[:, None] & (cols[None, :] < seq_k)
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + diag)
            p = tl.where(valid, tl.exp2(s - lse2[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out = b * stride_dkb + hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom,
                 stride_dqb, stride_dqh, stride_dqm,
                 n_heads, group, seq_q, seq_k, head_dim, qk_scale, scale,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 PRECISION: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    row_mask = rows < seq_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_mask[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :],
                 mask=row_mask[:, None] & d_ok[None, :], other=0.0)
    lse2 = tl.load(LSE + bh * seq_q + rows, mask=row_mask, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * seq_q + rows, mask=row_mask, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    diag = seq_k - seq_q
    hi = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, (start_m + 1) * BLOCK_M + diag)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < seq_k) & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        valid = row_mask[:, None] & (cols[None, :] < seq_k)
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + diag)
        p = tl.where(valid, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_mask[:, None] & d_ok[None, :])


def _blocks(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps): small tiles under the interpreter, GPU tiles otherwise."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if interpreting():
        return 32, 32, block_d, 4
    return 64, 64, block_d, 4 if block_d <= 64 else 8


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        batch, n_heads, seq_q, head_dim = q.shape
        n_kv_heads, seq_k = k.shape[1], k.shape[2]
        o = torch.empty((batch, n_heads, seq_q, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, n_heads, seq_q), dtype=torch.float32, device=q.device)
        block_m, block_n, block_d, warps = _blocks(head_dim)
        if o.numel():
            _attn_fwd[(triton.cdiv(seq_q, block_m), batch * n_heads)](
                q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride()[:3],
                n_heads, n_heads // n_kv_heads, seq_q, seq_k, head_dim, scale * LOG2E,
                CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                PRECISION=_precision(q.dtype), num_warps=warps, num_stages=2)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        batch, n_heads, seq_q, head_dim = q.shape
        n_kv_heads, seq_k = k.shape[1], k.shape[2]
        group = n_heads // n_kv_heads
        delta = (do.float() * o.float()).sum(-1)
        dq = torch.empty((batch, n_heads, seq_q, head_dim), dtype=q.dtype, device=q.device)
        dk = torch.empty((batch, n_kv_heads, seq_k, head_dim), dtype=k.dtype, device=k.device)
        dv = torch.empty((batch, n_kv_heads, seq_k, head_dim), dtype=v.dtype, device=v.device)
        block_m, block_n, block_d, warps = _blocks(head_dim)
        common = dict(CAUSAL=ctx.causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                      PRECISION=_precision(q.dtype), num_warps=warps, num_stages=2)
        if dk.numel():
            _attn_bwd_dkdv[(triton.cdiv(seq_k, block_n), batch * n_kv_heads)](
                q, k, v, do, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride()[:3],
                *dk.stride()[:3], n_heads, n_kv_heads, group, seq_q, seq_k, head_dim, ctx.scale * LOG2E, ctx.scale,
                **common)
        if dq.numel():
            _attn_bwd_dq[(triton.cdiv(seq_q, block_m), batch * n_heads)](
                q, k, v, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride()[:3],
                *dq.stride()[:3], n_heads, group, seq_q, seq_k, head_dim, ctx.scale * LOG2E, ctx.scale, **common)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None) -> torch.Tensor:
    """Softmax(q k^T * scale) v with grouped-query heads and bottom-right causal alignment."""
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         "[batch, heads, seq, head_dim]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return AttentionFunction.apply(q, k, v, causal, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
