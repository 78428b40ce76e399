"""The DeepSpeed JSON a training command names (`--deepspeed`), or the stage's shipped one, read as a JSON object.

Reading it needs neither torch nor DeepSpeed, so the process that starts a job's ranks (`--nproc`, `zerollm launch`)
reads it first: a missing or broken file is one line before any rank starts, not one line per rank. Filling and
checking its values is `llm.train.engine.resolve_ds_config`'s, in every rank.
"""

import json
import math
import re
from pathlib import Path
from typing import Any

import hjson

from llm.errors import UserError, read_user_json_object

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
COMMENTS = re.compile(r"#[^\n]*|//[^\n]*|/\*.*?\*/", re.DOTALL)
"""Hjson's comments: what is left of a file without them is blank where Hjson reads the file as {}."""


def shipped_names() -> list[str]:
    return sorted(path.stem for path in DS_CONFIG_DIR.glob("*.json"))


def load_ds_config(path: str | Path | None, stage: str) -> tuple[dict[str, Any], str]:
    """The raw DeepSpeed JSON and its name for messages: `path`, or the shipped config a missing `path` names (a
    bare name, `pretrain_zero3`, or `ds_configs/pretrain_zero3.json` as the README writes it: found from any
    directory); by default the stage's shipped one, ds_configs/<stage>.json. A file with nothing but blanks and
    comments is refused (Hjson reads it as {})."""
    if path is not None and not str(path).strip():  # `--deepspeed "$UNSET"` took the default silently
        raise UserError("--deepspeed is empty: give a JSON file or a shipped name, or leave the option out for the "
                        f"stage's own ({stage})")
    path = Path(path) if path is not None else DS_CONFIG_DIR / f"{stage}.json"
    if not path.exists() and (path.parent == Path(".") and not path.suffix
                              or path.parent == Path("ds_configs") and path.suffix == ".json"):
        path = DS_CONFIG_DIR / f"{path.stem}.json" if path.stem in shipped_names() else path
    if path.is_dir():
        raise UserError(f"{path}: is a directory; the DeepSpeed config is a JSON file")
    if path.exists() and not path.is_file():  # /dev/null, a pipe
        raise UserError(f"{path}: not a regular file; the DeepSpeed config is a JSON file")
    if not path.is_file():
        raise UserError(f"{path}: DeepSpeed config not found (give a JSON file, or a shipped one by name: "
                        f"{', '.join(shipped_names())})")

    def parse(text: str) -> Any:
        data = parse_as_deepspeed(text)
        content = COMMENTS.sub("", text).strip()
        if data == {} and not content:  # Hjson's {}: ZeRO 0, not the stage's own config
            raise UserError(f"{path}: is empty; give the DeepSpeed settings as a JSON object, or leave --deepspeed "
                            f"out for the stage's own ({stage})")
        if isinstance(data, dict) and not content.startswith("{"):  # Hjson reads `key: value` lines as an object:
            # an Accelerate YAML trained at ZeRO 0 with DeepSpeed's defaults, its zero_stage one more unknown key
            raise UserError(f"{path}: not a JSON object (it does not open with '{{'): a YAML file? DeepSpeed reads its "
                            "config as JSON; an Accelerate config names its DeepSpeed JSON in deepspeed_config_file")
        return data

    return read_user_json_object(path, "DeepSpeed config", parse), str(path)


def _refuse_keys_given_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise ValueError(f"the key {twice!r} is given twice in one object")
    return dict(pairs)


NUMBER = re.compile(r"-?\d+(?:\.\d*)?[eE][+-]?\d+")
"""A number with an exponent: one that may lie beyond a float's range."""


def parse_as_deepspeed(text: str) -> Any:
    """A DeepSpeed config's text read as DeepSpeed reads a config file: as Hjson, so comments and trailing commas are
    taken, and a key given twice is refused (json keeps the last silently: `"stage": 3, "stage": 1` ran ZeRO-1).
    Strict JSON is tried first: where neither reads the text, its error says where and what, unless it stopped at
    a comment (which Hjson takes): then Hjson's error does."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_keys_given_twice)
    except json.JSONDecodeError as strict:
        try:
            return hjson.loads(text, object_pairs_hook=_refuse_keys_given_twice)
        except OverflowError:  # hjson's int() of a number beyond a float's range (it reads 1e400 as infinity)
            huge = next((m for m in NUMBER.finditer(text) if math.isinf(float(m.group()))), None)
            if huge is None:
                raise strict from None
            raise json.JSONDecodeError(f"the number {huge.group()} is beyond a float's range (it would be "
                                       "Infinity)", text, huge.start()) from None
        except hjson.HjsonDecodeError as lenient:
            if text.startswith(("//", "/*", "#"), strict.pos):
                raise json.JSONDecodeError(lenient.msg, text, lenient.pos) from None
            raise strict from None
