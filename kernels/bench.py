"""Kernel benchmark: `python -m kernels.bench [--op NAME] [--dtype bf16|fp16|fp32]` on a CUDA GPU.

For each op and shape it prints forward and backward time (median of `triton.testing.do_bench`),
achieved GB/s (RMSNorm, RoPE, SwiGLU) or TFLOP/s (attention) and the share of the device peak
(copy bandwidth measured in the same run; dense bf16 TFLOP/s from a table), and the speed-up of our
kernel over torch eager, `torch.compile`, and for attention `F.scaled_dot_product_attention` with
its flash and cuDNN backends (and Liger-Kernel where installed). Ratios > 1 mean ours is faster.
`--smoke` runs tiny shapes on the CPU (Triton interpreter, wall-clock timing) to check the tool itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PEAK_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "H800": 989.5, "A100": 312.0, "L40S": 362.0, "4090": 165.2}
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
    from triton.testing import do_bench

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


def _attention_cases(dev, dtype, smoke) -> list[Case]:
    from kernels.flash_attention import attention
    from kernels.reference import attention as eager

    shapes = [(1, 2, 1, 64, 64)] if smoke else [
        (1, 32, 8, 4096, 128), (1, 32, 8, 8192, 128), (1, 32, 8, 16384, 128),  # LLaMA-3-8B-like
        (4, 8, 2, 4096, 64), (4, 8, 4, 4096, 96), (2, 16, 8, 8192, 64)]  # our recipes
    cases = []
    for b, h, hk, s, d in shapes:
        def make(b=b, h=h, hk=hk, s=s, d=d):
            return [torch.randn(b, h, s, d, device=dev, dtype=dtype), torch.randn(b, hk, s, d, device=dev, dtype=dtype),
                    torch.randn(b, hk, s, d, device=dev, dtype=dtype)]
        others = {"eager": eager}
        if not smoke:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def sdpa_with(backend):
                def run(q, k, v):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
                return run
            others.update({"compile": torch.compile(eager), "sdpa-flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
                           "cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION)})
        flops = 4 * b * h * s * s * d / 2  # causal: half the score matrix
        cases.append(Case("attention", f"b{b} h{h}/{hk} s{s} d{d}", make, attention, others, flops, 2.5, True))
    return cases


def _memory_cases(dev, dtype, smoke) -> list[Case]:
    from kernels import reference
    from kernels.rmsnorm import rms_norm
    from kernels.rope import apply_rope
    from kernels.swiglu_gate import swiglu

    size = torch.finfo(dtype).bits // 8
    cases = []
    for rows, hidden in ([(64, 123)] if smoke else [(16384, 512), (16384, 768), (16384, 1024), (16384, 4096)]):
        def make(rows=rows, hidden=hidden):
            return [torch.randn(rows, hidden, device=dev, dtype=dtype), torch.randn(hidden, device=dev, dtype=dtype)]
        others = {"eager": lambda x, w: reference.rms_norm(x, w, 1e-6)}
        if not smoke:
            others["compile"] = torch.compile(others["eager"])
            if importlib.util.find_spec("liger_kernel"):
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction

                others["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
        cases.append(Case("rmsnorm", f"{rows}x{hidden}", make, lambda x, w: rms_norm(x, w, 1e-6), others,
                          2 * rows * hidden * size, 1.5, False))
    for b, h, hk, s, d in ([(1, 2, 1, 16, 64)] if smoke else [(1, 32, 8, 4096, 128), (4, 8, 2, 4096, 64),
                                                              (4, 8, 4, 4096, 96), (1, 32, 8, 16384, 128)]):
        half = d // 2
        angles = torch.outer(torch.arange(s, device=dev, dtype=torch.float32),
                             torch.rand(half, device=dev, dtype=torch.float32))
        cos, sin = angles.cos(), angles.sin()

        def make(b=b, h=h, hk=hk, s=s, d=d):
            return [torch.randn(b, h, s, d, device=dev, dtype=dtype), torch.randn(b, hk, s, d, device=dev, dtype=dtype)]
        others = {"eager": lambda q, k, cos=cos, sin=sin: reference.apply_rope(q, k, cos, sin)}
        if not smoke:
            others["compile"] = torch.compile(others["eager"])
        cases.append(Case("rope", f"b{b} h{h}/{hk} s{s} d{d}", make,
                          lambda q, k, cos=cos, sin=sin: apply_rope(q, k, cos, sin), others,
                          2 * b * (h + hk) * s * d * size, 1.0, False))
    for rows, hidden in ([(8, 100)] if smoke else [(16384, 1408), (16384, 2048), (16384, 14336)]):
        def make(rows=rows, hidden=hidden):
            return [torch.randn(rows, hidden, device=dev, dtype=dtype), torch.randn(rows, hidden, device=dev, dtype=dtype)]
        others = {"eager": reference.swiglu}
        if not smoke:
            others["compile"] = torch.compile(reference.swiglu)
        cases.append(Case("swiglu", f"{rows}x{hidden}", make, swiglu, others, 3 * rows * hidden * size, 5 / 3, False))
    return cases


def _copy_bandwidth(timer, dev) -> float:
    x = torch.empty(1 << 28, device=dev, dtype=torch.uint8) if dev == "cuda" else torch.empty(1 << 20, dtype=torch.uint8)
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
    peak_flops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), math.nan) * 1e12
    print(f"device {name}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s; dense bf16 peak "
          f"{peak_flops / 1e12:,.0f} TFLOP/s; dtype {dtype}; times are medians in ms; xNAME = NAME time / ours")
    cases = _memory_cases(dev, dtype, args.smoke) + _attention_cases(dev, dtype, args.smoke)
    cases = [c for c in cases if args.op in ("all", c.op)]
    header = f"{'op':<10}{'shape':<24}{'pass':<5}{'ms':>9}{'rate':>14}{'% peak':>8}   vs others"
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
            print(f"{case.op:<10}{case.shape:<24}{direction:<5}{ours[i]:9.3f}{unit:>14}{100 * rate / peak:7.0f}%   {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
