"""The record of every run (command, code, versions, hosts and ranks, data digest) in the run directory and the wandb
config; samples at each evaluation under ZeRO-3 on two ranks; a resume on changed data is refused."""

import json
import os
import socket
import subprocess

import h5py
import pytest
import torch
from forked_ranks import run_job
from test_train import _wandb_records

from conftest import FIXTURES, REPO, run_cli, train_args
from llm.runtime.cpu_threads import cpu_threads_per_rank
from llm.runtime.fingerprint import code_version, file_digest

PROMPTS = 'train.sample_prompts=["Hello", "你好"]'


@pytest.fixture(scope="module")
def zero3_run(pretrain_data, tmp_path_factory):
    """Started as a user starts it (not with forked ranks): the record names the ranks' command line."""
    out = tmp_path_factory.mktemp("zero3_record")
    result = run_cli(*train_args(pretrain_data, out, "train.max_steps=2", "train.eval_every=1", "train.precision=fp32",
                                 PROMPTS, "train.sample_tokens=6", nproc=2,
                                 extra=["--zero-stage", 3, "--wandb", "offline"]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _records(run):
    return [json.loads(line) for line in (run / "run_record.jsonl").read_text().splitlines()]


def test_the_run_record_names_command_code_versions_ranks_and_data(zero3_run, pretrain_data):
    (record,) = _records(zero3_run)
    assert record["command"].startswith("zerollm train pretrain --recipe demo")
    assert "--zero-stage 3" in record["command"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["code"]["git"]["commit"] == head and record["code"]["digest"] == code_version()
    assert record["versions"]["torch"] == torch.__version__ and "deepspeed" in record["versions"]
    assert record["world_size"] == 2 and [r["rank"] for r in record["ranks"]] == [0, 1]
    assert {r["host"] for r in record["ranks"]} == {socket.gethostname()}
    assert len({r["pid"] for r in record["ranks"]}) == 2
    assert [r["cpu_threads"] for r in record["ranks"]] == [cpu_threads_per_rank(2, os.environ)] * 2
    with h5py.File(pretrain_data / "tokens.h5") as h5:
        tokens = {split: h5[split]["tokens"].shape[0] for split in ("train", "val")}
    assert record["data"]["digest"] == file_digest(pretrain_data / "tokens.h5") and record["data"]["tokens"] == tokens
    assert record["resumed_from"] is None


def test_the_code_digest_covers_the_package_source():
    empty = "e3b0c44298fc1c14"  # sha256 of nothing: what a digest of no files gives
    assert code_version() != empty


def test_samples_at_each_evaluation_under_zero3_reach_the_file_and_wandb(zero3_run):
    rows = [json.loads(line) for line in (zero3_run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [(1, "Hello"), (1, "你好"), (2, "Hello"), (2, "你好")]
    assert all(isinstance(r["completion"], str) for r in rows)
    from wandb.proto import wandb_internal_pb2

    (wandb_file,) = (zero3_run / "wandb").glob("offline-run-*/run-*.wandb")
    config_keys, history_keys = set(), []
    for payload in _wandb_records(wandb_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config_keys |= {item.key for item in record.config.update}
        elif kind == "history":
            history_keys.append({item.key or "/".join(item.nested_key) for item in record.history.item})
    assert "run_record" in config_keys
    assert sum("samples/_type" in keys for keys in history_keys) == 2
    (table,) = wandb_file.parent.glob("files/media/table/samples_2_*.table.json")
    logged = json.loads(table.read_text())
    assert logged["columns"] == ["step", "prompt", "completion"]
    assert logged["data"] == [[r["step"], r["prompt"], r["completion"]] for r in rows]  # the whole table so far


def test_resuming_on_changed_data_is_refused_naming_the_difference(zero3_run, pretrain_data, tokenizer_dir, tmp_path):
    other = tmp_path / "other"
    result = run_cli("data", "prepare", "--input", FIXTURES / "pretrain" / "en_notes.jsonl", "--tokenizer",
                     tokenizer_dir, "--out", other, "--val-fraction", 0.2, "--workers", 1)
    assert result.returncode == 0, result.stderr[-2000:]
    result = run_job(*train_args(other, zero3_run, "train.max_steps=3", PROMPTS, nproc=2,
                                 extra=["--zero-stage", 3, "--resume", "auto"]))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("zerollm: error:") == 1, result.stderr[-3000:]  # said once, not once per rank
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"zerollm: error: {other.resolve()}: not the data {zero3_run} was trained on")
    assert "tokens.h5 digest" in message and "train split" in message and "val split" in message
    assert f"--init-from {zero3_run}" in message
    assert len(_records(zero3_run)) == 1  # nothing was written


def test_a_grpo_run_recorded_with_the_whole_file_tokenizer_hash_resumes(tmp_path):
    """A GRPO run's input hash is its tokenizer's; runs made before the hash left out the post-processor recorded the
    whole file's hash, and resuming them was refused as changed data."""
    from llm.errors import UserError
    from llm.tokenizer import Tokenizer
    from llm.train.run_record import check_same_data, write_run_record

    llama = Tokenizer.load(FIXTURES / "tokenizers" / "llama")  # a real post-processor: the two hashes differ
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    data = {"path": str(prompts), "digest": file_digest(prompts), "tokens": {}}
    write_run_record(tmp_path, {"data": {**data, "tokenizer_hash": llama.legacy_hash}})
    check_same_data(tmp_path, {**data, "tokenizer_hash": llama.hash}, llama.legacy_hash)
    with pytest.raises(UserError, match=f"tokenizer {llama.legacy_hash} then, {llama.hash} now"):
        check_same_data(tmp_path, {**data, "tokenizer_hash": llama.hash})
