"""A model folder's generation_config.json sets the sampling that generate, chat and serve use where an option or a
request field leaves it out, as transformers' `generate` and vLLM do."""

import json
import shutil

import pytest
from forked_ranks import run_job

from conftest import train_args, zerollm_here
from llm.errors import UserError
from llm.infer.generate import TextGenerator
from llm.infer.sampling import SamplingParams
from llm.infer.server import parse_options
from llm.infer.suggested_sampling import (
    declared_stop_ids,
    generation_config_text,
    suggested_sampling,
    unapplied_settings,
)
from llm.loading import load_for_inference
from llm.rundir import GENERATION_CONFIG_FILE, HF_CONFIG_FILE

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
"""Qwen3-0.6B's generation_config.json."""


def _with_generation_config(tiny_export, tmp_path, config) -> str:
    folder = tmp_path / "model"
    shutil.copytree(tiny_export, folder)
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / GENERATION_CONFIG_FILE).write_text(text)
    return folder


def test_the_suggested_sampling_is_read_and_do_sample_false_is_greedy(tmp_path):
    assert suggested_sampling(tmp_path) == {}
    (tmp_path / GENERATION_CONFIG_FILE).write_text(json.dumps(QWEN3))
    assert suggested_sampling(tmp_path) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    (tmp_path / GENERATION_CONFIG_FILE).write_text(json.dumps({"do_sample": False, "temperature": 0.7,
                                                                "repetition_penalty": 1.1}))
    assert suggested_sampling(tmp_path) == {"temperature": 0.0, "repetition_penalty": 1.1}  # transformers' greedy
    (tmp_path / GENERATION_CONFIG_FILE).write_text(json.dumps({"do_sample": True, "top_k": 50}))
    assert suggested_sampling(tmp_path) == {"temperature": 1.0, "top_k": 50}  # sampling at transformers' default: it
    # was greedy (the options' temperature 0), the note saying it sampled
    (tmp_path / GENERATION_CONFIG_FILE).write_text(json.dumps({"top_k": -1, "repetition_penalty": 1e308}))
    assert suggested_sampling(tmp_path) == {"top_k": 0, "repetition_penalty": 1e308}  # vLLM's off; a float (was inf)


@pytest.mark.parametrize("text, said", [
    ('{"top_k": 2.5}', "top_k is 2.5, not an integer"),
    ('{"temperature": 1' + "0" * 400 + '}', "temperature must be a finite number >= 0, got inf"),  # no float holds it
    ('{"temperature": NaN}', "temperature must be a finite number >= 0, got nan"),  # said as inf
    ('{"temperature": "hot"}', "temperature is 'hot', not a number"),
    ('{"temperature": true}', "temperature is True, not a number"),  # true is 1 in Python, never a temperature
    ('{"top_p": 0}', "top_p must be a number in (0, 1], got 0.0"),
    ('{"repetition_penalty": -1}', "repetition_penalty must be a finite number > 0, got -1.0"),
    ("[1]", "not a JSON object"),
    ("{", "cannot be read (JSONDecodeError)"),
])
def test_a_generation_config_that_cannot_be_used_is_one_line(tmp_path, text, said):
    (tmp_path / GENERATION_CONFIG_FILE).write_text(text)
    with pytest.raises(UserError) as refused:
        suggested_sampling(tmp_path)
    assert str(refused.value) == f"{tmp_path / GENERATION_CONFIG_FILE}: {said}; fix or remove it"


def _generated(monkeypatch, capsys, model, *options) -> tuple[str, str]:
    assert zerollm_here(monkeypatch, "generate", "--model", model, "--prompt", "To be", "--max-new-tokens", 12,
                        "--seed", 3, *options) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_generate_samples_as_the_model_folder_suggests_unless_an_option_says_otherwise(tiny_export, tmp_path,
                                                                                        monkeypatch, capsys):
    """Qwen3's folder decoded greedily, which its authors warn ends in endless repetitions."""
    folder = _with_generation_config(tiny_export, tmp_path, {"do_sample": True, "temperature": 1.5, "top_p": 0.9})
    suggested, note = _generated(monkeypatch, capsys, folder)
    assert note == (f"zerollm: note: sampling as {folder / GENERATION_CONFIG_FILE} suggests: temperature 1.5, top_p "
                    "0.9 (an option given overrides it)\n")
    assert (suggested, "") == _generated(monkeypatch, capsys, tiny_export, "--temperature", 1.5, "--top-p", 0.9)
    greedy, _ = _generated(monkeypatch, capsys, tiny_export)
    assert suggested != greedy
    assert _generated(monkeypatch, capsys, folder, "--temperature", 0) == (
        greedy, f"zerollm: note: sampling as {folder / GENERATION_CONFIG_FILE} suggests: top_p 0.9 (an option given "
                "overrides it)\n")
    (folder / GENERATION_CONFIG_FILE).write_text('{"top_k": -3}')
    assert zerollm_here(monkeypatch, "generate", "--model", folder, "--prompt", "To be") == 2
    assert capsys.readouterr().err == (f"zerollm: error: {folder / GENERATION_CONFIG_FILE}: top_k must be an integer "
                                       ">= 0 (0: off), got -3; fix or remove it\n")


def test_generation_stops_at_the_end_tokens_the_model_folder_declares(tiny_export, tmp_path, monkeypatch, capsys):
    """Llama 3.1's <|eom_id|> is in its config.json's and generation_config.json's eos_token_id, but neither the
    tokenizer's end of text nor its end of turn: replies ran on past it, where transformers' generate stops."""
    model, tokenizer = load_for_inference(tiny_export)
    prompt = tokenizer.encode("To be")
    sampled = [int(token) for token, _ in TextGenerator(model, tokenizer, stop_token_ids=[]).token_steps(
        [prompt], SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))]
    stop = next(token for token in sampled[2:] if token not in sampled[:2])
    expected = tokenizer.decode(sampled[:sampled.index(stop)], skip_special_tokens=True)
    for name, declared in ((HF_CONFIG_FILE, stop), (GENERATION_CONFIG_FILE, [tokenizer.eos_id, -1, stop])):
        folder = tmp_path / name
        shutil.copytree(tiny_export, folder)
        config = json.loads((folder / name).read_text()) if (folder / name).is_file() else {}
        (folder / name).write_text(json.dumps({**config, "eos_token_id": declared}))
        assert zerollm_here(monkeypatch, "generate", "--model", folder, "--prompt", "To be", "--max-new-tokens", 12,
                            "--temperature", 1, "--seed", 3) == 0
        assert capsys.readouterr().out == expected + "\n"
    (folder / GENERATION_CONFIG_FILE).write_text('{"eos_token_id": ["<|eom_id|>"]}')
    assert zerollm_here(monkeypatch, "generate", "--model", folder, "--prompt", "To be") == 2
    assert capsys.readouterr().err == (f"zerollm: error: {folder / GENERATION_CONFIG_FILE}: eos_token_id is "
                                       "['<|eom_id|>'], not a token id or a list of them; fix or remove it\n")


def test_every_end_token_declared_is_read_token_0_too(tmp_path):
    """Id 0 (MiniMind's end of text) declared in a list was unpinned; a negative id is no token."""
    (tmp_path / GENERATION_CONFIG_FILE).write_text('{"eos_token_id": [0, 2, -1]}')
    assert declared_stop_ids(tmp_path) == {0, 2}


def test_decoding_settings_the_sampler_has_not_are_named(tiny_export, tmp_path, monkeypatch, capsys):
    """A generation_config.json's min_p (or no_repeat_ngram_size, num_beams, ...) was dropped without a word: the
    note named the temperature alone, and the text differed from transformers'."""
    folder = _with_generation_config(tiny_export, tmp_path, {"do_sample": True, "min_p": 0.99, "num_beams": 1,
                                                             "no_repeat_ngram_size": 2, "typical_p": 1.0})
    _, note = _generated(monkeypatch, capsys, folder)
    path = folder / GENERATION_CONFIG_FILE
    assert note == (f"zerollm: note: sampling as {path} suggests: temperature 1 (an option given overrides it); "
                    "min_p 0.99, no_repeat_ngram_size 2, which zerollm's sampler does not apply\n")
    _, note = _generated(monkeypatch, capsys, folder, "--temperature", 0)
    assert note == (f"zerollm: note: {path} sets min_p 0.99, no_repeat_ngram_size 2, which zerollm's sampler does not "
                    "apply\n")
    path.write_text(json.dumps({"min_p": None, "bad_words_ids": [], "suppress_tokens": [], "sequence_bias": {}}))
    assert unapplied_settings(folder) == []  # null, [] and {} ask for nothing: they were unpinned


def test_a_request_that_leaves_sampling_out_takes_what_the_model_suggests():
    params = parse_options({}, 16, {"temperature": 0.6, "top_k": 20}).params
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.6, 20, 1.0, 1.0)
    params = parse_options({"temperature": 0.2, "top_k": -1, "top_p": None}, 16, {"temperature": 0.6, "top_k": 20,
                                                                                   "top_p": 0.95}).params
    assert (params.temperature, params.top_k, params.top_p) == (0.2, 0, 0.95)  # null takes the default
    params = parse_options({}, 16).params
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 1.0)  # OpenAI's
    assert parse_options({}, 16, {"temperature": 3.0}).params.temperature == 3.0  # beyond OpenAI's bound of 2: a
    # request that left it out was refused, naming a temperature it never sent


def test_a_run_tuned_from_a_model_folder_keeps_its_generation_config_and_exports_it(zero_runs, pretrain_data, tmp_path,
                                                                                    monkeypatch, capsys):
    """The run and its export dropped it, as transformers' Trainer does not: the tuned model decoded greedily where
    its base sampled."""
    base, run, export = tmp_path / "base", tmp_path / "run", tmp_path / "export"
    assert zerollm_here(monkeypatch, "export", "--run", zero_runs[2], "--out", base) == 0
    suggestion = json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "transformers_version": "4.51.0"})
    (base / GENERATION_CONFIG_FILE).write_text(suggestion)
    result = run_job(*train_args(pretrain_data, run, "train.max_steps=1", extra=["--init-from", base]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / GENERATION_CONFIG_FILE).read_text() == suggestion
    assert zerollm_here(monkeypatch, "export", "--run", run, "--out", export) == 0
    assert (export / GENERATION_CONFIG_FILE).read_text() == suggestion
    capsys.readouterr()
    assert zerollm_here(monkeypatch, "generate", "--model", run, "--prompt", "To be", "--max-new-tokens", 2) == 0
    assert capsys.readouterr().err == (f"zerollm: note: sampling as {run / GENERATION_CONFIG_FILE} suggests: "
                                       "temperature 0.7, top_p 0.9 (an option given overrides it)\n")
    (base / GENERATION_CONFIG_FILE).write_text('{"top_p": 7}')  # said before any rank starts
    assert zerollm_here(monkeypatch, *train_args(pretrain_data, tmp_path / "other", extra=["--init-from", base])) == 2
    assert capsys.readouterr().err == (f"zerollm: error: {base / GENERATION_CONFIG_FILE}: top_p must be a number in "
                                       "(0, 1], got 7.0; fix or remove it\n")


def test_an_exports_generation_config_stops_where_its_config_does(tokenizer_dir, tmp_path):
    """The copy kept its base's token ids, which transformers' generate takes over config.json's: a base naming its
    end of text alone (Qwen2.5's) or LlamaConfig's defaults (bos 1, eos 2: other tokens of this tokenizer), and the
    exported chat model ran past its end of turn in transformers where zerollm stopped. Stop ids of its own beyond
    the tokenizer's (Llama 3.1's end of a tool call) are kept after them."""
    from llm.config import ModelConfig
    from llm.export import export_model
    from llm.model import Transformer

    model = Transformer(ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64))
    (tmp_path / "generation.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [0, 7],
                                                          "pad_token_id": 0, "temperature": 0.6}))
    export_model(model, tokenizer_dir, tmp_path / "export", tmp_path / "generation.json")
    config = json.loads((tmp_path / "export" / HF_CONFIG_FILE).read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, [0, 2], 3)
    assert json.loads((tmp_path / "export" / GENERATION_CONFIG_FILE).read_text()) == {
        "bos_token_id": None, "eos_token_id": [0, 2, 7], "pad_token_id": 3, "temperature": 0.6}
    (tmp_path / "generation.json").write_text(json.dumps({"eos_token_id": None}))  # was [0, 2, null]: refused
    export_model(model, tokenizer_dir, tmp_path / "export", tmp_path / "generation.json")  # by generate
    assert json.loads((tmp_path / "export" / GENERATION_CONFIG_FILE).read_text()) == {"eos_token_id": [0, 2]}
    (tmp_path / "generation.json").write_text(json.dumps({"temperature": 0.6}))  # ids it does not give: none added
    export_model(model, tokenizer_dir, tmp_path / "export", tmp_path / "generation.json")
    assert (tmp_path / "export" / GENERATION_CONFIG_FILE).read_text() == json.dumps({"temperature": 0.6})


def test_a_copy_of_a_generation_config_keeps_only_generation_settings(tmp_path):
    """A generation_config.json linked to a file elsewhere (a user's credentials in JSON), in a model folder handed
    over, was copied whole into every run tuned from it and every export of such a run."""
    from test_export import _model

    from llm.export import export_model

    secret = tmp_path / "kaggle.json"
    secret.write_text(json.dumps({"username": "victim", "key": "SECRET-KEY-123", "temperature": 0.6,
                                  "eos_token_id": [2, 3], "stop_strings": ["x" * 65, "<|im_end|>"],
                                  "nested": {"token": "SECRET"}, "_from_model_config": True}))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / GENERATION_CONFIG_FILE).symlink_to(secret)
    copied = generation_config_text(tmp_path / "model" / GENERATION_CONFIG_FILE)
    assert json.loads(copied) == {"temperature": 0.6, "eos_token_id": [2, 3], "stop_strings": ["<|im_end|>"],
                                  "_from_model_config": True}
    # in the file's order, the text setting among the others
    assert list(json.loads(copied)) == ["temperature", "eos_token_id", "stop_strings", "_from_model_config"]
    export_model(_model(0), None, tmp_path / "export", tmp_path / "model" / GENERATION_CONFIG_FILE)
    assert (tmp_path / "export" / GENERATION_CONFIG_FILE).read_text() == copied
    assert generation_config_text(tmp_path / "none.json") is None
    (tmp_path / "qwen3.json").write_text(json.dumps(QWEN3))  # generation settings alone: copied as they are
    assert generation_config_text(tmp_path / "qwen3.json") == json.dumps(QWEN3)
    (tmp_path / "shadow").write_text("root:*:20228:0:99999:7:::\n")
    with pytest.raises(UserError, match=r"shadow: cannot be read \(JSONDecodeError\); fix or remove it$"):
        generation_config_text(tmp_path / "shadow")
