"""Users' records -> canonical records: pretraining text, conversations (SFT) and preference pairs (DPO).

Records come from `llm.data.readers` (text files, JSON, tables). Conversations become canonical messages (see
`message`), the shape the tokenizer renders:

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "reasoning_content": str,                           # assistant only, when the record has it
     "tool_calls": [{"name": str, "arguments": dict | str, "id": str}, ...],  # assistant only, when the record
                                                         # has them; "id" where the call has one
     "weight": 0,                                        # assistant only: OpenAI's mark of a reply not to learn
     "name": str, "tool_call_id": str}                   # tool only, where the record has them

Accepted turn shapes: OpenAI/MiniMind `{"role", "content"}` (content may be a list of text parts; an assistant
turn may carry `reasoning_content`, `tool_calls` in OpenAI's `{"function": {...}}` form or plain `{"name",
"arguments"}`, or a legacy `function_call`), ShareGPT `{"from", "value"}` (human, gpt, system, function_call,
observation). A top-level `system` beside the turns (LLaMA-Factory, Alpaca) becomes the opening system turn
(`with_system`). A record that cannot be used raises `RecordError`; `read_records` turns it into a `Skipped`
naming its place, so the caller counts and reports it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from llm.data.readers import (
    FIXED_RECORD_LIMIT,
    PIECE_CHARS,
    Item,
    RecordLimit,
    Skipped,
    expand_inputs,
    json_type,
    read_items,
    skipped_note,
    split_text,
)
from llm.jsonl import JSON_ERRORS, json_problem

__all__ = ["Chat", "Item", "Pair", "RecordError", "Skipped", "conversation", "expand_inputs", "preference",
           "pretrain_text", "PretrainTexts", "read_items", "read_records", "skipped_note", "tool_definitions",
           "with_system"]

Message = dict[str, Any]


class RecordError(ValueError):
    """A record whose shape or content cannot be used; becomes a `Skipped`."""


def _require_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{what} is {json_type(value)}, expected a string")
    return value


# ---- messages ---------------------------------------------------------------------------------------

ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "bot": "assistant", "tool": "tool", "observation": "tool", "function": "tool",
                "function_call": "assistant"}


def _content(turn: dict, role: str) -> str:
    """A turn's text: `content` or `value`, a string or a list of text parts; may be absent on an assistant turn
    that calls tools."""
    if turn.get("content") is not None and turn.get("value") is not None and turn["content"] != turn["value"]:
        raise RecordError("'content' and 'value' give different text; keep one")  # 'value' was dropped
    key = "content" if "content" in turn else "value"
    value = turn.get(key)
    if isinstance(value, list):  # OpenAI content parts
        kinds = {(str(part["type"]) if "type" in part else "none (no 'type')") if isinstance(part, dict)
                 else type(part).__name__ for part in value}
        if kinds - {"text"}:
            raise RecordError(f"turn '{key}' has parts of type {', '.join(sorted(kinds - {'text'}))}; "
                              "only text parts can be trained on")
        value = "".join(_require_text(part.get("text"), "text part") for part in value)
    if value is None and role == "assistant":
        return ""
    if value is None:
        raise RecordError(f"{role} turn has neither 'content' nor 'value'")
    return _require_text(value, f"turn '{key}'")


def call_arguments(arguments: Any) -> Any:
    """A tool call's arguments as chat templates take them: the text of a JSON object (OpenAI's form) as that
    object, as given in the other form; templates put an object's JSON in the text, but a string's JSON is the text
    quoted again (`"{\"city\": ...}"`), so data mixing the two forms taught two formats of call (and a served
    model saw another than it was trained on). Anything else as it is."""
    if isinstance(arguments, str):
        with contextlib.suppress(*JSON_ERRORS):  # other text stays text
            parsed = json.loads(arguments)
            return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _tool_call(call: Any) -> dict[str, Any]:
    """{"name", "arguments"} from OpenAI's {"type": "function", "function": {...}} or a plain call object."""
    if isinstance(call, str):
        call = _json_text(call, "tool call")
    if not isinstance(call, dict):
        raise RecordError(f"tool call is {json_type(call)}, expected an object")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordError("tool call has no 'name' string")
    arguments = call_arguments(function.get("arguments", {}))
    if not isinstance(arguments, (dict, str)):
        raise RecordError(f"tool call '{function['name']}' arguments are {json_type(arguments)}, expected an "
                          "object or a string")
    return {"name": function["name"], "arguments": arguments, **call_id(call)}


def call_id(call: dict) -> dict[str, str]:
    """A tool call's `id` (OpenAI's, which a tool turn's `tool_call_id` answers; Mistral's templates render both and
    refuse a call without one), as `{"id": ...}`, or nothing where it has no string id."""
    return {"id": call["id"]} if isinstance(call.get("id"), str) else {}


def _json_text(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except JSON_ERRORS as exc:
        raise RecordError(f"{what} is not valid JSON ({json_problem(exc)})") from None


def _tool_calls(turn: dict, raw_role: str) -> list[dict[str, Any]]:
    if raw_role == "function_call":  # ShareGPT: the value is the call, or a list of calls (LLaMA-Factory's parallel)
        value = turn.get("value", turn.get("content"))
        value = _json_text(value, "tool call") if isinstance(value, str) else value
        return [_tool_call(call) for call in (value if isinstance(value, list) else [value])]
    calls = turn.get("tool_calls")
    if isinstance(calls, str):  # some datasets store the list as JSON text
        calls = _json_text(calls, "'tool_calls'")
    if calls is None:
        calls = []
    elif isinstance(calls, dict):
        calls = [calls]
    elif not isinstance(calls, list):
        raise RecordError(f"'tool_calls' is {json_type(calls)}, expected a list of tool calls")
    else:
        calls = list(calls)  # a copy: the legacy call below is appended to it
    if turn.get("function_call") is not None:  # OpenAI's legacy single call
        calls.append(turn["function_call"])
    return [_tool_call(call) for call in calls]


def message(turn: Any) -> Message:
    """The canonical message of one turn; nothing the turn carries among content, reasoning_content, tool_calls
    and a tool's name is dropped. Reasoning or tool calls on a turn other than the assistant's are refused."""
    if not isinstance(turn, dict):
        raise RecordError("conversation turn is not an object")
    raw_role = turn.get("role", turn.get("from"))
    if not isinstance(raw_role, str) or raw_role not in ROLE_ALIASES:
        raise RecordError(f"unknown role {raw_role!r}; expected one of {', '.join(ROLE_ALIASES)}")
    given = turn.get("from")  # beside 'role', it was dropped: a user turn read as the assistant's was learnt
    if given is not None and (not isinstance(given, str) or ROLE_ALIASES.get(given) != ROLE_ALIASES[raw_role]):
        raise RecordError(f"'role' and 'from' give different roles ({raw_role!r}, {given!r}); keep one")
    role = ROLE_ALIASES[raw_role]
    calls = _tool_calls(turn, raw_role)
    out: Message = {"role": role, "content": "" if raw_role == "function_call" else _content(turn, role)}
    reasoning = reasoning_text(turn)
    if role != "assistant" and (calls or reasoning):
        raise RecordError(f"{role} turn carries {'tool_calls' if calls else 'reasoning'}; only assistant turns may")
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    if role == "assistant" and _weight(turn) == 0:
        out["weight"] = 0
    if role == "tool":
        out.update({key: turn[key] for key in ("name", "tool_call_id") if isinstance(turn.get(key), str)})
    return out


REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
"""Where a turn's reasoning is kept: DeepSeek's and Qwen's `reasoning_content`, vLLM's newer `reasoning`, the
`thinking` of gpt-oss's template and of datasets made for it."""


def reasoning_text(turn: dict) -> str:
    """A turn's reasoning ("" for none), from whichever of `REASONING_KEYS` it is under; RecordError where it is
    not a string, or where two of them give different text (one would be dropped without a word)."""
    given = {key: _require_text(turn[key], f"'{key}'") for key in REASONING_KEYS if turn.get(key) is not None}
    texts = {text for text in given.values() if text}  # "" is no reasoning, under any key
    if len(texts) > 1:
        raise RecordError(f"{' and '.join(repr(key) for key in given)} give different reasoning; keep one")
    return texts.pop() if texts else ""


def _weight(turn: dict) -> int:
    """An assistant turn's `weight` in OpenAI's fine-tuning format: 0 (the reply is context, not learnt) or 1 (the
    default); RecordError for another value."""
    weight = turn.get("weight")
    if weight is None:
        return 1
    if isinstance(weight, bool) or weight not in (0, 1):
        raise RecordError(f"'weight' is {json.dumps(weight)[:40]}, expected 0 (not learnt) or 1")
    return int(weight)


def _messages(turns: Any, what: str) -> list[Message]:
    if not isinstance(turns, list):
        raise RecordError(f"{what} is not a list of turns")
    return [message(t) for t in turns]


def _is_empty_reply(m: Message) -> bool:
    return m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls")


def _alpaca(value: dict, answer_key: str | None) -> list[Message]:
    """Alpaca `history` ([[question, answer], ...]), `instruction` + `input` (one user turn) and, when `answer_key` is
    given, its value as the assistant reply (its `system`, as any record's, is `with_system`'s)."""
    instruction = _require_text(value["instruction"], "'instruction'")
    extra = _require_text(value.get("input") or "", "'input'")
    messages = []
    history = value.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
        raise RecordError("'history' is not a list of [question, answer] pairs")
    for question, answer in history:
        messages += [{"role": "user", "content": _require_text(question, "'history' question")},
                     {"role": "assistant", "content": _require_text(answer, "'history' answer")}]
    messages.append({"role": "user", "content": "\n".join(part for part in (instruction, extra) if part)})  # as
    # LLaMA-Factory joins them: an empty instruction left a stray line end before the input
    if answer_key is not None:
        messages.append({"role": "assistant", "content": _require_text(value[answer_key], f"'{answer_key}'")})
    return messages


def one_reading(value: dict, readings: dict[str, Callable[[], list[Message]]]) -> list[Message] | None:
    """The turns record `value` gives by the keys of `readings` (each read by its function), None where it holds
    none of them. A record may give them several ways when they agree, each the start of the longest, which is used:
    Magpie's records give their turns as both 'conversations' and 'messages', UltraChat's its first prompt as
    'prompt' beside 'messages'. Where they disagree, RecordError: one was used and the other dropped without a
    word."""
    found = {key: read() for key, read in readings.items() if value.get(key) is not None}  # null: not given
    if not found:
        return None
    longest = max(found, key=lambda key: len(found[key]))
    for key, turns in found.items():
        if found[longest][:len(turns)] != turns:
            raise RecordError(f"'{longest}' and '{key}' give different turns; keep one")
    return found[longest]


TURNS_KEYS = ("conversations", "messages")


def _turns_readings(value: dict) -> dict[str, Callable[[], list[Message]]]:
    return {key: partial(_messages, value.get(key), f"'{key}'") for key in TURNS_KEYS}


def with_system(value: dict, messages: list[Message]) -> list[Message]:
    """`messages` opened by the record's top-level `system` text (LLaMA-Factory's ShareGPT and Alpaca shapes), when
    it has one. A record with both that field and a system turn of its own is refused: which one is meant?"""
    system = value.get("system")
    if system is None or system == "":
        return messages
    system = _require_text(system, "'system'")
    if messages and messages[0]["role"] == "system":
        raise RecordError("both a 'system' field and a system turn; keep one")
    return [{"role": "system", "content": system}, *messages]


def _written_messages(value: dict) -> list[Message] | None:
    """The messages of a conversation record, every turn as written (the shapes of `conversation`), with its
    `system`; None for a record of neither shape."""
    readings = _turns_readings(value)
    if "output" in value:  # an 'instruction' alone (Magpie's, beside its conversations) is no conversation
        readings["instruction"] = partial(_alpaca, value, "output")
    if "completion" in value:  # a 'prompt' alone (UltraChat's, beside its messages) is none either
        readings["prompt"] = partial(_prompt_completion, value)
    messages = one_reading(value, readings)
    return None if messages is None else with_system(value, messages)


def _prompt_completion(value: dict) -> list[Message]:
    """TRL's prompt-completion record: the prompt's turns as context (its replies of weight 0), the completion's
    learnt. TRL's unpaired preference record (KTO's: a `label` beside them) is refused: SFT would learn a completion
    labelled bad."""
    if "label" in value:
        raise RecordError("a 'label' beside 'prompt' and 'completion' (KTO's unpaired preference record), which SFT "
                          "would learn whatever it says; give the completions to learn, or pairs to `--kind dpo`")
    context = _prompt_turns(value["prompt"])
    return [{**turn, "weight": 0} if turn["role"] == "assistant" else turn for turn in context] + _reply_turns(
        value["completion"], "'completion'")


def conversation(value: Any) -> list[Message]:
    """Canonical messages of an SFT record: `conversations`/`messages` turns, Alpaca (`instruction`, `input`,
    `output`, optional `history`) or TRL's prompt-completion (`prompt` and `completion`, each text or turns), any
    with an optional top-level `system`. Turns after the last assistant reply to learn (not of `weight` 0) teach
    nothing and are left out.

    Refused (RecordError): no assistant reply to learn, an empty assistant reply (neither content nor tool calls),
    an unknown role, a non-string content, reasoning or tool calls outside an assistant turn, a malformed tool call,
    a `weight` other than 0 or 1, a `system` field beside a system turn.
    """
    if not isinstance(value, dict):
        raise RecordError(f"record is {json_type(value)}, expected an object")
    messages = _written_messages(value)
    if messages is None:
        keys = ", ".join(sorted(value)) or "none"
        raise RecordError(f"not a conversation (keys: {keys}); expected 'conversations', 'messages', "
                          "'instruction'/'output' or 'prompt'/'completion'")
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise RecordError("no assistant reply")
    if any(_is_empty_reply(messages[i]) for i in replies):
        raise RecordError("empty assistant reply")
    learnt = [i for i in replies if messages[i].get("weight") != 0]
    if not learnt:
        raise RecordError("every assistant reply has weight 0: nothing to learn")
    return messages[:learnt[-1] + 1]


# ---- preference pairs ---------------------------------------------------------------------------------

def _reply_turns(value: Any, what: str) -> list[Message]:
    """A DPO `chosen`/`rejected`: a string (the reply), one turn object, or a list of turns (the reply, or the
    whole conversation ending in it)."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        has_role = "role" in value or "from" in value
        return [message(value if has_role else {**value, "role": "assistant"})]
    if isinstance(value, list):
        if not value:
            raise RecordError(f"{what} is an empty list; expected the reply (a string, turn or list of turns)")
        return _messages(value, what)
    raise RecordError(f"{what} is {json_type(value)}, expected a string, turn or list of turns")


def _explicit_prompt(value: dict) -> list[Message]:
    return one_reading(value, {**prompt_readings(value), "instruction": partial(_alpaca, value, None)}) or []


def prompt_readings(value: dict) -> dict[str, Callable[[], list[Message]]]:
    """The ways a record gives a prompt, for `one_reading`: 'conversations', 'messages' or 'prompt'."""
    return {**_turns_readings(value), "prompt": partial(_prompt_turns, value.get("prompt"))}


def _prompt_turns(prompt: Any) -> list[Message]:
    """A record's `prompt`: a user message's text, or a list of turns."""
    if isinstance(prompt, str):
        if not prompt.strip():  # a prompt of nothing trained a pair answering an empty user turn
            raise RecordError("empty 'prompt'")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return _messages(prompt, "'prompt'")
    raise RecordError(f"'prompt' is {json_type(prompt)}, expected a string or a list of turns")


def _turn_said(turns: list[Message], index: int) -> str:
    """Turn `index` of `turns` in a few words ('a system turn', 'no turn'), for where a pair's two sides part."""
    if index >= len(turns):
        return "no turn"
    role = turns[index]["role"]
    return f"{'an' if role == 'assistant' else 'a'} {role} turn"


def preference(value: Any) -> tuple[list[Message], Message, Message]:
    """(prompt messages, chosen reply, rejected reply) of a DPO record; the replies are canonical assistant messages.

    The prompt is `conversations`/`messages` turns, a `prompt` string or list of turns, an Alpaca `instruction`
    (+ `input`), or, with none of these (MiniMind's shape), the turns that `chosen` and `rejected` conversations
    share before their last reply; a top-level `system` opens it (`with_system`). Turns that end in the chosen (or
    rejected) reply itself (UltraFeedback's `messages`, the chosen conversation) give the prompt without it. Either
    way `chosen` and `rejected` must each end in exactly one assistant turn after the shared turns, and the prompt
    must end with a user or tool turn.
    """
    if not isinstance(value, dict) or "chosen" not in value or "rejected" not in value:
        raise RecordError("a preference record needs 'chosen' and 'rejected'")
    prompt = _explicit_prompt(value)
    replies = {key: _reply_turns(value[key], f"'{key}'") for key in ("chosen", "rejected")}
    if prompt and prompt[-1]["role"] == "assistant" and any(prompt[-1] == turns[-1] for turns in replies.values()):
        prompt = prompt[:-1]  # UltraFeedback's 'messages': the chosen conversation, its reply included
    full = []
    for key, turns in replies.items():
        if prompt and turns[:len(prompt)] != prompt:
            opening = next((i for i, turn in enumerate(turns) if turn["role"] != "system"), len(turns))
            if turns[opening:opening + len(prompt)] != prompt:  # else: the prompt behind its own system turns
                if any(turn["role"] == "user" for turn in turns):  # a prompt of its own: both would be trained (a
                    # system turn first had the prompt put before it, the system turn then mid-conversation)
                    raise RecordError(f"'{key}' holds a user turn that is not the record's prompt; give the prompt "
                                      "once")
                turns = prompt + turns
        full.append(with_system(value, turns))
    chosen, rejected = full
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if len(chosen) - shared != 1 or len(rejected) - shared != 1:
        raise RecordError(f"'chosen' and 'rejected' must each end in one assistant reply after the turns they share; "
                          f"they part at turn {shared + 1} ({_turn_said(chosen, shared)} in 'chosen', "
                          f"{_turn_said(rejected, shared)} in 'rejected')")
    if chosen[-1] == rejected[-1]:
        raise RecordError("'chosen' and 'rejected' are the same reply")
    for key, reply in (("chosen", chosen[-1]), ("rejected", rejected[-1])):
        if reply["role"] != "assistant":
            raise RecordError(f"'{key}' ends with a {reply['role']} turn, not an assistant reply")
        if _is_empty_reply(reply):
            raise RecordError(f"empty '{key}'")
        if reply.get("weight") == 0:
            raise RecordError(f"'{key}' has weight 0 (not to learn), yet a preference pair learns from both replies")
    if shared == 0:
        raise RecordError("no prompt: expected 'prompt', 'conversations', 'messages', 'instruction', or 'chosen' "
                          "and 'rejected' conversations that share their first turns")
    if chosen[shared - 1]["role"] not in ("user", "tool"):
        raise RecordError("the prompt must end with a user or tool turn")
    return chosen[:shared], chosen[-1], rejected[-1]


# ---- tool definitions ---------------------------------------------------------------------------------

TOOLS_KEYS = ("tools", "functions")
"""Where a record lists the tools its conversation may call: `tools` (TRL, OpenAI requests, MiniMind's system turn)
or `functions` (OpenAI's older name, MiniMind 2510's system turn)."""

TURN_LISTS = (*TURNS_KEYS, "prompt", "chosen", "rejected")


def tool_list(value: Any, what: str) -> list[dict]:
    """A list of tool definitions (OpenAI's `{"type": "function", "function": {...}}` or the plain function object),
    or the JSON text of one (MiniMind stores it so), as given; RecordError for anything else."""
    if isinstance(value, str):
        value = _json_text(value, what)
    if not isinstance(value, list):
        raise RecordError(f"{what} is {json_type(value)}, expected a list of tool definitions")
    for number, tool in enumerate(value, 1):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RecordError(f"{what}: tool {number} is not a definition with a 'name' string")
    return value


def tool_definitions(value: dict) -> list[dict] | None:
    """The tool definitions a conversation or preference record gives its chat template, None where it gives none:
    a top-level `tools` or `functions` (TRL's column, OpenAI's request), or the same key on a system turn
    (MiniMind's), a list or the JSON text of one. Given in several places, they must be the same."""
    places = {f"'{key}'": value[key] for key in TOOLS_KEYS if value.get(key) not in (None, "", [])}
    for turns_key in TURN_LISTS:
        turns = value.get(turns_key)
        for number, turn in enumerate(turns if isinstance(turns, list) else (), 1):
            if isinstance(turn, dict) and turn.get("role", turn.get("from")) == "system":
                places |= {f"'{turns_key}' turn {number}'s '{key}'": turn[key] for key in TOOLS_KEYS
                           if turn.get(key) not in (None, "", [])}
    found = {place: tool_list(tools, place) for place, tools in places.items()}
    if len({json.dumps(tools, sort_keys=True) for tools in found.values()}) > 1:
        raise RecordError(f"{' and '.join(found)} give different tool definitions; keep one")
    return next(iter(found.values()), None)


class Chat(NamedTuple):
    """An SFT record as `data prepare` encodes it."""
    messages: list[Message]
    tools: list[dict] | None


class Pair(NamedTuple):
    """A DPO record as `data prepare` encodes it (`preference`'s three parts)."""
    prompt: list[Message]
    chosen: Message
    rejected: Message
    tools: list[dict] | None


def chat_record(value: Any) -> Chat:
    return Chat(conversation(value), tool_definitions(value))


def pair_record(value: Any) -> Pair:
    value = _from_openai_preference(value)
    return Pair(*preference(value), tool_definitions(value))


OPENAI_PREFERENCE_KEYS = ("input", "preferred_output", "non_preferred_output")


def _from_openai_preference(value: Any) -> Any:
    """OpenAI's preference fine-tuning record (`input` holding the `messages` and `tools`, `preferred_output` and
    `non_preferred_output` the replies) in the shape `preference` and `tool_definitions` read; any other value as it
    is."""
    if not isinstance(value, dict) or not any(key in value for key in OPENAI_PREFERENCE_KEYS[1:]):
        return value
    missing = [key for key in OPENAI_PREFERENCE_KEYS if key not in value]
    if missing:
        raise RecordError(f"an OpenAI preference record needs {', '.join(repr(key) for key in missing)} too")
    given = value["input"]
    if not isinstance(given, dict) or given.get("messages") is None:
        raise RecordError(f"'input' is {json_type(given)} without 'messages', expected an object holding them")
    return {"prompt": given["messages"], "chosen": value["preferred_output"],
            "rejected": value["non_preferred_output"], **({"tools": given["tools"]} if given.get("tools") else {})}


# ---- pretraining text ---------------------------------------------------------------------------------

def pretrain_text(value: Any) -> str:
    """The text a record contributes to pretraining.

    Plain strings and `{"text"}` records (MiniMind) as they are; conversations, Alpaca and DPO records (prompt
    and chosen reply), read as `conversation` and `preference` read them (a record they refuse for its shape is
    refused here too), are flattened to their messages' reasoning and content joined by newlines. A conversation
    needs no assistant reply here, and keeps its turns after the last one.
    """
    if isinstance(value, str):
        text = value
    elif not isinstance(value, dict):
        raise RecordError(f"record is {json_type(value)}, expected an object or a string")
    elif "text" in value:
        text = _require_text(value["text"], "'text'")
    elif "chosen" in value and "rejected" in value:
        prompt, chosen, _ = preference(value)
        text = _flattened([*prompt, chosen])
    elif (messages := _written_messages(value)) is not None:
        text = _flattened(messages)
    else:
        keys = ", ".join(sorted(value)) or "none"
        raise RecordError(f"no text field (keys: {keys}); expected 'text', 'conversations' or 'instruction'/'output'")
    if not text.strip():
        raise RecordError("empty text")
    return text


def _flattened(messages: list[Message]) -> str:
    return "\n".join(part for m in messages for part in (m.get("reasoning_content"), m["content"]) if part)


READERS = {"pretrain": pretrain_text, "sft": chat_record, "dpo": pair_record}


def read_records(files: Iterable[Path], kind: str, limit: RecordLimit = FIXED_RECORD_LIMIT,
                 piece_chars: int = PIECE_CHARS) -> Iterator[Item | Skipped]:
    """Every file's records converted for `kind` as `Item`s, unusable ones as `Skipped`.

    pretrain: the text, a long document as pieces of at most `piece_chars` characters (`Item.last` marks its
    end); sft: `Chat`; dpo: `Pair`.
    """
    convert = READERS[kind]
    for path in files:
        for item in read_items(path, limit):
            if isinstance(item, Skipped):
                yield item
            elif kind == "pretrain" and not (item.piece == 0 and item.last):
                yield item  # a piece of a long .txt document: text already
            elif item.piece == 0:  # later pieces of a text document belong to the record reported at piece 0
                try:
                    value = convert(item.value)
                except RecordError as exc:
                    yield Skipped(item.source, item.line, str(exc), item.unit)
                    continue
                if kind == "pretrain":
                    yield from split_text(item, value, piece_chars)
                else:
                    yield Item(item.source, item.line, value, item.unit)


class PretrainTexts:
    """The text of every usable pretraining record of `files` (`read_records`), a long document as pieces, read as
    it is iterated; `skipped_count` counts the unusable ones as they are read, and `first_skipped` is the first (each
    was kept: a corpus of millions of unusable lines held them all in memory)."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.files, self.first_skipped, self.skipped_count = files, None, 0

    def __iter__(self) -> Iterator[str]:
        for record in read_records(self.files, "pretrain"):
            if isinstance(record, Skipped):
                self.skipped_count += 1
                self.first_skipped = self.first_skipped or record
            else:
                yield record.value

    def skipped_note(self) -> str:
        """`skipped_note` of the records read so far."""
        return skipped_note([self.first_skipped] if self.first_skipped else [], self.skipped_count)
