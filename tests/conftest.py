"""Shared fixtures: a small tokenizer, prepared data and ZeRO runs built once per session (shared by the
xdist workers), and a CLI runner.

Test corpora are the committed files under tests/fixtures/ (written for this project, see its README): the
suite reads nothing beside the repository, so it runs, and takes the same time, on a fresh clone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
import torch.distributed as dist
from filelock import FileLock
from forked_ranks import run_job

from llm.runtime.cpu_threads import cpu_threads_per_rank
from llm.runtime.rank_env import PORTS_VARIABLE, RANK_VARIABLES, port_range

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER") is not None:
    # each worker's jobs draw their ports from a part of the range of their own: a port one worker drew and had not
    # yet bound looked free to the other (a worker that replaces a crashed one, gw2 of 2, takes gw0's part)
    low, high = port_range(os.environ)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    part = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) % workers
    width = (high - low + 1) // workers
    if width >= 1:
        os.environ[PORTS_VARIABLE] = f"{low + part * width}-{low + (part + 1) * width - 1}"
    # one worker per core, each running tests and starting jobs of its own: a thread per process keeps the cores
    # from being oversubscribed (the jobs' ranks take OMP_NUM_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(cpu_threads_per_rank(1, os.environ))


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict[str, str] | None = None,
            as_script: bool = False) -> subprocess.CompletedProcess:
    """`zerollm ARGS` in a fresh interpreter (`python -m llm`, or the console script `as_script`), output captured as
    text; `env`: variables set beside this process's."""
    program = [str(Path(sys.executable).with_name("zerollm"))] if as_script else [sys.executable, "-m", "llm"]
    return subprocess.run([*program, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          check=False, env=None if env is None else {**os.environ, **env})


SHADOWING = "a user's llm.py ran"


def folder_shadowing_zerollm(path: Path) -> Path:
    """`path`, made a working directory holding a user's llm.py that prints SHADOWING and exits 0: `python -m llm`
    there runs it in place of zerollm (every rank did, and the job exited 0 untrained); the console script and the
    processes zerollm starts do not."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "llm.py").write_text(f"print({SHADOWING!r})\n")
    return path


def closed_pipe() -> BinaryIO:
    """A pipe's writing end whose reader has left before the first write, as `| head -c 5`'s once head is done."""
    reading, writing = os.pipe()
    os.close(reading)
    return open(writing, "wb")


def full_disk() -> BinaryIO:
    """A file every write to which finds no space left on its device."""
    return open("/dev/full", "wb")


def zerollm_here(monkeypatch, *args) -> int:
    """`zerollm ARGS` run in this process, as from a fresh shell (no launcher's rank variables, so an N-rank job is
    launched from here, not joined); its exit code. Only for commands that train nothing in this process: a one-rank
    job ends its process with os._exit."""
    from llm.cli import main  # noqa: PLC0415 - after the environment above is set

    for name in ("LOCAL_RANK", *RANK_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as ended:
        main(list(map(str, args)))
    return ended.value.code


@pytest.fixture
def cli_here(monkeypatch, capsys) -> Callable[..., subprocess.CompletedProcess]:
    """`zerollm ARGS` run in this process (`zerollm_here`), with its exit code and output as `run_cli` gives them:
    for commands that start no process and train nothing, saving the fresh interpreter's imports."""
    def run(*args) -> subprocess.CompletedProcess:
        code = zerollm_here(monkeypatch, *args)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(list(map(str, args)), code, captured.out, captured.err)

    return run


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory `name`, filled by `build` once per test session: under pytest-xdist the first worker to ask
    builds it in the directory all workers share, the others wait for it and read it (tests only read these)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        out = tmp_path_factory.mktemp(name)
        build(out)
        return out
    out = tmp_path_factory.getbasetemp().parent / name
    built = out.with_name(f"{name}.built")  # beside it: the directory holds exactly what `build` wrote
    with FileLock(f"{out}.lock"):
        if not built.is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            built.touch()
    return out


def _check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A 512-token tokenizer trained on the English and Chinese fixture stories."""
    return built_once(tmp_path_factory, "tokenizer", lambda out: _check(run_cli(
        "tokenizer", "train", "--input", FIXTURES / "pretrain" / "en_stories.txt",
        FIXTURES / "pretrain" / "zh_stories.txt", "--vocab-size", 512, "--out", out)))


@pytest.fixture(scope="module")
def tiny_export(tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny random model exported with the session's tokenizer, for commands that take `--model`."""
    from llm.config import ModelConfig
    from llm.export import export_model
    from llm.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))
    out = tmp_path_factory.mktemp("export")
    export_model(model, tokenizer_dir, out)
    return out


@pytest.fixture(scope="session")
def pretrain_data(tokenizer_dir, tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "data", lambda out: _check(run_cli(
        "data", "prepare", "--input", FIXTURES / "pretrain" / "en_stories.txt", "--tokenizer", tokenizer_dir,
        "--out", out, "--val-fraction", 0.05, "--workers", 2)))


TINY = ["model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "data.seq_len=32", "train.micro_batch_size=4", "train.warmup_steps=2", "train.eval_batches=2",
        "train.log_every=1", "train.lr=3e-3", "train.sample_prompts=[]"]
"""A tiny model that trains in seconds; no samples at evaluations (tests/test_run_record.py turns them on)."""
BENCH_TINY = [o for o in TINY if not o.startswith(("train.eval_batches=", "train.log_every="))]
"""TINY without what `bench train` sets itself (it refuses a --set of those)."""
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu"}


def train_args(data, out, *overrides, nproc=1, extra=()):
    """`zerollm train pretrain` arguments for a tiny model."""
    sets = [a for o in [*TINY, *overrides] for a in ("--set", o)]
    return ["train", "pretrain", "--recipe", "demo", "--data", data, "--out", out, "--nproc", nproc, *sets, *extra]


ZERO_RUN = ["train.max_steps=4", "train.eval_every=2", "train.precision=fp32"]
"""The job of `zero_runs`, on 2 ranks."""


class ZeroRuns(Mapping):
    """The same 4-step job on 2 ranks under ZeRO 0, 1, 2 and 3 (fp32), each trained when a test first asks for it,
    its ranks forked (tests/forked_ranks.py)."""

    def __init__(self, data: Path, tmp_path_factory) -> None:
        self.data, self.tmp_path_factory = data, tmp_path_factory
        self.runs: dict[int, Path] = {}

    def __getitem__(self, stage: int) -> Path:
        if stage not in self.runs:
            self.runs[stage] = built_once(self.tmp_path_factory, f"zero{stage}", lambda out: _check(run_job(
                *train_args(self.data, out, *ZERO_RUN, nproc=2, extra=["--zero-stage", stage]))))
        return self.runs[stage]

    def __iter__(self) -> Iterator[int]:
        return iter((0, 1, 2, 3))

    def __len__(self) -> int:
        return 4


@pytest.fixture(scope="session")
def zero_runs(pretrain_data, tmp_path_factory) -> ZeroRuns:
    return ZeroRuns(pretrain_data, tmp_path_factory)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A process group of one (gloo), as a one-rank job has."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def deepspeed_without_shared_memory(monkeypatch) -> None:
    """DeepSpeed's CPU communication as `setup_distributed` starts it: without the shared-memory op that building
    DeepSpeed's collectives would compile first (a minute of a core)."""
    import deepspeed  # noqa: PLC0415 - after the environment above is set

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)


LONGEST_FILES = ("test_launch.py", "test_kernels_compile.py", "test_launch_conventions.py", "test_cli.py",
                 "test_train.py", "test_user_files.py", "test_eval.py", "test_gpu_check.py", "test_time_budget.py",
                 "test_launch_safety.py", "test_lora.py", "test_faults.py", "test_tokenizer.py",
                 "test_learning_speed.py", "test_devices.py")
"""Test files by their time in a full run, longest first (`pytest --durations=0`, summed per file)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Queue the longest files first. pytest-xdist hands each worker whole files (--dist loadfile) in this order, so
    a long file queued last would run alone while the other worker idles. Tests keep their order within a file."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))


GIVES_UP_ON = "a" * 40 + "c"
"""Text on which `regex_that_gives_up`'s tokenizer panics."""


def regex_that_gives_up(tokenizer_dir: Path, out: Path) -> Path:
    """A copy of the tokenizer whose pre-tokenizer first splits on `(a+)+b`: on `GIVES_UP_ON` its regex engine
    backtracks past its retry limit and the tokenizers library panics, as a hostile tokenizer.json can make it."""
    shutil.copytree(tokenizer_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, spec["pre_tokenizer"]]}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def changed_after_listing(listing: Callable, path: Path, change: str) -> Callable:
    """`listing` (an `expand_inputs`) that then takes `path` away: removed ('unlink'), or replaced by a folder
    ('mkdir'), as a file can change between the listing of the inputs and their reading."""
    def then_changed(*args, **kwargs):
        files = listing(*args, **kwargs)
        path.unlink()
        if change == "mkdir":
            path.mkdir()
        return files

    return then_changed
