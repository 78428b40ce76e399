"""Hugging Face Llama format: export a run, import an export (ours or one written by transformers).

An export directory holds `model.safetensors`, a `config.json` for `LlamaForCausalLM` and the
tokenizer files, so `transformers.AutoModelForCausalLM.from_pretrained(DIR)` reproduces our logits.
Our RoPE already uses the rotate-half layout Hugging Face uses, so weights are renamed, never permuted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from llm.config import ModelConfig, validate_model
from llm.errors import UserError
from llm.model import Transformer
from llm.tokenizer import CONFIG_FILE as TOKENIZER_CONFIG
from llm.tokenizer import TOKENIZER_FILE, Tokenizer

WEIGHTS_FILE, HF_CONFIG_FILE = "model.safetensors", "config.json"

_LAYER_NAMES = {  # ours (inside layers.N.) -> Hugging Face (inside model.layers.N.)
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


def hf_config(cfg: ModelConfig, tokenizer: Tokenizer | None) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std, "torch_dtype": "float32",
        "rope_scaling": None,
    }
    if cfg.rope_scaling == "yarn":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.yarn_beta_fast,
                                  "beta_slow": cfg.yarn_beta_slow,
                                  "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    if tokenizer is not None:
        config.update(bos_token_id=tokenizer.im_start_id, eos_token_id=tokenizer.stop_ids, pad_token_id=tokenizer.pad_id)
    return config


def model_config_from_hf(config: dict, source: str) -> ModelConfig:
    if config.get("model_type") != "llama" and "LlamaForCausalLM" not in config.get("architectures", []):
        raise UserError(f"{source}: not a Llama-architecture config (model_type {config.get('model_type')!r})")
    if config.get("attention_bias") or config.get("mlp_bias") or config.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: biases or a non-SiLU activation are not part of our architecture")
    heads = config["num_attention_heads"]
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise UserError(f"{source}: RoPE scaling '{kind}' is not supported (only YaRN)")
    cfg = ModelConfig(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=heads, n_kv_heads=config.get("num_key_value_heads", heads), hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6), max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=config.get("rope_theta", rope.get("rope_theta", 10000.0)),
        tie_embeddings=config.get("tie_word_embeddings", False), init_std=config.get("initializer_range", 0.02),
    )
    if kind == "yarn":
        cfg.rope_scaling, cfg.rope_factor = "yarn", rope["factor"]
        cfg.rope_original_max_seq_len = rope.get("original_max_position_embeddings", cfg.max_seq_len)
        cfg.yarn_beta_fast, cfg.yarn_beta_slow = rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0)
    if config.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise UserError(f"{source}: head_dim {config['head_dim']} differs from hidden_size / num_attention_heads")
    validate_model(cfg)
    return cfg


def export_model(model: Transformer, tokenizer_dir: Path | None, out: Path) -> None:
    cfg = model.cfg
    if cfg.moe:
        raise UserError("mixture-of-experts models have no LlamaForCausalLM form; export supports dense models")
    state = {hf_name(k): v.detach().float().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")  # tied: transformers re-ties it from the embeddings
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer = None
    if tokenizer_dir is not None and (tokenizer_dir / TOKENIZER_FILE).is_file():
        tokenizer = Tokenizer.load(tokenizer_dir)
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG):
            shutil.copy(tokenizer_dir / name, out / name)
    (out / HF_CONFIG_FILE).write_text(json.dumps(hf_config(cfg, tokenizer), indent=2))


def import_model(directory: Path) -> Transformer:
    """Our model from an export directory (ours, or `save_pretrained` of a Llama model)."""
    config_path = directory / HF_CONFIG_FILE
    weights = sorted(directory.glob("*.safetensors"))
    if not config_path.is_file() or not weights:
        raise UserError(f"{directory}: expected {HF_CONFIG_FILE} and *.safetensors (a Hugging Face Llama export)")
    cfg = model_config_from_hf(json.loads(config_path.read_text()), str(config_path))
    state = {}
    for path in weights:
        state.update(load_file(str(path)))
    model = Transformer(cfg)
    ours = {hf_name(k): k for k in model.state_dict()}
    if cfg.tie_embeddings:
        ours.pop("lm_head.weight")
    missing, unexpected = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    if missing or unexpected:
        raise UserError(f"{directory}: weights do not match {HF_CONFIG_FILE} (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    model.load_state_dict({ours[name]: tensor.float() for name, tensor in state.items()}, strict=not cfg.tie_embeddings)
    return model.eval()
