"""SFT and DPO: data shapes, loss masks, packing, training on 2 ranks, exact resume, the pretrain -> SFT -> DPO chain."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import run_cli, shared, train_args
from llm.config import ModelConfig
from llm.data.datasets import PackedConversations, PreferencePairs
from llm.data.formats import RecordError, conversation, preference
from llm.data.prepare import encode_sft, prepare
from llm.model import Transformer, masked_cross_entropy
from llm.tokenizer import Tokenizer
from llm.train.checkpoint import consolidated_weights


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- data -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, folder", [("sft", "sft"), ("dpo", "dpo")])
def test_every_shared_file_prepares(tokenizer_dir, tmp_path, kind, folder):
    files = sorted(p for p in shared(folder).iterdir() if p.suffix in (".json", ".jsonl"))
    assert len(files) >= 2
    for path in files:
        report = prepare(kind, [str(path)], tokenizer_dir, tmp_path / path.stem, seq_len=1024, workers=2,
                         show_progress=False)
        assert report.documents["train"] + report.documents["val"] > 0, path
        assert all(s.startswith(f"{path}:") for s in report.skipped)


def test_documented_handling_of_bad_conversations(tokenizer_dir, tmp_path):
    records = [
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"role": "user", "content": "no reply here"}]},
        {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
        {"conversations": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"instruction": "add", "input": "1 and 2", "output": "3"},
        {"text": "not a conversation"},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    report = prepare("sft", [str(path)], tokenizer_dir, tmp_path / "out", val_fraction=0.0, workers=1,
                     show_progress=False)
    assert report.documents["train"] == 3
    assert report.skipped == [f"{path}:2: no assistant reply", f"{path}:3: empty assistant reply",
                              f"{path}:4: unknown role 'wizard'; expected one of system, user, human, assistant, gpt, bot",
                              f"{path}:7: not a conversation (keys: text); expected 'conversations', 'messages' or "
                              "'instruction'/'output'"]
    strict = run_cli("data", "prepare", "--kind", "sft", "--input", path, "--tokenizer", tokenizer_dir, "--out",
                     tmp_path / "strict", "--strict")
    assert strict.returncode == 2 and f"{path}:2: no assistant reply" in strict.stderr


def test_shapes_normalise_to_messages_and_pairs():
    assert conversation({"instruction": "add", "input": "1 and 2", "output": "3", "system": "math"}) == [
        {"role": "system", "content": "math"}, {"role": "user", "content": "add\n1 and 2"},
        {"role": "assistant", "content": "3"}]
    prompt, chosen, rejected = preference({"conversations": [{"from": "human", "value": "q"}],
                                           "chosen": {"from": "gpt", "value": "good"},
                                           "rejected": {"from": "gpt", "value": "bad"}})
    assert (prompt, chosen, rejected) == ([{"role": "user", "content": "q"}], "good", "bad")
    assert preference({"prompt": "q", "chosen": "a", "rejected": "b"})[1:] == ("a", "b")
    with pytest.raises(RecordError, match="end with a user turn"):
        preference({"conversations": [{"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"})


def test_loss_mask_is_exactly_the_assistant_replies(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "和 3+3 呢？"},
                {"role": "assistant", "content": "六。\nSix."}]
    sample, truncated = encode_sft(tok, messages, max_tokens=10_000)
    tokens, mask = sample["tokens"], sample["loss_mask"]
    assert not truncated and tok.decode(tokens) == tok.render_chat(messages)
    runs, current = [], []
    for token, bit in zip(tokens + [None], mask + [0]):
        if bit:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    assert runs == ["4<|im_end|>", "六。\nSix.<|im_end|>"]
    unmasked = tok.decode([t for t, bit in zip(tokens, mask) if not bit])
    assert unmasked == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                        "<|im_start|>assistant\n\n<|im_start|>user\n和 3+3 呢？<|im_end|>\n<|im_start|>assistant\n\n")


def test_long_conversations_are_cut_at_a_turn_boundary(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2 " * 50}, {"role": "assistant", "content": "a2 " * 50}]
    full, _ = encode_sft(tok, messages, 10_000)
    first, _ = encode_sft(tok, messages[:2], 10_000)
    sample, truncated = encode_sft(tok, messages, len(full["tokens"]) - 1)
    assert truncated and sample == first  # the whole first exchange, nothing of the second
    assert tok.decode(sample["tokens"]).endswith("a1<|im_end|>\n")


@pytest.fixture(scope="module")
def sft_data(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    prepare("sft", [str(shared("sft"))], tokenizer_dir, out, val_fraction=0.02, seq_len=512, workers=2,
            show_progress=False)
    return out


def test_packing_pads_under_ten_percent_on_the_shared_sft_files(sft_data):
    windows = PackedConversations(sft_data, "train", 512, pad_id=3)
    assert windows.padding_fraction < 0.10
    shared_window = next(i for i, w in enumerate(windows.windows) if len(w) >= 3)
    sample = windows[shared_window]
    segments = sample["segment_ids"]
    assert segments.max() == len(windows.windows[shared_window])  # several conversations share the window
    filled = segments > 0
    assert (sample["loss_mask"][~filled] == 0).all()
    assert sorted(i for w in windows.windows for i in w) == list(range(len(windows.offsets) - 1))  # each once


def test_a_samples_loss_does_not_depend_on_its_window_mates():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    target = torch.randint(0, 97, (1, 9))

    def loss_of_target(mate_length: int) -> float:
        mate = torch.randint(0, 97, (1, mate_length))
        tokens = torch.cat([mate, target[:, :-1]], 1)
        targets = torch.cat([torch.zeros_like(mate), target[:, 1:]], 1)
        mask = torch.cat([torch.zeros_like(mate), torch.ones(1, 8, dtype=torch.long)], 1)
        segments = torch.cat([torch.ones_like(mate), torch.full((1, 8), 2)], 1)
        return masked_cross_entropy(model(tokens, segment_ids=segments).logits, targets, mask).item()

    alone = masked_cross_entropy(model(target[:, :-1]).logits, target[:, 1:], None).item()
    assert loss_of_target(5) == pytest.approx(alone, abs=1e-6)
    assert loss_of_target(20) == pytest.approx(alone, abs=1e-6)


def test_preference_pairs_mask_the_replies(tokenizer_dir, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    prepare("dpo", [str(path)], tokenizer_dir, tmp_path / "out", val_fraction=0.0, workers=1, show_progress=False)
    pair = PreferencePairs(tmp_path / "out", "train", 32, pad_id=3)[0]
    tok = Tokenizer.load(tokenizer_dir)
    for reply, text in (("chosen", "4"), ("rejected", "5")):
        mask = pair[f"{reply}_mask"].bool()
        assert tok.decode(pair[f"{reply}_targets"][mask].tolist()) == f"{text}<|im_end|>"
        prompt_end = int(mask.nonzero()[0])
        assert tok.decode(pair[f"{reply}_tokens"][:prompt_end + 1].tolist()).endswith("<|im_start|>assistant\n")


# ---- training -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_train_data(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft64")
    prepare("sft", [str(shared("sft", "chatterbot_zh.jsonl")), str(shared("sft", "identity.json"))], tokenizer_dir,
            out, val_fraction=0.05, seq_len=64, workers=2, show_progress=False)
    return out


@pytest.fixture(scope="module")
def dpo_data(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    prepare("dpo", [str(shared("dpo"))], tokenizer_dir, out, val_fraction=0.02, seq_len=64, workers=2,
            show_progress=False)
    return out


def _stage_args(stage, data, out, init_from, *overrides, nproc=2, extra=()):
    args = train_args(data, out, "data.seq_len=64", "train.precision=fp32", "train.eval_every=2", *overrides,
                      nproc=nproc, extra=["--init-from", init_from, *extra])
    args[1] = stage
    return args


@pytest.fixture(scope="module")
def chain(zero_runs, sft_train_data, dpo_data, tmp_path_factory):
    """pretrain (ZeRO-2 run) -> sft -> dpo, under ZeRO-2 and ZeRO-3, 2 ranks each."""
    runs = {}
    for stage in (2, 3):
        sft = tmp_path_factory.mktemp(f"sft{stage}")
        result = run_cli(*_stage_args("sft", sft_train_data, sft, zero_runs[2], "train.max_steps=4",
                                      extra=["--zero-stage", stage]))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        dpo = tmp_path_factory.mktemp(f"dpo{stage}")
        result = run_cli(*_stage_args("dpo", dpo_data, dpo, sft, "train.max_steps=4", "train.micro_batch_size=2",
                                      "train.lr=1e-4", extra=["--zero-stage", stage]))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        runs[stage] = {"sft": sft, "dpo": dpo}
    return runs


@pytest.mark.parametrize("stage", [2, 3])
def test_sft_then_dpo_on_two_ranks(chain, stage):
    sft_rows, dpo_rows = _metrics(chain[stage]["sft"]), _metrics(chain[stage]["dpo"])
    assert [r["step"] for r in sft_rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in sft_rows)
    assert [r["step"] for r in dpo_rows] == [1, 2, 3, 4]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"):
        assert all(key in r for r in dpo_rows)
    assert dpo_rows[0]["loss"] == pytest.approx(math.log(2), abs=0.01)  # policy starts as the reference
    assert json.loads((chain[stage]["dpo"] / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage


def test_sft_starts_from_the_pretrained_weights(zero_runs, chain):
    start = consolidated_weights(zero_runs[2])
    after = consolidated_weights(chain[2]["sft"])
    drift = max((after[k] - start[k]).abs().max().item() for k in start)
    assert 0 < drift < 0.1  # moved by 4 small steps from the pretrained weights, not from a fresh init


def test_init_from_a_different_shape_is_refused(zero_runs, sft_train_data, tmp_path):
    result = run_cli(*_stage_args("sft", sft_train_data, tmp_path, zero_runs[2], "model.dim=96", "train.max_steps=1",
                                  nproc=1))
    assert result.returncode == 2 and "model.dim 64 there, 96 here" in result.stderr


def test_dpo_needs_init_from(dpo_data, tmp_path):
    result = run_cli("train", "dpo", "--recipe", "demo", "--data", dpo_data, "--out", tmp_path)
    assert result.returncode == 2 and "--init-from" in result.stderr


def _start(args, log):
    return subprocess.Popen([sys.executable, "-m", "llm", *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_sigkill_then_resume_is_bit_exact(stage, chain, sft_train_data, dpo_data, tmp_path):
    data, init = (sft_train_data, chain[2]["sft"]) if stage == "sft" else (dpo_data, chain[2]["sft"])
    steps = ["train.max_steps=6", "train.save_every=3", "train.eval_every=0", "train.micro_batch_size=8"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_cli(*_stage_args(stage, data, straight, init, *steps))
    assert result.returncode == 0, result.stderr[-3000:]
    latest = killed / "checkpoints" / "latest"
    with open(tmp_path / "killed.log", "w") as log:
        proc = _start(_stage_args(stage, data, killed, init, *steps), log)
        try:
            deadline = time.time() + 300
            while not (latest.is_file() and latest.read_text() == "global_step3"):
                assert proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
                time.sleep(0.005)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = run_cli(*_stage_args(stage, data, killed, init, *steps, extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = _metrics(straight), _metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    wa, wb = consolidated_weights(straight), consolidated_weights(killed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dpo_sanity_loss_starts_at_ln2_and_accuracy_rises(zero_runs, tokenizer_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{a} plus {b}?", "chosen": f"{a + b}", "rejected": f"{a + b + 7}"}
            for a in range(4) for b in range(4)]
    pairs.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert run_cli("data", "prepare", "--kind", "dpo", "--input", pairs, "--tokenizer", tokenizer_dir, "--out",
                   tmp_path / "data", "--val-fraction", 0, "--seq-len", 32).returncode == 0
    result = run_cli(*_stage_args("dpo", tmp_path / "data", tmp_path / "run", zero_runs[2], "data.seq_len=32",
                                  "train.max_steps=30", "train.micro_batch_size=8", "train.lr=3e-3",
                                  "train.warmup_steps=1", "train.eval_every=0", "train.dpo_beta=0.5", nproc=1))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path / "run")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=0.01)
    assert max(r["rewards/accuracy"] for r in rows[-5:]) > 0.9
    assert rows[-1]["loss"] < rows[0]["loss"]
