"""DeepSpeed's Muon functions are compiled on first use, not at every job's start (`llm.runtime.deferred_compile`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from llm.runtime.deferred_compile import compile_on_first_call


def _eager_compile_counting(monkeypatch) -> list[str]:
    """torch.compile with the eager backend (no C++ build), recording the name of each function it compiles."""
    compiled, real_compile = [], torch.compile

    def counting(fn, **options):
        compiled.append(fn.__name__)
        return real_compile(fn, backend="eager")

    monkeypatch.setattr(torch, "compile", counting)
    return compiled


def test_a_function_is_compiled_at_its_first_call_and_traced_into_a_compiled_caller(monkeypatch):
    compiled = _eager_compile_counting(monkeypatch)

    @compile_on_first_call
    def double(x):
        return x * 2

    @compile_on_first_call
    def double_plus_one(x):
        return double(x) + 1

    assert compiled == [] and double.__name__ == "double"
    x = torch.arange(4.0)
    assert torch.equal(double_plus_one(x), x * 2 + 1)
    assert compiled == ["double_plus_one"]  # `double` ran inside its compiled caller, not compiled on its own
    assert torch.equal(double(x), x * 2) and torch.equal(double_plus_one(x), x * 2 + 1)
    assert compiled == ["double_plus_one", "double"]  # each compiled once


BUILD_AN_ENGINE = textwrap.dedent("""
    import os, sys
    import torch
    from llm.config import build_config
    from llm.model import Transformer
    from llm.runtime.distributed import setup_distributed
    from llm.runtime.rank_env import free_port
    from llm.train.ds_config_file import load_ds_config
    from llm.train.engine import build_engine, resolve_ds_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    cfg = build_config("demo", ["train.precision=fp32", "model.vocab_size=64"])
    setup_distributed(60)
    raw, source = load_ds_config(None, "pretrain")
    build_engine(Transformer(cfg.model), cfg, resolve_ds_config(raw, cfg, 1, source, None), lambda step: 1.0)
    print("muon imported:", "deepspeed.runtime.zero.muon.original_muon" in sys.modules)
    print("inductor compiler imported:", "torch._inductor.compile_fx" in sys.modules)

    from deepspeed.runtime.zero.muon import original_muon
    real_compile = torch.compile
    torch.compile = lambda fn, **options: real_compile(fn, backend="eager")
    grad, momentum = torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    expected = original_muon.muon_update.__wrapped__(grad.clone(), momentum.clone(), is_expert_group=True)
    print("same update:", torch.equal(original_muon.muon_update(grad.clone(), momentum.clone(), is_expert_group=True),
                                      expected))
""")


def test_building_an_engine_leaves_torch_inductor_unimported_and_muon_still_works():
    """DeepSpeed imports its Muon module while building the engine; before, that import compiled Muon's functions,
    which imported TorchInductor (1.5 s of each rank's start). Muon's update is still the same, compiled at first
    use (here with the eager backend, which needs no C++ compiler)."""
    result = subprocess.run([sys.executable, "-c", BUILD_AN_ENGINE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-3:] == ["muon imported: True", "inductor compiler imported: False",
                                              "same update: True"], result.stdout
