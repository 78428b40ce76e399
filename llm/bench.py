"""`zerollm bench train`: training throughput of a recipe on random tokens (a benchmark, not a test)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

from llm.config import build_config
from llm.data.prepare import SPLITS, TOKENS_FILE, SplitWriter, write_attrs
from llm.errors import UserError
from llm.train.metrics import METRICS_FILE


def write_random_tokens(out: Path, vocab_size: int, n_tokens: int, seed: int = 0) -> None:
    """A pretraining data directory of uniform random tokens (ids above the special tokens)."""
    rng = np.random.default_rng(seed)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    with h5py.File(out / TOKENS_FILE, "w") as h5:
        for split in SPLITS:
            writer = SplitWriter(h5.create_group(split), dtype)
            writer.append(rng.integers(4, vocab_size, n_tokens).astype(dtype))
            writer.close()
        write_attrs(h5, "pretrain", "random", vocab_size, None)


def bench_train(args: argparse.Namespace) -> int:
    cfg = build_config(args.recipe, args.overrides)
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    total_steps = args.steps + args.warmup
    t = cfg.train
    tokens_needed = total_steps * t.micro_batch_size * t.grad_accum * args.nproc * cfg.data.seq_len + 1
    with tempfile.TemporaryDirectory(prefix="zerollm-bench-") as tmp:
        data, run = Path(tmp) / "data", Path(tmp) / "run"
        write_random_tokens(data, cfg.model.vocab_size, tokens_needed)
        command = [sys.executable, "-m", "llm", "train", "pretrain", "--recipe", args.recipe, "--data", str(data),
                   "--out", str(run), "--nproc", str(args.nproc), *sum((["--set", o] for o in args.overrides), []),
                   "--set", f"train.max_steps={total_steps}", "--set", "train.eval_every=0",
                   "--set", "train.save_every=0", "--set", "train.log_every=1", "--set", "train.eval_batches=1"]
        if args.deepspeed:
            command += ["--deepspeed", args.deepspeed]
        if args.zero_stage is not None:
            command += ["--zero-stage", str(args.zero_stage)]
        code = subprocess.run(command).returncode
        if code != 0:
            return code
        rows = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    measured = [r for r in rows if r["step"] > args.warmup]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in measured)

    print(f"\nbench train: recipe {args.recipe}, {args.nproc} rank(s), {t.precision}, micro batch "
          f"{t.micro_batch_size} x accum {t.grad_accum}, seq {cfg.data.seq_len}; median of {len(measured)} steps "
          f"after {args.warmup} warm-up")
    print(f"  tokens/s               {median('tokens_per_sec'):12,.0f}")
    print(f"  loss-bearing tokens/s  {median('loss_tokens_per_sec'):12,.0f}")
    print(f"  MFU                    {median('mfu'):12.3f}")
    print(f"  peak memory (MiB)      {max(r['peak_mem_mb'] for r in measured):12,.0f}")
    return 0
