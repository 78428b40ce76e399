"""The run directory: what `zerollm train` writes, and where every other command looks for it.

    RUN_DIR/
        config.yaml                  the resolved run config
        ds_config.json               the resolved DeepSpeed config
        metrics.jsonl                one JSON object per logged step
        samples.jsonl                greedy generations from fixed prompts at each evaluation
        run_record.jsonl             one record per start or resume: command, code, versions, hosts, data
        eval/                        `zerollm eval --tasks` results (lm-evaluation-harness tables and JSON)
        tokenizer/                   a copy of the tokenizer the data was prepared with
        checkpoints/
            global_step<N>/          DeepSpeed's files (model, optimizer / ZeRO partitions, scheduler)
                                     + client_state.json (step, sampler, run id, world size)
                                     + rng_rank<R>.pt (every RNG of rank R)
            latest                   the tag of the newest *complete* checkpoint
            universal/global_step<N> while resuming on another world size: DeepSpeed's universal
                                     checkpoint of global_step<N> (removed once loaded)

A prepared data directory keeps its tokenizer under the same folder name (`TOKENIZER_DIR`).

This module names and reads the layout only (no torch, no model code), so the launcher can use it
cheaply; `llm.train.checkpoint` writes checkpoints and `llm.loading` rebuilds models from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llm.errors import UserError

CONFIG_FILE = "config.yaml"
DS_CONFIG_FILE = "ds_config.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
RUN_RECORD_FILE = "run_record.jsonl"
EVAL_DIR = "eval"
TOKENIZER_DIR = "tokenizer"
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
CLIENT_STATE = "client_state.json"
UNIVERSAL_DIR = "universal"
TAG_PREFIX = "global_step"


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def config_file(run_dir: Path) -> Path:
    return run_dir / CONFIG_FILE


def tokenizer_dir(directory: Path) -> Path:
    """The tokenizer copy kept in a run directory or a prepared data directory."""
    return directory / TOKENIZER_DIR


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def universal_dir(run_dir: Path) -> Path:
    return checkpoint_dir(run_dir) / UNIVERSAL_DIR


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def step_of(tag: str) -> int:
    return int(tag.removeprefix(TAG_PREFIX))


def rng_file(run_dir: Path, tag: str, rank: int) -> Path:
    return checkpoint_dir(run_dir) / tag / f"rng_rank{rank}.pt"


def latest_tag(run_dir: Path) -> str | None:
    """The tag `latest` names (None before the first checkpoint)."""
    path = checkpoint_dir(run_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not (checkpoint_dir(run_dir) / tag).is_dir():
        raise UserError(f"{path} names '{tag}', which does not exist; delete the file to start over")
    return tag


def client_state_of(run_dir: Path, tag: str) -> dict[str, Any]:
    client_file = checkpoint_dir(run_dir) / tag / CLIENT_STATE
    if not client_file.is_file():
        raise UserError(f"{client_file.parent}: no {CLIENT_STATE}; the checkpoint is incomplete")
    return json.loads(client_file.read_text())
