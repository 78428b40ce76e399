"""Hugging Face Llama format: export a run, import an export (ours or one written by transformers).

An export directory holds `model.safetensors`, a `config.json` for `LlamaForCausalLM` (`Qwen3ForCausalLM` for a
model with QK-norm, which is Llama plus a per-head RMSNorm of q and k; `Qwen2ForCausalLM` for one with biases on q, k
and v, which is Llama plus those) and the tokenizer files, so
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` reproduces our logits; and the `generation_config.json` of a
run's base model, where it had one (its suggested sampling, `llm.infer.suggested_sampling`).
Our RoPE already uses the rotate-half layout Hugging Face uses, so weights are renamed, never permuted.

An export is written to a hidden folder beside its destination and renamed into place when complete, so a
killed export leaves the previous one (or none), never a truncated file. Importing reads exactly the weight files
the directory names (`model.safetensors`, or the shards of `model.safetensors.index.json`'s weight_map): exports
are untrusted input, read as safetensors and JSON only, and a malformed one is a one-line UserError.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from llm import durable, rundir
from llm.config import ModelConfig, RunConfig, validate_model
from llm.data.output import refuse_foreign_contents, refuse_mount_point
from llm.errors import SigtermUnwinds, UserError, read_user_json_object
from llm.infer.suggested_sampling import generation_config_text
from llm.model import Transformer
from llm.model.from_weights import model_from_weights, shapes_only
from llm.model.host_memory import check_fits_in_memory
from llm.model.rope import yarn_attention_scale
from llm.rundir import HF_CONFIG_FILE
from llm.tokenizer import CONFIG_FILE as TOKENIZER_CONFIG
from llm.tokenizer import TOKENIZER_FILE, Tokenizer

WEIGHTS_FILE, WEIGHTS_INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
EXPORT_FILES = {WEIGHTS_FILE, HF_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG, rundir.GENERATION_CONFIG_FILE}
"""What an export holds."""
EXPORTED_BY = {"exported_by": "zerollm"}
"""In the metadata of an export's model.safetensors: how a later export knows a folder it may replace."""
SAVED_BY_TRANSFORMERS = "transformers_version"
"""A key every config.json transformers saves carries, and export never writes."""
_LEGACY_BUFFER = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
"""RoPE frequencies older transformers saved with the weights: recomputed from config.json, so ignored on import."""

_LAYER_NAMES = {  # ours (inside layers.N.) -> Hugging Face (inside model.layers.N.)
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}
"""model_type -> class: qwen3 is Llama with QK-norm, qwen2 Llama with biases on q, k and v, mistral Llama with an
optional sliding window (none here), whose hidden size need not be a multiple of the heads (transformers' Llama
refuses such a model: export writes it as Mistral)."""
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


def hf_config(cfg: ModelConfig, tokenizer: Tokenizer | None) -> dict:
    if cfg.qk_norm and cfg.qkv_bias:  # Qwen3's attention_bias puts one on the output projection too
        raise UserError("a model with both model.qk_norm and model.qkv_bias has no Hugging Face class; export supports "
                        "either")
    model_type = ("qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else
                  "mistral" if cfg.dim % cfg.n_heads else "llama")
    config = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attention_head_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std, "torch_dtype": "float32",
        "rope_scaling": None,
    }
    if model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if model_type == "mistral":  # absent, its class's default (4096) would be a window
        config["sliding_window"] = None
    if model_type == "qwen2":  # Qwen2's q, k and v biases are its class's own: no attention_bias key says so
        del config["attention_bias"]
    if cfg.rope_scaling == "yarn":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.yarn_beta_fast,
                                  "beta_slow": cfg.yarn_beta_slow,
                                  "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    if cfg.rope_scaling == "llama3":
        config["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                                  "low_freq_factor": cfg.llama3_low_freq_factor,
                                  "high_freq_factor": cfg.llama3_high_freq_factor,
                                  "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    if tokenizer is not None:
        config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.stop_ids,
                      pad_token_id=tokenizer.pad_id)
    return config


def _refuse_other_yarn(rope: dict[str, Any], factor: float, where: str) -> None:
    """Refuse YaRN settings that Hugging Face honours and our tables do not (they would load into another function,
    silently): an attention factor other than 0.1 * ln(factor) + 1, DeepSeek's mscale pair, an untruncated
    correction range. `where`: the file and the RoPE object's key, for the errors."""
    attention = rope.get("attention_factor")
    if attention is not None and not (isinstance(attention, int | float) and not isinstance(attention, bool)
                                      and math.isclose(attention, yarn_attention_scale(factor), rel_tol=1e-6)):
        raise UserError(f"{where} 'attention_factor' {attention!r} is not supported (our YaRN scales "
                        f"by 0.1 * ln(factor) + 1 = {yarn_attention_scale(factor):.6g})")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):  # transformers' order
        raise UserError(f"{where} 'mscale' and 'mscale_all_dim' (DeepSeek's attention factor) are not "
                        "supported")
    if rope.get("truncate", True) is not True:
        raise UserError(f"{where} 'truncate' {rope['truncate']!r} is not supported (our YaRN rounds "
                        "its correction range, as truncate true does)")


def _number(config: dict[str, Any], key: str, source: str, kind: type, default: Any = None) -> Any:
    """config[key] (or `default` when absent) checked to be a positive int (`kind` int) or number (`kind` float)."""
    value = config.get(key, default)
    if value is None:
        raise UserError(f"{source}: '{key}' is missing")
    allowed = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed) or not 0 < value < math.inf:
        expected = "a positive integer" if kind is int else "a positive number"
        raise UserError(f"{source}: '{key}' must be {expected}, got {value!r}")
    return value


def _first_of(key: str, places: list[tuple[dict[str, Any], str]], kind: type, default: Any) -> Any:
    """`key` from the first of `places` (a mapping, and its name in errors) that holds it, else `default`: the order
    transformers 5 reads RoPE keys in. Checked by `_number`."""
    for mapping, where in places:
        if key in mapping:
            return _number(mapping, key, where, kind)
    return default


DEFAULT_WINDOW = 4096
"""The sliding window of a Mistral config without the key, and of a Qwen2 or Qwen3 config that turns it on without
the key, as transformers reads them."""
QWEN3_HEAD_DIM = 128
"""The head width of a Qwen3 config without the key, as transformers reads it (Llama's is hidden size / heads)."""


def _model_type(config: dict, source: str) -> str:
    """The architecture a config.json describes, of those in ARCHITECTURES: its model_type, which transformers builds
    the model by (a model_type of another architecture with a Llama class in `architectures`, Gemma's or Granite's,
    was read as Llama: another function), or, without one, the class `architectures` names."""
    model_type = config.get("model_type")
    if model_type is None:
        architectures = config.get("architectures") or []
        model_type = next((t for t, name in ARCHITECTURES.items()
                           if isinstance(architectures, list) and name in architectures), None)
    if not (isinstance(model_type, str) and model_type in ARCHITECTURES):
        raise UserError(f"{source}: not a Llama-, Mistral-, Qwen2- or Qwen3-architecture config (model_type "
                        f"{config.get('model_type')!r})")
    return model_type


MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
"""`max_position_embeddings` of a config without the key, per architecture, as transformers reads it: the context, and
the original length of a YaRN or Llama 3 RoPE that names none (2048 for all of them built another RoPE than
transformers for Qwen and Mistral configs)."""

QWEN_FIRST_WINDOWED_LAYER = 28
"""`max_window_layers` of a Qwen2 or Qwen3 config without the key, as transformers reads it."""


def _sliding_window(config: dict, model_type: str) -> Any:
    """The sliding window of a config as transformers reads it: a Mistral config's, a Qwen2 or Qwen3 config's where
    `use_sliding_window` gives it to some layer (those from `max_window_layers` on, or as `layer_types` says: a true
    flag with max_window_layers at least the layer count windows none, and was refused); None for the others."""
    if model_type == "mistral":
        return config.get("sliding_window", DEFAULT_WINDOW)
    if model_type not in ("qwen2", "qwen3") or not config.get("use_sliding_window"):
        return None
    layer_types, layers = config.get("layer_types"), config.get("num_hidden_layers")
    first = config.get("max_window_layers", QWEN_FIRST_WINDOWED_LAYER)
    if isinstance(layer_types, list):
        windowed = any(kind != "full_attention" for kind in layer_types)
    else:
        windowed = not (isinstance(layers, int) and isinstance(first, int) and first >= layers)
    return config.get("sliding_window", DEFAULT_WINDOW) if windowed else None  # null: none


def attention_window(directory: Path) -> int | None:
    """The sliding window of an export directory's Mistral model, None for other models: its attention sees only
    that many positions back, which ours does everywhere within it (a longer window than its context is accepted;
    attention past it is another function than the model's)."""
    config = read_user_json_object(directory / HF_CONFIG_FILE, "model config")
    return _sliding_window(config, _model_type(config, str(directory / HF_CONFIG_FILE)))


def model_config_from_hf(config: dict, source: str) -> ModelConfig:
    model_type = _model_type(config, source)
    if (quantized := config.get("quantization_config")) is not None:  # GPTQ, AWQ, bitsandbytes, FP8: packed weights,
        method = quantized.get("quant_method") if isinstance(quantized, dict) else None  # scales, other names
        what = f"quant_method {method!r}" if method else "quantization_config"
        raise UserError(f"{source}: a quantized model ({what}); give the model's unquantized fp32, bf16 or fp16 "
                        "weights (its base repository)")
    window = _sliding_window(config, model_type)
    positions = _number(config, "max_position_embeddings", source, int, MAX_POSITIONS[model_type])
    if window is not None and not (isinstance(window, int) and window >= positions):
        given = "" if "sliding_window" in config else " (absent: its class's default)"
        raise UserError(f"{source}: 'sliding_window' {window!r}{given} is a window of fewer positions than "
                        f"'max_position_embeddings' {positions}: sliding-window attention is not part of our "
                        f"architecture (null, or a window of at least {positions}, is full attention)")
    for key in ("attention_bias", "mlp_bias"):  # Llama's and Qwen3's attention_bias is on every projection; Qwen2
        if config.get(key) and (key, model_type) != ("attention_bias", "qwen2"):  # reads none (its q, k, v have one)
            raise UserError(f"{source}: '{key}' {config[key]!r}: biases other than Qwen2's on q, k and v are not part "
                            "of our architecture")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' two names of one function
        raise UserError(f"{source}: 'hidden_act' {config['hidden_act']!r} is not part of our architecture (SiLU only)")
    rope_key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"  # transformers' choice
    rope = config.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise UserError(f"{source}: '{rope_key}' must be an object or null, got {rope!r}")
    if any(isinstance(value, dict) for value in rope.values()):
        raise UserError(f"{source}: '{rope_key}' per layer type (a nested object) is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn", "llama3"):
        raise UserError(f"{source}: RoPE scaling '{kind}' is not supported (only YaRN and Llama 3's)")
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"{source}: 'partial_rotary_factor' other than 1 (RoPE on part of each head) is not part of "
                        "our architecture")
    heads = _number(config, "num_attention_heads", source, int)
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise UserError(f"{source}: 'tie_word_embeddings' must be true or false, got {tie!r}")
    cfg = ModelConfig(
        vocab_size=_number(config, "vocab_size", source, int), dim=_number(config, "hidden_size", source, int),
        n_layers=_number(config, "num_hidden_layers", source, int), n_heads=heads,
        n_kv_heads=heads if config.get("num_key_value_heads") is None  # null, as absent: one per head, as transformers
        else _number(config, "num_key_value_heads", source, int),  # reads it (it was refused as missing)
        hidden_dim=_number(config, "intermediate_size", source, int),
        norm_eps=_number(config, "rms_norm_eps", source, float, 1e-6),
        max_seq_len=positions,
        rope_theta=_first_of("rope_theta", [(rope, f"{source} {rope_key}"), (config, source)], float, 10000.0),
        tie_embeddings=tie, init_std=_number(config, "initializer_range", source, float, 0.02),
        qk_norm=model_type == "qwen3", qkv_bias=model_type == "qwen2",
    )
    if kind in ("yarn", "llama3"):
        cfg.rope_scaling, cfg.rope_factor = kind, _number(rope, "factor", f"{source} {rope_key}", float)
        # a top-level original_max_position_embeddings (Phi-3's) comes first in transformers, rope_parameters' does not
        cfg.rope_original_max_seq_len = _first_of("original_max_position_embeddings", [
            (config, source), (rope, f"{source} {rope_key}")], int, cfg.max_seq_len)
    if kind == "llama3":  # transformers requires both (and ignores an attention_factor: llama3 scales by 1)
        cfg.llama3_low_freq_factor = _number(rope, "low_freq_factor", f"{source} {rope_key}", float)
        cfg.llama3_high_freq_factor = _number(rope, "high_freq_factor", f"{source} {rope_key}", float)
    if kind == "yarn":
        betas = {key: rope.get(key) or default for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0))}
        cfg.yarn_beta_fast = _number(betas, "beta_fast", f"{source} {rope_key}", float)  # null or 0: the default,
        cfg.yarn_beta_slow = _number(betas, "beta_slow", f"{source} {rope_key}", float)  # as in transformers
        _refuse_other_yarn(rope, cfg.rope_factor, f"{source}: {rope_key}")
    if model_type == "qwen3" and "head_dim" not in config:  # Qwen3Config's default, not the quotient (a Qwen3
        config = {**config, "head_dim": QWEN3_HEAD_DIM}  # model saved without the key was refused as misshapen)
    if config.get("head_dim") is not None:  # null or absent: hidden_size / num_attention_heads, as in transformers
        head_dim = _number(config, "head_dim", source, int)
        cfg.head_dim = head_dim if cfg.dim % heads or head_dim != cfg.dim // heads else None
    try:
        validate_model(cfg)
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None
    return cfg


def refuse_replacing_a_source(out: Path, cfg: RunConfig, lora_bases: list[Path]) -> None:
    """Refuse an --out that is a model the run being exported was made from: its train.init_from (the base a LoRA
    run's adapters are merged onto, a DPO or GRPO run's reference), its distillation teacher, or, for a LoRA run on
    a LoRA run, a base further down (`lora_bases`, nearest first: `llm.loading.lora_bases`). Export replaces --out
    whole: the base of a LoRA run was lost, and the run could no longer be loaded."""
    def _is(source: str | Path | None) -> bool:
        return bool(source) and out.is_dir() and Path(source).is_dir() and os.path.samefile(out, source)

    for key, source in (("train.init_from", cfg.train.init_from), ("train.teacher", cfg.train.teacher)):
        if _is(source):
            lora = "; a LoRA run is loaded onto it" if key == "train.init_from" and cfg.lora.r else ""
            raise UserError(f"--out {out} is the run's {key}, a model it was trained from, which export would "
                            f"replace{lora}; choose another --out")
    for above, base in zip(lora_bases, lora_bases[1:]):
        if _is(base):
            raise UserError(f"--out {out} is the train.init_from of {above}, a LoRA run this one's adapters build "
                            "on: export would replace it, and neither run could be loaded any more; choose another "
                            "--out")


def _replaceable(out: Path) -> None:
    """Refuse to replace a directory that is not empty or an earlier export: export replaces it whole, so a folder
    with anything export does not write (a downloaded model's README.md, notes, folders),
    or whose model.safetensors export did not write (a downloaded model of those files alone), is left alone."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    refuse_mount_point(out, out, "export")
    refuse_foreign_contents(out, out, "export", EXPORT_FILES, WEIGHTS_FILE, not_ours=_not_exported_here)


def _not_exported_here(out: Path) -> str | None:
    """None where export wrote `out`'s model.safetensors (a model downloaded from the Hub has one too): marked so in
    its metadata, or, unmarked, as earlier versions wrote it, beside a config.json that transformers did not save;
    else the weights' name."""
    try:
        with safe_open(out / WEIGHTS_FILE, "pt") as weights:
            if (weights.metadata() or {}).items() >= EXPORTED_BY.items():
                return None
        config = json.loads((out / HF_CONFIG_FILE).read_text(encoding="utf-8"))
        if isinstance(config, dict) and SAVED_BY_TRANSFORMERS not in config:
            return None
    except (SafetensorError, OSError, ValueError):  # ValueError: JSON's, and text that is not UTF-8
        pass
    return WEIGHTS_FILE


def export_model(model: Transformer, tokenizer_dir: Path | None, out: Path,
                 generation_config: Path | None = None) -> str:
    """Write `out` (see the module docstring), replacing an earlier export there as a whole (`durable.staged_folder`:
    the earlier one is renamed aside and then deleted; a crash between the two renames leaves both complete folders,
    the old one as .<name>.old), with a copy of `generation_config` where that file exists (a run's, kept from its
    base); the Hugging Face class its config.json names."""
    cfg = model.cfg
    try:
        out = out.resolve()
    except (OSError, RuntimeError) as exc:  # a loop of symbolic links: RuntimeError before Python 3.13
        raise UserError(f"--out {out}: cannot follow it ({exc})") from None
    if cfg.moe:
        raise UserError("mixture-of-experts models have no LlamaForCausalLM form; export supports dense models")
    _replaceable(out)
    state = {hf_name(k): v.detach().float().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")  # tied: transformers re-ties it from the embeddings
    try:  # Ctrl-C or SIGTERM while writing leaves no staging folder
        with SigtermUnwinds() as stop, durable.staged_folder(out, replace=True) as staging:
            try:
                staging.mkdir(parents=True)
            except OSError as exc:  # e.g. a file where a parent folder should be
                raise UserError(f"--out {out}: cannot create it ({exc.strerror})") from None
            config = _write_export(state, cfg, tokenizer_dir, staging)
            if generation_config is not None and (text := generation_config_text(generation_config)) is not None:
                (staging / rundir.GENERATION_CONFIG_FILE).write_text(_with_export_token_ids(text, config),
                                                                     encoding="utf-8")
            stop.check()  # a stop never renames the export into place
    except Exception as exc:
        if (reason := durable.out_of_room(exc)) is None:
            raise
        kept = "the export there is as it was" if out.exists() else "nothing was written"
        raise UserError(f"--out {out}: {reason} while writing the export; {kept}") from None
    return config["architectures"][0]


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _with_export_token_ids(text: str, config: dict[str, Any]) -> str:
    """The copied generation_config.json `text` with the token ids of the export's config.json where it gives its
    own: transformers' `generate` takes them over config.json's, so a copy from a base whose ids were others (its end
    of text where the tokenizer's stop ids are more, LlamaConfig's defaults) ran the exported chat model past its end
    of turn. Its other stop ids (Llama 3.1's end of a tool call) are kept after the tokenizer's."""
    generation = json.loads(text)
    exported = {key: config[key] for key in TOKEN_ID_KEYS if key in config and key in generation}
    if "eos_token_id" in exported:  # its own ids: whole numbers (a null or a text among them is no token)
        own, given = (ids if isinstance(ids, list) else [ids] for ids in (exported["eos_token_id"],
                                                                           generation["eos_token_id"]))
        exported["eos_token_id"] = own + [i for i in given if isinstance(i, int) and not isinstance(i, bool)
                                          and i not in own]
    changed = {**generation, **exported}
    return text if changed == generation else json.dumps(changed, indent=2) + "\n"


def _sort_metadata(path: Path) -> None:
    """Put the metadata keys of safetensors file `path` in sorted order, in place: the library writes them in a
    random order each process, so two exports of the same weights differed in their bytes, and a LoRA run on an
    export that was exported again was refused as trained on other weights (the run record names its digest)."""
    with open(path, "r+b") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps({"__metadata__": header.pop("__metadata__"), **header}, separators=(",", ":")).encode()
        if len(text) <= size:  # the same entries: never longer; the library pads with spaces too
            file.seek(8)
            file.write(text.ljust(size))


def _write_export(state: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer_dir: Path | None, staging: Path) -> dict:
    """The export's files into the folder `staging`; its config.json."""
    save_file(state, str(staging / WEIGHTS_FILE), metadata={"format": "pt", **EXPORTED_BY})
    _sort_metadata(staging / WEIGHTS_FILE)
    os.chmod(staging / WEIGHTS_FILE, 0o666 & ~durable.current_umask())  # written 0600: readable like the other files
    tokenizer = None
    if tokenizer_dir is not None and (tokenizer_dir / TOKENIZER_FILE).is_file():
        tokenizer = Tokenizer.load(tokenizer_dir)
        shutil.copy(tokenizer_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
        tokenizer.save_config(staging)  # its special tokens by role too: a copy made by earlier versions lacks them
    config = hf_config(cfg, tokenizer)
    (staging / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return config


def _read_tensors(path: Path, names: list[str] | None) -> dict[str, torch.Tensor]:
    """The tensors `names` (all when None) of one safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            missing = sorted(set(names or ()) - present)
            if missing:
                raise UserError(f"{path}: lacks {missing[:3]}, which {WEIGHTS_INDEX_FILE} places there")
            return {name: f.get_tensor(name) for name in (sorted(present) if names is None else names)}
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc})") from None


def weight_files(directory: Path) -> dict[str, list[str] | None]:
    """Exactly the weight files an export names, each with the tensors it must hold (None: all it holds):
    model.safetensors when present (as transformers does), else the shards of model.safetensors.index.json's
    weight_map. Other *.safetensors files in the directory are not read."""
    if (directory / WEIGHTS_FILE).is_file():
        return {WEIGHTS_FILE: None}
    index = directory / WEIGHTS_INDEX_FILE
    if not index.is_file():
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        hint = (f"; {pickled[0]} is not read (a pickle can run code when loaded): save the model with transformers' "
                "save_pretrained, which writes safetensors" if pickled else "")
        raise UserError(f"{directory}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} beside {HF_CONFIG_FILE}{hint}")
    weight_map = read_user_json_object(index, "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise UserError(f"{index}: 'weight_map' must map tensor names to shard file names")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if Path(shard).name != shard or shard in (".", ".."):
            raise UserError(f"{index}: shard '{shard}' is not a file name in {directory}")
        shards.setdefault(shard, []).append(name)
    for shard in shards:
        if not (directory / shard).is_file():
            raise UserError(f"{index}: names shard {shard}, which is missing")
    return shards


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Exactly the weights an export names (`weight_files`)."""
    state = {}
    for name, tensors in weight_files(directory).items():
        state.update(_read_tensors(directory / name, tensors))
    return state


def drop_tied_copy(state: dict[str, torch.Tensor], embeddings: str, output: str) -> bool:
    """For a model whose config ties its output matrix to its embeddings: remove `output` from the weights `state`
    when it is a copy of `embeddings` (a tied model saved under both names), and say so (True, also when there is no
    `output`); False, `state` unchanged, when `output` holds another matrix (an untied model's weights), which loading
    into the one tied parameter would lose. A tied model saved with `output` alone has it as its embeddings, as
    transformers loads it (it was refused as differing from the embeddings it lacks)."""
    if output in state and embeddings not in state:
        state[embeddings] = state.pop(output)
    if output in state:
        if not torch.equal(state[output], state.get(embeddings, torch.empty(0))):
            return False
        del state[output]
    return True


def export_model_config(directory: Path) -> ModelConfig:
    """The model config an export directory's config.json describes, read without its weights."""
    config_path = directory / HF_CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{directory}: expected {HF_CONFIG_FILE} and {WEIGHTS_FILE} (a Hugging Face Llama export)")
    cfg = model_config_from_hf(read_user_json_object(config_path, "model config"), str(config_path))
    _check_sizes_against_headers(directory, cfg)
    return cfg


def _check_sizes_against_headers(directory: Path, cfg: ModelConfig) -> None:
    """Refuse a config.json whose heads or vocabulary do not match its weights' (the first query projection's and
    the embeddings' shapes, read from the safetensors headers alone): a model's RoPE tables, built before its
    weights are compared, are as wide as its heads (a hostile head_dim of 2^22 asked for 512 GiB: a traceback, or
    the OOM killer), and --init-from sized its memory check by a vocabulary the weights do not have. Weights that
    cannot be read are said where they are read."""
    expected = {"model.layers.0.self_attn.q_proj.weight": (cfg.n_heads * cfg.attention_head_dim, cfg.dim),
                "model.embed_tokens.weight": (cfg.vocab_size, cfg.dim), "lm_head.weight": (cfg.vocab_size, cfg.dim)}
    try:
        files = weight_files(directory)
    except UserError:
        return
    for file, tensors in files.items():
        wanted = [name for name in expected if tensors is None or name in tensors]
        if not wanted:
            continue
        try:
            with safe_open(str(directory / file), framework="pt") as weights:
                shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in wanted
                          if name in weights.keys()}  # noqa: SIM118 - safe_open has no __contains__
        except (SafetensorError, OSError):
            return
        for name, shape in shapes.items():
            if shape != expected[name]:
                raise UserError(f"{directory}: weights do not match {HF_CONFIG_FILE} ({name} {shape}, expected "
                                f"{expected[name]})")


def import_model(directory: Path) -> Transformer:
    """Our model from an export directory (ours, or `save_pretrained` of a Llama model); a UserError for one that
    cannot fit in memory (it was built until the kernel killed the process, without a word)."""
    cfg = export_model_config(directory)
    state = {name: tensor for name, tensor in read_weights(directory).items() if not _LEGACY_BUFFER.fullmatch(name)}
    if integral := next((name for name in sorted(state) if not state[name].dtype.is_floating_point), None):
        raise UserError(f"{directory}: {integral} holds {str(state[integral].dtype).removeprefix('torch.')} values, "
                        "not floating point (quantized weights?); give the model's fp32, bf16 or fp16 weights")
    if cfg.tie_embeddings and not drop_tied_copy(state, "model.embed_tokens.weight", "lm_head.weight"):
        raise UserError(f"{directory}: {HF_CONFIG_FILE} ties the embeddings (tie_word_embeddings true), but the "
                        "weights hold an lm_head.weight that differs from model.embed_tokens.weight; set "
                        "tie_word_embeddings to false to keep both")
    layers = {name.split(".")[2] for name in state if name.startswith("model.layers.")}
    if len(layers) != cfg.n_layers:  # checked first: building a model of a hostile layer count would never end
        raise UserError(f"{directory}: weights do not match {HF_CONFIG_FILE} ({len(layers)} layers in the weights, "
                        f"num_hidden_layers {cfg.n_layers})")
    with shapes_only():  # names and shapes only: a hostile size in config.json allocates nothing
        expected = Transformer(cfg).state_dict()
    ours = {hf_name(k): k for k in expected}
    if cfg.tie_embeddings:
        ours.pop("lm_head.weight")
    missing, unexpected = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    if missing or unexpected:
        raise UserError(f"{directory}: weights do not match {HF_CONFIG_FILE} (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    misshapen = [f"{name} {tuple(state[name].shape)}, expected {tuple(expected[ours[name]].shape)}"
                 for name in sorted(state) if state[name].shape != expected[ours[name]].shape]
    if misshapen:
        raise UserError(f"{directory}: weights do not match {HF_CONFIG_FILE} ({misshapen[0]})")
    check_fits_in_memory(cfg, remedy=f" ({directory / HF_CONFIG_FILE})")  # its shapes checked first, allocating nothing
    weights = {}
    for name in sorted(state):  # copied one at a time into this process's memory (safetensors maps the file: its
        weights[ours[name]] = state.pop(name).to(torch.float32, copy=True)  # pages would change with a later write)
    return model_from_weights(cfg, weights).eval()
