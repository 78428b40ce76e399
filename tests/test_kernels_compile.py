"""The compile check (`python -m kernels.compile_check`): Triton kernels compiled for sm_80, sm_86, sm_90 (and
Blackwell's sm_100, sm_120) on a CPU.

Each test runs it in its own process: compiling needs Triton in compiled mode, and this pytest process runs
Triton's interpreter (tests/test_kernels.py sets it up; see kernels.runtime).
"""

import os
import subprocess
import sys
import textwrap

KERNELS = {"attn_fwd", "attn_bwd_delta", "attn_bwd_kv", "attn_bwd_kv_atomic_dq", "attn_bwd_q", "rmsnorm_fwd",
           "rmsnorm_bwd", "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd"}


def _run(*args, script=None, timeout=900):
    """`python -m kernels.compile_check ARGS`, or `python SCRIPT`, with Triton in compiled mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(script)] if script else [sys.executable, "-m", "kernels.compile_check", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def test_quick_compile_check_passes_for_each_tile_family_with_every_kernel():
    """sm_86 (99 KiB of shared memory a block) is checked too: it got sm_80's tiles, one of which needs 112 KiB."""
    result = _run("--quick")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines()[1:-1]]
    for arch in ("sm_80", "sm_86", "sm_90"):
        assert {row[1] for row in rows if row[0] == arch} == KERNELS
    assert all("ERROR" not in row for row in rows)
    assert all(int(row[-5]) > 0 for row in rows)  # registers, as ptxas reported them
    assert all(row[-2] == "0" for row in rows if row[1].startswith("attn_")), "a register transpose in attention"
    # the default attention kernels' first tiles keep everything in registers (only the atomic-dQ option spills)
    assert all(row[-4] == "0/0" for row in rows if row[1] in ("attn_fwd", "attn_bwd_kv", "attn_bwd_q")), rows
    assert "0 failed" in result.stdout.splitlines()[-1]


def test_blackwell_compiles_with_the_tiles_of_its_family():
    """sm_100 (B200: 227 KiB of shared memory a block, Hopper's tiles) and sm_120 (RTX 50: 99 KiB, sm_86's)."""
    result = _run("--arch", "100,120", "--kernel", "attn_bwd_delta", "--kernel", "rmsnorm_bwd", "--quick",
                  "--jobs", "1")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines()[1:-1]]
    assert {(row[0], row[1]) for row in rows} == {(f"sm_{arch}", kernel) for arch in (100, 120)
                                                  for kernel in ("attn_bwd_delta", "rmsnorm_bwd")}
    assert all(row[-1] == "ok" for row in rows), rows


def test_compile_error_and_shared_memory_over_the_limit_fail_the_check(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        import triton
        import triton.language as tl
        import kernels.hardware
        from kernels.compile_check import compile_launch, main
        from kernels.runtime import Launch

        @triton.jit
        def broken(X, BLOCK: tl.constexpr):  # inner dimensions 32 and 16 do not match
            product = tl.dot(tl.zeros((BLOCK, 32), tl.float16), tl.zeros((16, BLOCK), tl.float16))
            tl.store(X + tl.arange(0, BLOCK), product)

        if __name__ == "__main__":  # the compile check's worker processes import this file too
            config = triton.Config({}, num_warps=4, num_stages=1)
            x = torch.empty(16, dtype=torch.float32, device="meta")
            row = compile_launch(Launch("broken", broken, (x,), {"BLOCK": 16}, [config]), config, 90)
            print("STATUS", row.status)
            kernels.hardware.SHARED_MEMORY_LIMIT[90] = 0  # any kernel using shared memory is now over the limit
            sys.exit(main(["--arch", "90", "--kernel", "rmsnorm_bwd", "--quick", "--jobs", "1"]))
    """))
    result = _run(script=script)
    assert "STATUS ERROR" in result.stdout, result.stdout + result.stderr[-3000:]
    assert result.returncode == 1 and "SHARED MEMORY OVER 0 KiB" in result.stdout, result.stdout + result.stderr


def test_bad_arguments_and_the_interpreter_are_refused(monkeypatch, capsys):
    """In this process: each is refused before anything compiles. Whether Triton interprets is stubbed here;
    tests/test_kernels.py reads it both ways (`kernels.runtime.interpreting`)."""
    from kernels import compile_check

    monkeypatch.setattr(compile_check, "interpreting", lambda: False)
    assert compile_check.main(["--arch", "75"]) == 2
    assert "--arch takes a comma-separated list of [80, 86, 89, 90, 100, 120]" in capsys.readouterr().err
    assert compile_check.main(["--kernel", "no_such_kernel"]) == 2
    assert "no launch matches --kernel" in capsys.readouterr().err
    monkeypatch.setattr(compile_check, "interpreting", lambda: True)
    assert compile_check.main([]) == 2 and "TRITON_INTERPRET=1 makes Triton interpret" in capsys.readouterr().err
