"""Checkpoints: DeepSpeed's layout plus our client state, with an atomic `latest` (layout: `llm.rundir`).

`latest` is replaced (write to a temporary file, then rename) only after every rank has finished
writing, so a job killed mid-save resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llm import rundir
from llm.errors import UserError


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, run_dir: Path, step: int, client_state: dict[str, Any], keep: int) -> None:
    """Save on every rank, then (rank 0) publish it as `latest` and prune old checkpoints."""
    root = rundir.checkpoint_dir(run_dir)
    tag = rundir.tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    torch.save(rng_state(), rundir.rng_file(run_dir, tag, dist.get_rank()))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / tag / rundir.CLIENT_STATE).write_text(json.dumps(client_state, indent=1))
        tmp = root / f".{rundir.LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / rundir.LATEST)
        if keep > 0:
            done = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(rundir.TAG_PREFIX)),
                          key=lambda p: rundir.step_of(p.name))
            for old in done[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def is_partitioned(run_dir: Path, tag: str) -> bool:
    """Whether the optimizer state is split across the ranks that saved it (ZeRO, or bf16's optimizer)."""
    return any((rundir.checkpoint_dir(run_dir) / tag).glob("*zero_pp_rank_*optim_states.pt"))


def convert_to_universal(run_dir: Path, tag: str) -> None:
    """DeepSpeed's universal checkpoint of `tag` (one file per parameter and optimizer state, loadable on any
    world size), written to checkpoints/universal/<tag> by `deepspeed.checkpoint.ds_to_universal`."""
    universal = rundir.universal_dir(run_dir)
    target = universal / tag
    if target.is_dir():
        return
    partial = universal / f".{tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    source = rundir.checkpoint_dir(run_dir) / tag
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
               "--output_folder", str(partial), "--inject_missing_state"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"{source}: conversion to a universal checkpoint failed:\n"
                        f"{(result.stdout + result.stderr)[-2000:]}")
    (universal / "latest_universal").unlink(missing_ok=True)  # written by the tool; we keep `latest`
    os.replace(partial, target)


def load(engine, run_dir: Path, tag: str, universal: bool = False) -> dict[str, Any]:
    """Restore engine, optimizer, scheduler and this rank's RNGs; return the client state. `universal`: load
    the conversion made by `convert_to_universal` (the job has another world size than the one that saved)."""
    client_state = rundir.client_state_of(run_dir, tag)
    root = rundir.universal_dir(run_dir) if universal else rundir.checkpoint_dir(run_dir)
    path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise UserError(f"{root / tag}: DeepSpeed could not load this checkpoint")
    rng_file = rundir.rng_file(run_dir, tag, dist.get_rank())
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


class Checkpointer:
    """Decides when a step is saved: every `save_every` steps (0 = never on a schedule), at the end of the run,
    and when the ranks agreed to stop. `client_state(stopped_by_signal)` gives what the checkpoint records beside
    DeepSpeed's own state."""

    def __init__(self, engine, run_dir: Path, save_every: int, keep: int,
                 client_state: Callable[[bool], dict[str, Any]]) -> None:
        self.engine, self.run_dir, self.save_every, self.keep = engine, run_dir, save_every, keep
        self.client_state = client_state

    def due(self, step: int, last: bool, stopped_by_signal: bool) -> bool:
        return last or stopped_by_signal or bool(self.save_every and step % self.save_every == 0)

    def after_step(self, step: int, last: bool, stopped_by_signal: bool) -> None:
        if self.due(step, last, stopped_by_signal):
            save(self.engine, self.run_dir, step, self.client_state(stopped_by_signal), self.keep)
