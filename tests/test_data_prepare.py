import json

import h5py
import numpy as np
import pytest

from conftest import run_cli, shared
from llm.data.formats import read_items
from llm.data.prepare import prepare
from llm.tokenizer import Tokenizer


def _tokens(out, split="train"):
    with h5py.File(out / "tokens.h5", "r") as h5:
        return h5[split]["tokens"][:], h5[split]["doc_offsets"][:], dict(h5.attrs)


def test_every_shared_pretrain_file_prepares(tokenizer_dir, tmp_path):
    source = shared("pretrain")
    report = prepare("pretrain", [str(source)], tokenizer_dir, tmp_path, val_fraction=0.01, workers=2, show_progress=False)
    files = sorted(p for p in source.rglob("*") if p.suffix in (".txt", ".jsonl", ".json"))
    assert len(files) >= 8 and set(report.files) == {str(p) for p in files}
    assert all(count > 0 for count in report.files.values()), report.files
    assert report.skipped == []
    tok = Tokenizer.load(tokenizer_dir)
    tokens, offsets, attrs = _tokens(tmp_path)
    assert tokens.dtype == np.uint16 and offsets[-1] == len(tokens) == report.tokens["train"]
    assert len(offsets) - 1 == report.documents["train"]
    assert (tokens[offsets[1:] - 1] == tok.eos_id).all()  # end-of-text closes every document
    assert attrs["tokenizer_hash"] == tok.hash and attrs["vocab_size"] == 512 and attrs["kind"] == "pretrain"
    assert report.documents["val"] > 0
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "report.json").read_text())["tokens"] == report.tokens


def test_documents_decode_back_to_their_text_in_order(tokenizer_dir, tmp_path):
    path = shared("pretrain", "fortunes_zh_chinese.jsonl")
    prepare("pretrain", [str(path)], tokenizer_dir, tmp_path, val_fraction=0.0, workers=2, show_progress=False)
    tokens, offsets, _ = _tokens(tmp_path)
    tok = Tokenizer.load(tokenizer_dir)
    texts = [item.value["text"] for item, _ in zip(read_items(path), range(50))]
    decoded = [tok.decode(tokens[offsets[i]:offsets[i + 1] - 1]) for i in range(50)]
    assert decoded == texts


def test_txt_blocks_and_json_arrays_with_line_numbers(tokenizer_dir, tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n\nsecond doc\n")
    (tmp_path / "b.json").write_text('[\n {"text": "one"},\n {"wrong": 1},\n\n {"text": "three"}\n]\n')
    report = prepare("pretrain", [str(tmp_path / "a.txt"), str(tmp_path / "b.json")], tokenizer_dir, tmp_path / "out",
                              val_fraction=0.0, workers=1, show_progress=False)
    assert report.documents["train"] == 4
    assert report.skipped == [f"{tmp_path / 'b.json'}:3: no text field (keys: wrong); expected 'text', 'conversations' or 'instruction'/'output'"]


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
    return {"good": good, "malformed": malformed, "wrong_field": wrong_field, "binary": binary, "empty": empty,
            "unknown": tmp_path / "x.csv", "missing": tmp_path / "missing.jsonl"}


def _prepare(tokenizer_dir, out, *inputs, strict=False):
    extra = ["--strict"] if strict else []
    return run_cli("data", "prepare", "--input", *inputs, "--tokenizer", tokenizer_dir, "--out", out,
                   "--workers", 1, *extra)


def test_malformed_json_line_is_skipped_and_reported_with_file_line(tokenizer_dir, bad_inputs, tmp_path):
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["good"], bad_inputs["malformed"])
    assert result.returncode == 0, result.stderr
    assert f"{bad_inputs['malformed']}:2: malformed JSON" in result.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["documents"]["train"] + report["documents"]["val"] == 22 and len(report["skipped"]) == 1


def test_strict_makes_a_malformed_record_fatal_and_writes_nothing(tokenizer_dir, bad_inputs, tmp_path):
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["good"], bad_inputs["malformed"], strict=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{bad_inputs['malformed']}:2: malformed JSON" in result.stderr
    assert not any((tmp_path / "out").glob("*tokens.h5*"))


def test_wrong_field_is_skipped_with_reason(tokenizer_dir, bad_inputs, tmp_path):
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["wrong_field"])
    assert result.returncode == 0, result.stderr
    assert f"{bad_inputs['wrong_field']}:2: no text field (keys: content)" in result.stdout
    assert f"{bad_inputs['wrong_field']}:3: 'text' is int, expected a string" in result.stdout


@pytest.mark.parametrize("case, message", [
    ("binary", "looks like a binary file"),
    ("empty", "no usable records found"),
    ("missing", "no such file or directory"),
    ("unknown", "unknown format"),
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
    assert not any(out.glob("*tokens.h5*"))


def test_empty_file_beside_good_ones_is_reported(tokenizer_dir, bad_inputs, tmp_path):
    result = _prepare(tokenizer_dir, tmp_path / "out", bad_inputs["good"], bad_inputs["empty"])
    assert result.returncode == 0, result.stderr
    assert f"files with no records: {bad_inputs['empty']}" in result.stdout


def test_tiny_corpus_still_gets_a_validation_document(tokenizer_dir, bad_inputs, tmp_path):
    report = prepare("pretrain", [str(bad_inputs["good"])], tokenizer_dir, tmp_path / "out", val_fraction=0.01,
                              workers=1, show_progress=False)
    assert report.documents == {"train": 19, "val": 1}
