"""`zerollm bench learn`: the whole pipeline inside one wall-time budget on a user's text file."""

import errno
import json
import math
import os
import signal
import threading
from types import SimpleNamespace

import pytest

from conftest import FIXTURES, TINY, run_cli
from llm.errors import EXIT_PREEMPTED, UserError
from llm.eval.learning_speed import file_parts, write_parts


def test_the_split_keeps_every_byte_and_cuts_at_the_first_line_end_after_90_percent(tmp_path):
    source = tmp_path / "novel.txt"
    source.write_text("".join(f"第{i}回 天下大势，分久必合，合久必分。\n\n" for i in range(200)))
    train, val = write_parts(source, file_parts(source), tmp_path)
    data = source.read_bytes()
    assert train.read_bytes() + val.read_bytes() == data
    cut = len(train.read_bytes())
    assert data[cut - 1:cut] == b"\n" and b"\n" not in data[int(0.9 * len(data)):cut - 1]


@pytest.mark.parametrize("name,text", [("a.json", "[]"), ("short.txt", "one line only")])
def test_files_that_cannot_be_split_are_refused(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError):
        file_parts(tmp_path / name)


def test_a_split_the_disk_cannot_take_is_one_line_and_leaves_no_torn_part(tmp_path, monkeypatch):
    """A full disk as the parts were written was an OSError traceback (exit 1, which bench learn also gives for 'over
    budget'), a torn train.txt left behind."""
    from llm import durable

    write = durable.write_bytes

    def full(path, data):
        if path.name == "val.txt":
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, data)

    monkeypatch.setattr(durable, "write_bytes", full)
    with pytest.raises(UserError, match=rf"^{tmp_path}: no space left on device while writing the training and "
                                        "held-out parts; nothing was lost"):
        write_parts(FIXTURES / "pretrain" / "zh_stories.txt", file_parts(FIXTURES / "pretrain" / "zh_stories.txt"),
                    tmp_path)
    assert not (tmp_path / "val.txt").exists() and (tmp_path / "train.txt").stat().st_size > 0  # whole or absent


def _earlier_result(out) -> dict[str, str]:
    """An earlier bench learn's result in `out` (a few of its files), as {path in out: text}."""
    files = {".zerollm-bench-learn": "", "result.json": '{"earlier": true}', "val.txt": "earlier held-out part",
             "run/earlier": "its run", "tok/tokenizer.json": "{}"}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return files


def _files(out) -> dict[str, str]:
    return {str(path.relative_to(out)): path.read_bytes().decode(errors="replace") for path in out.rglob("*")
            if path.is_file()}


def test_an_earlier_result_waits_aside_and_comes_back_where_a_rerun_does_not_complete(tmp_path, monkeypatch):
    """A rerun into the same --out deleted the earlier result and its run first: a rerun that was stopped, failed
    or killed left no measurement at all."""
    from llm.eval import learning_speed
    from llm.runtime.preemption import Preemption

    out = tmp_path / "out"
    earlier = _earlier_result(out)
    seen = []

    def stopped_while_training(*args, **kwargs):
        seen.append(_files(out))
        monkeypatch.setattr(Preemption, "stopped_by", signal.SIGINT)
        return EXIT_PREEMPTED

    def rerun():
        return learning_speed.bench_learn(str(FIXTURES / "pretrain" / "en_stories.txt"), str(out), budget="60",
                                          reserve=1, vocab_size=300)

    monkeypatch.setattr(learning_speed, "run_training", stopped_while_training)
    assert rerun() == 130
    assert seen[0][".previous/result.json"] == earlier["result.json"] and "result.json" not in seen[0]
    assert seen[0]["val.txt"] != earlier["val.txt"]  # the rerun's own split
    assert _files(out) == earlier  # back, and nothing of the rerun's
    # killed while training: its outputs beside the earlier result aside, until the next bench learn into --out
    (out / ".previous").mkdir()
    for name in ("result.json", "val.txt", "run", "tok"):
        os.replace(out / name, out / ".previous" / name)
    (out / "train.txt").write_text("the killed run's split")
    monkeypatch.setattr(learning_speed, "run_training", lambda *args, **kwargs: (_ for _ in ()).throw(
        UserError("a refusal")))
    with pytest.raises(UserError, match="^a refusal$"):
        rerun()
    assert _files(out) == earlier


def test_bench_learn_runs_tokenizer_data_training_and_heldout_bits_per_byte_in_one_budget(tmp_path):
    """The budget counts from the process's start: its imports (6 s on a loaded 2-core machine) were left out, so a
    run that took 68 s of a 60 s budget said it was inside it."""
    novel = FIXTURES / "pretrain" / "zh_stories.txt"
    tiny = [o for o in TINY if not o.startswith(("model.vocab_size", "train.lr"))]
    tiny.append("train.max_steps=20")  # the budget, roomy for a loaded machine, is not all trained
    _earlier_result(tmp_path / "out")  # replaced once the new result is written
    result = run_cli("bench", "learn", "--input", novel, "--budget", 120, "--reserve", 48, "--vocab-size", 400,
                     "--out", tmp_path / "out", *[a for o in tiny for a in ("--set", o)])
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    assert not (tmp_path / "out" / ".previous").exists() and not (tmp_path / "out" / "run" / "earlier").exists()
    summary = json.loads((tmp_path / "out" / "result.json").read_text())
    assert summary["within_budget"] == (result.returncode == 0) == ("OVER BUDGET" not in result.stdout)
    assert list(summary["phases_s"]) == ["start-up", "split", "tokenizer", "data", "training", "evaluation"]
    assert summary["phases_s"]["start-up"] > 0.5  # the imports (torch's among them) of the command's own process
    assert summary["vocab_size"] == 400 and 0 < summary["train_max_time_s"] < 120 - 48
    heldout = summary["heldout"]
    paragraphs = [p.strip("\n") for p in (tmp_path / "out" / "val.txt").read_text().split("\n\n") if p.strip()]
    assert heldout["bytes"] == sum(len(p.encode()) for p in paragraphs) and summary["skipped"] == {
        "train": [], "heldout": []}
    assert math.isfinite(heldout["bits_per_byte"]) and heldout["context"] == 32
    assert f"held-out bits per byte  {heldout['bits_per_byte']:.4f}" in result.stdout
    config = (tmp_path / "out" / "run" / "config.yaml").read_text()
    assert "max_time: " in config and "vocab_size: 400" in config
    assert (tmp_path / "out" / "tasks" / "heldout_bpb.yaml").is_file()


@pytest.mark.parametrize("options, message", [
    (["--reserve", "100"], "--reserve must be at least 0 s and less than --budget (30 s), got 100"),
    (["--reserve", "nan"], "--reserve must be at least 0 s and less than --budget (30 s), got nan"),
    (["--reserve", "-5"], "--reserve must be at least 0 s and less than --budget (30 s), got -5"),
    (["--vocab-size", "0"], "--vocab-size 0 is too small"),  # 0 took the recipe's and trained for the whole budget
    (["--budget", "0"], "zerollm: error: --budget must be a positive duration, got '0'"),  # "config key '--budget'"
    (["--set", "train.max_time=3s"], "--set train.max_time: --budget (what it leaves after the preparation and "
                                     "--reserve) sets it too; give it once"),  # replaced without a word
    (["--set", "data.path=mine"], "--set data.path: bench learn (the training part of --input) sets it too"),
    (["--out", "{folder}"], "--out {folder} holds train.txt but no .zerollm-bench-learn, which bench learn writes "
                            "into its every output, so they may be yours; it replaces its output there, so give it a "
                            "new or empty directory (or one it wrote before)"),
    (["--out", "{folder}/train.txt/out"], "--out {folder}/train.txt/out: {folder}/train.txt is a file"),  # a traceback
    (["--out", "{tmp}/dangling"], "--out {tmp}/dangling: {tmp}/dangling is a symbolic link to {tmp}/nowhere, which "
                                  "does not exist"),  # FileExistsError traceback
    # a TypeError traceback (check_training_options(None)):
    (["--recipe", "demo"], "recipe demo leaves model.vocab_size to the tokenizer: give --vocab-size N"),
    # refused by the training job once split, tokenizer and data filled --out, so that the corrected command was
    # refused for the full --out:
    (["--deepspeed", "{tmp}/missing.json"], "{tmp}/missing.json: DeepSpeed config not found"),
    (["--deepspeed", "{tmp}/ds.json"], "{tmp}/ds.json: zero_optimization.stage must be 0, 1, 2 or 3, got 7"),
    (["--deepspeed", "{tmp}/warmup.json", "--recipe", "demo", "--vocab-size", "512"], "{tmp}/warmup.json: a "
     "'scheduler' section counts steps, and train.max_time ends the run by the clock"),  # a recipe without max_time
    # refused by the training job, once an earlier bench learn's result and run there were deleted:
    (["--set", "train.stage=sft"], "train.stage sft: bench learn measures pretraining on the training part of --input; "
                                   "leave train.stage as pretrain"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, options, message):
    """The input in --out was cut to its first 90 % before `--reserve` above the budget was refused, and an earlier
    tokens.h5 there replaced."""
    from conftest import zerollm_here

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "train.txt").write_bytes((FIXTURES / "pretrain" / "en_stories.txt").read_bytes())
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 7}}')
    (tmp_path / "warmup.json").write_text('{"scheduler": {"type": "WarmupLR"}}')
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = (folder / "train.txt").read_bytes()
    options = [option.format(folder=folder, tmp=tmp_path) for option in options]
    out = [] if "--out" in options else ["--out", str(tmp_path / "out")]
    assert zerollm_here(monkeypatch, "bench", "learn", "--input", folder / "train.txt", "--budget", "30", *out,
                        *options) == 2
    assert message.format(folder=folder, tmp=tmp_path) in capsys.readouterr().err
    assert (folder / "train.txt").read_bytes() == before and not (tmp_path / "out").exists()


def test_a_short_file_that_is_not_utf8_is_refused_for_its_encoding(tmp_path, monkeypatch, capsys):
    """It was called too short to split: true, but text that is not UTF-8 is refused however long it grows. Such
    an --input, or a missing one, left --out made, holding bench learn's marker alone."""
    from conftest import zerollm_here

    for body, said in ((b"ok\n\xc4\xe3\xba\xc3\n", "{input}:2: not valid UTF-8 text"),  # GBK
                       (b"ok\n", "{input}: too short to split into a training part and a held-out part"),
                       (None, "{input}: no such file or directory")):
        source = tmp_path / "short.txt"
        if body is None:
            source.unlink()
        else:
            source.write_bytes(body)
        assert zerollm_here(monkeypatch, "bench", "learn", "--input", source, "--budget", "30",
                            "--out", tmp_path / "out") == 2
        assert capsys.readouterr().err.startswith("zerollm: error: " + said.format(input=source))
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("earlier", [False, True])
@pytest.mark.parametrize("name, tail, said", [
    ("novel.txt", b"caf\xe9 ol\xe9\n" * 20, "{input}:301: not valid UTF-8 text"),
    ("novel.jsonl", b'{"title": "no text"}\n' * 300,
     "{part}: no usable text records to evaluate on (120 records skipped, first: {input}:481: no text "),
])
def test_a_heldout_part_the_readers_refuse_ends_bench_learn_before_it_trains(tmp_path, monkeypatch, capsys, name, tail,
                                                                           said, earlier):
    """It was read only after training: the whole budget (10 minutes by default) went before the refusal, which named
    a line of the split file rather than of the user's. With an earlier result in --out, which takes the place of the
    split's copies again, the refusal named the copy all the same."""
    from conftest import zerollm_here
    from llm.eval import learning_speed

    def trains(*args, **kwargs):
        raise AssertionError("bench learn trained before it read the held-out part")

    monkeypatch.setattr(learning_speed, "run_training", trains)
    lines = [f"The king went to the sea and found gold number {i}.\n" for i in range(300)]
    if name.endswith(".jsonl"):
        lines = [json.dumps({"text": line.strip()}) + "\n" for line in lines]
    source, out = tmp_path / name, tmp_path / "out"
    source.write_bytes("".join(lines).encode() + tail)
    if earlier:
        out.mkdir()
        kept = _earlier_result(out)
    assert zerollm_here(monkeypatch, "bench", "learn", "--input", source, "--budget", "30", "--out", out) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    copy = out / f"val{source.suffix}"
    assert error.startswith("zerollm: error: " + said.format(input=source, part=source if earlier else copy)), error
    if earlier:
        assert error.endswith(f"(in the held-out part, the last 10% of {source}; nothing was trained)")
        assert str(out) not in error and _files(out) == kept
    else:
        assert error.endswith(f"(in the held-out part, the last 10% of {source}, copied to {copy}; nothing was "
                              "trained)")
        assert copy.is_file() and not (out / "tok").exists() and not (out / "run").exists()


def test_a_refusal_from_the_training_job_ends_bench_learn_without_teardown(tmp_path, monkeypatch, capsys):
    """The training job runs in bench learn's process: a UserError it raised was printed and the process then went
    through interpreter teardown, which can abort with its DeepSpeed engine and gloo group alive (`llm.cli.end_rank`
    ends a training process at once for that reason)."""
    from conftest import zerollm_here
    from llm.eval import learning_speed

    class Ended(Exception):
        pass

    def refuses(*args, **kwargs):
        raise UserError("a refusal from inside the training job")

    this_process, real_exit = os.getpid(), os._exit

    def os_exit(code):
        if os.getpid() != this_process:  # a data-preparing worker ends as ever
            real_exit(code)
        raise Ended(code)

    monkeypatch.setattr(learning_speed, "run_training", refuses)
    monkeypatch.setattr(os, "_exit", os_exit)
    with pytest.raises(Ended) as ended:
        zerollm_here(monkeypatch, "bench", "learn", "--input", FIXTURES / "pretrain" / "en_stories.txt",
                     "--budget", "60", "--reserve", "1", "--vocab-size", "300", "--out", tmp_path / "out")
    assert ended.value.args == (2,)
    assert capsys.readouterr().err.endswith("zerollm: error: a refusal from inside the training job\n")


def test_the_training_jobs_advice_to_resume_is_bench_learns_to_run_again(tmp_path, monkeypatch):
    """A full disk while saving told a bench learn user to 'rerun with --resume auto', an option it refuses."""
    from llm.eval import learning_speed
    from llm.runtime.rerun import rerun_advice

    def out_of_room(*args, **kwargs):  # as the job's checkpoint says it
        raise UserError(f"run/checkpoints: no space left on device while saving step 4; free space and "
                        f"{rerun_advice()}")

    monkeypatch.setattr(learning_speed, "run_training", out_of_room)
    with pytest.raises(UserError) as error:
        learning_speed.bench_learn(str(FIXTURES / "pretrain" / "en_stories.txt"), str(tmp_path / "out"), budget="60",
                                   reserve=1, vocab_size=300)
    assert str(error.value).endswith(f"free space and run bench learn again into {tmp_path / 'out'} (it has no "
                                     "--resume: it starts over)")
    assert rerun_advice() == "rerun with --resume auto"  # outside it


def test_a_stop_by_a_second_signal_inside_bench_learn_says_to_run_it_again(monkeypatch):
    """Its line is written by the signal reader's thread, which starts without bench learn's words: it advised
    --resume auto."""
    import torch

    from llm.runtime import preemption
    from llm.runtime.rerun import rerun_said_as

    info = SimpleNamespace(device=torch.device("cpu"), is_main=True)
    with rerun_said_as("run bench learn again"):
        stop = preemption.Preemption(info)
    said = []
    monkeypatch.setattr(stop, "_say", lambda line, wait_s=0.0: said.append(line))
    monkeypatch.setattr(os, "_exit", lambda code: said.append(code))
    thread = threading.Thread(target=lambda: [stop._on_signal(signal.SIGINT, now) for now in (0.0, 60.0)])
    thread.start()
    thread.join()
    assert said[1:] == ["stopped at once by a second signal, without a checkpoint; run bench learn again",
                        128 + signal.SIGINT]


def test_a_failed_bench_learn_is_rerun_into_its_own_out_but_a_foreign_or_input_holding_one_is_refused(
        tmp_path, monkeypatch, capsys):
    """A bench learn that failed after its split (here: the training part is not UTF-8) left --out full, and the
    corrected command was refused for that folder; the refusal also named the split's copy, not the user's file."""
    from conftest import zerollm_here

    lines = "".join(f"The king went to the sea and found gold number {i}.\n" for i in range(300)).encode()
    source, out = tmp_path / "novel.txt", tmp_path / "out"
    source.write_bytes(b"caf\xe9\n" + lines)
    for _ in range(2):
        assert zerollm_here(monkeypatch, "bench", "learn", "--input", source, "--budget", "30", "--out", out) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"zerollm: error: {source}:1: not valid UTF-8 text (in the training part, the first 90% of {source}, "
            f"copied to {out}/train.txt; nothing was trained)")
    assert sorted(os.listdir(out)) == [".zerollm-bench-learn", "tasks", "train.txt", "val.txt"]
    assert zerollm_here(monkeypatch, "bench", "learn", "--input", out / "val.txt", "--budget", "30", "--out", out) == 2
    said = capsys.readouterr().err
    assert f"--input {out}/val.txt is inside --out {out}, whose contents bench learn replaces" in said
    (out / "notes.md").write_text("mine")
    assert zerollm_here(monkeypatch, "bench", "learn", "--input", source, "--budget", "30", "--out", out) == 2
    assert "holds notes.md, which bench learn did not write" in capsys.readouterr().err


def test_records_left_out_of_either_part_are_said(tmp_path, monkeypatch, capsys):
    """Unusable records were dropped from the training and the held-out part without a word: the bits per byte
    covered an unstated subset."""
    from conftest import zerollm_here
    from llm.eval import learning_speed

    class Trained(Exception):
        pass

    def trains(*args, **kwargs):
        raise Trained

    monkeypatch.setattr(learning_speed, "run_training", trains)
    rows = [{"text": f"The king went to the sea and found gold number {i}."} for i in range(300)]
    for i in (3, 7, 280, 290, 295):
        rows[i] = {"title": "no text"}
    source = tmp_path / "novel.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(Trained):
        zerollm_here(monkeypatch, "bench", "learn", "--input", source, "--budget", "60", "--reserve", "1",
                     "--vocab-size", "300", "--out", tmp_path / "out")
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    reason = "no text field (keys: title); expected 'text', 'conversations' or 'instruction'/'output')"
    assert notes == [f"note: 2 unusable records of the training part left out (first: {source}:4: {reason}",
                     f"note: 3 unusable records of the held-out part left out (first: {source}:281: {reason}"]


def test_the_heldout_task_is_written_atomically(tmp_path, monkeypatch):
    """tasks/heldout.jsonl and its YAML (and result.json) were written in place (a torn file after a crash)."""
    from llm import durable
    from llm.eval.learning_speed import write_heldout_task

    val = tmp_path / "val.txt"
    val.write_text("第一段。\n\nSecond paragraph.\n")
    written = []
    monkeypatch.setattr(durable, "write_text", lambda path, text, real=durable.write_text: (
        written.append(path.name), real(path, text)))
    task_dir, skipped = write_heldout_task(val, tmp_path / "tasks")
    assert written == ["heldout.jsonl", "heldout_bpb.yaml"]
    rows = [json.loads(line) for line in (task_dir / "heldout.jsonl").read_text().splitlines()]
    assert rows == [{"text": "第一段。"}, {"text": "Second paragraph."}]
    assert str((task_dir / "heldout.jsonl").resolve()) in (task_dir / "heldout_bpb.yaml").read_text()


def test_a_second_bench_learn_into_the_same_out_is_refused_while_the_first_runs(tmp_path, monkeypatch, capsys):
    """Only the training held a lock: a second one, started while the first split, prepared or evaluated, deleted
    the first's files and both printed a result (the first's from the second's held-out part)."""
    from conftest import zerollm_here
    from llm.eval.learning_speed import LEARN_MARKER
    from llm.held_locks import held_folder

    out = tmp_path / "out"
    with held_folder(out, LEARN_MARKER, "bench learn"):  # as the first bench learn holds it
        (out / "result.json").write_text("the first's")
        assert zerollm_here(monkeypatch, "bench", "learn", "--input", FIXTURES / "pretrain" / "en_stories.txt",
                            "--budget", "30", "--out", out) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"zerollm: error: --out {out}: another bench learn is writing "
                                                        "there; wait for it to end, or choose another --out")
    assert (out / "result.json").read_text() == "the first's"


def test_a_bench_learn_stopped_while_training_says_there_is_nothing_to_resume(tmp_path, monkeypatch, capsys):
    """The job's own line advised `--resume auto`, which bench learn does not have (and a rerun starts over); it exited
    75, which says the same."""
    from llm.eval import learning_speed
    from llm.runtime.preemption import Preemption

    def stopped_by_ctrl_c(*args, **kwargs):
        monkeypatch.setattr(Preemption, "stopped_by", signal.SIGINT)  # as the job's Preemption notes it
        return EXIT_PREEMPTED

    monkeypatch.setattr(learning_speed, "run_training", stopped_by_ctrl_c)
    assert learning_speed.bench_learn(str(FIXTURES / "pretrain" / "en_stories.txt"), str(tmp_path / "out"),
                                      budget="60") == 130  # the CLI then ends the process with it; 75 says to resume
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zerollm: note: bench learn stopped while training, so nothing was measured; it has no --resume: run it again "
        f"(into {tmp_path / 'out'}, whose contents it replaces)")


def test_the_stop_signals_are_as_they_were_after_an_in_process_training_job():
    """The job's handlers stayed after it: Ctrl-C during bench learn's evaluation was ignored, and it ran on."""
    from llm.runtime.preemption import stop_signals_restored

    before = [signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)]
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    reading, writing = os.pipe()
    os.set_blocking(writing, False)
    try:
        with stop_signals_restored():  # what `Preemption.install` changes
            signal.signal(signal.SIGINT, lambda *_: None)
            signal.signal(signal.SIGTERM, lambda *_: None)
            signal.set_wakeup_fd(writing)
        assert [signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)] == before
        assert signal.set_wakeup_fd(wakeup) == wakeup
    finally:
        os.close(reading)
        os.close(writing)
