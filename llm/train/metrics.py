"""Training metrics: throughput, MFU, memory, and where logged steps go (`metrics.jsonl`, wandb, the console).

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs per token = 6 * (matmul parameters
active per token) + 12 * n_layers * n_heads * head_dim * seq_len (attention scores), as in the PaLM paper.
The peak is `train.peak_tflops` when given, a table entry for known GPUs (dense bf16), and on CPU
the best measured rate of square matmuls (up to 1024^3, or to the first that takes 20 ms
without beating the size before: `measure_peak_flops`) in the training dtype on
the threads each rank uses (so CPU MFU reads "share of what this machine's matmul reaches").
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kernels.hardware import peak_tflops
from llm import durable, rundir
from llm.config import ModelConfig, RunConfig, WandbConfig
from llm.devices import synchronize
from llm.errors import UserError
from llm.jsonl import JsonLine, jsonl_lines, strict_json
from llm.runtime.distributed import DistInfo
from llm.runtime.rerun import rerun_advice
from llm.stdout import on_terminal, unguarded


def matmul_params_per_token(cfg: ModelConfig, total_params: int) -> int:
    """Parameters multiplied per token: all but the embedding lookup (the tied output matmul counts) and norms."""
    norms = cfg.dim * (2 * cfg.n_layers + 1)
    embedding_lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    params = total_params - norms - embedding_lookup
    if cfg.moe:
        expert = 3 * cfg.dim * cfg.ffn_hidden_dim
        params -= cfg.n_layers * expert * (cfg.n_experts - cfg.n_experts_per_token)
    return params


def flops_per_token(cfg: ModelConfig, total_params: int, seq_len: int) -> float:
    attention_width = cfg.n_heads * cfg.attention_head_dim  # dim, unless head_dim is set apart from it
    return 6.0 * matmul_params_per_token(cfg, total_params) + 12.0 * cfg.n_layers * attention_width * seq_len


GROWING = 1.1
"""A matmul rate this much above the size before's is still growing (`measure_peak_flops`)."""


def measure_peak_flops(device: torch.device, dtype: torch.dtype, max_size: int = 1024, enough_s: float = 0.02,
                       repeats: int = 5) -> float:
    """Best rate of a square matmul in `dtype` on `device` (on the CPU: this process's threads), over sizes doubling
    from 128 up to `max_size` or to the first whose product takes `enough_s` at a rate no better than the size
    before's (by `GROWING`): a CPU that emulates bf16 reaches its rate on small matrices and would spend seconds on
    each 1024^3 one, while on a loaded machine a small product waits for its threads to be scheduled (a 128^3 one
    took 20 ms there, and the peak read 33 times too low). The operands come from a generator of their own: drawn
    from the global RNG after a resume restored it, they would shift every dropout mask of the resumed run."""
    generator = torch.Generator().manual_seed(0)
    size, rate = min(128, max_size), 0.0
    while True:
        a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
        torch.mm(a, b)
        synchronize(device)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        rate, before = max(rate, 2.0 * size ** 3 / best), rate
        if size >= max_size or (best >= enough_s and rate <= GROWING * before):
            return rate
        size = min(2 * size, max_size)


def peak_flops_per_rank(device: torch.device, configured_tflops: float | None, dtype: torch.dtype) -> float:
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        return peak_tflops(torch.cuda.get_device_name(device), dtype) * 1e12
    return measure_peak_flops(device, dtype)


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory allocated (CUDA), memory allocated now (MPS), or this process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "mps":
        return torch.mps.current_allocated_memory() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class StepStats:
    """A logged step, reduced across ranks."""

    loss: float
    """Mean over the step's micro-batches and ranks."""
    metrics: dict[str, float]
    """The objective's own numbers, means like `loss`."""
    loss_tokens: int
    """Loss-bearing target positions on every rank since the previous logged step."""
    positions: int
    """Token positions fed to training on every rank since the previous logged step (GRPO: each update counts)."""
    generated_tokens: int = 0
    """Tokens generated on every rank since the previous logged step (GRPO's rollouts)."""
    generation_seconds: float = 0.0
    """Time this rank spent generating since the previous logged step (excluded from training throughput)."""


def _truncate_after(path: Path, step: int) -> None:
    """Drop rows of a jsonl file past the step this run starts from (logged by a killed run, or by an earlier run),
    and lines that are not a JSON row (the last one torn by a kill mid-write, even mid-character), each named as
    file:line on stderr. The file is read a line at a time and cut where the rows to drop begin (they are its last:
    rows are appended by step), so a resume's memory does not grow with the steps logged (the file was read whole
    into a list and rewritten at every resume: 870 MB on rank 0 for a million rows); it is rewritten only where a row
    kept follows one dropped (a file edited by hand). A cut is one system call and a rewrite is atomic, so a kill here
    loses nothing."""
    if not path.is_file():
        return
    cut, rewrite, unended = None, False, False
    for line in jsonl_lines(path):
        if _row_up_to(line, step, path):
            rewrite, unended = rewrite or cut is not None, not line.ended
        elif cut is None:
            cut = line.offset
    if rewrite:
        durable.write_text(path, "".join(line.text + "\n" for line in jsonl_lines(path) if _row_up_to(line, step)))
    elif cut is not None:
        os.truncate(path, cut)
        durable.fsync(path)
    elif unended:  # a kill between a row and its newline: the next row would be appended to it
        durable.append_text(path, "\n")


def _row_up_to(line: JsonLine, step: int, noted: Path | None = None) -> bool:
    """Whether `line` is a row of a step up to `step`; a line that is no row of a step is named on stderr as
    `noted`:line, where given."""
    try:
        return line.value["step"] <= step
    except (KeyError, TypeError):
        if noted is not None:
            print(f"zerollm: note: {noted}:{line.number}: dropped a line that is not a row of a step (torn by a "
                  "killed run)", file=sys.stderr, flush=True)
        return False


NO_WANDB_KEY = "wandb: no API key configured; run `wandb login`, set WANDB_API_KEY, or pass --wandb offline"


def import_wandb():
    """The wandb module, or a one-line refusal naming the remedy: not installed, installed but failing to import (a
    protobuf it does not work with: "Descriptors cannot be created directly"), or not wandb's (a wandb.py of the
    user's, found first)."""
    try:
        import wandb  # noqa: PLC0415 - optional dependency, imported only when asked for
    except Exception as exc:  # noqa: BLE001 - whatever a broken install raises, said in one line
        if isinstance(exc, ModuleNotFoundError) and exc.name == "wandb":
            raise UserError("wandb is not installed; `pip install wandb` or use --wandb off") from None
        raise UserError(f"wandb cannot be imported ({type(exc).__name__}: {_wandb_reason(exc)}); reinstall it "
                        "(`pip install --force-reinstall wandb`) or use --wandb off") from None
    if not all(hasattr(wandb, name) for name in ("init", "Settings")):
        where = getattr(wandb, "__file__", None) or ", ".join(getattr(wandb, "__path__", []))
        raise UserError(f"the module wandb found at {where} is not "
                        "wandb's (a file or folder of yours named wandb?); rename it, or use --wandb off")
    return wandb


def _wandb_reason(exc: Exception) -> str:
    """The first line of a wandb error, to go in a sentence of ours."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


def _refuse_unreadable_variables(wandb) -> None:
    """Refuse the first WANDB_* variable wandb.init would fail to read (`WANDB_MODE=bogus`: pydantic's
    ValidationError; `WANDB_PROJECT=a/b`: wandb's UsageError), naming it; each is read alone, as wandb reads it."""
    for name, value in sorted(os.environ.items()):
        if not name.startswith("WANDB_"):
            continue
        try:
            wandb.Settings().update_from_env_vars({name: value})
        except (ValueError, wandb.Error) as exc:
            errors = exc.errors() if hasattr(exc, "errors") else []
            said = errors[0].get("msg", "") if errors else _wandb_reason(exc)
            raise UserError(f"wandb cannot read {name}={value!r} ({said}); correct or unset it") from None


def check_wandb(settings: WandbConfig, run_dir: Path) -> None:
    """Refuse, before the run directory is written, wandb settings that cannot start a run: wandb not installed, a
    WANDB_* variable it cannot read (`WANDB_MODE=bogus`), a wandb.project it refuses (`a/b`), a file where the run
    keeps its wandb folder, or `online` without an API key where wandb.init looks for one (WANDB_API_KEY or
    WANDB_IDENTITY_TOKEN_FILE, the netrc file, wandb's settings files), looked up without a network call and without
    asking. A wandb older than the helpers these need (`Settings.update_from_env_vars`, `wbauth`) leaves what they
    check to wandb.init, whose error is one line too (`MetricsSink`)."""
    if settings.mode == "off":
        return
    wandb = import_wandb()
    folder = run_dir / rundir.WANDB_DIR
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {run_dir}: {folder} is a file where wandb keeps its folder; move it away")
    _refuse_unwritable_staging(wandb)
    if hasattr(wandb.Settings, "update_from_env_vars"):
        _refuse_unreadable_variables(wandb)
        try:
            wandb.Settings(project=settings.run_project())
        except wandb.Error as exc:
            raise UserError(f"wandb.project: {_wandb_reason(exc)}") from None
    if settings.mode != "online":
        return
    try:
        from wandb.sdk import wandb_setup  # noqa: PLC0415 - part of wandb
        from wandb.sdk.lib import wbauth  # noqa: PLC0415
    except ImportError:
        return
    try:
        auth = wbauth.authenticate_session(host=wandb_setup.singleton().settings.base_url, source="zerollm",
                                           prompt=False, update_session=False)
    except wandb.errors.AuthenticationError as exc:  # a key of the wrong form, or two kinds of credentials set
        raise UserError(f"wandb: {_wandb_reason(exc)}; run `wandb login`, or pass --wandb offline") from None
    if auth is None:
        raise UserError(NO_WANDB_KEY)


def _refuse_unwritable_staging(wandb: Any) -> None:
    """wandb stages the samples' tables (and every artifact) in its data folder (WANDB_DATA_DIR, by default in the
    home folder), offline too: where it cannot write there (a read-only home, as on compute nodes) the run ended at
    its first evaluation with a PermissionError traceback, before its first checkpoint."""
    data = Path(wandb.env.get_data_dir())
    staging = data / "artifacts" / "staging"  # made by wandb; here only the nearest folder that exists is looked at
    existing = next(path for path in (staging, *staging.parents) if path.exists() or path == path.parent)
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise UserError(f"wandb cannot write its data folder {data} (WANDB_DATA_DIR), where it stages the samples' "
                        "tables; set WANDB_DATA_DIR to a folder it can write, or use --wandb off")


def _append(path: Path, text: str, step: int) -> None:
    """`durable.append_text` of step `step`'s `text`; a write that runs out of room (a full disk, a quota) is one
    UserError (it said "nothing was lost", where the steps since the newest checkpoint were)."""
    with durable.room_needed(path.parent, f"step {step} to {path.name}",
                             rerun_advice(", which continues from the newest checkpoint"),
                             f"{path.name} is as it was, but the steps trained since the newest checkpoint are not "
                             "saved (a resume trains them again)"):
        durable.append_text(path, text)


class MetricsSink:
    """Writes logged steps to RUN_DIR/metrics.jsonl, samples to RUN_DIR/samples.jsonl and, when enabled, both to a
    wandb run (samples as a table; the run record in its config). Rank 0 only."""

    def __init__(self, run_dir: Path, cfg: RunConfig, run_id: str, start_step: int,
                 record: dict[str, Any] | None = None) -> None:
        self.path = run_dir / rundir.METRICS_FILE
        self.samples_path = run_dir / rundir.SAMPLES_FILE
        for path in (self.path, self.samples_path):
            _truncate_after(path, start_step)
        self.wandb_run = None
        if cfg.wandb.mode != "off":
            wandb = import_wandb()
            try:
                self.wandb_run = wandb.init(project=cfg.wandb.run_project(), name=cfg.wandb.run_name(run_dir),
                                            id=run_id, resume="allow", dir=str(run_dir), mode=cfg.wandb.mode,
                                            config=cfg.to_dict())
            except (wandb.Error, ValueError) as exc:  # no network (after wandb's wait), a key the server refuses, a
                # WANDB_SERVICE it cannot parse, ...
                advice = "check the network and `wandb login`, or pass --wandb offline (and `wandb sync` its folder " \
                    "later)" if cfg.wandb.mode == "online" else "check the WANDB_* variables, or pass --wandb off"
                raise UserError(f"wandb: cannot start the {cfg.wandb.mode} run ({_wandb_reason(exc)}); {advice}") \
                    from None
            if record is not None:
                self.wandb_run.config.update({"run_record": record}, allow_val_change=True)

    def log(self, row: dict[str, Any]) -> None:
        _append(self.path, json.dumps(strict_json(row), allow_nan=False) + "\n", row["step"])
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append `rows` ({step, prompt, completion}) to samples.jsonl; wandb gets the whole table so far."""
        _append(self.samples_path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), step)
        if self.wandb_run is not None:
            import wandb  # noqa: PLC0415 - optional dependency, present since the run was created with it

            every = [line.value for line in jsonl_lines(self.samples_path)]  # whole: torn lines went at the start
            table = wandb.Table(columns=["step", "prompt", "completion"],
                                data=[[r["step"], r["prompt"], r["completion"]] for r in every])
            self.wandb_run.log({"samples": table}, step=step)

    def close(self, exit_code: int) -> None:
        """End the wandb run, recording the exit code of the training command (a failed or stopped run's too). It
        may come from another thread (`llm.runtime.forced_exit`): the run is let go first, so that the training
        thread, still stepping, logs nothing more to it."""
        run, self.wandb_run = self.wandb_run, None
        if run is not None:
            run.finish(exit_code=exit_code)


class MetricsLogger:
    """Decides which steps are logged and turns them into rows: rank 0 writes them to the sink and the console
    (a progress bar on a terminal, plain lines in a log file). Every rank holds one, so that every rank agrees
    on the logged steps, whose totals are reduced across ranks.

    Throughput is measured over the steps since the previous logged step, from the time spent in them
    (`timed`) up to the reduction at the logged step, which waits for the device: no other step waits.
    Where a step generates (GRPO), `tokens_per_sec` counts training time only and `rollout_tokens_per_sec`
    the generated tokens over the time spent generating and scoring them.
    """

    def __init__(self, cfg: RunConfig, info: DistInfo, n_params: int, start_step: int,
                 sink: MetricsSink | None) -> None:
        t = cfg.train
        self.cfg, self.sink = cfg, sink
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision, torch.float32)
        self.flops_per_token = flops_per_token(cfg.model, n_params, cfg.data.seq_len)
        # only the rank that writes the rows reads the peak: another would measure its matmuls for nothing
        self.peak_flops = None if sink is None else peak_flops_per_rank(info.device, t.peak_tflops, dtype) * \
            info.world_size
        self.device = info.device
        self.interactive = on_terminal()  # a bar on a terminal, plain lines in a log file
        self.bar = tqdm(total=t.max_steps if t.max_time is None else None,  # a time budget: no step count known
                        initial=start_step, desc=t.stage, unit="step", dynamic_ncols=True,
                        disable=sink is None or not self.interactive, file=unguarded())  # off if its terminal goes
        self._seconds = 0.0

    def due(self, step: int, eval_due: bool) -> bool:
        return step % self.cfg.train.log_every == 0 or eval_due

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the time of a step (and of the reduction of a logged one) toward throughput."""
        start = time.perf_counter()
        yield
        self._seconds += time.perf_counter() - start

    def log(self, step: int, lr: float, stats: StepStats | None, grad_norm, epoch: int, tokens_seen: int,
            val_loss: float | None = None) -> None:
        self.bar.update(1)
        if stats is None:
            return
        seconds, self._seconds = self._seconds, 0.0
        if self.sink is None:
            return
        tokens_per_sec = stats.positions / max(seconds - stats.generation_seconds, 1e-9)
        row = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
               "tokens_per_sec": tokens_per_sec, "loss_tokens_per_sec": stats.loss_tokens / seconds,
               "mfu": self.flops_per_token * tokens_per_sec / self.peak_flops,
               "peak_mem_mb": peak_memory_mb(self.device), "epoch": epoch, "tokens": tokens_seen, **stats.metrics}
        status = {"loss": f"{stats.loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tokens_per_sec:.0f}"}
        if stats.generated_tokens:
            row["rollout_tokens_per_sec"] = stats.generated_tokens / max(stats.generation_seconds, 1e-9)
        if "reward/mean" in stats.metrics:
            status["reward"] = f"{stats.metrics['reward/mean']:.3f}"
        if val_loss is not None:
            row["val_loss"] = val_loss
            status["val_loss"] = f"{val_loss:.4f}"
        self.sink.log(row)
        self.bar.set_postfix(status)
        if self.interactive and val_loss is not None:  # a line of its own above the bar: the bar's text was cut at
            self.bar.write(f"step {step} val_loss {val_loss:.4f}", file=sys.stdout)  # 80 columns, replaced next step
        if not self.interactive:
            of = f"/{self.cfg.train.max_steps}" if self.cfg.train.max_time is None else ""
            print(f"step {step}{of} " + " ".join(f"{k} {v}" for k, v in status.items()), flush=True)

    def log_samples(self, step: int, rows: list[dict[str, Any]] | None) -> None:
        """Samples of an evaluation (rank 0 passes them; other ranks pass None): to the sink and the console."""
        if self.sink is None or not rows:
            return
        self.sink.log_samples(step, rows)
        for row in rows:
            self.bar.write(f"  sample {row['prompt']!r} -> {row['completion']!r}", file=sys.stdout)

    def close(self, exit_code: int) -> None:
        try:
            self.bar.close()  # may fail on a stream that is gone: the wandb run is ended all the same
        finally:
            if self.sink is not None:
                self.sink.close(exit_code)
