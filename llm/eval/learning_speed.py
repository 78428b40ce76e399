"""How much a recipe learns in a fixed wall time: `zerollm bench learn --input NOVEL.txt --budget 10m`.

The whole pipeline runs inside the budget, timed from the start of the command:

    split      the file's first 90 % (cut at a line end) for training, the rest for validation, which is read
               (and written out as an lm-eval task) before anything trains: a part the readers refuse ends it here
    tokenizer  byte-level BPE trained on the training part (--vocab-size, default the recipe's model.vocab_size)
    data       the training part prepared for pretraining (no validation split: the held-out part is scored at the end)
    train      the recipe with train.max_time = what is left of the budget after the reserve; the time budget ends
               the run with its schedule complete (`llm.train.time_budget`)
    eval       bits per byte of the trained model on the held-out part (`llm.eval.perplexity`: windows of the trained
               context, stride = context, <|endoftext|> between paragraphs scored, zero bytes)

`--reserve` seconds are kept for starting the training job and for the final evaluation; the command reports the
wall time of each phase and exits 1 if the whole took longer than the budget. OUT keeps every file (train.txt,
val.txt, tok/, data/, run/), result.json, and an lm-evaluation-harness task over the validation paragraphs
(tasks/) to score any Hugging Face model by the same windows: docs/benchmarks.md has the comparison commands.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import torch

from llm import durable, held_locks, rundir
from llm.command_line import is_zerollm_command
from llm.config import RunConfig, build_config, parse_duration, refuse_set_twice
from llm.data.formats import PretrainTexts, Skipped, expand_inputs, read_records, skipped_note
from llm.data.output import refuse_foreign_contents, staging_leftovers
from llm.data.prepare import prepare
from llm.errors import EXIT_OK, EXIT_PREEMPTED, UserError
from llm.eval.perplexity import evaluate_stream
from llm.eval.token_stream import stream_of_files
from llm.loading import load_trained_model
from llm.runtime.accelerator import local_device_type
from llm.runtime.preemption import Preemption, stop_signals_restored
from llm.runtime.rerun import rerun_said_as
from llm.tokenizer import Tokenizer, check_training_options, train_tokenizer
from llm.train.ds_config_file import load_ds_config
from llm.train.engine import resolve_ds_config, resolve_precision
from llm.train.job import run as run_training
from llm.train.run_lock import check_run_unlocked
from llm.wording import plural

TRAIN_SHARE = 0.9
SPLIT_SUFFIXES = (".txt", ".jsonl")
TASK_NAME = "heldout_bpb"
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ''
doc_to_target: '{{{{text}}}}'
metric_list:
  - metric: bits_per_byte
  - metric: word_perplexity
"""


def file_parts(path: Path, train_share: float = TRAIN_SHARE) -> tuple[bytes, bytes]:
    """The first `train_share` of the file's bytes, cut at the first line end from there, and the rest; a file
    that cannot be split is refused before anything is written."""
    if path.suffix.lower() not in SPLIT_SUFFIXES:
        raise UserError(f"{path}: give a .txt or .jsonl file (it is cut at a line end into training and held-out "
                        "parts)")
    expand_inputs([path])  # the readers' checks: exists, not binary
    data = path.read_bytes()
    cut = data.find(b"\n", int(len(data) * train_share))
    if cut < 0 or not data[cut + 1:].strip() or not data[:cut].strip():
        for _ in read_records([path], "pretrain"):  # what the readers refuse a longer file for (text that is not
            pass  # UTF-8) comes first
        raise UserError(f"{path}: too short to split into a training part and a held-out part at a line end")
    return data[:cut + 1], data[cut + 1:]


def write_parts(path: Path, parts: tuple[bytes, bytes], out: Path) -> tuple[Path, Path]:
    """`file_parts` of `path` as two files of its format in `out`: the training part and the held-out part."""
    train, val = out / f"train{path.suffix.lower()}", out / f"val{path.suffix.lower()}"
    with durable.room_needed(out, "the training and held-out parts"):  # it was a traceback, a part left torn
        durable.write_bytes(train, parts[0])
        durable.write_bytes(val, parts[1])
    return train, val


def write_heldout_task(val: Path, out: Path) -> tuple[Path, list[Skipped]]:
    """An lm-eval task over the held-out documents (one jsonl record per document, as the readers see them), and the
    records the readers skipped; a held-out part the readers refuse, or without a usable record, is a UserError."""
    records = list(read_records([val], "pretrain"))
    usable = [record for record in records if not isinstance(record, Skipped)]
    if not usable:  # every record read was skipped
        raise UserError(f"{val}: no usable text records to evaluate on{skipped_note(records)}")
    out.mkdir(parents=True, exist_ok=True)
    documents = out / "heldout.jsonl"
    durable.write_text(documents, "".join(json.dumps({"text": record.value}, ensure_ascii=False) + "\n"
                                          for record in usable))
    durable.write_text(out / f"{TASK_NAME}.yaml", TASK_YAML.format(name=TASK_NAME, data=documents.resolve()))
    return out, [record for record in records if isinstance(record, Skipped)]


def in_input(said: str, part: Path, input_file: str, lines_before: int) -> str:
    """`said` with each `part:LINE:` (a line of the split's copy) as the line of the user's file it came from."""
    return re.sub(rf"{re.escape(str(part))}:(\d+):", lambda m: f"{input_file}:{int(m[1]) + lines_before}:", said)


def check_heldout_part(input_file: str, train: Path, val: Path, tasks: Path,
                       copy_kept: bool) -> tuple[Path, list[str]]:
    """`write_heldout_task` before training, so that a held-out part the readers refuse ends the command before
    the budget is spent (it ended it after training); its messages (the refusal, or the records it skipped) name
    the lines of the user's file (`refused_part`)."""
    lines_before = train.read_bytes().count(b"\n")
    try:
        task_dir, skipped = write_heldout_task(val, tasks)
    except UserError as exc:
        raise refused_part(exc, val, input_file, lines_before, copy_kept) from None
    return task_dir, [in_input(str(record), val, input_file, lines_before) for record in skipped]


def refused_part(exc: UserError, part: Path, input_file: str, lines_before: int, copy_kept: bool) -> UserError:
    """The refusal of a part of the split (`lines_before` lines of the input before it: 0 for the training part) in
    the user's terms: their file's lines, which part, where its copy is (`copy_kept`: it stays; not where an earlier
    result takes its place again, `earlier_result_kept`), and that nothing was trained."""
    which = (f"the training part, the first {TRAIN_SHARE:.0%}" if lines_before == 0 else
             f"the held-out part, the last {1 - TRAIN_SHARE:.0%}")
    said, copy = in_input(str(exc), part, input_file, lines_before), f", copied to {part}"
    if not copy_kept:  # the part's copy is gone: the user's file is what to look at
        said, copy = said.replace(str(part), input_file), ""
    return UserError(f"{said} (in {which} of {input_file}{copy}; nothing was trained)")


def skipped_in_part(skipped: list[str], part: str, count: int | None = None) -> str:
    """A note on the records of one part that were left out, or ''; `count`: how many, where `skipped` names only
    the first of them (`prepare`'s report)."""
    if not skipped:
        return ""
    count = len(skipped) if count is None else count
    return f"note: {count} unusable {plural('record', count)} of the {part} part left out (first: {skipped[0]})"


def check_training_start(base: RunConfig, vocab_size: int, deepspeed_config: str | None,
                         zero_stage: int | None, max_time: float) -> None:
    """What the training job would refuse at its start without needing the data, checked before anything is
    written (a refusal after the split, tokenizer and data left --out full, and the corrected command was refused
    for that; an earlier bench learn's result deleted): the stage (pretraining: --input is text), the DeepSpeed
    config's file and values against the recipe (at a train.max_time of `max_time` seconds, as the job trains: a
    DeepSpeed 'scheduler', which counts steps, was refused after the data was made), its precision on this
    machine."""
    if base.train.stage != "pretrain":
        raise UserError(f"train.stage {base.train.stage}: bench learn measures pretraining on the training part of "
                        "--input; leave train.stage as pretrain")
    cfg = copy.deepcopy(base)
    cfg.model.vocab_size, cfg.train.max_time = vocab_size, max_time
    raw, source = load_ds_config(deepspeed_config, cfg.train.stage)
    cfg.train.precision = resolve_precision(cfg.train.precision, torch.device(local_device_type()))
    resolve_ds_config(raw, cfg, 1, source, zero_stage)


SET_HERE = {"train.max_time": "--budget (what it leaves after the preparation and --reserve)",
            "data.path": "bench learn (the training part of --input)"}
"""Run-config keys bench learn sets itself, and what sets them: a --set of one is refused (it was replaced)."""

LEARN_MARKER = ".zerollm-bench-learn"
"""Written first into bench learn's --out: marks a folder whose contents an earlier bench learn wrote."""
EARLIER_RESULT = ".previous"
"""Where an earlier bench learn's complete result waits while a new one is made (`earlier_result_kept`)."""
EARLIER_MOVING, EARLIER_DELETED = f"{EARLIER_RESULT}.partial", f"{EARLIER_RESULT}.old"
"""The earlier result as it is moved aside (put back whole after a kill there), and as it is deleted (renamed first:
a kill there leaves no part of it to be taken for the whole)."""
ASIDE = {EARLIER_RESULT, EARLIER_MOVING, EARLIER_DELETED}
LEARN_OUTPUTS = {f"{part}{suffix}" for part in ("train", "val") for suffix in SPLIT_SUFFIXES} | {
    "tok", "data", "run", "tasks", "result.json", LEARN_MARKER, *ASIDE}
"""Everything bench learn writes into --out (and replaces when it runs there again)."""


def check_output_dir(out_dir: Path, input_file: Path) -> None:
    """--out must be new, empty or an earlier bench learn's (a failed one's included: its rerun was refused for the
    folder it had filled), and must not hold the input (its split would overwrite it); nothing is written here."""
    rundir.check_writable_out(out_dir, "give a new or empty folder")
    if not out_dir.is_dir():
        return
    entries = os.listdir(out_dir)
    refuse_foreign_contents(out_dir, out_dir, "bench learn", LEARN_OUTPUTS, LEARN_MARKER,
                            staging_leftovers(entries, ("tok", "data")))
    if entries and input_file.resolve().is_relative_to(out_dir.resolve()):
        raise UserError(f"--input {input_file} is inside --out {out_dir}, whose contents bench learn replaces; "
                        "give another --out")
    check_run_unlocked(out_dir / "run")


def _outputs(out_dir: Path) -> list[Path]:
    """What a bench learn wrote into `out_dir` (its marker and a kept earlier result aside)."""
    return [out_dir / name for name in sorted(LEARN_OUTPUTS - {LEARN_MARKER, *ASIDE})
            if (out_dir / name).exists() or (out_dir / name).is_symlink()]


def _move_all(source: Path, target: Path) -> None:
    for name in os.listdir(source):
        os.replace(source / name, target / name)
    source.rmdir()


def _put_back_earlier_result(out_dir: Path) -> None:
    """An earlier result a kill left aside back whole in `out_dir` in place of what a bench learn that did not
    complete wrote, and the rest of one being deleted deleted."""
    if (out_dir / EARLIER_MOVING).is_dir():  # killed as it moved aside: the rest of it is in `out_dir`
        _move_all(out_dir / EARLIER_MOVING, out_dir)
    if (out_dir / EARLIER_RESULT).is_dir():
        for path in _outputs(out_dir):
            durable.remove(path)
        _move_all(out_dir / EARLIER_RESULT, out_dir)
    durable.remove_leftover(out_dir / EARLIER_DELETED, out_dir)


@contextlib.contextmanager
def earlier_result_kept(out_dir: Path) -> Iterator[Callable[[], None]]:
    """`out_dir` (checked by `check_output_dir`) made empty but for the marker, an earlier bench learn's complete
    result (result.json and the files it came from) moved aside to `out_dir/.previous` rather than deleted: a rerun
    that failed, was stopped or ran out of room deleted the only measurement there was. Where the new result is not
    written (the function yielded is called once it is), the earlier one is put back, on the way out or, after a
    kill, by the next bench learn into `out_dir`. An earlier run's outputs without a result are deleted."""
    _put_back_earlier_result(out_dir)
    complete = (out_dir / "result.json").is_file()
    if complete:
        (out_dir / EARLIER_MOVING).mkdir()
        for path in _outputs(out_dir):
            os.replace(path, out_dir / EARLIER_MOVING / path.name)
        os.replace(out_dir / EARLIER_MOVING, out_dir / EARLIER_RESULT)
    else:
        for path in _outputs(out_dir):
            durable.remove(path)
    (out_dir / LEARN_MARKER).touch()
    written = False

    def result_written() -> None:
        nonlocal written
        written = True
        if complete:
            os.replace(out_dir / EARLIER_RESULT, out_dir / EARLIER_DELETED)
            durable.remove_set_aside(out_dir / EARLIER_DELETED, out_dir)

    try:
        yield result_written
    finally:
        if not written:
            _put_back_earlier_result(out_dir)


class Phases:
    """Wall time of each phase since the start of the command: of this process where it runs zerollm's command line,
    its imports (the first phase, 'start-up') included; where zerollm runs inside another program (a test), since
    now."""

    def __init__(self) -> None:
        now, command = time.perf_counter(), is_zerollm_command(sys.orig_argv)
        # the process's start time counts whole clock ticks from a boot time in whole seconds: a second off at most
        self.start = self.mark = now - max(0.0, time.time() - psutil.Process().create_time()) if command else now
        self.seconds: dict[str, float] = {}
        if command:
            self.done("start-up")

    def done(self, name: str, detail: str = "") -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self.mark
        self.mark = now
        print(f"[{self.elapsed():6.1f} s] {name}{detail} done in {self.seconds[name]:.1f} s", flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def bench_learn(input_file: str, out: str, recipe: str = "cpu-10m", budget: str = "10m", reserve: float = 15.0,
                vocab_size: int | None = None, overrides: list[str] | None = None,
                deepspeed_config: str | None = None, zero_stage: int | None = None) -> int:
    """Run the pipeline (module docstring) in `out`; print and save the result. Returns the exit code: 0 inside
    the budget, 1 over it."""
    phases = Phases()
    budget_s = parse_duration(budget, "--budget")
    if not 0 <= reserve < budget_s:  # NaN included
        raise UserError(f"--reserve must be at least 0 s and less than --budget ({budget_s:g} s), got {reserve:g}")
    out_dir = Path(out)
    check_output_dir(out_dir, Path(input_file))
    base = build_config(recipe, overrides)  # a mistake in the recipe or --set fails before the clock matters
    refuse_set_twice(overrides or [], SET_HERE)
    vocab = base.model.vocab_size if vocab_size is None else vocab_size
    if vocab is None:
        raise UserError(f"recipe {recipe} leaves model.vocab_size to the tokenizer: give --vocab-size N (the "
                        "tokenizer's size, e.g. 4096 as cpu-10m)")
    check_training_options(vocab)
    check_training_start(base, vocab, deepspeed_config, zero_stage, budget_s - reserve)
    parts = file_parts(Path(input_file))  # before --out is made: a missing --input left it holding the marker alone
    with held_locks.held_folder(out_dir, LEARN_MARKER, "bench learn"), earlier_result_kept(out_dir) as result_written:
        train_file, val_file = write_parts(Path(input_file), parts, out_dir)
        copy_kept = not (out_dir / EARLIER_RESULT).is_dir()  # else the earlier result's files replace it on failure
        task_dir, heldout_skipped = check_heldout_part(input_file, train_file, val_file, out_dir / "tasks", copy_kept)
        phases.done("split")

        texts = PretrainTexts([train_file])
        try:
            tokenizer = train_tokenizer(texts, vocab, out_dir / "tok", show_progress=False,
                                        unusable=texts.skipped_note)
        except UserError as exc:  # about the training part (its records), or not (a write to tok/)
            raise (refused_part(exc, train_file, input_file, 0, copy_kept) if str(train_file) in str(exc)
                   else exc) from None
        phases.done("tokenizer", f" ({tokenizer.vocab_size} tokens)")

        report = prepare("pretrain", [str(train_file)], out_dir / "tok", out_dir / "data", val_fraction=0.0, workers=2,
                         show_progress=False)
        phases.done("data", f" ({report.tokens['train']:,} training tokens)")
        train_skipped = [in_input(said, train_file, input_file, 0) for said in report.skipped]
        for note in (skipped_in_part(train_skipped, "training", report.total("skipped")),
                     skipped_in_part(heldout_skipped, "held-out")):
            if note:
                print(note, flush=True)

        max_time = budget_s - phases.elapsed() - reserve
        if max_time <= 0:
            raise UserError(f"--budget {budget} leaves no time to train after {phases.elapsed():.0f} s of preparation "
                            f"and a {reserve:g} s reserve")
        cfg = build_config(recipe, [*(overrides or []), f"model.vocab_size={tokenizer.vocab_size}",
                                    f"train.max_time={max_time:.3f}"], paths={"data.path": str(out_dir / "data")})
        try:
            with stop_signals_restored(), rerun_said_as(f"run bench learn again into {out_dir} (it has no --resume: "
                                                        "it starts over)"):
                code = run_training(cfg, out_dir / "run", deepspeed_config, resume=False, zero_stage=zero_stage)
        except UserError as exc:  # the job ran in this process: end it without teardown, as `llm.cli.end_rank` does
            exc.end_at_once = True
            raise
        if code == EXIT_PREEMPTED:
            print(f"zerollm: note: bench learn stopped while training, so nothing was measured; it has no --resume: "
                  f"run it again (into {out_dir}, whose contents it replaces)", file=sys.stderr, flush=True)
            return 128 + Preemption.stopped_by if Preemption.stopped_by else code  # 130 or 143, not 75 (resume)
        if code != EXIT_OK:
            return code
        phases.done("training", f" (train.max_time {max_time:.1f} s)")
        in_loop = rundir.client_state_of(out_dir / "run", rundir.latest_tag(out_dir / "run"))["time_budget"]["elapsed"]

        model, trained = load_trained_model(out_dir / "run")
        heldout = Tokenizer.load(rundir.tokenizer_dir(out_dir / "run"))
        stream, _ = stream_of_files([str(val_file)], heldout)
        context = trained.data.seq_len
        result = evaluate_stream(model, heldout, stream, context, context, progress=False)
        phases.done("evaluation")

        total = phases.elapsed()
        summary = {"input": str(input_file), "recipe": recipe, "overrides": overrides or [], "budget_s": budget_s,
                   "wall_s": total, "within_budget": total <= budget_s, "phases_s": phases.seconds,
                   "train_max_time_s": max_time, "train_loop_s": in_loop, "vocab_size": tokenizer.vocab_size,
                   "train_tokens": report.tokens["train"], "heldout": result.to_dict(),
                   "skipped": {"train": train_skipped, "heldout": heldout_skipped}}
        said = (f"\nbench learn: {input_file}, recipe {recipe}, budget {budget_s:g} s, wall {total:.1f} s"
                f"{'' if total <= budget_s else f' -- OVER BUDGET by {total - budget_s:.1f} s: raise --reserve'}\n"
                f"  held-out bits per byte  {result.bits_per_byte:.4f}  (loss per token {result.loss:.4f}, "
                f"{result.tokens:,} tokens, {result.bytes:,} bytes, windows of {context})\n"
                f"  training loop {in_loop:.1f} s of train.max_time {max_time:.1f} s; starting and ending the job "
                f"{phases.seconds['training'] - in_loop:.1f} s and the held-out evaluation "
                f"{phases.seconds['evaluation']:.1f} s came out of the {reserve:g} s reserve\n"
                f"  written to {out_dir / 'result.json'}; lm-eval task for other models in {task_dir}")
        try:
            with durable.room_needed(out_dir, "result.json"):
                durable.write_text(out_dir / "result.json", json.dumps(summary, indent=1, allow_nan=False))
            result_written()
        except UserError:  # a full disk: the measurement is still said (it was a traceback, the result lost)
            print(said.rsplit("\n", 1)[0], flush=True)
            raise
        print(said)
        return 0 if total <= budget_s else 1
