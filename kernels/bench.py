"""Kernel benchmark: `python -m kernels.bench [--op NAME] [--dtype bf16|fp16|fp32]` on a CUDA GPU.

For each op and shape it prints forward and backward time (median of `triton.testing.do_bench`),
achieved GB/s (RMSNorm, RoPE, SwiGLU) or TFLOP/s (attention) and the share of the device peak
(copy bandwidth measured in the same run; dense TFLOP/s of the dtype from kernels.hardware), and the
speed-up of our kernel over torch eager, `torch.compile`, and for attention `F.scaled_dot_product_attention` with
its flash and cuDNN backends (and Liger-Kernel where installed); for packed sequences (segment ids) over
the dense block-diagonal mask ("eager") and the torch path (FlexAttention). Ratios > 1 mean ours is faster.
`--smoke` runs tiny shapes on the CPU (Triton interpreter, wall-clock timing) to check the tool itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels
from kernels import reference
from kernels.hardware import peak_tflops
from kernels.testing import packed_segment_ids

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    op: str
    shape: str
    inputs: Callable[[], list[torch.Tensor]]
    ours: Callable
    others: dict[str, Callable]
    work: float
    """Bytes moved (memory-bound ops) or FLOPs (attention) of the forward pass."""
    backward_work_ratio: float
    compute_bound: bool


def _timer(smoke: bool):
    if smoke:
        def wall(fn) -> float:
            fn()
            samples = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return statistics.median(samples) * 1e3
        return wall
    from triton.testing import do_bench  # noqa: PLC0415 - triton is optional (not installed off Linux)

    return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")


def _fwd_bwd(timer, fn, inputs) -> tuple[float, float]:
    """(forward ms, backward ms) of fn(*inputs); backward times autograd.grad with a fixed upstream gradient."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    forward = timer(lambda: fn(*leaves))
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]
    tensors = [x for x in leaves if x.requires_grad]
    backward = timer(lambda: torch.autograd.grad(outs, tensors, grads, retain_graph=True))
    return forward, backward


def _qkv(dev, dtype, b: int, h: int, hk: int, s: int, d: int) -> Callable[[], list[torch.Tensor]]:
    """A maker of random q `[b, h, s, d]`, k and v `[b, hk, s, d]`."""
    def make():
        return [torch.randn(b, heads, s, d, device=dev, dtype=dtype) for heads in (h, hk, hk)]
    return make


def _sdpa_with(backend) -> Callable:
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return run


def _attention_cases(dev, dtype, smoke) -> list[Case]:
    shapes = [(1, 2, 1, 64, 64)] if smoke else [
        (1, 32, 8, 4096, 128), (1, 32, 8, 8192, 128), (1, 32, 8, 16384, 128),  # LLaMA-3-8B-like
        (4, 8, 2, 4096, 64), (4, 8, 4, 4096, 96), (2, 16, 8, 8192, 64)]  # our recipes
    cases = []
    for b, h, hk, s, d in shapes:
        others = {"eager": reference.attention}
        if not smoke:
            others.update({"compile": torch.compile(reference.attention),
                           "sdpa-flash": _sdpa_with(SDPBackend.FLASH_ATTENTION),
                           "cudnn": _sdpa_with(SDPBackend.CUDNN_ATTENTION)})
        flops = 4 * b * h * s * s * d / 2  # causal: half the score matrix
        cases.append(Case("attention", f"b{b} h{h}/{hk} s{s} d{d}", _qkv(dev, dtype, b, h, hk, s, d),
                          _ours("attention"), others, flops, 2.5, True))
    return cases + _packed_attention_cases(dev, dtype, smoke)


def _packed_attention_cases(dev, dtype, smoke) -> list[Case]:
    """Packed SFT windows: samples of random lengths (seeded) filling each row, segment ids, causal."""
    shapes = [(1, 2, 1, 64, 64, 16)] if smoke else [(8, 8, 2, 4096, 64, 256), (4, 16, 8, 8192, 128, 512)]
    cases = []
    for b, h, hk, s, d, shortest in shapes:
        gen = torch.Generator().manual_seed(0)
        lengths = []
        for _ in range(b):
            row = []
            while sum(row) < s:
                row.append(min(int(torch.randint(shortest, 8 * shortest, (1,), generator=gen)), s - sum(row)))
            lengths.append(row)
        ids = packed_segment_ids(b, s, lengths, dev)
        others = {"eager": lambda q, k, v, ids=ids: reference.attention(q, k, v, segment_ids=ids),
                  "torch": lambda q, k, v, ids=ids: kernels.attention(q, k, v, segment_ids=ids, backend="torch")}
        flops = 4 * h * d * sum(n * n for row in lengths for n in row) / 2
        cases.append(Case("attention", f"packed b{b} h{h}/{hk} s{s} d{d}", _qkv(dev, dtype, b, h, hk, s, d),
                          lambda q, k, v, ids=ids: kernels.attention(q, k, v, segment_ids=ids, backend="triton"),
                          others, flops, 2.5, True))
    return cases


def _ours(name: str) -> Callable:
    op = getattr(kernels, name)
    return lambda *args: op(*args, backend="triton")


def _memory_cases(dev, dtype, smoke) -> list[Case]:
    rms_norm, apply_rope, swiglu = _ours("rms_norm"), _ours("apply_rope"), _ours("swiglu")
    size = torch.finfo(dtype).bits // 8
    cases = []
    for rows, hidden in ([(64, 123)] if smoke else [(16384, 512), (16384, 768), (16384, 1024), (16384, 4096)]):
        def make(rows=rows, hidden=hidden):
            return [torch.randn(rows, hidden, device=dev, dtype=dtype), torch.randn(hidden, device=dev, dtype=dtype)]
        others = {"eager": lambda x, w: reference.rms_norm(x, w, 1e-6)}
        if not smoke:
            others["compile"] = torch.compile(others["eager"])
            if importlib.util.find_spec("liger_kernel"):
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415 - optional

                others["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
        cases.append(Case("rmsnorm", f"{rows}x{hidden}", make, lambda x, w: rms_norm(x, w, 1e-6), others,
                          2 * rows * hidden * size, 1.5, False))
    for b, h, hk, s, d in ([(1, 2, 1, 16, 64)] if smoke else [(1, 32, 8, 4096, 128), (4, 8, 2, 4096, 64),
                                                              (4, 8, 4, 4096, 96), (1, 32, 8, 16384, 128)]):
        half = d // 2
        angles = torch.outer(torch.arange(s, device=dev, dtype=torch.float32),
                             torch.rand(half, device=dev, dtype=torch.float32))
        cos, sin = angles.cos(), angles.sin()

        qkv = _qkv(dev, dtype, b, h, hk, s, d)
        others = {"eager": lambda q, k, cos=cos, sin=sin: reference.apply_rope(q, k, cos, sin)}
        if not smoke:
            others["compile"] = torch.compile(others["eager"])
        cases.append(Case("rope", f"b{b} h{h}/{hk} s{s} d{d}", lambda qkv=qkv: qkv()[:2],
                          lambda q, k, cos=cos, sin=sin: apply_rope(q, k, cos, sin), others,
                          2 * b * (h + hk) * s * d * size, 1.0, False))
    for rows, hidden in ([(8, 100)] if smoke else [(16384, 1408), (16384, 2048), (16384, 14336)]):
        def make(rows=rows, hidden=hidden):
            return [torch.randn(rows, hidden, device=dev, dtype=dtype) for _ in range(2)]
        others = {"eager": reference.swiglu}
        if not smoke:
            others["compile"] = torch.compile(reference.swiglu)
        cases.append(Case("swiglu", f"{rows}x{hidden}", make, swiglu, others, 3 * rows * hidden * size, 5 / 3, False))
    return cases


def _copy_bandwidth(timer, dev) -> float:
    x = torch.empty(1 << 28 if dev == "cuda" else 1 << 20, device=dev, dtype=torch.uint8)
    y = torch.empty_like(x)
    return 2 * x.numel() / (timer(lambda: y.copy_(x)) * 1e-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=["all", "rmsnorm", "rope", "attention", "swiglu"], default="all")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        dev, dtype = "cpu", torch.float32
    elif not torch.cuda.is_available():
        print("kernels.bench: no CUDA device; the benchmark times kernels on a GPU "
              "(correctness runs on the CPU in tests/test_kernels.py; --smoke checks this tool)", file=sys.stderr)
        return 2
    else:
        dev, dtype = "cuda", DTYPES[args.dtype]
    timer = _timer(args.smoke)
    bandwidth = _copy_bandwidth(timer, dev)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    peak_flops = peak_tflops(name, dtype) * 1e12
    print(f"device {name}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s; dense {str(dtype).removeprefix('torch.')} peak "
          f"{peak_flops / 1e12:,.0f} TFLOP/s; dtype {dtype}; times are medians in ms; xNAME = NAME time / ours")
    cases = _memory_cases(dev, dtype, args.smoke) + _attention_cases(dev, dtype, args.smoke)
    cases = [c for c in cases if args.op in ("all", c.op)]
    header = f"{'op':<10}{'shape':<30}{'pass':<5}{'ms':>9}{'rate':>14}{'% peak':>8}   vs others"
    print(header)
    print("-" * len(header))
    for case in cases:
        inputs = case.inputs()
        ours = _fwd_bwd(timer, case.ours, inputs)
        others = {}
        for other, fn in case.others.items():
            try:
                others[other] = _fwd_bwd(timer, fn, inputs)
            except (RuntimeError, torch.OutOfMemoryError) as exc:  # unsupported backend or shape, OOM
                others[other] = str(exc).splitlines()[0][:40]
            if dev == "cuda":
                torch.cuda.empty_cache()
        for i, direction in enumerate(("fwd", "bwd")):
            work = case.work * (case.backward_work_ratio if i else 1.0)
            rate = work / (ours[i] * 1e-3)
            peak = peak_flops if case.compute_bound else bandwidth
            unit = f"{rate / 1e12:9.1f} TF/s" if case.compute_bound else f"{rate / 1e9:9.0f} GB/s"
            ratios = "  ".join(f"x{k} {v[i] / ours[i]:.2f}" if isinstance(v, tuple) else f"x{k} n/a"
                               for k, v in others.items())
            print(f"{case.op:<10}{case.shape:<30}{direction:<5}{ours[i]:9.3f}{unit:>14}{100 * rate / peak:7.0f}%   "
                  f"{ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
