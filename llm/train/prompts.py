"""GRPO's prompt set, read straight from the users' files (`--prompts FILE...`; no `data prepare` step).

A record is one of

    {"conversations": [..., {"role": "user", ...}, ...], ...}   MiniMind's RL shape (also "messages"): the prompt is
                                                              every turn up to the final user turn (MiniMind's
                                                              empty assistant placeholder after it is ignored)
    {"prompt": "text" | [turns], "answer": ..., ...}          a prompt string (one user message) or turns
    a plain string (a .txt block or a JSON string)            one user message

A top-level "system" text opens the prompt as a system turn, as in `data prepare` (`llm.data.formats.with_system`),
and tool definitions (a top-level "tools", or MiniMind's on its system turn: `llm.data.formats.tool_definitions`) go
to the chat template with it. Every other field of a record (`answer`, a top-level `tools` too, as TRL passes it to
its reward functions) travels with the prompt to the rewards.
Files are read record by record; the prompts are held in memory as token ids (a few hundred bytes each). A record
that cannot be used (malformed, no user turn, missing a field the rewards need, longer than data.seq_len -
grpo.max_new_tokens tokens, refused by the chat template) is skipped and reported as file:line; a set with no usable
prompt is a `UserError`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from llm.chat_template import MessagesRefused
from llm.data.formats import (
    Item,
    RecordError,
    Skipped,
    expand_inputs,
    one_reading,
    prompt_readings,
    read_items,
    tool_definitions,
    with_system,
)
from llm.data.readers import json_type
from llm.errors import UserError
from llm.tokenizer import TextNotEncoded

PROMPT_KEYS = ("conversations", "messages", "prompt")
CONSUMED_KEYS = (*PROMPT_KEYS, "system")
"""Fields that make the prompt; the others go to the rewards."""


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, str]]
    """The conversation so far, ending with the user's turn."""
    fields: dict[str, Any]
    """The record's other fields (`answer`, ...), for the rewards."""
    ids: list[int]
    """Token ids of the rendered prompt, the assistant's turn opened."""


def prompt_record(value: Any) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """(prompt messages, other fields) of one record; RecordError when it holds no usable prompt."""
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        raise RecordError(f"record is {json_type(value)}, expected an object or a string")
    messages = one_reading(value, prompt_readings(value))
    if messages is None:
        keys = ", ".join(sorted(value)) or "none"
        raise RecordError(f"no prompt (keys: {keys}); expected 'conversations', 'messages' or 'prompt'")
    messages = with_system(value, messages)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise RecordError("no user turn")
    messages = messages[:users[-1] + 1]
    if not messages[-1]["content"].strip():
        raise RecordError("empty user turn")
    return messages, {k: v for k, v in value.items() if k not in CONSUMED_KEYS}


class PromptSet(Dataset):
    """Prompts by index, for the resumable sampler; `skipped` lists every unusable record as 'file:line: reason'."""

    def __init__(self, prompts: list[Prompt], skipped: list[str]) -> None:
        self.prompts, self.skipped = prompts, skipped

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    def summary(self, shown: int = 20) -> str:
        """What was read, and every skipped record (the first `shown` of them by place, the rest by reason)."""
        lines = [f"{len(self.prompts):,} prompts"]
        if self.skipped:
            reasons = Counter(s.split(": ", 1)[1] for s in self.skipped)
            lines.append(f"skipped {len(self.skipped):,} records: "
                         + "; ".join(f"{r} x{n}" for r, n in reasons.most_common(5)))
            lines += [f"  {s}" for s in self.skipped[:shown]]
            if len(self.skipped) > shown:
                lines.append(f"  ... and {len(self.skipped) - shown} more")
        return "\n".join(lines)


Encode = Callable[[list[dict[str, str]], list[dict] | None], list[int]]
"""Renders and tokenizes a prompt's messages given its tool definitions (None for none)."""


def _usable(item: Item, encode: Encode, max_tokens: int, required_fields: Iterable[str]) -> Prompt:
    messages, fields = prompt_record(item.value)
    for name in required_fields:
        value = fields.get(name)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise RecordError(f"no '{name}' string or number, which the reward needs")
        if isinstance(value, str) and not value.strip():  # an empty completion would match it
            raise RecordError(f"an empty '{name}', which the reward needs")
    ids = encode(messages, tool_definitions(item.value) if isinstance(item.value, dict) else None)
    if len(ids) > max_tokens:
        raise RecordError(f"prompt of {len(ids)} tokens is longer than data.seq_len - grpo.max_new_tokens = "
                          f"{max_tokens}")
    return Prompt(messages, fields, ids)


def read_prompts(paths: list[str], encode: Encode, max_tokens: int, required_fields: Iterable[str] = ()) -> PromptSet:
    """Every usable prompt of the files (or directories) in order (a directory's run directories left out, this
    run's among them: `expand_inputs`); `encode` renders and tokenizes a prompt."""
    prompts, skipped = [], []
    for path in expand_inputs(paths):
        for item in read_items(path):
            if isinstance(item, Skipped):
                skipped.append(str(item))
                continue
            try:
                prompts.append(_usable(item, encode, max_tokens, required_fields))
            except (RecordError, MessagesRefused, TextNotEncoded) as exc:
                skipped.append(str(Skipped(item.source, item.line, str(exc))))
    if not prompts:
        first = f"; first: {skipped[0]}" if skipped else ""
        raise UserError(f"{', '.join(paths)}: no usable prompt ({len(skipped)} records skipped{first})")
    return PromptSet(prompts, skipped)
