"""A Hugging Face model folder's `generation_config.json`: the sampling its authors suggest (Qwen3's temperature 0.6,
top-k 20 and top-p 0.95, against greedy decoding's endless repetitions), which transformers' `generate` and vLLM
apply wherever a request leaves an option out. `generate`, `chat` and `serve` do the same."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llm.errors import UserError
from llm.infer.sampling import InvalidSampling, SamplingParams
from llm.rundir import GENERATION_CONFIG_FILE
from llm.wording import shown

MAX_FILE_BYTES = 1 << 20
"""Far more than a generation config holds (a few hundred bytes): a larger file is refused before it is read."""
SUGGESTED_FIELDS = {"temperature": float, "top_k": int, "top_p": float, "repetition_penalty": float}
"""The keys read (vLLM's, less min_p, which the sampler has not) and the type of each."""


GENERATION_KEYS = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time", "stop_strings",
    "do_sample", "num_beams", "num_beam_groups", "penalty_alpha", "use_cache", "cache_implementation", "temperature",
    "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "diversity_penalty", "repetition_penalty",
    "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids", "renormalize_logits",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "suppress_tokens", "begin_suppress_tokens",
    "guidance_scale", "num_return_sequences", "pad_token_id", "bos_token_id", "eos_token_id",
    "decoder_start_token_id", "transformers_version"})
"""transformers' GenerationConfig fields that a copy of the file keeps (`generation_config_text`)."""
TEXT_LIMIT = 64
"""The longest text a copy keeps (a version, a cache's name, a stop string)."""


def _read(path: Path) -> tuple[str, dict[str, Any]]:
    """generation_config.json's text and object; a UserError naming `path` for a file that is too large, not JSON
    or not an object."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise UserError(f"{path}: {path.stat().st_size:,} bytes, far more than a generation config holds; fix or "
                            "remove it")
        text = path.read_text(encoding="utf-8")
        config = json.loads(text)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise UserError(f"{path}: cannot be read ({type(exc).__name__}); fix or remove it") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object; fix or remove it")
    return text, config


def _plain(value: Any, depth: int = 0) -> bool:
    """A value of the kinds generation settings take: a number, a flag, null, a short text, or lists of them (token
    ids, stop strings, banned sequences)."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return len(value) <= TEXT_LIMIT
    return isinstance(value, list) and depth < 2 and all(_plain(item, depth + 1) for item in value)


def generation_config_text(path: Path) -> str | None:
    """The text to write for a copy of generation_config.json `path` (beside a model trained from it, in an export),
    None where there is no such file: its text where it holds nothing but transformers' generation fields, of the
    kinds they take, else those fields alone. The file was copied whole, and a link there to a file elsewhere (a
    user's credentials in JSON) was copied into the run and its exports; a file that is not a generation config's
    JSON object is a UserError."""
    if not path.is_file():
        return None
    text, config = _read(path)
    kept = {key: value for key, value in config.items() if key in GENERATION_KEYS and _plain(value)}
    return text if kept == config else json.dumps(kept, indent=2) + "\n"


def suggested_sampling(model_dir: str | Path) -> dict[str, Any]:
    """The SamplingParams fields `model_dir`'s generation_config.json suggests ({} where it has none). Its
    `do_sample: false` is greedy decoding, whatever its temperature says, and `do_sample: true` samples, at
    temperature 1 where it gives none, as in transformers; a temperature without `do_sample` is used, as vLLM uses
    it. A file that cannot be read, or a value of the wrong type or out of range, is a UserError naming the file and
    the key."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    _, config = _read(path)
    suggested = {}
    for key, kind in SUGGESTED_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise UserError(f"{path}: {key} is {shown(value)}, not {'a number' if kind is float else 'an integer'}; "
                            "fix or remove it")
        try:
            suggested[key] = kind(value)
        except OverflowError:  # an integer no float holds (10**400): out of every range
            suggested[key] = math.inf
    if suggested.get("top_k") == -1:  # vLLM's "off", as a request's
        suggested["top_k"] = 0
    if config.get("do_sample") is False:
        suggested["temperature"] = 0.0
    elif config.get("do_sample") is True:  # transformers' sampling, at its default temperature where none is given
        suggested.setdefault("temperature", 1.0)
    try:
        SamplingParams(**suggested)
    except InvalidSampling as exc:
        raise UserError(f"{path}: {exc.field} {exc.reason}; fix or remove it") from None
    return suggested


def suggested_note(model_dir: str | Path, suggested: dict[str, Any], overridden: set[str],
                   overrider: str = "an option") -> str | None:
    """'note: sampling as ... suggests' naming what the file suggests and is used (not `overridden` by an option or
    a request field, the `overrider`), or None where nothing of it is."""
    used = [f"{key} {value:g}" for key, value in suggested.items() if key not in overridden]
    if not used:
        return None
    return (f"note: sampling as {Path(model_dir) / GENERATION_CONFIG_FILE} suggests: {', '.join(used)} ({overrider} "
            "given overrides it)")
