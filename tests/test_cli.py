import errno
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    FIXTURES,
    SHADOWING,
    closed_pipe,
    folder_shadowing_zerollm,
    full_disk,
    run_cli,
    train_args,
    zerollm_here,
)
from llm.errors import UserError
from llm.stdout import SHOWN_ANYHOW


@pytest.mark.parametrize("command", [[], ["tokenizer", "train"], ["data", "prepare"], ["train", "pretrain"],
                                     ["launch"], ["demo"], ["bench", "train"]])
def test_help_explains_every_command(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0 and "usage: zerollm" in result.stdout


def test_module_entry_point_matches_console_script():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "zerollm"
    assert script.is_file(), "console script not installed beside the interpreter"
    assert subprocess.run([str(script), "--help"], capture_output=True, text=True).stdout == run_cli("--help").stdout


def test_a_ctrl_c_while_the_command_line_loads_is_one_line(monkeypatch, capsys):
    """A Ctrl-C in a command's first fraction of a second, while its modules were imported, was a KeyboardInterrupt
    traceback."""

    class Interrupted:
        def find_spec(self, name, path=None, target=None):
            if name == "llm.cli":
                raise KeyboardInterrupt
            return None

    from llm.__main__ import run

    monkeypatch.delitem(sys.modules, "llm.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code == 130 and capsys.readouterr().err == "zerollm: interrupted\n"


def test_deepspeed_launcher_options_given_to_a_command_say_where_they_go(capsys):
    """`zerollm train ... --hostfile h --num_gpus 2`, as one would write `deepspeed --hostfile h ...`, was the top-level
    usage and 'unrecognized arguments' only."""
    from llm.cli import parse_arguments

    with pytest.raises(SystemExit) as exited:
        parse_arguments(["train", "pretrain", "--recipe", "demo", "--data", "d", "--out", "o", "--hostfile", "h",
                         "--num_gpus=2"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zerollm: error: unrecognized arguments: --hostfile h --num_gpus=2 (--hostfile, --num_gpus: DeepSpeed's "
        "launcher's; give them to `zerollm launch --hostfile FILE -- train ...` or `deepspeed --hostfile FILE "
        "--module llm train ...`, or run ranks on this machine with --nproc N)")
    with pytest.raises(SystemExit):
        parse_arguments(["train", "pretrain", "--recipe", "demo", "--data", "d", "--out", "o", "--bogus"])
    assert capsys.readouterr().err.splitlines()[-1] == "zerollm: error: unrecognized arguments: --bogus"
    with pytest.raises(SystemExit):  # `zerollm launch` takes training commands only
        parse_arguments(["eval", "--model", "m", "--input", "a.txt", "--num_gpus", "2"])
    assert capsys.readouterr().err.splitlines()[-1] == ("zerollm: error: unrecognized arguments: --num_gpus 2 "
                                                        "(--num_gpus: DeepSpeed's launcher's; zerollm eval runs its "
                                                        "ranks on this machine, with --nproc N)")
    with pytest.raises(SystemExit):  # of bench's commands, only `bench train` has --nproc
        parse_arguments(["bench", "learn", "--input", "a.txt", "--num_gpus", "2"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("(--num_gpus: DeepSpeed's launcher's; zerollm bench "
                                                             "runs as one process)")
    with pytest.raises(SystemExit):
        parse_arguments(["chat", "--model", "m", "--include", "localhost:0"])
    assert capsys.readouterr().err.splitlines()[-1] == ("zerollm: error: unrecognized arguments: --include "
                                                        "localhost:0 (--include: DeepSpeed's launcher's; zerollm chat "
                                                        "runs as one process)")


def test_deepspeed_and_torchrun_spellings_given_to_launch_name_ours(capsys):
    """`zerollm launch --master_port P` was 'unrecognized arguments: --master_port' alone."""
    from llm.cli import parse_arguments

    with pytest.raises(SystemExit):
        parse_arguments(["launch", "--hostfile", "h", "--num_gpus=2", "--master_port", "29690", "--", "train"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zerollm: error: unrecognized arguments: --num_gpus=2 --master_port (zerollm launch spells --num_gpus as "
        "--nproc-per-node, --master_port as --master-port)")
    with pytest.raises(SystemExit):  # it had no hint
        parse_arguments(["launch", "--num_nodes=2", "--", "train"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zerollm: error: unrecognized arguments: --num_nodes=2 (zerollm launch spells --num_nodes as --nnodes "
        "(per-node mode; with a hostfile, choose its nodes with --include or --exclude))")


def test_launch_options_after_the_training_command_say_where_they_go(capsys):
    """`zerollm launch -- train ... --hostfile h` printed the top-level usage, then 'the training command is
    invalid'."""
    from llm.cli import checked_training_command

    with pytest.raises(UserError, match=r"^--hostfile is an option of `zerollm launch`: give launch options before "
                                        r"'--' and the training command after it \(zerollm launch --hostfile FILE -- "
                                        r"train ...\)$"):
        checked_training_command(["--", "train", "pretrain", "--recipe", "demo", "--data", "d", "--out", "o",
                                  "--hostfile", "h"])
    assert capsys.readouterr().err == ""


def test_demo_runs_every_stage_and_reports_accuracy(tmp_path, tmp_path_factory):
    # from a folder holding a user's llm.py, which ran as every stage (`python -m llm`); every stage at most 4 steps
    project = folder_shadowing_zerollm(tmp_path_factory.mktemp("project"))
    result = run_cli("demo", "--out", tmp_path, "--steps", 4, cwd=project, as_script=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert SHADOWING not in result.stdout
    assert "validation loss fell" in result.stdout
    assert "warmup" not in result.stdout + result.stderr  # a note to lower it, which the demo takes no option for
    assert "samples (greedy):" in result.stdout and "'The capital of France is' ->" in result.stdout
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "global_step4"
    report = result.stdout[result.stdout.index("accuracy on 114 held-out arithmetic questions"):]
    for stage in ("pretrain", "sft", "dpo", "grpo"):
        assert re.search(rf"after {stage} +\d+\.\d %", report), stage
    for stage in ("sft", "dpo", "grpo"):
        assert (tmp_path / f"{stage}_run" / "checkpoints" / "latest").read_text() == "global_step4", stage
    assert (tmp_path / "grpo.jsonl").read_text().count("\n") == 800 - 114  # the training questions, with answers


def test_demo_refuses_a_folder_of_the_users_and_steps_below_one(tmp_path, monkeypatch, capsys):
    """The demo overwrote corpus.txt and deleted tokenizer/ in any --out (`--out .` in a project lost its own); a
    file as --out was a FileExistsError traceback; --steps 0 ran the full-length demo. Each is refused before the
    demo starts anything, so it runs in this process."""
    mine = tmp_path / "project"
    (mine / "tokenizer").mkdir(parents=True)
    (mine / "tokenizer" / "tokenizer.json").write_text("{}")
    (mine / "corpus.txt").write_text("my corpus")
    assert zerollm_here(monkeypatch, "demo", "--out", mine) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zerollm: error: --out {mine} holds corpus.txt, tokenizer but no .zerollm-demo, which zerollm demo writes "
        "into its every output, so they may be yours; it replaces its output there, so give it a new or empty "
        "directory (or one it wrote before)")
    assert (mine / "corpus.txt").read_text() == "my corpus" and (mine / "tokenizer" / "tokenizer.json").is_file()
    (tmp_path / "afile").write_text("x")
    assert zerollm_here(monkeypatch, "demo", "--out", tmp_path / "afile") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zerollm: error: --out {tmp_path / 'afile'}: is a file; give a directory (new, empty, or an earlier demo's)")
    assert zerollm_here(monkeypatch, "demo", "--out", tmp_path / "new", "--steps", 0) == 2
    assert "argument --steps: must be at least 2 (the validation loss is compared between two evaluations), got 0" \
        in capsys.readouterr().err
    assert zerollm_here(monkeypatch, "demo", "--out", tmp_path / "new", "--steps", 1) == 2  # every stage ran, then
    assert "argument --steps: must be at least 2" in capsys.readouterr().err  # 'did NOT fall': one evaluation only
    assert not (tmp_path / "new").exists()


def test_a_demo_step_that_fails_says_the_demo_starts_over_and_a_full_disk_is_one_line(tmp_path, monkeypatch):
    """A stage that failed for a full disk advised '--resume auto', which the demo does not take; a full disk as the
    demo wrote its own files was an OSError traceback, exit 1 (the demo's 'the loss did not fall')."""
    from llm import demo

    monkeypatch.setattr(demo, "run_stopping_together", lambda command: (2, []))
    with pytest.raises(UserError, match=r"^demo step `zerollm train pretrain` failed with exit code 2; the demo has no "
                                        r"--resume: run it again to start it over once what it said is put right$"):
        demo._zerollm("train", "pretrain")

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(demo, "write_corpus", full)
    with pytest.raises(UserError, match=rf"^{tmp_path / 'd'}: no space left on device while writing the demo's files; "
                                        "nothing was lost .*: free space and run the demo again$"):
        demo.run_demo(tmp_path / "d")


@pytest.mark.parametrize("stopped", [signal.SIGINT, signal.SIGTERM, 75])
def test_a_demo_stopped_in_a_stage_says_it_starts_over_not_resume(monkeypatch, capsys, stopped):
    """A stage stopped by Ctrl-C said 'rerun with --resume auto', which the demo does not take (a rerun deletes
    that checkpoint and starts over); the demo said nothing to correct it. On SIGTERM the demo ended at once and
    its stage trained on, orphaned (now passed on and waited for: `llm.child_job`, tested in tests/test_bench.py)."""
    from llm import demo
    from llm.errors import Terminated

    signalled = stopped in (signal.SIGINT, signal.SIGTERM)
    monkeypatch.setattr(demo, "run_stopping_together", lambda command: (75, [stopped] if signalled else []))
    if signalled:
        with pytest.raises(KeyboardInterrupt if stopped == signal.SIGINT else Terminated):
            demo._zerollm("train", "pretrain")
        assert capsys.readouterr().err == ("zerollm demo: stopped; the demo has no --resume: run it again to start "
                                           "it over\n")
    else:
        with pytest.raises(UserError, match=r"^demo step `zerollm train pretrain` was stopped; the demo has no "
                                            r"--resume: run it again to start it over$"):
            demo._zerollm("train", "pretrain")


def test_demo_takes_its_own_earlier_folders(tmp_path):
    """A demo folder of a version that wrote no marker, and one where a killed demo left data prepare's or tokenizer
    train's staging folder, were refused as the user's."""
    from llm.demo import DEMO_MARKER, take_output_dir

    unmarked, killed = tmp_path / "unmarked", tmp_path / "killed"
    for folder, names in ((unmarked, ["tokenizer", "data", "run", "sft_run"]),
                          (killed, [".data.partial-41-9f0c1a2b", ".tokenizer.partial", ".tokenizer.old"])):
        for name in names:
            (folder / name).mkdir(parents=True)
        (folder / "corpus.txt").write_text("")
    (killed / DEMO_MARKER).touch()
    for folder in (unmarked, killed):
        take_output_dir(folder)
        assert (folder / DEMO_MARKER).is_file()


def test_a_second_demo_into_the_same_out_is_refused_while_the_first_runs(tmp_path, monkeypatch, capsys):
    """Only the trainings held locks: a second demo, started while the first made its DPO pairs (or its data, or
    scored a stage), deleted the first's runs, and the first ended "sft_run: no such directory"."""
    from llm.demo import DEMO_MARKER
    from llm.held_locks import held_folder

    out = tmp_path / "demo"
    with held_folder(out, DEMO_MARKER, "zerollm demo"):  # as the first demo holds it
        (out / "sft_run").mkdir()
        assert zerollm_here(monkeypatch, "demo", "--out", out, "--steps", 2) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"zerollm: error: --out {out}: another zerollm demo is "
                                                        "writing there; wait for it to end, or choose another --out")
    assert (out / "sft_run").is_dir()


def test_bench_train_prints_throughput_mfu_and_memory():
    result = run_cli("bench", "train", "--recipe", "demo", "--steps", 2, "--warmup", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    for label in ("tokens/s", "loss-bearing tokens/s", "MFU", "peak memory (MiB)"):
        assert label in result.stdout
    assert "warmup" not in result.stdout + result.stderr  # the recipe's 50 warmup steps in 3: not what is measured


def test_demo_accuracy_counts_what_the_grpo_reward_counts():
    from llm.demo import share_right, wrong_answer

    qa = [("What is 5 + 7?", "12"), ("五加七等于多少？", "等于十二"), ("What is 6 + 6?", "12"),
          ("六加六等于多少？", "等于十二")]
    # a trailing full stop earns the exact-match reward, so it is right here too; a wrong number or extra words not
    assert share_right(["12.", "等于十二。", "13", "等于十二 个"], qa) == 0.5
    near_misses = {wrong_answer(right, random.Random(seed)) for seed in range(20) for _, right in qa}
    assert near_misses <= {"13", "14", "15", "9", "10", "11", "等于十三", "等于十四", "等于十五"}


def test_demo_held_out_questions_are_a_random_slice_never_trained_on():
    from llm.demo import HELD_OUT, questions

    held, train = questions(held=True), questions(held=False)
    assert len(held) == 114 and len(held) + len(train) == 800 and not {q for q, _ in held} & {q for q, _ in train}
    # spread over the addends, not one structured slice (such as b % 7 == 0, which left "+ 0" untrained)
    for position in (0, 1):
        assert len({pair[position] for pair in HELD_OUT}) >= 15


def test_demo_dpo_pairs_reject_no_answer_holding_a_replacement_character(tmp_path, monkeypatch):
    """A sampled answer decoded with U+FFFD (a character cut by the token limit, or bytes that are no UTF-8) was
    rejected as it was: mojibake in dpo.jsonl, and the replacement character's bytes, which the model never wrote,
    trained on. It is left out as an empty answer is; a question left without a wrong answer gets a near miss."""
    from llm import demo

    qa = [("What is 5 + 7?", "12"), ("五加七等于多少？", "等于十二")]
    attempts = iter([["13", "等于十\ufffd"], ["1\ufffd", "等于十二"], ["", "\ufffd十三"]])  # greedy, 2 samples
    monkeypatch.setattr(demo, "questions", lambda held: qa)
    monkeypatch.setattr(demo, "answers", lambda run, questions, temperature=0.0, seed=None: next(attempts))
    demo.write_dpo_file(tmp_path / "dpo.jsonl", tmp_path / "sft_run", samples=2)
    rows = [json.loads(line) for line in (tmp_path / "dpo.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(row["prompt"], row["chosen"]) for row in rows] == qa
    assert rows[0]["rejected"] == "13" and rows[1]["rejected"] in {"等于十三", "等于十四", "等于十五"}


def _help(monkeypatch, capsys, *command: str) -> str:
    """`zerollm COMMAND --help` as printed on a wide terminal (no line breaks inside a sentence)."""
    from llm.cli import build_parser

    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return capsys.readouterr().out


def test_demo_help_names_every_stage_and_its_default_length(monkeypatch, capsys):
    """It said '1000 pretraining, 300 SFT, 100 DPO' and described pretraining only, after GRPO joined the demo."""
    from llm.config import load_recipe
    from llm.demo import POST_TRAINING

    text = _help(monkeypatch, capsys, "demo")
    assert f"{load_recipe('demo')['train']['max_steps']} pretraining" in text
    for stage, (steps, _, _) in POST_TRAINING.items():
        assert f"{steps} {stage.upper()}" in text and f"{stage.upper()} " in text.split("options:")[0], stage
    assert "accuracy on held-out questions after each stage" in text


def test_lora_is_offered_only_where_it_is_accepted(monkeypatch, capsys):
    """`--lora` showed in the help of pretrain and distill, which refuse it (still in one line: test_lora.py)."""
    for stage in ("sft", "dpo", "grpo"):
        assert "--lora SPEC" in _help(monkeypatch, capsys, "train", stage), stage
    for stage in ("pretrain", "distill"):
        assert "--lora" not in _help(monkeypatch, capsys, "train", stage), stage


def test_help_of_every_input_option_names_what_the_readers_read(monkeypatch, capsys):
    """The help named .txt, .jsonl and .json only; the readers take gzip, Parquet, Arrow and save_to_disk too."""
    from llm.data.readers import TABLE_SUFFIXES, TEXT_SUFFIXES

    for command in (["tokenizer", "train"], ["data", "prepare"], ["train", "grpo"]):
        text = _help(monkeypatch, capsys, *command)
        for suffix in (*TEXT_SUFFIXES, ".gz", *TABLE_SUFFIXES, "save_to_disk"):
            assert suffix in text, (command, suffix)
    assert "(default pretrain)" in _help(monkeypatch, capsys, "data", "prepare")
    assert "/quit (or /exit)" in _help(monkeypatch, capsys, "chat")


@pytest.mark.parametrize("command, option", [
    (["tokenizer", "train", "--vocab-size", "512", "--out", "o"], "input"),
    (["data", "prepare", "--tokenizer", "t", "--out", "o"], "input"),
    (["train", "grpo", "--recipe", "demo", "--init-from", "r", "--out", "o"], "prompts"),
    (["eval", "--model", "m"], "input"),
])
def test_an_input_option_given_twice_reads_both(command, option):
    """`--prompts a.jsonl --prompts b.jsonl` (as --reward repeats) trained on b.jsonl alone, without a word."""
    from llm.cli import build_parser

    parsed = build_parser().parse_args([*command, f"--{option}", "a", "b", f"--{option}", "c"])
    assert getattr(parsed, option) == ["a", "b", "c"]


@pytest.mark.parametrize("command", [["train", "pretrain", "--recipe", "demo", "--data", "d", "--out", "o"],
                                     ["bench", "train", "--recipe", "demo"],
                                     ["bench", "learn", "--input", "novel.txt"]])  # bench learn's was --deepspeed alone
def test_deepspeeds_own_option_name_gives_the_config(command, capsys):
    """`--deepspeed_config ds.json`, as DeepSpeed's scripts take it, was "unrecognized arguments"."""
    from llm.cli import build_parser

    def given(*options):
        return build_parser().parse_args([*command, *options]).deepspeed

    assert given("--deepspeed_config", "ds.json") == "ds.json"
    # DeepSpeed's switch, as in `deepspeed train.py --deepspeed --deepspeed_config ds.json`: it took the next option
    # for its file ("expected one argument")
    assert given("--deepspeed", "--deepspeed_config", "ds.json") == "ds.json"
    assert given("--deepspeed_config", "ds.json", "--deepspeed") == "ds.json"
    assert given("--deepspeed") is None and given("--deepspeed", "ds.json") == "ds.json"  # the stage's default
    assert given("--deepspeed", "ds.json", "--deepspeed_config", "ds.json") == "ds.json"
    with pytest.raises(SystemExit) as exited:  # the last took the first's place without a word
        given("--deepspeed", "a.json", "--deepspeed_config", "b.json")
    assert exited.value.code == 2 and capsys.readouterr().err.endswith(
        "error: --deepspeed_config: a DeepSpeed config was given twice (a.json and b.json); give one\n")


@pytest.mark.parametrize("open_stdout, code, stderr", [
    (closed_pipe, 141, ""),  # 128 + SIGPIPE, quietly
    (full_disk, 2, "zerollm: error: cannot write the output (No space left on device)\n"),
])
def test_every_command_ends_quietly_on_a_closed_pipe_and_in_one_line_on_a_full_disk(tmp_path, open_stdout, code,
                                                                                    stderr):
    """Only generate and chat did; `tokenizer train`, `data prepare`, `eval` and `plot` ended in a BrokenPipeError
    or OSError traceback, exit 1, after doing their work."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"document {i}: some words to merge" for i in range(50)))
    with open_stdout() as stdout:
        result = subprocess.run([sys.executable, "-m", "llm", "tokenizer", "train", "--input", str(corpus),
                                 "--vocab-size", "300", "--out", str(tmp_path / "tok")], stdout=stdout,
                                stderr=subprocess.PIPE, text=True, check=False)
    assert (result.returncode, result.stderr) == (code, stderr)
    assert (tmp_path / "tok" / "tokenizer.json").is_file()  # the work is done: only what it said is lost


def test_a_training_job_of_two_ranks_ends_quietly_on_a_closed_pipe(pretrain_data, tmp_path):
    """`zerollm train ... --nproc 2 | head`: rank 0's print failed, and the job ended as for a rank's own error:
    its traceback, 'rank 0: failed with OutputLost: Broken pipe; the job is ended on every rank', exit 76. It ends
    every rank as one process ends: 141, without a word."""
    with closed_pipe() as stdout:
        result = subprocess.run([sys.executable, "-m", "llm", *map(str, train_args(
            pretrain_data, tmp_path / "run", "train.max_steps=50", nproc=2))], stdout=stdout, stderr=subprocess.PIPE,
            text=True, check=False, timeout=300)
    assert (result.returncode, result.stderr) == (141, "")


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_training_whose_output_reader_leaves_stops_with_a_checkpoint(pretrain_data, tmp_path, nproc):
    """`zerollm train ... | head -3`: the first print after head left ended the training at once (141, nothing
    said), its steps since the newest checkpoint lost (none where it had not saved yet). It stops as on SIGTERM."""
    run = tmp_path / "run"
    args = train_args(pretrain_data, run, "train.max_steps=500", "train.save_every=400", "train.log_every=1",
                      nproc=nproc)
    job = subprocess.Popen([sys.executable, "-m", "llm", *map(str, args)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    while not job.stdout.readline().startswith("step 2/"):  # as head reads its lines
        pass
    job.stdout.close()
    stderr = job.communicate(timeout=300)[1]
    assert job.returncode == 75, stderr[-3000:]
    assert "zerollm: standard output cannot be written (its reader left); stopping with a checkpoint" in stderr
    tag = (run / "checkpoints" / "latest").read_text()
    assert 2 <= int(tag.removeprefix("global_step")) < 400
    assert (f"stopped as its output was lost at step {tag.removeprefix('global_step')}; checkpoint saved in {run}; "
            "rerun with --resume auto to continue") in stderr  # where it can be read


def test_a_command_started_with_its_output_closed_runs_silently(tmp_path):
    """With descriptor 1 closed (`>&-`) sys.stdout is None, to which print() writes nothing: the guard is not put
    around None."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"document {i}: some words to merge" for i in range(50)))
    result = subprocess.run([sys.executable, "-m", "llm", "tokenizer", "train", "--input", str(corpus), "--vocab-size",
                             "300", "--out", str(tmp_path / "tok")], preexec_fn=lambda: os.close(1),
                            stderr=subprocess.PIPE, text=True, check=False)
    assert (result.returncode, result.stderr) == (0, "")


def test_a_progress_bar_writes_around_the_guard(monkeypatch):
    """tqdm turns a bar off where its terminal is gone (an OSError it catches); through the guard that was OutputLost,
    which ended the training."""
    from llm.stdout import GuardedStdout, unguarded

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", GuardedStdout(stream))
    assert unguarded() is stream
    monkeypatch.setattr(sys, "stdout", stream)
    assert unguarded() is stream


def test_a_path_too_long_for_the_file_system_is_one_line(tmp_path, cli_here):
    """pathlib's is_file() and is_dir() raise ENAMETOOLONG where they answer False for a missing file: a traceback in
    eval, plot, generate, export and train."""
    long = tmp_path / ("b" * 300)
    for command in (["plot", long, "--out", tmp_path / "x.png"], ["eval", "--model", long, "--input", long],
                    ["generate", "--model", long, "--prompt", "hi"],
                    ["eval", "--model", long, "--input", long, "--nproc", 2]):  # was said by each rank
        result = cli_here(*command)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, command
        assert result.stderr.startswith(f"zerollm: error: {long}") and result.stderr.endswith(": File name too long\n")


def test_only_a_path_of_the_command_line_is_said_as_the_users(tmp_path, monkeypatch, capsys):
    """A path the product made itself that the file system refuses is the product's bug: its traceback stays."""
    import llm.cli

    def refuse(args):
        raise OSError(errno.ENAMETOOLONG, "File name too long", str(tmp_path / "made-here"))

    monkeypatch.setitem(llm.cli.COMMANDS, "plot", refuse)
    with pytest.raises(OSError, match="made-here"):
        llm.cli.main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")])


@pytest.mark.parametrize("argv, said", [
    (["tokenizer", "train", "--input", "", "--vocab-size", "300", "--out", "t"], "argument --input: is empty"),
    (["data", "prepare", "--input", "a.txt", "--tokenizer", "", "--out", "d"], "argument --tokenizer: is empty"),
    (["train", "pretrain", "--recipe", "demo", "--data", "d", "--out", ""], "argument --out: is empty"),
    (["train", "sft", "--recipe", "demo", "--data", "d", "--out", "o", "--init-from", ""],
     "argument --init-from: is empty"),
    (["eval", "--model", "", "--input", "a.txt"], "argument --model: is empty"),
    (["plot", "", "--out", "p.png"], "argument RUN: is empty"),
    (["eval", "--model", "m", "--input", "a.txt", "--nproc", "abc"],
     "argument --nproc: expects a whole number in decimal digits, got 'abc'"),
    (["demo", "--steps", "1.5"], "argument --steps: expects a whole number in decimal digits, got '1.5'"),
    (["generate", "--model", "m", "--prompt", "p", "--seed", "1_0"],
     "argument --seed: expects a whole number in decimal digits, got '1_0'"),
])
def test_an_empty_path_and_a_count_that_is_not_a_number_are_refused_by_name(argv, said, capsys):
    """An empty path was the current directory: `train --out ''` trained there and `data prepare --input ''` read all
    of it. A count that is not a number was 'invalid ranks_on_this_machine value', the name of a function."""
    from llm.cli import build_parser

    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args(argv)
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {said}" + ("; give a path (. for the current "
                                                                               "directory)" if "empty" in said else ""))


def _named_in_bytes(folder: Path, name: bytes) -> str:
    """The path of `name` in `folder`, a name in bytes that need not be UTF-8 (as Python holds it: lone surrogates)."""
    return os.fsdecode(os.path.join(os.fsencode(folder), name))


def test_a_path_that_is_not_utf8_is_printed_as_its_bytes(tmp_path, monkeypatch):
    """On a strict UTF-8 standard output (what a UTF-8 locale gives Python), printing such a path was a
    UnicodeEncodeError traceback, exit 1, after the work was done."""
    out = Path(_named_in_bytes(tmp_path, b"tok\xff"))
    written = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(written, encoding="utf-8", errors="strict"))
    code = zerollm_here(monkeypatch, "tokenizer", "train", "--input", FIXTURES / "pretrain" / "en_stories.txt",
                        "--vocab-size", 300, "--out", out)
    sys.stdout.flush()
    assert code == 0 and b"written to " + os.fsencode(out) + b"\n" in written.getvalue()


@pytest.mark.parametrize("command, option", [
    (["train", "pretrain", "--recipe", "demo", "--data", "data", "--out"], "--out "),
    (["eval", "--input", "corpus.txt", "--model"], "--model "),
    (["train", "sft", "--recipe", "demo", "--data", "data", "--out", "run", "--set"], "--set train.init_from="),
])
def test_a_run_or_export_folder_named_in_bytes_that_are_not_utf8_is_refused_before_anything_is_written(
        command, option, tmp_path, capsys, monkeypatch):
    """Such a folder (GBK bytes from a zip made on Windows) was written, then torch and safetensors could not open its
    files: a run's checkpoints were called damaged ('train the run again'), an export's weights unreadable. Refused in
    one line at once, named by an option or by a --set (which said the folder was damaged, 'train the run again')."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("some text\n")
    folder = _named_in_bytes(tmp_path, b"\xc4\xe3")
    given = f"{option.removeprefix('--set ')}{folder}" if option.startswith("--set") else folder
    code = zerollm_here(monkeypatch, *command, given)
    assert code == 2 and os.listdir(tmp_path) == ["corpus.txt"]
    shown = folder.encode("utf-8", "backslashreplace").decode()  # its bytes as \\udcXX escapes: one line, any stream
    assert capsys.readouterr().err == (f"zerollm: error: {option}{shown}: its name holds byte 0xc4, which is "
                                       "not UTF-8; torch and safetensors open no file below such a name: rename it\n")


def test_a_tokenizer_folder_named_in_bytes_that_are_not_utf8_is_read(tmp_path, monkeypatch):
    """zerollm reads tokenizer.json itself: the tokenizers library's reading takes UTF-8 paths only, so a tokenizer
    that `tokenizer train --out` wrote there could not be loaded ('surrogates not allowed'). A data folder so named
    is written (h5py takes any name)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    folder = _named_in_bytes(tmp_path, b"tok\xc4\xe3")
    shutil.copytree(FIXTURES / "tokenizers" / "llama", folder)
    written = io.BytesIO()  # its notes name the folder in its bytes, which neither capsys nor xdist can carry
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(written, encoding="utf-8", errors="strict"))
    data = _named_in_bytes(tmp_path, b"data\xc4\xe3")  # a data folder may be so named too
    assert zerollm_here(monkeypatch, "data", "prepare", "--input", corpus, "--tokenizer", folder, "--out", data) == 0
    assert Path(data, "tokens.h5").is_file()
    sys.stdout.flush()
    assert b"written to" in written.getvalue()


def test_a_run_path_that_glob_reads_as_a_pattern_is_refused(tmp_path, monkeypatch, capsys):
    """DeepSpeed finds a run's checkpoint files with glob: `run[1]` evaluated, exported and resumed the checkpoints
    of a `run1` beside it, without a word (or a FileNotFoundError traceback where there was none)."""
    run = tmp_path / "run[1]"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    for args in (["eval", "--model", run, "--data", tmp_path], ["export", "--run", run, "--out", tmp_path / "e"],
                 ["train", "pretrain", "--recipe", "demo", "--data", tmp_path, "--out", tmp_path / "new*"]):
        assert zerollm_here(monkeypatch, *args) == 2
        said = capsys.readouterr().err
        assert "which DeepSpeed reads as a pattern where it looks for a run's checkpoint files" in said, said
    assert zerollm_here(monkeypatch, "export", "--run", tmp_path / "none", "--out", tmp_path / "e[1]") == 2
    assert capsys.readouterr().err.endswith("none: no such directory\n")  # an export's own name is any


def test_text_standard_output_cannot_encode_is_escaped_not_a_crash(tmp_path):
    """Under a latin-1 or ASCII stdout, the first Chinese printed raised UnicodeEncodeError: a training at its first
    evaluation's samples (before its first checkpoint), other commands once their work was written."""
    out = tmp_path / "中文 é"
    result = subprocess.run([sys.executable, "-m", "llm", "tokenizer", "train", "--input",
                             FIXTURES / "pretrain" / "zh_stories.txt", "--vocab-size", "300", "--out", out],
                            capture_output=True, env={**os.environ, "PYTHONIOENCODING": "latin-1"})
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert f"{tmp_path}/\\u4e2d\\u6587 \xe9".encode("latin-1") in result.stdout
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=SHOWN_ANYHOW)
    stream.write("中 \udce4")  # a path's byte that is not UTF-8 is written back as that byte, as ls writes it
    stream.flush()
    assert stream.buffer.getvalue() == "中 ".encode() + b"\xe4"


def test_a_command_started_with_its_error_stream_closed_runs_silently(tmp_path, tokenizer_dir):
    """`2>&-`: data prepare and eval ended at once, exit 1 and nothing written (their progress bar wrote to None),
    chat in 'input(): lost sys.stderr'."""
    result = subprocess.run([sys.executable, "-m", "llm", "data", "prepare", "--input",
                             FIXTURES / "pretrain" / "en_stories.txt", "--tokenizer", tokenizer_dir, "--out",
                             tmp_path / "data"], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.close(2), check=False)
    assert result.returncode == 0 and "written to" in result.stdout
    assert (tmp_path / "data" / "tokens.h5").is_file()


def test_a_demo_killed_while_it_trained_its_tokenizer_runs_again_in_its_folder(tmp_path):
    """tokenizer train holds `.tokenizer.lock` beside its folder while it writes: one left by a SIGKILL made the demo
    refuse its own folder ('holds .tokenizer.lock, which zerollm demo did not write')."""
    from llm.demo import DEMO_MARKER, take_output_dir

    (tmp_path / DEMO_MARKER).write_text("")
    (tmp_path / ".tokenizer.lock").write_text("")
    take_output_dir(tmp_path)
    (tmp_path / ".notes.lock").write_text("")  # another's is still refused
    with pytest.raises(UserError, match=r"holds \.notes\.lock, which zerollm demo did not write"):
        take_output_dir(tmp_path)


def test_a_tokenizer_train_into_a_folder_being_written_is_refused_before_its_training(tmp_path):
    """It trained the whole tokenizer, then was refused as it wrote it (another command held the folder)."""
    from llm.held_locks import held_beside

    with held_beside(tmp_path / "tok"):
        result = run_cli("tokenizer", "train", "--input", FIXTURES / "pretrain" / "en_stories.txt", "--vocab-size",
                         300, "--out", tmp_path / "tok")
    assert (result.returncode, result.stderr) == (2, f"zerollm: error: {tmp_path / 'tok'}: another zerollm command is "
                                                     "writing it now; wait for it to end, or choose another --out\n")
    assert "tokenizing" not in result.stdout + result.stderr and not (tmp_path / "tok").exists()


def test_launch_refuses_a_run_path_glob_reads_as_a_pattern_before_any_rank_starts(tmp_path):
    """Each rank refused it, once the launcher had started them."""
    from llm.cli import checked_training_command

    with pytest.raises(UserError, match=r"which DeepSpeed reads as a pattern"):
        checked_training_command(["--", "train", "pretrain", "--recipe", "demo", "--data", str(tmp_path), "--out",
                                  str(tmp_path / "run[1]")])
