"""DeepSpeed's Muon optimizer compiled on its first step instead of on every job's start.

DeepSpeed's ZeRO and bf16 optimizers import its Muon module while they are built, on every job, to check whether
the optimizer is Muon. That module decorates three functions with `torch.compile`, and decorating imports
TorchInductor: 1.5 s of every rank's start on a 2-core CPU (measured; about a quarter of a rank's start), for an
optimizer most runs do not use. `defer_muon_compile` makes DeepSpeed's decorator compile a function on its first
call instead, so a run with `"optimizer": {"type": "Muon"}` gets the same compiled functions, one step later.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def compile_on_first_call(fn: Callable) -> Callable:
    """`torch.compile(fn)`, made when the function is first called outside a compiled region. Called from
    another compiled function, it is traced into that one, as a function `torch.compile` decorated would be."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def defer_muon_compile() -> None:
    """Let DeepSpeed's `compiler.compile()` (used by its Muon module only) give `compile_on_first_call`; a no-op
    once the Muon module is imported (its functions are compiled already)."""
    from deepspeed.runtime import compiler  # noqa: PLC0415 - once the caller has chosen the accelerator

    if MUON_MODULE not in sys.modules:
        compiler.compile = lambda: compile_on_first_call
