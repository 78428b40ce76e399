"""Probe run in a fresh interpreter by tests/test_step_syncs.py: build a one-rank trainer of a stage (pretrain or
sft, from scratch), then count the host
syncs (`.item()`, `.tolist()`, `int(t)`, ...) and collectives that OUR code (llm/, kernels/) issues while it
trains, reduces a logged step, evaluates and votes on stopping. Prints one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from llm.cli import end_now
from llm.config import build_config
from llm.data.prepared import read_data_attrs
from llm.runtime.distributed import setup_distributed
from llm.train.ds_config_file import load_ds_config
from llm.train.engine import resolve_ds_config, resolve_precision
from llm.train.job import build_trainer

PACKAGE_DIRS = tuple(str(Path(__file__).resolve().parents[2] / name) + "/" for name in ("llm", "kernels"))
SYNCS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")
events: list[dict] = []
phase = "setup"


def _ours(depth: int = 2) -> str | None:
    frame = sys._getframe(depth)
    name = frame.f_code.co_filename
    return f"{Path(name).name}:{frame.f_lineno}" if name.startswith(PACKAGE_DIRS) else None


def _watch_syncs() -> None:
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, _name=name, **kwargs):
            where = _ours()
            if where:
                events.append({"phase": phase, "kind": "sync", "what": _name, "where": where})
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, wrapper)


def _watch_collectives(device: torch.device) -> None:
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        where = _ours()
        if where:
            events.append({"phase": phase, "kind": "collective", "where": where, "device": str(tensor.device),
                           "on_training_device": tensor.device == device})
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


def main(stage: str, data: str, run: str, overrides: list[str]) -> None:
    global phase
    cfg = build_config("demo", [f"train.stage={stage}", *overrides], paths={"data.path": data})
    attrs = read_data_attrs(data, stage)
    info = setup_distributed()
    cfg.train.precision = resolve_precision(cfg.train.precision, info.device)
    raw, source = load_ds_config(None, stage)
    trainer = build_trainer(cfg, Path(run), info, resolve_ds_config(raw, cfg, 1, source), attrs)
    _watch_syncs()
    _watch_collectives(info.device)
    for step in range(2):
        phase = f"train_step {step + 1}"
        sums, batches = trainer.train_step()
    phase = "reduce_step"
    trainer.reduce_step(sums, batches)
    phase = "evaluate"
    trainer.evaluate()
    phase = "stop vote"
    trainer.preemption.agreed()
    print(json.dumps({"events": events, "grad_accum": cfg.train.grad_accum}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
    end_now(0)  # as a rank ends (`end_rank`): the teardown of its process group aborted it once in a full run
