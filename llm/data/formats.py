"""Readers of users' files -> canonical records.

Supported files: `.txt` (documents separated by blank lines), `.jsonl` (one JSON value per line) and
`.json` (an array of records, or one record). A record that cannot be used is not dropped silently:
it comes out as `Skipped(source, line, reason)` so the caller can count and report it. A file that
cannot be read at all (missing, binary, not UTF-8, invalid `.json`, unknown extension) raises
`UserError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm.errors import UserError

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".json")


@dataclass(frozen=True)
class Item:
    """One raw value read from a file: a text block (str) or a parsed JSON value."""

    source: str
    line: int
    value: Any


@dataclass(frozen=True)
class Skipped:
    source: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}"


class RecordError(ValueError):
    """A record whose shape or content cannot be used; becomes a `Skipped`."""


def expand_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Files named directly, plus the supported files under any directory (sorted)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
            if not found:
                raise UserError(f"{path}: directory holds no {'/'.join(SUPPORTED_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in SUPPORTED_SUFFIXES:
                raise UserError(f"{path}: unknown format '{path.suffix}'; expected one of {', '.join(SUPPORTED_SUFFIXES)}")
            files.append(path)
        else:
            raise UserError(f"{path}: no such file or directory")
    if not files:
        raise UserError("no input files given")
    for path in files:
        _check_text_file(path)
    return files


def _check_text_file(path: Path) -> None:
    with path.open("rb") as f:
        head = f.read(8192)
    if b"\x00" in head:
        raise UserError(f"{path}: looks like a binary file (NUL bytes); expected UTF-8 text")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{number}: not valid UTF-8 text") from None


def _txt_items(path: Path) -> Iterator[Item]:
    block: list[str] = []
    start = 0
    for number, line in _lines(path):
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield Item(str(path), start, "".join(block).rstrip("\n"))
            block = []
    if block:
        yield Item(str(path), start, "".join(block).rstrip("\n"))


def _jsonl_items(path: Path) -> Iterator[Item | Skipped]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            yield Item(str(path), number, json.loads(line))
        except json.JSONDecodeError as exc:
            yield Skipped(str(path), number, f"malformed JSON ({exc.msg})")


def _json_items(path: Path) -> Iterator[Item]:
    text = "".join(line for _, line in _lines(path))
    if not text.strip():
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}); a .json file must hold one array or object") from None
    if not isinstance(value, list):
        yield Item(str(path), 1, value)
        return
    # line numbers of array elements: re-scan element starts with the raw decoder
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    line = text.count("\n", 0, pos) + 1
    for element in value:
        while text[pos] in " \t\r\n,":
            line += text[pos] == "\n"
            pos += 1
        _, end = decoder.raw_decode(text, pos)
        yield Item(str(path), line, element)
        line += text.count("\n", pos, end)
        pos = end


def read_items(path: Path) -> Iterator[Item | Skipped]:
    """Raw values of one file (checked by `expand_inputs`), streamed; a `.json` array is parsed whole."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _txt_items(path)
    if suffix == ".jsonl":
        return _jsonl_items(path)
    return _json_items(path)


def _require_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{what} is {type(value).__name__}, expected a string")
    return value


def _turn_text(turn: Any) -> str:
    if not isinstance(turn, dict):
        raise RecordError("conversation turn is not an object")
    for key in ("content", "value"):
        if key in turn:
            return _require_text(turn[key], f"turn '{key}'")
    raise RecordError("conversation turn has neither 'content' nor 'value'")


def pretrain_text(value: Any) -> str:
    """The text a record contributes to pretraining.

    Plain strings and `{"text"}` records (MiniMind) as they are; conversations, Alpaca and DPO
    records are flattened to their turns' text joined by newlines.
    """
    if isinstance(value, str):
        text = value
    elif not isinstance(value, dict):
        raise RecordError(f"record is {type(value).__name__}, expected an object or a string")
    elif "text" in value:
        text = _require_text(value["text"], "'text'")
    elif "conversations" in value or "messages" in value:
        turns = value.get("conversations", value.get("messages"))
        if not isinstance(turns, list):
            raise RecordError("'conversations' is not a list")
        parts = [_turn_text(t) for t in turns]
        if "chosen" in value:
            chosen = value["chosen"]
            parts.append(_turn_text(chosen) if isinstance(chosen, dict) else _require_text(chosen, "'chosen'"))
        text = "\n".join(parts)
    elif "instruction" in value and "output" in value:
        parts = [value["instruction"], value.get("input", ""), value["output"]]
        text = "\n".join(_require_text(p, "alpaca field") for p in parts if p != "")
    else:
        keys = ", ".join(sorted(value)) or "none"
        raise RecordError(f"no text field (keys: {keys}); expected 'text', 'conversations' or 'instruction'/'output'")
    if not text.strip():
        raise RecordError("empty text")
    return text


# ---- conversations (SFT) and preference pairs (DPO) ------------------------------------------------

ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "bot": "assistant"}


def _message(turn: Any) -> dict[str, str]:
    """A {role, content} message from an OpenAI/MiniMind {role, content} or ShareGPT {from, value} turn."""
    if not isinstance(turn, dict):
        raise RecordError("conversation turn is not an object")
    raw_role = turn.get("role", turn.get("from"))
    if raw_role not in ROLE_ALIASES:
        raise RecordError(f"unknown role {raw_role!r}; expected one of {', '.join(ROLE_ALIASES)}")
    return {"role": ROLE_ALIASES[raw_role], "content": _turn_text(turn)}


def _messages(turns: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise RecordError(f"{what} is not a list of turns")
    return [_message(t) for t in turns]


def conversation(value: Any) -> list[dict[str, str]]:
    """Canonical messages of an SFT record: `conversations`/`messages` turns, or Alpaca
    instruction (+ input) -> user, output -> assistant. Turns after the last assistant reply are dropped.

    Refused (RecordError, so the record is skipped and reported): a record with no assistant reply,
    an empty assistant reply, an unknown role, a non-string content.
    """
    if not isinstance(value, dict):
        raise RecordError(f"record is {type(value).__name__}, expected an object")
    if "conversations" in value or "messages" in value:
        messages = _messages(value.get("conversations", value.get("messages")), "'conversations'")
    elif "instruction" in value and "output" in value:
        instruction = _require_text(value["instruction"], "'instruction'")
        extra = _require_text(value.get("input") or "", "'input'")
        messages = [{"role": "user", "content": f"{instruction}\n{extra}" if extra else instruction},
                    {"role": "assistant", "content": _require_text(value["output"], "'output'")}]
        if value.get("system"):
            messages.insert(0, {"role": "system", "content": _require_text(value["system"], "'system'")})
    else:
        keys = ", ".join(sorted(value)) or "none"
        raise RecordError(f"not a conversation (keys: {keys}); expected 'conversations', 'messages' or "
                          "'instruction'/'output'")
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise RecordError("no assistant reply")
    if any(not messages[i]["content"].strip() for i in replies):
        raise RecordError("empty assistant reply")
    return messages[:replies[-1] + 1]


def _response(value: Any, what: str) -> str:
    """The reply text of a DPO `chosen`/`rejected`: a string, one turn object, or a list ending in a reply."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, dict):
        text = _message(value)["content"]
    elif isinstance(value, list) and value:
        text = _messages(value, what)[-1]["content"]
    else:
        raise RecordError(f"{what} is missing or not a string, turn or list of turns")
    if not text.strip():
        raise RecordError(f"empty {what}")
    return text


def preference(value: Any) -> tuple[list[dict[str, str]], str, str]:
    """(prompt messages, chosen reply, rejected reply) of a DPO record. The prompt is `conversations` /
    `messages` turns or a `prompt` string (a user message)."""
    if not isinstance(value, dict) or "chosen" not in value or "rejected" not in value:
        raise RecordError("a preference record needs 'chosen' and 'rejected'")
    if "conversations" in value or "messages" in value:
        prompt = _messages(value.get("conversations", value.get("messages")), "'conversations'")
    elif isinstance(value.get("prompt"), str):
        prompt = [{"role": "user", "content": value["prompt"]}]
    elif isinstance(value.get("prompt"), list):
        prompt = _messages(value["prompt"], "'prompt'")
    else:
        raise RecordError("no prompt: expected 'conversations', 'messages' or 'prompt'")
    if not prompt or prompt[-1]["role"] != "user":
        raise RecordError("the prompt must end with a user turn")
    return prompt, _response(value["chosen"], "'chosen'"), _response(value["rejected"], "'rejected'")


READERS = {"pretrain": pretrain_text, "sft": conversation, "dpo": preference}


def read_records(files: Iterable[Path], kind: str) -> Iterator[Item | Skipped]:
    """Every file's records converted for `kind` (text, messages or a preference triple) as `Item`s,
    unusable ones as `Skipped`."""
    convert = READERS[kind]
    for path in files:
        for item in read_items(path):
            if isinstance(item, Skipped):
                yield item
                continue
            try:
                yield Item(item.source, item.line, convert(item.value))
            except RecordError as exc:
                yield Skipped(item.source, item.line, str(exc))
