"""GRPO: rewards and their spec, prompt files, advantages, the objective, and training on 2 ranks under ZeRO-2 and
ZeRO-3 (reward rising, first-step KL 0), bit-exact resume after SIGKILL, one-line errors for bad inputs."""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from forked_ranks import kill_when, run_job
from wandb_files import wandb_records

from conftest import TINY, zerollm_here
from llm.cli import attach_negative_weights, build_parser
from llm.config import GRPOConfig, ModelConfig, build_config
from llm.errors import UserError
from llm.export import export_model
from llm.loading import consolidated_weights
from llm.model import Transformer
from llm.model.token_losses import token_logps
from llm.rundir import GENERATION_CONFIG_FILE
from llm.tokenizer import Tokenizer
from llm.train import rollout
from llm.train.objectives import GRPOObjective
from llm.train.prompts import prompt_record, read_prompts
from llm.train.rewards import RING_SIGNAL, Completions, Reward, answers_match, final_answer, reward_metrics
from llm.train.rollout import encode_prompt, group_advantages
from llm.train.trainer import Trainer

USER_REWARD = '''
def letters(prompts, completions, answer, **fields):
    """Share of ASCII letters in each completion."""
    assert len(prompts) == len(completions) == len(answer) and prompts[0][-1]["role"] == "user"
    return [sum(c.isascii() and c.isalpha() for c in text) / max(1, len(text)) for text in completions]


def capital(prompts, completions, **fields):
    """1 for a completion that starts with a capital letter."""
    return [float("A" <= text.strip()[:1] <= "Z") for text in completions]
'''


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _completions(texts, answers=None, lengths=None):
    n = len(texts)
    return Completions([[{"role": "user", "content": "q"}]] * n, texts, lengths or [1] * n,
                       [{"answer": a} for a in (answers or [""] * n)])


# ---- rewards ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, answer, expected", [
    ("15", "15", True), ("  15. ", 15, True), ("15.0", "15", True), ("1,000", 1000, True), ("十五。", "十五", True),
    ("I think <answer>7</answer>", "7", True), ("<answer>6</answer> then <answer>7</answer>", "7", True),
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True), ("work... #### 42", "42", True),
    ("16", "15", False), ("15 apples", "15", False), ("", "15", False), ("十六", "十五", False),
    ("1,234,567.5", 1234567.5, True), ("-2", "-2.0", True), ("1e3", 1000, True),
    # were matches: a list is no number, '1_000' is Python's spelling, and an answer of '.' matched an empty reply
    ("1,2,3", 123, False), ("1,2", "12", False), ("1_000", "1000", False), ("", ".", False), ("。", "。", False),
    ("e4", "e4", True), ("e5", "5", False), ("+e3", "1000", False), ("3.", "3", True), (".5", "0.5", True),
    # were matches: numbers went through float and compared within 1e-9
    ("1000000000500", 1000000000000, False), ("1000000001", 1000000000, False), ("3e-10", "-5e-10", False),
    ("0.0000000001", 0, False), ("9007199254740993", 9007199254740992, False), ("0.1", 0.1, True), ("-0", 0, True),
    ("1e999999999", "1e999999999", True),
    # the minus sign of typeset text (U+2212) was no sign: "−3" did not match -3
    ("\u22123", -3, True), ("\u22123", "-3.0", True), ("1e\u22122", 0.01, True), ("\u22123", 3, False),
    # a tag's answer on lines of its own, a full stop after a space, commas only between groups of three, and the
    # record's answer read by the same rule
    ("<answer>\n42\n</answer>", "42", True), ("so #### 42 .", 42, True), ("1234,567", 1234567, False),
    ("Paris", "Paris.", True), ("42", "#### 42", True),
])
def test_exact_match_follows_the_documented_extraction_rule(completion, answer, expected):
    assert answers_match(completion, answer) is expected


def test_final_answer_prefers_tags_then_boxed_then_hashes():
    assert final_answer("\\boxed{1} <answer>2</answer> #### 3") == "2"
    assert final_answer("\\boxed{1} #### 3") == "1"
    assert final_answer("x #### 3.") == "3"
    assert final_answer("first \\boxed{1}, corrected: \\boxed{2}") == "2"  # the last of each, as documented
    assert final_answer("step #### 3 ... so #### 4") == "4"
    assert final_answer("<answer>5</answer> no: <answer>6</answer>") == "6"


def test_reward_terms_weights_and_components(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(USER_REWARD)
    monkeypatch.chdir(tmp_path)
    reward = Reward(["exact_match", "0.5*format:[0-9]+", "2*length", "myrewards:letters"], max_new_tokens=4,
                    device=torch.device("cpu"))
    assert reward.required_fields == ["answer"]
    total, parts = reward(_completions(["12", "ab"], answers=["12", "12"], lengths=[2, 4]))
    assert parts["exact_match"].tolist() == [1.0, 0.0] and parts["format"].tolist() == [1.0, 0.0]
    assert parts["length"].tolist() == [-0.5, -1.0] and parts["letters"].tolist() == [0.0, 1.0]
    assert total.tolist() == [1.0 + 0.5 - 1.0 + 0.0, 0.0 + 0.0 - 2.0 + 1.0]
    logged = Reward(["exact_match", "0*length"], 4, torch.device("cpu"))  # weight 0 beside another: logged only
    total, parts = logged(_completions(["12"], answers=["12"], lengths=[2]))
    assert total.tolist() == [1.0] and parts["length"].tolist() == [-0.5]
    by_path = Reward([f"{tmp_path / 'myrewards.py'}:letters"], 4, torch.device("cpu"))
    assert by_path(_completions(["a1"]))[1]["letters"].tolist() == [0.5]


@pytest.mark.parametrize("term, message", [
    ("exact_match,format", "give each term its own --reward"),
    ("accuracy", "expected \\[WEIGHT\\*\\]NAME with NAME exact_match"),
    ("length:0.5", "expected \\[WEIGHT\\*\\]NAME with NAME exact_match"),  # length takes no argument
    ("no_such_module_xyz:fn", "cannot import no_such_module_xyz"),
    ("json:no_such_function", "json has no function 'no_such_function'"),
    ("format:[", "not a regular expression"),
    ("format:", "no pattern after 'format:'; give 'format' alone for DeepSeek-R1's"),  # it meant R1's format
    ("0.5*format:", "no pattern after 'format:'"),
    ("format:a{99999999999}", r"not a regular expression \(the repetition number is too large\)"),  # OverflowError
    ("format:" + "(" * 2000 + ")" * 2000, r"not a regular expression \(maximum recursion depth"),  # RecursionError
    ("model:/nonexistent/reward-model", "model:/nonexistent/reward-model: no such directory; give a directory written "
                                        "by save_pretrained"),
    ("model:/dev/null", "model:/dev/null: not a directory; give"),
    ("missing_file.py:fn", "no such file missing_file.py"),
    ("os:system", r"system must be callable as system\(prompts=..., completions=..., \*\*fields\)"),
    ("1e400*format", r"the weight 1e400 is beyond 1e\+09 in magnitude"),  # inf: every step's loss was NaN, exit 0
    ("0*exact_match", r"every term has weight 0 \(0\*exact_match\), so every completion's reward is 0"),  # silent
    (["0*format", "-0.0*length"], r"every term has weight 0 \(0\*format, -0.0\*length\)"),
])
def test_bad_reward_terms_are_one_line_errors(term, message):
    with pytest.raises(UserError, match=message) as error:
        Reward(term if isinstance(term, list) else [term], 4, torch.device("cpu"))
    assert "\n" not in str(error.value)


def test_a_negative_weight_is_a_reward_term_not_an_option(monkeypatch, capsys, tmp_path):
    """`--reward -1*length` ended in argparse's 'expected one argument' (only `--reward=-1*length` worked)."""
    code = zerollm_here(monkeypatch, "train", "grpo", "--recipe", "demo", "--init-from", tmp_path / "none",
                        "--prompts", tmp_path / "p.jsonl", "--reward", "-1*length", "--reward", "-.5*format",
                        "--out", tmp_path / "run")
    err = capsys.readouterr().err
    assert code == 2 and err == f"zerollm: error: --init-from {tmp_path / 'none'}: no such directory\n"
    argv = ["train", "grpo", "--recipe", "demo", "--init-from", "m", "--prompts", "p", "--reward", "-1*length",
            "--reward", "-.5*format", "--reward", "exact_match", "--out", "o"]
    assert build_parser().parse_args(attach_negative_weights(argv)).reward == ["-1*length", "-.5*format",
                                                                               "exact_match"]
    assert [term.weight for term in Reward(["-1*length", "-.5*format"], 4, torch.device("cpu")).terms] == [-1, -0.5]


@pytest.mark.parametrize("body, message", [
    ("    raise RuntimeError('boom in reward')", r"score: raised RuntimeError: boom in reward \(at .*rewardfn.py:2\)"),
    ("    import sys; sys.exit(0)", r"score: raised SystemExit: 0 \(at .*rewardfn.py:2\)"),  # it ended the run, exit 0
    # neither is an Exception: a traceback and exit 1
    ("    raise GeneratorExit('out')", r"score: raised GeneratorExit: out \(at .*rewardfn.py:2\)"),
    ("    raise type('Mine', (BaseException,), {})('x')", r"score: raised Mine: x \(at .*rewardfn.py:2\)"),
    ("    return ['1.0'] * len(completions)", r"returned list \['1.0', '1.0'\]; it must return one float per"),
    ("    return {i: 1.0 for i in range(len(completions))}", r"returned dict \{0: 1.0, 1: 1.0\}; it must return one"),
    ("    return [1e308] * len(completions)", r"each finite and at most 1e\+09 in magnitude"),  # inf in float32
    ("    return [10**400] * len(completions)", r"returned list \[1000000000000\d*; it must return one float"),
    ("    completions.clear(); return []", r"returned list \[\]; it must return one float per completion \(2\)"),
    ("    return b'\\x01' * len(completions)", r"returned bytes b'\\x01\\x01'; it must return one float"),  # [1.0, 1.0]
])
def test_a_user_function_that_fails_is_one_line_naming_where(tmp_path, monkeypatch, body, message):
    """Before, a raising function was a traceback after the model had loaded, sys.exit(0) in it ended the run with
    exit 0 and nothing saved, and strings passed as scores."""
    (tmp_path / "rewardfn.py").write_text(f"def score(prompts, completions, **fields):\n{body}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "rewardfn", raising=False)  # each case's own file
    reward = Reward(["rewardfn:score"], 4, torch.device("cpu"))
    with pytest.raises(UserError, match=message) as error:
        reward(_completions(["a", "b"]))
    assert "\n" not in str(error.value)


def _limit_gone() -> bool:
    """Whether no reward time limit is left behind: its signal's handler back to the default, its ringer ended."""
    return signal.getsignal(RING_SIGNAL) == signal.SIG_DFL and not any(
        thread.name == "zerollm-reward-limit" for thread in threading.enumerate())


def test_a_reward_that_hangs_ends_in_one_line_at_its_time_limit(tmp_path, monkeypatch):
    """A reward that never answered held the run for ever: a stop signal lets the step finish first."""
    (tmp_path / "hangs.py").write_text("import time\n\ndef score(prompts, completions, **fields):\n"
                                       "    try:\n        time.sleep(60)\n    except Exception:\n"
                                       "        return [0.0] * len(completions)\n")  # it cannot catch the limit
    monkeypatch.chdir(tmp_path)
    reward = Reward(["exact_match", "hangs:score"], 4, torch.device("cpu"), timeout_s=1)
    with pytest.raises(UserError, match=r"^--reward hangs:score: no answer for 2 completions within "
                                        r"grpo.reward_timeout_s \(1 s, every term together\); make it faster"):
        reward(_completions(["a", "b"], answers=["a", "b"]))
    assert _limit_gone()  # and the next call has its whole limit (a generous one: the limit counts wall time)
    assert Reward(["exact_match"], 4, torch.device("cpu"), timeout_s=60)(_completions(["a"], answers=["a"]))[0] == 1


def test_a_reward_that_times_itself_with_sigalrm_still_ends_at_its_time_limit(tmp_path, monkeypatch):
    """math_verify's `timeout` (TRL's and open-r1's accuracy rewards) ends with signal.alarm(0), which cancelled the
    limit's timer: a hang after it held the run until train.collective_timeout_s, each rank blaming the other."""
    (tmp_path / "verified.py").write_text(
        "import signal, time\n\ndef score(prompts, completions, **fields):\n"
        "    previous = signal.signal(signal.SIGALRM, lambda *a: None)\n    signal.alarm(5)\n"
        "    signal.alarm(0)\n    signal.signal(signal.SIGALRM, previous)\n    time.sleep(3)\n"
        "    open('slept through', 'w').close()\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    reward = Reward(["verified:score"], 4, torch.device("cpu"), timeout_s=1)
    # named as given, as a failing or a wrong return is (it said '--reward score')
    with pytest.raises(UserError, match=r"^--reward verified:score: no answer for 1 completions within "
                                        r"grpo.reward_timeout_s"):
        reward(_completions(["a"]))
    assert not (tmp_path / "slept through").exists() and _limit_gone()  # its wait was ended at the limit


def test_a_reward_that_changes_the_working_directory_leaves_the_runs_as_it_was(tmp_path, monkeypatch):
    """A reward working in a scratch folder of its own (code execution) moved the run's: its --out, given relative,
    led nowhere, and the next metrics row ended the run in a traceback."""
    (tmp_path / "scratch.py").write_text("import os, tempfile\n\ndef score(prompts, completions, **fields):\n"
                                         "    os.chdir(tempfile.mkdtemp())\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    assert Reward(["scratch:score"], 4, torch.device("cpu"))(_completions(["a"]))[0].tolist() == [1.0]
    assert os.getcwd() == str(tmp_path)


def test_a_time_limit_that_ends_before_the_first_term_starts_names_that_term(monkeypatch):
    """grpo.reward_timeout_s=1e-9 rang before the first term had started: an AttributeError traceback."""
    from llm.train import rewards

    def rings_at_once(limit):
        raise rewards._OutOfTime

    monkeypatch.setattr(rewards.TimeLimit, "arm", rings_at_once)
    with pytest.raises(UserError, match=r"^--reward exact_match: no answer for 1 completions within "
                                        r"grpo.reward_timeout_s \(1e-09 s, every term together\)"):
        Reward(["exact_match", "format"], 4, torch.device("cpu"), timeout_s=1e-9)(_completions(["a"], answers=["a"]))
    monkeypatch.undo()
    for _ in range(20):  # the real limit at a microsecond: it rings anywhere, even as the timer is set
        with contextlib.suppress(UserError):
            Reward(["exact_match", "format"], 4, torch.device("cpu"), timeout_s=1e-6)(_completions(["a"]))
        assert _limit_gone()


@pytest.mark.parametrize("raising, said", [("import sys\nsys.exit(3)", "SystemExit: 3"),
                                           ("raise GeneratorExit('x')", "GeneratorExit: x")])  # a traceback, exit 1
def test_a_reward_module_that_exits_while_imported_is_one_line(tmp_path, monkeypatch, raising, said):
    """sys.exit(3) at import ended zerollm with exit 3 and nothing said."""
    (tmp_path / "exits.py").write_text(raising + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "exits", raising=False)
    with pytest.raises(UserError, match=rf"^--reward exits:f: cannot import exits \({said}\); run from the "):
        Reward(["exits:f"], 4, torch.device("cpu"))


def test_ctrl_c_in_a_reward_is_still_ctrl_c(tmp_path, monkeypatch):
    (tmp_path / "interrupted.py").write_text("def score(prompts, completions, **fields):\n"
                                             "    raise KeyboardInterrupt\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        Reward(["interrupted:score"], 4, torch.device("cpu"))(_completions(["a"]))


def test_exact_match_compares_words_that_float_reads_as_text():
    """float("nan") is a NaN, unequal to itself: a record answered "nan" (or "NaN") never matched."""
    assert answers_match("nan", "nan") and answers_match("NaN", "NaN") and not answers_match("nan", "NaN")
    assert answers_match("inf", "inf") and answers_match("1,000", 1000.0)


def test_a_user_function_cannot_change_what_the_next_terms_read(tmp_path, monkeypatch):
    (tmp_path / "meddler.py").write_text(
        "def score(prompts, completions, answer, **fields):\n"
        "    completions[0] = '12'; answer[1] = 'ab'; prompts[0][-1]['content'] = 'changed'\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    reward = Reward(["meddler:score", "exact_match"], 4, torch.device("cpu"))
    batch = _completions(["7", "ab"], answers=["12", "12"])
    assert reward(batch)[1]["exact_match"].tolist() == [0.0, 0.0]  # was [1.0, 1.0]: it read the meddler's edits
    assert batch.texts == ["7", "ab"] and batch.prompts[0][-1]["content"] == "q"


def test_the_rewards_read_a_completion_as_its_reply_reads_without_special_tokens(tokenizer_dir):
    """The rewards read the special tokens a completion held: an exact match failed on '4<|im_start|>', whose reply
    (generate's, serve's, TRL's rewards') reads '4'."""
    tok = Tokenizer.load(tokenizer_dir)
    generator = rollout.TextGenerator(Transformer(ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=2)), tok)
    four, end = tok.encode("4"), tok.encode_rendered("<|im_end|>")
    rows = [[*four, tok.im_start_id, *four, *end, *four], [*four, tok.pad_id, *four]]
    completions, texts = rollout.cut_completions(rows, generator)
    assert completions == [[*four, tok.im_start_id, *four, *end], rows[1]]  # the loss keeps the stop token
    assert texts == ["44", "44"]
    assert Reward(["exact_match"], 1, torch.device("cpu"))(_completions(texts, answers=["44", "44"]))[1][
        "exact_match"].tolist() == [1.0, 1.0]


def test_a_user_function_returning_the_wrong_shape_is_named(tmp_path, monkeypatch):
    (tmp_path / "short.py").write_text("def one(prompts, completions, **fields):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    reward = Reward(["short:one"], 4, torch.device("cpu"))
    with pytest.raises(UserError, match="short:one: returned list .* one float per completion \\(2\\)"):
        reward(_completions(["a", "b"]))
    (tmp_path / "yields.py").write_text("def one(prompts, completions, **fields):\n    yield 1.0\n"
                                        "def texts(prompts, completions, **fields):\n    yield from ['1', '2']\n")
    for name, shown in (("one", r"\[1\.0\]"), ("texts", r"\['1', '2'\]")):  # was <generator object one at 0x..>
        with pytest.raises(UserError, match=rf"^--reward yields:{name}: returned generator {shown}; it must return "
                                            r"one float per completion \(2\)"):
            Reward([f"yields:{name}"], 4, torch.device("cpu"))(_completions(["a", "b"]))


def test_a_function_named_like_a_total_and_an_array_of_lines_are_said_plainly(tmp_path, monkeypatch):
    """A function named `mean` overwrote reward/mean (the total) with its own unweighted mean, and one returning an
    array of rows was refused in a message of ten lines."""
    (tmp_path / "rw.py").write_text("import numpy as np\n"
                                    "def mean(prompts, completions, **fields):\n    return [1.0] * len(completions)\n"
                                    "def rows(prompts, completions, **fields):\n"
                                    "    return np.ones((len(completions), 2))\n")
    monkeypatch.chdir(tmp_path)
    reward = Reward(["2*rw:mean", "exact_match"], 4, torch.device("cpu"))
    assert [term.name for term in reward.terms] == ["mean_0", "exact_match"]
    with pytest.raises(UserError) as refused:
        Reward(["rw:rows"], 4, torch.device("cpu"))(_completions(["a"] * 6))
    said = str(refused.value)
    assert "\n" not in said and said.startswith("--reward rw:rows: returned ndarray [[1. 1.] [1. 1.]")


def test_a_column_of_scores_is_refused_alike_from_torch_and_numpy(tmp_path, monkeypatch):
    """A torch tensor of shape (n, 1) was taken as n scores, where numpy's (n, 1) was refused."""
    (tmp_path / "cols.py").write_text("import numpy as np, torch\n"
                                      "def t(prompts, completions, **f):\n    return torch.ones(len(completions), 1)\n"
                                      "def n(prompts, completions, **f):\n    return np.ones((len(completions), 1))\n"
                                      "def flat(prompts, completions, **f):\n    return torch.ones(len(completions))\n")
    monkeypatch.chdir(tmp_path)
    for name, kind in (("t", "Tensor"), ("n", "ndarray")):
        with pytest.raises(UserError, match=rf"^--reward cols:{name}: returned {kind} .*one float per completion"):
            Reward([f"cols:{name}"], 4, torch.device("cpu"))(_completions(["a", "b"]))
    assert Reward(["cols:flat"], 4, torch.device("cpu"))(_completions(["a", "b"]))[0].tolist() == [1.0, 1.0]


def test_a_reward_may_be_any_iterable_of_floats(tmp_path, monkeypatch):
    """A generator or a map of scores (read once) is as good as a list."""
    (tmp_path / "lazy.py").write_text("def gen(prompts, completions, **f):\n    return (1.0 for c in completions)\n"
                                      "def lengths(prompts, completions, **f):\n    return map(len, completions)\n")
    monkeypatch.chdir(tmp_path)
    reward = Reward(["lazy:gen", "lazy:lengths"], 4, torch.device("cpu"))
    assert {name: scores.tolist() for name, scores in reward(_completions(["a", "bcd"]))[1].items()} == {
        "gen": [1.0, 1.0], "lengths": [1.0, 3.0]}


def test_a_local_reward_model_scores_completions(tokenizer_dir, tmp_path):
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=3)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "rm" / name).write_bytes((tokenizer_dir / name).read_bytes())
    reward = Reward([f"model:{tmp_path / 'rm'}"], 4, torch.device("cpu"))
    batch = _completions(["a fine answer", "another, longer answer", "a fine answer"])
    scores = reward(batch)[1]["model"].tolist()
    assert len(scores) == 3 and all(math.isfinite(s) for s in scores)
    assert scores[0] == pytest.approx(scores[2]) and scores[0] != pytest.approx(scores[1])

    def out_of_memory(**inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    reward.terms[0].score.model = out_of_memory  # a traceback on the rank it hit, the others left waiting
    with pytest.raises(UserError, match=r"model:.*rm: failed on 3 completions \(OutOfMemoryError: CUDA out of memory"):
        reward(batch)


EVIL_MODULE = """
from pathlib import Path
Path(__file__).with_name("ran").write_text("the folder's code ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


def test_a_reward_model_folders_own_code_is_never_run(tokenizer_dir, tmp_path, monkeypatch):
    """A config.json with an `auto_map` made transformers ask on a terminal whether to run the folder's Python, and
    a "y" (typed ahead, or by a user who trusted the folder as a model) ran it."""
    folder = tmp_path / "rm"
    folder.mkdir()
    config = {"architectures": ["EvilForSequenceClassification"], "model_type": "evil",
              "auto_map": {"AutoConfig": "evil.EvilConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(EVIL_MODULE)
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")
    with pytest.raises(UserError, match=f"^--reward model:{folder}: cannot read its config"):
        Reward([f"model:{folder}"], 4, torch.device("cpu"))
    assert not (folder / "ran").exists()


def test_a_reward_model_that_is_no_classifier_is_refused(tokenizer_dir, tmp_path):
    """A causal language model (an export of ours) loaded as a sequence classifier got a head of random weights:
    the run trained on noise, with only transformers' table of newly initialised weights to say so."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=3)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    with pytest.raises(UserError, match=f"^--reward model:{tmp_path / 'lm'}: its config.json names LlamaForCausalLM, "
                                        "not a sequence-classification model"):
        Reward([f"model:{tmp_path / 'lm'}"], 4, torch.device("cpu"))
    transformers.LlamaForSequenceClassification(config).save_pretrained(tmp_path / "headless")
    weights = tmp_path / "headless" / "model.safetensors"
    tensors = {k: v for k, v in safetensors.torch.load_file(weights).items() if not k.startswith("score")}
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "headless" / name).write_bytes((tokenizer_dir / name).read_bytes())
    reward = Reward([f"model:{tmp_path / 'headless'}"], 4, torch.device("cpu"))
    with pytest.raises(UserError, match=r"its weights lack score.weight; transformers would start them from random"):
        reward(_completions(["a fine answer"]))


def _reward_model(tokenizer_dir, out, model_class="LlamaForSequenceClassification", **config):
    """A tiny sequence-classification model saved at `out` with the test tokenizer's files."""
    import transformers
    if model_class.startswith("GPT2"):
        settings = {"vocab_size": 512, "n_embd": 16, "n_layer": 1, "n_head": 2, "num_labels": 1, **config}
        config_class = transformers.GPT2Config
    else:
        settings = {"vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "num_labels": 1, **config}
        config_class = transformers.LlamaConfig
    torch.manual_seed(0)
    getattr(transformers, model_class)(config_class(**settings)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


def test_a_reward_model_of_several_labels_scores_the_probability_of_its_last(tokenizer_dir, tmp_path):
    """The tests used one-label models only: scoring the first label of two passed."""
    import transformers

    directory = _reward_model(tokenizer_dir, tmp_path / "rm", num_labels=2, pad_token_id=3)
    reward = Reward([f"model:{directory}"], 4, torch.device("cpu"))
    batch = _completions(["a fine answer"])
    scores = reward(batch)[1]["model"].tolist()
    text = reward.terms[0].score._text(batch.prompts[0], batch.texts[0])
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        probabilities = model(**tokenizer([text], return_tensors="pt")).logits.float().softmax(-1)[0].tolist()
    assert probabilities[0] != pytest.approx(probabilities[1], abs=1e-3)  # the two labels tell apart
    assert scores == [pytest.approx(probabilities[1], abs=1e-5)]


def test_a_reward_model_without_a_padding_token_or_with_a_short_context_scores_batches(tokenizer_dir, tmp_path):
    """A model whose config names no pad_token_id, or whose context is shorter than a prompt and its completion:
    a ValueError and an IndexError traceback at the first rollout, exit 1."""
    texts = ["a fine answer", "another, longer answer " * 30, "a fine answer"]
    for name, model_class, config in (("nopad", "LlamaForSequenceClassification", {}),
                                      ("short", "GPT2ForSequenceClassification", {"n_positions": 8,
                                                                                  "pad_token_id": 3})):
        directory = _reward_model(tokenizer_dir, tmp_path / name, model_class, **config)
        scores = Reward([f"model:{directory}"], 4, torch.device("cpu"))(_completions(texts))[1]["model"].tolist()
        assert all(math.isfinite(score) for score in scores) and scores[0] == pytest.approx(scores[2]), name


def test_a_reward_model_scores_a_completion_alike_alone_and_padded_in_a_batch(tokenizer_dir, tmp_path):
    """A config naming another padding id than the tokenizer pads with: transformers read each shorter row's score
    at a padding position, silently."""
    directory = _reward_model(tokenizer_dir, tmp_path / "rm", pad_token_id=5)
    reward = Reward([f"model:{directory}"], 4, torch.device("cpu"))
    alone = reward(_completions(["a fine answer"]))[0].tolist()
    batched = reward(_completions(["a fine answer", "another, much longer answer than that one"]))[0].tolist()
    assert batched[0] == pytest.approx(alone[0], abs=1e-5)


def test_a_reward_models_chat_template_renders_as_transformers_and_within_our_bounds(tokenizer_dir, tmp_path,
                                                                                      monkeypatch):
    """It went through transformers' `apply_chat_template`: a template that refused the messages was a traceback in
    the rollout, and a hostile one (it comes with downloaded files) ran unbounded."""
    import transformers

    import llm.chat_template

    directory = _reward_model(tokenizer_dir, tmp_path / "rm", pad_token_id=3)
    reward = Reward([f"model:{directory}"], 4, torch.device("cpu"))
    model = reward.terms[0].score
    reward(_completions(["a fine answer"]))  # loads it
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say <|im_end|> once."}]
    assert model._text(prompt, "<|im_end|>") == transformers.AutoTokenizer.from_pretrained(directory) \
        .apply_chat_template([*prompt, {"role": "assistant", "content": "<|im_end|>"}], tokenize=False)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    unset = "[{{ bos_token }}|{{ cls_token }}|{{ eos_token }}]{% for m in messages %}{{ m.content }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": unset, "bos_token": None}))
    unset_reward = Reward([f"model:{directory}"], 4, torch.device("cpu"))
    unset_reward(_completions(["a fine answer"]))
    assert unset_reward.terms[0].score._text(prompt, "A") == transformers.AutoTokenizer.from_pretrained(directory) \
        .apply_chat_template([*prompt, {"role": "assistant", "content": "A"}], tokenize=False)  # not '[None|None|'
    monkeypatch.setattr(llm.chat_template, "RENDER_SECONDS", 0.5)
    for template, reason in (("{{ raise_exception('no system turns') }}",
                              "the chat template refused the messages: no system turns"),
                             ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                              "rendering took longer than 0.5 s"),
                             ("{{ ('x' * 1000000).translate({120: 'y' * 1000}) }}",
                              "str.translate would make a result of more than")):
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        with pytest.raises(UserError, match=f"^--reward model:{directory}: .*{re.escape(reason)}"):
            Reward([f"model:{directory}"], 4, torch.device("cpu"))(_completions(["a fine answer"]))


def test_a_reward_models_context_is_the_least_limit_it_states():
    """A model whose config and tokenizer state no limit (Bloom) was given transformers' 'no limit', 10**30, as a
    length: an OverflowError on every rollout."""
    from llm.train.rewards import _context_of

    assert _context_of(SimpleNamespace(max_position_embeddings=514), SimpleNamespace(model_max_length=512)) == 512
    assert _context_of(SimpleNamespace(n_positions=8), SimpleNamespace(model_max_length=10**30)) == 8
    assert _context_of(SimpleNamespace(), SimpleNamespace(model_max_length=10**30)) is None  # not cut


def test_a_broken_reward_model_is_one_line(tokenizer_dir, tmp_path):
    """A truncated weights file was a SafetensorError traceback; weights of NaN passed their scores on, and the run
    ended blaming the learning rate; a directory without tokenizer files failed inside the model."""
    batch = _completions(["a fine answer", "another"])
    corrupt = _reward_model(tokenizer_dir, tmp_path / "corrupt", pad_token_id=3)
    (corrupt / "model.safetensors").write_bytes(b"\0" * 100)
    with pytest.raises(UserError, match=f"^--reward model:{corrupt}: cannot load it \\(SafetensorError: "):
        Reward([f"model:{corrupt}"], 4, torch.device("cpu"))(batch)
    broken = _reward_model(tokenizer_dir, tmp_path / "nan", pad_token_id=3)
    weights = safetensors.torch.load_file(broken / "model.safetensors")
    weights["score.weight"] = torch.full_like(weights["score.weight"], math.nan)
    safetensors.torch.save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"^--reward model:{broken}: scored 2 of 2 completions nan; a reward must "
                                        "be finite"):
        Reward([f"model:{broken}"], 4, torch.device("cpu"))(batch)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    with pytest.raises(UserError, match=f"^--reward model:{broken}: no tokenizer there \\(none of tokenizer.json, "):
        Reward([f"model:{broken}"], 4, torch.device("cpu"))


def test_a_reward_file_given_by_path_imports_as_python_runs_it(tmp_path, monkeypatch):
    """Loaded without a place in sys.modules, a file defining a dataclass failed ('NoneType' object has no
    attribute '__dict__', with advice to give the path it had been given), and it could not import its neighbours."""
    folder = tmp_path / "rewards_here"
    folder.mkdir()
    (folder / "helpers_of_mine.py").write_text("BONUS = 2.0\n")
    (folder / "scored.py").write_text("from __future__ import annotations\nfrom dataclasses import dataclass\n"
                                      "from helpers_of_mine import BONUS\n\n@dataclass\nclass Score:\n"
                                      "    value: float = BONUS\n\n"
                                      "def score(prompts, completions, **fields):\n"
                                      "    return [Score().value for _ in completions]\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "scored", raising=False)
    monkeypatch.delitem(sys.modules, "helpers_of_mine", raising=False)
    reward = Reward([f"{folder / 'scored.py'}:score"], 4, torch.device("cpu"))
    assert reward(_completions(["a", "b"]))[0].tolist() == [2.0, 2.0]
    for folder, value in (("a", 3.0), ("b", 4.0)):  # a file named as a module, twice: neither takes its place
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "json.py").write_text(f"def score(prompts, completions, **fields):\n"
                                                   f"    return [{value}] * len(completions)\n")
    reward = Reward([f"{tmp_path / 'a' / 'json.py'}:score", f"{tmp_path / 'b' / 'json.py'}:score"], 4,
                    torch.device("cpu"))
    assert reward(_completions(["a"]))[0].tolist() == [7.0] and sys.modules["json"] is json


def test_terms_renamed_apart_never_take_another_terms_name(tmp_path, monkeypatch):
    """`format`, `format:REGEX` and a function `format_1`: the second was renamed format_1 too, its scores
    overwritten by the function's, which was counted twice."""
    (tmp_path / "named.py").write_text("def format_1(prompts, completions, **fields):\n"
                                       "    return [100.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "named", raising=False)
    reward = Reward(["format", "format:[A-Z].*", "named:format_1"], 4, torch.device("cpu"))
    names = [term.name for term in reward.terms]
    assert len(set(names)) == 3 and names[2] == "format_1", names
    total, parts = reward(_completions(["Abc", "x"]))
    assert total.tolist() == [101.0, 100.0] and set(parts) == set(names)


@pytest.mark.parametrize("body", [
    # swallows every ring and returns: out of time all the same
    "    for _ in range(3):\n        try:\n            time.sleep(0.5)\n"
    "        except BaseException:\n            pass\n",
    # swallows the first ring and waits again: the limit rang once only, and the second wait took its 30 s
    "    try:\n        time.sleep(30)\n    except BaseException:\n        pass\n    time.sleep(30)\n",
])
def test_a_reward_that_swallows_its_time_limit_still_ends_at_it(tmp_path, monkeypatch, body):
    """The limit rang once: a bare `except: pass` around the wait took it, and the reward ran on for as long as it
    liked, exit 0."""
    (tmp_path / "swallows.py").write_text(f"import time\n\ndef score(prompts, completions, **fields):\n{body}"
                                          "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "swallows", raising=False)
    reward = Reward(["swallows:score"], 4, torch.device("cpu"), timeout_s=1)
    start = time.monotonic()
    with pytest.raises(UserError, match=r"^--reward swallows:score: no answer for 1 completions within "
                                        r"grpo.reward_timeout_s"):
        reward(_completions(["a"]))
    assert time.monotonic() - start < 10
    assert _limit_gone()


def test_a_function_that_cannot_take_the_records_fields_is_refused_before_training(tmp_path, monkeypatch):
    """`def score(prompts, completions)` given records with an answer failed at the first rollout, the error placed
    in our code."""
    (tmp_path / "narrow.py").write_text("def score(prompts, completions):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "narrow", raising=False)
    reward = Reward(["narrow:score"], 4, torch.device("cpu"))
    reward.check_fields(set())  # records without other fields: it takes them
    with pytest.raises(UserError, match=r"^--reward narrow:score: cannot take the prompt records' fields \(got an "
                                        r"unexpected keyword argument 'answer'\); give it a \*\*fields parameter"):
        reward.check_fields({"answer"})


def test_a_function_gets_every_field_of_the_records_none_where_a_record_lacks_it(tmp_path, monkeypatch):
    """A field only some records have was passed only where the batch held one of those: a function the check had
    accepted failed at the first rollout without it (a TypeError placed in our code, or a KeyError in **fields). A
    field named like the function's own arguments was dropped without a word."""
    (tmp_path / "ids.py").write_text("def named(prompts, completions, answer, id):\n"
                                     "    return [float(i is not None) for i in id]\n"
                                     "def keywords(prompts, completions, **fields):\n"
                                     "    return [float(i is not None) for i in fields['id']]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "ids", raising=False)
    reward = Reward(["ids:named", "ids:keywords"], 4, torch.device("cpu"))
    reward.check_fields({"answer", "id"})  # some records of the prompt files have an id
    with_id = Completions([[{"role": "user", "content": "q"}]] * 2, ["x", "y"], [1, 1], [{"answer": "a", "id": 1},
                                                                                          {"answer": "b"}])
    without = Completions(with_id.prompts, with_id.texts, with_id.lengths, [{"answer": "a"}, {"answer": "b"}])
    assert {name: scores.tolist() for name, scores in reward(with_id)[1].items()} == {
        "named": [1.0, 0.0], "keywords": [1.0, 0.0]}
    assert {name: scores.tolist() for name, scores in reward(without)[1].items()} == {
        "named": [0.0, 0.0], "keywords": [0.0, 0.0]}
    with pytest.raises(UserError, match=r"^--reward ids:named: the prompt records have a field named 'prompts', "
                                        "which the function receives as its own prompts; rename that field"):
        reward.check_fields({"answer", "prompts"})


# ---- prompts ----------------------------------------------------------------------------------------

def test_prompt_records_of_both_shapes():
    minimind = {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "content": "无"}], "answer": "4"}
    assert prompt_record(minimind) == ([{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "2+2?"}], {"answer": "4"})
    assert prompt_record({"prompt": "2+2?", "answer": 4, "id": 7}) == ([{"role": "user", "content": "2+2?"}],
                                                                     {"answer": 4, "id": 7})
    assert prompt_record("just a prompt") == ([{"role": "user", "content": "just a prompt"}], {})


def test_a_prompts_tool_definitions_reach_the_chat_template_and_the_rewards(tokenizer_dir, tmp_path):
    """MiniMind's RL prompts carry their tools on the system turn: they were dropped without a word."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    system, user = {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Lima?"}
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"conversations": [{**system, "tools": json.dumps(tools)}, user, {"role": "assistant", "content": ""}],
         "answer": "sunny"},
        {"prompt": [user], "tools": tools, "answer": "sunny"},
        {"prompt": [user], "tools": "not json", "answer": "sunny"}]) + "\n")
    tok = Tokenizer.load(tokenizer_dir)
    prompts = read_prompts([str(path)], partial(encode_prompt, tok), max_tokens=500, required_fields=["answer"])
    assert [p.ids for p in prompts] == [tok.encode_chat([system, user], True, tools=tools),
                                        tok.encode_chat([user], True, tools=tools)]
    assert [p.fields for p in prompts] == [{"answer": "sunny"}, {"answer": "sunny", "tools": tools}]  # as TRL's
    assert prompts.skipped == [f"{path}:3: 'tools' is not valid JSON (Expecting value)"]


def test_bad_prompt_records_are_skipped_and_reported_by_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}), "{not json",
            json.dumps({"conversations": [{"role": "assistant", "content": "hi"}], "answer": "1"}),
            json.dumps({"prompt": "no answer here"}), json.dumps({"text": "pretraining text"}),
            json.dumps({"prompt": "long " * 40, "answer": "1"}), json.dumps({"prompt": "ok", "answer": 3}),
            json.dumps({"prompt": "empty answer", "answer": " "}),  # an empty completion matched it
            # a blank question, an answer of true (a bool is no number), and a prompt of exactly max_tokens tokens
            json.dumps({"conversations": [{"role": "user", "content": " \n"}], "answer": "1"}),
            json.dumps({"prompt": "yes?", "answer": True}), json.dumps({"prompt": "x" * 50, "answer": "5"})]
    path.write_text("\n".join(rows) + "\n")
    prompts = read_prompts([str(path)], lambda messages, tools: [0] * len(messages[-1]["content"]), max_tokens=50,
                           required_fields=["answer"])
    assert [p.fields["answer"] for p in prompts] == ["2", 3, "5"]
    assert [s.split(": ", 1)[0] for s in prompts.skipped] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 8, 9, 10)]
    assert "no user turn" in prompts.skipped[1] and "no 'answer'" in prompts.skipped[2]
    assert "longer than data.seq_len - grpo.max_new_tokens = 50" in prompts.skipped[4]
    assert prompts.skipped[5].endswith("an empty 'answer', which the reward needs")
    assert prompts.skipped[6].endswith("empty user turn")
    assert prompts.skipped[7].endswith("no 'answer' string or number, which the reward needs")
    assert "skipped 8 records" in prompts.summary()
    assert prompts.summary(shown=2).splitlines()[2:] == [f"  {prompts.skipped[0]}", f"  {prompts.skipped[1]}",
                                                         "  ... and 6 more"]  # the first `shown`, by place
    with pytest.raises(UserError, match=rf"no usable prompt \(11 records skipped; first: {re.escape(str(path))}:1: "
                                        "prompt of 100 tokens is longer"):
        read_prompts([str(path)], lambda messages, tools: [0] * 100, max_tokens=50)


def test_a_prompt_folder_holding_runs_gives_none_of_their_files_as_prompts(tmp_path):
    """`--prompts DIR --out DIR/run`: a second run read the first's samples.jsonl rows as prompts (and its
    metrics.jsonl and checkpoint JSON as bad records), without a word; a prepared data folder's report too."""
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    for run in ("run_a", "run_b"):
        (tmp_path / run / "checkpoints" / "global_step1").mkdir(parents=True)
        (tmp_path / run / "config.yaml").write_text("model: {}\n")
        (tmp_path / run / "samples.jsonl").write_text(json.dumps({"step": 1, "prompt": "Once", "completion": "x"})
                                                      + "\n")
        (tmp_path / run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "run_b" / "run_record.jsonl").write_text("{}\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokens.h5").write_bytes(b"")
    (tmp_path / "data" / "report.json").write_text(json.dumps({"prompt": "report", "answer": "1"}))
    prompts = read_prompts([str(tmp_path)], lambda messages, tools: [0], max_tokens=50, required_fields=["answer"])
    assert [p.fields["answer"] for p in prompts] == ["2"] and prompts.skipped == []
    (tmp_path / "data" / "mine.jsonl").write_text(json.dumps({"prompt": "mine", "answer": "3"}) + "\n")
    (tmp_path / "run_a" / "notes.jsonl").write_text(json.dumps({"prompt": "noted", "answer": "4"}) + "\n")
    (tmp_path / "run_a" / "loss.png").write_bytes(b"")  # `zerollm plot runs/a --out runs/a/loss.png`
    prompts = read_prompts([str(tmp_path)], lambda messages, tools: [0], max_tokens=50, required_fields=["answer"])
    assert sorted(p.fields["answer"] for p in prompts) == ["2", "3", "4"]  # what the user put beside is read
    with pytest.raises(UserError, match="run_b: directory holds no .* besides what zerollm wrote there, which is not "
                                        "data$"):  # `--prompts DIR --out DIR`: the run's own rows were prompts
        read_prompts([str(tmp_path / "run_b")], lambda messages, tools: [0], 50, required_fields=["answer"])


# ---- advantages and the objective ---------------------------------------------------------------------

def test_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    scaled = group_advantages(rewards, 4, scale=True)
    assert scaled[:4].sum().abs() < 1e-6 and scaled[0] == pytest.approx(0.75 / (0.5 + 1e-4), rel=1e-4)
    assert scaled[4:].abs().max() == 0  # a group whose completions all score alike teaches nothing
    assert group_advantages(rewards, 4, scale=False)[:4].tolist() == [0.75, -0.25, -0.25, -0.25]


def _objective_batch():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=2, max_seq_len=32))
    tokens = torch.randint(4, 61, (4, 10))
    mask = torch.zeros(4, 10, dtype=torch.long)
    mask[:, 5:] = 1
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask[:, 1:],
             "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    with torch.no_grad():
        batch["ref_logps"] = token_logps(model(batch["tokens"]).logits, batch["targets"])
    return model, batch


@pytest.mark.parametrize("mode", ["gathered", "copy"])
def test_the_zero3_rollout_model_computes_what_the_engine_trains(monkeypatch, mode):
    """The rollout model was cast whole (`model.to(dtype=bf16)`), RoPE tables included, while DeepSpeed casts only
    the parameters: completions were sampled from another function than the one trained."""
    model_cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    policy = Transformer(model_cfg).eval()
    for param in policy.parameters():  # as DeepSpeed's bf16 engine casts the module (its buffers stay fp32)
        param.data = param.data.to(torch.bfloat16)
    engine = SimpleNamespace(module=policy, zero_optimization_stage=lambda: 3)
    cfg = SimpleNamespace(model=model_cfg, lora=SimpleNamespace(r=0), train=SimpleNamespace(seed=0),
                          grpo=SimpleNamespace(rollout_model=mode))
    monkeypatch.setattr(rollout, "full_parameters", lambda engine: contextlib.nullcontext())  # one rank: all there
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with rollout.RolloutPolicy(cfg, engine, torch.device("cpu")).generating() as model, torch.no_grad():
        assert model is not policy and {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
        assert torch.equal(model(tokens).logits, policy(tokens).logits)


def test_first_update_has_ratio_one_zero_kl_and_no_clipping():
    model, batch = _objective_batch()
    step = GRPOObjective(GRPOConfig(kl_coef=0.1))(model, batch)
    assert step.metrics["kl"].item() == 0.0 and step.metrics["clip_fraction"].item() == 0.0
    assert step.loss_tokens.item() == 4 * 5 and "old_logps" in batch
    step.loss.backward()
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("loss", ["grpo", "cispo"])
def test_clipped_tokens_are_counted_and_only_cispo_keeps_their_gradient(loss):
    model, batch = _objective_batch()
    with torch.no_grad():
        logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    batch["old_logps"] = logps - 1.0  # every ratio is e > 1 + clip_high
    batch["advantages"] = torch.ones(4)  # positive: the clip binds for grpo
    del batch["ref_logps"]  # no reference: no KL term
    step = GRPOObjective(GRPOConfig(loss=loss, kl_coef=0.0))(model, batch)
    assert step.metrics["clip_fraction"].item() == 1.0 and "kl" not in step.metrics
    step.loss.backward()
    gradient = sum(p.grad.abs().sum().item() for p in model.parameters() if p.grad is not None)
    assert (gradient > 0) is (loss == "cispo")


def test_clip_high_above_clip_low_leaves_a_ratio_between_them_unclipped():
    """DAPO's clip-higher: the tests used the defaults only, where both bounds are 0.2."""
    model, batch = _objective_batch()
    with torch.no_grad():
        logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    batch["old_logps"] = logps - math.log(1.25)  # every ratio 1.25: inside [0.8, 1.28], outside [0.8, 1.2]
    batch["advantages"] = torch.ones(4)
    assert GRPOObjective(GRPOConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0))(model, dict(batch)) \
        .metrics["clip_fraction"].item() == 0.0
    assert GRPOObjective(GRPOConfig(clip_low=0.2, clip_high=0.2, kl_coef=0.0))(model, dict(batch)) \
        .metrics["clip_fraction"].item() == 1.0


@pytest.mark.parametrize("loss", ["grpo", "cispo"])
def test_a_ratio_below_one_minus_clip_low_is_clipped_there(loss):
    """No test had a ratio below 1 - clip_low: the lower bound taken from clip_high, or a clipped token of negative
    advantage left out of clip_fraction, passed."""
    model, batch = _objective_batch()
    with torch.no_grad():
        logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    batch["old_logps"] = logps - math.log(0.75)  # every ratio 0.75: below 1 - clip_low = 0.8, above 1 - clip_high
    batch["advantages"] = -torch.ones(4)  # negative: the lower clip binds for grpo
    del batch["ref_logps"]
    step = GRPOObjective(GRPOConfig(loss=loss, clip_low=0.2, clip_high=0.28, kl_coef=0.0))(model, dict(batch))
    assert step.metrics["clip_fraction"].item() == 1.0
    mask = batch["mask"]
    expected = 0.8 if loss == "grpo" else ((0.8 * logps * mask).sum(-1) / mask.sum(-1)).mean().item()
    assert step.loss.item() == pytest.approx(expected, rel=1e-5)
    batch["advantages"] = torch.ones(4)  # positive: a ratio below the range is clipped for cispo only
    step = GRPOObjective(GRPOConfig(loss=loss, clip_low=0.2, clip_high=0.28, kl_coef=0.0))(model, dict(batch))
    assert step.metrics["clip_fraction"].item() == (0.0 if loss == "grpo" else 1.0)


def test_cispo_inside_the_clip_range_weighs_the_gradient_of_logp_by_the_ratio():
    """Its ratio is a weight, not differentiated: the test above sets ratios where the clamp has no gradient anyway."""
    model, batch = _objective_batch()
    with torch.no_grad():
        logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    batch["old_logps"] = logps - 0.1  # every ratio e^0.1, inside the clip range
    del batch["ref_logps"]
    GRPOObjective(GRPOConfig(loss="cispo", kl_coef=0.0))(model, dict(batch)).loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    mask, advantages = batch["mask"], batch["advantages"]
    logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    (-(math.exp(0.1) * advantages[:, None] * logps * mask).sum(-1) / mask.sum(-1)).mean().backward()
    assert all(torch.allclose(g, p.grad, rtol=1e-4, atol=1e-7) for g, p in zip(got, model.parameters()))


def test_the_log_probabilities_are_at_the_sampling_temperature():
    """The reference's are taken at grpo.temperature (the rollout's): the policy's at another made the first step's
    KL other than 0."""
    model, batch = _objective_batch()
    with torch.no_grad():
        at_temperature = token_logps(model(batch["tokens"]).logits, batch["targets"], temperature=0.7)
    batch["ref_logps"] = at_temperature
    step = GRPOObjective(GRPOConfig(temperature=0.7, kl_coef=0.1))(model, batch)
    assert torch.allclose(batch["old_logps"], at_temperature, atol=1e-6)
    assert step.metrics["kl"].item() == pytest.approx(0.0, abs=1e-6)


def test_the_kl_term_weighs_kl_coef():
    """k3 estimator exp(ref - logp) - (ref - logp) - 1, at ref = logp + 1 on every completion token: e - 2, times
    grpo.kl_coef, over each completion's tokens (it was caught only by a training run's reward)."""
    model, batch = _objective_batch()
    with torch.no_grad():
        logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    batch["ref_logps"] = logps + 1.0
    without = GRPOObjective(GRPOConfig(kl_coef=0.0))(model, dict(batch)).loss.item()
    for coef in (0.1, 0.5):
        step = GRPOObjective(GRPOConfig(kl_coef=coef))(model, dict(batch))
        assert step.metrics["kl"].item() == pytest.approx(math.e - 2, rel=1e-5)
        assert step.loss.item() == pytest.approx(without + coef * (math.e - 2), rel=1e-5)

def test_positions_off_the_completions_cannot_make_the_loss_nan():
    """The ratio and the KL term were exponentiated at every position and masked after: a prompt or padding
    position whose reference log-probability is 90 nats above the policy's (exp overflows fp32) made the loss and
    every gradient NaN, though the loss is over completion tokens only."""
    model, batch = _objective_batch()
    batch["old_logps"] = batch["ref_logps"] - 0.5  # every completion token's ratio is e^0.5: some clip
    objective = GRPOObjective(GRPOConfig(kl_coef=0.1))
    expected = objective(model, dict(batch))
    assert batch["mask"][:, 0].sum() == 0  # the first target of every row is the prompt's
    batch["ref_logps"], batch["old_logps"] = batch["ref_logps"].clone(), batch["old_logps"].clone()
    batch["ref_logps"][0, 0] += 90.0
    batch["old_logps"][1, 0] -= 90.0
    step = objective(model, dict(batch))
    step.loss.backward()
    assert step.loss.item() == expected.loss.item()
    assert step.metrics["kl"].item() == expected.metrics["kl"].item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_token_mean_weighs_every_completion_token_alike():
    """Only that the two means differ was pinned: their meanings swapped, and `kl` a mean per completion where
    docs/grpo.md says per completion token, passed."""
    model, batch = _objective_batch()
    batch["mask"][0, :] = 1  # the first completion is longer: 9 tokens, the others 5
    per_sequence = GRPOObjective(GRPOConfig(kl_coef=0.0))(model, dict(batch)).loss
    per_token = GRPOObjective(GRPOConfig(kl_coef=0.0, token_mean=True))(model, dict(batch)).loss
    assert per_sequence.item() != pytest.approx(per_token.item())
    batch["advantages"] = torch.tensor([-1.0, 0.0, 0.0, 0.0])  # at ratio 1, each token of the long one loses 1
    with torch.no_grad():
        logps = token_logps(model(batch["tokens"]).logits, batch["targets"])
    batch["ref_logps"] = logps + torch.tensor([1.0, 0.0, 0.0, 0.0])[:, None]  # the long one 1 nat off: e - 2 a token
    for token_mean, loss in ((False, (1 + 0 + 0 + 0) / 4), (True, 9 / 24)):
        step = GRPOObjective(GRPOConfig(kl_coef=0.0, token_mean=token_mean))(model, dict(batch))
        assert step.loss.item() == pytest.approx(loss, rel=1e-6), token_mean
        assert step.metrics["kl"].item() == pytest.approx(9 * (math.e - 2) / 24, rel=1e-5), token_mean


def test_token_mean_spans_every_micro_batch_of_the_step(one_rank_group):
    """Split into two micro-batches with 14 and 10 completion tokens, a token-mean step still weighs every token
    alike (DAPO): the trainer's weights make DeepSpeed's mean over micro-batches the mean over all 24 tokens."""
    model, batch = _objective_batch()
    batch["mask"][0, :] = 1  # the first completion is longer
    del batch["ref_logps"]
    objective = GRPOObjective(GRPOConfig(kl_coef=0.0, token_mean=True))
    whole = objective(model, dict(batch)).loss
    halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    trainer = Trainer.__new__(Trainer)
    trainer.objective, trainer.dist, trainer._exact = objective, SimpleNamespace(world_size=1), torch.float64
    weights, _ = trainer._step_weights(halves)
    split = sum(w * objective(model, half).loss for w, half in zip(weights, halves, strict=True)) / len(halves)
    assert split.item() == pytest.approx(whole.item(), rel=1e-6)
    assert trainer._token_weights(halves, GRPOObjective(GRPOConfig()).token_mask) is None


def test_grpo_config_is_checked():
    base = ["train.stage=grpo", "train.init_from=x", "grpo.prompts=p.jsonl"]
    with pytest.raises(UserError, match="multiple of grpo.group_size"):
        build_config("demo", [*base, "train.micro_batch_size=6", "grpo.group_size=4"])
    with pytest.raises(UserError, match="below data.seq_len"):
        build_config("demo", [*base, "grpo.max_new_tokens=128"])
    with pytest.raises(UserError, match="--prompts"):
        build_config("demo", ["train.stage=grpo", "train.init_from=x"])
    assert build_config("demo", [*base, "grpo.reward=length"]).grpo.reward == ["length"]


# ---- training -----------------------------------------------------------------------------------------

GRPO_SETTINGS = ["train.micro_batch_size=16", "train.lr=1e-2", "train.warmup_steps=1", "train.precision=fp32",
                 "grpo.group_size=8", "grpo.max_new_tokens=6", "train.max_steps=8", "train.save_every=4"]


@pytest.fixture(scope="module")
def policy(tokenizer_dir, tmp_path_factory):
    """A tiny random export to start from, initialised with a wide spread (init_std 0.2), so that its first
    samples differ a lot and a reward has something to choose between after a few steps."""
    out = tmp_path_factory.mktemp("policy")
    cfg = build_config("demo", [*TINY, "model.init_std=0.2"])
    torch.manual_seed(0)
    export_model(Transformer(cfg.model), tokenizer_dir, out)
    return out


@pytest.fixture(scope="module")
def prompt_dir(tmp_path_factory):
    """Prompts in both shapes, all short enough for TINY's data.seq_len with GRPO_SETTINGS' completions (MiniMind's
    shape was 27-29 tokens, beyond the 26 left: every one was skipped, and no rollout had one), and a user's reward
    module."""
    out = tmp_path_factory.mktemp("prompts")
    topics = ["kings", "love", "war", "night", "gold", "rome", "the sea", "a rose"]
    rows = [{"prompt": f"Tell me about {t}.", "answer": t} for t in topics]
    rows += [{"conversations": [{"role": "user", "content": f"Of {t}?"},
                                {"role": "assistant", "content": ""}], "answer": t} for t in topics]
    (out / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 2) + "\n")
    (out / "myrewards.py").write_text(USER_REWARD)
    return out


def _grpo_args(policy, prompt_dir, out, *overrides, rewards=(), nproc=2, extra=()):
    sets = [a for o in [*TINY, *GRPO_SETTINGS, *overrides] for a in ("--set", o)]
    return ["train", "grpo", "--recipe", "demo", "--init-from", policy, "--prompts", prompt_dir / "prompts.jsonl",
            *[a for r in rewards for a in ("--reward", r)], "--out", out, "--nproc", nproc, *sets, *extra]


@pytest.fixture(scope="module")
def grpo_runs(policy, prompt_dir, tmp_path_factory):
    """8 steps on 2 ranks: ZeRO-2 with a built-in reward (the completion starts with a capital letter), ZeRO-3 with
    the user's function (the same rule, written by the user)."""
    runs = {}
    for stage, reward in ((2, "format:[A-Z].*"), (3, "myrewards:capital")):
        out = tmp_path_factory.mktemp(f"grpo{stage}")
        result = run_job(*_grpo_args(policy, prompt_dir, out, rewards=[reward], extra=["--zero-stage", stage]),
                         cwd=prompt_dir)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert ", 32 prompts, " in result.stdout and "skipped" not in result.stdout  # both shapes
        runs[stage] = out
    return runs


@pytest.mark.parametrize("stage, component", [(2, "reward/format"), (3, "reward/capital")])
def test_grpo_raises_the_reward_on_two_ranks(grpo_runs, stage, component):
    rows = _metrics(grpo_runs[stage])
    assert [r["step"] for r in rows] == list(range(1, 9))
    rewards = [r["reward/mean"] for r in rows]
    assert [r[component] for r in rows] == rewards
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.25, rewards
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0  # the policy starts as the reference, then moves away
    for key in ("reward/std", "clip_fraction", "completion_length", "rollout_tokens_per_sec", "tokens_per_sec"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert all(1 <= r["completion_length"] <= 6 for r in rows)
    assert json.loads((grpo_runs[stage] / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage


def _assert_trained_alike(straight, resumed, steps):
    """`resumed` (a run stopped and resumed) logged every one of `steps` steps as `straight` (the same run, not
    stopped) did, bit for bit, and ended with the same weights."""
    a, b = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for key in ("loss", "reward/mean", "kl", "completion_length"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = consolidated_weights(straight), consolidated_weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_grpo_sigkill_then_resume_is_bit_exact(grpo_runs, policy, prompt_dir, tmp_path):
    killed = tmp_path / "killed"
    args = _grpo_args(policy, prompt_dir, killed, rewards=["format:[A-Z].*"], extra=["--zero-stage", 2])
    latest = killed / "checkpoints" / "latest"
    kill_when(lambda: latest.is_file() and latest.read_text() == "global_step4", *args)
    result = run_job(*args, "--resume", "auto", name="resumed")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_trained_alike(grpo_runs[2], killed, steps=8)


def test_a_grpo_resume_on_another_seed_names_the_prompts(grpo_runs, policy, prompt_dir, tmp_path):
    """The prompt order is the seed's: the refusal said "does not fit the data in None" (GRPO has no data.path)."""
    run = tmp_path / "run"
    shutil.copytree(grpo_runs[2], run)
    result = run_job(*_grpo_args(policy, prompt_dir, run, "train.seed=7", rewards=["format:[A-Z].*"],
                                 extra=["--zero-stage", 2, "--resume", "auto"]))
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"zerollm: error: {run}: global_step8 does not fit the data in "
                                f"{prompt_dir / 'prompts.jsonl'} (")


def test_a_resume_by_another_stage_names_the_stage(grpo_runs, pretrain_data, tmp_path):
    """`train pretrain --resume auto` into a GRPO run compared its tokens.h5 with the run's prompt file and said
    "not the data ... was trained on", with the digests mislabelled; the stage was never named."""
    run = tmp_path / "run"
    shutil.copytree(grpo_runs[2], run)
    sets = [a for o in TINY for a in ("--set", o)]
    result = run_job("train", "pretrain", "--recipe", "demo", "--data", pretrain_data, "--out", run, "--resume",
                     "auto", "--nproc", 1, *sets)
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and errors == [
        f"zerollm: error: {run}: its checkpoints cannot resume with these changes (train.stage grpo there, pretrain "
        f"here); resume with the values there, or start a new run with --init-from {run}"], result.stderr[-3000:]


@pytest.mark.parametrize("found_at, log_every, save_every, setting, what", [
    (2, 1, 4, "train.lr=1e30", "gradient norm is inf"),  # at a logged step
    (2, 3, 2, "grpo.kl_coef=1e30", "gradient norm is inf"),  # before a checkpoint, from a finite loss
])
def test_a_run_that_diverged_ends_before_it_is_saved(policy, prompt_dir, tmp_path, found_at, log_every, save_every,
                                                     setting, what):
    """A diverged run's loss was NaN or its gradient norm Infinity, written as such into metrics.jsonl (not JSON) and
    saved, and the run ended with exit 0 (sampled at a temperature of 1e-45, now refused, every step's loss was)."""
    run = tmp_path / "run"
    sets = [f"train.log_every={log_every}", f"train.save_every={save_every}", setting]
    result = run_job(*_grpo_args(policy, prompt_dir, run, *sets, rewards=["format:[A-Z].*"]))
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and errors == [
        f"zerollm: error: step {found_at}: the {what} (no longer a number: the weights, gradients or "
        "activations overflowed); stopped without saving; no checkpoint was saved before: lower train.lr, or change "
        "what made the run diverge"], result.stderr[-3000:]
    assert not (run / "checkpoints" / "latest").exists()
    logged = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    assert all(json.loads(line)["step"] < found_at for line in logged)  # nothing of the diverged step


def test_a_reward_that_fails_on_one_rank_is_one_line(policy, prompt_dir, tmp_path):
    """Each rank scores its own completions. A reward that raised on rank 1 alone left rank 0 in its next
    collective: its line came with rank 0's traceback of a lost connection and the watchdog's advice to replace a
    failed node."""
    (tmp_path / "rankfail.py").write_text(
        "import os\n\ndef score(prompts, completions, **fields):\n"
        "    if os.environ['RANK'] == '1':\n        raise ValueError('no score on rank 1')\n"
        "    return [0.0] * len(completions)\n")
    result = run_job(*_grpo_args(policy, prompt_dir, tmp_path / "run", "train.max_steps=2", rewards=["rankfail:score"]),
                     cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and errors == [
        "zerollm: error: --reward rankfail:score: raised ValueError: no score on rank 1 (at "
        f"{tmp_path / 'rankfail.py'}:5); nothing was trained, nothing saved"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "stopped responding" not in result.stderr + result.stdout


def test_a_reward_that_fails_mid_run_keeps_the_steps_before_it_and_the_resume_is_exact(grpo_runs, policy,
                                                                                         prompt_dir, tmp_path):
    """A reward that raised at step 6 ended the run without saving: step 5, complete, was lost with every step
    since the checkpoint of step 4 (hundreds at the default train.save_every)."""
    (tmp_path / "flaky.py").write_text(  # myrewards:capital, but for a failure at the call that fail_at names
        "import os\n\nCALLS = [0]\n\ndef capital(prompts, completions, **fields):\n    CALLS[0] += 1\n"
        "    if os.path.exists('fail_at') and CALLS[0] == int(open('fail_at').read()):\n"
        "        raise RuntimeError('scorer offline')\n"
        "    return [float('A' <= text.strip()[:1] <= 'Z') for text in completions]\n")
    (tmp_path / "fail_at").write_text("6")
    run = tmp_path / "run"
    args = _grpo_args(policy, prompt_dir, run, rewards=["flaky:capital"], extra=["--zero-stage", 3])
    result = run_job(*args, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerollm: error:")]
    assert result.returncode == 2 and errors == [
        f"zerollm: error: --reward flaky:capital: raised RuntimeError: scorer offline (at {tmp_path / 'flaky.py'}:8); "
        f"step 5 is saved in {run}; rerun with --resume auto once it is corrected"], result.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == "global_step5"
    (tmp_path / "fail_at").unlink()
    result = run_job(*args, "--resume", "auto", cwd=tmp_path, name="resumed")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_trained_alike(grpo_runs[3], run, steps=8)


def test_a_second_ctrl_c_stops_a_hung_run_at_once(policy, prompt_dir, tmp_path):
    """A Ctrl-C (the terminal signals every process of the job: the command and both ranks, which the command also
    forwards it to) asks for a stop after the step; a reward that hangs never lets the step end, and a second Ctrl-C
    did nothing, so the run held until grpo.reward_timeout_s (600 s). Now the first is acknowledged and the second
    stops every rank at once, without a checkpoint."""
    (tmp_path / "hangs.py").write_text("import os, pathlib, time\n\ndef score(prompts, completions, **fields):\n"
                                       "    pathlib.Path(os.environ['RANK'] + '.hung').touch()\n    time.sleep(600)\n")
    args = _grpo_args(policy, prompt_dir, tmp_path / "run", rewards=["hangs:score"], extra=["--wandb", "offline"])
    with open(tmp_path / "run.log", "w") as log:
        job = subprocess.Popen([sys.executable, "-m", "llm", *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
                               cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"{rank}.hung").exists() for rank in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGINT)
        time.sleep(3)  # more than FORCE_AFTER_S: the forwarded copy of this Ctrl-C must not count as a second
        first = (tmp_path / "run.log").read_text()
        assert job.poll() is None and first.count("zerollm: stopping with a checkpoint when this step ends; a "
                                                  "second Ctrl-C (or SIGTERM) stops at once, without one") == 1, first
        os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert (tmp_path / "run.log").read_text().count(
        "zerollm: stopped at once by a second signal, without a checkpoint; rerun with --resume auto to continue "
        "from the last complete one") == 1
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
    (wandb_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")  # its run ended all the same:
    exits = [record.exit.exit_code for record in wandb_records(wandb_file)  # it was left with no exit code, often
             if record.WhichOneof("record_type") == "exit"]  # with no records at all (os._exit skipped its finish)
    assert exits == [128 + signal.SIGINT]


@pytest.mark.parametrize("case, message", [
    ("missing prompts", "no-such-prompts.jsonl: no such file or directory"),
    ("bad reward", "--reward nosuchmodule:fn: cannot import nosuchmodule"),
    ("no usable prompt", "no usable prompt"),
    ("too few prompts", "1 usable prompts, fewer than one step takes (4 over all ranks: train.micro_batch_size"),
    ("narrow reward", "narrow_score.py:score: cannot take the prompt records' fields (got an unexpected keyword"),
])
def test_bad_prompts_and_rewards_are_one_line_errors_before_training(policy, prompt_dir, tmp_path, case, message,
                                                                     monkeypatch, capfd):
    prompts, reward = prompt_dir / "prompts.jsonl", "exact_match"
    if case == "missing prompts":
        prompts = tmp_path / "no-such-prompts.jsonl"
    elif case == "bad reward":
        reward = "nosuchmodule:fn"
    elif case == "narrow reward":  # it failed at the first rollout: the records have an answer it cannot take
        (tmp_path / "narrow_score.py").write_text("def score(prompts, completions):\n    return [0.0]\n")
        monkeypatch.setattr(sys, "path", list(sys.path))
        monkeypatch.delitem(sys.modules, "narrow_score", raising=False)
        reward = f"{tmp_path / 'narrow_score.py'}:score"
    elif case == "no usable prompt":
        prompts = tmp_path / "answerless.jsonl"
        prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")  # exact_match needs an answer
    else:
        prompts = tmp_path / "one.jsonl"
        prompts.write_text(json.dumps({"prompt": "hi", "answer": "1"}) + "\n")
    args = _grpo_args(policy, prompt_dir, tmp_path / "run", rewards=[reward])
    args[args.index("--prompts") + 1] = prompts
    if "few" in case:  # found by every rank's trainer (it was said once per rank), in processes of their own
        result = run_job(*args)
        code, stderr = result.returncode, result.stderr
    else:  # found by the launching process before it starts a rank: `zerollm` run in this one
        code = zerollm_here(monkeypatch, *args)
        stderr = capfd.readouterr().err
    assert code == 2 and message in stderr, stderr[-2000:]
    assert stderr.count("zerollm: error:") == 1 and "Traceback" not in stderr
    assert not (tmp_path / "run").exists()


# ---- rollouts generated a micro-batch at a time -------------------------------------------------------------------

def _rollouts(policy, prompt_dir, micro, accum, group, *overrides):
    """GRPO's step source in this process on one rank, as under ZeRO-2 (the engine's own module generates), and the
    prompts of its first step."""
    from llm.runtime.distributed import DistInfo
    cfg = build_config("demo", [*TINY, *GRPO_SETTINGS, "model.init_std=0.2", "train.stage=grpo",
                                f"train.init_from={policy}", f"grpo.prompts={prompt_dir / 'prompts.jsonl'}",
                                "grpo.reward=length", f"train.micro_batch_size={micro}", f"train.grad_accum={accum}",
                                f"grpo.group_size={group}", *overrides])
    tokenizer, reward, prompts = rollout.grpo_inputs(cfg)
    assert len(prompts) == 32 and not prompts.skipped  # both shapes
    torch.manual_seed(0)
    engine = SimpleNamespace(module=Transformer(cfg.model).eval(), zero_optimization_stage=lambda: 2)
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    source = rollout.Rollouts(cfg, info, engine, tokenizer, reward)
    return cfg, source, [prompts[i] for i in range(source.draw_size)]


def _generation_calls(monkeypatch):
    """The (rows, seed) of every generation call from now on."""
    from llm.infer.generate import TextGenerator
    calls, token_steps = [], TextGenerator.token_steps

    def recorded(self, prompts, params, use_cache=True):
        calls.append((len(prompts), params.seed))
        return token_steps(self, prompts, params, use_cache)

    monkeypatch.setattr(TextGenerator, "token_steps", recorded)
    return calls


def test_the_rollout_batch_size_is_whole_groups():
    base = ["train.stage=grpo", "train.init_from=x", "grpo.prompts=p.jsonl", "grpo.group_size=4"]
    with pytest.raises(UserError, match=r"grpo.rollout_batch_size \(6\) must be a multiple of grpo.group_size \(4\)"):
        build_config("demo", [*base, "grpo.rollout_batch_size=6"])
    assert build_config("demo", [*base, "grpo.rollout_batch_size=8"]).grpo.rollout_batch_size == 8


@pytest.mark.parametrize("micro, accum, group, chunk, rows", [
    (8, 2, 4, 0, [8, 8]), (4, 4, 8, 0, [8, 8]), (12, 2, 8, 0, [8, 8, 8]), (16, 1, 8, 0, [16]),
    (8, 2, 4, 16, [16]), (8, 2, 4, 4, [4, 4, 4, 4])])
def test_rollouts_are_generated_at_most_a_micro_batch_at_a_time(policy, prompt_dir, monkeypatch, micro, accum, group,
                                                                chunk, rows):
    """A step's completions were one generation call, whose KV cache holds rows x (longest prompt + max_new_tokens)
    positions: it grew with train.grad_accum (an 8B policy at micro 8 x accum 8 with 1k + 4k tokens: 40 GiB), and a
    lower micro-batch with more accumulation, the usual remedy, changed nothing. Now whole groups, at most
    max(micro_batch_size, group_size) rows a call (or grpo.rollout_batch_size), put back together in order."""
    chunk_set = [f"grpo.rollout_batch_size={chunk}"] if chunk else []  # 0: the default, as the user sets nothing
    cfg, source, drawn = _rollouts(policy, prompt_dir, micro, accum, group, *chunk_set)
    calls = _generation_calls(monkeypatch)
    batches = source.step_batches(lambda: drawn, 3)
    assert [n for n, _ in calls] == rows
    assert [len(b["tokens"]) for b in batches.micro_batches] == [micro] * accum
    tokens = [row for b in batches.micro_batches for row in b["tokens"].tolist()]
    for row, prompt in zip(tokens, [p for p in drawn for _ in range(group)], strict=True):  # in order, `group` each
        assert row[:len(prompt.ids)] == prompt.ids
    lengths = torch.cat([b["mask"].sum(1) for b in batches.micro_batches])
    assert len(lengths) == micro * accum and lengths.min() >= 1
    assert batches.generated_tokens == int(lengths.sum())  # the rollout tokens/s counts every chunk's tokens
    advantages = torch.cat([b["advantages"] for b in batches.micro_batches])
    torch.testing.assert_close(advantages, group_advantages(-lengths.float() / cfg.grpo.max_new_tokens, group, True))


def test_a_step_logs_its_mean_completion_length_and_leaves_advantages_unscaled_as_set(policy, prompt_dir):
    """No test set grpo.scale_rewards=false (Dr. GRPO), and the logged completion_length was pinned only between 1
    and max_new_tokens: the setting ignored, or the longest completion logged, passed."""
    cfg, source, drawn = _rollouts(policy, prompt_dir, 8, 1, 4, "grpo.scale_rewards=false")
    lengths = [1, 2, 3, 6, 6, 3, 2, 1]  # sampled completions of these lengths (a random policy's all run to the end)
    source._sample = lambda ids, step: ([[5] * n for n in lengths], ["x"] * len(ids))
    batches = source.step_batches(lambda: drawn, 0)
    assert batches.metrics["completion_length"].item() == 3.0  # the mean, as docs/grpo.md says
    advantages = torch.cat([b["advantages"] for b in batches.micro_batches])  # reward -n/6 less its group's mean
    torch.testing.assert_close(advantages, torch.tensor([2, 1, 0, -3, -3, 0, 1, 2]) / 6)


def test_a_prompt_leaving_no_room_for_its_completion_is_skipped(policy, tmp_path):
    """A prompt longer than data.seq_len - grpo.max_new_tokens tokens (26 here) is skipped: the limit was pinned only
    with read_prompts' own argument."""
    path = tmp_path / "prompts.jsonl"
    cfg = build_config("demo", [*TINY, *GRPO_SETTINGS, "train.stage=grpo", f"train.init_from={policy}",
                                f"grpo.prompts={path}", "grpo.reward=length"])
    short, long = "Tell me about the sea.", "Tell me about the sea, the sea."
    sizes = [len(encode_prompt(Tokenizer.load(policy), [{"role": "user", "content": text}], None))
             for text in (short, long)]
    assert sizes[0] <= 26 < sizes[1] <= cfg.data.seq_len  # the long one has room for itself, not for 6 tokens more
    path.write_text(json.dumps({"prompt": short}) + "\n" + json.dumps({"prompt": long}) + "\n")
    _, _, prompts = rollout.grpo_inputs(cfg)
    assert [p.messages[-1]["content"] for p in prompts] == [short]
    assert prompts.skipped == [f"{path}:2: prompt of {sizes[1]} tokens is longer than data.seq_len - "
                               "grpo.max_new_tokens = 26"]


@pytest.mark.parametrize("accum", [1, 2])
def test_each_chunk_samples_as_one_generation_call_with_its_seed(policy, prompt_dir, accum):
    """One chunk (train.grad_accum 1) samples exactly what the step's single generation call did (the measured
    examples and the demo depend on it); with more, chunk i takes word i of the step's seed sequence."""
    import numpy as np

    from llm.infer.generate import TextGenerator
    from llm.infer.sampling import SamplingParams
    cfg, source, drawn = _rollouts(policy, prompt_dir, 8, accum, 4)
    ids = [p.ids for p in drawn for _ in range(4)]
    completions, texts = source._sample(ids, 5)
    g, generator = cfg.grpo, TextGenerator(source.engine.module, source.tokenizer)
    seeds = np.random.SeedSequence([cfg.train.seed, 0, 5]).generate_state(accum)
    expected = []
    for i, seed in enumerate(seeds):
        params = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                                top_p=g.top_p, seed=int(seed))
        steps = [next_ids for next_ids, _ in generator.token_steps(ids[8 * i:8 * i + 8], params)]
        expected += torch.stack(steps, 1).tolist()
    stop = set(generator.stop_ids.tolist())
    ends = [next((i + 1 for i, token in enumerate(row) if token in stop), len(row)) for row in expected]
    assert completions == [row[:end] for row, end in zip(expected, ends, strict=True)]
    assert len(texts) == 8 * accum


def test_grpo_resume_with_grad_accum_is_bit_exact(policy, prompt_dir, tmp_path):
    """Generated in chunks, a step still samples what it did before the run was killed."""
    sets = ["train.micro_batch_size=8", "train.grad_accum=2", "train.max_steps=4", "train.save_every=2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_job(*_grpo_args(policy, prompt_dir, straight, *sets, rewards=["format:[A-Z].*"]), name="straight")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    args = _grpo_args(policy, prompt_dir, killed, *sets, rewards=["format:[A-Z].*"])
    latest = killed / "checkpoints" / "latest"
    kill_when(lambda: latest.is_file() and latest.read_text() == "global_step2", *args)
    result = run_job(*args, "--resume", "auto", name="resumed")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_trained_alike(straight, killed, steps=4)


def test_a_reward_that_fails_leaves_the_rngs_as_the_step_found_them(policy, prompt_dir):
    """The step saved after a failed reward is the one before it: a reward that drew from the global RNGs before
    it failed had moved them, and the resumed run drew otherwise than the run would have."""
    import random

    import numpy as np

    from llm.errors import StepInputError
    from llm.train.rewards import RewardTerm

    cfg, source, prompts = _rollouts(policy, prompt_dir, 8, 1, 4)

    def draws_then_fails(batch):
        random.random(), np.random.rand(), torch.rand(3)
        raise UserError("--reward draws:score: raised RuntimeError: scorer offline")

    source.reward.terms = [RewardTerm("score", 1.0, draws_then_fails)]
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with pytest.raises(StepInputError, match="scorer offline"):
        source.step_batches(lambda: prompts, 0)
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])


def test_a_reward_module_whose_name_a_library_has_says_to_give_its_path(tmp_path, monkeypatch):
    """A yaml.py of the user's beside the run: `--reward yaml:score` imported PyYAML (loaded already), and the error
    said 'yaml has no function score', of a file that has one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "yaml.py").write_text("def score(prompts, completions, **fields):\n    return [1.0] * len(prompts)\n")
    with pytest.raises(UserError, match=r"^--reward yaml:score: the name yaml is an installed module's \(.*\), not "
                                        r"your yaml.py's; give the path of its file: --reward yaml.py:score$"):
        Reward(["yaml:score"], 4, torch.device("cpu"))
    assert Reward(["yaml.py:score"], 4, torch.device("cpu"))(_completions(["a"]))[0].tolist() == [1.0]


def test_the_reference_log_probabilities_are_at_the_sampling_temperature(policy, prompt_dir):
    """With grpo.temperature other than 1 the reference scored at temperature 1 (a mutation no test caught): the KL
    term is 0 at the first step (the policy is the reference) only where both score at the sampling temperature."""
    cfg, source, drawn = _rollouts(policy, prompt_dir, 8, 1, 4, "grpo.temperature=0.5")
    model = source.engine.module
    source.reference = model  # the policy is its own reference, as at step 1
    ids = [p.ids for p in drawn for _ in range(4)]
    completions, _ = source._sample(ids, 0)
    batch = source._micro_batch(ids[:8], completions[:8], torch.zeros(8))
    with torch.no_grad():
        expected = model(batch["tokens"], batch["targets"], logps_temperature=0.5).token_logps
    mask = batch["mask"].bool()
    torch.testing.assert_close(batch["ref_logps"][mask], expected[mask])


def test_the_format_reward_needs_the_whole_stripped_completion_to_match():
    """A prefix match scored 1, or a completion with a newline around it 0, and every test passed."""
    reward = Reward(["format"], 4, torch.device("cpu"))
    texts = ["<think>a</think> <answer>1</answer>", "\n<think>a</think>\n<answer>1</answer>\n",
             "<think>a</think><answer>1</answer> and then some more text",
             "<think>a\nb</think><answer>1\n2</answer>", "<think>a</think><answer></answer>"]  # '.' is any character
    assert reward(_completions(texts))[1]["format"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    custom = Reward(["format:[0-9]+"], 4, torch.device("cpu"))
    assert custom(_completions(["12", " 12\n", "12ab"]))[1]["format"].tolist() == [1.0, 1.0, 0.0]
    dotall = Reward(["format:a.b"], 4, torch.device("cpu"))  # a REGEX's '.' is any character too, as documented
    assert dotall(_completions(["a\nb", "a\n\nb"]))[1]["format"].tolist() == [1.0, 0.0]


def test_reward_std_is_the_mean_of_the_groups_standard_deviations():
    total = torch.tensor([0.0, 1.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0])
    expected = torch.tensor([0.0, 1.0, 0.0, 1.0]).std().item() / 2  # the second group's std is 0
    assert reward_metrics(total, {}, 4)["reward/std"].item() == pytest.approx(expected)


def test_rollouts_and_training_samples_stop_at_the_end_tokens_the_base_declares(policy, prompt_dir, tmp_path):
    """Llama 3.1's <|eom_id|> is in its generation_config.json's eos_token_id alone: rollouts and the samples at each
    evaluation ran on past it, where generate stops."""
    from llm.runtime.distributed import DistInfo
    from llm.train import job

    base = tmp_path / "base"
    shutil.copytree(policy, base)
    declared = 300
    (base / GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": [declared, 7]}))
    cfg, source, _ = _rollouts(base, prompt_dir, 8, 1, 4)
    assert declared not in Tokenizer.load(base).stop_ids
    assert {declared, 7} <= set(source.tokenizer.stop_ids)
    cfg.train.sample_prompts = ["Once"]
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    assert {declared, 7} <= job._sample_generator(cfg, source.engine, info, chat=True).stop_ids
