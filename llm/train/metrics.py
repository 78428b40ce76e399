"""Training metrics: throughput, MFU, memory, and the sinks (`metrics.jsonl`, wandb).

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs per token = 6 * (matmul parameters
active per token) + 12 * n_layers * dim * seq_len (attention scores), as in the PaLM paper.
The peak is `train.peak_tflops` when given, a table entry for known GPUs (dense bf16), and on CPU
the best measured rate of a 1024^3 matmul in the training dtype on the threads each rank uses (so
CPU MFU reads "share of what this machine's matmul reaches").
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch

from llm.config import ModelConfig, RunConfig
from llm.errors import UserError

METRICS_FILE = "metrics.jsonl"

# dense bf16 tensor-core peaks, TFLOP/s
GPU_PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "H800": 989.5, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                   "A10": 125.0, "4090": 165.2, "3090": 71.0}


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
    return 6.0 * matmul_params_per_token(cfg, total_params) + 12.0 * cfg.n_layers * cfg.dim * seq_len


def measure_cpu_peak_flops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best rate of a square matmul in `dtype` on this process's threads."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best


def peak_flops_per_rank(device: torch.device, configured_tflops: float | None, dtype: torch.dtype) -> float:
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return float("nan")
    return measure_cpu_peak_flops(dtype)


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory allocated (GPU), or this process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MetricsSink:
    """Writes logged steps to RUN_DIR/metrics.jsonl and, when enabled, to a wandb run. Rank 0 only."""

    def __init__(self, run_dir: Path, cfg: RunConfig, run_id: str, start_step: int) -> None:
        self.path = run_dir / METRICS_FILE
        self._truncate_after(start_step)
        self.wandb_run = None
        if cfg.wandb.mode != "off":
            try:
                import wandb
            except ImportError:
                raise UserError("wandb is not installed; `pip install wandb` or use --wandb off") from None
            self.wandb_run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name or run_dir.name, id=run_id,
                                        resume="allow", dir=str(run_dir), mode=cfg.wandb.mode, config=cfg.to_dict())

    def _truncate_after(self, step: int) -> None:
        """Drop rows past the step this run starts from (logged by a killed run, or by an earlier run)."""
        if not self.path.is_file():
            return
        rows = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
