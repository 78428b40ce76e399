"""Checkpoints: DeepSpeed's layout plus our client state, with an atomic `latest`.

    RUN_DIR/checkpoints/
        global_step<N>/          DeepSpeed's files (model, optimizer / ZeRO partitions, scheduler)
                                 + client_state.json (step, sampler, run id, world size)
                                 + rng_rank<R>.pt (every RNG of rank R)
        latest                   the tag of the newest *complete* checkpoint
        universal/global_step<N> while resuming on another world size: DeepSpeed's universal checkpoint
                                 of global_step<N> (removed once loaded)

`latest` is replaced (write to a temporary file, then rename) only after every rank has finished
writing, so a job killed mid-save resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llm.errors import UserError

LATEST, CLIENT_STATE, UNIVERSAL = "latest", "client_state.json", "universal"


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"global_step{step}"


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


def latest_tag(run_dir: Path) -> str | None:
    path = checkpoint_dir(run_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not (checkpoint_dir(run_dir) / tag).is_dir():
        raise UserError(f"{path} names '{tag}', which does not exist; delete the file to start over")
    return tag


def save(engine, run_dir: Path, step: int, client_state: dict[str, Any], keep: int) -> None:
    """Save on every rank, then (rank 0) publish it as `latest` and prune old checkpoints."""
    root = checkpoint_dir(run_dir)
    tag = tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    torch.save(rng_state(), root / tag / f"rng_rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / tag / CLIENT_STATE).write_text(json.dumps(client_state, indent=1))
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / LATEST)
        if keep > 0:
            done = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("global_step")),
                          key=lambda p: int(p.name.removeprefix("global_step")))
            for old in done[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def client_state_of(run_dir: Path, tag: str) -> dict[str, Any]:
    client_file = checkpoint_dir(run_dir) / tag / CLIENT_STATE
    if not client_file.is_file():
        raise UserError(f"{client_file.parent}: no {CLIENT_STATE}; the checkpoint is incomplete")
    return json.loads(client_file.read_text())


def is_partitioned(run_dir: Path, tag: str) -> bool:
    """Whether the optimizer state is split across the ranks that saved it (ZeRO, or bf16's optimizer)."""
    return any((checkpoint_dir(run_dir) / tag).glob("*zero_pp_rank_*optim_states.pt"))


def universal_dir(run_dir: Path) -> Path:
    return checkpoint_dir(run_dir) / UNIVERSAL


def convert_to_universal(run_dir: Path, tag: str) -> None:
    """DeepSpeed's universal checkpoint of `tag` (one file per parameter and optimizer state, loadable on any
    world size), written to checkpoints/universal/<tag> by `deepspeed.checkpoint.ds_to_universal`."""
    target = universal_dir(run_dir) / tag
    if target.is_dir():
        return
    partial = universal_dir(run_dir) / f".{tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(checkpoint_dir(run_dir) / tag), "--output_folder", str(partial), "--inject_missing_state"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"{checkpoint_dir(run_dir) / tag}: conversion to a universal checkpoint failed:\n"
                        f"{(result.stdout + result.stderr)[-2000:]}")
    (universal_dir(run_dir) / "latest_universal").unlink(missing_ok=True)  # written by the tool; we keep `latest`
    os.replace(partial, target)


def load(engine, run_dir: Path, tag: str, universal: bool = False) -> dict[str, Any]:
    """Restore engine, optimizer, scheduler and this rank's RNGs; return the client state. `universal`: load
    the conversion made by `convert_to_universal` (the job has another world size than the one that saved)."""
    client_state = client_state_of(run_dir, tag)
    root = universal_dir(run_dir) if universal else checkpoint_dir(run_dir)
    path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise UserError(f"{root / tag}: DeepSpeed could not load this checkpoint")
    rng_file = checkpoint_dir(run_dir) / tag / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


def consolidated_weights(run_dir: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 model weights of a checkpoint of any ZeRO stage and world size, on the CPU."""
    tag = tag or latest_tag(run_dir)
    if tag is None:
        raise UserError(f"{run_dir}: no checkpoint found (expected {checkpoint_dir(run_dir) / LATEST})")
    tag_dir = checkpoint_dir(run_dir) / tag
    if any(tag_dir.glob("*zero_pp_rank_*optim_states.pt")):
        from llm.train.engine import ensure_accelerator_env

        ensure_accelerator_env()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    state = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in state["module"].items()}


def load_trained_model(run_dir: Path, tag: str | None = None):
    """(model in eval mode, run config) rebuilt from RUN_DIR/config.yaml and its newest checkpoint."""
    import yaml

    from llm.config import build_config
    from llm.model import Transformer

    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise UserError(f"{run_dir}: no config.yaml; is this a run directory made by `zerollm train`?")
    cfg = build_config(yaml.safe_load(config_file.read_text()))
    model = Transformer(cfg.model)
    missing, unexpected = model.load_state_dict(consolidated_weights(run_dir, tag), strict=False)
    tied = {"output.weight"} if cfg.model.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise UserError(f"{run_dir}: checkpoint does not match config.yaml (missing {sorted(set(missing) - tied)}, "
                        f"unexpected {sorted(unexpected)})")
    return model.eval(), cfg
