"""Users' own Hugging Face assets: a Llama written by transformers, with its own (foreign) tokenizer, is fine-tuned
and exported back with equal logits; a QK-norm model exports as Qwen3; `--init-from` refuses a model whose RoPE or
norm settings differ from the run's instead of training it silently on other ones."""

from __future__ import annotations

import json
import shutil

import torch

from conftest import FIXTURES, run_cli
from llm.config import ModelConfig
from llm.export import export_model, import_model
from llm.loading import load_for_inference
from llm.model import Transformer
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
    return run_cli("train", "sft", "--recipe", "demo", "--init-from", base, "--data", data, "--out", out,
                   *[a for o in [*BASE_SHAPE, *SFT, *overrides] for a in ("--set", o)])


def test_a_transformers_llama_with_its_tokenizer_fine_tunes_and_exports_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    _transformers_llama(base)
    data = _sft_data(tmp_path, base)
    result = _sft(base, data, tmp_path / "run", *BASE_FUNCTION)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    result = run_cli("export", "--run", tmp_path / "run", "--out", tmp_path / "export")
    assert result.returncode == 0, result.stderr[-2000:]
    assert Tokenizer.load(tmp_path / "export").hash == Tokenizer.load(base).hash
    ours, _ = load_for_inference(tmp_path / "run")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 415, (2, 29))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, ours(tokens).logits, atol=1e-4)
        base_logits = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()(tokens).logits
        assert not torch.allclose(base_logits, ours(tokens).logits, atol=1e-4)  # the fine-tuning changed it


def test_init_from_refuses_other_rope_theta_and_norm_eps(tmp_path):
    base = tmp_path / "base"
    _transformers_llama(base)
    result = _sft(base, _sft_data(tmp_path, base), tmp_path / "run")  # the recipe's rope_theta and norm_eps
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert "model.rope_theta 500000.0 there, 10000.0 here" in message
    assert "model.norm_eps 1e-06 there, 1e-05 here" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_qk_norm_model_exports_as_qwen3_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    qk_norm=True)).eval()
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
