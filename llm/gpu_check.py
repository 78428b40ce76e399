"""The GPU check: one command that, on one GPU, checks and times everything the GPU path needs, streaming each
result to a file as soon as it is known (a run cut short keeps what it finished).

    python -m llm.gpu_check --out DIR [--budget-s 480]      on a CUDA machine
    python -m llm.gpu_check --out DIR --smoke                on the CPU: the same steps, tiny, to test the tool

Steps, each bounded by its share of the budget and recorded in DIR/summary.md as it ends:
  1. versions and clocks (python, torch, triton, deepspeed; GPU, capability, memory, clocks, power)
  2. compiled-kernel correctness: tests/test_kernels_gpu.py alone, in a process that compiles (TRITON_INTERPRET unset;
     tests/test_kernels.py would set it to 1), each test's outcome listed as it ends (with the kernel table, what
     kernels.VERIFIED rests on)
  3. the kernel table: `python -m kernels.bench` (GB/s against a measured copy, TFLOP/s against SDPA's flash and
     cuDNN backends and torch eager), bf16, then attention in fp16
  4. training throughput: `zerollm bench train` for minimind-26m and tiny-k-215m at bf16 ZeRO-2,
     with model.kernels=triton and =torch (tokens/s, MFU, peak memory)
  5. where a step's time goes: torch.profiler's top 20 ops of one tiny-k-215m training step
A step's budget is its share (SHARES) of the time left when it starts, among the steps still to run: what a step
leaves unused goes to the ones after it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from launch.own_module import zerollm_command
from llm.bench import BENCH_VOCAB, write_random_tokens
from llm.config import build_config
from llm.data.prepared import read_data_attrs
from llm.errors import UserError
from llm.runtime.distributed import setup_distributed
from llm.train.ds_config_file import load_ds_config
from llm.train.engine import resolve_ds_config, resolve_precision
from llm.train.job import build_trainer

REPO = Path(__file__).resolve().parents[1]
DONE_FILE = "done.json"
"""Written when every step has run; a rerun into the same --out removes the earlier one first."""
GPU_RECIPES = ("minimind-26m", "tiny-k-215m")
SHARES = {"versions": 0.02, "kernel tests": 0.35, "kernel table": 0.3, "training": 0.28, "profile": 0.05}
"""Each step's weight in the time budget (step_budget), from one H200 run (docs/benchmarks.md): the kernel tests took
130 s (they compile each kernel for every dtype and shape class they take and autotune attention's tiles), the kernel
table about 100 s (the 97 s it had there cut it short; its two commands alone, in a call of their own, took 104 s
with a wheel install), the four training jobs 90 s (each starts DeepSpeed in a process of its own), the profile 12 s.
At the default budget (480 s) each step gets at least 1.25 times what it took there."""
BF16_TABLE_SHARE = 0.7
"""The most of the kernel table's budget its bf16 half (every op) may take; the fp16 attention rows get what it leaves.
In the H200's first sitting the fp16 run made 10 of its 16 rows in 24 s."""
GIB_PER_KERNEL_TEST_WORKER = 40
"""GPU memory per pytest-xdist process of the kernel tests: the float64 reference of the largest attention test
(kernels.testing.compare; 32 heads x 4096 x 4096 scores, kept for the backward) takes some 30 GiB."""


def seconds(text: str) -> float:
    """--budget-s: a positive, finite number of seconds (argparse's float takes nan and inf)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def kernel_test_workers() -> int:
    """Processes for the kernel tests: compiling them is the CPU's work, so where pytest-xdist is installed, one per
    GIB_PER_KERNEL_TEST_WORKER of GPU memory, at most 4 and one per core (1: pytest's own process)."""
    if importlib.util.find_spec("xdist") is None or not torch.cuda.is_available():
        return 1
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return max(1, min(4, int(gib // GIB_PER_KERNEL_TEST_WORKER), os.cpu_count() or 1))


def step_budget(name: str, total_s: float, elapsed_s: float) -> float:
    """Step `name`'s share of the time left, among the steps from it on (a step's unused time goes to later ones)."""
    later = list(SHARES)[list(SHARES).index(name):]
    return max(0.0, total_s - elapsed_s) * SHARES[name] / sum(SHARES[n] for n in later)


def kernel_tests_command(python: str, smoke: bool, workers: int = 1) -> tuple[list[str], dict[str, str | None]]:
    """The kernel tests' command and its environment changes (None: unset). On a GPU: tests/test_kernels_gpu.py alone
    (tests/test_kernels.py sets TRITON_INTERPRET=1 as it is imported, which would skip every compiled test), in a
    process that compiles, `-v` streaming each outcome as it ends (a run cut short keeps them) and `-rA` listing them
    all, skip reasons included, at the end."""
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-rA"]
    if smoke:
        return [*pytest, "-q", "tests/test_kernels.py", "-k", "rms"], {"TRITON_INTERPRET": "1"}
    processes = ["-n", str(workers)] if workers > 1 else []
    return [*pytest, "-v", *processes, "-m", "gpu", "tests/test_kernels_gpu.py"], {"TRITON_INTERPRET": None}


class Report:
    """DIR/<step>.txt with each step's output, DIR/summary.md with one line per finished step; written as it goes."""

    def __init__(self, out: Path) -> None:
        self.out = out
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file; give a directory for the results")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--out {out}: cannot create it ({exc.strerror or exc})") from None
        for earlier in [self.step_file(name) for name in SHARES] + [out / DONE_FILE]:  # a rerun's results replace them
            try:
                earlier.unlink(missing_ok=True)
            except OSError as exc:
                raise UserError(f"--out {out}: cannot replace the earlier {earlier.name} ({exc.strerror or exc})") \
                    from None
        self.summary = out / "summary.md"
        self.summary.write_text(f"# GPU check, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\n")

    def step_file(self, name: str) -> Path:
        return self.out / f"{name.replace(' ', '_')}.txt"

    def line(self, text: str) -> None:
        with self.summary.open("a") as f:
            f.write(text + "\n")
        print(text, flush=True)


def run_command(command: list[str], log: Path, timeout_s: float, env: dict[str, str | None] | None = None) -> str:
    """Run `command` with `env`'s changes to this environment (None unsets a variable), appending its output to `log`
    as it comes; returns 'ok', 'exit N' or 'timed out'."""
    child_env = {**os.environ, **(env or {})}
    with log.open("a") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                   env={k: v for k, v in child_env.items() if v is not None}, start_new_session=True)
        try:
            code = process.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            f.write(f"\n[timed out after {timeout_s:.0f} s]\n")
            return "timed out"
        except BaseException:  # Ctrl-C: the child, in a session of its own, did not get it
            with contextlib.suppress(ProcessLookupError):  # its group gone already
                os.killpg(process.pid, 9)
            with contextlib.suppress(ChildProcessError):  # reaped by waitpid itself: a Ctrl-C that lands inside
                _, status = os.waitpid(process.pid, 0)  # Popen.wait(timeout) can leave its lock held, and a wait()
                process.returncode = os.waitstatus_to_exitcode(status)  # then hangs; told, so Popen waits no more
            raise
    return "ok" if code == 0 else f"exit {code}"


def versions(smoke: bool) -> str:
    version = importlib.metadata.version
    lines = [f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"triton {version('triton')}, deepspeed {version('deepspeed')}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                     f"{props.multi_processor_count} SMs")
        if shutil.which("nvidia-smi"):
            query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit," \
                    "temperature.gpu"
            smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True,
                                 text=True, check=False)
            lines.append(smi.stdout.strip())
    elif smoke:
        lines.append("no GPU (smoke mode on the CPU)")
    return "\n".join(lines)


def profile_step(recipe: str, smoke: bool) -> str:
    """torch.profiler's top 20 ops (by device time on a GPU) of one training step, after two warm-up steps."""
    overrides = ["train.max_steps=3", "train.eval_every=0"]
    if smoke:
        overrides += ["train.micro_batch_size=2", "data.seq_len=32"]
    cfg = build_config(recipe, overrides)
    cfg.model.vocab_size = cfg.model.vocab_size or BENCH_VOCAB
    info = setup_distributed()
    cfg.train.precision = resolve_precision("auto", info.device)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"zerollm-gpu-check-{os.getpid()}"
    write_random_tokens(work / "data", cfg.model.vocab_size, 4 * cfg.train.micro_batch_size * cfg.data.seq_len + 1)
    cfg.data.path = str(work / "data")
    raw, source = load_ds_config(None, "pretrain")
    trainer = build_trainer(cfg, work / "run", info, resolve_ds_config(raw, cfg, 1, source),
                            read_data_attrs(cfg.data.path, "pretrain"))
    for _ in range(2):
        trainer.reduce_step(*trainer.train_step())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if info.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        trainer.reduce_step(*trainer.train_step())
    shutil.rmtree(work, ignore_errors=True)
    sort = "cuda_time_total" if info.device.type == "cuda" else "cpu_time_total"
    return f"{recipe}, {cfg.train.precision}, one step:\n" + prof.key_averages().table(sort_by=sort, row_limit=20)


def _timed(report: Report, name: str, budget_s: float, fn: Callable[[Path, float], str]) -> None:
    start = time.monotonic()
    log = report.step_file(name)
    try:
        status = fn(log, budget_s)
    except Exception as exc:  # noqa: BLE001 - a failed step is recorded and the next one runs
        status = f"failed: {type(exc).__name__}: {exc}"
        with log.open("a") as f:
            f.write(f"\n{status}\n")
    report.line(f"- {name}: {status} ({time.monotonic() - start:.0f} s, budget {budget_s:.0f} s) -> {log.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the results (created)")
    parser.add_argument("--budget-s", type=seconds, default=480.0, help="total time for every step (default 480)")
    parser.add_argument("--smoke", action="store_true", help="tiny versions of every step on the CPU")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("llm.gpu_check: no CUDA device; use --smoke to check the tool on the CPU", file=sys.stderr)
        return 2
    try:
        report = Report(Path(args.out))
        run_steps(report, args.budget_s, args.smoke)
    except UserError as exc:
        print(f"llm.gpu_check: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"llm.gpu_check: stopped; {args.out} keeps the steps that finished (summary.md)", file=sys.stderr)
        return 130
    return 0


def run_steps(report: Report, budget_s: float, smoke: bool) -> None:
    """Every step in turn, each within its share of what is left of `budget_s`; done.json when all have run."""
    start = time.monotonic()
    python = sys.executable

    def budget(name: str) -> float:
        return step_budget(name, budget_s, time.monotonic() - start)

    def write(log: Path, text: str) -> str:
        with log.open("a") as f:
            f.write(text + "\n")
        return "ok"

    _timed(report, "versions", budget("versions"), lambda log, _: write(log, versions(smoke)))
    tests, tests_env = kernel_tests_command(python, smoke, 1 if smoke else kernel_test_workers())
    _timed(report, "kernel tests", budget("kernel tests"), lambda log, t: run_command(tests, log, t, tests_env))

    def kernel_table(log: Path, t: float) -> str:
        if smoke:  # one op, as the smoke's kernel tests (tests/test_kernels.py runs every op's smoke table)
            return run_command([python, "-m", "kernels.bench", "--smoke", "--op", "rmsnorm"], log, t)
        start = time.monotonic()  # bf16, every op: at most BF16_TABLE_SHARE; fp16 attention: what it leaves
        first = run_command([python, "-m", "kernels.bench", "--dtype", "bf16"], log, BF16_TABLE_SHARE * t)
        second = run_command([python, "-m", "kernels.bench", "--op", "attention", "--dtype", "fp16"], log,
                             t - (time.monotonic() - start))
        return f"bf16 {first}, fp16 attention {second}"

    _timed(report, "kernel table", budget("kernel table"), kernel_table)

    def training(log: Path, t: float) -> str:
        runs = [("demo", "torch")] if smoke else [(r, k) for r in GPU_RECIPES for k in ("triton", "torch")]
        results = []
        for recipe, kernels in runs:
            steps = ["--steps", "1", "--warmup", "1"] if smoke else ["--steps", "8", "--warmup", "3"]
            precision = "auto" if smoke else "bf16"
            command = [*zerollm_command(), "bench", "train", "--recipe", recipe, *steps, "--zero-stage", "2",
                       "--set", f"model.kernels={kernels}", "--set", f"train.precision={precision}"]
            results.append(f"{recipe}/{kernels} {run_command(command, log, t / len(runs))}")
        return ", ".join(results)

    _timed(report, "training", budget("training"), training)
    recipe = "demo" if smoke else "tiny-k-215m"
    _timed(report, "profile", budget("profile"), lambda log, _: write(log, profile_step(recipe, smoke)))
    (report.out / DONE_FILE).write_text(json.dumps({"finished": time.strftime("%Y-%m-%dT%H:%M:%S")}))


if __name__ == "__main__":
    sys.exit(main())
