"""The record of every run (command, code, versions, hosts and ranks, data digest) in the run directory and the wandb
config; samples at each evaluation under ZeRO-3 on two ranks; a resume on changed data is refused."""

import json
import os
import shlex
import socket
import subprocess

import h5py
import numpy as np
import pytest
import torch
from forked_ranks import run_job
from wandb_files import wandb_records

from conftest import FIXTURES, REPO, SHADOWING, folder_shadowing_zerollm, run_cli, train_args
from llm.data.prepare import STREAMS, TOKENS_FILE, SplitWriter, write_attrs
from llm.errors import UserError
from llm.runtime.cpu_threads import cpu_threads_per_rank
from llm.runtime.fingerprint import code_version, file_digest

PROMPTS = 'train.sample_prompts=["Hello", "你好"]'
ZERO3_ARGS = ["train.max_steps=2", "train.eval_every=1", "train.precision=fp32", PROMPTS, "train.sample_tokens=6"]


@pytest.fixture(scope="module")
def zero3_run(pretrain_data, tmp_path_factory):
    """Started as a user starts it (not with forked ranks): the record names the command as typed."""
    out, temporary = tmp_path_factory.mktemp("zero3_record"), tmp_path_factory.mktemp("temporary")
    result = run_cli(*train_args(pretrain_data, out, *ZERO3_ARGS, nproc=2, extra=["--zero-stage", 3, "--wandb",
                                                                                  "offline"]),
                     env={"TMPDIR": str(temporary)}, cwd=folder_shadowing_zerollm(tmp_path_factory.mktemp("project")),
                     as_script=True)  # a user's llm.py there ran on each rank (`python -u -m llm`), exit 0
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert SHADOWING not in result.stdout
    # the temporary folders of the job's processes are gone with them: wandb's two (media and artifacts) were left
    # by every run logged to it, as its rank ended without interpreter teardown (`llm.cli.end_now`)
    # (torch's compiler keeps its cache there, torchinductor_USER, meant to stay)
    assert [path.name for path in temporary.iterdir() if not path.name.startswith("torchinductor_")] == []
    return out


def _records(run):
    return [json.loads(line) for line in (run / "run_record.jsonl").read_text().splitlines()]


def test_the_run_record_names_command_code_versions_ranks_and_data(zero3_run, pretrain_data):
    (record,) = _records(zero3_run)
    typed = train_args(pretrain_data, zero3_run, *ZERO3_ARGS, nproc=2, extra=["--zero-stage", 3, "--wandb", "offline"])
    assert record["command"] == shlex.join(["zerollm", *map(str, typed)])  # --nproc 2 was missing
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["code"]["git"]["commit"] == head and record["code"]["digest"] == code_version()
    assert record["versions"]["torch"] == torch.__version__ and "deepspeed" in record["versions"]
    assert record["world_size"] == 2 and [r["rank"] for r in record["ranks"]] == [0, 1]
    assert {r["host"] for r in record["ranks"]} == {socket.gethostname()}
    assert len({r["pid"] for r in record["ranks"]}) == 2
    assert [r["cpu_threads"] for r in record["ranks"]] == [cpu_threads_per_rank(2, os.environ)] * 2
    with h5py.File(pretrain_data / "tokens.h5") as h5:
        tokens = {split: h5[split]["tokens"].shape[0] for split in ("train", "val")}
    from llm.data.prepare import tokens_digest

    assert record["data"]["digest"] == tokens_digest(pretrain_data / "tokens.h5") and record["data"]["tokens"] == tokens
    assert record["data"]["digest_method"] == "whole"
    assert record["resumed_from"] is None


def test_an_untracked_module_makes_the_checkout_dirty(tmp_path):
    """git status was asked with --untracked-files=no: a new .py file under the package left `dirty` false."""
    from llm.train.run_record import git_state

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("runs/\n")
    git("add", ".gitignore")
    git("commit", "-qm", "start")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "metrics.jsonl").write_text("{}\n")
    assert git_state(tmp_path)["dirty"] is False  # an ignored file is not a change
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "new_module.py").write_text("x = 1\n")
    assert git_state(tmp_path)["dirty"] is True


def test_the_code_digest_covers_the_package_source():
    empty = "e3b0c44298fc1c14"  # sha256 of nothing: what a digest of no files gives
    assert code_version() != empty


@pytest.mark.parametrize("edited", ["llm/train/job.py", "llm/configs/pretrain.yaml", "kernels/rope.py",
                                    "launch/launcher.py", "ds_configs/pretrain_zero3.json"])
def test_an_edit_to_any_source_or_config_file_of_the_checkout_changes_the_code_digest(edited, tmp_path, monkeypatch):
    """Unpinned: an edit to a DeepSpeed config or a kernel left the digest as it was (nodes running different copies
    agreed, and a run record named no change)."""
    from llm.runtime import fingerprint

    files = ["llm/train/job.py", "llm/configs/pretrain.yaml", "kernels/rope.py", "launch/launcher.py",
             "ds_configs/pretrain_zero3.json"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"{name}\n")
    monkeypatch.setattr(fingerprint, "PACKAGE_ROOT", tmp_path)
    before = code_version()
    (tmp_path / edited).write_text(f"{edited} edited\n")
    assert code_version() != before


def test_samples_at_each_evaluation_under_zero3_reach_the_file_and_wandb(zero3_run):
    rows = [json.loads(line) for line in (zero3_run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [(1, "Hello"), (1, "你好"), (2, "Hello"), (2, "你好")]
    assert all(isinstance(r["completion"], str) for r in rows)
    (wandb_file,) = (zero3_run / "wandb").glob("offline-run-*/run-*.wandb")
    config_keys, history_keys = set(), []
    for record in wandb_records(wandb_file):
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
    from llm.tokenizer import Tokenizer
    from llm.train.run_record import check_same_data, prompts_summary, write_run_record

    llama = Tokenizer.load(FIXTURES / "tokenizers" / "llama")  # a real post-processor: the two hashes differ
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    data = {"path": str(prompts), "digest": file_digest(prompts), "tokens": {}}  # as runs recorded it then
    write_run_record(tmp_path, {"data": {**data, "tokenizer_hash": llama.legacy_hash}})
    now = prompts_summary([prompts], {"tokenizer_hash": llama.hash})
    check_same_data(tmp_path, now, [prompts], llama.legacy_hash)
    with pytest.raises(UserError, match=f"tokenizer {llama.legacy_hash} then, {llama.hash} now"):
        check_same_data(tmp_path, now, [prompts])


def test_grpo_prompts_in_a_datasets_folder_are_recorded_and_a_change_to_them_is_refused(tmp_path):
    """A save_to_disk folder of prompts (which GRPO reads as `data prepare` does) ended `train grpo` in a traceback:
    IsADirectoryError from the digest of its prompt files."""
    import datasets

    from llm.train.run_record import check_same_data, prompts_summary, write_run_record

    folder = tmp_path / "prompts"
    datasets.Dataset.from_dict({"prompt": ["1 + 1 =", "2 + 2 ="], "answer": ["2", "4"]}).save_to_disk(folder)
    run = tmp_path / "run"
    run.mkdir()
    write_run_record(run, {"data": prompts_summary([folder], {"tokenizer_hash": "tok"})})
    check_same_data(run, prompts_summary([folder], {"tokenizer_hash": "tok"}), [folder])
    datasets.Dataset.from_dict({"prompt": ["1 + 1 =", "2 + 2 ="], "answer": ["2", "5"]}).save_to_disk(folder)
    with pytest.raises(UserError, match=r"not the data .* was trained on"):
        check_same_data(run, prompts_summary([folder], {"tokenizer_hash": "tok"}), [folder])


def test_a_cache_file_that_datasets_writes_into_a_prompt_folder_is_no_change_to_its_prompts(tmp_path):
    """The folder's digest covered every file in it, so the cache file of a `.map()` the user ran on the loaded
    dataset had a resume refused as trained on other data; the prompts are read from its data files alone. A record
    of the version before (every file, a cache file included) is still taken for the same prompts."""
    import datasets

    from llm.runtime.fingerprint import whole_file_digest
    from llm.train.run_record import check_same_data, prompts_summary, write_run_record

    folder = tmp_path / "prompts"
    datasets.Dataset.from_dict({"prompt": ["1 + 1 =", "2 + 2 ="], "answer": ["2", "4"]}).save_to_disk(folder)
    # without a cache file, the same digest as the version before made of every file
    assert prompts_summary([folder], {"tokenizer_hash": "tok"})["digest"] == whole_file_digest(folder)
    run = tmp_path / "run"
    run.mkdir()
    write_run_record(run, {"data": prompts_summary([folder], {"tokenizer_hash": "tok"})})
    datasets.load_from_disk(str(folder)).map(lambda row: {"answer": row["answer"] + "!"})
    assert len(list(folder.glob("cache-*.arrow"))) == 1
    check_same_data(run, prompts_summary([folder], {"tokenizer_hash": "tok"}), [folder])
    before = tmp_path / "before"  # recorded by the version before, its digest of every file, the cache's included
    before.mkdir()
    write_run_record(before, {"data": {**prompts_summary([folder], {"tokenizer_hash": "tok"}),
                                       "digest": whole_file_digest(folder)}})
    check_same_data(before, prompts_summary([folder], {"tokenizer_hash": "tok"}), [folder])
    data_file = next(folder.glob("data-*.arrow"))
    data_file.write_bytes(data_file.read_bytes().replace(b"2 + 2 =", b"2 + 3 ="))
    for trained in (run, before):
        with pytest.raises(UserError, match=r"not the data .* was trained on"):
            check_same_data(trained, prompts_summary([folder], {"tokenizer_hash": "tok"}), [folder])


def _tokens_h5(folder, middle_token):
    """A tokens.h5 of 2 x 1.5 M tokens (more than the two MiB a sampled digest reads), written as `data prepare`
    writes it, whose one token in the middle of the train split is `middle_token`."""
    folder.mkdir()
    tokens = np.arange(3_000_000, dtype=np.uint16) % 500
    tokens[1_500_000] = middle_token
    with h5py.File(folder / TOKENS_FILE, "w") as h5:
        for split, part in (("train", tokens), ("val", tokens[:100])):
            writer = SplitWriter(h5.create_group(split), STREAMS["pretrain"], np.uint16)
            writer.append({"tokens": part})
            writer.close()
        write_attrs(h5, "pretrain", "tok", 512, None)
    return folder


@pytest.fixture
def edited_data(tmp_path):
    """The same data, and the same with one token in the middle changed (same size, same first and last MiB)."""
    return _tokens_h5(tmp_path / "data", 7), _tokens_h5(tmp_path / "edited", 8)


def test_resuming_on_data_edited_between_its_first_and_last_mib_is_refused(edited_data, tmp_path):
    """The digest was the size and the first and last MiB: a resume on such data went on, and ranks holding either
    copy agreed."""
    from llm.train.run_record import check_same_data, data_summary, write_run_record

    original, edited = edited_data
    run = tmp_path / "run"
    run.mkdir()
    write_run_record(run, {"data": data_summary(original, {"tokenizer_hash": "tok"})})
    check_same_data(run, data_summary(original, {"tokenizer_hash": "tok"}), [original / TOKENS_FILE])
    now = data_summary(edited, {"tokenizer_hash": "tok"})
    with pytest.raises(UserError, match=r"not the data .* was trained on .*: tokens.h5 digest \w+ then, \w+ now\. "):
        check_same_data(run, now, [edited / TOKENS_FILE])


def test_a_record_with_the_sampled_digest_of_earlier_versions_compares_like_with_like(edited_data, tmp_path):
    """A run recorded before `digest_method` holds the sampled digest: its own data still resumes it (other data:
    the two tests of an earlier version's run below)."""
    from llm.train.run_record import check_same_data, data_summary, write_run_record

    original, _ = edited_data
    run = tmp_path / "run"
    run.mkdir()
    old = {"path": str(original), "digest": file_digest(original / TOKENS_FILE), "tokenizer_hash": "tok",
           "tokens": {"train": 3_000_000, "val": 100}}
    write_run_record(run, {"data": old})
    check_same_data(run, data_summary(original, {"tokenizer_hash": "tok"}), [original / TOKENS_FILE])


def test_a_run_recorded_by_the_previous_version_resumes_on_its_data(pretrain_data, tmp_path):
    """Its record holds the sampled digest and no digest_method; the resume compares it with the same kind."""
    run = tmp_path / "run"
    first = run_job(*train_args(pretrain_data, run, "train.max_steps=1", "train.save_every=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    (record,) = _records(run)
    del record["data"]["digest_method"]
    record["data"]["digest"] = file_digest(pretrain_data / TOKENS_FILE)
    (run / "run_record.jsonl").write_text(json.dumps(record) + "\n")
    resumed = run_job(*train_args(pretrain_data, run, "train.max_steps=2", extra=["--resume", "auto"]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 1" in resumed.stdout
    assert [r["data"].get("digest_method") for r in _records(run)] == [None, "whole"]


def _old_record(run, data_dir, digest):
    """A run record as versions before digest_method wrote it: the sampled digest of the data it trained on."""
    from llm.train.run_record import data_summary

    summary = data_summary(data_dir, {"tokenizer_hash": "tok"})
    old = {"path": summary["path"], "digest": digest, "tokenizer_hash": "tok", "tokens": summary["tokens"]}
    run.mkdir()
    (run / "run_record.jsonl").write_text(json.dumps({"data": old}) + "\n")
    return summary


def test_an_earlier_version_s_run_resumes_on_its_data_prepared_again(pretrain_data, tmp_path, capsys):
    """Preparing the same corpus again (as the note for data without a stored digest advises) changed the file's
    first MiB by the digest it stores, so the earlier record's sampled digest differed and the run was refused."""
    from llm.train.run_record import check_same_data

    run, files = tmp_path / "run", [pretrain_data / TOKENS_FILE]
    summary = _old_record(run, pretrain_data, "0123456789abcdef")  # the file as the earlier version wrote it
    check_same_data(run, summary, files)
    assert "is compared by its token counts and tokenizer only" in capsys.readouterr().err
    changed = {**summary, "tokens": {**summary["tokens"], "train": summary["tokens"]["train"] + 1}}
    with pytest.raises(UserError, match=r"train split \d+ tokens then, \d+ now"):
        check_same_data(run, changed, files)


def test_an_earlier_version_s_data_that_changed_is_still_refused(pretrain_data, tmp_path):
    """A tokens.h5 with no stored digest (prepared by an earlier version) is compared by the sampled digest."""
    from llm.train.run_record import check_same_data

    data = tmp_path / "data"
    data.mkdir()
    (data / TOKENS_FILE).write_bytes((pretrain_data / TOKENS_FILE).read_bytes())
    with h5py.File(data / TOKENS_FILE, "r+") as h5:
        del h5.attrs["content_digest"]
    run = tmp_path / "run"
    summary = _old_record(run, data, "0123456789abcdef")
    with pytest.raises(UserError, match=r"tokens.h5 digest 0123456789abcdef then, [0-9a-f]{16} now"):
        check_same_data(run, summary, [data / TOKENS_FILE])
    (run / "run_record.jsonl").unlink()
    run.rmdir()
    _old_record(run, data, file_digest(data / TOKENS_FILE))
    check_same_data(run, summary, [data / TOKENS_FILE])


def test_a_record_naming_a_file_in_bytes_that_are_not_utf8_is_written_and_reads_back(tmp_path):
    """A recipe or DeepSpeed file named in GBK bytes reached the run record, whose write ended the run's start in a
    UnicodeEncodeError traceback (exit 1)."""
    from llm.jsonl import jsonl_lines
    from llm.train.run_record import write_run_record

    name = os.fsdecode(b"recipe-\xc4\xe3.yaml")
    write_run_record(tmp_path, {"command": ["zerollm", "train", "pretrain", "--recipe", name]})
    [line] = list(jsonl_lines(tmp_path / "run_record.jsonl"))
    assert line.value == {"command": ["zerollm", "train", "pretrain", "--recipe", name]}
