"""The training step never waits for the device: no host sync from our code per micro-batch or per step, and
every collective of ours runs on a tensor of the training device (on a GPU a CPU tensor would crash NCCL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import TINY

PROBE = Path(__file__).parent / "probes" / "step_syncs.py"


def test_steps_have_no_host_syncs_and_collectives_use_the_training_device(pretrain_data, tmp_path):
    overrides = [*TINY, "train.grad_accum=3", "train.precision=fp32"]
    result = subprocess.run([sys.executable, str(PROBE), str(pretrain_data), str(tmp_path / "run"), *overrides],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    events = report["events"]
    in_steps = [e for e in events if e["phase"].startswith("train_step")]
    assert in_steps == [], in_steps  # 2 steps x 3 micro-batches: not one sync, not one collective of ours
    collectives = [e for e in events if e["kind"] == "collective"]
    assert {e["phase"] for e in collectives} == {"reduce_step", "evaluate", "stop vote"} or \
        {e["phase"] for e in collectives} == {"reduce_step", "evaluate"}  # one rank: the vote needs no collective
    assert all(e["on_training_device"] for e in collectives), collectives
    reduce_syncs = [e for e in events if e["phase"] == "reduce_step" and e["kind"] == "sync"]
    assert len(reduce_syncs) == 1, reduce_syncs  # the logged step waits once, for its numbers
