"""Reading the JSON Lines files a run appends to (metrics.jsonl, samples.jsonl, run_record.jsonl), whose last line
a killed run may have cut anywhere, even inside a character; what reading JSON text raises, said for a message; and
strict JSON to write (no NaN or Infinity)."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

JSON_ERRORS = (ValueError, RecursionError)
"""What `json` raises on text it cannot turn into a value: malformed JSON (`JSONDecodeError`, a ValueError), an
integer longer than Python converts (ValueError) and a value nested deeper than the recursion limit."""


def json_problem(exc: ValueError | RecursionError) -> str:
    """What is wrong with the JSON text that raised `exc` (one of `JSON_ERRORS`), for a message."""
    if isinstance(exc, json.JSONDecodeError):
        return exc.msg
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return f"an integer of more than {sys.get_int_max_str_digits()} digits"


class JsonLine(NamedTuple):
    number: int
    offset: int
    """Where the line starts in the file, in bytes."""
    text: str
    value: Any
    """The line's JSON value; None where the line is not JSON (or not UTF-8)."""
    ended: bool
    """Whether a newline ends the line: the last line a killed run was writing has none."""


def jsonl_lines(path: Path) -> Iterator[JsonLine]:
    """The lines of a jsonl file that are not blank, read one at a time and decoded one by one: a line that is not
    UTF-8 (a write cut mid-character by a kill) is not JSON, as an ASCII line cut short is not, and the others still
    read. Only newlines end lines (U+2028 inside a JSON string, written as is, does not)."""
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if text.strip():
                try:
                    value = json.loads(raw.decode("utf-8"))
                except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                    value = None
                yield JsonLine(number, offset, text, value, raw.endswith(b"\n"))
            offset += len(raw)


def strict_json(value: Any) -> Any:
    """`value` with every number that is not finite as None: a row of metrics.jsonl is strict JSON, as `zerollm eval
    --json` writes it. The MFU of a GPU whose peak is unknown is NaN, the gradient norm of an fp16 step DeepSpeed
    skipped is inf, and json.dumps writes them as bare NaN / Infinity, which jq, JavaScript and pandas' strict readers
    refuse. Readers take null as "no value" (`zerollm plot` leaves the point out); wandb still gets the number."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(value: Any, **options: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, **options)` that UTF-8 can encode: a file name that is not UTF-8 (GBK
    bytes from a zip made on Windows), which Python holds with lone surrogates for its bytes, is written as their
    `\\udcXX` escapes (ASCII), which json.loads reads back to the same name; written as they are, they ended the
    write in a UnicodeEncodeError."""
    text = json.dumps(value, ensure_ascii=False, **options)
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)  # only inside strings: JSON's syntax is ASCII
