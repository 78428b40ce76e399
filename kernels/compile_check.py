"""Compile every Triton kernel for real GPUs, on any machine: `python -m kernels.compile_check [--arch 80,86,90]`.

For each kernel, each launch configuration the dispatcher can choose (dtypes fp32/bf16/fp16; attention head
dims 32/48/64/96/128, causal or not, with or without segment ids, forward and backward, every autotune tile
of the architecture's family, `runtime.arch_family`; RMSNorm row widths 64..16384; RoPE head dims with offsets or
positions) and each architecture, the kernel is compiled to a cubin by Triton with the ptxas that ships inside the
triton wheel (no GPU, no CUDA install needed). One row per kernel x configuration x arch gives registers per thread,
spilled bytes (ptxas' spill stores / loads) and shared memory. The exit status is 1 when a compile fails or
a configuration needs more shared memory than the architecture allows, 0 otherwise; spills are reported, not
fatal (kernels/BENCHMARKS.md justifies the ones that remain).

Arguments are bound exactly as `JITFunction.run` binds them on a device (same specialisation of pointer
alignment, unit strides and divisibility by 16), using meta tensors for the tensors: the cubins are the ones
a launch would build. `--quick` compiles a representative subset (what the CI test runs).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib
import io
import multiprocessing
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernels.hardware import SHARED_MEMORY_LIMIT
from kernels.runtime import INTERPRET_ENV, Launch, interpreting

MODULES = ("flash_attention", "rmsnorm", "rope", "swiglu_gate")
ARCHS = (80, 86, 90)  # one of each tile family: A100, A10 / RTX 3090 (sm_89 compiles alike), Hopper
# --quick: every kernel in bf16 at the widest head dims (the most registers and shared memory), attention causal as
# the model launches it (with and without segment ids), one RMSNorm width, with the first tile of each list: 17
# compiles an arch
QUICK = {"dtype": {"bfloat16"}, "head_dim": {"96,128"}, "hidden": {4096}, "causal": {True}}


@dataclass
class Row:
    arch: int
    kernel: str
    labels: dict
    tile: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared: int = 0
    transposes: int = 0
    """Register transposes (`tt.trans` of a tensor in registers) in the TTGIR; the attention kernels have none."""
    error: str = ""

    @property
    def over_shared_limit(self) -> bool:
        return self.shared > SHARED_MEMORY_LIMIT[self.arch]

    @property
    def status(self) -> str:
        if self.error:
            return "ERROR " + self.error
        if self.over_shared_limit:
            return f"SHARED MEMORY OVER {SHARED_MEMORY_LIMIT[self.arch] // 1024} KiB"
        return "spills" if self.spill_stores or self.spill_loads else "ok"


def _describe(labels: dict) -> tuple[str, str, str]:
    """(dtype, size, variant) columns from a launch's labels."""
    size = str(labels.get("head_dim", labels.get("hidden", "")))
    variant = []
    if "causal" in labels:
        variant.append("causal" if labels["causal"] else "full")
    if labels.get("segments"):
        variant.append("segments")
    if "positions" in labels:
        variant.append("positions" if labels["positions"] else "offset")
    return labels.get("dtype", ""), size, "+".join(variant)


def _tile(config) -> str:
    tiles = " ".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in config.kwargs.items())
    return f"{tiles} w{config.num_warps} s{config.num_stages}".strip()


@functools.cache
def _launches(module: str, arch: int) -> list[Launch]:
    return importlib.import_module(f"kernels.{module}").launches(arch)


JIT_COMPILATION_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")
"""knobs.compilation settings that Triton's JITFunction.run passes to the compiler as options: those of them this
Triton has (3.6 has the first only)."""


def compile_launch(launch: Launch, config, arch: int) -> Row:
    """Compile one launch with one config for sm_<arch>; registers, spills and shared memory from ptxas."""
    row = Row(arch, launch.kernel, launch.labels, _tile(config))
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = launch.fn
    kwargs = dict(launch.constexprs, **config.all_kwargs(), debug=bool(fn.debug) or knobs.runtime.debug,
                  **{name: getattr(knobs.compilation, name) for name in JIT_COMPILATION_KNOBS
                     if hasattr(knobs.compilation, name)})
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), knobs.compilation.scope(), knobs.nvidia.scope():
            knobs.compilation.always_compile = True
            knobs.nvidia.dump_ptxas_log = True
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 -- a compile error of any type is a result to report
        row.error = " ".join(str(exc).split())[:200]
        return row
    ptxas = log.getvalue()
    row.shared = kernel.metadata.shared
    row.transposes = kernel.asm["ttgir"].count("tt.trans ")
    if found := re.search(r"Used (\d+) registers", ptxas):
        row.registers = int(found.group(1))
    if found := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas):
        row.spill_stores, row.spill_loads = int(found.group(1)), int(found.group(2))
    return row


def _compile_task(task: tuple[str, int, int, int]) -> Row:
    module, arch, launch_index, config_index = task
    launch = _launches(module, arch)[launch_index]
    return compile_launch(launch, launch.configs[config_index], arch)


def _quick(launch: Launch) -> bool:
    return all(launch.labels[key] in allowed for key, allowed in QUICK.items() if key in launch.labels)


def tasks(archs: list[int], kernels: set[str] | None, quick: bool) -> list[tuple[str, int, int, int]]:
    out = []
    for arch in archs:
        for module in MODULES:
            for i, launch in enumerate(_launches(module, arch)):
                if (kernels and launch.kernel not in kernels) or (quick and not _quick(launch)):
                    continue
                out.extend((module, arch, i, j) for j in range(1 if quick else len(launch.configs)))
    return out


def _format(row: Row) -> str:
    dtype, size, variant = _describe(row.labels)
    spill = f"{row.spill_stores}/{row.spill_loads}"
    return (f"sm_{row.arch:<4}{row.kernel:<23}{dtype:<10}{size:>7}  {variant:<18}{row.tile:<20}{row.registers:>5}"
            f"{spill:>12}{row.shared / 1024:>9.1f}{row.transposes:>6}  {row.status}")


HEADER = (f"{'arch':<7}{'kernel':<23}{'dtype':<10}{'size':>7}  {'variant':<18}{'tile':<20}{'regs':>5}"
          f"{'spill st/ld':>12}{'smem KiB':>9}{'trans':>6}  status")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)),
                        help=f"compute capabilities to compile for, of {sorted(SHARED_MEMORY_LIMIT)} "
                             f"(default {','.join(map(str, ARCHS))})")
    parser.add_argument("--kernel", action="append", help="only this kernel (repeatable), e.g. attn_fwd")
    parser.add_argument("--quick", action="store_true", help="a representative subset (the CI test)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    args = parser.parse_args(argv)
    if interpreting():
        print(f"kernels.compile_check: {INTERPRET_ENV}=1 makes Triton interpret instead of compile; unset it",
              file=sys.stderr)
        return 2
    try:
        archs = [int(a) for a in args.arch.split(",")]
    except ValueError:
        archs = []
    if not archs or any(a not in SHARED_MEMORY_LIMIT for a in archs):
        print(f"kernels.compile_check: --arch takes a comma-separated list of {sorted(SHARED_MEMORY_LIMIT)}",
              file=sys.stderr)
        return 2
    work = tasks(archs, set(args.kernel) if args.kernel else None, args.quick)
    if not work:
        print("kernels.compile_check: no launch matches --kernel", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = []
    print(HEADER)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    with tempfile.TemporaryDirectory(prefix="compile-check-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # the spawned workers inherit it; nothing stays behind
        with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs), multiprocessing.get_context("spawn")) as pool:
            for row in pool.map(_compile_task, work, chunksize=4):
                rows.append(row)
                print(_format(row), flush=True)
    failed = [r for r in rows if r.error or r.over_shared_limit]
    spilled = [r for r in rows if r.spill_stores or r.spill_loads]
    compiled = [r for r in rows if not r.error]
    print(f"{len(rows)} compiles for {', '.join(f'sm_{a}' for a in archs)} in {time.perf_counter() - start:.0f} s "
          f"({max(1, args.jobs)} processes): {len(failed)} failed, {len(spilled)} spill, max registers "
          f"{max((r.registers for r in compiled), default=0)}, max shared memory "
          f"{max((r.shared for r in compiled), default=0) / 1024:.1f} KiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
