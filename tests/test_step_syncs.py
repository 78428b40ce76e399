"""The training step never waits for the device: no host sync from our code per micro-batch or per step, and
every collective of ours runs on a tensor of the training device (on a GPU a CPU tensor would crash NCCL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from conftest import FIXTURES, REPO, TINY
from llm.config import ModelConfig
from llm.data.prepare import prepare
from llm.model import Transformer
from llm.train.metrics import StepStats
from llm.train.trainer import Trainer

PROBE = Path(__file__).parent / "probes" / "step_syncs.py"
DATA_SIZED = ("nonzero", "argwhere", "bincount", "unique", "masked_select")
"""Ops whose output's size depends on the data: on a GPU, each waits for the device (torch.* and Tensor.*)."""
HOST_SYNCS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", *DATA_SIZED)
"""Tensor methods that wait for the device on a GPU: the probe's, and the data-sized ops."""


def _probe(stage, data, run, *overrides):
    result = subprocess.run([sys.executable, str(PROBE), stage, str(data), str(run), *TINY, "train.grad_accum=3",
                             "train.precision=fp32", *overrides],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["events"]


HOST_BATCH_CHECK = "datasets.py"
"""Where the batch's token ids are read on the host before the batch moves to the device
(`llm.data.datasets.check_token_ids`): on a GPU no wait for the device, on the CPU the probe cannot tell."""


def test_steps_have_no_host_syncs_and_collectives_use_the_training_device(pretrain_data, tmp_path):
    events = _probe("pretrain", pretrain_data, tmp_path / "run")
    in_steps = [e for e in events if e["phase"].startswith("train_step")
                and not e.get("where", "").startswith(HOST_BATCH_CHECK)]
    assert in_steps == [], in_steps  # 2 steps x 3 micro-batches: not one sync, not one collective of ours
    collectives = [e for e in events if e["kind"] == "collective"]
    assert {e["phase"] for e in collectives} == {"reduce_step", "evaluate", "stop vote"} or \
        {e["phase"] for e in collectives} == {"reduce_step", "evaluate"}  # one rank: the vote needs no collective
    assert all(e["on_training_device"] for e in collectives), collectives
    reduce_syncs = [e for e in events if e["phase"] == "reduce_step" and e["kind"] == "sync"]
    assert len(reduce_syncs) == 1, reduce_syncs  # the logged step waits once, for its numbers


def test_an_sft_step_adds_one_collective_on_the_training_device_and_no_sync(tokenizer_dir, tmp_path):
    """SFT weighs its micro-batches by their share of the step's reply tokens: one all-reduce per step."""
    prepare("sft", [str(FIXTURES / "sft" / "messages_zh.jsonl")], tokenizer_dir, tmp_path / "sft", val_fraction=0.1,
            seq_len=64, workers=1, show_progress=False)
    events = _probe("sft", tmp_path / "sft", tmp_path / "run", "data.seq_len=64")
    # packed windows on the CPU attend per segment, reading the bounds on the host (kernels/torch_attention.py);
    # on a GPU FlexAttention takes them on the device
    in_steps = [e for e in events if e["phase"].startswith("train_step")
                and not e.get("where", "").startswith(("torch_attention.py", HOST_BATCH_CHECK))]
    assert [(e["phase"], e["kind"]) for e in in_steps] == [("train_step 1", "collective"),
                                                           ("train_step 2", "collective")], in_steps
    assert all(e["on_training_device"] for e in in_steps), in_steps


def test_the_gradient_norm_the_trainer_keeps_is_read_at_logged_steps_only(monkeypatch):
    """fp32 without ZeRO, where DeepSpeed keeps no gradient norm, the trainer keeps it on the device; every step
    handed it to the logger as a float, read whether the step was logged or not: a wait for the device per step."""
    trainer = Trainer.__new__(Trainer)
    trainer._norm_taken_here, trainer._last_grad_norm = True, torch.tensor(2.5)
    trainer.step, trainer.tokens_seen, trainer.sampler = 7, 100, SimpleNamespace(epoch=0)
    reads, logged = [], []
    monkeypatch.setattr(torch.Tensor, "__float__", lambda self: reads.append(self) or self.item())
    logger = SimpleNamespace(log=lambda *args: logged.append(args))
    trainer._log_step(logger, 1e-3, None, None)
    assert (reads, logged[-1][3]) == ([], None)
    trainer._log_step(logger, 1e-3, StepStats(1.0, {}, 10, 10), None)
    assert (len(reads), logged[-1][3]) == (1, 2.5)


def test_an_moe_layer_waits_for_the_device_once_per_forward(monkeypatch):
    """An MoE layer reads its experts' token counts on the host once per forward (each expert module runs on its own
    number of tokens); it found each expert's tokens with `nonzero`, one sync per expert per layer."""
    ours = tuple(str(REPO / name) + "/" for name in ("llm", "kernels"))
    syncs = []

    def watch(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(ours):
                syncs.append((name, Path(frame.f_code.co_filename).name))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    model = Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=3, n_heads=4, max_seq_len=64, moe=True,
                                    n_experts=8, n_experts_per_token=2, n_shared_experts=1)).train()
    tokens = torch.randint(0, 97, (2, 24))
    for name in HOST_SYNCS:
        watch(torch.Tensor, name)
    for name in DATA_SIZED:
        watch(torch, name)
    model(tokens, tokens).loss.backward()
    assert syncs == [("tolist", "moe.py")] * 3, syncs
