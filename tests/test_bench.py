"""`zerollm bench generate` and `bench train`: what they measure and report (benchmarks are commands: these tests
check the figures' bookkeeping, never a speed)."""

import json
import math
import re
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import BENCH_TINY, run_cli
from llm import rundir
from llm.config import ModelConfig, build_config
from llm.errors import UserError
from llm.model import Transformer


def _rates(stdout: str) -> dict[str, tuple[float, float]]:
    """variant -> (prefill tok/s, decode tok/s) of the printed table."""
    rows = re.findall(r"^  (zerollm, KV cache|zerollm, no cache|transformers generate) +([\d,.]+|inf) +([-\d,.]+|inf)",
                      stdout, re.MULTILINE)
    return {name: (float(prefill.replace(",", "")), float(decode.replace(",", ""))) for name, prefill, decode in rows}


def test_bench_generate_times_prefill_and_decode_within_one_call(tiny_export, monkeypatch, capsys):
    """transformers' decode time was one generate(new) call less a separate (cold) generate(1) call: negative or
    absurd rates (-2,394.9 tok/s, -0.09x). A clock that ticks once per reading makes that difference 0 (a
    ZeroDivisionError before); timed within one call, every variant's prefill and decode take 1 tick."""
    from llm import bench

    ticks = iter(range(10**6))
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    assert bench.bench_generate(str(tiny_export), prompt_tokens=16, new_tokens=2, repeats=1, device="cpu") == 0
    rates = _rates(capsys.readouterr().out)
    assert set(rates) == {"zerollm, KV cache", "zerollm, no cache", "transformers generate"}
    assert all(r == (16.0, 1.0) for r in rates.values()), rates  # 16 prompt tokens and 1 decoded token per tick


def test_bench_generate_says_why_transformers_is_not_measured(tokenizer_dir, monkeypatch, capsys):
    """On a mixture-of-experts model (which export refuses, so transformers has nothing to load) the transformers row
    was left out of the table without a word."""
    from llm import bench
    from llm.tokenizer import Tokenizer

    torch.manual_seed(0)
    moe = Transformer(ModelConfig(vocab_size=512, dim=64, n_layers=1, n_heads=4, max_seq_len=64, moe=True,
                                  n_experts=4, n_experts_per_token=2))
    monkeypatch.setattr(bench, "load_for_inference", lambda _: (moe, Tokenizer.load(tokenizer_dir)))
    assert bench.bench_generate("moe-run", prompt_tokens=16, new_tokens=2, repeats=1, device="cpu") == 0
    out = capsys.readouterr().out
    assert set(_rates(out)) == {"zerollm, KV cache", "zerollm, no cache"}
    assert out.splitlines()[-1] == ("  transformers generate   not measured (a mixture-of-experts model, which export "
                                    "refuses)")


def test_bench_generate_rates_are_positive(tiny_export, cli_here):
    result = cli_here("bench", "generate", "--model", tiny_export, "--prompt-tokens", 16, "--new-tokens", 2,
                      "--repeats", 1, "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    rates = _rates(result.stdout)
    assert len(rates) == 3 and all(p > 0 and d > 0 for p, d in rates.values()), result.stdout


def test_bench_generate_of_a_batch_no_host_holds_is_one_line(tiny_export):
    """--batch 100000 filled the host's memory until the OOM killer ended it (exit 137, nothing said): run in a
    process of its own, which that would end, not the test's."""
    result = run_cli("bench", "generate", "--model", tiny_export, "--prompt-tokens", 16, "--new-tokens", 2,
                     "--batch", 10**8, "--device", "cpu")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert re.fullmatch(r"zerollm: error: --batch 100000000 of 18 positions needs about [\d,.]+ GiB for its "
                        r"generations on the CPU \(KV cache, attention, logits\), more than (this host's|the limit "
                        r"of this process's cgroup \(a container's or a job's\):) [\d,.]+ GiB; lower --batch or "
                        r"the token counts\n", result.stderr)  # a container's limit is named where it is the lower


@pytest.mark.parametrize("raised", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.06 GB, other allocations: 1.20 GB, max allowed: "
                 "18.13 GB). Tried to allocate 2.00 GB on private pool."),  # Apple's GPU: a RuntimeError
])
def test_bench_generate_out_of_gpu_memory_is_one_line(tiny_export, monkeypatch, raised):
    from llm import bench

    def out_of_memory(run, repeats):
        raise raised

    monkeypatch.setattr(bench, "_median_seconds", out_of_memory)
    with pytest.raises(UserError) as error:
        bench.bench_generate(str(tiny_export), prompt_tokens=16, new_tokens=2, batch=3, repeats=1, device="cpu")
    assert str(error.value) == ("the GPU ran out of memory generating --batch 3 of 18 positions; lower --batch or the "
                                "token counts")


def test_bench_generate_passes_on_other_runtime_errors(tiny_export, monkeypatch):
    from llm import bench

    def broken(run, repeats):
        raise RuntimeError("expected all tensors to be on the same device")

    monkeypatch.setattr(bench, "_median_seconds", broken)
    with pytest.raises(RuntimeError, match="same device"):
        bench.bench_generate(str(tiny_export), prompt_tokens=16, new_tokens=2, batch=3, repeats=1, device="cpu")


def test_bench_train_ended_by_max_time_in_its_warmup_is_one_line():
    """train.max_time ended the job within the warm-up steps: `statistics.median` of no steps raised
    StatisticsError (a traceback), under a header promising the median of --steps steps."""
    tiny = [a for o in BENCH_TINY for a in ("--set", o)]
    result = run_cli("bench", "train", "--recipe", "demo", "--steps", 1, "--warmup", 100, *tiny,
                     "--set", "train.max_time=0.01")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert re.search(r"zerollm: error: the job stopped after \d+ step\(s\), within the 100 warm-up steps "
                     r"\(train\.max_time=0\.01\): nothing was measured", result.stderr), result.stderr[-2000:]


def test_bench_train_of_more_steps_than_memory_holds_tokens_for_runs_to_its_time_budget():
    """The random tokens of every step were made up front: --steps 1000000000 was a numpy MemoryError (477 GiB)."""
    tiny = [a for o in BENCH_TINY for a in ("--set", o)]
    result = run_cli("bench", "train", "--recipe", "demo", "--steps", 10**9, "--warmup", 1, *tiny,
                     "--set", "train.max_time=4")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "of --steps 1000000000: train.max_time ended the job sooner" in result.stdout, result.stdout[-2000:]


def test_bench_train_reports_the_steps_it_measured():
    from llm.bench import TrainFigures, _measured

    def figures(steps: int) -> TrainFigures:
        return TrainFigures(1.0, 1.0, 0.1, 10.0, 5, 5, steps)

    assert _measured({"": figures(20)}, 20) == "20 steps"
    assert _measured({"": figures(3)}, 20) == "3 steps (of --steps 20: train.max_time ended the job sooner)"
    assert _measured({"a": figures(1), "b": figures(4)}, 4) == \
        "1 / 4 steps (of --steps 4: train.max_time ended the job sooner)"


def test_bench_train_takes_the_medians_of_the_numbers_a_run_logged(tmp_path):
    """metrics.jsonl holds null for a value that is not a number (the MFU of a GPU missing from the peak table, with
    no train.peak_tflops): the median over it was a TypeError."""
    from llm.bench import _train_job

    rows = [{"step": step, "tokens_per_sec": 100.0 * step, "loss_tokens_per_sec": 50.0, "mfu": None,
             "peak_mem_mb": 10.0 + step} for step in (1, 2, 3)]
    (tmp_path / rundir.METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = build_config("demo", ["model.vocab_size=512"])
    figures = _train_job([sys.executable, "-c", ""], tmp_path, warmup=0, cfg=cfg)
    assert (figures.tokens_per_sec, figures.loss_tokens_per_sec, figures.peak_mem_mb) == (200.0, 50.0, 13.0)
    assert math.isnan(figures.mfu) and figures.steps == 3
    figures = _train_job([sys.executable, "-c", ""], tmp_path, warmup=1, cfg=cfg)  # the warm-up step left out
    assert (figures.tokens_per_sec, figures.peak_mem_mb, figures.steps) == (250.0, 13.0, 2)


@pytest.mark.parametrize("given, said", [("train.max_steps=1", "--steps (with --warmup) sets it too"),
                                         ("train.log_every=5", "bench train (it measures steps alone) sets it too")])
def test_a_set_of_what_bench_train_sets_itself_is_refused(given, said):
    """Its own --set came after the user's and won: --set train.max_steps=1 ran --steps + --warmup steps."""
    from llm.bench import bench_train

    with pytest.raises(UserError, match=re.escape(f"--set {given.partition('=')[0]}: {said}; give it once")):
        bench_train("demo", [given])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_bench_train_waits_for_its_job_and_says_there_is_nothing_to_resume(signum, tmp_path, capsys):
    """The job's line advised `--resume auto` into its temporary folder, which bench train then removed; the
    Ctrl-C that stopped it raised KeyboardInterrupt here, and subprocess.run killed the job before it saved; a
    SIGTERM (`kill`, systemd), which reaches bench alone, ended bench at once, and its job trained on, orphaned, in
    the temporary folder. Both now wait for the job's checkpoint and exit 130 or 143, not 75 (which says to resume).
    Here the job signals bench itself (as the terminal's Ctrl-C reaches both) and stops on the signal bench passes
    on, or, for SIGINT, on its own."""
    from llm.bench import _train_job

    passed_on = tmp_path / "passed_on"
    job = (f"import os, signal, sys, time\n"
           f"signal.signal(signal.SIGTERM, lambda *_: (open({str(passed_on)!r}, 'w').close(), sys.exit(75)))\n"
           f"os.kill(os.getppid(), {int(signum)})\n"
           f"time.sleep(0 if {int(signum)} == signal.SIGINT else 60)\n"
           f"sys.exit(75)\n")
    cfg = build_config("demo", ["model.vocab_size=512"])
    assert _train_job([sys.executable, "-c", job], tmp_path, warmup=0, cfg=cfg) == 128 + signum
    assert passed_on.exists() == (signum == signal.SIGTERM)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zerollm: note: bench train stopped, so nothing was measured; its runs were in a temporary folder, now "
        "removed: there is nothing to resume, run it again")


def test_a_timed_step_waits_for_the_device_on_mps_as_on_cuda(monkeypatch):
    """Only CUDA's queue was waited for: on Apple's MPS the prefill's work, still queued, was timed as decoding."""
    from llm import bench

    waited = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: waited.append("mps"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append("cuda"))
    for device in ("mps", "cuda", "cpu"):
        assert bench._synchronized(torch.device(device), lambda: 7)() == 7
    assert waited == ["mps", "cuda"]


def test_a_bench_whose_job_stopped_by_itself_ends_as_a_closed_pipe_not_to_be_resumed(tmp_path, monkeypatch):
    """`bench train | head`: its job's output was lost and the job stopped with a checkpoint (75, 'resume'), which
    bench train passed on, though its runs were removed: there is nothing to resume. Likewise bench learn's job."""
    from llm import bench
    from llm.errors import EXIT_PIPE_CLOSED
    from llm.runtime.distributed import DistInfo
    from llm.runtime.preemption import Preemption

    stopped = bench._train_job([sys.executable, "-c", "import sys; sys.exit(75)"], tmp_path, 0,
                               build_config("demo", []))
    assert stopped == EXIT_PIPE_CLOSED
    monkeypatch.setattr(Preemption, "stopped_by", None)
    preemption = Preemption(DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1,
                                     device=torch.device("cpu")))
    preemption.output_lost(BrokenPipeError(32, "Broken pipe"))
    assert (preemption.requested, preemption.output_lost_now, Preemption.stopped_by) == (True, True, signal.SIGPIPE)
