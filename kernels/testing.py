"""Checks shared by the interpreter tests and the GPU tests (tests/test_kernels*.py): kernel vs reference vs oracle.

Criterion: with the reference computed in float64 as the oracle, the kernel's max error is at most `factor`
times the error of the same-dtype reference (2 forward, 3 backward), plus a small floor scaled by the
output's magnitude when that exceeds 1 (one rounding of a value near 8 in fp16 is ~4e-3), so a lucky
reference on a tiny tensor is no failure. Backward runs twice and must be bitwise identical.
"""

from __future__ import annotations

import random

import torch
from torch.overrides import TorchFunctionMode

from kernels.segments import same_segment

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def random_seed() -> int:
    """A fresh seed, set for torch and returned (tests put it in every message)."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    return seed


class _NaNFilled(TorchFunctionMode):
    """Fills every float tensor torch.empty / empty_like returns with NaN."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.empty, torch.empty_like) and out.is_floating_point():
            out.fill_(float("nan"))
        return out


def nan_filled_allocations() -> TorchFunctionMode:
    """Every float tensor torch.empty / empty_like allocates inside starts as NaN, so an element a kernel fails
    to write shows up. A torch function mode, not torch.empty replaced: a `torch.device(...)` block first entered
    while it was replaced kept the replacement as the constructor it puts on its device, and for the rest of the
    process torch.empty under `torch.device("meta")` made real tensors (tests/test_from_weights.py failed after
    tests/test_kernels.py in one worker)."""
    return _NaNFilled()


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, oracle: torch.Tensor, factor: float, floor: float,
                seed: int) -> None:
    assert not torch.isnan(got).any(), f"{name}: NaN in output (unwritten element?) seed={seed}"
    got, ref, oracle = got.double(), ref.double(), oracle.double()
    err, ref_err = (got - oracle).abs().max().item(), (ref - oracle).abs().max().item()
    floor *= max(1.0, oracle.abs().max().item())
    assert err <= factor * ref_err + floor, f"{name}: error {err:.3g} vs reference {ref_err:.3g} seed={seed}"


def compare(op_kernel, op_ref, inputs: list, dtype: torch.dtype, seed: int, deterministic: bool = True) -> None:
    """Forward and backward of op_kernel vs op_ref (same dtype), both against op_ref in float64. Non-tensor
    inputs pass through; integer tensors pass through unchanged (segment ids, positions)."""
    runs = {}
    for tag, op, cast in (("kernel", op_kernel, dtype), ("ref", op_ref, dtype), ("oracle", op_ref, torch.float64)):
        xs = [x.detach().to(cast).requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x
              for x in inputs]
        out = op(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator(device=outs[0].device).manual_seed(seed)
        grads_out = [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float64).to(o.dtype)
                     for o in outs]
        tensors = [x for x in xs if torch.is_tensor(x) and x.requires_grad]
        grads = torch.autograd.grad(outs, tensors, grads_out, retain_graph=True)
        if tag == "kernel" and deterministic:
            again = torch.autograd.grad(outs, tensors, grads_out)
            for g1, g2 in zip(grads, again):
                assert torch.equal(g1, g2), f"backward not deterministic, seed={seed}"
        runs[tag] = (outs, grads)
    for kind, index, factor in (("output", 0, 2.0), ("grad", 1, 3.0)):
        for i, (got, ref, oracle) in enumerate(zip(*(runs[t][index] for t in ("kernel", "ref", "oracle")))):
            check_close(f"{kind} {i}", got, ref, oracle, factor, FLOOR[dtype], seed)


def oracle_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Dense attention that, like the kernels, gives 0 (not NaN) for a row that sees no key; a segment is a run of
    equal ids."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(seq_k - seq_q)
    if segment_ids is not None:
        visible = visible & same_segment(segment_ids)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return weights @ v


def packed_segment_ids(batch: int, seq: int, lengths: list[list[int]], device: str | torch.device = "cpu"):
    """Segment ids 1, 2, ... for samples of the given lengths per row, padding (id 0) after them."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    for row, row_lengths in enumerate(lengths):
        position = 0
        for segment, length in enumerate(row_lengths, start=1):
            ids[row, position:position + length] = segment
            position += length
    return ids
