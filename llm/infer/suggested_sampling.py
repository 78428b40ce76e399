"""A Hugging Face model folder's `generation_config.json`: the sampling its authors suggest (Qwen3's temperature 0.6,
top-k 20 and top-p 0.95, against greedy decoding's endless repetitions), which transformers' `generate` and vLLM
apply wherever a request leaves an option out. `generate`, `chat` and `serve` do the same. And the end tokens it and
config.json declare, at which they stop."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llm.errors import UserError
from llm.infer.sampling import InvalidSampling, SamplingParams
from llm.rundir import GENERATION_CONFIG_FILE, HF_CONFIG_FILE
from llm.wording import shown

MAX_FILE_BYTES = 1 << 20
"""Far more than a generation config or a model's config.json holds (a few hundred bytes, a few kilobytes): a larger
file is refused before it is read."""
SUGGESTED_FIELDS = {"temperature": float, "top_k": int, "top_p": float, "repetition_penalty": float}
"""The keys read (vLLM's, less min_p, which the sampler has not) and the type of each."""


TEXT_KEYS = frozenset({"transformers_version", "cache_implementation", "stop_strings"})
"""The generation settings of text (`generation_config_text`): a copy keeps no other text."""
TEXT_LIMIT = 64
"""The longest text a copy keeps (a version, a cache's name, a stop string)."""


def _read(path: Path) -> tuple[str, dict[str, Any]]:
    """generation_config.json's (or config.json's) text and object; a UserError naming `path` for a file that is too
    large, not JSON or not an object."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise UserError(f"{path}: {path.stat().st_size:,} bytes, far more than such a config holds; fix or "
                            "remove it")
        text = path.read_text(encoding="utf-8")
        config = json.loads(text)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise UserError(f"{path}: cannot be read ({type(exc).__name__}); fix or remove it") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object; fix or remove it")
    return text, config


def _settings(path: Path) -> dict[str, Any]:
    """The object of a model folder's JSON config `path` (`_read`), {} where the folder has no such file."""
    return _read(path)[1] if path.is_file() else {}


def _numeric(value: Any, depth: int = 0) -> bool:
    """A number, a flag, null, or lists of them (token ids, banned sequences, a penalty's pair)."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, list) and depth < 3 and all(_numeric(item, depth + 1) for item in value)


def _texts_kept(value: Any) -> Any:
    """A text setting's value with its texts of up to TEXT_LIMIT characters (None where none is left)."""
    if isinstance(value, str):
        return value if len(value) <= TEXT_LIMIT else None
    short = [text for text in value if isinstance(text, str) and len(text) <= TEXT_LIMIT] \
        if isinstance(value, list) else []
    return short or None


def generation_config_text(path: Path) -> str | None:
    """The text to write for a copy of generation_config.json `path` (beside a model trained from it, in an export),
    None where there is no such file: its text where it holds nothing but numbers, flags and token ids, and the
    texts of TEXT_KEYS, else those settings alone. The file was copied whole, and a link there to a file elsewhere
    (a user's credentials in JSON) was copied into the run and its exports; a file that is not a JSON object is a
    UserError."""
    if not path.is_file():
        return None
    text, config = _read(path)
    kept = {key: value for key, value in config.items() if _numeric(value)}
    kept.update({key: short for key in TEXT_KEYS & set(config) if (short := _texts_kept(config[key])) is not None})
    kept = {key: kept[key] for key in config if key in kept}  # in the file's order
    return text if kept == config else json.dumps(kept, indent=2) + "\n"


def suggested_sampling(model_dir: str | Path) -> dict[str, Any]:
    """The SamplingParams fields `model_dir`'s generation_config.json suggests ({} where it has none). Its
    `do_sample: false` is greedy decoding, whatever its temperature says, and `do_sample: true` samples, at
    temperature 1 where it gives none, as in transformers; a temperature without `do_sample` is used, as vLLM uses
    it. A file that cannot be read, or a value of the wrong type or out of range, is a UserError naming the file and
    the key."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    config = _settings(path)
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


def declared_stop_ids(model_dir: str | Path) -> set[int]:
    """The end tokens `model_dir`'s config.json and generation_config.json declare (`eos_token_id`: an id or a list),
    which transformers' `generate` and vLLM stop at besides the tokenizer's: Llama 3.1's `<|eom_id|>`, the end of a
    tool call's turn, is in neither the tokenizer's end nor its turn end, and replies ran on past it. A value that is
    not an integer or a list of them is a UserError naming the file; a negative one (transformers only warns of it)
    is no token, and left out."""
    declared: set[int] = set()
    for name in (HF_CONFIG_FILE, GENERATION_CONFIG_FILE):
        path = Path(model_dir) / name
        value = _settings(path).get("eos_token_id")
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise UserError(f"{path}: eos_token_id is {shown(value)}, not a token id or a list of them; fix or "
                            "remove it")
        declared.update(i for i in ids if i >= 0)
    return declared


UNAPPLIED_DEFAULTS = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                      "no_repeat_ngram_size": 0, "num_beams": 1, "penalty_alpha": 0.0, "bad_words_ids": None,
                      "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                      "min_length": 0, "min_new_tokens": 0, "stop_strings": None, "forced_bos_token_id": None,
                      "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "guidance_scale": 1.0,
                      "watermarking_config": None}
"""transformers' decoding settings that zerollm's sampler has not, each with the value that leaves it off there:
a file setting one otherwise (`min_p: 0.1`) decodes otherwise in transformers, and was dropped without a word."""


def unapplied_settings(model_dir: str | Path) -> list[str]:
    """'key value' for each setting of `model_dir`'s generation_config.json that changes transformers' decoding and
    that zerollm does not apply."""
    config = _settings(Path(model_dir) / GENERATION_CONFIG_FILE)
    return [f"{key} {shown(config[key])}" for key, off in UNAPPLIED_DEFAULTS.items()
            if key in config and config[key] not in (off, None, [], {})]


def suggested_note(model_dir: str | Path, suggested: dict[str, Any], overridden: set[str],
                   overrider: str = "an option") -> str | None:
    """'note: sampling as ... suggests' naming what the file suggests and is used (not `overridden` by an option or
    a request field, the `overrider`), and what of it is not applied (`unapplied_settings`), or None where nothing
    of it is either."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    used = [f"{key} {value:g}" for key, value in suggested.items() if key not in overridden]
    unapplied = unapplied_settings(model_dir)
    said = [f"sampling as {path} suggests: {', '.join(used)} ({overrider} given overrides it)"] if used else []
    if unapplied:
        said.append(f"{'' if used else f'{path} sets '}{', '.join(unapplied)}, which zerollm's sampler does not "
                    "apply")
    return f"note: {'; '.join(said)}" if said else None
