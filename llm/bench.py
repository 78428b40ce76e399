"""Benchmarks (commands, never tests): `zerollm bench train`, the training throughput of a recipe on random
tokens (with --lora: full fine-tuning beside LoRA), and `zerollm bench generate`, prefill and decode speed of our
generator with and without its KV cache beside transformers' `generate`."""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from launch.own_module import zerollm_command
from llm import rundir
from llm.child_job import run_stopping_together
from llm.config import RunConfig, build_config, parse_lora_spec, refuse_set_twice
from llm.data.prepare import RANDOM_TOKENS_HASH, SPLITS, STREAMS, TOKENS_FILE, SplitWriter, write_attrs
from llm.devices import CPU_OUT_OF_MEMORY, out_of_memory, place, resolve, synchronize
from llm.errors import EXIT_PIPE_CLOSED, EXIT_PREEMPTED, UserError
from llm.export import export_model
from llm.infer.generate import TextGenerator
from llm.infer.sampling import SamplingParams
from llm.loading import load_for_inference
from llm.model import Transformer
from llm.model.from_weights import shapes_only
from llm.model.host_memory import check_generation_fits_in_memory
from llm.model.lora import apply_lora, parameter_counts
from llm.wording import plural

BENCH_VOCAB = 6400
"""Vocabulary of the random tokens when the recipe leaves it to the tokenizer."""
MAX_RANDOM_TOKENS = 1 << 24
"""The most random tokens `bench train` writes to each split; a longer benchmark goes over them again, in epochs (a
billion steps' worth was a numpy MemoryError)."""


def _write_random_data(out: Path, kind: str, vocab_size: int, records, seed: int, **attrs) -> None:
    """A data directory of `kind` whose every split holds the records `records(rng, dtype)` yields."""
    rng = np.random.default_rng(seed)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    with h5py.File(out / TOKENS_FILE, "w") as h5:
        for split in SPLITS:
            writer = SplitWriter(h5.create_group(split), STREAMS[kind], dtype)
            for record in records(rng, dtype):
                writer.append(record)
            writer.close()
        write_attrs(h5, kind, RANDOM_TOKENS_HASH, vocab_size, None, **attrs)


def write_random_tokens(out: Path, vocab_size: int, n_tokens: int, seed: int = 0) -> None:
    """A pretraining data directory of uniform random tokens (ids above the special tokens)."""
    _write_random_data(out, "pretrain", vocab_size,
                       lambda rng, dtype: [{"tokens": rng.integers(4, vocab_size, n_tokens).astype(dtype)}], seed)


def write_random_conversations(out: Path, vocab_size: int, n_conversations: int, seq_len: int, seed: int = 0) -> None:
    """An SFT data directory of random conversations, each filling one window of `seq_len` positions with loss on
    every token (so SFT trains on as many tokens per step as pretraining on the same shape)."""
    def conversations(rng, dtype):
        return ({"tokens": rng.integers(4, vocab_size, seq_len + 1).astype(dtype),
                 "loss_mask": np.ones(seq_len + 1, dtype=np.uint8)} for _ in range(n_conversations))

    _write_random_data(out, "sft", vocab_size, conversations, seed, seq_len=seq_len)


def trainable_parameters(cfg: RunConfig) -> tuple[int, int]:
    """(trainable, total) parameters of the run config's model, LoRA included; counted on the meta device."""
    with shapes_only():
        model = Transformer(cfg.model)
        if cfg.lora.r:
            apply_lora(model, cfg.lora, cfg.train.seed)
    return parameter_counts(model)


@dataclass
class TrainFigures:
    """Medians of the measured steps of one benchmarked job."""

    tokens_per_sec: float
    loss_tokens_per_sec: float
    mfu: float
    peak_mem_mb: float
    trainable: int
    total: int
    steps: int
    """Steps measured: --steps, or fewer where train.max_time ended the job sooner."""


def _median(values: Iterable[Any]) -> float:
    """The median of the numbers among `values`; NaN where there is none (metrics.jsonl holds null for a value that
    is not a number, such as the MFU of a GPU whose peak is unknown)."""
    numbers = [v for v in values if rundir.is_number(v)]
    return statistics.median(numbers) if numbers else math.nan


def _train_job(command: list[str], run: Path, warmup: int, cfg: RunConfig) -> TrainFigures | int:
    """Run a training command; its figures, or its exit code when it failed."""
    code, stopped = run_stopping_together(command)  # on Ctrl-C or SIGTERM the job stops with a checkpoint
    if code == EXIT_PREEMPTED or stopped and code != 0:  # the job advised --resume auto, into a folder now removed
        print("zerollm: note: bench train stopped, so nothing was measured; its runs were in a temporary folder, now "
              "removed: there is nothing to resume, run it again", file=sys.stderr, flush=True)
        # 130 or 143, as for any command (75 says to resume); stopped by itself, its output (this command's) was lost
        return 128 + stopped[-1] if stopped else EXIT_PIPE_CLOSED
    if code != 0:
        return code
    rows = [json.loads(line) for line in (run / rundir.METRICS_FILE).read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_sec" in r]  # the training steps' rows
    measured = [r for r in rows if r["step"] > warmup]
    if not measured:
        raise UserError(f"the job stopped after {len(rows)} step(s), within the {warmup} warm-up steps "
                        f"(train.max_time={cfg.train.max_time}): nothing was measured; raise train.max_time or "
                        "leave it out")
    return TrainFigures(*(_median(r.get(key) for r in measured)
                          for key in ("tokens_per_sec", "loss_tokens_per_sec", "mfu")),
                        max(r["peak_mem_mb"] for r in measured), *trainable_parameters(cfg), len(measured))


BENCH_TRAIN_SETS = {"train.max_steps": "--steps (with --warmup)",
                    **{key: "bench train (it measures steps alone)"
                       for key in ("train.eval_every", "train.save_every", "train.log_every", "train.eval_batches")}}
"""Run-config keys bench train sets itself, and what sets them: a --set of one is refused (it was replaced)."""


def bench_train(recipe: str, overrides: list[str], steps: int = 10, warmup: int = 2, nproc: int = 1,
                deepspeed_config: str | None = None, zero_stage: int | None = None, lora: str | None = None) -> int:
    """Train `steps + warmup` steps of `recipe` on random tokens in a temporary directory; print the medians of the
    measured steps. With `lora` (a --lora spec), fine-tune a random model of the recipe on random conversations
    (SFT) twice, every parameter and LoRA, and print both side by side. Returns the exit code."""
    if given := [o.partition("=")[0] for o in overrides if o.startswith("lora.")]:  # refused below as pretraining's
        raise UserError(f"bench train: give LoRA with --lora SPEC (e.g. --lora r=16), not --set {given[0]}: it "
                        "measures LoRA beside full fine-tuning")
    refuse_set_twice(overrides, BENCH_TRAIN_SETS)
    cfg = build_config(recipe, overrides)
    if cfg.model.vocab_size is None:  # the recipe takes the tokenizer's: bench with MiniMind's 6400
        overrides = [*overrides, f"model.vocab_size={BENCH_VOCAB}"]
        cfg.model.vocab_size = BENCH_VOCAB
    if steps < 1 or warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    lora_overrides = parse_lora_spec(lora) if lora is not None else []
    total_steps = steps + warmup
    t = cfg.train
    per_step = t.micro_batch_size * t.grad_accum * nproc
    # the samples of every step, up to MAX_RANDOM_TOKENS (then the steps go over them again), and at least one step's
    samples = max(per_step, min(total_steps * per_step, MAX_RANDOM_TOKENS // cfg.data.seq_len))
    options = [a for o in overrides for a in ("--set", o)] + [
        "--set", f"train.max_steps={total_steps}", "--set", "train.eval_every=0", "--set", "train.save_every=0",
        "--set", "train.log_every=1", "--set", "train.eval_batches=1", "--nproc", str(nproc)]
    if t.warmup_steps > total_steps:  # its schedule is not what is measured: no note that the run ends in its warmup
        options += ["--set", f"train.warmup_steps={total_steps}"]
    if deepspeed_config:
        options += ["--deepspeed", deepspeed_config]
    if zero_stage is not None:
        options += ["--zero-stage", str(zero_stage)]
    figures: dict[str, TrainFigures] = {}
    with tempfile.TemporaryDirectory(prefix="zerollm-bench-") as tmp:
        data, base = Path(tmp) / "data", Path(tmp) / "base"
        if lora is None:
            write_random_tokens(data, cfg.model.vocab_size, samples * cfg.data.seq_len + 1)
            jobs = {"": (["pretrain"], cfg)}
        else:
            write_random_conversations(data, cfg.model.vocab_size, samples, cfg.data.seq_len)
            torch.manual_seed(t.seed)
            export_model(Transformer(cfg.model), None, base)
            tuned = build_config(recipe, [*overrides, *lora_overrides, "train.stage=sft"],
                                 paths={"train.init_from": str(base)})
            jobs = {"full fine-tuning": (["sft", "--init-from", str(base)], cfg),
                    f"LoRA r={tuned.lora.r}": (["sft", "--init-from", str(base), "--lora", lora], tuned)}
        for name, (stage_args, job_cfg) in jobs.items():
            run = Path(tmp) / f"run{len(figures)}"
            command = [*zerollm_command(), "train", *stage_args, "--recipe", recipe, "--data", str(data),
                       "--out", str(run), *options]
            result = _train_job(command, run, warmup, job_cfg)
            if isinstance(result, int):
                return result
            figures[name] = result
            precision = rundir.recorded_config(run)["train"]["precision"]  # what auto became there
    print(f"\nbench train: recipe {recipe}, {'SFT on random conversations' if lora else 'random tokens'}, "
          f"{nproc} rank(s), {precision}, micro batch {t.micro_batch_size} x accum {t.grad_accum}, seq "
          f"{cfg.data.seq_len}; median of {_measured(figures, steps)} after {warmup} warm-up")
    tokens_per_step = t.micro_batch_size * t.grad_accum * nproc * cfg.data.seq_len
    lines = [("trainable parameters", lambda f: f"{f.trainable:,}"),
             ("  of all parameters", lambda f: f"{100 * f.trainable / f.total:.2f} %"),
             ("tokens/s", lambda f: f"{f.tokens_per_sec:,.0f}"),
             ("s/step", lambda f: f"{tokens_per_step / f.tokens_per_sec:.3f}"),
             ("loss-bearing tokens/s", lambda f: f"{f.loss_tokens_per_sec:,.0f}"),
             ("MFU", lambda f: f"{f.mfu:.3f}" if math.isfinite(f.mfu) else "n/a"),
             ("peak memory (MiB)", lambda f: f"{f.peak_mem_mb:,.0f}")]
    print(f"  {'':24}" + "".join(f"{name:>20}" for name in figures))
    for label, show in lines:
        print(f"  {label:<24}" + "".join(f"{show(f):>20}" for f in figures.values()))
    return 0


def _measured(figures: dict[str, TrainFigures], asked: int) -> str:
    """'N steps', for each job where they differ, and why where fewer than asked ran."""
    counts = sorted({f.steps for f in figures.values()})
    shown = f"{' / '.join(map(str, counts))} {plural('step', max(counts))}"
    return shown if counts == [asked] else f"{shown} (of --steps {asked}: train.max_time ended the job sooner)"


def _median_seconds(fn, repeats: int) -> list[float]:
    """Median over `repeats` of each element of the tuple of seconds `fn` returns, after one run not counted (the
    first call of a variant pays for allocations, lazy initialisation and cold caches)."""
    fn()
    runs = [fn() for _ in range(repeats)]
    return [statistics.median(column) for column in zip(*runs)]


def _synchronized(device: torch.device, fn):
    """`fn` whose return waits for the device, so that wall-clock times measure the work, not its queueing."""
    def run():
        out = fn()
        synchronize(device)  # MPS's too: its prefill was timed as decoding
        return out
    return run


def _rate(tokens: int, seconds: float) -> float:
    """Tokens per second; inf for a time below the clock's resolution."""
    return tokens / seconds if seconds > 0 else math.inf


def bench_generate(model_dir: str, prompt_tokens: int = 128, new_tokens: int = 64, batch: int = 1,
                   repeats: int = 3, device: str = "auto", dtype: str = "auto") -> int:
    """Prefill and decode tokens/s: our cached decoding, uncached decoding, transformers' generate."""
    if min(prompt_tokens, new_tokens, batch, repeats) < 1 or new_tokens < 2:
        raise UserError("--prompt-tokens, --batch and --repeats must be >= 1 and --new-tokens >= 2")
    where, precision = resolve(device, dtype)
    model, tokenizer = load_for_inference(model_dir)
    if prompt_tokens + new_tokens > model.cfg.max_seq_len:
        raise UserError(f"--prompt-tokens + --new-tokens exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    if where.type == "cpu":
        check_generation_fits_in_memory(model.cfg, batch, prompt_tokens + new_tokens)
    hf_dir = tempfile.TemporaryDirectory(prefix="zerollm-bench-")
    if not model.cfg.moe:
        export_model(model, None, Path(hf_dir.name))  # the same weights for transformers, written before casting
    generator = TextGenerator(place(model, where, precision), tokenizer, stop_token_ids=[])  # always --new-tokens
    rng = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, tokenizer.vocab_size, (batch, prompt_tokens), generator=rng)
    params = SamplingParams(max_new_tokens=new_tokens)

    def ours(use_cache: bool):
        def run() -> tuple[float, float]:
            start = time.perf_counter()
            steps = generator.token_steps(prompts.tolist(), params, use_cache)
            _synchronized(where, lambda: next(steps))()
            first = time.perf_counter()
            _synchronized(where, lambda: [None for _ in steps])()
            return first - start, time.perf_counter() - first
        return run

    def measured(run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
        try:
            return _median_seconds(run, repeats)
        except RuntimeError as exc:  # CUDA's torch.OutOfMemoryError, MPS's RuntimeError of its own, the host's
            if out_of_memory(exc) is None:
                raise
            device = "the host" if CPU_OUT_OF_MEMORY in str(exc) else "the GPU"
            raise UserError(f"{device} ran out of memory generating --batch {batch} of {prompt_tokens + new_tokens} "
                            "positions; lower --batch or the token counts") from None

    results = {"zerollm, KV cache": measured(ours(True)), "zerollm, no cache": measured(ours(False))}
    try:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 - optional: compared where installed
        from transformers.generation.streamers import BaseStreamer  # noqa: PLC0415
    except ImportError as exc:
        AutoModelForCausalLM, unimportable = None, f"transformers cannot be imported: {exc}"
    if AutoModelForCausalLM is not None and not model.cfg.moe:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir.name, dtype=precision).to(where).eval()
        hf_prompts = prompts.to(where)

        class FirstToken(BaseStreamer):
            """Notes when generate hands over its first new token (its first `put` is the prompt); the host has
            the token then, so the prefill is done."""

            def __init__(self) -> None:
                self.puts, self.at = 0, None

            def put(self, value) -> None:
                self.puts += 1
                if self.puts == 2:
                    self.at = time.perf_counter()

            def end(self) -> None:
                pass

        def transformers_run() -> tuple[float, float]:
            """Prefill and decode of one generate call, as ours: up to the first new token, and the rest."""
            first = FirstToken()
            with torch.no_grad():
                start = time.perf_counter()
                _synchronized(where, lambda: hf.generate(hf_prompts, max_new_tokens=new_tokens,
                                                         min_new_tokens=new_tokens, do_sample=False,
                                                         pad_token_id=tokenizer.pad_id, eos_token_id=None,
                                                         streamer=first))()
                end = time.perf_counter()
            return first.at - start, end - first.at

        results["transformers generate"] = measured(transformers_run)
    hf_dir.cleanup()
    missing = None if "transformers generate" in results else (  # the row was left out without a word
        "a mixture-of-experts model, which export refuses" if model.cfg.moe
        else unimportable)
    prefill_tokens, decode_tokens = batch * prompt_tokens, batch * (new_tokens - 1)
    cached_decode = _rate(decode_tokens, results["zerollm, KV cache"][1])
    print(f"bench generate: {model.num_parameters() / 1e6:.2f} M parameters, batch {batch}, prompt "
          f"{prompt_tokens} tokens, {new_tokens} new tokens, greedy, {where.type} "
          f"{str(precision).removeprefix('torch.')}"
          f"{f', {torch.get_num_threads()} threads' if where.type == 'cpu' else ''}; median of {repeats}")
    print(f"  {'variant':<24}{'prefill tok/s':>15}{'decode tok/s':>15}{'cached decode is':>20}")
    for name, (prefill, decode) in results.items():
        rate = _rate(decode_tokens, decode)
        print(f"  {name:<24}{_rate(prefill_tokens, prefill):15,.0f}{rate:15,.1f}{cached_decode / rate:18.2f}x")
    if missing:
        print(f"  {'transformers generate':<24}not measured ({missing})")
    return 0
