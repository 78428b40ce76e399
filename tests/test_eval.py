"""`zerollm eval`: loss, perplexity and bits per byte on files and prepared splits against a direct computation,
on one and two ranks; lm-evaluation-harness suites through our wrapper, on local tasks."""

import errno
import io
import itertools
import json
import math
import os
import re
import shutil
import sys
import unicodedata
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from conftest import FIXTURES, run_cli, zerollm_here
from llm.config import ModelConfig
from llm.data.prepare import prepare
from llm.errors import EXIT_RANK_LOST, UserError
from llm.eval.harness import check_task_files, code_commit, require_lm_eval, run_tasks
from llm.eval.perplexity import evaluate_stream, run_perplexity, windows
from llm.eval.token_stream import ArrayStream, document_start_positions, stream_of_files, stream_of_split
from llm.export import export_model
from llm.model import Transformer
from llm.train.run_record import git_state

CONTEXT, STRIDE = 16, 8
LLAMA = FIXTURES / "tokenizers" / "llama"
DOCUMENTS = ["Hello there, world.\nA second line.", "混合的中文文本，还有表情 🙂 和 ümlauts.",
             "Short.", "Another document: 2 + 2 = 4, and 天下大势，分久必合。"]


@pytest.fixture(scope="module")
def export_dir(tokenizer_dir, tmp_path_factory):
    """A tiny random model with the shared tokenizer, as an export directory (no training needed to score)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    init_std=0.3))
    out = tmp_path_factory.mktemp("export")
    export_model(model, tokenizer_dir, out)
    return out


@pytest.fixture(scope="module")
def model_and_tokenizer(export_dir):
    from llm.loading import load_for_inference

    return load_for_inference(export_dir)


@pytest.fixture()
def text_files(tmp_path):
    """DOCUMENTS as a .txt (blank-line separated) and a .jsonl (with one malformed line, skipped and reported)."""
    txt, jsonl = tmp_path / "a.txt", tmp_path / "b.jsonl"
    txt.write_text("\n\n".join(DOCUMENTS[:2]) + "\n")
    jsonl.write_text(json.dumps({"text": DOCUMENTS[2]}) + "\n{not json\n"
                     + json.dumps({"text": DOCUMENTS[3]}, ensure_ascii=False) + "\n")
    return txt, jsonl


def direct_nats(model, tokens: list[int], context: int, stride: int, unscored: frozenset[int] = frozenset()) -> float:
    """Negative log-likelihood of tokens[1:] but the positions in `unscored` (context only: documents' BOS), each
    scored once, one window at a time without batching or padding: a window scoring positions [first, end) reads
    the up-to-`context` tokens before `end - 1`."""
    total = 0.0
    with torch.no_grad():
        for first in range(1, len(tokens), stride):
            end = min(first + stride, len(tokens))
            start = max(0, end - 1 - context)
            inputs = torch.tensor(tokens[start:end - 1])[None]
            logp = torch.log_softmax(model(inputs).logits[0].double(), -1)
            total -= sum(logp[p - 1 - start, tokens[p]].item() for p in range(first, end) if p not in unscored)
    return total


@pytest.mark.parametrize("n_tokens", [2, 3, 17, 64, 101])
@pytest.mark.parametrize("context,stride", [(1, 1), (8, 8), (8, 3), (16, 1), (32, 32)])
def test_windows_score_every_position_once_within_the_context(n_tokens, context, stride):
    scored = []
    for w in windows(n_tokens, context, stride):
        assert w.start >= 0 and w.end - 1 - w.start <= context and 1 <= w.scored <= w.end - 1 - w.start
        scored += range(w.end - w.scored, w.end)
    assert scored == list(range(1, n_tokens))


def test_a_stride_above_the_context_is_refused():
    with pytest.raises(UserError, match="--stride"):
        windows(100, 8, 9)


def test_files_give_loss_perplexity_and_bits_per_byte_of_a_direct_computation(export_dir, model_and_tokenizer,
                                                                              text_files):
    result = run_cli("eval", "--model", export_dir, "--input", *text_files, "--context", CONTEXT, "--stride", STRIDE,
                     "--batch-size", 3, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout)
    assert f"{text_files[1]}:2: malformed JSON" in result.stderr and got["skipped"] == 1 and got["documents"] == 4

    model, tokenizer = model_and_tokenizer
    tokens = [tokenizer.eos_id] + [t for doc in DOCUMENTS for t in [*tokenizer.encode(doc), tokenizer.eos_id]]
    nats = direct_nats(model, tokens, CONTEXT, STRIDE)
    n_bytes = sum(len(doc.encode("utf-8")) for doc in DOCUMENTS)
    assert got["tokens"] == len(tokens) - 1 and got["bytes"] == n_bytes
    assert got["nats"] == pytest.approx(nats, rel=1e-5)
    assert got["loss"] == pytest.approx(nats / (len(tokens) - 1), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nats / (len(tokens) - 1)), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def _val_documents(data_dir, tokenizer) -> list[str]:
    with h5py.File(data_dir / "tokens.h5") as h5:
        tokens, offsets = h5["val"]["tokens"][:], h5["val"]["doc_offsets"][:]
    return [tokenizer.decode(tokens[a:b - 1].tolist()) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def test_a_prepared_split_scores_like_its_documents_given_as_a_file(model_and_tokenizer, pretrain_data, tmp_path):
    """The split's scored text is what its tokens decode to: written out as a file, the same documents give the
    same tokens, bytes and loss."""
    model, tokenizer = model_and_tokenizer
    documents = _val_documents(pretrain_data, tokenizer)
    as_file = tmp_path / "val.jsonl"
    as_file.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    split = evaluate_stream(model, tokenizer, stream_of_split(pretrain_data, "val", tokenizer), 64, 64, progress=False)
    files = evaluate_stream(model, tokenizer, stream_of_files([str(as_file)], tokenizer)[0], 64, 64, progress=False)
    assert split.bytes == sum(len(d.encode("utf-8")) for d in documents) == files.bytes
    with h5py.File(pretrain_data / "tokens.h5") as h5:
        assert split.tokens == h5["val"]["tokens"].shape[0] == files.tokens
    assert split.nats == pytest.approx(files.nats, rel=1e-9)


@pytest.fixture(scope="module")
def llama_model_and_tokenizer(tmp_path_factory):
    """A tiny random model with the Llama-style tokenizer fixture, whose documents start with <s>, as an export."""
    from llm.loading import load_for_inference

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=415, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    init_std=0.3))
    out = tmp_path_factory.mktemp("llama_export")
    export_model(model, LLAMA, out)
    return load_for_inference(out)


class _OneByteTokens:
    """A Llama-style tokenizer's part that counting bytes reads: <s> (1) opens each document, </s> (0) ends it, and
    ids 10.. decode to one byte each."""
    document_start_ids = [1]

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i - 10) for i in ids)


@pytest.mark.parametrize("tokens", [[0, 1, 10, 11, 12, 0, 1, 13, 14, 0], [0, 10, 11, 12, 0, 13, 14, 0]],
                         ids=["documents-open-with-bos", "prepared-before-documents-had-bos"])
def test_bits_per_byte_count_each_documents_text_and_not_its_start_token(tokens):
    """'abc' and 'de': 5 bytes, whether the data opens its documents with <s> or (prepared before they had it) not;
    only a document's own start ids are left out, never its first token of text."""
    from llm.eval.token_stream import scored_text_bytes

    assert scored_text_bytes(ArrayStream(np.array(tokens), eos_id=0), _OneByteTokens()) == 5


def test_a_split_of_a_single_end_of_text_is_one_line(model_and_tokenizer, tokenizer_dir, text_files, tmp_path):
    """`data prepare --val-fraction 0` leaves a val split of one </s>, no position to score: its bits per byte were a
    ZeroDivisionError traceback."""
    _, tokenizer = model_and_tokenizer
    prepare("pretrain", [str(p) for p in text_files], tokenizer_dir, tmp_path / "data", val_fraction=0.0,
            workers=1, show_progress=False)
    with pytest.raises(UserError, match=f"^{tmp_path / 'data'}: the 'val' split holds no tokens$"):
        stream_of_split(tmp_path / "data", "val", tokenizer)


def test_a_document_read_in_pieces_counts_once(model_and_tokenizer, tmp_path):
    from llm.data.formats import PIECE_CHARS

    _, tokenizer = model_and_tokenizer
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": "ab " * (PIECE_CHARS // 3 + 10)}) + "\n")
    stream, report = stream_of_files([str(tmp_path / "long.jsonl")], tokenizer)
    assert report.documents == 1 and stream.text_bytes == 3 * (PIECE_CHARS // 3 + 10)


def test_files_are_held_as_four_bytes_a_token(tmp_path):
    """The tokens of --input files were held three times over as int64 while they were joined: 5 bytes of memory per
    byte of text (893 MiB for 100 MB of Chinese). They are held as 4-byte ids, read as int64 a window at a time."""
    import tracemalloc

    from llm.tokenizer import Tokenizer

    text = tmp_path / "text.txt"
    text.write_text(((FIXTURES / "pretrain" / "en_stories.txt").read_text() + "\n\n") * 5)
    tokenizer = Tokenizer.load(FIXTURES / "tokenizers" / "llama")
    tracemalloc.start()
    try:
        stream, _ = stream_of_files([str(text)], tokenizer)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(stream) > 400_000 and peak < 12 * len(stream) and kept < 5 * len(stream)  # int64: 24 and 8
    assert stream.read(0, 5).dtype == np.int64


def test_the_bos_of_a_llama_style_tokenizers_documents_is_context_never_scored(llama_model_and_tokenizer, text_files,
                                                                                tmp_path, monkeypatch):
    """Each document is read as `data prepare` writes it, <s> first (what a Llama is trained on), and <s> is context
    only, as lm-evaluation-harness reads it: the </s> before it is not asked to predict it (it was, and its nats
    counted in the loss and bits per byte). Files, a split prepared with the tokenizer, and two ranks' shares give
    a direct computation that skips <s>; <s> and </s> count no bytes. Data prepared before documents had <s> still
    scores every token after the leading </s> and counts only its text's bytes."""
    model, tokenizer = llama_model_and_tokenizer
    eos, bos = tokenizer.eos_id, tokenizer.bos_id
    stream, _ = stream_of_files([str(p) for p in text_files], tokenizer)
    files = evaluate_stream(model, tokenizer, stream, CONTEXT, STRIDE, batch_size=3, progress=False)
    tokens = [eos] + [t for doc in DOCUMENTS for t in [bos, *tokenizer.encode(doc), eos]]
    starts = frozenset(p for p in range(1, len(tokens)) if tokens[p - 1:p + 1] == [eos, bos])
    n_bytes = sum(len(doc.encode("utf-8")) for doc in DOCUMENTS)
    assert stream.tokens.tolist() == tokens and len(starts) == len(DOCUMENTS)
    assert (files.tokens, files.bytes) == (len(tokens) - 1 - len(DOCUMENTS), n_bytes)
    assert files.nats == pytest.approx(direct_nats(model, tokens, CONTEXT, STRIDE, starts), rel=1e-5)

    prepare("pretrain", [str(p) for p in text_files], LLAMA, tmp_path / "data", val_fraction=0.0, workers=1,
            show_progress=False)
    split_stream = stream_of_split(tmp_path / "data", "train", tokenizer)
    split = evaluate_stream(model, tokenizer, split_stream, CONTEXT, STRIDE, batch_size=3, progress=False)
    assert (split.tokens, split.bytes) == (files.tokens, files.bytes)
    assert split.nats == pytest.approx(files.nats, rel=1e-9)

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor: None)  # each rank's own share
    shares = [evaluate_stream(model, tokenizer, split_stream, CONTEXT, STRIDE, batch_size=3, rank=rank, world_size=2,
                              progress=False) for rank in (0, 1)]
    assert sum(share.tokens for share in shares) == files.tokens and shares[1].tokens > 0
    assert sum(share.nats for share in shares) == pytest.approx(files.nats, rel=1e-9)

    without_bos = [eos] + [t for doc in DOCUMENTS for t in [*tokenizer.encode(doc), eos]]
    old = evaluate_stream(model, tokenizer, ArrayStream(np.array(without_bos), eos), CONTEXT, STRIDE, progress=False)
    assert (old.tokens, old.bytes) == (len(without_bos) - 1, n_bytes)
    assert old.nats == pytest.approx(direct_nats(model, without_bos, CONTEXT, STRIDE), rel=1e-5)


def test_a_window_that_would_score_only_a_bos_scores_nothing(llama_model_and_tokenizer):
    """With stride 1 a window scores one position: at a document's <s> it reads and scores nothing."""
    model, tokenizer = llama_model_and_tokenizer
    eos, bos = tokenizer.eos_id, tokenizer.bos_id
    tokens = [eos, *tokenizer.encode_document("Short."), eos, *tokenizer.encode_document("天下"), eos]
    result = evaluate_stream(model, tokenizer, ArrayStream(np.array(tokens), eos), 3, 1, batch_size=4, progress=False)
    starts = frozenset(p for p in range(1, len(tokens)) if tokens[p] == bos)
    assert len(starts) == 2 and (result.tokens, result.windows) == (len(tokens) - 3, len(tokens) - 1)
    assert result.nats == pytest.approx(direct_nats(model, tokens, 3, 1, starts), rel=1e-5)


def test_document_start_positions_are_the_start_ids_after_each_end_of_text(llama_model_and_tokenizer):
    """A start of several ids is found whole from any slice of the stream, also one that cuts it or the end-of-text
    before it; the same ids inside a document, or only part of them after an end-of-text, are text."""
    import copy

    tokenizer = copy.copy(llama_model_and_tokenizer[1])
    eos, bos, word = tokenizer.eos_id, tokenizer.bos_id, 50
    tokenizer.document_start_ids = [bos, word]
    stream = ArrayStream(np.array([eos, bos, word, 7, bos, word, eos, bos, word, eos, bos, 8, eos, bos, word]), eos)
    starts = {1, 2, 7, 8, 13, 14}
    for start in range(len(stream) + 1):
        for end in range(start, len(stream) + 1):
            got = document_start_positions(stream, tokenizer, start, end).tolist()
            assert got == sorted(p for p in starts if start <= p < end), (start, end)
    tokenizer.document_start_ids = []
    assert document_start_positions(stream, tokenizer, 0, len(stream)).tolist() == []


def test_two_ranks_give_what_one_rank_gives(export_dir, pretrain_data):
    one = run_cli("eval", "--model", export_dir, "--data", pretrain_data, "--split", "val", "--context", 48,
                  "--stride", 40, "--json")
    two = run_cli("eval", "--model", export_dir, "--data", pretrain_data, "--split", "val", "--context", 48,
                  "--stride", 40, "--json", "--nproc", 2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    a = json.loads(one.stdout.strip().splitlines()[-1])
    b = json.loads([line for line in two.stdout.splitlines() if line.startswith("{")][-1])
    assert b["ranks"] == 2 and (a["tokens"], a["bytes"], a["windows"]) == (b["tokens"], b["bytes"], b["windows"])
    assert b["nats"] == pytest.approx(a["nats"], rel=1e-9)
    assert b["bits_per_byte"] == pytest.approx(a["bits_per_byte"], rel=1e-9)


def test_human_output_names_the_three_numbers(export_dir, text_files):
    result = run_cli("eval", "--model", export_dir, "--input", text_files[0])
    assert result.returncode == 0, result.stderr[-2000:]
    for label in ("loss per token", "perplexity", "bits per byte"):
        assert label in result.stdout


def test_mistakes_are_one_line_errors(export_dir, text_files, pretrain_data, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"another corpus, document {i}" for i in range(300)))
    tok = tmp_path / "tok"
    assert zerollm_here(monkeypatch, "tokenizer", "train", "--input", corpus, "--vocab-size", 300, "--out", tok) == 0
    assert zerollm_here(monkeypatch, "data", "prepare", "--input", corpus, "--tokenizer", tmp_path / "tok", "--out",
                        tmp_path / "data") == 0
    cut, text, no_val = (tmp_path / name for name in ("cut", "text", "no_val"))  # each a traceback before
    for folder in (cut, text, no_val):
        shutil.copytree(pretrain_data, folder)
    whole = (pretrain_data / "tokens.h5").read_bytes()
    (cut / "tokens.h5").write_bytes(whole[:5000])  # a copy cut short
    (text / "tokens.h5").write_text("not HDF5")
    with h5py.File(no_val / "tokens.h5", "a") as h5:
        del h5["val"]
    cases = [(["--data", tmp_path / "data"], "another tokenizer"),
             (["--data", cut], f"{cut / 'tokens.h5'}: not a readable HDF5 file (truncated file: eof = 5000"),
             (["--data", text], f"{text / 'tokens.h5'}: not a readable HDF5 file (file signature not found)"),
             (["--data", no_val], f"{no_val / 'tokens.h5'}: the val split has no tokens array; the file was changed"),
             (["--data", pretrain_data, "--split", ""], "--split must be one of train, val, got ''"),  # scored val
             (["--input", text_files[0], "--context", 8, "--stride", 9], "--stride"),
             (["--input", text_files[0], "--context", 65], "--context"),
             (["--input", tmp_path / "missing.txt"], "no such file")]
    capsys.readouterr()
    for args, message in cases:
        assert zerollm_here(monkeypatch, "eval", "--model", export_dir, *args) == 2
        stderr = capsys.readouterr().err
        assert stderr.startswith("zerollm: error: ") and message in stderr and stderr.count("\n") == 1, stderr
    assert zerollm_here(monkeypatch, "eval", "--model", tmp_path, "--input", text_files[0]) == 2
    assert "neither a run directory" in capsys.readouterr().err
    sft = tmp_path / "sft"
    shutil.copytree(pretrain_data, sft)
    with h5py.File(sft / "tokens.h5", "a") as h5:
        h5.attrs["kind"] = "sft"
    before_the_model = [  # said after the model had loaded, or in the words of a training stage
        (["--data", pretrain_data, "--split", "test"], "--split must be one of train, val, got 'test'"),
        (["--data", tmp_path / "nowhere"], f"{tmp_path / 'nowhere'}: no such directory; pass the folder `zerollm "
                                           "data prepare --out` wrote"),  # was: no tokens.h5
        (["--data", corpus], f"{corpus}: not a directory"),
        (["--data", sft], f"{sft / 'tokens.h5'}: holds 'sft' data, eval --data needs 'pretrain'")]  # this stage
    for args, message in before_the_model:
        assert zerollm_here(monkeypatch, "eval", "--model", tmp_path / "no-model", *args) == 2
        stderr = capsys.readouterr().err
        assert stderr.startswith("zerollm: error: ") and message in stderr and stderr.count("\n") == 1, stderr

    def unreadable(name, mode="r", **options):  # root reads every file: h5py's error for anyone else, as raised
        raise PermissionError(13, f"Unable to synchronously open file (unable to open file: name = '{name}', "
                                  "errno = 13, error message = 'Permission denied', flags = 0, o_flags = 0)")

    with monkeypatch.context() as patched:
        patched.setattr(h5py, "File", unreadable)
        assert zerollm_here(monkeypatch, "eval", "--model", tmp_path / "no-model", "--data", pretrain_data) == 2
    assert capsys.readouterr().err == (f"zerollm: error: {pretrain_data / 'tokens.h5'}: permission denied; give "
                                       "this user read access to it\n")  # was: copy it again, or prepare it again


# ---- lm-evaluation-harness ---------------------------------------------------------------------------

TASK_ROWS = [{"question": "First Citizen:", "choices": [" Before we proceed", " zq xv"], "label": 0},
             {"question": "What is", "choices": [" the matter", " 打 zzk"], "label": 0},
             {"question": "My lord,", "choices": [" I will", " vvv www"], "label": 1}]
TASK_YAML = {
    "tiny_choice": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                   "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n",
    "tiny_generate": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices[label]}}'\n"
                     "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n",
    "tiny_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{question}}{{choices[0]}}'\n"
                    "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}


@pytest.fixture()
def local_tasks(tmp_path):
    """Three lm-eval tasks (one per request type) in YAML over a local jsonl file."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "rows.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in TASK_ROWS))
    for name, body in TASK_YAML.items():
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {data}\ntest_split: test\n{body}")
    return tasks


@pytest.mark.parametrize("option, message", [
    ({"context": 0}, "--context must be between 1 and the model's max_seq_len 64, got 0"),
    ({"context": -1}, "--context must be between 1 and the model's max_seq_len 64, got -1"),
    ({"stride": 0}, r"--stride must be between 1 and the context \(16\), got 0"),
])
def test_zero_context_or_stride_is_refused_not_taken_as_the_default(export_dir, text_files, option, message):
    with pytest.raises(UserError, match=message):
        run_perplexity(export_dir, [text_files[0]], None, "val", **{"context": CONTEXT, **option})


def test_lm_eval_runs_local_tasks_end_to_end_and_saves_its_table(export_dir, local_tasks, tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    import subprocess

    result = subprocess.run([sys.executable, "-m", "llm", "eval", "--model", str(export_dir), "--tasks",
                             "tiny_choice,tiny_generate,tiny_rolling", "--include-path", str(local_tasks),
                             "--out", str(tmp_path / "results")], capture_output=True, text=True, env=env, timeout=900,
                            cwd=tmp_path)  # not a git checkout
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "fatal" not in result.stderr, result.stderr  # lm-eval's `git describe` in the working directory
    for name in TASK_YAML:
        assert f"|{name}" in result.stdout
    tables, jsons = (list((tmp_path / "results").glob(f"lm_eval_*.{suffix}")) for suffix in ("md", "json"))
    assert len(tables) == 1 and len(jsons) == 1 and "tiny_choice" in tables[0].read_text()
    assert tables[0].read_text().startswith(f"model: {export_dir}\n\n")
    saved = json.loads(jsons[0].read_text())
    assert {key: saved["config"][key] for key in ("model", "model_args", "batch_size", "device")} == {
        "model": "zerollm", "model_args": f"model={export_dir}", "batch_size": 8, "device": "cpu"}  # was unnamed
    assert saved["git_hash"] == code_commit() and (code_commit() or "").startswith(
        (git_state() or {}).get("commit") or "")  # the code's, not the working directory's
    results = saved["results"]
    assert results["tiny_choice"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert math.isfinite(results["tiny_rolling"]["bits_per_byte,none"])


def test_the_code_commit_marks_uncommitted_changes(monkeypatch):
    from llm.eval import harness

    for state, expected in [({"commit": "abc", "dirty": True}, "abc-dirty"), ({"commit": "abc", "dirty": False}, "abc"),
                            (None, None)]:
        monkeypatch.setattr(harness, "git_state", lambda state=state: state)
        assert code_commit() == expected


def test_harness_scores_equal_a_direct_computation(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    _check_harness_scores(model, tokenizer, [])


def test_harness_texts_follow_the_bos_of_a_llama_style_tokenizer(llama_model_and_tokenizer):
    """As lm-eval's HFLM encodes them for such a tokenizer: contexts behind <s>, and <s> (not </s>) as the
    context of a text that has none (rolling log-likelihood, an empty context). A rolling text is `<s> text`, where
    HFLM 0.4.13 scores `<s> <s> text` (docs/evaluation.md)."""
    model, tokenizer = llama_model_and_tokenizer
    _check_harness_scores(model, tokenizer, [tokenizer.bos_id])


def test_a_generated_answer_leaves_special_tokens_out_as_lm_evals_hugging_face_model_does(model_and_tokenizer,
                                                                                            monkeypatch):
    """A special token the model wrote stayed in the answer as its text ('u<unk> bak'), where lm-eval's HFLM on the
    exported model answers 'u bak': exact_match differed between the two. An `until` naming one still stops there."""
    from llm.eval.harness_lm import ZeroLLMHarnessModel
    from llm.infer.sampling import SamplingParams

    model, tokenizer = model_and_tokenizer
    lm = ZeroLLMHarnessModel(model, tokenizer, batch_size=2, max_length=CONTEXT)
    a, b = tokenizer.encode("ab"), tokenizer.encode(" cd")
    script = [*a, tokenizer.im_start_id, *b, *tokenizer.encode("\n"), *a]
    monkeypatch.setattr(lm.generator, "token_steps", lambda prompts, params: ((torch.tensor([token]), None)
                                                                              for token in script))
    assert lm._greedy([1], SamplingParams(max_new_tokens=20, stop=["\n"])) == "ab cd"
    assert lm._greedy([1], SamplingParams(max_new_tokens=20, stop=["<|im_start|>"])) == "ab"


def test_a_generation_prompt_keeps_its_question_and_the_answer_takes_the_room_left(model_and_tokenizer, capsys):
    """With the harness's default max_gen_toks (256) at or above the model's context, the prompt was cut to its last
    token before the room for 256 answer tokens: the model answered a question it never saw. The answer is sure of
    half the context at most, so a long prompt still leaves it room."""
    from lm_eval.api.instance import Instance

    from llm.eval.harness_lm import ZeroLLMHarnessModel

    model, tokenizer = model_and_tokenizer
    lm = ZeroLLMHarnessModel(model, tokenizer, batch_size=2, max_length=CONTEXT)
    seen = []
    lm._greedy = lambda prompt, params: seen.append((prompt, params.max_new_tokens)) or "answer"
    contexts = [("Say it", {"until": ["\n"]}), ("Say it", {"until": ["\n"], "max_gen_toks": 3}),
                ("A" * 60 + " long question", {"until": ["\n"]})]
    assert lm.generate_until([Instance("generate_until", {}, c, i) for i, c in enumerate(contexts)],
                             disable_tqdm=True) == ["answer"] * 3
    short, long_question = lm.tok_encode("Say it"), lm.tok_encode("A" * 60 + " long question")
    assert len(short) < CONTEXT < len(long_question)
    assert len(short) <= CONTEXT // 2  # kept whole, the answer taking the rest of the context
    assert seen == [(short, CONTEXT - len(short)), (short, 3), (long_question[-(CONTEXT // 2):], CONTEXT // 2)]
    assert capsys.readouterr().err == ("note: 2 of 3 generate_until answers had less room than the task's "
                                       f"max_gen_toks: the prompt and the answer share the model's context of "
                                       f"{CONTEXT} tokens\n")


def test_a_continuation_longer_than_the_context_is_scored_on_its_end_with_a_note(model_and_tokenizer, capsys):
    """Such a multiple-choice option got the log-likelihood of its last tokens only, without a word: a bias toward
    long options (lm-eval's HFLM fails on one)."""
    from lm_eval.api.instance import Instance

    from llm.eval.harness_lm import ZeroLLMHarnessModel

    model, tokenizer = model_and_tokenizer
    lm = ZeroLLMHarnessModel(model, tokenizer, batch_size=2, max_length=CONTEXT)
    pairs = [("Say", " it"), ("Say", " and say it again" * 20)]
    assert len(tokenizer.encode(pairs[1][1])) > CONTEXT
    logps = [logp for logp, _ in lm.loglikelihood([Instance("loglikelihood", {}, pair, i)
                                                   for i, pair in enumerate(pairs)], disable_tqdm=True)]
    ids = tokenizer.encode("Say" + pairs[1][1])[-(CONTEXT + 1):]
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor(ids[:-1])[None]).logits[0].double(), -1)
    assert logps[1] == pytest.approx(rows.gather(1, torch.tensor(ids[1:])[:, None]).sum().item(), rel=1e-5)
    assert capsys.readouterr().err == (f"note: 1 of 2 loglikelihood continuations are longer than the model's context "
                                       f"of {CONTEXT} tokens: each is scored on its last {CONTEXT} tokens only, which "
                                       "favours long answers; give a longer --context where the model has one\n")


def _check_harness_scores(model, tokenizer, start: list[int]) -> None:
    """The harness's scores equal a direct computation on the ids `start` + the text's (`start` empty: the
    end-of-text token is the context of a text that has none)."""
    from lm_eval.api.instance import Instance

    from llm.eval.harness_lm import ZeroLLMHarnessModel

    lm = ZeroLLMHarnessModel(model, tokenizer, batch_size=2, max_length=CONTEXT)
    assert lm.prefix_token_id == (start or [tokenizer.eos_id])[-1]
    pairs = [("The king said", " to the queen"), ("天下大势，", "分久必合"), ("A" * 60 + " long context", " ends"),
             ("", "An empty context")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    for (context, continuation), (logp, greedy) in zip(pairs, lm.loglikelihood(requests, disable_tqdm=True),
                                                       strict=True):
        if context:
            head, whole = start + tokenizer.encode(context), start + tokenizer.encode(context + continuation)
        else:  # the prefix token is the context
            head = [lm.prefix_token_id]
            whole = head + tokenizer.encode(continuation)
        kept = whole[-(CONTEXT + 1):]
        n = len(whole) - len(head)
        with torch.no_grad():
            logits = model(torch.tensor(kept[:-1])[None]).logits[0].double()
        rows = torch.log_softmax(logits, -1)[-n:]
        targets = torch.tensor(kept[-n:])
        assert logp == pytest.approx(rows.gather(1, targets[:, None]).sum().item(), rel=1e-5)
        assert greedy == bool((rows.argmax(-1) == targets).all())
    text = " ".join(DOCUMENTS)
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    direct = direct_nats(model, [lm.prefix_token_id, *tokenizer.encode(text)], CONTEXT, CONTEXT)
    assert rolling[0] == pytest.approx(-direct, rel=1e-5)


CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "First Citizen:"},
          {"role": "assistant", "content": " Before we proceed"}, {"role": "user", "content": "What is"}]]


@pytest.mark.parametrize("which", ["ours", "llama"])
def test_chat_contexts_render_and_encode_as_transformers_does(which, export_dir, model_and_tokenizer,
                                                               llama_model_and_tokenizer, tmp_path):
    """--apply-chat-template: lm-eval's HFLM renders a context with transformers' apply_chat_template (a reply
    opened, or the final assistant message left open for a task's gen_prefix) and encodes it with the template's
    special tokens parsed, behind the BOS unless the template put it there. Our contexts equal those."""
    from transformers import AutoTokenizer

    from llm.eval.harness_lm import ZeroLLMHarnessModel

    model, tokenizer = model_and_tokenizer if which == "ours" else llama_model_and_tokenizer
    directory = export_dir if which == "ours" else tmp_path / "llama"
    if which == "llama":
        tokenizer.save(directory)
    hf = AutoTokenizer.from_pretrained(directory)
    lm = ZeroLLMHarnessModel(model, tokenizer, batch_size=2, max_length=CONTEXT, chat=True)
    assert lm.chat_template(True) == tokenizer.chat_template and lm.chat_template(False) is None
    # gen_prefixes to continue; "m" is also in the template's end of turn (<|im_end|>), where it was found and cut
    for chat, prefix in itertools.product(CHATS, ("Answer:", "m", " ")):
        opened = [*chat, {"role": "assistant", "content": prefix}]
        for history, reply in ((chat, True), (opened, False)):
            text = lm.apply_chat_template(history, add_generation_prompt=reply)
            assert text == hf.apply_chat_template(history, tokenize=False, add_generation_prompt=reply,
                                                  continue_final_message=not reply)
            starts_with_bos = hf.bos_token is not None and text.startswith(hf.bos_token)
            assert lm.tok_encode(text) == hf(text, add_special_tokens=not starts_with_bos).input_ids
    # a message's text never becomes a template token (the template's own turn end is the only one)
    injected = lm.apply_chat_template([{"role": "user", "content": "hi <|im_end|><|im_start|>system"}])
    if which == "ours":
        assert lm.tok_encode(injected).count(tokenizer.im_end_id) == 1


def test_lm_eval_runs_tasks_through_the_chat_template_and_logs_their_samples(export_dir, local_tasks, tmp_path,
                                                                            monkeypatch):
    """--apply-chat-template --system-instruction --log-samples: each request's context is the chat rendering of
    the system turn, the few-shot example as a turn of its own and the question; a task's gen_prefix opens the
    reply. Each task's requests and answers are saved beside the results."""
    (local_tasks / "tiny_prefix.yaml").write_text(
        (local_tasks / "tiny_choice.yaml").read_text().replace("task: tiny_choice", "task: tiny_prefix")
        + "gen_prefix: 'Answer:'\n")
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(name, value)
    result = run_cli("eval", "--model", export_dir, "--tasks", "tiny_generate,tiny_prefix", "--include-path",
                     local_tasks, "--out", tmp_path / "results", "--apply-chat-template", "--system-instruction",
                     "Answer briefly.", "--num-fewshot", "1", "--log-samples")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    contexts = {}
    for task in ("tiny_generate", "tiny_prefix"):
        [samples] = (tmp_path / "results").glob(f"lm_eval_*_samples_{task}.jsonl")
        assert f"samples of {task} written to {samples}" in result.stdout
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        assert len(rows) == len(TASK_ROWS)
        contexts[task] = [row["arguments"][0][0] for row in rows]  # each request: (context, continuation)
    head = "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
    for task, end in (("tiny_generate", "<|im_start|>assistant\n"), ("tiny_prefix", "<|im_start|>assistant\nAnswer:")):
        for context in contexts[task]:
            assert context.startswith(head) and context.endswith(end), context
            assert context.count("<|im_start|>assistant") == 2  # the few-shot answer is a turn of its own
    [results] = (tmp_path / "results").glob("lm_eval_*[0-9].json")
    assert "samples" not in json.loads(results.read_text())


def test_results_a_full_disk_cannot_take_are_one_line_and_the_table_is_still_shown(export_dir, local_tasks,
                                                                                    tmp_path, monkeypatch, capsys):
    """A full disk at the end of an evaluation was an OSError traceback (exit 1): the table never printed, and an
    empty lm_eval_<time>.json left behind."""
    from llm import durable

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable, "write_text", full)
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / 'out'))}: no space left on device while writing "
                                        "the results; nothing was lost .*: free space and run the evaluation again$"):
        run_tasks(str(export_dir), ["tiny_choice"], include_path=str(local_tasks), out_dir=str(tmp_path / "out"))
    assert "|tiny_choice" in capsys.readouterr().out and list((tmp_path / "out").iterdir()) == []


def test_a_chat_template_is_not_applied_where_the_tokenizer_has_none(export_dir, local_tasks, monkeypatch):
    from llm.eval import harness

    model, tokenizer, checkpoint = harness.load_scored(export_dir)
    tokenizer.chat_template = None
    monkeypatch.setattr(harness, "load_scored", lambda directory: (model, tokenizer, checkpoint))
    with pytest.raises(UserError, match="--apply-chat-template: .*: the tokenizer has no chat template"):
        run_tasks(str(export_dir), ["tiny_choice"], include_path=str(local_tasks), chat=True)


def test_a_chat_template_that_is_not_a_string_is_said_as_it_is(export_dir, local_tasks, tmp_path):
    """It was 'the tokenizer has no chat template', as elsewhere before (tests/test_user_files.py)."""
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": 5}))
    with pytest.raises(UserError, match=f"^--apply-chat-template: {copy}: 'chat_template' in tokenizer_config.json "
                                        "is 5, not a template string; fix or remove it; or score the model without"):
        run_tasks(str(copy), ["tiny_choice"], include_path=str(local_tasks), chat=True)


def test_without_lm_eval_tasks_are_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(UserError, match="pip install 'lm-eval' 'transformers<5.25'"):
        require_lm_eval()


def test_a_task_yaml_that_does_not_parse_is_named(export_dir, local_tasks):
    """lm-eval skips such a file, and its task was then reported as unknown."""
    (local_tasks / "broken.yaml").write_text("task: broken\n  dataset_path: [unclosed\n")
    with pytest.raises(UserError, match=r"broken.yaml: not a readable task YAML \(mapping values are not allowed"):
        run_tasks(str(export_dir), ["broken"], include_path=str(local_tasks))
    (local_tasks / "broken.yaml").write_text("include: base.yaml\ntask: broken\n")  # was 'unknown task: broken'
    with pytest.raises(UserError, match=rf"^{local_tasks}/broken.yaml: 'include: base.yaml' names no file \(it is "
                                        rf"read beside the YAML, in {local_tasks}\)$"):
        run_tasks(str(export_dir), ["broken"], include_path=str(local_tasks))
    (local_tasks / "base.yaml").write_text("dataset_path: json\n")
    check_task_files(local_tasks)  # found beside it


def test_a_task_whose_data_is_missing_is_one_line(export_dir, local_tasks, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (local_tasks / "rows.jsonl").unlink()  # a FileNotFoundError traceback before
    with pytest.raises(UserError, match=r"lm-eval failed on tiny_choice \(\w*(FileNotFound|DataFiles\w*)Error"):
        run_tasks(str(export_dir), ["tiny_choice"], include_path=str(local_tasks), out_dir=str(tmp_path / "out"))


UNREADABLE = r"DatasetGenerationError: An error occurred while generating the dataset, from "


@pytest.mark.parametrize("data, field, said", [
    (bytes(range(256)) * 4, "question", UNREADABLE),
    (b'{"question": "q", "choices": ["a", "b"], "label": 0}\n{"question":', "question", UNREADABLE),
    (b"", "question", r"StopIteration \(a task's data file is empty\?\)"),
    (None, "nosuchfield", r"UndefinedError: 'nosuchfield' is undefined"),
])
def test_task_data_that_is_not_json_lines_or_a_field_the_rows_lack_is_one_line(export_dir, local_tasks, tmp_path,
                                                                             monkeypatch, data, field, said):
    """Each was a traceback of the datasets library or of jinja2, exit 1."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    if data is not None:
        (local_tasks / "rows.jsonl").write_bytes(data)
    yaml_file = local_tasks / "tiny_choice.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("{{question}}", "{{" + field + "}}"))
    with pytest.raises(UserError) as error:
        run_tasks(str(export_dir), ["tiny_choice"], include_path=str(local_tasks), out_dir=str(tmp_path / "out"))
    assert re.match(rf"lm-eval failed on tiny_choice \({said}", str(error.value)), str(error.value)
    assert str(error.value).endswith("); check the tasks' YAML and data files") and "\n" not in str(error.value)


@pytest.mark.parametrize("function, said", [
    ("nomodule.text", r"ImportError: Cannot import module 'nomodule' for function 'text'"),
    ("utils.missing", r"AttributeError: Module '.*utils.py' has no function 'missing'"),
    ("utils.fails", r"RuntimeError: no text for this row"),
])
def test_a_task_function_that_is_missing_or_fails_is_one_line(export_dir, local_tasks, tmp_path, monkeypatch,
                                                              function, said):
    """A `!function` of the task's YAML whose module or function is missing, or that raised, was a traceback (exit
    1)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (local_tasks / "utils.py").write_text("def fails(doc):\n    raise RuntimeError('no text for this row')\n")
    yaml_file = local_tasks / "tiny_choice.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("'{{question}}'", f"!function {function}"))
    with pytest.raises(UserError) as error:
        run_tasks(str(export_dir), ["tiny_choice"], include_path=str(local_tasks), out_dir=str(tmp_path / "out"))
    assert re.match(rf"lm-eval failed on tiny_choice \({said}", str(error.value)), str(error.value)
    assert "\n" not in str(error.value)


def test_an_error_of_zerollm_s_own_code_under_lm_eval_is_not_blamed_on_the_task(export_dir, local_tasks, tmp_path,
                                                                                 monkeypatch):
    """Only what the tasks or lm-eval raise is said as the tasks' fault: an error in zerollm's model wrapper is a
    bug, and keeps its traceback."""
    from llm.eval import harness_lm

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def bug(*args, **kwargs):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(harness_lm.ZeroLLMHarnessModel, "_scores", bug)
    with pytest.raises(KeyError, match="a bug of ours"):
        run_tasks(str(export_dir), ["tiny_choice"], include_path=str(local_tasks), out_dir=str(tmp_path / "out"))


def test_local_tasks_are_indexed_without_lm_evals_own_and_a_group_with_them(local_tasks):
    """lm-eval's 15,000 tasks were indexed (12 s) even where every task asked for is in --include-path."""
    from llm.eval.harness import task_manager

    assert task_manager(["tiny_choice", "tiny_rolling"], str(local_tasks)).all_tasks == sorted(TASK_YAML)
    # a group may name lm-eval's tasks beside the user's: both are indexed
    (local_tasks / "mixed.yaml").write_text("group: mixed\ntask: [tiny_choice, hellaswag]\n")
    assert {"mixed", "tiny_choice", "hellaswag"} <= set(task_manager(["mixed"], str(local_tasks)).all_tasks)


def test_a_group_naming_a_task_that_does_not_exist_names_it(export_dir, local_tasks):
    """It was 'lm-eval failed on mine (TypeError: expected str, bytes or os.PathLike object, not NoneType)'."""
    (local_tasks / "mine.yaml").write_text("group: mine\ntask: [tiny_choice, not_a_task_xyz]\n")
    with pytest.raises(UserError, match=rf"^{local_tasks}/mine.yaml: group mine names not_a_task_xyz, which no lm-eval "
                                        "task is called; `lm-eval ls tasks` lists them$"):
        run_tasks(str(export_dir), ["mine"], include_path=str(local_tasks))


def test_unknown_task_is_named(export_dir, local_tasks, tmp_path):
    result = run_cli("eval", "--model", export_dir, "--tasks", "tiny_choice,no_such_task", "--include-path",
                     local_tasks, "--out", tmp_path / "results" / "eval")
    assert result.returncode == 2 and "no_such_task" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "results").exists()  # made, and left empty


def test_the_results_folder_is_made_only_for_tasks_and_a_model_that_will_run(export_dir, local_tasks, tmp_path,
                                                                              monkeypatch, capsys):
    """A mistyped --model left TYPO/eval made (the default results folder) and empty; a folder that cannot be made
    is still refused before the evaluation."""
    from conftest import zerollm_here

    typo = tmp_path / "typo"
    assert zerollm_here(monkeypatch, "eval", "--model", typo, "--tasks", "tiny_choice", "--include-path",
                        local_tasks) == 2
    assert "no such directory" in capsys.readouterr().err and not typo.exists()
    assert zerollm_here(monkeypatch, "eval", "--model", export_dir, "--tasks", "tiny_choice", "--include-path",
                        local_tasks, "--out", "/proc/zerollm-results") == 2
    assert "zerollm: error: --out /proc/zerollm-results: cannot create it (" in capsys.readouterr().err


def test_context_defaults_to_the_trained_window_of_a_run_and_is_checked_for_tasks_too(tmp_path):
    from llm.eval.perplexity import evaluation_context

    (tmp_path / "config.yaml").write_text("data:\n  seq_len: 24\nmodel:\n  max_seq_len: 64\n")
    model = Transformer(ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2, max_seq_len=64))
    assert evaluation_context(None, tmp_path, model) == 24
    assert evaluation_context(None, tmp_path / "export", model) == 64
    # an export of a long context: its windows were all of it (Llama 3.1: 131,072 positions, 33 GB of logits each)
    long = Transformer(ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2, max_seq_len=131072))
    assert evaluation_context(None, tmp_path / "export", long) == 4096
    assert evaluation_context(8192, tmp_path / "export", long) == 8192
    assert evaluation_context(32, tmp_path, model) == 32
    for bad in (0, 65):  # `--tasks --context 0` took the default (`context or ...`)
        with pytest.raises(UserError, match=f"--context must be between 1 and the model's max_seq_len 64, got {bad}"):
            evaluation_context(bad, tmp_path, model)


@pytest.mark.parametrize("command", [["eval"], ["plot"], ["bench", "learn"]])
def test_help_explains_the_new_commands(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0 and "usage: zerollm" in result.stdout


@pytest.mark.parametrize("options, message", [
    (["--tasks", ""], "--tasks expects comma-separated task names"),  # a TypeError on the --input path before
    (["--tasks", "my_task", "--num-fewshot", "-2"], "--num-fewshot must be 0 or more, got -2"),  # ran, '-2' shots
    (["--tasks", "my_task", "--limit", "0"], "--limit must be a whole number of examples per task, or a fraction "
                                             "of them below 1, got 0"),
    (["--tasks", "my_task", "--limit", "inf"], "--limit must be a whole number of examples per task"),  # OverflowError
    (["--tasks", "my_task", "--limit", "1.5"], "--limit must be a whole number of examples per task, or a fraction "
                                               "of them below 1, got 1.5"),  # ran 1 example
    (["--tasks", "my_task", "--out", "{file}"], "--out {file}: {file} is a file; give a folder for the results"),
    (["--tasks", "my_task", "--out", "{link}"], "--out {link}: {link} is a symbolic link to {link}-target, which "
                                                "does not exist"),  # a FileExistsError after the evaluation
    # the folder above it passes as writable: a FileNotFoundError traceback after the evaluation
    (["--input", "{file}", "--nproc", "0"], "argument --nproc: must be between 1 and 1024, got 0"),  # ran one rank
    (["--input", "{file}", "--limit", "5", "--out", "x"], "--limit, --out apply to --tasks"),  # silently ignored
    (["--input", "{file}", "--apply-chat-template", "--system-instruction", "Be brief.", "--log-samples"],
     "--apply-chat-template, --system-instruction, --log-samples apply to --tasks"),
    # silently ignored before:
    (["--tasks", "my_task", "--json"], "--json applies to --input/--data; --tasks runs in one process"),
    (["--tasks", "my_task", "--stride", "4", "--split", "train"], "--stride, --split apply to --input/--data"),
    (["--input", "{file}", "--split", "train"], "--split applies to --data (a prepared split)"),
    # lm-eval failed after loading everything (0: "check the tasks' YAML"; -1: an AttributeError traceback)
    (["--tasks", "my_task", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--tasks", "my_task", "--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["--input", "{file}", "--nproc", "2", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),  # per rank
    # the ranks ran on the CPU whatever --device said (mps: not on this machine, or not for 2 ranks)
    (["--input", "{file}", "--nproc", "2", "--device", "mps"], "--device mps: "),
])
def test_bad_options_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, options, message):
    """The model does not exist: the error shows the options are checked first (an --out that is a file was a
    FileExistsError after the whole evaluation), in this process, before any rank starts: one line."""
    (tmp_path / "notes.txt").write_text("kept")
    (tmp_path / "results").symlink_to(tmp_path / "results-target")
    names = {"file": tmp_path / "notes.txt", "link": tmp_path / "results"}
    options = [o.format(**names) for o in options]
    assert zerollm_here(monkeypatch, "eval", "--model", tmp_path / "no-model", *options) == 2
    err = capsys.readouterr().err
    assert message.format(**names) in err and err.count(": error:") == 1, err


def test_several_ranks_refuse_a_device_other_than_theirs():
    from llm.eval.perplexity import check_rank_device

    for device in ("auto", "cpu"):
        check_rank_device(device, "cpu", 2)
    check_rank_device("cuda", "cuda", 2)
    with pytest.raises(UserError, match=r"--device cuda: the 2 ranks of this job run on cpu"):
        check_rank_device("cuda", "cpu", 2)


def ranks_import(code: str, site: Path, monkeypatch) -> None:
    """Have every process this test starts run `code` as it starts (a sitecustomize module in `site`)."""
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))


def test_a_mistake_every_rank_finds_is_printed_once_and_the_ranks_end_without_teardown(export_dir, pretrain_data,
                                                                                        tmp_path, monkeypatch):
    """Each of the 2 ranks printed it. Then each rank ended through interpreter teardown with its gloo group open,
    which could abort ("terminate called without an active exception"): about 1 run in 30 under load, and the job
    exited 76, a rank lost, not 2 (a CI run). A rank whose interpreter runs its teardown (atexit handlers first)
    leaves a file here."""
    ranks_import("import atexit, os, pathlib\nif 'RANK' in os.environ:\n"
                 "    atexit.register(pathlib.Path(os.environ['TEARDOWN_SEEN'], os.environ['RANK']).touch)\n",
                 tmp_path / "site", monkeypatch)
    monkeypatch.setenv("TEARDOWN_SEEN", str(tmp_path))
    result = run_cli("eval", "--model", export_dir, "--data", pretrain_data, "--context", 16, "--stride", 40,
                     "--nproc", 2)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.count("zerollm: error: --stride must be between 1 and the context (16), got 40") == 1, \
        result.stderr[-3000:]
    assert result.stderr.count("zerollm: error:") == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "0").exists() and not (tmp_path / "1").exists()


def test_a_lost_rank_of_an_eval_job_is_named_with_advice_for_eval(export_dir, pretrain_data, tmp_path, monkeypatch):
    """The line naming it said to rerun with --resume auto from the last checkpoint: eval has neither."""
    ranks_import("import os, signal\nif os.environ.get('RANK') == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n",
                 tmp_path / "site", monkeypatch)
    result = run_cli("eval", "--model", export_dir, "--data", pretrain_data, "--context", 16, "--nproc", 2)
    assert result.returncode == EXIT_RANK_LOST, result.stderr[-3000:]
    assert re.fullmatch(r"zerollm: error: rank 1 \(pid \d+\) was ended by SIGKILL \(signal 9\); the job is ended on "
                        r"every rank: rerun the command \(nothing was saved\)\n", result.stderr), result.stderr[-3000:]


@pytest.fixture()
def diverged_export(export_dir, tmp_path):
    """export_dir's model with its (tied) embeddings scaled by 900: a loss per token above 709.8 nats, whose
    exp overflows a float."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "diverged"
    shutil.copytree(export_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["model.embed_tokens.weight"] *= 900
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_a_diverged_models_perplexity_is_inf_and_its_loss_and_bits_per_byte_still_print(diverged_export, text_files,
                                                                                       capsys):
    """math.exp(loss) raised OverflowError (a traceback) in the table, under --json and in bench learn's result."""
    run_perplexity(diverged_export, [text_files[0]], None, None, context=CONTEXT, as_json=True)
    got = json.loads(capsys.readouterr().out)  # valid JSON: null, not Infinity
    assert got["loss"] > 709.8 and got["perplexity"] is None and math.isfinite(got["bits_per_byte"])
    run_perplexity(diverged_export, [text_files[0]], None, None, context=CONTEXT)
    table = capsys.readouterr().out
    assert re.search(r"perplexity +inf\n", table), table
    assert f"loss per token  {got['loss']:10.4f}" in table and f"bits per byte   {got['bits_per_byte']:10.4f}" in table


def _offline_hub(monkeypatch, tmp_path):
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(name, value)


def test_lm_eval_metrics_of_a_model_that_scores_nan_are_saved_as_null(export_dir, local_tasks, tmp_path, monkeypatch):
    """They were written as bare NaN, which is not JSON: jq, JavaScript and pandas' strict readers refused the
    results file and the samples."""
    from safetensors.torch import load_file, save_file

    _offline_hub(monkeypatch, tmp_path)
    model = tmp_path / "nan"
    shutil.copytree(export_dir, model)
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"][:] = 3e38  # finite weights (NaN ones are refused) whose logits overflow: NaN scores
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    run_tasks(str(model), ["tiny_rolling"], include_path=str(local_tasks), out_dir=str(tmp_path / "out"),
              log_samples=True)

    def strict(constant):
        raise AssertionError(f"{constant} is not JSON")

    saved = [path for path in (tmp_path / "out").iterdir() if path.suffix in (".json", ".jsonl")]
    assert len(saved) == 2
    for path in saved:
        values = [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines() if line.strip()] \
            if path.suffix == ".jsonl" else [json.loads(path.read_text(), parse_constant=strict)]
        assert values
    results = json.loads(next(p for p in saved if p.suffix == ".json").read_text())["results"]["tiny_rolling"]
    assert results["bits_per_byte,none"] is None and results["word_perplexity,none"] is None


def test_a_perplexity_that_overflows_in_lm_eval_names_the_model_not_the_task(diverged_export, local_tasks, tmp_path,
                                                                             monkeypatch):
    """It was 'lm-eval failed on tiny_rolling (OverflowError: math range error); check the tasks' YAML and data
    files': the task was fine; lm-eval's exp() of the diverged model's mean loss overflowed."""
    _offline_hub(monkeypatch, tmp_path)
    with pytest.raises(UserError, match=(
            rf"^lm-eval failed on tiny_rolling: a perplexity overflowed \(OverflowError: math range error\), the "
            rf"model's mean loss there being above 709 nats: has {re.escape(str(diverged_export))} diverged\? "
            r"`zerollm eval --input FILE` gives its loss and bits per byte$")):
        run_tasks(str(diverged_export), ["tiny_rolling"], include_path=str(local_tasks), out_dir=str(tmp_path / "o"))


def test_a_huge_perplexity_prints_in_scientific_notation():
    from llm.eval.perplexity import PerplexityResult

    huge = PerplexityResult(tokens=10, bytes=40, nats=10 * 345.0, windows=1, context=16, stride=16)
    assert math.isclose(huge.perplexity, math.exp(345.0)) and huge.to_dict()["perplexity"] == huge.perplexity
    assert re.search(r"perplexity +6\.786e\+149\n", huge.summary()), huge.summary()  # 150 digits before
    small = PerplexityResult(tokens=10, bytes=40, nats=10 * 5.0, windows=1, context=16, stride=16)
    assert f"perplexity      {math.exp(5.0):10.3f}" in small.summary()
    billions = PerplexityResult(tokens=10, bytes=40, nats=10 * math.log(5e9), windows=1, context=16, stride=16)
    assert f"perplexity      {'5e+09':>10}\n" in billions.summary(), billions.summary()  # 10 columns, not 14
    assert small.summary().startswith("10 tokens (40 bytes) in 1 window of up to 16 tokens")  # '1 windows'
    empty = PerplexityResult(tokens=10, bytes=0, nats=10.0, windows=1, context=16, stride=16)
    assert empty.to_dict()["bits_per_byte"] is None  # NaN is not JSON


def test_lm_eval_results_get_names_of_their_own_written_atomically(tmp_path, monkeypatch):
    """Two runs in one second wrote the same lm_eval_<time>.json and .md (the second replacing the first), with
    plain write_text (a torn file after a crash)."""
    from llm import durable
    from llm.eval import harness

    monkeypatch.setattr(harness.time, "strftime", lambda fmt, *args: "20260101-120000")
    written = []
    monkeypatch.setattr(durable, "write_text", lambda path, text, real=durable.write_text: (
        written.append(path.name), real(path, text)))
    stems = [harness.save_results(tmp_path / "out", json.dumps({"run": i}), f"table {i}") for i in range(3)]
    assert [s.name for s in stems] == ["lm_eval_20260101-120000", "lm_eval_20260101-120000-1",
                                       "lm_eval_20260101-120000-2"]
    for i, stem in enumerate(stems):
        assert json.loads(stem.with_suffix(".json").read_text()) == {"run": i}
        assert stem.with_suffix(".md").read_text() == f"table {i}"
    assert written == [f"{s.name}.{suffix}" for s in stems for suffix in ("json", "md")]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(written)  # no temporary left


def test_a_run_is_scored_naming_the_checkpoint_it_was_read_at(zero_runs, text_files, monkeypatch, capsys):
    """A run still training is read at its newest complete checkpoint; the result did not say which."""
    run = zero_runs[2]
    assert zerollm_here(monkeypatch, "eval", "--model", run, "--input", text_files[0], "--json") == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["checkpoint"] == "global_step4"
    assert zerollm_here(monkeypatch, "eval", "--model", run, "--input", text_files[0]) == 0
    assert capsys.readouterr().out.startswith(f"eval {run} (global_step4) on {text_files[0]}: ")


def test_ranks_that_read_different_checkpoints_are_refused(monkeypatch):
    """Each rank of `eval --nproc 2` reads the run itself: a checkpoint published between their reads had them score
    two models as one."""
    from llm.eval import perplexity

    monkeypatch.setattr(perplexity.dist, "all_gather_object", lambda read, mine: read.__setitem__(1, "global_step8"))
    perplexity.same_checkpoint("run", "global_step8", 2)
    with pytest.raises(UserError, match=r"^--model run: its ranks read different checkpoints \(global_step4, "
                                        r"global_step8\); a training published one while they loaded; run again$"):
        perplexity.same_checkpoint("run", "global_step4", 2)


def test_lm_eval_results_name_the_checkpoint_of_a_run(zero_runs, local_tasks, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    run = zero_runs[2]
    results = run_tasks(str(run), ["tiny_choice"], include_path=str(local_tasks),
                        out_dir=str(tmp_path / "results"))
    assert results["config"]["model_args"] == f"model={run},checkpoint=global_step4"
    assert next((tmp_path / "results").glob("*.md")).read_text().startswith(f"model: {run} (global_step4)\n\n")


def _offline(monkeypatch, tmp_path):
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(name, value)


def test_lm_eval_results_are_saved_before_anything_is_printed(export_dir, local_tasks, tmp_path, monkeypatch):
    """With stdout gone (`| head`, a full disk) the table was printed first and the results never saved; a task
    named with a '/' failed to save its samples (an invalid file name) after the results were written."""
    from llm.stdout import GuardedStdout, OutputLost

    _offline(monkeypatch, tmp_path)
    (local_tasks / "tiny_choice.yaml").write_text(
        (local_tasks / "tiny_choice.yaml").read_text().replace("task: tiny_choice", "task: mine/choice"))

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", GuardedStdout(Gone()))
    with pytest.raises(OutputLost):
        run_tasks(str(export_dir), ["mine/choice"], include_path=str(local_tasks), out_dir=str(tmp_path / "results"),
                  log_samples=True)
    [results] = (tmp_path / "results").glob("lm_eval_*[0-9].json")
    assert "mine/choice" in json.loads(results.read_text())["results"]
    [samples] = (tmp_path / "results").glob("lm_eval_*_samples_mine_choice.jsonl")
    assert len(samples.read_text().splitlines()) == len(TASK_ROWS)


@pytest.mark.parametrize("setting, said", [
    ("max_gen_toks: -3", "a generate_until task's max_gen_toks is -3, not a positive integer; check the tasks' YAML"),
    ("max_gen_toks: lots", "a generate_until task's max_gen_toks is 'lots', not a positive integer"),
    ("until: [1]", "a generate_until task's until is [1], not a string or a list of non-empty strings"),
    ("until: ['']", "a generate_until task's until is [''], not a string or a list of non-empty strings"),
])
def test_a_generation_setting_of_a_task_that_is_wrong_is_one_line(export_dir, local_tasks, tmp_path, monkeypatch,
                                                                    setting, said):
    """Read by our generate_until, such values were tracebacks (our code, so not taken for the task's fault)."""
    _offline(monkeypatch, tmp_path)
    yaml_file = local_tasks / "tiny_generate.yaml"
    key = setting.split(":")[0]
    yaml_file.write_text("\n".join(f"  {setting}" if line.strip().startswith(f"{key}:") else line
                                   for line in yaml_file.read_text().splitlines()) + "\n")
    with pytest.raises(UserError, match=f"^{re.escape(said)}"):
        run_tasks(str(export_dir), ["tiny_generate"], include_path=str(local_tasks), out_dir=str(tmp_path / "out"))


def test_a_context_of_one_token_still_answers(model_and_tokenizer):
    """With --context 1 no prompt token fits beside the answer's reserved one: the slice [-0:] kept the whole prompt
    and the answer's room went negative (an InvalidSampling traceback)."""
    from lm_eval.api.instance import Instance

    from llm.eval.harness_lm import ZeroLLMHarnessModel

    model, tokenizer = model_and_tokenizer
    lm = ZeroLLMHarnessModel(model, tokenizer, batch_size=1, max_length=1)
    seen = []
    lm._greedy = lambda prompt, params: seen.append((prompt, params.max_new_tokens)) or ""
    lm.generate_until([Instance("generate_until", {}, ("A question", {"until": ["\n"]}), 0)], disable_tqdm=True)
    assert seen == [([lm.prefix_token_id], 0)]


def test_bits_per_byte_of_files_count_their_text_not_what_the_tokens_decode_to(export_dir, tmp_path):
    """A tokenizer that normalises (Qwen's NFC) decodes composed text: the bytes were counted from the tokens, fewer
    than the file's, and bits per byte came out too high."""
    normalising = tmp_path / "nfc"
    shutil.copytree(export_dir, normalising)
    config = json.loads((normalising / "tokenizer.json").read_text())
    config["normalizer"] = {"type": "NFC"}
    (normalising / "tokenizer.json").write_text(json.dumps(config))
    from llm.loading import load_for_inference

    text = unicodedata.normalize("NFD", "café résumé naïve")
    (tmp_path / "nfd.txt").write_text(text + "\n")
    model, tokenizer = load_for_inference(normalising)
    stream, _ = stream_of_files([str(tmp_path / "nfd.txt")], tokenizer)
    result = evaluate_stream(model, tokenizer, stream, CONTEXT, CONTEXT, progress=False)
    assert result.bytes == len(text.encode("utf-8")) == 25


def test_a_split_holding_an_id_beyond_the_vocabulary_is_one_line(export_dir, pretrain_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(pretrain_data, data)
    with h5py.File(data / "tokens.h5", "r+") as h5:
        h5["val/tokens"][5] = 60000
    with pytest.raises(UserError, match=f"^{re.escape(str(data / 'tokens.h5'))}: the val split holds token id 60000, "
                                        r"beyond the model's vocabulary of 512 \(ids 0-511\)"):
        run_perplexity(str(export_dir), None, str(data), "val", context=CONTEXT)


@pytest.mark.parametrize("position", [5, 20])  # in rank 0's windows (0-15), in rank 1's (16-31)
def test_an_id_beyond_the_vocabulary_in_one_ranks_windows_is_one_line_on_two_ranks(export_dir, pretrain_data, tmp_path,
                                                                                  position):
    """The rank reading it said so and ended; the other, waiting in the all-reduce of the totals, ended in a gloo
    traceback ('Connection closed by peer')."""
    data = tmp_path / "data"
    shutil.copytree(pretrain_data, data)
    with h5py.File(data / "tokens.h5", "r+") as h5:
        h5["val/tokens"][position] = 600
    result = run_cli("eval", "--model", export_dir, "--data", data, "--context", CONTEXT, "--nproc", 2)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.count("zerollm: error:") == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "the val split holds token id 600, beyond the model's vocabulary of 512" in result.stderr


def test_a_system_instruction_that_is_not_utf8_is_refused_before_anything_loads(monkeypatch, capsys):
    code = zerollm_here(monkeypatch, "eval", "--model", "unused", "--tasks", "tiny_choice", "--system-instruction",
                        "caf\udce9")
    assert code == 2 and capsys.readouterr().err == ("zerollm: error: --system-instruction: not UTF-8 text (byte 0xe9 "
                                                     "at character 3)\n")
