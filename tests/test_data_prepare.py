"""data prepare: input files and formats, skipped records, the output directory, bounded memory."""

import bz2
import errno
import gzip
import itertools
import json
import lzma
import multiprocessing
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

import datasets
import h5py
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import FIXTURES, GIVES_UP_ON, changed_after_listing, regex_that_gives_up, run_cli, zerollm_here
from llm.cli import main
from llm.data import prepare as prepare_module
from llm.data.arrow_values import text_bytes
from llm.data.formats import Chat, Pair, PretrainTexts, read_items, read_records
from llm.data.output import LOCK_FILE, OutputDir
from llm.data.prepare import Report, not_prepared_here, prepare
from llm.data.prepared import read_data_attrs
from llm.data.readers import PIECE_CHARS, Item, RecordLimit, Skipped, expand_inputs, split_text
from llm.errors import STOP_SIGNALS, UserError
from llm.rundir import PREPARED_ENTRIES
from llm.tokenizer import Tokenizer, train_tokenizer
from llm.train.prompts import read_prompts


def _tokens(out, split="train"):
    with h5py.File(out / "tokens.h5", "r") as h5:
        return h5[split]["tokens"][:], h5[split]["doc_offsets"][:], dict(h5.attrs)


def _documents(out, tokenizer_dir):
    tokens, offsets, _ = _tokens(out)
    tok = Tokenizer.load(tokenizer_dir)
    return [tok.decode(tokens[a:b - 1]) for a, b in itertools.pairwise(offsets)]


def _quiet(kind, inputs, tokenizer_dir, out, **options):
    options = {"val_fraction": 0.0, "workers": 1, **options}
    return prepare(kind, [str(p) for p in inputs], tokenizer_dir, out, show_progress=False, **options)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(f"document number {i}, with a few words" for i in range(30)) + "\n")
    return path


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("other_tokenizer")
    texts = [f"another corpus, document {i}" for i in range(300)]
    train_tokenizer(texts, 300, out, show_progress=False)
    return out


# ---- files and records ---------------------------------------------------------------------------------

def test_every_pretrain_file_prepares(tokenizer_dir, tmp_path):
    source = FIXTURES / "pretrain"
    report = prepare("pretrain", [str(source)], tokenizer_dir, tmp_path / "out", val_fraction=0.01, workers=2,
                     show_progress=False)
    files = sorted(p for p in source.rglob("*") if p.suffix in (".txt", ".jsonl", ".json"))
    assert len(files) >= 5 and set(report.files) == {str(p) for p in files}
    assert all(count > 0 for count in report.files.values()), report.files
    assert report.skipped == []
    tok = Tokenizer.load(tokenizer_dir)
    tokens, offsets, attrs = _tokens(tmp_path / "out")
    assert tokens.dtype == np.uint16 and offsets[-1] == len(tokens) == report.tokens["train"]
    assert len(offsets) - 1 == report.documents["train"]
    assert (tokens[offsets[1:] - 1] == tok.eos_id).all()  # end-of-text closes every document
    assert attrs["tokenizer_hash"] == tok.hash and attrs["vocab_size"] == 512 and attrs["kind"] == "pretrain"
    assert report.documents["val"] > 0
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "out" / "report.json").read_text())["tokens"] == report.tokens


def test_documents_decode_back_to_their_text_in_order(tokenizer_dir, tmp_path):
    path = FIXTURES / "pretrain" / "zh_sayings.jsonl"
    _quiet("pretrain", [path], tokenizer_dir, tmp_path / "out", workers=2)
    texts = [item.value["text"] for item, _ in zip(read_items(path), range(50))]
    assert _documents(tmp_path / "out", tokenizer_dir)[:50] == texts


def test_txt_blocks_and_json_arrays_with_line_numbers(tokenizer_dir, tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n\nsecond doc\n")
    (tmp_path / "b.json").write_text('[\n {"text": "one"},\n {"wrong": 1},\n\n {"text": "three"}\n]\n')
    report = _quiet("pretrain", [tmp_path / "a.txt", tmp_path / "b.json"], tokenizer_dir, tmp_path / "out")
    assert report.documents["train"] == 4
    assert report.skipped == [(f"{tmp_path / 'b.json'}:3: no text field (keys: wrong); expected 'text', "
                               "'conversations' or 'instruction'/'output'")]
    assert _documents(tmp_path / "out", tokenizer_dir) == ["first doc\nline two", "second doc", "one", "three"]


def test_bom_and_crlf_never_reach_the_documents(tokenizer_dir, tmp_path):
    bom = "\ufeff".encode()
    (tmp_path / "a.txt").write_bytes(bom + b"first line\r\nsame doc\r\n\r\nsecond doc\r\n")
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "one"}\r\n{"text": "two"}\r\n')
    (tmp_path / "c.json").write_bytes(bom + b'[{"text": "three"},\r\n "four"]\r\n')
    report = _quiet("pretrain", sorted(tmp_path.glob("*.*")), tokenizer_dir, tmp_path / "out")
    assert report.skipped == []
    assert _documents(tmp_path / "out", tokenizer_dir) == ["first line\nsame doc", "second doc", "one", "two",
                                                           "three", "four"]


def test_json_is_read_element_by_element_with_errors_at_their_line(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"text": "one"},\n  2.5,\n  "three"\n]\n')
    assert [(i.line, i.value) for i in read_items(path)] == [(2, {"text": "one"}), (3, 2.5), (4, "three")]
    path.write_text('{"text": "one object"}')
    assert [(i.line, i.value) for i in read_items(path)] == [(1, {"text": "one object"})]
    for text, line, message in (('[\n {"text": "one"},\n {"text": }\n]', 3, "invalid JSON"),
                                ('[\n {"text": "one"}\n {"text": "two"}\n]', 3, "expected ',' or ']'"),
                                ('[\n 1\n]\n]', 4, "extra data")):
        path.write_text(text)
        with pytest.raises(UserError, match=f"a.json:{line}: {message}"):
            list(read_items(path))
    # a mistake early in a file longer than the largest record: it was read on to the limit, then reported as a
    # value too long
    tail = ",\n".join(['{"text": "' + "z" * 100 + '"}'] * 2000)
    path.write_text('[{"text": "one"},\n {"text": "two" "oops"},\n' + tail + "]\n")
    with pytest.raises(UserError, match=r"a.json:2: invalid JSON \(Expecting ',' delimiter\)"):
        list(read_items(path, RecordLimit(0.001, "--max-record-mb")))
    escape = '{"text": "' + "z" * 3000 + '\\u00e9"}'  # values a window may end inside of: read whole
    path.write_text("[" + ",\n".join([escape] * 30) + "]")
    assert len(list(read_items(path, RecordLimit(0.01, "--max-record-mb")))) == 30


@pytest.fixture
def bad_inputs(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"document number {i}"}) for i in range(20)) + "\n")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"text": "fine"}\n{"text": "broken\n{"text": "also fine"}\n')
    wrong_field = tmp_path / "wrong_field.jsonl"
    wrong_field.write_text('{"text": "fine"}\n{"content": "not our field"}\n{"text": 5}\n')
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(b"PAR1 not really")
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text("text saved as UTF-16\n", encoding="utf-16")
    late_nul = tmp_path / "late_nul.txt"  # past the 8 KiB looked at first: tokenized, NUL bytes and all
    late_nul.write_bytes(b"plain text\n" * 900 + b"abc\x00def\n")
    flipped = tmp_path / "flipped.jsonl.gz"  # a byte flipped in the deflate stream: a zlib.error traceback
    packed = bytearray(gzip.compress((FIXTURES / "pretrain" / "en_notes.jsonl").read_bytes(), mtime=0))
    packed[len(packed) // 2] ^= 0xFF
    flipped.write_bytes(bytes(packed))
    cut = {}
    for suffix, pack in (("xz", lzma.compress), ("bz2", bz2.compress), ("zst", _zstd)):
        cut[f"cut_{suffix}"] = tmp_path / f"cut.jsonl.{suffix}"  # a download cut short
        cut[f"cut_{suffix}"].write_bytes(pack((FIXTURES / "pretrain" / "en_notes.jsonl").read_bytes())[:-20])
    return {"good": good, "malformed": malformed, "wrong_field": wrong_field, "binary": binary, "empty": empty,
            "damaged": damaged, "utf16": utf16, "unknown": tmp_path / "x.csv", "missing": tmp_path / "missing.jsonl",
            "late_nul": late_nul, "flipped": flipped, **cut}


def _zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as packed:
        packed.write(data)
    return sink.getvalue().to_pybytes()


def _prepare(tokenizer_dir, out, *inputs, strict=False):
    extra = ["--strict"] if strict else []
    return run_cli("data", "prepare", "--input", *inputs, "--tokenizer", tokenizer_dir, "--out", out,
                   "--workers", 1, *extra)


def test_only_its_own_leftovers_beside_out_are_removed(tokenizer_dir, bad_inputs, tmp_path):
    """A folder beside --out whose name merely started like a leftover of a killed prepare (a user's
    `.out.old-backup`) was deleted with the leftovers, without a word."""
    names = [".out.old-backup", ".out.partial-snapshot", ".out.partial-41-9f0c1a2b", ".out.old-41-9f0c1a2b",
             ".out.partial-41-z4ll4hb_", ".out.partial", ".out.old"]  # the last three: tokenizer train's
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "kept.txt").write_text("mine\n")
    assert _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["good"]).returncode == 0
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".out.")) == sorted(names[:2])
    assert (tmp_path / ".out.old-backup" / "kept.txt").read_text() == "mine\n"


def test_a_set_aside_output_that_cannot_be_deleted_is_named(tokenizer_dir, bad_inputs, tmp_path, monkeypatch,
                                                          capsys):
    """A read-only earlier output, set aside as .OUT.old-PID-XXXXXXXX, was left there without a word at every run (a
    full copy of the data each time); a leftover that was a link was said to be undeletable."""
    out, remove = tmp_path / "out", shutil.rmtree
    prepare("pretrain", [str(bad_inputs["good"])], tokenizer_dir, out, workers=1, show_progress=False)

    def read_only_old(path, *args, **kwargs):
        if os.path.basename(path).startswith(".out.old-") and os.path.exists(path):
            raise PermissionError(13, "Permission denied", str(path))
        remove(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", read_only_old)
    prepare("pretrain", [str(bad_inputs["good"])], tokenizer_dir, out, workers=1, show_progress=False)
    left = [path for path in tmp_path.iterdir() if path.name.startswith(".out.old-")]
    assert len(left) == 1 and capsys.readouterr().err == (
        f"zerollm: note: {out} is written, but its earlier copy, set aside as {left[0]}, cannot be deleted "
        "(Permission denied); delete it yourself\n")
    tokens = (out / "tokens.h5").read_bytes()
    with pytest.raises(UserError, match=f"^{left[0]}, a copy of {out} an earlier run left beside it, cannot be "
                                        r"deleted \(Permission denied\); delete it \(or make it writable\) and run "
                                        "again$"):
        prepare("pretrain", [str(bad_inputs["good"])], tokenizer_dir, out, workers=1, show_progress=False)
    assert (out / "tokens.h5").read_bytes() == tokens
    monkeypatch.setattr(shutil, "rmtree", remove)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".out.partial-41-9f0c1a2b").symlink_to(tmp_path / "elsewhere")  # a link: removed, not followed
    prepare("pretrain", [str(bad_inputs["good"])], tokenizer_dir, out, workers=1, show_progress=False)
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".out.")]
    assert (tmp_path / "elsewhere").is_dir()


def test_an_output_set_aside_by_a_killed_commit_is_put_back_not_deleted(tokenizer_dir, bad_inputs, tmp_path):
    """A prepare killed between its commit's two renames leaves no OUT and the earlier output whole in
    `.OUT.old-PID-XXXXXXXX`: the rerun deleted that copy before writing anything, so a rerun that failed lost both."""
    out = tmp_path / "out"
    assert _prepare(tokenizer_dir, out, bad_inputs["good"]).returncode == 0
    tokens = (out / "tokens.h5").read_bytes()
    out.rename(tmp_path / ".out.old-41-9f0c1a2b")  # as the kill left it
    failed = _prepare(tokenizer_dir, out, bad_inputs["good"], bad_inputs["malformed"], strict=True)
    assert failed.returncode == 2 and "malformed JSON" in failed.stderr
    assert failed.stderr.startswith(f"zerollm: note: --out {out} was missing, its earlier output set aside by a data "
                                    "prepare stopped as it replaced it: put back from .out.old-41-9f0c1a2b, to be "
                                    "replaced when this run's output is whole\n")
    assert (out / "tokens.h5").read_bytes() == tokens
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert _prepare(tokenizer_dir, out, bad_inputs["good"]).returncode == 0
    assert (out / "tokens.h5").is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_malformed_json_line_is_skipped_and_reported_with_file_line(tokenizer_dir, bad_inputs, tmp_path):
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["good"], bad_inputs["malformed"])
    assert result.returncode == 0, result.stderr
    assert f"{bad_inputs['malformed']}:2: malformed JSON" in result.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["documents"]["train"] + report["documents"]["val"] == 22 and len(report["skipped"]) == 1


def test_a_record_the_tokenizer_library_panics_on_is_skipped_with_its_reason(tokenizer_dir, tmp_path):
    """The library's panic in a worker was a PicklingError traceback that ended the prepare, exit 1."""
    hostile = regex_that_gives_up(tokenizer_dir, tmp_path / "hostile")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(f"{GIVES_UP_ON}\n\n" + (FIXTURES / "pretrain" / "en_stories.txt").read_text())
    result = run_cli("data", "prepare", "--input", corpus, "--tokenizer", hostile, "--out", tmp_path / "out",
                     "--workers", 2)
    assert result.returncode == 0, result.stderr
    assert (f"{corpus}:1: the tokenizer failed on the text (Onig: Regex search error: retry-limit-in-match over): "
            "is its tokenizer.json from a source you trust?") in result.stdout
    assert len(json.loads((tmp_path / "out" / "report.json").read_text())["skipped"]) == 1


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_piece_of_a_long_text_the_tokenizer_library_fails_on_is_left_out_and_the_counts_hold(tokenizer_dir,
                                                                                           tmp_path, where):
    """The rest of the document was written while the report counted it as skipped: a failed first piece left the
    others as a document the report did not count; a failed last piece left the document without its end."""
    hostile = regex_that_gives_up(tokenizer_dir, tmp_path / "hostile")
    words = "word " * (PIECE_CHARS // 5)
    long_text = {"first": GIVES_UP_ON + " " + words * 2, "middle": words + GIVES_UP_ON + " " + words,
                 "last": words * 2 + GIVES_UP_ON}[where]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(f"first document\n\n{long_text}\n\nlast document\n")
    report = _quiet("pretrain", [corpus], hostile, tmp_path / "out")
    piece = {"first": 1, "middle": 2, "last": 3}[where]
    assert report.skipped == [f"{corpus}:3: piece {piece} of its text left out, the rest kept: the tokenizer failed on "
                              "the text (Onig: Regex search error: retry-limit-in-match over): is its tokenizer.json "
                              "from a source you trust?"]
    documents = _documents(tmp_path / "out", hostile)
    assert len(documents) == report.documents["train"] == 3
    assert documents[0] == "first document" and documents[-1] == "last document"
    with h5py.File(tmp_path / "out" / "tokens.h5") as h5:
        assert h5["train/tokens"].shape[0] == report.tokens["train"]


def test_terminal_controls_in_records_and_file_names_are_shown_escaped(tokenizer_dir, tmp_path, monkeypatch, capsys):
    """A key or part type holding ESC sequences reached the terminal raw (set its title, cleared it, coloured what
    followed), and one holding a newline forged a line of zerollm's own; a file name too."""
    path = tmp_path / "a\x1b[2Jb.jsonl"
    path.write_text("\n".join([
        json.dumps({"\x1b]0;PWNED\x07\x1b[31mfake": 1}),
        json.dumps({"messages": [{"role": "user", "content": [{"type": "X\nzerollm: done", "text": "a"}]},
                                 {"role": "assistant", "content": "b"}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]})]) + "\n")
    assert zerollm_here(monkeypatch, "data", "prepare", "--kind", "sft", "--input", path, "--tokenizer",
                        tokenizer_dir, "--out", tmp_path / "out", "--workers", 1) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\nzerollm: done" not in out
    shown = str(tmp_path / "a\\x1b[2Jb.jsonl")
    assert f"  {shown}:1: not a conversation (keys: \\x1b]0;PWNED\\x07\\x1b[31mfake);" in out
    assert f"  {shown}:2: turn 'content' has parts of type X\\nzerollm: done;" in out
    (tmp_path / "out2\x1b[2J").write_text("")  # a file where the folder goes: the error line names it
    assert zerollm_here(monkeypatch, "data", "prepare", "--kind", "sft", "--input", path, "--tokenizer",
                        tokenizer_dir, "--out", tmp_path / "out2\x1b[2J", "--workers", 1) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "out2\\x1b[2J" in err and err.count("\n") == 1


DEEP, HUGE = "[" * 100_000 + "]" * 100_000, "1" * 5000  # deeper than the recursion limit; more digits than int takes
TOO_DEEP, TOO_LONG = "nested too deeply", f"an integer of more than {sys.get_int_max_str_digits()} digits"


def test_json_nested_too_deeply_or_with_a_huge_integer_is_skipped_or_refused(tokenizer_dir, tmp_path, monkeypatch,
                                                                             capsys):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(['{"text": "fine"}', DEEP, f'{{"text": {HUGE}}}']) + "\n")
    report = _quiet("pretrain", [path], tokenizer_dir, tmp_path / "out")
    assert report.skipped == [f"{path}:2: malformed JSON ({TOO_DEEP})", f"{path}:3: malformed JSON ({TOO_LONG})"]
    calls = tmp_path / "calls.jsonl"  # tool calls given as JSON text
    calls.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a", "tool_calls": DEEP}]}) + "\n")
    assert [str(r) for r in read_records([calls], "sft")] == [f"{calls}:1: 'tool_calls' is not valid JSON ({TOO_DEEP})"]
    for value, problem in ((DEEP, TOO_DEEP), (HUGE, TOO_LONG)):
        array = tmp_path / "a.json"
        array.write_text(f'[\n{{"text": "fine"}},\n{value}\n]\n')
        code = zerollm_here(monkeypatch, "data", "prepare", "--input", array, "--tokenizer", tokenizer_dir, "--out",
                            tmp_path / "out2", "--workers", 1)
        assert code == 2 and capsys.readouterr().err.splitlines()[-1] == (
            f"zerollm: error: {array}:3: invalid JSON ({problem}); a .json file must hold one array or object")
        assert not (tmp_path / "out2").exists()


def test_strict_makes_a_malformed_record_fatal_and_writes_nothing(tokenizer_dir, bad_inputs, tmp_path):
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["good"], bad_inputs["malformed"], strict=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{bad_inputs['malformed']}:2: malformed JSON" in result.stderr
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in bad_inputs.values() if p.exists())


def test_wrong_field_is_skipped_with_reason(tokenizer_dir, bad_inputs, tmp_path):
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["wrong_field"])
    assert result.returncode == 0, result.stderr
    assert f"{bad_inputs['wrong_field']}:2: no text field (keys: content)" in result.stdout
    assert f"{bad_inputs['wrong_field']}:3: 'text' is a number, expected a string" in result.stdout


@pytest.mark.parametrize("case, message", [
    ("binary", "looks like a binary file"),
    ("empty", "no usable records found"),
    ("missing", "no such file or directory"),
    ("unknown", "unknown format"),
    ("damaged", "cannot read it as Parquet"),
    ("utf16", "looks like UTF-16 text (byte-order mark FF FE); convert it to UTF-8"),  # was "a binary file"
    ("late_nul", "late_nul.txt:901: looks like a binary file (NUL bytes)"),
    ("flipped", "cannot read (Error -3 while decompressing data"),
    ("cut_xz", "cannot read (Compressed file ended before the end-of-stream marker was reached)"),
    ("cut_bz2", "cannot read (Compressed file ended before the end-of-stream marker was reached)"),
    ("cut_zst", "cannot read (Truncated compressed stream)"),
])
def test_unusable_input_is_one_line_error_exit_2_nothing_written(tokenizer_dir, bad_inputs, tmp_path, case, message):
    if case == "unknown":
        bad_inputs[case].write_text("x")
    out = tmp_path / "out"
    result = _prepare(tokenizer_dir, out, bad_inputs[case])
    assert result.returncode == 2
    assert message in result.stderr
    assert case == "empty" or str(bad_inputs[case]) in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]) and "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("target", ["self.jsonl", "gone.jsonl"])
def test_an_input_that_is_a_broken_link_is_named_so(tokenizer_dir, tmp_path, monkeypatch, capsys, target):
    """A link to itself (or to a file since removed) was 'no such file or directory', though the file is there."""
    link = tmp_path / "self.jsonl"
    link.symlink_to(tmp_path / target)
    assert zerollm_here(monkeypatch, "data", "prepare", "--input", link, "--tokenizer", tokenizer_dir, "--out",
                        tmp_path / "out") == 2
    assert capsys.readouterr().err == (f"zerollm: error: {link} is a symbolic link to {tmp_path / target}, which does "
                                       "not exist (or links back to itself)\n")


def test_empty_file_beside_good_ones_is_reported(tokenizer_dir, bad_inputs, tmp_path):
    """A file whose records were all read and skipped was said to have 'no records'."""
    (tmp_path / "numbers.jsonl").write_text('{"text": 1}\n{"text": 2}\n')
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["good"], bad_inputs["empty"],
                      tmp_path / "numbers.jsonl")
    assert result.returncode == 0, result.stderr
    assert f"files with no usable records: {bad_inputs['empty']}, {tmp_path / 'numbers.jsonl'}\n" in result.stdout
    assert f"{tmp_path / 'numbers.jsonl'}:2: 'text' is a number, expected a string" in result.stdout


def test_tiny_corpus_still_gets_a_validation_document(tokenizer_dir, bad_inputs, tmp_path):
    report = _quiet("pretrain", [bad_inputs["good"]], tokenizer_dir, tmp_path / "out", val_fraction=0.01)
    assert report.documents == {"train": 19, "val": 1}
    _, offsets, _ = _tokens(tmp_path / "out", "val")
    assert offsets[-1] == report.tokens["val"] and len(offsets) == 2


# ---- other input formats -----------------------------------------------------------------------------------

def _write_every_format(records: list, folder) -> dict:
    """The same records as .jsonl, .jsonl.gz (.bz2, .xz, .zst), Parquet, Arrow (IPC file and stream) and a
    save_to_disk directory. Folders of .bz2, .xz and .zst files (the Pile's shards) were read as holding nothing."""
    folder.mkdir()
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    paths = {"jsonl": folder / "r.jsonl", "gz": folder / "r.jsonl.gz", "parquet": folder / "r.parquet",
             "arrow_file": folder / "file.arrow", "arrow_stream": folder / "stream.arrow", "hf": folder / "hf"}
    paths["jsonl"].write_text(text)
    with gzip.open(paths["gz"], "wt", encoding="utf-8") as f:
        f.write(text)
    for suffix, pack in (("bz2", bz2.compress), ("xz", lzma.compress), ("zst", _zstd)):
        paths[suffix] = folder / suffix / f"r.jsonl.{suffix.upper()}"  # a folder of it, its suffix in capitals
        paths[suffix].parent.mkdir()
        paths[suffix].write_bytes(pack(text.encode("utf-8")))
        paths[suffix] = paths[suffix].parent
    table = pa.Table.from_pylist(records)
    pq.write_table(table, paths["parquet"], row_group_size=50)
    for key, new in (("arrow_file", pa.ipc.new_file), ("arrow_stream", pa.ipc.new_stream)):
        with pa.OSFile(str(paths[key]), "wb") as sink, new(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=70)
    datasets.Dataset.from_list(records).save_to_disk(str(paths["hf"]))
    return paths


@pytest.mark.parametrize("kind, fixture", [("pretrain", "pretrain/en_notes.jsonl"), ("sft", "sft/messages_zh.jsonl"),
                                           ("dpo", "dpo/trl_pairs.jsonl")])
def test_parquet_arrow_gz_and_save_to_disk_give_the_same_tokens_as_jsonl(tokenizer_dir, tmp_path, kind, fixture):
    records = [json.loads(line) for line in (FIXTURES / fixture).read_text().splitlines()]
    paths = _write_every_format(records, tmp_path / "inputs")
    reference = None
    for name, path in paths.items():
        report = _quiet(kind, [path], tokenizer_dir, tmp_path / name)
        assert report.skipped == [] and report.documents["train"] == len(records), name
        with h5py.File(tmp_path / name / "tokens.h5") as h5:
            arrays = {key: h5["train"][key][:].tolist() for key in h5["train"]}
        reference = reference or (report.tokens, arrays)
        assert (report.tokens, arrays) == reference, name


def test_tokenizer_train_reads_the_same_texts_from_any_format(tmp_path):
    records = [json.loads(line) for line in (FIXTURES / "pretrain" / "en_notes.jsonl").read_text().splitlines()]
    paths = _write_every_format(records, tmp_path / "inputs")
    hashes = set()
    for name in ("jsonl", "parquet", "hf"):
        result = run_cli("tokenizer", "train", "--input", paths[name], "--vocab-size", 300, "--out", tmp_path / name)
        assert result.returncode == 0, result.stderr
        hashes.add(Tokenizer.load(tmp_path / name).hash)
    assert len(hashes) == 1


def test_conversations_that_datasets_stores_as_json_give_the_same_tokens_as_jsonl(tokenizer_dir, tmp_path):
    """`datasets` 5 stores turns whose keys differ between rows (a reasoning_content or tool_calls on some) as JSON
    text, in Arrow's `arrow.json` extension type, in its Parquet files and save_to_disk folders: each turn was read
    as a string, and every record skipped ("conversation turn is not an object")."""
    source = FIXTURES / "sft" / "openai_tools.jsonl"
    dataset = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(tmp_path / "cache"))
    assert "extension<arrow.json>" in str(dataset.data.schema.field("messages").type)  # what this test is about
    dataset.to_parquet(str(tmp_path / "tools.parquet"))
    dataset.save_to_disk(str(tmp_path / "tools"))
    reference = None
    for path in (source, tmp_path / "tools.parquet", tmp_path / "tools"):
        out = tmp_path / "out" / path.name
        report = _quiet("sft", [path], tokenizer_dir, out)
        assert report.skipped == [] and report.documents["train"] == len(source.read_text().splitlines()), path
        with h5py.File(out / "tokens.h5") as h5:
            arrays = {key: h5["train"][key][:].tolist() for key in h5["train"]}
        reference = reference or arrays
        assert arrays == reference, path


def test_a_json_column_value_that_is_not_json_skips_its_row_naming_the_column(tmp_path):
    texts = pa.array(['{"role": "user", "content": "hi"}', '{"role": "assistant", "content": "hello"}',
                      '{"role": "user", "content": "hi"}', '{"role": "assistant"'])
    turns = pa.ListArray.from_arrays([0, 2, 4], pa.ExtensionArray.from_storage(pa.json_(), texts))
    pq.write_table(pa.table({"messages": turns}), tmp_path / "chat.parquet")
    read = list(read_items(tmp_path / "chat.parquet"))
    assert read[0].value == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert str(read[1]).startswith(f"{tmp_path / 'chat.parquet'}:row 2: column 'messages': '{{\"role\": "
                                   "\"assistant\"' is not JSON (")
    deep = pa.ExtensionArray.from_storage(pa.json_(), pa.array(["[" * 100_000 + "]" * 100_000]))
    pq.write_table(pa.table({"messages": deep}), tmp_path / "deep.parquet")  # a RecursionError escaped
    assert str(next(read_items(tmp_path / "deep.parquet"))).endswith("is not JSON (nested too deeply)")


def _text_bytes_read_out(value) -> int:
    if isinstance(value, str | bytes):
        return len(value.encode() if isinstance(value, str) else value)
    if isinstance(value, dict):
        return sum(map(_text_bytes_read_out, value.values()))
    if isinstance(value, list | tuple):
        return sum(map(_text_bytes_read_out, value))
    return 0


@pytest.mark.parametrize("kind", ["string_view", "binary_view", "list_view", "large_list_view", "fixed_size_list",
                                  "map", "json", "list_of_structs", "run_end_encoded", "sparse_union", "dense_union"])
def test_the_text_a_row_holds_is_counted_in_every_arrow_type_before_it_is_read_out(kind):
    """--max-record-mb skips a row holding more text than it before the row is read out; a string_view column (and
    list views, fixed-size lists, maps, JSON, run-end encoded columns and unions) counted as holding none, and its
    row of 2 MB was tokenized."""
    words = ["é" * 7, None, "a" * 13, "x" * 40, "", "long " * 9]
    codes = pa.array([0, 1, 0, 0, 1, 0], pa.int8())
    arrays = {"string_view": pa.array(words, pa.string_view()),
              "binary_view": pa.array([w and w.encode() for w in words], pa.binary_view()),
              "list_view": pa.array([[w, w] if w else None for w in words], pa.list_view(pa.string())),
              "large_list_view": pa.array([[w] for w in words], pa.large_list_view(pa.string())),
              "fixed_size_list": pa.array([[w, "yy"] for w in words], pa.list_(pa.string(), 2)),
              "map": pa.array([[("k", w or "")] for w in words], pa.map_(pa.string(), pa.string())),
              "json": pa.ExtensionArray.from_storage(pa.json_(), pa.array([w and json.dumps(w) for w in words])),
              "list_of_structs": pa.array([[{"t": w, "n": 1}] for w in words]),
              "run_end_encoded": pa.RunEndEncodedArray.from_arrays(pa.array([2, 3, 6], pa.int32()),
                                                                   pa.array(["ab" * 50, None, "c"])),
              "sparse_union": pa.UnionArray.from_sparse(codes, [pa.array(words), pa.array(range(6))]),
              "dense_union": pa.UnionArray.from_dense(codes, pa.array([0, 0, 1, 2, 1, 3], pa.int32()),
                                                      [pa.array(words[:4]), pa.array(["zz", "y"])])}
    for array in (arrays[kind], arrays[kind].slice(2)):  # a slice starts inside the buffers
        values = (array.storage if kind == "json" else array).to_pylist()
        assert text_bytes(pa, array) == [_text_bytes_read_out(v) for v in values], array
    assert max(text_bytes(pa, arrays[kind])) > 0


def test_dataset_dict_directories_read_every_split_and_report_rows(tokenizer_dir, tmp_path):
    splits = {"train": [{"text": "one"}, {"text": ""}, {"text": "two"}], "test": [{"text": "three"}]}
    dataset_dict = datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})
    dataset_dict.save_to_disk(str(tmp_path / "hf"))
    pq.write_table(pa.Table.from_pylist([{"text": "four"}, {"other": "x"}]), tmp_path / "more.parquet")
    report = _quiet("pretrain", [tmp_path / "hf", tmp_path / "more.parquet"], tokenizer_dir, tmp_path / "out")
    assert report.skipped == [f"{tmp_path / 'hf' / 'train'}:row 2: empty text",
                              (f"{tmp_path / 'more.parquet'}:row 2: no text field (keys: none); expected 'text', "
                               "'conversations' or 'instruction'/'output'")]
    assert _documents(tmp_path / "out", tokenizer_dir) == ["one", "two", "three", "four"]
    walked = expand_inputs([tmp_path], exclude=tmp_path / "out")  # a folder walk finds the splits and the file
    assert walked == [tmp_path / "hf" / "train", tmp_path / "hf" / "test", tmp_path / "more.parquet"]


def test_a_dataset_dict_found_in_a_folder_is_read_in_its_own_order_as_when_named(tokenizer_dir, tmp_path):
    """A folder walk sorted the splits (test, train, validation) where the DatasetDict named read them in its own
    order: the same data gave other tokens, and another digest, by how it was named."""
    corpus = tmp_path / "corpus"
    datasets.DatasetDict({k: datasets.Dataset.from_list([{"text": k}]) for k in ("train", "validation", "test")}
                         ).save_to_disk(str(corpus / "hf"))
    for name in ("a", "z"):
        (corpus / f"{name}.jsonl").write_text(json.dumps({"text": name}) + "\n")
    named = [corpus / "a.jsonl", corpus / "hf", corpus / "z.jsonl"]
    _quiet("pretrain", named, tokenizer_dir, tmp_path / "named")
    _quiet("pretrain", [corpus], tokenizer_dir, tmp_path / "walked")
    for out in ("named", "walked"):
        assert _documents(tmp_path / out, tokenizer_dir) == ["a", "train", "validation", "test", "z"], out
    assert (prepare_module.tokens_digest(tmp_path / "named" / "tokens.h5")
            == prepare_module.tokens_digest(tmp_path / "walked" / "tokens.h5"))


def test_a_datasets_directory_naming_files_outside_it_is_refused(tokenizer_dir, tmp_path):
    """A save_to_disk folder from elsewhere is untrusted: its state.json (or a DatasetDict's split list) naming
    '../x' or an absolute path had datasets read data outside the folder given, without a word."""
    datasets.Dataset.from_list([{"text": "secret"}]).save_to_disk(str(tmp_path / "secret"))
    datasets.Dataset.from_list([{"text": "inside"}]).save_to_disk(str(tmp_path / "mine" / "ds"))
    state = tmp_path / "mine" / "ds" / "state.json"
    described = json.loads(state.read_text())
    name = described["_data_files"][0]["filename"]
    described["_data_files"][0]["filename"] = f"../../secret/{name}"
    state.write_text(json.dumps(described))
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": [str(tmp_path / "secret")]}))
    for given, said in ((tmp_path / "mine" / "ds", f"{state}: the data file \"../../secret/{name}\" is not a file name "
                                                   f"in {tmp_path / 'mine' / 'ds'}; save the dataset again"),
                        (tmp_path / "dict", f"{tmp_path / 'dict' / 'dataset_dict.json'}: the split \"/")):
        with pytest.raises(UserError) as error:
            _quiet("pretrain", [given], tokenizer_dir, tmp_path / "out")
        assert str(error.value).startswith(said) and " is not a " in str(error.value), str(error.value)
    assert not (tmp_path / "out").exists()


def test_a_datasets_directory_with_audio_and_image_columns_gives_its_texts(tokenizer_dir, tmp_path):
    """A speech or multimodal dataset's rows were decoded whole: an Audio column ended the run with a traceback
    (ImportError: torchcodec), an Image column of bytes that are no image with 'cannot read it'. Its text is read,
    the media left undecoded."""
    media = {"bytes": b"RIFF not really a wave", "path": None}
    dataset = datasets.Dataset.from_dict({"text": ["one", "two"], "audio": [media] * 2, "image": [media] * 2})
    dataset.cast_column("audio", datasets.Audio()).cast_column("image", datasets.Image()).save_to_disk(
        str(tmp_path / "hf"))
    report = _quiet("pretrain", [tmp_path / "hf"], tokenizer_dir, tmp_path / "out")
    assert report.skipped == [] and _documents(tmp_path / "out", tokenizer_dir) == ["one", "two"]


def test_a_dataset_dict_whose_split_folder_is_gone_says_so(tmp_path):
    """It said '.../test: cannot read (it is a directory now)' of a folder that is not there."""
    datasets.DatasetDict({k: datasets.Dataset.from_list([{"text": k}]) for k in ("train", "test")}).save_to_disk(
        str(tmp_path / "hf"))
    shutil.rmtree(tmp_path / "hf" / "test")
    for given in (tmp_path / "hf", tmp_path):
        with pytest.raises(UserError) as refused:
            expand_inputs([given])
        assert str(refused.value) == (f"{tmp_path / 'hf' / 'test'}: no such folder, though "
                                      f"{tmp_path / 'hf' / 'dataset_dict.json'} lists the split 'test'; save the "
                                      "dataset again, or give the splits' folders that are there")


def test_a_missing_datasets_package_is_a_one_line_error(tmp_path, monkeypatch):
    pq.write_table(pa.Table.from_pylist([{"text": "one"}]), tmp_path / "a.parquet")
    datasets.Dataset.from_list([{"text": "one"}]).save_to_disk(str(tmp_path / "hf"))
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match=r"a.parquet: reading Parquet/Arrow files needs pyarrow; install it with "
                                        r"`pip install 'datasets>=2\.19'`"):
        expand_inputs([tmp_path / "a.parquet"])
    with pytest.raises(UserError, match=r"hf: reading a save_to_disk directory needs the datasets package"):
        list(read_items(tmp_path / "hf"))


def test_symlinked_folders_are_read_each_once_and_a_link_loop_ends(tokenizer_dir, tmp_path, capsys):
    folder, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "a.txt").write_text("one document\n")
    (elsewhere / "b.txt").write_text("a linked document\n")
    (tmp_path / "c.txt").write_text("a linked file\n")
    (folder / "linked").symlink_to(elsewhere)
    (folder / "same_again").symlink_to(elsewhere)  # the same folder reached twice
    (folder / "loop").symlink_to(folder)
    (folder / "within").symlink_to(folder / "a.txt")  # read once, and no link out of the folder
    (folder / "c.txt").symlink_to(tmp_path / "c.txt")
    report = _quiet("pretrain", [folder], tokenizer_dir, tmp_path / "out")
    assert report.files == {str(folder / "a.txt"): 1, str(folder / "c.txt"): 1, str(folder / "linked" / "b.txt"): 1}
    assert _documents(tmp_path / "out", tokenizer_dir) == ["one document", "a linked file", "a linked document"]
    # a folder from elsewhere holding a link to your home pulled your files into the data without a word
    assert capsys.readouterr().err == (
        f"zerollm: note: {folder}: read through symbolic links that lead out of it: {folder / 'c.txt'} -> "
        f"{tmp_path / 'c.txt'} (1 input), {folder / 'linked'} -> {elsewhere} (1 input); remove a link to leave what "
        "it leads to out\n")
    assert expand_inputs([folder]) == [folder / "a.txt", folder / "c.txt", folder / "linked" / "b.txt"]
    assert capsys.readouterr().err == ""  # eval's and GRPO's readings (several per command, one per rank) say nothing


def _edited_tokenizer(tokenizer_dir, out, edit_spec=None, edit_config=None):
    """A copy of `tokenizer_dir` with its tokenizer.json (`edit_spec`) or tokenizer_config.json (`edit_config`)
    changed in place by the given function."""
    shutil.copytree(tokenizer_dir, out)
    for name, edit in (("tokenizer.json", edit_spec), ("tokenizer_config.json", edit_config)):
        if edit is not None:
            content = json.loads((out / name).read_text())
            edit(content)
            (out / name).write_text(json.dumps(content))
    return out


def test_a_tokenizer_json_that_truncates_or_pads_changes_no_token(tokenizer_dir, corpus, tmp_path):
    """Its truncation (to 8 tokens here) cut every document short and its padding put pad tokens inside documents
    and inside SFT replies' loss, without a word."""
    def truncating_and_padding(spec):
        spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
        spec["padding"] = {"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": 16, "pad_id": 3,
                           "pad_type_id": 0, "pad_token": "<|pad|>"}

    odd = _edited_tokenizer(tokenizer_dir, tmp_path / "odd", truncating_and_padding)
    loaded = Tokenizer.load(odd)
    assert loaded.hash == Tokenizer.load(tokenizer_dir).hash and loaded.notes == [
        f"{odd}: the truncation and padding its tokenizer.json sets are not used: zerollm cuts and pads by "
        "data.seq_len"]
    _quiet("pretrain", [corpus], odd, tmp_path / "odd_data")
    _quiet("pretrain", [corpus], tokenizer_dir, tmp_path / "data")
    assert np.array_equal(_tokens(tmp_path / "odd_data")[0], _tokens(tmp_path / "data")[0])


def test_a_tokenizer_whose_ids_leave_gaps_has_a_row_for_every_id(tokenizer_dir, corpus, tmp_path):
    """Its vocabulary size was its count of tokens: ids above it were written into the data (training then
    refused it, saying the file had changed) or, above 65,535, were an OverflowError traceback."""
    def moved_to(new_id):
        def move(spec):
            vocab = spec["model"]["vocab"]
            vocab[max(vocab, key=vocab.get)] = new_id
        return move

    for new_id in (600, 70_000):
        gaps = _edited_tokenizer(tokenizer_dir, tmp_path / f"gaps{new_id}", moved_to(new_id))
        assert Tokenizer.load(gaps).vocab_size == new_id + 1
        _quiet("pretrain", [corpus], gaps, tmp_path / f"data{new_id}")
        tokens, _, attrs = _tokens(tmp_path / f"data{new_id}")
        assert attrs["vocab_size"] == new_id + 1 and tokens.max() < new_id + 1
        assert tokens.dtype == (np.uint32 if new_id > 65_535 else np.uint16)


def test_a_role_token_the_vocabulary_lacks_is_refused(tokenizer_dir, tmp_path):
    """An eos_token not in tokenizer.json was ignored: replies ended in it as plain text, the model never learnt to
    stop, and transformers (which adds it as a new token) disagreed with zerollm on the ids."""
    odd = _edited_tokenizer(tokenizer_dir, tmp_path / "odd", edit_config=lambda c: c.update(eos_token="<|eos|>"))
    with pytest.raises(UserError) as refused:
        Tokenizer.load(odd)
    assert str(refused.value) == (f"{odd}: tokenizer_config.json names eos_token '<|eos|>', which is not a token of "
                                  "its tokenizer.json; name one of its tokens there, or remove eos_token")


def test_a_special_token_only_the_tokenizer_config_declares_is_refused(tokenizer_dir, tmp_path):
    """A token in tokenizer_config.json's added_tokens_decoder, additional_special_tokens or (transformers 5's)
    extra_special_tokens that tokenizer.json lacks was read as plain text (six pieces of <|tool|>) in chat and SFT
    data, where transformers adds it as a new token. One tokenizer.json holds at another id than the config's is
    used at tokenizer.json's, as transformers uses it."""
    entry = {"content": "<|tool|>", "special": True, "lstrip": False, "rstrip": False, "normalized": False,
             "single_word": False}
    for name, edit in (("decoder", lambda c: c.setdefault("added_tokens_decoder", {}).update({"512": entry})),
                       ("extra", lambda c: c.update(additional_special_tokens=["<|tool|>"])),
                       ("extra5", lambda c: c.update(extra_special_tokens={"tool_token": "<|tool|>"}))):
        odd = _edited_tokenizer(tokenizer_dir, tmp_path / name, edit_config=edit)
        with pytest.raises(UserError) as refused:
            Tokenizer.load(odd)
        assert str(refused.value) == (
            f"{odd}: tokenizer_config.json declares the special token '<|tool|>', which its tokenizer.json does not "
            "hold; zerollm reads tokens from tokenizer.json: save the tokenizer again with transformers "
            "(AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)), which writes it there")
    im_end = {**entry, "content": "<|im_end|>"}
    moved = _edited_tokenizer(tokenizer_dir, tmp_path / "moved", edit_config=lambda c: c.update(
        added_tokens_decoder={"7": im_end}, additional_special_tokens=["<|im_end|>"]))
    assert Tokenizer.load(moved).im_end_id == 2


USERS_ONLY = ("{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
              "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRIMMED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


TOOL_CALL = {"content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def _sft_with_template(tokenizer_dir, tmp_path, template, reply):
    """(tokenizer with `template`, a one-conversation sft file whose assistant says `reply`: its text, or the rest
    of its message)."""
    odd = _edited_tokenizer(tokenizer_dir, tmp_path / "odd")
    (odd / "chat_template.jinja").write_text(template)
    path = tmp_path / "chats.jsonl"
    reply = reply if isinstance(reply, dict) else {"content": reply}
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q1"},
                                             {"role": "assistant", **reply}]}) + "\n")
    return odd, path


STOP_FIRST = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<|endoftext|>{% endif %}"
              "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, reply, reason", [
    (STOP_FIRST, "a1", "the chat template ends the reply of assistant message 2 with <|endoftext|> before its text, "
                       "which would not be learnt; use a template that renders the reply's text before its "
                       "end-of-turn token"),  # only <|endoftext|> was learnt, silently
    (USERS_ONLY, "a1", "the chat template does not render the text of assistant message 2 where its reply is (it "
                       "leaves the turn out, or puts it elsewhere), so its loss cannot be placed; use a template that "
                       "renders every assistant turn"),  # the loss fell on the next user turn, silently
    ("\n", TOOL_CALL, "the chat template does not render the tool calls of assistant message 2, so it would be "
                      "left out (a tool call learnt as an empty reply); use a template that renders tool calls and "
                      "tool turns"),  # "too long", nothing cut; then "no reply tokens"
])
def test_a_template_that_renders_no_reply_has_its_record_skipped_saying_so(tokenizer_dir, tmp_path, template, reply,
                                                                           reason):
    odd, path = _sft_with_template(tokenizer_dir, tmp_path, template, reply)
    with pytest.raises(UserError) as refused:
        _quiet("sft", [path], odd, tmp_path / "out")
    reason = f"{odd}: {reason}"
    assert str(refused.value).endswith(f"first: {path}:1: {reason})"), str(refused.value)


LLAMA31_TOOL_CALLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
                      "{{ m.tool_calls[0].function.name }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Llama 3.1's way with a turn holding tool calls: it renders the calls, not the turn's text."""


def test_a_tool_call_turn_whose_text_the_template_leaves_out_is_learnt(tokenizer_dir, tmp_path):
    """Refused as a template that leaves the assistant turn out, where it trained on the tool call before."""
    call = {"content": "Let me check.", "tool_calls": [{"type": "function",
                                                        "function": {"name": "weather", "arguments": "{}"}}]}
    odd, path = _sft_with_template(tokenizer_dir, tmp_path, LLAMA31_TOOL_CALLS, call)
    assert _quiet("sft", [path], odd, tmp_path / "out").skipped == []
    tokens, _, _ = _tokens(tmp_path / "out")
    with h5py.File(tmp_path / "out" / "tokens.h5", "r") as h5:
        mask = h5["train"]["loss_mask"][:].astype(bool)
    assert Tokenizer.load(odd).decode(tokens[mask].tolist(), skip_special_tokens=False) == "weather<|im_end|>"


def test_a_reply_of_weight_0_is_context_not_learnt(tokenizer_dir, tmp_path):
    """OpenAI's fine-tuning format: a reply marked weight 0 was learnt with the rest."""
    path = tmp_path / "weighted.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "system", "content": "Marv"}, {"role": "user", "content": "capital of France"},
        {"role": "assistant", "content": "Paris, as if", "weight": 0}, {"role": "user", "content": "be nicer"},
        {"role": "assistant", "content": "Paris, dear", "weight": 1}]}) + "\n")
    assert _quiet("sft", [path], tokenizer_dir, tmp_path / "out").skipped == []
    tokens, _, _ = _tokens(tmp_path / "out")
    with h5py.File(tmp_path / "out" / "tokens.h5", "r") as h5:
        mask = h5["train"]["loss_mask"][:].astype(bool)
    tok = Tokenizer.load(tokenizer_dir)
    assert tok.decode(tokens[mask].tolist(), skip_special_tokens=False) == "Paris, dear<|im_end|>"
    assert "Paris, as if" in tok.decode(tokens.tolist())
    from llm.data.formats import chat_record
    from llm.data.prepare import encode_sft

    turns = json.loads(path.read_text())["messages"] + [{"role": "user", "content": "more " * 200},
                                                         {"role": "assistant", "content": "long " * 200}]
    turns[2], turns[4] = {**turns[2], "weight": 1}, {**turns[4], "weight": 0}  # learnt, context, too long: cut
    # after the one learnt, not after the context (it was)
    sample, truncated, _ = encode_sft(tok, chat_record({"messages": turns}), 120)
    assert truncated and tok.decode(sample["tokens"], skip_special_tokens=False).endswith("Paris, as if<|im_end|>")


def test_records_the_tokenizing_skips_are_not_counted_usable(tokenizer_dir, tmp_path):
    """A file all of whose records were too long was counted as holding them all, and left out of the files with no
    usable records."""
    long, short = tmp_path / "long.jsonl", tmp_path / "short.jsonl"
    turns = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "answer " * 50}]
    long.write_text("\n".join([json.dumps({"messages": turns})] * 3) + "\n")
    short.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yo"}]}) + "\n")
    report = _quiet("sft", [long, short], tokenizer_dir, tmp_path / "out", seq_len=64)
    assert report.files == {str(long): 0, str(short): 1} and report.total("skipped") == 3
    assert f"files with no usable records: {long}" in report.summary()


MISTRAL_CALL_IDS = (  # Mistral v0.3's rule: every call and every tool result carries a 9-character call id
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}{{ c.function.name }}:{{ c.id }}{% endfor %}<|im_end|>"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS]{{ m.tool_call_id }}={{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}")


@pytest.mark.parametrize("shape", ["openai", "flat"])
def test_tool_call_ids_reach_a_template_that_renders_them(tokenizer_dir, tmp_path, shape):
    """Calls' ids and tool turns' tool_call_id were dropped: Mistral's templates refused every tool-calling record."""
    call = {"name": "weather", "arguments": {"city": "Lima"}}
    call = {"id": "abcDEF123", "type": "function", "function": call} if shape == "openai" else {"id": "abcDEF123",
                                                                                                 **call}
    odd, path = _sft_with_template(tokenizer_dir, tmp_path, MISTRAL_CALL_IDS, {"content": "", "tool_calls": [call]})
    record = json.loads(path.read_text())
    record["messages"] += [{"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
                           {"role": "assistant", "content": "It is sunny."}]
    path.write_text(json.dumps(record) + "\n")
    assert _quiet("sft", [path], odd, tmp_path / "out").skipped == []
    tokens, _, _ = _tokens(tmp_path / "out")
    text = Tokenizer.load(odd).decode(tokens.tolist(), skip_special_tokens=False)
    assert "[TOOL_CALLS]weather:abcDEF123<|im_end|>[TOOL_RESULTS]abcDEF123=sunny[/TOOL_RESULTS]It is sunny." in text


def test_a_reply_the_template_changes_is_learnt_where_it_is_rendered(tokenizer_dir, tmp_path):
    odd, path = _sft_with_template(tokenizer_dir, tmp_path, TRIMMED, "  a1 ")
    assert _quiet("sft", [path], odd, tmp_path / "out").skipped == []
    tokens, _, _ = _tokens(tmp_path / "out")
    with h5py.File(tmp_path / "out" / "tokens.h5", "r") as h5:
        mask = h5["train"]["loss_mask"][:].astype(bool)
    assert Tokenizer.load(odd).decode(tokens[mask].tolist(), skip_special_tokens=False) == "a1<|im_end|>"


@pytest.mark.parametrize("command", [["data", "prepare", "--tokenizer", "TOKENIZER"],
                                     ["tokenizer", "train", "--vocab-size", "300"]])
def test_an_out_that_is_a_symbolic_link_loop_is_one_line(tokenizer_dir, tmp_path, monkeypatch, capsys, command):
    """pathlib's RuntimeError 'Symlink loop from ...' was a traceback, exit 1."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    command = [str(tokenizer_dir) if arg == "TOKENIZER" else arg for arg in command]
    code = zerollm_here(monkeypatch, *command, "--input", FIXTURES / "pretrain" / "en_notes.jsonl",
                        "--out", tmp_path / "a")
    assert (code, capsys.readouterr().err) == (2, f"zerollm: error: --out {tmp_path / 'a'}: a symbolic link that "
                                                  "leads back to itself; remove the link or give a directory\n")


def test_a_file_named_twice_or_also_found_in_a_folder_is_read_once(tokenizer_dir, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    named = folder / "a.jsonl"
    report = _quiet("pretrain", [named, folder, tmp_path / "corpus" / ".." / "corpus" / "a.jsonl"], tokenizer_dir,
                    tmp_path / "out")
    assert report.files == {str(named): 2} and report.documents["train"] == 2


def test_a_fifo_in_a_folder_is_skipped_and_one_named_is_refused(tokenizer_dir, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("one document\n")
    os.mkfifo(folder / "pipe.txt")  # reading it would wait forever for a writer
    result = run_cli("data", "prepare", "--input", folder, "--tokenizer", tokenizer_dir, "--out", tmp_path / "out",
                     "--workers", 1, timeout=120)
    assert result.returncode == 0, result.stderr
    assert set(json.loads((tmp_path / "out" / "report.json").read_text())["files"]) == {str(folder / "a.txt")}
    result = run_cli("data", "prepare", "--input", folder / "pipe.txt", "--tokenizer", tokenizer_dir, "--out",
                     tmp_path / "out2", timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"zerollm: error: {folder / 'pipe.txt'}: not a regular file (a FIFO, socket or device); " \
                            "give a file or a directory\n"
    assert not (tmp_path / "out2").exists()


# ---- the output directory --------------------------------------------------------------------------------

def test_out_inside_the_input_directory_is_never_read_back(tokenizer_dir, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("one document\n\nanother one\n")
    for _ in range(2):
        report = _quiet("pretrain", [folder], tokenizer_dir, folder / "data")
        assert set(report.files) == {str(folder / "a.txt")} and report.documents["train"] == 2
    with pytest.raises(UserError, match="is inside the output directory"):
        _quiet("pretrain", [folder / "data" / "report.json"], tokenizer_dir, folder / "data")


def test_out_holding_files_of_its_own_is_refused_and_left_intact(tokenizer_dir, corpus, tmp_path):
    mine = tmp_path / "mine"
    (mine / "tokenizer").mkdir(parents=True)
    (mine / "tokenizer" / "notes.txt").write_text("keep me")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("x: 1\n")
    named_tokens = tmp_path / "named-tokens"  # a file of the user's that happens to be named tokens.h5
    named_tokens.mkdir()
    (named_tokens / "tokens.h5").write_text("my own file")
    notes_beside = tmp_path / "notes-beside"  # prepared data with the user's notes put in its tokenizer/
    _quiet("pretrain", [corpus], tokenizer_dir, notes_beside)
    (notes_beside / "tokenizer" / "notes.txt").write_text("keep me too")
    unmarked = "but no tokens.h5, which data prepare writes into its every output, so they may be yours"
    for out, said in ((mine, f"tokenizer {unmarked}"), (run_dir, f"checkpoints, config.yaml {unmarked}"),
                      (named_tokens, "tokens.h5, which data prepare did not write"),  # this one and the next were
                      (notes_beside, "tokenizer/notes.txt, which data prepare did not write")):  # replaced, exit 0
        result = _prepare(tokenizer_dir, out, corpus)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"--out {out} holds {said}; it replaces its output there" in result.stderr
    assert (mine / "tokenizer" / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yaml"]
    assert (named_tokens / "tokens.h5").read_text() == "my own file"
    assert (notes_beside / "tokenizer" / "notes.txt").read_text() == "keep me too"


def test_preparing_again_replaces_the_whole_earlier_output(tokenizer_dir, other_tokenizer, corpus, tmp_path):
    out = tmp_path / "out"
    _quiet("pretrain", [corpus], tokenizer_dir, out)
    _quiet("pretrain", [corpus], other_tokenizer, out)
    assert read_data_attrs(out, "pretrain")["tokenizer_hash"] == Tokenizer.load(other_tokenizer).hash
    assert Tokenizer.load(out / "tokenizer").hash == Tokenizer.load(other_tokenizer).hash
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]  # no staging or set-aside copy left
    (tmp_path / "link").symlink_to(out)  # through a symlink: the directory is replaced, the link kept
    _quiet("pretrain", [corpus], tokenizer_dir, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and read_data_attrs(out, "pretrain")["tokenizer_hash"] == \
        Tokenizer.load(tokenizer_dir).hash


def test_the_tokens_carry_a_digest_of_all_their_content(tokenizer_dir, corpus, tmp_path, monkeypatch, capsys):
    """Runs identified data by its size and first and last MiB, blind to a change between them; the digest is now
    of all of it, made as the file is written. A file prepared before (no digest stored) is read whole for it, with
    a note where that takes a while, and gets the same digest."""
    from llm.data import prepare as prepare_module

    _quiet("pretrain", [corpus], tokenizer_dir, tmp_path / "a")
    corpus.write_text(corpus.read_text().replace("number 15,", "number 51,"))
    _quiet("pretrain", [corpus], tokenizer_dir, tmp_path / "b")
    digests = [prepare_module.tokens_digest(tmp_path / name / "tokens.h5") for name in ("a", "b")]
    assert digests[0] != digests[1] and all(len(d) == 16 for d in digests)
    path = tmp_path / "a" / "tokens.h5"
    with h5py.File(path, "a") as h5:
        assert h5.attrs["content_digest"] == digests[0]
        del h5.attrs["content_digest"]  # as an earlier version wrote it
    monkeypatch.setattr(prepare_module, "NOTED_DIGEST_BYTES", 0)
    assert prepare_module.tokens_digest(path) == digests[0]
    assert capsys.readouterr().err == (f"zerollm: note: {path} was prepared by an earlier version, which stored no "
                                       "digest of it: reading all 0.0 GiB of it to compute one (`zerollm data "
                                       "prepare` again stores one)\n")


def test_a_second_prepare_into_a_locked_out_is_refused(tokenizer_dir, corpus, tmp_path):
    out = tmp_path / "out"
    with OutputDir(out, PREPARED_ENTRIES, not_prepared_here) as first:
        (first.staging / "tokens.h5").write_text("being written")
        result = _prepare(tokenizer_dir, out, corpus)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert (f"--out {out}: another `zerollm data prepare` (pid {os.getpid()}) is writing there; wait for it to "
                "finish or choose another --out") in result.stderr
        assert (first.staging / "tokens.h5").read_text() == "being written"
        assert OutputDir(out, PREPARED_ENTRIES, not_prepared_here).staging != first.staging  # unique temporary names
    assert _prepare(tokenizer_dir, out, corpus).returncode == 0  # the lock goes with its holder


def test_an_interrupted_prepare_leaves_the_previous_output_whole(tokenizer_dir, other_tokenizer, corpus, tmp_path,
                                                                 monkeypatch):
    out = tmp_path / "out"
    _quiet("pretrain", [corpus], tokenizer_dir, out)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def interrupted(self, directory):
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "save", interrupted)  # killed after the tokens, before the tokenizer copy
    with pytest.raises(KeyboardInterrupt):
        _quiet("pretrain", [corpus], other_tokenizer, out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert read_data_attrs(out, "pretrain")["tokenizer_hash"] == Tokenizer.load(tokenizer_dir).hash
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]


def _signalled_prepare(tokenizer_dir, tmp_path, records: int, signal_workers) -> tuple[int, str]:
    """Exit code and stderr of `data prepare --workers 2` (in a session of its own) on `records` records of 3000
    characters; `signal_workers(process)` is called once its workers are started and writing."""
    unit = (FIXTURES / "pretrain" / "en_stories.txt").read_text().replace("\n", " ")
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": unit[i:i + 3000]}) + "\n" for i in range(records)))
    process = subprocess.Popen([sys.executable, "-m", "llm", "data", "prepare", "--input", str(source), "--tokenizer",
                                str(tokenizer_dir), "--out", str(tmp_path / "out"), "--workers", "2"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while not list(tmp_path.glob(".out.partial-*/tokens.h5")):  # created after the workers
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.01)
        signal_workers(process)
        err = process.communicate(timeout=120)[1]
    finally:
        process.kill()
    return process.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_the_process_group_stops_prepare_and_its_workers_cleanly(tokenizer_dir, tmp_path, signum):
    """Ctrl-C signals the whole process group: workers that took it printed tracebacks, and one stopped halfway
    through a job or a result hung the run in Pool.terminate. SIGTERM killed the run with its staging left behind."""
    code, err = _signalled_prepare(tokenizer_dir, tmp_path, 3000, lambda process: os.killpg(process.pid, signum))
    assert code == 128 + signum and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert signum != signal.SIGINT or err.endswith("\nzerollm: interrupted\n")
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]  # no staging directory, no OUT holding only the lock


def test_a_worker_discards_a_stop_signal_sent_to_the_group_before_it_left_it(tokenizer_dir):
    """A worker not yet scheduled when a SIGTERM reached the process group (a loaded machine) had it pending, blocked,
    and died of it as it unblocked: the run ended as if the out-of-memory killer had ended a worker (exit 2)."""
    pid = os.fork()
    if pid == 0:  # a worker as the pool forks it: stop signals blocked, and one sent to the group pending
        code = 1
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            os.kill(os.getpid(), signal.SIGTERM)
            prepare_module._init_pool_worker(str(tokenizer_dir), os.getppid())
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0  # neither killed by the signal nor failed

def test_a_worker_ended_by_the_runs_own_stop_signal_is_said_as_the_stop(tokenizer_dir, corpus, tmp_path, monkeypatch):
    """A SIGTERM to the process group ends the workers too; where the run's own SystemExit was lost in a finalizer
    (where the handler happened to run: it is recorded for that), the broken pool came first and the run ended as a
    worker lost to the out-of-memory killer, exit 2 with advice to lower --workers (seen under load)."""
    def stopped_then_broken(output, *args):
        output._signalled = signal.SIGTERM  # its exception dropped by the finalizer it was raised in
        raise UserError("a tokenizer worker ended before its work was done")

    monkeypatch.setattr(prepare_module, "_write_tokens", stopped_then_broken)
    with pytest.raises(SystemExit) as stopped:
        _quiet("pretrain", [corpus], tokenizer_dir, tmp_path / "out")
    assert stopped.value.code == 128 + signal.SIGTERM
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]

def test_a_worker_killed_ends_the_run_in_one_line(tokenizer_dir, tmp_path):
    """A worker the out-of-memory killer ended was replaced by the pool, and the run waited for its jobs forever."""
    def kill_a_worker(process):
        psutil.Process(process.pid).children()[0].kill()

    code, err = _signalled_prepare(tokenizer_dir, tmp_path, 3000, kill_a_worker)
    assert code == 2, err
    assert err.endswith("zerollm: error: a tokenizer worker ended before its work was done, so its records are lost "
                        "(the out-of-memory killer ends one that holds a huge record): lower --workers or "
                        "--max-record-mb, and run again\n"), err
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def _half_a_result_then_killed(job):
    """What a worker the out-of-memory killer ends halfway through sending a 1 MiB result leaves: part of the
    message in the result pipe, the pipe's lock held."""
    results = sys._getframe(1).f_locals["result_queue"]  # the executor's worker loop, calling this job
    with results._wlock:
        os.write(results._writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_while_it_sends_a_result_ends_the_run(tokenizer_dir, monkeypatch):
    """The executor's thread read the rest of that message for ever, and the run waited for its results."""
    monkeypatch.setattr(prepare_module, "_encode_batch", _half_a_result_then_killed)
    raised = []

    def tokenize():
        try:
            with prepare_module.TokenizerPool(2, str(tokenizer_dir)) as pool:
                list(prepare_module._encoded(iter([([], ("pretrain", 8, []))]), pool))
        except UserError as exc:
            raised.append(str(exc))

    run = threading.Thread(target=tokenize, daemon=True)
    run.start()
    run.join(timeout=60)
    assert not run.is_alive() and raised and raised[0].startswith("a tokenizer worker ended before its work was done")


def test_a_pool_that_cannot_start_every_worker_ends_those_it_started(tokenizer_dir, monkeypatch):
    """A fork that failed (EAGAIN at a process limit) left the workers started before it running, and the
    interpreter's exit waited for them for ever."""
    fork = multiprocessing.get_context("fork")
    started = []

    class SecondForkFails(fork.Process):
        def start(self):
            if started:
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
            super().start()
            started.append(self)

    monkeypatch.setattr(fork, "Process", SecondForkFails)
    try:
        with pytest.raises(OSError, match="Resource temporarily unavailable"):
            prepare_module.TokenizerPool(2, str(tokenizer_dir))
        assert len(started) == 1 and started[0].exitcode is not None
    finally:
        for worker in started:
            worker.kill()


def _held_file(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


def test_the_workers_do_not_hold_the_outputs_lock(tokenizer_dir, tmp_path):
    """The workers inherited it, and bench learn's around it: a run killed with SIGKILL left them held by its
    orphaned workers for up to a second, and a rerun at once was refused, naming the dead process as the one
    writing there."""
    from llm.eval.learning_speed import LEARN_MARKER
    from llm.held_locks import held_folder

    with held_folder(tmp_path / "learn", LEARN_MARKER, "bench learn"), \
            OutputDir(tmp_path / "out", PREPARED_ENTRIES, not_prepared_here):
        locks = {str(tmp_path / "out" / LOCK_FILE), str(tmp_path / "learn" / LEARN_MARKER)}
        assert locks <= {_held_file(int(fd)) for fd in os.listdir("/proc/self/fd")}
        with prepare_module.TokenizerPool(2, str(tokenizer_dir)) as pool:
            held = {pool.result(pool._executor.submit(_held_files)) for _ in range(4)}
    assert held and not any(locks & files for files in held)


def _held_files() -> frozenset[str]:
    return frozenset(filter(None, (_held_file(int(fd)) for fd in os.listdir("/proc/self/fd"))))


def test_a_job_longer_than_the_pools_look_at_its_workers_gives_its_results(tokenizer_dir, monkeypatch):
    monkeypatch.setattr(prepare_module, "WORKER_POLL_S", 0.01)
    with prepare_module.TokenizerPool(2, str(tokenizer_dir)) as pool:
        assert pool.result(pool._executor.submit(time.sleep, 0.3)) is None


def test_a_second_ctrl_c_waits_until_the_pool_is_closed(tokenizer_dir):
    """A Ctrl-C landing while the pool closed (after the first one's) stopped it half-way: a worker left running,
    the executor not shut down, and the interpreter's exit could wait for them."""
    def interrupted(signum, frame):
        raise KeyboardInterrupt

    pool = prepare_module.TokenizerPool(2, str(tokenizer_dir))
    workers = pool._processes()
    kill = workers[0].kill

    def kill_and_ctrl_c():
        kill()
        os.kill(os.getpid(), signal.SIGINT)

    workers[0].kill = kill_and_ctrl_c
    before = signal.signal(signal.SIGINT, interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.close()
        assert all(worker.exitcode is not None for worker in workers) and pool._executor._processes is None
    finally:
        signal.signal(signal.SIGINT, before)
        workers[0].kill = kill
        for worker in workers:
            worker.kill()


def test_workers_end_when_their_main_process_is_killed(tokenizer_dir, tmp_path):
    workers = []

    def kill_the_main_process(process):
        workers.extend(psutil.Process(process.pid).children())
        process.kill()

    _signalled_prepare(tokenizer_dir, tmp_path, 3000, kill_the_main_process)
    assert len(workers) == 2
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive


def test_workers_leave_ctrl_c_to_the_main_process(tokenizer_dir, tmp_path):
    def interrupt_workers(process):
        for worker in psutil.Process(process.pid).children():
            worker.send_signal(signal.SIGINT)

    code, err = _signalled_prepare(tokenizer_dir, tmp_path, 300, interrupt_workers)
    assert code == 0 and "Traceback" not in err, err
    assert read_data_attrs(tmp_path / "out", "pretrain")["kind"] == "pretrain"


def test_training_refuses_a_tokenizer_copy_that_does_not_match_the_tokens(tokenizer_dir, other_tokenizer, corpus,
                                                                           tmp_path):
    out = tmp_path / "out"
    _quiet("pretrain", [corpus], tokenizer_dir, out)
    shutil.rmtree(out / "tokenizer")
    shutil.copytree(other_tokenizer, out / "tokenizer")
    with pytest.raises(UserError) as error:
        read_data_attrs(out, "pretrain")
    ours, theirs = Tokenizer.load(tokenizer_dir).hash, Tokenizer.load(other_tokenizer).hash
    assert f"(hash {theirs}) is not the tokenizer" in str(error.value) and f"(hash {ours})" in str(error.value)


def test_unwritable_out_is_a_one_line_error(tokenizer_dir, corpus, tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "corpus.txt" / "out"  # a file where a directory should be
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):  # a read-only file system (as root, permissions would not stop writes)
        if str(path).startswith(str(read_only)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    for out, reason in ((blocked, "Not a directory"), (read_only / "out", "Read-only file system")):
        with pytest.raises(SystemExit) as exit_code:
            main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out)])
        assert exit_code.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"zerollm: error: --out {out}: cannot write there ({reason}); data prepare needs to write in it and "
            "beside it (in its parent directory)")
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(SystemExit):  # it said "cannot write there (Not a directory); ... write in it and beside it"
        main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out",
              str(tmp_path / "a_file")])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"zerollm: error: --out {tmp_path / 'a_file'} is a "
                                                                "file; give a directory")
    assert (tmp_path / "a_file").read_text() == "mine"


def test_a_full_disk_at_the_lock_leaves_no_out_behind(tokenizer_dir, corpus, tmp_path, monkeypatch, capsys):
    """Writing its pid into the lock file of an OUT it had just created failed (a full disk): the refusal left OUT
    behind, holding only .prepare.lock."""
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(SystemExit) as exit_code:
        main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out",
              str(tmp_path / "out")])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"zerollm: error: --out {tmp_path / 'out'}: cannot write there (No space left on device); data prepare needs "
        "to write in it and beside it (in its parent directory)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]

def _file_size_limit(limit: int):
    """For a child process: files it writes cannot grow past `limit` bytes (a write fails with EFBIG, as on a full
    disk; no root needed to fill a file system)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("documents", [10_000, 40_000])  # the write fails as the file closes; as it is written
def test_a_failed_write_is_a_one_line_error_and_leaves_nothing(tokenizer_dir, tmp_path, documents):
    """HDF5 crashed freeing the file whose write failed: exit 139 (a segmentation fault) after the message; a write
    that failed as the file closed was an h5py traceback."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document number {i}, with a few words" for i in range(documents)) + "\n")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "llm", "data", "prepare", "--input", str(corpus), "--tokenizer",
                             str(tokenizer_dir), "--out", str(out), "--workers", "1"], capture_output=True, text=True,
                            preexec_fn=_file_size_limit(64 * 1024), check=False)
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, (
        f"zerollm: error: --out {out}: cannot write the output (File too large); nothing was kept"))
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


# ---- bounded memory ----------------------------------------------------------------------------------------

def _long_text() -> str:
    english = (FIXTURES / "pretrain" / "en_stories.txt").read_text()[:60_000].replace("\n", " ")
    chinese = (FIXTURES / "pretrain" / "zh_stories.txt").read_text()[:40_000].replace("\n", "")
    return english + chinese  # Chinese has no spaces: cut after punctuation


def test_a_long_document_is_tokenized_in_pieces_that_add_up_exactly(tokenizer_dir, tmp_path):
    text = _long_text()
    (tmp_path / "long.txt").write_text(text + "\n")
    items = list(read_items(tmp_path / "long.txt"))
    assert len(items) >= 3 and [i.piece for i in items] == list(range(len(items)))
    assert [i.last for i in items] == [False] * (len(items) - 1) + [True]
    assert max(len(i.value) for i in items) <= PIECE_CHARS and "".join(i.value for i in items) == text
    _quiet("pretrain", [tmp_path / "long.txt"], tokenizer_dir, tmp_path / "out")
    tokens, offsets, _ = _tokens(tmp_path / "out")
    tok = Tokenizer.load(tokenizer_dir)
    assert tokens.tolist() == tok.encode(text) + [tok.eos_id] and offsets.tolist() == [0, len(tokens)]


def test_a_records_text_keeps_its_trailing_newlines(tokenizer_dir, tmp_path):
    """A {"text"} record is stored as its text is (docs/data.md): its trailing newlines went, as a .txt block's
    line ends go, so every source file of a code corpus lost its last newline. A .txt block still drops its own."""
    texts = ["def f():\n    return 1\n", "line\n\n\n", "no newline"]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    _quiet("pretrain", [tmp_path / "code.jsonl"], tokenizer_dir, tmp_path / "out")
    assert _documents(tmp_path / "out", tokenizer_dir) == texts
    (tmp_path / "code.txt").write_text("a block\nof two lines\n\nanother\n")
    _quiet("pretrain", [tmp_path / "code.txt"], tokenizer_dir, tmp_path / "txt")
    assert _documents(tmp_path / "txt", tokenizer_dir) == ["a block\nof two lines", "another"]


def _prefixing_tokenizer(folder, style: str):
    """A BPE tokenizer.json that puts a space before a text: as SentencePiece conversions write them, Llama-2's (a
    normalizer prepending and replacing spaces by `▁`) or transformers' newer one (a Metaspace pre-tokenizer
    prepending `▁` to a text), or byte-level with a prefix space (RoBERTa's, BART's)."""
    from tokenizers import Tokenizer as LibraryTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    library = LibraryTokenizer(models.BPE())
    library.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")  # no merge across words
    library.decoder = decoders.Metaspace(prepend_scheme="first")
    if style == "prefix_space":
        library.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        library.decoder = decoders.ByteLevel()
    if style == "normalizer":
        library.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        library.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    library.train_from_iterator([_long_text()], trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                                    special_tokens=["</s>"]))
    spec = json.loads(library.to_str())
    if style == "normalizer":  # Llama-2's file has no pre-tokenizer
        spec["pre_tokenizer"] = None
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.mark.parametrize("style", ["normalizer", "pre_tokenizer", "prefix_space"])
def test_a_long_document_keeps_its_text_at_every_cut_with_a_tokenizer_prefixing_a_space(tmp_path, style):
    """Each later piece of a long document was encoded as a text of its own, and such a tokenizer puts a space
    before a text: a space more at every cut (about one in 32,000 characters, 'The  quick')."""
    directory = _prefixing_tokenizer(tmp_path / "tok", style)
    tok = Tokenizer.load(directory)
    chinese = (FIXTURES / "pretrain" / "zh_stories.txt").read_text().replace("\n", "")
    text = _long_text() + chinese[:PIECE_CHARS]  # cuts before a space, and after Chinese punctuation
    (tmp_path / "long.txt").write_text(text + "\n")
    assert [item.value[0] == " " for item in read_items(tmp_path / "long.txt")][1:] == [True, True, False]
    _quiet("pretrain", [tmp_path / "long.txt"], directory, tmp_path / "out")
    tokens, _, _ = _tokens(tmp_path / "out")
    assert tokens.tolist() == tok.encode_document(text) + [tok.eos_id]
    assert tok.decode(tokens[:-1]) == (" " if style == "prefix_space" else "") + text  # the document's own prefix


def test_documents_open_with_the_bos_a_llama_style_tokenizer_puts_before_a_text(tmp_path):
    """They were written without it, though transformers' `tokenizer(text)` gives it and such a model is trained
    behind it. A long document read in pieces gets one, before its first piece."""
    llama = FIXTURES / "tokenizers" / "llama"
    tok = Tokenizer.load(llama)
    text = _long_text()
    (tmp_path / "docs.txt").write_text("Short one.\n\n" + text + "\n")
    _quiet("pretrain", [tmp_path / "docs.txt"], llama, tmp_path / "out")
    tokens, offsets, attrs = _tokens(tmp_path / "out")
    short = [1, *tok.encode("Short one."), 2]
    assert tokens.tolist() == short + [1, *tok.encode(text), 2] and offsets.tolist() == [0, len(short), len(tokens)]
    assert attrs["tokenizer_hash"] == tok.hash and attrs["bos_id"] == 1


@pytest.mark.parametrize("limit", [40, 300, 5000])
def test_pieces_tokenize_as_the_whole_text(tokenizer_dir, limit):
    tok = Tokenizer.load(tokenizer_dir)
    text = _long_text()[:9000] + " don't stop_here... 'quoted'  3.14 x\t\ty\n\nz " + _long_text()[-3000:]
    pieces = [item.value for item in split_text(Item("t", 1, None), text, limit)]
    assert "".join(pieces) == text and max(map(len, pieces)) <= limit
    assert [t for p in pieces for t in tok.encode(p)] == tok.encode(text)
    pieces = [item.value for item in split_text(Item("t", 1, None), "x" * 1000, limit)]  # no place to cut well
    assert "".join(pieces) == "x" * 1000 and max(map(len, pieces)) <= limit


def _peak_rss_mb(tokenizer_dir, folder, n_chars: int) -> float:
    """Peak resident memory of `data prepare --workers 1` on a one-line file of `n_chars` characters."""
    unit = (FIXTURES / "pretrain" / "en_stories.txt").read_text().replace("\n", " ")
    path = folder / f"line{n_chars}.txt"
    path.write_text((unit * (n_chars // len(unit) + 1))[:n_chars])
    code = ("import resource, sys\nfrom llm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", code, "data", "prepare", "--input", str(path), "--tokenizer",
                             str(tokenizer_dir), "--out", str(folder / f"out{n_chars}"), "--workers", "1"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1]) / 1024


def test_memory_does_not_grow_with_the_length_of_one_line(tokenizer_dir, tmp_path):
    small, large = _peak_rss_mb(tokenizer_dir, tmp_path, 1_000_000), _peak_rss_mb(tokenizer_dir, tmp_path, 6_000_000)
    assert large - small < 60, (small, large)  # reading the line whole took ~135 bytes a character: +650 MB


def test_json_records_over_the_limit_are_skipped_or_refused_without_reading_them_whole(tokenizer_dir, tmp_path):
    big = {"text": "many words " * 3000}
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"text": "short"}, big, {"text": "after"})) + "\n")
    report = _quiet("pretrain", [path], tokenizer_dir, tmp_path / "out", max_record_mb=0.01)
    size = len(json.dumps(big))  # its line end is no part of it (it was counted: one character too many)
    assert report.documents["train"] == 2 and report.skipped == [
        (f"{path}:2: record of {size:,} characters is over --max-record-mb 0.01; raise it, or put long documents "
         "in .txt files, which are streamed")]
    (tmp_path / "big.json").write_text(json.dumps([{"text": "short"}, big]))
    with pytest.raises(UserError, match="big.json:1: a value longer than --max-record-mb 0.01; raise it, or convert "
                                        "the file to .jsonl$"):  # not "; a .json file must hold one array or object"
        _quiet("pretrain", [tmp_path / "big.json"], tokenizer_dir, tmp_path / "out2", max_record_mb=0.01)


def test_a_tiny_max_record_mb_is_named_as_given(tokenizer_dir, tmp_path):
    """It was named "--max-record-mb 0" (the limit in whole characters, over a million)."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "x"}\n')
    assert [str(s) for s in read_items(path, RecordLimit(1e-9, "--max-record-mb"))] == [
        f"{path}:1: record of 13 characters is over --max-record-mb 1e-09; raise it, or put long documents in .txt "
        "files, which are streamed"]
    (tmp_path / "a.json").write_text('{"text": "x"}')
    with pytest.raises(UserError, match="a.json:1: a value longer than --max-record-mb 1e-09;"):
        list(read_items(tmp_path / "a.json", RecordLimit(1e-9, "--max-record-mb")))
    for at_the_limit in (path, tmp_path / "a.json"):  # a line's end counted in .jsonl: 13 characters were 14
        assert [item.value for item in read_items(at_the_limit, RecordLimit(13e-6))] == [{"text": "x"}]


def test_a_command_without_max_record_mb_names_the_limit_not_the_option(tmp_path):
    """tokenizer train, eval, bench learn and train grpo read records under the fixed 64 MB limit; a record over it
    was skipped advising "--max-record-mb 64; raise it", an option only data prepare takes."""
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"prompt": "x" * 64_000_000, "answer": "1"}) + "\n")
        f.write(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    reason = (f"{path}:1: record of 64,000,029 characters is over the 64 MB limit of one record; put long documents in "
              ".txt files, which are streamed")
    prompts = read_prompts([str(path)], lambda messages, tools: [0], max_tokens=8)
    assert [p.fields["answer"] for p in prompts] == ["2"] and prompts.skipped == [reason]
    texts = PretrainTexts([path])
    assert list(texts) == [] and str(texts.first_skipped) == reason  # the second record has no text either
    assert texts.skipped_count == 2


def test_a_dpo_prompt_of_the_wrong_type_is_named(tokenizer_dir, tmp_path):
    """It was skipped as "no prompt"."""
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": 5, "chosen": "a", "rejected": "b"}\n{"prompt": "hi", "chosen": "a", "rejected": "b"}\n')
    report = _quiet("dpo", [path], tokenizer_dir, tmp_path / "out")
    assert report.skipped == [f"{path}:1: 'prompt' is a number, expected a string or a list of turns"]


@pytest.mark.parametrize("blank", [" " * 40_000, " " * 4_000, "\t"])
def test_a_blank_line_of_any_length_separates_documents(tokenizer_dir, tmp_path, blank):
    """A line of white space longer than a part (32,768 characters) joined the documents around it, and a file of
    only such a line wrote a document of spaces."""
    path = tmp_path / "docs.txt"
    path.write_text(f"doc one\n{blank}\n   doc two\n{blank}")
    report = _quiet("pretrain", [path], tokenizer_dir, tmp_path / "out")
    assert report.documents["train"] == 2
    path.write_text(f"{blank}\n")
    with pytest.raises(UserError, match="no usable records"):
        _quiet("pretrain", [path], tokenizer_dir, tmp_path / "out2")


def test_a_dpo_pair_whose_replies_part_after_the_cut_is_skipped(tokenizer_dir, tmp_path):
    """Replies that differ only past --seq-len were written cut, chosen equal to rejected: a pair that teaches
    nothing, listed as merely 'cut to fit'."""
    path = tmp_path / "pairs.jsonl"
    common = "a long shared opening of both replies " * 8
    path.write_text(json.dumps({"prompt": "hi", "chosen": common + "yes", "rejected": common + "no"}) + "\n"
                    + json.dumps({"prompt": "hi", "chosen": "yes", "rejected": "no"}) + "\n")
    report = _quiet("dpo", [path], tokenizer_dir, tmp_path / "out", seq_len=32)
    assert report.skipped == [f"{path}:1: too long: the replies differ only after what fits in --seq-len 32"]
    assert report.documents["train"] == 1


@pytest.mark.parametrize("kind, source", [("pretrain", "pretrain/en_notes.jsonl"), ("sft", "sft/messages_zh.jsonl")])
def test_a_tokenizer_without_chat_tokens_prepares_and_records_missing_roles(tmp_path, kind, source):
    """A Llama-style tokenizer has no <|im_start|>: its role is recorded as -1 (h5py cannot store None)."""
    llama = FIXTURES / "tokenizers" / "llama"
    prepare(kind, [str(FIXTURES / source)], llama, tmp_path, val_fraction=0.2, workers=1, show_progress=False)
    attrs = read_data_attrs(tmp_path, kind)
    tok = Tokenizer.load(llama)
    assert attrs["im_start_id"] == -1 and attrs["eos_id"] == tok.eos_id and attrs["pad_id"] == tok.pad_id
    assert list(attrs["stop_ids"]) == tok.stop_ids


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--workers", "-3", "--workers must be between 1 and"), ("--workers", "100000", "--workers must be between 1 and"),
    ("--max-record-mb", "nan", "--max-record-mb must be a positive number"),
    ("--seed", "-1", "--seed must be a non-negative integer"),
    ("--seq-len", str(1 << 64), "--seq-len must be between 8 and 16,777,216, got 18446744073709551616")])
def test_out_of_range_options_are_one_line_errors(tokenizer_dir, corpus, tmp_path, monkeypatch, capsys, option, value,
                                                  message):
    code = zerollm_here(monkeypatch, "data", "prepare", "--input", corpus, "--tokenizer", tokenizer_dir, "--out",
                        tmp_path / "out", option, value)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"zerollm: error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


LONE_SURROGATE_RECORDS = {  # the JSON escape \ud800 written literally: valid JSON, text no tokenizer can hold
    "pretrain": ('{"text": "bad \\ud800 x"}', '{"text": "good text"}'),
    "sft": ('{"messages": [{"role": "user", "content": "q\\ud800"}, {"role": "assistant", "content": "a"}]}',
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'),
    "dpo": ('{"prompt": "p\\ud800", "chosen": "c", "rejected": "r"}',
            '{"prompt": "p", "chosen": "c", "rejected": "r"}'),
}
LONE_SURROGATE_REASON = "text is not valid Unicode (a lone surrogate such as \\ud800)"


@pytest.mark.parametrize("kind", LONE_SURROGATE_RECORDS)
def test_a_record_with_a_lone_surrogate_is_skipped_and_reported(tokenizer_dir, tmp_path, kind):
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(LONE_SURROGATE_RECORDS[kind]) + "\n")
    report = _quiet(kind, [path], tokenizer_dir, tmp_path / "out")
    assert report.skipped == [f"{path}:1: {LONE_SURROGATE_REASON}"] and report.documents["train"] == 1


def test_a_lone_surrogate_is_skipped_by_every_reader_of_records(tokenizer_dir, tmp_path):
    """eval --input and grpo prompt files read through the same readers as data prepare."""
    from llm.eval.token_stream import stream_of_files  # noqa: PLC0415 - loads torch
    from llm.train.prompts import read_prompts  # noqa: PLC0415

    array = tmp_path / "array.json"
    array.write_text('[\n{"text": "fine"},\n{"text": "\\udfff"}\n]')
    assert [str(item) for item in read_items(array)][1] == f"{array}:3: {LONE_SURROGATE_REASON}"
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(LONE_SURROGATE_RECORDS["pretrain"]) + "\n")
    assert stream_of_files([str(texts)], Tokenizer.load(tokenizer_dir))[1].skipped == [
        f"{texts}:1: {LONE_SURROGATE_REASON}"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "p\\ud800"}\n{"prompt": "p"}\n')
    assert read_prompts([str(prompts)], lambda messages, tools: [1], 100).skipped == [
        f"{prompts}:1: {LONE_SURROGATE_REASON}"]


def test_a_record_the_tokenizer_library_panics_on_is_skipped_by_eval_and_grpo_prompts(tokenizer_dir, tmp_path):
    """eval --input and grpo's prompt files stopped with the library's PanicException, a traceback."""
    from llm.eval.token_stream import stream_of_files  # noqa: PLC0415 - loads torch
    from llm.train.prompts import read_prompts  # noqa: PLC0415

    tok = Tokenizer.load(regex_that_gives_up(tokenizer_dir, tmp_path / "hostile"))
    reason = ("the tokenizer failed on the text (Onig: Regex search error: retry-limit-in-match over): is its "
              "tokenizer.json from a source you trust?")
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": GIVES_UP_ON}) + "\n" + json.dumps({"text": "fine"}) + "\n")
    stream, report = stream_of_files([str(texts)], tok)
    assert report.skipped == [f"{texts}:1: {reason}"] and report.documents == 1
    assert stream.text_bytes == len("fine")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": GIVES_UP_ON}) + "\n" + json.dumps({"prompt": "p"}) + "\n")
    assert read_prompts([str(prompts)], lambda messages, tools: tok.encode_chat(messages, True), 100).skipped == [
        f"{prompts}:1: {reason}"]


@pytest.mark.parametrize("calls", ["5", '"5"', "true"])
def test_tool_calls_that_are_not_a_list_are_skipped_and_reported(tokenizer_dir, tmp_path, calls):
    path = tmp_path / "sft.jsonl"
    path.write_text(f'{{"messages": [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "a", '
                    f'"tool_calls": {calls}}}]}}\n' + LONE_SURROGATE_RECORDS["sft"][1] + "\n")
    report = _quiet("sft", [path], tokenizer_dir, tmp_path / "out")
    assert len(report.skipped) == 1 and report.skipped[0].startswith(f"{path}:1: 'tool_calls' is ")
    assert report.skipped[0].endswith(", expected a list of tool calls") and report.documents["train"] == 1


# ---- record shapes read alike everywhere ----------------------------------------------------------------------

def _values(path, kind):
    """Each record's text, messages or pair (tool definitions are tested on their own), or its skip line."""
    def plain(value):
        return value.messages if isinstance(value, Chat) else tuple(value[:3]) if isinstance(value, Pair) else value
    return [plain(r.value) if isinstance(r, Item) else str(r) for r in read_records([path], kind)]


def test_a_top_level_system_field_opens_the_conversation_pair_and_prompt(tmp_path):
    """LLaMA-Factory's ShareGPT shape: it was dropped silently."""
    from llm.train.prompts import read_prompts  # noqa: PLC0415 - loads torch

    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "arr"}]
    system = {"role": "system", "content": "You are a pirate."}
    user, reply = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "arr"}
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"system": "You are a pirate.", "conversations": turns},
        {"system": "You are a pirate.", "conversations": [{"from": "system", "value": "Be kind."}, *turns]},
        {"system": "", "messages": [user, reply]},
    ]) + "\n")
    assert _values(path, "sft") == [
        [system, user, reply],
        f"{path}:2: both a 'system' field and a system turn; keep one",
        [user, reply]]
    assert _values(path, "pretrain")[:2] == ["You are a pirate.\nhi\narr",
                                             f"{path}:2: both a 'system' field and a system turn; keep one"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"system": "You are a pirate.", "prompt": "hi", "chosen": "arr", "rejected": "no"})
                     + "\n")
    assert _values(pairs, "dpo") == [([system, user], reply, {"role": "assistant", "content": "no"})]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"system": "You are a pirate.", "prompt": "hi", "answer": "arr"}) + "\n")
    prompt = read_prompts([str(prompts)], lambda messages, tools: [1], 100)[0]
    assert (prompt.messages, prompt.fields) == ([system, user], {"answer": "arr"})


def test_pretraining_flattens_every_conversation_shape_sft_reads(tmp_path):
    """Content parts and "input": null were skipped, Alpaca's system and history dropped."""
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "x"}]},
                      {"role": "assistant", "content": "ok"}]},
        {"instruction": "add 2 and 2", "input": None, "output": "4"},
        {"instruction": "add", "input": "1 and 2", "output": "3", "system": "math", "history": [["2+2?", "4"]]},
    ]) + "\n")
    assert _values(path, "pretrain") == ["parts x\nok", "add 2 and 2\n4", "math\n2+2?\n4\nadd\n1 and 2\n3"]
    assert ["\n".join(m["content"] for m in messages) for messages in _values(path, "sft")] == _values(path,
                                                                                                       "pretrain")


UNKNOWN_ROLE = ("unknown role {}; expected one of system, user, human, assistant, gpt, bot, tool, observation, "
                "function, function_call")


@pytest.mark.parametrize("kind, record, reason", [
    ("sft", {"messages": [{"role": ["user"], "content": "q"}, {"role": "assistant", "content": "a"}]},
     UNKNOWN_ROLE.format("['user']")),
    ("pretrain", {"conversations": [{"from": ["user"], "value": "q"}]}, UNKNOWN_ROLE.format("['user']")),
    ("dpo", {"prompt": [{"role": {"is": "user"}, "content": "q"}], "chosen": "a", "rejected": "b"},
     UNKNOWN_ROLE.format("{'is': 'user'}")),
    ("sft", {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "q"}]},
                          {"role": "assistant", "content": "a"}]},
     "turn 'content' has parts of type ['text']; only text parts can be trained on"),
    ("sft", {"messages": [{"role": "user", "content": [{"text": "q"}]}, {"role": "assistant", "content": "a"}]},
     "turn 'content' has parts of type none (no 'type'); only text parts can be trained on"),  # "of type None"
    ("dpo", {"prompt": "q", "chosen": [], "rejected": "b"},
     "'chosen' is an empty list; expected the reply (a string, turn or list of turns)"),
])
def test_a_role_or_part_type_that_is_not_a_string_is_skipped_with_its_reason(tokenizer_dir, tmp_path, kind, record,
                                                                             reason):
    """A list or object as a role or part type was a TypeError traceback (unhashable)."""
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(record) + "\n" + LONE_SURROGATE_RECORDS[kind][1] + "\n")
    report = _quiet(kind, [path], tokenizer_dir, tmp_path / "out")
    assert report.skipped == [f"{path}:1: {reason}"] and report.documents["train"] == 1


def test_a_role_that_is_not_a_string_is_skipped_from_grpo_prompts(tmp_path):
    from llm.train.prompts import read_prompts  # noqa: PLC0415 - loads torch

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": [{"role": ["user"], "content": "q"}]}\n{"prompt": "fine"}\n')
    assert read_prompts([str(path)], lambda messages, tools: [1], 100).skipped == [
        f"{path}:1: {UNKNOWN_ROLE.format(['user'])}"]


LLAMA = FIXTURES / "tokenizers" / "llama"
ALTERNATE = (f"{LLAMA}: the chat template refused the messages: Conversation roles must alternate "
             "user/assistant/user/assistant/...")


@pytest.mark.parametrize("kind, refused, fine", [
    ("sft", {"messages": [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "ok"}]}, LONE_SURROGATE_RECORDS["sft"][1]),
    ("dpo", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "chosen": "c",
             "rejected": "d"}, LONE_SURROGATE_RECORDS["dpo"][1]),
])
def test_a_record_the_chat_template_refuses_is_skipped_with_its_place(tmp_path, kind, refused, fine):
    """It stopped the whole run with one line naming no record."""
    path = tmp_path / "records.jsonl"
    path.write_text(fine + "\n" + json.dumps(refused) + "\n")
    report = _quiet(kind, [path], LLAMA, tmp_path / "out")
    assert report.skipped == [f"{path}:2: {ALTERNATE}"] and report.documents["train"] == 1
    with pytest.raises(UserError) as stopped:
        _quiet(kind, [path], LLAMA, tmp_path / "strict", strict=True)
    assert str(stopped.value) == f"{path}:2: {ALTERNATE} (--strict stops at the first bad record)"
    assert not (tmp_path / "strict").exists()


def test_a_grpo_prompt_the_chat_template_refuses_is_skipped_with_its_place(tmp_path):
    from llm.train.prompts import read_prompts  # noqa: PLC0415 - loads torch

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}\n'
                    '{"prompt": "fine"}\n')
    tok = Tokenizer.load(LLAMA)
    prompts = read_prompts([str(path)], lambda messages, tools: tok.encode_chat(messages, True), 100)
    assert prompts.skipped == [f"{path}:1: {ALTERNATE}"] and len(prompts) == 1


# ---- the splits, and inputs that change under the run -------------------------------------------------------

@pytest.mark.parametrize("records, documents", [(2, {"train": 1, "val": 1}), (1, {"train": 1, "val": 0})])
def test_the_train_split_always_gets_a_sample(tokenizer_dir, tmp_path, records, documents):
    """Every record drawn for validation left training without a sample (and `train` failed later)."""
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(records)))
    report = _quiet("pretrain", [path], tokenizer_dir, tmp_path / "out", val_fraction=0.99)
    assert report.documents == documents
    tokens, offsets, _ = _tokens(tmp_path / "out")
    assert len(offsets) == 2 and offsets[-1] == len(tokens) == report.tokens["train"]
    assert _documents(tmp_path / "out", tokenizer_dir) == [f"document {records - 1}"]


@pytest.mark.parametrize("change, problem", [("unlink", "No such file or directory"),
                                             ("mkdir", "it is a directory now")])
def test_an_input_gone_while_preparing_is_named_not_the_output(tokenizer_dir, tmp_path, monkeypatch, capsys, change,
                                                               problem):
    """It was `--out OUT: cannot write the output (No such file or directory)`."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (first, second):
        path.write_text('{"text": "some text"}\n')
    monkeypatch.setattr("llm.data.prepare.expand_inputs", changed_after_listing(expand_inputs, second, change))
    code = zerollm_here(monkeypatch, "data", "prepare", "--input", first, second, "--tokenizer", tokenizer_dir,
                        "--out", tmp_path / "out", "--workers", 1)
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zerollm: error: {second}: cannot read ({problem})"
    assert not (tmp_path / "out").exists()


def test_the_summary_groups_reasons_by_their_numbers_but_keeps_escapes():
    """'\\ud800' was shown as '\\udN'."""
    report = Report()
    for note in (f"a.jsonl:1: {LONE_SURROGATE_REASON}", "a.jsonl:2: record of 700 characters",
                 "a.jsonl:3: record of 800 characters"):
        report.note("skipped", note)
    assert f"skipped: 3 records: record of N characters x2; {LONE_SURROGATE_REASON} x1" in report.summary()
    # a pretraining record is a document; training counts windows of data.seq_len tokens as its samples
    assert report.summary().startswith("documents  train ") and Report(seq_len=64).summary().startswith("samples    ")


def test_a_corpus_of_unusable_records_is_reported_in_bounded_memory(tokenizer_dir, tmp_path, monkeypatch):
    """Every skipped and every truncated record was held in memory as a note until the end (millions of them for a
    corpus in the wrong shape); the report names the first NOTES_KEPT of each and counts them all."""
    monkeypatch.setattr(prepare_module, "NOTES_KEPT", 3)
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join('{"txt": "wrong field"}\n' if i % 2 else '{"text": "a fine record"}\n' for i in range(20)))
    report = _quiet("pretrain", [path], tokenizer_dir, tmp_path / "out")
    why = "no text field (keys: txt); expected 'text', 'conversations' or 'instruction'/'output'"
    assert report.skipped == [f"{path}:{line}: {why}" for line in (2, 4, 6)] and report.counts["skipped"] == {why: 10}
    assert "skipped: 10 records" in report.summary(shown=2)
    assert "  ... 1 more in report.json (the first 3 of them)" in report.summary(shown=2)
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(saved["skipped"]) == 3 and saved["counts"]["skipped"] == {why: 10}
    quoting = Report()  # reasons that quote their record (its keys) are as many as the records: counted apart no more
    for line in range(5):
        quoting.note("skipped", f"a.jsonl:{line}: no text field (keys: id_{chr(97 + line)})")
    assert quoting.counts["skipped"] == {**{f"no text field (keys: id_{c})": 1 for c in "abc"}, "other reasons": 2}
    from llm.eval.learning_speed import skipped_in_part  # noqa: PLC0415 - loads torch

    assert skipped_in_part(quoting.skipped, "training", 5).startswith("note: 5 unusable records of the training part")


def test_a_wrongly_typed_field_is_named_in_jsons_words(tmp_path):
    """The reasons named Python's types: 'text' is NoneType (for null), is list, is bool."""
    from llm.data.formats import read_records

    path = tmp_path / "records.jsonl"
    path.write_text('{"text": null}\n{"text": [1]}\n{"text": true}\n{"text": 1.5}\n[{"text": "a"}]\n')
    assert [str(r) for r in read_records([path], "pretrain")] == [
        f"{path}:1: 'text' is null, expected a string", f"{path}:2: 'text' is a list, expected a string",
        f"{path}:3: 'text' is a boolean, expected a string", f"{path}:4: 'text' is a number, expected a string",
        f"{path}:5: record is a list, expected an object or a string"]


def test_an_input_named_in_bytes_that_are_not_utf8_is_prepared_and_its_name_reported(tokenizer_dir, tmp_path):
    """A file whose name is GBK bytes (a zip made on Windows) was tokenized, then writing report.json ended in a
    UnicodeEncodeError traceback and nothing was written. Its name is written as JSON escapes that read back to it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    gbk_named = os.path.join(os.fsencode(corpus), b"\xc4\xe3\xba\xc3.txt")
    with open(gbk_named, "w", encoding="utf-8") as file:
        file.write("Once upon a time there was a story in a file named in GBK.\n" * 20)
    result = run_cli("data", "prepare", "--input", corpus, "--tokenizer", tokenizer_dir, "--out", tmp_path / "out",
                     "--workers", 1)
    assert result.returncode == 0, result.stderr
    written = (tmp_path / "out" / "report.json").read_bytes()
    assert b"\\udcc4\\udce3\\udcba\\udcc3.txt" in written and written.decode("utf-8")
    assert list(json.loads(written)["files"]) == [os.fsdecode(gbk_named)]


def test_a_tokenizer_trained_into_the_corpus_folder_is_not_read_as_data(tmp_path):
    """`tokenizer train --input corpus --out corpus/tok` leaves --out out of its own input, but every later command
    read the tokenizer's three JSON files as records: three skipped records a run, and --strict refused the corpus.
    An export or a Hugging Face model download kept there likewise (its config.json, vocab.json, merges.txt)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(FIXTURES / "pretrain" / "en_notes.jsonl", corpus)
    (corpus / "notes.txt").write_text("A note kept beside the tokenizer is data.\n")
    trained = run_cli("tokenizer", "train", "--input", corpus, "--vocab-size", 300, "--out", corpus / "tok")
    assert trained.returncode == 0, trained.stderr
    shutil.copytree(corpus / "tok", corpus / "export")
    (corpus / "export" / "config.json").write_text('{"model_type": "llama"}')
    (corpus / "export" / "vocab.json").write_text('{"a": 0}')  # a GPT-2 style tokenizer's files beside it
    (corpus / "export" / "merges.txt").write_text("#version: 0.2\na b\n")
    (corpus / "export" / "kept.txt").write_text("Also data.\n")
    result = _prepare(corpus / "tok", tmp_path / "out", corpus, strict=True)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert sorted(report["files"]) == sorted(str(corpus / name) for name in ("en_notes.jsonl", "notes.txt",
                                                                             "export/kept.txt"))


def test_a_table_whose_rows_hold_more_text_than_its_file_is_read_row_by_row_within_max_record_mb(tmp_path):
    """5 KB of Parquet can hold a dictionary column naming one 50 MB string from every row: read out 256 rows at a
    time it took gigabytes, and ended in a MemoryError traceback. A row over --max-record-mb is skipped, as a JSON
    line is; rows are read out one at a time where their batch holds more than it."""
    big = "a " * 600_000  # 1.2 MB
    column = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0, 1, 1], type=pa.int32()), pa.array([big, "short"]))
    nested = pa.array([[{"t": "x" * 300_000}]] * 5)  # text inside lists of structs counts too
    pq.write_table(pa.table({"text": column, "extra": nested}), tmp_path / "bomb.parquet", compression="zstd")
    assert (tmp_path / "bomb.parquet").stat().st_size < 20_000
    read = list(read_items(tmp_path / "bomb.parquet", RecordLimit(1.0, "--max-record-mb")))
    assert [str(r) if isinstance(r, Skipped) else r.value["text"] for r in read] == [
        f"{tmp_path / 'bomb.parquet'}:row {n}: record of 1,500,000 bytes of text is over --max-record-mb 1; raise it"
        if n in (1, 3) else "short" for n in range(1, 6)]
    assert [r.value["text"] for r in read_items(tmp_path / "bomb.parquet", RecordLimit(2.0, "--max-record-mb"))] == [
        big, "short", big, "short", "short"]  # under it, row by row: 5 rows hold more than 2 MB together
    views = pa.table({"text": pa.array(["short", big], pa.string_view())})  # Arrow's Utf8View: counted as 0
    with pa.OSFile(str(tmp_path / "views.arrow"), "wb") as sink, pa.ipc.new_file(sink, views.schema) as writer:
        writer.write_table(views)
    assert [str(r) for r in read_items(tmp_path / "views.arrow", RecordLimit(1.0, "--max-record-mb"))][1] == (
        f"{tmp_path / 'views.arrow'}:row 2: record of 1,200,000 bytes of text is over --max-record-mb 1; raise it")


def test_every_piece_of_a_long_document_goes_to_its_documents_split(tokenizer_dir, tmp_path):
    """Documents longer than a piece are tokenized in pieces: each lands whole in one split (a split drawn per
    piece passed every test)."""
    text = _long_text()
    texts = [f"{i} {text}" for i in range(4)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    report = _quiet("pretrain", [tmp_path / "long.jsonl"], tokenizer_dir, tmp_path / "out", val_fraction=0.5, seed=3)
    assert report.documents["train"] + report.documents["val"] == 4
    tokenizer, found = Tokenizer.load(tokenizer_dir), []
    with h5py.File(tmp_path / "out" / "tokens.h5") as h5:
        for split in ("train", "val"):
            tokens, offsets = h5[split]["tokens"][:], h5[split]["doc_offsets"][:]
            assert len(offsets) - 1 == report.documents[split]
            found += [tokenizer.decode(tokens[a:b - 1].tolist()) for a, b in itertools.pairwise(offsets)]
    assert sorted(found) == sorted(texts)


def test_a_document_longer_than_a_chunk_moved_to_val_stays_one_document(tokenizer_dir, tmp_path):
    """A tiny corpus's last document is moved to val a chunk at a time: it arrives as one document, not one per
    chunk."""
    from llm.data.prepare import CHUNK_TOKENS

    long_text = _long_text() * 2
    (tmp_path / "two.jsonl").write_text(json.dumps({"text": "a short one"}) + "\n" + json.dumps({"text": long_text})
                                        + "\n")
    report = _quiet("pretrain", [tmp_path / "two.jsonl"], tokenizer_dir, tmp_path / "out", val_fraction=0.01)
    assert report.documents == {"train": 1, "val": 1}
    with h5py.File(tmp_path / "out" / "tokens.h5") as h5:
        tokens, offsets = h5["val"]["tokens"][:], h5["val"]["doc_offsets"][:]
    assert len(tokens) > CHUNK_TOKENS  # more than one chunk moved
    assert offsets.tolist() == [0, len(tokens)]
    assert Tokenizer.load(tokenizer_dir).decode(tokens[:-1].tolist()) == long_text


def test_rows_read_one_at_a_time_after_the_first_256_are_the_right_rows(tmp_path):
    """An Arrow batch's rows past the first slice, read one at a time (their slice is over --max-record-mb), are that
    slice's rows: the batch's first ones were read in their place, and no test told."""
    import pyarrow as pa

    big = "b " * 300_000  # 0.6 MB: two put the second slice over 1 MB, each alone under it
    texts = [f"row {i}" for i in range(300)]
    texts[260] = texts[270] = big
    dictionary = list(dict.fromkeys(texts))
    indices = pa.array([dictionary.index(text) for text in texts], type=pa.int32())
    table = pa.table({"text": pa.DictionaryArray.from_arrays(indices, pa.array(dictionary))})  # one batch of 300
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)  # Parquet is read 256 rows a batch; an Arrow file keeps its batches as written
    assert [item.value["text"] for item in read_items(tmp_path / "t.arrow", RecordLimit(1.0))] == texts


def test_the_content_digest_covers_every_chunk_of_an_array(tmp_path, monkeypatch):
    """The data digest reads arrays a chunk at a time; the committed corpora hold less than one chunk, so a digest of
    the first chunk alone (a resume on data edited past it not refused) passed every test."""
    monkeypatch.setattr(prepare_module, "DIGEST_READ", 4)
    path = tmp_path / prepare_module.TOKENS_FILE
    with h5py.File(path, "w") as h5:
        h5.create_dataset("train/tokens", data=np.arange(20, dtype=np.uint16))
    with h5py.File(path, "r") as h5:
        before = prepare_module.content_digest(h5)
    with h5py.File(path, "r+") as h5:
        h5["train/tokens"][17] = 999
    with h5py.File(path, "r") as h5:
        assert prepare_module.content_digest(h5) != before


# ---- input edges a fourth mutation audit found unpinned -------------------------------------------------------------

def test_a_record_one_character_over_max_record_mb_is_skipped_and_one_at_it_is_read(tmp_path):
    at_limit = json.dumps({"text": "x" * (1000 - len('{"text": ""}'))})  # --max-record-mb 0.001: 1,000 characters
    path = tmp_path / "r.jsonl"
    path.write_text(at_limit + "\n" + at_limit.replace('"x', '"xx') + "\n")
    assert [type(item).__name__ for item in read_items(path, RecordLimit(0.001))] == ["Item", "Skipped"]


def test_the_folder_given_as_input_and_as_out_is_refused(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("doc\n")
    with pytest.raises(UserError, match=f"^{corpus}: is inside the output directory {corpus}, which is replaced"):
        expand_inputs([corpus], exclude=corpus)


def test_hidden_files_of_an_input_folder_are_left_out(tmp_path):
    (tmp_path / "a.txt").write_text("doc\n")
    (tmp_path / ".secret.txt").write_text("hidden\n")
    assert [path.name for path in expand_inputs([tmp_path])] == ["a.txt"]


def test_a_json_escape_across_the_read_window_is_read(tmp_path):
    """A \\u00e9 escape that straddles the 64 KiB window in which a .json file is parsed is read whole."""
    start = '[{"text": "'
    path = tmp_path / "r.json"
    path.write_text(start + "a" * (65536 - len(start) - 3) + "\\u00e9" + '"}]')
    (item,) = read_items(path)
    assert item.value["text"] == "a" * (65536 - len(start) - 3) + "é"


def test_a_lone_surrogate_in_a_key_skips_its_record(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "ok", "\\ud800": 1}\n')
    assert [type(item).__name__ for item in read_items(path)] == ["Skipped"]
