"""Checkpoints: DeepSpeed's layout plus our client state, with an atomic `latest`.

    RUN_DIR/checkpoints/
        global_step<N>/          DeepSpeed's files (model, optimizer / ZeRO partitions, scheduler)
                                 + client_state.json (step, sampler, run id, world size)
                                 + rng_rank<R>.pt (every RNG of rank R)
        latest                   the tag of the newest *complete* checkpoint

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
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llm.errors import UserError

LATEST, CLIENT_STATE = "latest", "client_state.json"


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


def load(engine, run_dir: Path, tag: str) -> dict[str, Any]:
    """Restore engine, optimizer, scheduler and this rank's RNGs; return the client state."""
    root = checkpoint_dir(run_dir)
    client_file = root / tag / CLIENT_STATE
    if not client_file.is_file():
        raise UserError(f"{root / tag}: no {CLIENT_STATE}; the checkpoint is incomplete")
    client_state = json.loads(client_file.read_text())
    saved_world = client_state["world_size"]
    if saved_world != dist.get_world_size() and engine.zero_optimization_stage() > 0:
        raise UserError(f"{root / tag} was saved by {saved_world} ranks, this job has {dist.get_world_size()}; "
                        "resuming ZeRO partitions on a different world size is not supported yet: "
                        "resume with the original number of ranks")
    path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise UserError(f"{root / tag}: DeepSpeed could not load this checkpoint")
    rng_file = root / tag / f"rng_rank{dist.get_rank()}.pt"
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
