"""Users' own Hugging Face assets: a Llama written by transformers, with its own (foreign) tokenizer, is fine-tuned
and exported back with equal logits; a QK-norm model exports as Qwen3; `--init-from` refuses a model whose RoPE or
norm settings differ from the run's instead of training it silently on other ones."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import h5py
import pytest
import torch
import yaml
from forked_ranks import run_job
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, run_cli
from llm import rundir
from llm.config import ModelConfig
from llm.data.prepare import RANDOM_TOKENS_HASH
from llm.errors import UserError
from llm.export import export_model, hf_config, import_model, model_config_from_hf
from llm.loading import initial_weights, load_for_inference, model_config_of, weights_summary
from llm.model import Transformer
from llm.runtime.fingerprint import file_digest, same_weights
from llm.tokenizer import Tokenizer

LLAMA_TOKENIZER = FIXTURES / "tokenizers" / "llama"
BASE_SHAPE = ["model.vocab_size=415", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.hidden_dim=160", "model.tie_embeddings=false", "model.max_seq_len=128"]
BASE_FUNCTION = ["model.rope_theta=500000.0", "model.norm_eps=1e-6"]
SFT = ["data.seq_len=48", "train.max_steps=2", "train.micro_batch_size=4", "train.warmup_steps=1",
       "train.eval_every=2", "train.eval_batches=1", "train.log_every=1", "train.precision=fp32"]


def _transformers_llama(directory):
    """What a user brings from the hub: `save_pretrained` of a Llama, and a Llama-style tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=415, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(LLAMA_TOKENIZER / name, directory / name)


def _sft_data(tmp_path, tokenizer):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"{a} plus {a}?"},
                                                        {"role": "assistant", "content": str(2 * a)}]})
                               for a in range(60)) + "\n")
    result = run_cli("data", "prepare", "--kind", "sft", "--input", chats, "--tokenizer", tokenizer,
                     "--out", tmp_path / "sft_data", "--workers", 1, "--val-fraction", 0.1, "--seq-len", 48)
    assert result.returncode == 0, result.stderr[-2000:]
    return tmp_path / "sft_data"


def _sft(base, data, out, *overrides):
    return run_job("train", "sft", "--recipe", "demo", "--init-from", base, "--data", data, "--out", out,
                   *[a for o in [*BASE_SHAPE, *SFT, *overrides] for a in ("--set", o)])


def test_a_transformers_llama_with_its_tokenizer_fine_tunes_and_exports_with_equal_logits(tmp_path, cli_here):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    _transformers_llama(base)
    data = _sft_data(tmp_path, base)
    result = _sft(base, data, tmp_path / "run", *BASE_FUNCTION)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    result = cli_here("export", "--run", tmp_path / "run", "--out", tmp_path / "export")
    assert result.returncode == 0, result.stderr[-2000:]
    assert Tokenizer.load(tmp_path / "export").hash == Tokenizer.load(base).hash
    ours, _ = load_for_inference(tmp_path / "run")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 415, (2, 29))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, ours(tokens).logits, atol=1e-4)
        base_logits = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()(tokens).logits
        assert not torch.allclose(base_logits, ours(tokens).logits, atol=1e-4)  # the fine-tuning changed it


def test_init_from_gives_the_run_its_model_s_shape_and_rope(tmp_path):
    """A downloaded model needed a recipe written for it: every model.* key the recipe did not share with it was
    refused ("the model differs from this run's config"). The recipe now brings the training settings only."""
    base = tmp_path / "base"
    _transformers_llama(base)
    data = _sft_data(tmp_path, base)
    result = run_job("train", "sft", "--recipe", "demo", "--init-from", base, "--data", data, "--out", tmp_path / "run",
                     *[a for o in SFT for a in ("--set", o)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "the model's shape and RoPE are --init-from" in result.stdout
    model = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert (model["dim"], model["n_layers"], model["vocab_size"], model["hidden_dim"], model["rope_theta"],
            model["norm_eps"], model["tie_embeddings"]) == (64, 2, 415, 160, 500000.0, 1e-6, False)


def _train_config(*argv):
    from llm.cli import _train_config, build_parser

    return _train_config(build_parser().parse_args(["train", *map(str, argv)]))


def test_the_run_s_settings_are_checked_against_the_init_from_model(tmp_path):
    """The recipe's model used to be validated before --init-from's replaced it: a LoRA rank the adopted model
    allows, or a --set model.n_heads equal to the model's own, was refused against the recipe's width."""
    torch.manual_seed(0)
    export_model(Transformer(ModelConfig(vocab_size=64, dim=192, n_layers=1, n_heads=6, n_kv_heads=3,
                                         max_seq_len=4096)), None, tmp_path / "export")
    common = ["sft", "--recipe", "demo", "--data", tmp_path / "data", "--out", tmp_path / "run",
              "--init-from", tmp_path / "export"]
    cfg = _train_config(*common, "--lora", "r=96,targets=wk", "--set", "model.n_heads=6")
    assert (cfg.model.dim, cfg.model.n_heads, cfg.model.kv_heads, cfg.lora.r) == (192, 6, 3, 96)
    assert cfg.model.max_seq_len == 4096  # its context, which export writes and chat and serve allow
    (tmp_path / "run").mkdir()
    cfg.save(rundir.config_file(tmp_path / "run"))  # as the run records it
    resumed = _train_config(*common[:-2], "--resume", "auto")  # without --init-from: the recorded model's shape
    assert (resumed.model.dim, resumed.model.n_heads, resumed.model.max_seq_len) == (192, 6, 4096)
    assert _train_config(*common[:-2]).model.dim == 128  # a new run without --init-from: the recipe's


def test_init_from_refuses_model_keys_set_otherwise(tmp_path):
    base = tmp_path / "base"
    _transformers_llama(base)
    result = _sft(base, _sft_data(tmp_path, base), tmp_path / "run", "model.rope_theta=10000", "model.norm_eps=1e-5")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert "model.rope_theta 500000.0 there, 10000.0 here" in message
    assert "model.norm_eps 1e-06 there, 1e-05 here" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("head_dim", [None, 32])
def test_a_qk_norm_model_exports_as_qwen3_with_equal_logits(tmp_path, head_dim):
    """head_dim 32 with dim 64 and 4 heads: a head wider than dim / n_heads, as Qwen3-0.6B's (128 with dim 1024 and
    16 heads) was refused ("head_dim 128 differs from hidden_size / num_attention_heads")."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    qk_norm=True, head_dim=head_dim)).eval()
    with torch.no_grad():  # norms away from their initial ones, so a missing norm would show in the logits
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    export_model(model, None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 21))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, model(tokens).logits, atol=1e-4)
        imported = import_model(tmp_path)
        assert imported.cfg.qk_norm and torch.equal(imported(tokens).logits, model(tokens).logits)
    assert config["head_dim"] == imported.cfg.attention_head_dim == (head_dim or 16)
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (4 * (head_dim or 16), 64)


def test_a_qwen2_model_imports_and_exports_with_transformers_logits(tmp_path):
    """Qwen2 and Qwen2.5 (Llama with biases on q, k and v) were refused ("not a Llama- or Qwen3-architecture
    config"): the most used small models to fine-tune could not be brought in."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases away from zero, so a missing one would show in the logits
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    model = import_model(tmp_path / "hf")
    assert model.cfg.qkv_bias and not model.cfg.qk_norm
    assert model.num_parameters() == model.cfg.parameter_count == sum(p.numel() for p in hf.parameters())
    tokens = torch.randint(0, 96, (2, 21))
    with torch.no_grad():
        assert torch.allclose(model(tokens).logits, hf(tokens).logits, atol=1e-4)
    assert export_model(model, None, tmp_path / "ours") == "Qwen2ForCausalLM"
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(again(tokens).logits, hf(tokens).logits, atol=1e-4)
        assert torch.equal(import_model(tmp_path / "ours")(tokens).logits, model(tokens).logits)


def test_a_model_whose_hidden_size_is_not_a_multiple_of_its_heads_exports_as_mistral(tmp_path):
    """dim 64, 3 heads of 6: transformers' Llama refuses such a config ("hidden size (64) is not a multiple of the
    number of attention heads (3)"), so the export did not load there."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=3, n_kv_heads=3, head_dim=6,
                                    max_seq_len=64)).eval()
    assert export_model(model, None, tmp_path) == "MistralForCausalLM"
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["sliding_window"] is None
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 21))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, model(tokens).logits, atol=1e-4)
        assert torch.equal(import_model(tmp_path)(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize("window", ["absent", 4095])
def test_a_mistral_model_with_a_sliding_window_is_refused(window):
    """A window shorter than the context (the class's default of 4096 where the key is absent, as Mistral-7B-v0.1
    has it) is attention we do not compute; null, or one covering every position, is full attention."""
    config = hf_config(_small(0).cfg, None)
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], max_position_embeddings=8192)
    config.pop("sliding_window", None)
    if window != "absent":
        config["sliding_window"] = window
    with pytest.raises(UserError) as refused:
        model_config_from_hf(config, "config.json")
    given = "4096 (absent: its class's default)" if window == "absent" else "4095"  # it named neither key nor value
    assert str(refused.value) == (f"config.json: 'sliding_window' {given} is a window of fewer positions than "
                                  "'max_position_embeddings' 8192: sliding-window attention is not part of our "
                                  "architecture (null, or a window of at least 8192, is full attention)")
    for full in (None, 8192, 32768):
        assert model_config_from_hf({**config, "sliding_window": full}, "config.json").max_seq_len == 8192


def test_a_qwen2_config_whose_sliding_window_reaches_no_layer_imports_with_transformers_logits(tmp_path):
    """`use_sliding_window: true` was refused outright; transformers windows a Qwen2 layer only from
    `max_window_layers` on, so with that at least the layer count (28 by default, as in Qwen2.5's configs) every
    layer attends to every position. A window that does reach a layer is still refused."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         use_sliding_window=True, sliding_window=8, max_window_layers=28)
    hf = Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 96, (2, 21))  # longer than the window: a window applied would change the logits
    with torch.no_grad():
        assert torch.allclose(import_model(tmp_path / "hf")(tokens).logits, hf(tokens).logits, atol=1e-4)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.pop("layer_types", None)  # as configs written before transformers 4.53 have it
    assert model_config_from_hf(raw, "config.json").n_layers == 2
    assert model_config_from_hf({**raw, "max_window_layers": 2}, "config.json").n_layers == 2  # from layer 2: none
    without_key = {k: v for k, v in raw.items() if k != "sliding_window"}  # transformers' default then: 4096
    for windowed in ({**raw, "max_window_layers": 1}, {**raw, "layer_types": ["full_attention", "sliding_attention"]},
                     {**without_key, "max_window_layers": 1, "max_position_embeddings": 32768}):
        with pytest.raises(UserError, match="sliding-window attention is not part of our architecture"):
            model_config_from_hf(windowed, "config.json")
    assert model_config_from_hf({**raw, "max_window_layers": 1, "sliding_window": None}, "config.json").n_layers == 2


def test_biases_qwen2_does_not_have_are_refused(tmp_path):
    config = hf_config(_small(0).cfg, None)
    with pytest.raises(UserError, match="'attention_bias' True: biases other than Qwen2's on q, k and v"):
        model_config_from_hf({**config, "attention_bias": True}, "config.json")
    both = dataclasses.replace(_small(0).cfg, qk_norm=True, qkv_bias=True)
    with pytest.raises(UserError, match="both model.qk_norm and model.qkv_bias has no Hugging Face class"):
        hf_config(both, None)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
"""Llama 3.1's RoPE scaling (Llama-3.2-1B: factor 32, original 8192) at a size where, with rope_theta 10000 and
heads of 16, all three bands occur: wavelengths below 64 / 4 kept, above 64 / 1 divided by 8, the rest blended."""


def test_a_llama3_rope_scaled_llama_imports_and_exports_with_transformers_logits(tmp_path):
    """Refused before ("RoPE scaling 'llama3' is not supported (only YaRN)"): Llama 3.1 and 3.2 could not be
    brought in."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_parameters={**LLAMA3_ROPE, "rope_theta": 10000.0}, tie_word_embeddings=False)
    wavelengths = [2 * math.pi * 10000.0 ** (i / 16) for i in range(0, 16, 2)]
    assert {"kept" if w < 64 / 4 else "divided" if w > 64 / 1 else "blended" for w in wavelengths} == {
        "kept", "divided", "blended"}
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights of std 0.2, so that logits are far apart wherever RoPE differs
        for parameter in hf.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    tokens = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(1))
    ours = import_model(tmp_path / "hf")
    cfg = ours.cfg
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len, cfg.llama3_low_freq_factor,
            cfg.llama3_high_freq_factor, cfg.rope_theta) == ("llama3", 8.0, 64, 1.0, 4.0, 10000.0)
    with torch.no_grad():
        expected = hf(tokens).logits
        assert torch.allclose(ours(tokens).logits, expected, atol=1e-4)
        plain = Transformer(dataclasses.replace(cfg, rope_scaling="none"))
        plain.load_state_dict(ours.state_dict())
        assert not torch.allclose(plain(tokens).logits, expected, atol=1e-2)  # the scaling shows in the logits
        export_model(ours, None, tmp_path / "export")
        assert json.loads((tmp_path / "export" / "config.json").read_text())["rope_scaling"] == LLAMA3_ROPE
        again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
        assert torch.allclose(again(tokens).logits, expected, atol=1e-4)


def test_init_from_and_resume_refuse_another_llama3_low_freq_factor_or_yarn_beta(tmp_path):
    """The frequency bands are part of the trained function, as model.rope_factor is."""
    from llm.train.job import RESUMED_FIELDS

    cfg = dataclasses.replace(_small(0).cfg, rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=16)
    export_model(Transformer(cfg), None, tmp_path / "export")
    assert initial_weights(cfg, str(tmp_path / "export"), RANDOM_TOKENS_HASH)
    with pytest.raises(UserError, match=r"\(model.llama3_low_freq_factor 1.0 there, 2.0 here\); set those model.\* "
                                        r"keys to the values there$"):
        initial_weights(dataclasses.replace(cfg, llama3_low_freq_factor=2.0), str(tmp_path / "export"),
                        RANDOM_TOKENS_HASH)
    # and YaRN's correction range, which went through silently
    yarn = dataclasses.replace(cfg, rope_scaling="yarn", rope_factor=4.0)
    export_model(Transformer(yarn), None, tmp_path / "yarn")
    with pytest.raises(UserError, match=r"\(model.yarn_beta_fast 32.0 there, 16.0 here\); set those"):
        initial_weights(dataclasses.replace(yarn, yarn_beta_fast=16.0), str(tmp_path / "yarn"), RANDOM_TOKENS_HASH)
    assert {f"model.{key}" for key in ("llama3_low_freq_factor", "llama3_high_freq_factor", "yarn_beta_fast",
                                       "yarn_beta_slow")} <= set(RESUMED_FIELDS)


@pytest.mark.parametrize("change, message", [
    ({"low_freq_factor": None}, "config.json rope_scaling: 'low_freq_factor' is missing"),
    ({"high_freq_factor": "4"}, "config.json rope_scaling: 'high_freq_factor' must be a positive number, got '4'"),
    ({"high_freq_factor": 1.0}, "config.json: model.rope_scaling=llama3 needs model.rope_factor >= 1, "
                                "model.rope_original_max_seq_len > 0 and 0 < model.llama3_low_freq_factor < "
                                "model.llama3_high_freq_factor, got 8.0, 64, 1.0 and 1.0"),
])
def test_llama3_rope_settings_transformers_cannot_compute_are_refused_in_one_line(change, message):
    """transformers fails on a missing factor (KeyError) and divides by zero on equal low and high factors."""
    config = {**hf_config(ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, max_seq_len=128), None),
              "rope_scaling": {k: v for k, v in {**LLAMA3_ROPE, **change}.items() if v is not None}}
    with pytest.raises(UserError) as exc:
        model_config_from_hf(config, "config.json")
    assert str(exc.value) == message


def _small(seed, vocab_size=96):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=64)).eval()


def test_a_sharded_exports_summary_covers_every_shard(tmp_path):
    """A shard replaced under an unchanged index is other weights: a LoRA run's base or a distilled run's teacher
    swapped that way must not pass as the one it was trained with."""
    export, other = tmp_path / "export", tmp_path / "other"
    export_model(_small(0), None, export)
    export_model(_small(1), None, other)
    shard = export / "model-00001-of-00001.safetensors"
    (export / "model.safetensors").rename(shard)
    names = sorted(load_file(str(shard)))
    (export / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                     "weight_map": {n: shard.name for n in names}}))
    before = weights_summary(export, "--init-from")
    assert "model.safetensors.index.json" in before["weights"]
    assert weights_summary(export, "--init-from") == before  # stable
    legacy = f"model.safetensors.index.json digest {file_digest(export / 'model.safetensors.index.json')}"
    assert same_weights(legacy, before["weights"])  # a run recorded before shards were digested still matches
    shutil.copy(other / "model.safetensors", shard)
    after = weights_summary(export, "--init-from")
    assert after["path"] == before["path"] and not same_weights(before["weights"], after["weights"])


@pytest.mark.parametrize("edited", [0, (3 << 20) - 1])
def test_a_weights_file_changed_in_its_first_or_last_byte_has_another_digest(tmp_path, edited):
    """Unpinned: the last MiB of a file larger than two was not read (a file's tail changed passed as the same
    weights)."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))
    before = file_digest(weights)
    changed = bytearray(3 << 20)
    changed[edited] = 1
    weights.write_bytes(changed)
    assert file_digest(weights) != before


def test_inference_refuses_a_tokenizer_with_more_tokens_than_the_model(tmp_path):
    tokens = Tokenizer.load(LLAMA_TOKENIZER).vocab_size
    export_model(_small(0, vocab_size=tokens - 10), LLAMA_TOKENIZER, tmp_path / "small")
    with pytest.raises(UserError) as exc:
        load_for_inference(tmp_path / "small")
    message = str(exc.value)
    assert "\n" not in message and str(tmp_path / "small") in message
    assert f"has {tokens} tokens, more than the model's vocab_size {tokens - 10}" in message
    export_model(_small(0, vocab_size=tokens + 6), LLAMA_TOKENIZER, tmp_path / "padded")  # padded rows: fine
    model, tokenizer = load_for_inference(tmp_path / "padded")
    assert model.cfg.vocab_size == tokens + 6 and tokenizer.vocab_size == tokens


def test_init_from_refuses_an_export_without_tokenizer_files(tmp_path):
    model = _small(0, vocab_size=Tokenizer.load(LLAMA_TOKENIZER).vocab_size)
    export_model(model, LLAMA_TOKENIZER, tmp_path / "export")
    data_hash = Tokenizer.load(LLAMA_TOKENIZER).hash
    assert initial_weights(model.cfg, str(tmp_path / "export"), data_hash).keys() == model.state_dict().keys()
    (tmp_path / "export" / "tokenizer.json").unlink()
    with pytest.raises(UserError) as exc:
        initial_weights(model.cfg, str(tmp_path / "export"), data_hash)
    message = str(exc.value)
    assert message.startswith(f"--init-from {tmp_path / 'export'}: no tokenizer") and "\n" not in message
    assert "nothing shows it is the one the data was prepared with" in message
    assert initial_weights(model.cfg, str(tmp_path / "export"), RANDOM_TOKENS_HASH)  # `bench train --lora`'s data


def test_init_from_another_shape_names_the_keys_that_set_it(tmp_path):
    """It named model.kv_heads and model.ffn_hidden_dim, which --set refuses as unknown keys."""
    model = _small(0)
    export_model(model, None, tmp_path / "export")
    other = dataclasses.replace(model.cfg, n_kv_heads=4, hidden_dim=64)
    with pytest.raises(UserError, match=r"\(model.n_kv_heads 2 there, 4 here; model.hidden_dim 128 there, 64 here\); "
                                        r"set those model.\* keys to the values there$"):
        initial_weights(other, str(tmp_path / "export"), RANDOM_TOKENS_HASH)


def test_init_from_names_a_head_dim_the_other_keys_will_not_give(tmp_path):
    """A model with 4 heads of 16 at dim 32 (head_dim set apart), a run at dim 64 with 4 heads (derived 16): the
    refusal named model.dim only, and once it was set, a second refusal named model.head_dim."""
    model = Transformer(dataclasses.replace(_small(0).cfg, head_dim=16))
    export_model(model, None, tmp_path / "export")
    run = dataclasses.replace(model.cfg, dim=64, head_dim=None, hidden_dim=model.cfg.ffn_hidden_dim)
    assert run.attention_head_dim == model.cfg.attention_head_dim == 16
    with pytest.raises(UserError, match=r"\(model.dim 32 there, 64 here; model.head_dim 16 there, unset \(model.dim / "
                                        r"model.n_heads\) here\); set those"):
        initial_weights(run, str(tmp_path / "export"), RANDOM_TOKENS_HASH)
    assert initial_weights(dataclasses.replace(run, dim=32, head_dim=16), str(tmp_path / "export"), RANDOM_TOKENS_HASH)


@pytest.mark.parametrize("model_type", [["llama"], {"name": "llama"}])
def test_a_model_type_that_is_not_a_string_is_refused_in_one_line(tmp_path, model_type):
    export_model(_small(0), None, tmp_path)
    config = hf_config(_small(0).cfg, None)
    config["model_type"] = model_type
    with pytest.raises(UserError, match=r"config.json: not a Llama-, Mistral-, Qwen2- or Qwen3-architecture config "
                                        r"\(model_type"):
        model_config_from_hf(config, "config.json")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="not a Llama-, Mistral-, Qwen2- or Qwen3-architecture config"):
        import_model(tmp_path)


@pytest.mark.parametrize("model_type", ["gemma", "granite"])
def test_a_model_type_of_another_architecture_is_refused_whatever_its_class_list_says(model_type):
    """transformers builds the model its model_type names (Gemma scales its embeddings, Granite its logits): such a
    config listing LlamaForCausalLM was read as Llama, its logits 2.7 to 4.5 off, and fine-tuned without a word."""
    config = hf_config(_small(0).cfg, None)
    with pytest.raises(UserError, match=f"not a Llama-, Mistral-, Qwen2- or Qwen3-architecture config \\(model_type "
                                        f"'{model_type}'\\)"):
        model_config_from_hf({**config, "model_type": model_type}, "config.json")
    del config["model_type"]  # none: the class the list names, as before
    assert model_config_from_hf(config, "config.json") == model_config_from_hf(hf_config(_small(0).cfg, None), "x")


def test_a_qwen3_config_without_head_dim_takes_qwen3s_default():
    """Qwen3Config's head_dim defaults to 128, not hidden size / heads: such a model saved without the key was
    refused, its k_norm of 128 not matching the 16 we read."""
    config = hf_config(dataclasses.replace(_small(0).cfg, qk_norm=True, head_dim=128), None)
    assert config["model_type"] == "qwen3" and config.pop("head_dim") == 128
    assert model_config_from_hf(config, "config.json").attention_head_dim == 128
    llama = hf_config(_small(0).cfg, None)
    llama.pop("head_dim", None)
    assert model_config_from_hf(llama, "config.json").attention_head_dim == 32 // 4  # Llama's: the quotient


@pytest.mark.parametrize("change, said", [
    ({"head_dim": 2**22}, f"model.layers.0.self_attn.q_proj.weight \\(32, 32\\), expected \\({4 * 2**22}, 32\\)"),
    # --init-from refused it as too large for the memory ('make model.vocab_size smaller'), not as other weights
    ({"vocab_size": 10**12}, "model.embed_tokens.weight \\(96, 32\\), expected \\(1000000000000, 32\\)"),
])
def test_a_head_width_the_weights_do_not_have_is_refused_before_anything_is_built(tmp_path, change, said):
    """The model's RoPE tables, as wide as its heads, were built before its weights were compared: a config.json
    with head_dim 2^22 asked for 512 GiB (a traceback, or the OOM killer), in generate and in --init-from alike."""
    export_model(_small(0), None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    refusal = f"^{tmp_path}: weights do not match config.json \\({said}\\)$"
    for read in (import_model, model_config_of):
        with pytest.raises(UserError, match=refusal):
            read(tmp_path)


def test_a_tied_model_saved_with_its_output_matrix_alone_loads_it_as_the_embeddings(tmp_path):
    """transformers loads it so; it was refused: 'the weights hold an lm_head.weight that differs from
    model.embed_tokens.weight', which they did not hold."""
    model = _small(0)
    export_model(model, None, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, tmp_path / "model.safetensors")
    tokens = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        assert torch.equal(import_model(tmp_path)(tokens).logits, model(tokens).logits)


def test_a_mistral_window_is_not_trained_past(tmp_path):
    """A Mistral model whose window (300) covers its context (256) is full attention there, and was accepted; a run
    at model.max_seq_len 512 then trained it as attention over all 512 positions, another function past 300."""
    model = _small(0)
    export_model(model, None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=300,
                  max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = dataclasses.replace(model.cfg, max_seq_len=512)
    with pytest.raises(UserError, match="its attention sees 300 positions back \\(a sliding window\\), and ours has "
                                        "none: model.max_seq_len 512 would train it on another function past them; "
                                        "set model.max_seq_len to at most 300$"):
        initial_weights(run, str(tmp_path), RANDOM_TOKENS_HASH)
    assert initial_weights(dataclasses.replace(run, max_seq_len=300), str(tmp_path), RANDOM_TOKENS_HASH)


def test_legacy_rotary_inv_freq_buffers_are_ignored_on_import(tmp_path):
    """Older transformers saved each layer's RoPE frequencies with the weights; transformers loads such a directory,
    and so do we, while any other unexpected tensor is still refused."""
    model = _small(0)
    export_model(model, None, tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    state.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone() for i in range(2)})
    save_file(state, str(weights))
    tokens = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert torch.equal(import_model(tmp_path)(tokens).logits, model(tokens).logits)
    state["model.layers.0.self_attn.rotary_emb.other"] = inv_freq
    save_file(state, str(weights))
    with pytest.raises(UserError, match=r"unexpected \['model.layers.0.self_attn.rotary_emb.other'\]"):
        import_model(tmp_path)


# ---- the ids a document starts with: what transformers' `tokenizer(text)` puts before a text ---------------------

TEXTS = ["The lighthouse keeper wrote the weather.", "灯塔看守人每天早上都在蓝色的笔记本上记录天气。", "x"]


def _llama_variant(directory, post_processor="keep", **config):
    """The Llama fixture with another post-processor (a `tokenizers.processors` object, or None) and config fields
    (a value None removes the field)."""
    from tokenizers import Tokenizer as HFTokenizer

    directory.mkdir()
    tok = HFTokenizer.from_file(str(LLAMA_TOKENIZER / "tokenizer.json"))
    if post_processor != "keep":
        tok.post_processor = post_processor
    tok.save(str(directory / "tokenizer.json"))
    fields = {**json.loads((LLAMA_TOKENIZER / "tokenizer_config.json").read_text()), **config}
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    return directory


def _bos_template(single="<s> $A"):
    from tokenizers import processors

    return processors.TemplateProcessing(single=single, pair=f"{single} $B", special_tokens=[("<s>", 1), ("</s>", 2)])


def _variant(name, tmp_path, tokenizer_dir):
    from tokenizers import processors
    from transformers import AutoTokenizer

    if name == "ours":
        return tokenizer_dir
    if name == "ours saved by transformers":  # which adds a post-processor that puts nothing before a text
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(tmp_path / name))
        return tmp_path / name
    if name == "minimind":
        return FIXTURES / "tokenizers" / "minimind"
    if name == "llama":
        return LLAMA_TOKENIZER
    variants = {
        "llama-3 (byte-level, then the template)": dict(post_processor=processors.Sequence(
            [processors.ByteLevel(trim_offsets=False), _bos_template()])),
        "bos and eos around the text": dict(post_processor=_bos_template("<s> $A </s>")),
        "add_bos_token false beside the template": dict(add_bos_token=False),  # the post-processor decides
        "gpt-2 (byte-level only)": dict(post_processor=processors.ByteLevel(), add_bos_token=None),
    }
    return _llama_variant(tmp_path / "variant", **variants[name])


@pytest.mark.parametrize("name, start", [
    ("ours", []), ("ours saved by transformers", []), ("minimind", []), ("gpt-2 (byte-level only)", []),
    ("llama", [1]), ("llama-3 (byte-level, then the template)", [1]), ("bos and eos around the text", [1]),
    ("add_bos_token false beside the template", [1]),
])
def test_documents_start_with_what_transformers_puts_before_a_text(name, start, tmp_path, tokenizer_dir):
    """`Tokenizer.encode` never adds a BOS, and nothing else knew of one: an imported Llama got its documents,
    prompts and eval texts without the <s> it was trained behind. The post-processor's own prefix is the document
    start; its hash (the post-processor left out) stays that of the tokenizer as it was."""
    from transformers import AutoTokenizer

    directory = _variant(name, tmp_path, tokenizer_dir)
    ours, theirs = Tokenizer.load(directory), AutoTokenizer.from_pretrained(str(directory))
    assert ours.document_start_ids == start
    for text in TEXTS:
        expected = theirs(text)["input_ids"]
        assert expected[:len(start) + len(ours.encode(text))] == ours.document_start_ids + ours.encode(text)
    if name not in ("ours", "ours saved by transformers", "minimind"):  # the fixture with another post-processor
        assert ours.hash == Tokenizer.load(LLAMA_TOKENIZER).hash
    ours.save(tmp_path / "copy")  # a prepared data folder's, a run's, an export's copy starts documents alike
    assert Tokenizer.load(tmp_path / "copy").document_start_ids == start


@pytest.mark.parametrize("config, start", [
    ({"add_bos_token": True}, [1]),  # as transformers 4's Llama tokenizers build their post-processor from it
    ({"add_bos_token": False}, []),
    ({"add_bos_token": None}, []),  # not said: the post-processor (here none) decides
    ({"add_bos_token": True, "bos_token": None}, []),  # no BOS to add
])
def test_add_bos_token_starts_documents_where_the_post_processor_adds_nothing(config, start, tmp_path):
    tokenizer = Tokenizer.load(_llama_variant(tmp_path / "variant", post_processor=None, **config))
    assert tokenizer.document_start_ids == start
    assert tokenizer.encode("The lighthouse") == Tokenizer.load(LLAMA_TOKENIZER).encode("The lighthouse")
    tokenizer.save(tmp_path / "copy")
    assert Tokenizer.load(tmp_path / "copy").document_start_ids == start


def test_an_imported_llama_reads_documents_prompts_and_eval_texts_as_transformers_tokenizes_them(tmp_path):
    """Pretraining documents, `zerollm eval` streams and plain prompts of a Llama brought from the hub begin with its
    <s>, as `tokenizer(text)` gives them; lm-eval's rolling log-likelihood equals transformers' own on those ids."""
    from lm_eval.api.instance import Instance
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm.data.prepare import prepare
    from llm.eval.harness_lm import ZeroLLMHarnessModel
    from llm.eval.token_stream import stream_of_files
    from llm.infer.generate import TextGenerator

    base = tmp_path / "base"
    _transformers_llama(base)
    theirs = AutoTokenizer.from_pretrained(str(base))
    model, tokenizer = load_for_inference(base)
    ids = [theirs(text)["input_ids"] for text in TEXTS]
    eos = tokenizer.eos_id
    assert all(i[0] == 1 for i in ids)

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepare("pretrain", [str(tmp_path / "docs.jsonl")], base, tmp_path / "data", val_fraction=0.0, workers=1,
            show_progress=False)
    with h5py.File(tmp_path / "data" / "tokens.h5") as h5:
        assert h5["train"]["tokens"][:].tolist() == [t for i in ids for t in [*i, eos]]
    stream, _ = stream_of_files([str(tmp_path / "docs.jsonl")], tokenizer)
    assert stream.tokens.tolist() == [eos] + [t for i in ids for t in [*i, eos]]
    assert [TextGenerator(model, tokenizer).prompt_ids(text) for text in TEXTS] == ids

    harness = ZeroLLMHarnessModel(model, tokenizer, batch_size=2, max_length=64)
    assert harness.prefix_token_id == 1 and harness.tok_encode(TEXTS[0]) == ids[0]
    rolling = harness.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), n)
                                             for n, t in enumerate(TEXTS)], disable_tqdm=True)
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    for text_ids, ours in zip(ids, rolling, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([text_ids])).logits[0].double(), -1)
        expected = sum(logp[p - 1, text_ids[p]].item() for p in range(1, len(text_ids)))
        assert ours == pytest.approx(expected, rel=1e-4)
