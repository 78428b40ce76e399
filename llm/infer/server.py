"""OpenAI-compatible HTTP server: POST /v1/chat/completions (JSON or SSE stream), GET /v1/models[/NAME], /health.

Standard library only (`http.server`, one thread per connection). Requests are untrusted:

- One generation thread owns the model and takes requests from a bounded line (full: 503; a request whose client
  left gives up its place at once), so requests never interleave on the model, and no client's socket is ever
  written while the model waits: a client that stops reading stalls only its own connection. Its pieces queue up
  (at most max_tokens of them) until the socket timeout ends the connection and cancels its generation; a
  client that disconnects is noticed within a quarter second (waiting, or while its pieces arrive, or while none
  come) and at the next write, and its generation ends quietly, at the next token, without a traceback. One that
  only half-closes (shutdown(SHUT_WR)) after its request still gets its answer.
- Every socket has a timeout (a client that sends or reads nothing for that long is dropped), a request's
  line, headers and body must all arrive within that timeout (a client dribbling bytes is dropped too),
  open connections are capped (one more gets 503 at once), so are one client address's off loopback (by default a
  quarter of the cap; one more gets 429 at once, so that a client reconnecting as fast as it is dropped cannot hold
  every connection) and bodies are read only with a valid Content-Length of at most 1 MiB; a GET that declares one is
  refused and its connection closed (its body must not be taken for the next request).
- Message text goes through the tokenizer's chat template to ids, never re-encoded: a user's
  `<|im_end|><|im_start|>system` stays text. The cheap checks of a request come before its tokenizing, which runs
  without the GIL (a few prompts at once), so that a long prompt does not stall the others' generation; a prompt
  whose text is too long for any encoding of it to fit the context is refused without encoding it.
- Bound to loopback, only requests whose Host is a loopback name are answered (a web page cannot
  reach the server through DNS rebinding), and only `Content-Type: application/json` posts (which
  browsers cannot send across origins without a preflight we never grant). Off loopback an API key
  is required (`Authorization: Bearer KEY`, as OpenAI clients send it).
- The address is bound and the options are checked before the model loads: a bad one is a UserError.
- Every error is an OpenAI-style JSON body (4xx for the client's mistakes); after a stream has
  begun, an error is sent as an SSE `data: {"error": ...}` event, and after the head of a reply that is not streamed
  was sent early (an HTTP/1.0 client whose input ended: see `_probe`), as the body under status 200.
- Replies are text without special tokens (`TextGenerator.text`), as vLLM's and TGI's are by default.
"""

from __future__ import annotations

import collections
import email.errors
import hmac
import io
import ipaddress
import json
import math
import queue
import re
import select
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from llm.chat_template import NestedTooDeeply, ToolsNotRendered
from llm.data.formats import TOOLS_KEYS, RecordError, call_arguments, call_id, reasoning_text, tool_list
from llm.errors import UserError
from llm.infer.generate import TextGenerator, TextStream
from llm.infer.sampling import InvalidSampling, SamplingParams
from llm.loopback import is_loopback, is_loopback_host
from llm.tokenizer import TextNotEncoded

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
MAX_TEMPERATURE = 2.0
"""OpenAI's bound (SamplingParams takes any finite temperature >= 0)."""
ROLES = ("system", "user", "assistant", "tool", "developer")
SYSTEM_ROLES = {"developer": "system"}
"""OpenAI's newer name for the system role, which its clients send for newer models: the chat template's system turn."""
ENCODES_AT_ONCE = 2
"""Prompts tokenized at once. Each is encoded without the GIL, so that generation and the other requests go on
meanwhile; a 1 MiB one takes about a second and 200 MB (64 at once would take 13 GB): the others wait their turn."""
CLOSE_WAIT_S = 30.0
"""How long closing the service waits for the generation thread to leave the model (one token's step)."""
ANSWER_WAIT_S = 2.0
"""How long closing the service waits for the requests it ended to be told so (`ServiceClosed`)."""
WAIT_POLL_S = 0.25
"""How often a request waiting for its generation checks whether its client is still there."""
CONTENT_LENGTH = re.compile(r"[0-9]{1,20}")
FIELD_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""A header's name: an RFC 9110 token, no whitespace."""
CHAT_ROUTE, HEALTH_ROUTE, MODELS_ROUTE = "/v1/chat/completions", "/health", "/v1/models"
READ_METHODS = "GET, HEAD"
"""What every route but chat takes, as an Allow header lists it (RFC 9110: where GET is, HEAD is too)."""


def allowed_methods(route: str) -> str | None:
    """The methods a route takes, as an Allow header lists them; None for a route the server does not have."""
    if route == CHAT_ROUTE:
        return "POST"
    if route in (HEALTH_ROUTE, MODELS_ROUTE) or route.startswith(MODELS_ROUTE + "/"):
        return READ_METHODS
    return None
API_KEY = re.compile(r"[!-~]+")
"""Visible ASCII: what an HTTP header carries unchanged."""


class ServiceClosed(Exception):
    """What a request still waiting or being answered gets when the service closes (Ctrl-C on `serve`): an error,
    not a reply cut short that reads as finished."""


class RequestError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


# ---- the request body -------------------------------------------------------------------------------

def _reject_constant(name: str) -> None:
    raise RequestError(f"'{name}' is not a JSON number")


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of a body; NaN/Infinity literals and lone surrogates (e.g. \\ud800) are refused."""
    try:
        body = json.loads(raw or b"null", parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("the request body is not valid JSON") from None
    except ValueError:  # valid JSON, but an integer longer than Python converts
        raise RequestError(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} digits") \
            from None
    except RecursionError:
        raise RequestError("the request body is not valid JSON: it is nested too deeply") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("the request holds invalid Unicode (a lone surrogate escape such as \\ud800)") from None
    return body


def _content(value: Any, where: str) -> str:
    """A message's content: a string, null, or OpenAI's list of text parts."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                       and isinstance(part.get("text"), str) for part in value):
        return "".join(part["text"] for part in value)
    raise RequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _tool_call(call: Any, where: str) -> dict:
    """OpenAI's {"function": {"name", "arguments"}} (or the flat form) as a canonical tool call."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), (str, dict))):
        raise RequestError(f"{where} needs a function name and arguments", where)
    if isinstance(call, dict) and call.get("id") is not None and not isinstance(call["id"], str):
        raise RequestError(f"{where}.id must be a string", f"{where}.id")  # it was left out
    return {"name": fn["name"], "arguments": call_arguments(fn["arguments"]), **call_id(call)}


def canonical_message(message: Any, index: int) -> dict:
    """An OpenAI chat message as a canonical message (role, content, reasoning_content, tool_calls with their ids,
    a tool message's name and tool_call_id)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"{where} needs a role in {ROLES} and a string content", where)
    role = SYSTEM_ROLES.get(message["role"], message["role"])
    out = {"role": role, "content": _content(message.get("content"), where)}
    if out["role"] == "assistant":
        try:
            reasoning = reasoning_text(message)  # reasoning_content, or vLLM's newer reasoning
        except RecordError as exc:
            raise RequestError(f"{where}: {exc}", where) from None
        if reasoning:
            out["reasoning_content"] = reasoning
        if message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(message["tool_calls"])]
    if out["role"] == "tool":
        for key in ("name", "tool_call_id"):
            if message.get(key) is None:
                continue
            if not isinstance(message[key], str):  # it was left out
                raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
            out[key] = message[key]
    return out


def _number(body: dict, key: str, kind: type | tuple, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RequestError(f"'{key}' must be {'an integer' if kind is int else 'a number'}", key)
    return value


def _float(body: dict, key: str, default: float) -> float:
    """A number field as a float: an integer too large for one (10**400) is infinite, as JSON's 1e999 is, for the
    sampling checks to refuse."""
    value = _number(body, key, (int, float), default)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def parse_messages(body: Any) -> list[dict]:
    """The canonical messages of a chat-completions body, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    return [canonical_message(m, i) for i, m in enumerate(messages)]


MAX_TOOLS = 128
"""The most tool definitions a request may give, as OpenAI's API allows: the chat template renders them three times
(with and without them, and once to encode), and 80,000 (within the 1 MiB body) held a core for seconds."""


def parse_tools(body: dict) -> list[dict] | None:
    """The tool definitions of a chat-completions body (`tools`, or `functions`, its name before), for the chat
    template; None where it gives none."""
    given = [key for key in TOOLS_KEYS if body.get(key) not in (None, [])]
    if len(given) > 1:
        raise RequestError("give 'tools' or 'functions' (its older name), not both", "functions")
    if not given:
        return None
    key = given[0]
    if not isinstance(body[key], list):  # the JSON text of a list is for files, as MiniMind writes them
        raise RequestError(f"'{key}' must be a list of tool definitions", key)
    if len(body[key]) > MAX_TOOLS:
        raise RequestError(f"'{key}' has {len(body[key])} tool definitions, more than {MAX_TOOLS} (OpenAI's limit)",
                           key)
    try:
        return tool_list(body[key], f"'{key}'")
    except RecordError as exc:
        raise RequestError(str(exc), key) from None


def check_model(body: dict, served: str) -> None:
    """A request's `model`, where it names one, must be the model served (404 otherwise, as OpenAI's API and vLLM
    answer): a client that asks for another model must not get this one's reply under that name. Absent or null
    asks for the model served."""
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise RequestError(f"'model' must be a string, got {json.dumps(name)[:60]}", "model")
    if name != served:
        raise model_not_found(name, served)


def model_not_found(name: str, served: str) -> RequestError:
    """The 404 for a model name other than the one served."""
    return RequestError(f"no model {name[:200]!r} here; this server serves {served!r}", "model", 404,
                        "model_not_found")


@dataclass(frozen=True)
class RequestOptions:
    params: SamplingParams
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk before [DONE] carries the usage, every other chunk usage null."""


def _flag(body: dict, key: str, where: str = "") -> bool:
    """body[key] (None: false), or RequestError naming `where` + key."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{where}{key}' must be true or false", where + key)
    return bool(value)


def _object(body: dict, key: str) -> dict | None:
    """body[key], a JSON object or None, or RequestError."""
    value = body.get(key)
    if value is not None and not isinstance(value, dict):
        raise RequestError(f"'{key}' must be an object", key)
    return value


def _given_number(body: dict, key: str) -> int | float | None:
    return _number(body, key, (int, float), None)


def _given_integer(body: dict, key: str) -> int | None:
    return _number(body, key, int, None)


def _given_flag(body: dict, key: str) -> bool | None:
    """body[key], true, false or None (absent or null), or RequestError."""
    return None if body.get(key) is None else _flag(body, key)


def _given_list(body: dict, key: str) -> list | None:
    value = body.get(key)
    if value is not None and not isinstance(value, list):
        raise RequestError(f"'{key}' must be a list", key)
    return value


def _given(body: dict, key: str) -> Any:
    return body.get(key)


UNSUPPORTED: dict[str, tuple[Callable[[dict, str], Any], Any]] = {
    "logprobs": (_flag, False),
    "top_logprobs": (_given_integer, 0),
    "logit_bias": (_object, {}),
    "frequency_penalty": (_given_number, 0),
    "presence_penalty": (_given_number, 0),
    "min_p": (_given_number, 0),  # vLLM's extensions, as top_k is
    "min_tokens": (_given_integer, 0),
    "ignore_eos": (_flag, False),
    "best_of": (_given_integer, 1),
    "use_beam_search": (_given_flag, False),
    "length_penalty": (_given_number, 1),
    "stop_token_ids": (_given_list, []),
    "bad_words": (_given_list, []),
    "allowed_token_ids": (_given_list, None),
    "logits_processors": (_given_list, []),
    "include_stop_str_in_output": (_given_flag, False),
    "skip_special_tokens": (_given_flag, True),  # what the server does: a reply's text leaves them out
    "spaces_between_special_tokens": (_given_flag, True),
    "echo": (_given_flag, False),
    "add_generation_prompt": (_given_flag, True),
    "continue_final_message": (_given_flag, False),
    "add_special_tokens": (_given_flag, False),
    "return_tokens_as_token_ids": (_given_flag, False),
    "prompt_logprobs": (_given_integer, None),
    "truncate_prompt_tokens": (_given_integer, None),
    "chat_template": (_given, None),
    "mm_processor_kwargs": (_object, {}),
    "documents": (_given, None),
    "reasoning_effort": (_given, None),  # OpenAI's, which vLLM gives gpt-oss's template
    "verbosity": (_given, "medium"),  # OpenAI's, whose default is medium
    "modalities": (_given_list, ["text"]),  # OpenAI's: a reply in audio too
    "audio": (_object, None),
    "web_search_options": (_object, None),
    "include_reasoning": (_given_flag, True),
    **{key: (_given, None) for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                       "structural_tag", "structured_outputs")},  # constrained decoding
}
"""OpenAI request fields (and vLLM's extensions) this server does not implement: (their reader, the value that asks
for nothing: what the server does anyway). A value of another type is refused by the reader as OpenAI refuses it
(false is no integer, 0 no boolean), any value but nothing (or null) as unsupported, not ignored, so that a client
never reads a reply made without what it asked for (a `guided_choice` answered with free text)."""


REQUEST_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
"""A request's sampling where it leaves a field out and the model suggests nothing (OpenAI's; vLLM's top_k and
repetition_penalty off)."""


def parse_options(body: dict, default_max_tokens: int, suggested: dict | None = None) -> RequestOptions:
    """The sampling parameters and stream options of a chat-completions body whose messages parse_messages
    accepted, or RequestError. A field left out, or given as null, takes what the model folder's
    generation_config.json `suggested`, else its default (`REQUEST_DEFAULTS`), as in vLLM."""
    defaults = {**REQUEST_DEFAULTS, **(suggested or {})}
    if _number(body, "n", int, 1) != 1:
        raise RequestError("only n=1 is supported", "n")
    for key, (read, nothing) in UNSUPPORTED.items():
        if read(body, key) not in (None, nothing):
            raise RequestError(f"'{key}' is not supported by this server; leave it out", key)
    for key in ("tool_choice", "function_call"):  # function_call: its name before tools replaced functions
        if body.get(key) not in (None, "none", "auto"):  # a reply must call a tool: none is parsed out of it
            raise RequestError(f"only 'none' and 'auto' {key} are supported (no tool call is parsed out of a reply)",
                               key)
    response_format = body.get("response_format")
    if response_format not in (None, {}, {"type": "text"}):  # {} asks for nothing, as logit_bias's does
        raise RequestError("only the 'text' response_format is supported", "response_format")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    given = {key: _number(body, key, int, None) for key in ("max_completion_tokens", "max_tokens")}
    key = next((key for key, value in given.items() if value is not None), "max_tokens")  # the newer name first
    max_tokens = default_max_tokens if given[key] is None else given[key]
    if max_tokens < 1:
        raise RequestError(f"'{key}' must be at least 1", key)
    stream, stream_options = _flag(body, "stream"), _object(body, "stream_options")
    if stream_options is not None and not stream:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    # NaN cannot come (the body's JSON refuses it); a model's suggestion above the bound is no request's fault
    temperature = _float(body, "temperature", defaults["temperature"])
    if body.get("temperature") is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise RequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}",
                           "temperature")
    top_k = _number(body, "top_k", int, defaults["top_k"])  # vLLM's extensions, which the sampler has: -1 or 0 is off
    try:
        params = SamplingParams(max_new_tokens=max_tokens, stop=stop, seed=_number(body, "seed", int, None),
                                temperature=temperature, top_p=_float(body, "top_p", defaults["top_p"]),
                                top_k=0 if top_k == -1 else top_k,
                                repetition_penalty=_float(body, "repetition_penalty",
                                                          defaults["repetition_penalty"]))
    except InvalidSampling as exc:  # named by the request's field
        field = key if exc.field == "max_new_tokens" else exc.field
        raise RequestError(f"{field} {exc.reason}", field) from None
    include_usage = _flag(stream_options or {}, "include_usage", "stream_options.")
    # vLLM's usage in every chunk; without include_usage it asks for none, as in vLLM
    if _flag(stream_options or {}, "continuous_usage_stats", "stream_options.") and include_usage:
        raise RequestError("'stream_options.continuous_usage_stats' is not supported by this server; leave it out",
                           "stream_options.continuous_usage_stats")
    return RequestOptions(params, stream, include_usage)


# ---- the model behind the server --------------------------------------------------------------------

_DONE = object()


def check_default_max_tokens(max_tokens: int) -> None:
    """Refuse a default max_tokens for which every request that leaves max_tokens out would be refused."""
    if max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {max_tokens}")


def served_name(name: str | None, model_dir: str) -> str:
    """The name the server answers to: --served-model-name, or the model folder's name."""
    if name is None:
        return Path(model_dir).resolve().name
    if not name.strip() or not name.isprintable():
        raise UserError(f"--served-model-name must be printable text that is not blank, got {name!r}")
    return name


class Generation:
    """One request's generation: its text pieces arrive in `pieces` (then _DONE, or the exception that ended it)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.prompt_ids, self.params = prompt_ids, params
        self.pieces: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.stream: TextStream | None = None


class WaitingLine:
    """The requests waiting for the generation thread, oldest first, at most `limit` of them. A request whose client
    left is taken out at once (`withdraw`): it holds no place, so clients that leave cannot fill the line."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._jobs: collections.deque[Generation] = collections.deque()
        self._changed = threading.Condition()
        self._closed = False

    def put(self, job: Generation) -> bool:
        """Whether `job` found a place (none once the line is closed)."""
        with self._changed:
            if self._closed or len(self._jobs) >= self.limit:
                return False
            self._jobs.append(job)
            self._changed.notify()
            return True

    def withdraw(self, job: Generation) -> bool:
        """Whether `job` was waiting (and is no longer)."""
        with self._changed:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            return True

    def get(self) -> Generation | None:
        """The oldest request, once there is one; None once the line is closed."""
        with self._changed:
            while not self._jobs and not self._closed:
                self._changed.wait()
            return None if self._closed else self._jobs.popleft()

    def close(self) -> list[Generation]:
        """Close the line; the requests still waiting, taken out of it."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            waiting = list(self._jobs)
            self._jobs.clear()
            return waiting

    def qsize(self) -> int:
        return len(self._jobs)


class ChatService:
    """The model behind the server: one generation thread serving a bounded line of requests."""

    def __init__(self, generator: TextGenerator, model_name: str, default_max_tokens: int = 256,
                 max_queued: int = 32, suggested: dict | None = None) -> None:
        """`suggested`: the sampling the model folder's generation_config.json suggests (`suggested_sampling`), for
        requests that leave it out."""
        check_default_max_tokens(default_max_tokens)
        self.generator, self.model_name, self.default_max_tokens = generator, model_name, default_max_tokens
        self.tokenizer = generator.tokenizer.named(f"model {model_name!r}")  # in its chat template's refusals
        self.suggested = suggested or {}
        self.context = generator.model.cfg.max_seq_len
        self.created = int(time.time())
        self.cancelled = 0
        """Generations ended early, or never begun, because their client left."""
        self._counting = threading.Lock()
        self._queue = WaitingLine(max_queued)
        self._encoding = threading.BoundedSemaphore(ENCODES_AT_ONCE)
        self._closing = threading.Event()
        self._cut_short: list[Generation] = []
        """Generations the closing service ended before they finished (at most one)."""
        self._worker = threading.Thread(target=self._serve, name="zerollm-generation", daemon=True)
        self._worker.start()

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None,
                   variables: dict | None = None) -> list[int]:
        """The ids of the messages (given the tool definitions `tools` and the request's further template
        `variables`, its chat_template_kwargs), ready for a reply. Messages whose text is too long for any encoding
        of it to leave room for a reply in the context are refused (context_length_exceeded) without encoding
        them."""
        tokenizer = self.tokenizer
        if variables and (refusal := tokenizer.chat_template_variables_refusal(variables)):
            raise RequestError(f"chat_template_kwargs: {refusal}", "chat_template_kwargs")
        try:
            rendered = tokenizer.render_for_encoding(messages, add_generation_prompt=True, tools=tools,
                                                     variables=variables)
        except ToolsNotRendered as exc:
            raise RequestError(str(exc), "tools") from None
        except NestedTooDeeply as exc:
            raise RequestError(str(exc), {"variables": "chat_template_kwargs"}.get(exc.part, exc.part)) from None
        fewest = tokenizer.fewest_tokens(rendered)
        if fewest >= self.context:
            raise RequestError(f"the prompt (at least {fewest} tokens) leaves no room for a reply in the model's "
                               f"context of {self.context} tokens", "messages", code="context_length_exceeded")
        with self._encoding:
            try:
                return tokenizer.encode_rendered(rendered, release_gil=True)
            except TextNotEncoded as exc:
                raise RequestError(str(exc), "messages") from None

    def default_max_tokens_after(self, prompt_ids: list[int]) -> int:
        """max_tokens of a request that leaves it out: the default, or what the context leaves after the prompt (at
        least 1: a prompt that leaves no room is for `submit` to refuse)."""
        return max(1, min(self.default_max_tokens, self.context - len(prompt_ids)))

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Queue a generation; RequestError when its prompt is empty or does not fit the context with max_tokens, or
        when the line is full. The caller must `withdraw` it when its client leaves or its reply is done."""
        if not prompt_ids:  # e.g. Llama 2's template renders a conversation without a user turn to nothing
            raise RequestError("the chat template renders these messages to no tokens: the model has nothing to "
                               "answer (send a user message)", "messages")
        if len(prompt_ids) >= self.context:  # whatever max_tokens is, given or not
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) leaves no room for a reply in the model's "
                               f"context of {self.context} tokens", "messages", code="context_length_exceeded")
        if len(prompt_ids) + params.max_new_tokens > self.context:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_new_tokens}) "
                               f"exceeds the model's context of {self.context} tokens", "messages",
                               code="context_length_exceeded")
        if (problem := self.generator.room_problem(len(prompt_ids), params.max_new_tokens, "max_tokens")) is not None:
            raise RequestError(f"{problem}: lower max_tokens", "max_tokens")  # the KV cache does not fit in memory
        job = Generation(prompt_ids, params)
        if not self._queue.put(job):
            said = "is shutting down" if self._closing.is_set() else "is busy: too many requests are waiting"
            raise RequestError(f"the server {said}; retry later", status=503)
        return job

    def withdraw(self, job: Generation) -> None:
        """End a submitted generation whose client left (or whose reply is done): it stops at the next token, and
        one still waiting leaves the line at once."""
        job.cancelled.set()
        if self._queue.withdraw(job):
            self._count_cancelled()

    def close(self) -> None:
        """Stop the generation thread: the current generation ends at its next token (also one the thread is just
        taking), and the thread is waited for, so that the process never ends while it runs the model (torch aborts
        the process then: 'terminate called without an active exception'). The waiting requests and the one cut
        short get `ServiceClosed`; their connections are given ANSWER_WAIT_S to say so."""
        self._closing.set()
        waiting = self._queue.close()
        for job in waiting:
            job.pieces.put(ServiceClosed("the server is shutting down; this request was not begun: retry it"))
        self._worker.join(CLOSE_WAIT_S)
        deadline = time.monotonic() + ANSWER_WAIT_S
        for job in [*waiting, *self._cut_short]:  # each connection withdraws its request once it has answered
            job.cancelled.wait(max(0.0, deadline - time.monotonic()))

    def _count_cancelled(self) -> None:
        with self._counting:  # the connections' threads and the generation thread count
            self.cancelled += 1

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():
                self._count_cancelled()
                continue

            def ended(job: Generation = job) -> bool:  # its client left, or the service is closing
                return job.cancelled.is_set() or self._closing.is_set()

            try:  # a client that left ends its generation at the next token, also while no text comes
                job.stream = self.generator.stream(job.prompt_ids, job.params, cancelled=ended)
                cut = False
                for piece in job.stream:
                    if ended():  # also one that had finished, its last piece held back (a stop string, a character)
                        cut = True
                        break
                    job.pieces.put(piece)
                if job.cancelled.is_set():
                    self._count_cancelled()
                if (cut or job.stream.finish_reason is None) and not job.cancelled.is_set():  # the server closes
                    self._cut_short.append(job)
                    job.pieces.put(ServiceClosed(f"the server is shutting down; this reply was cut off after "
                                                 f"{job.stream.completion_tokens} tokens: retry it"))
                else:
                    job.pieces.put(_DONE)
            except Exception as exc:  # noqa: BLE001 - the request reports it; the server keeps serving
                job.pieces.put(exc)


# ---- HTTP ---------------------------------------------------------------------------------------------

# RFC 3986, sections 3.2.2 and 3.2.3: an IPv6 address in brackets (a zone allowed after RFC 6874's '%25', or the bare
# '%' Python's urllib sends) or a registered name (an IPv4 address reads as one), then an optional port of digits
_UNRESERVED_OR_ESCAPED = r"[A-Za-z0-9\-._~]|%[0-9A-Fa-f]{2}"
_HOST = re.compile(rf"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)(?:%(?:25)?(?:{_UNRESERVED_OR_ESCAPED})+)?\]"
                   rf"|(?:{_UNRESERVED_OR_ESCAPED}|[!$&'()*+,;=])+)(?::(?P<port>[0-9]*))?")


def _well_formed_host(host: str) -> bool:
    """Whether a Host header reads as a host with an optional port from 0 to 65535 (RFC 9112, section 3.2): an empty
    one, or one with anything after its port or its IPv6 address's bracket, does not."""
    match = _HOST.fullmatch(host.strip())
    try:
        if match["ipv6"] is not None:
            ipaddress.IPv6Address(match["ipv6"])
        return int(match["port"] or 0) <= 65535
    except (TypeError, ValueError):  # no match; no IPv6 address; a port of more than 4,300 digits
        return False


class _DeadlineReader(socket.SocketIO):
    """A connection's reading side: each read waits at most `timeout_s`, and all the reads before `deadline` end by
    then, so that a client sending a byte now and then cannot hold its connection for as long as it likes."""

    def __init__(self, connection: socket.socket, timeout_s: float) -> None:
        super().__init__(connection, "rb")
        self.connection, self.timeout_s, self.deadline = connection, timeout_s, math.inf

    def readinto(self, buffer: Any) -> int | None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.connection.settimeout(min(self.timeout_s, remaining))
        try:
            return super().readinto(buffer)
        finally:
            self.connection.settimeout(self.timeout_s)  # writes keep the whole timeout


CLIENTS_5XX = (HTTPStatus.NOT_IMPLEMENTED, HTTPStatus.HTTP_VERSION_NOT_SUPPORTED)
"""The 5xx errors that are the client's mistake (an unknown method, a request line without an HTTP version): their
type is invalid_request_error, as a 4xx's, not server_error."""

TLS_HANDSHAKE = b"\x16"
"""The first byte of every TLS connection (RFC 8446, section 5.1: a record of type handshake)."""


class _HeadRecorder(io.BufferedReader):
    """A connection's buffered reading side that keeps the lines a request's head was read as (`lines`, emptied for
    each request): the header parser reads a bare CR inside a line as a line end, so only the raw line shows it."""

    def __init__(self, raw: io.RawIOBase) -> None:
        super().__init__(raw)
        self.lines: list[bytes] = []

    def readline(self, size: int | None = -1) -> bytes:
        line = super().readline(size)
        self.lines.append(line)
        return line


BODY_DEFECTS = (email.errors.StartBoundaryNotFoundDefect, email.errors.CloseBoundaryNotFoundDefect,
                email.errors.NoBoundaryInMultipartDefect, email.errors.MultipartInvariantViolationDefect)
"""What the header parser finds wrong with a multipart body it looks for after a head (there is none): a request
of such a Content-Type was a 400 'a header line is not Name: value', not the 415 it is."""


def _malformed_head(lines: list[bytes], headers: Any) -> bool:
    """Whether a request's head holds a header line that is not 'Name: value' (RFC 9112, sections 2.2 and 5): a
    line without a colon (the parser ended the headers there: those after it, a Content-Length or a Host, went
    unread, and the body would be taken for the next request), a name that is not a token ('Content-Length : 5' or
    'X(A)'), a bare CR inside a line (the parser split the line there into a second header), or a first line the
    parser took for a mailbox's 'From ' line and dropped."""
    bare_cr = any(b"\r" in line.removesuffix(b"\n").removesuffix(b"\r") for line in lines)
    defects = [defect for defect in headers.defects if not isinstance(defect, BODY_DEFECTS)]
    payload = headers.get_payload()  # a message/* type's: a message parsed from what follows (nothing, or lines left)
    left = payload if isinstance(payload, str) else any(part.items() or part.get_payload() for part in payload)
    return bool(bare_cr or defects or left or headers.get_unixfrom()
                or not all(FIELD_NAME.fullmatch(name) for name in headers))


def _make_handler(api_key: str | None, loopback: bool, timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "zerollm"
        timeout = timeout_s  # every read and write on the socket

        def setup(self) -> None:
            super().setup()
            self.service: ChatService = self.server.service
            self.rfile.close()  # read the same socket under each request's deadline instead
            self.reader = _DeadlineReader(self.connection, timeout_s)
            self.rfile = _HeadRecorder(self.reader)

        def version_string(self) -> str:  # the Server header: no Python version for a client to look up
            return self.server_version

        def handle_one_request(self) -> None:
            """One request, whose line, headers and body must all arrive within timeout_s. A TLS handshake (an
            https:// client) is refused at once: its bytes hold no line end, and the client waited for the timeout."""
            self.reader.deadline = time.monotonic() + timeout_s
            self.rfile.lines.clear()
            self.continue_expected = False
            try:
                handshake = self.rfile.peek(1)[:1] == TLS_HANDSHAKE
            except TimeoutError:  # as the standard library does when the request line does not come
                self.close_connection = True
                return
            if handshake:
                self._refuse_unread("a TLS handshake: this server speaks plain HTTP (use http://, or a TLS proxy in "
                                    "front of it)")
                return
            super().handle_one_request()

        def _refuse_unread(self, message: str, status: int = 400) -> None:
            """A 400 or other error before the request's head is read, closing the connection."""
            self.command, self.requestline, self.request_version, self.close_connection = None, "", "HTTP/1.1", True
            self.send_error(status, message)

        def handle_expect_100(self) -> bool:
            """'Expect: 100-continue' is met in `_read_body`, once the key and the body's size are checked: answered
            at once, it had a client with a wrong key upload its whole body before the 401."""
            self.continue_expected = True
            return True

        def parse_request(self) -> bool:
            """The standard library's, but an HTTP/1.0 connection closes after its reply, also one that asks to be
            kept alive (which its reply would have to confirm: an HTTP/1.0 client waits for the close otherwise),
            a head with a header line that is not 'Name: value' (`_malformed_head`) is a 400 and an expectation
            other than 100-continue a 417, each closing the connection. A request line without a version (HTTP/0.9's,
            whose reply has no status line) is a 505 at once: its head was waited for until the timeout."""
            if len(self.raw_requestline.split()) == 2:
                line = self.raw_requestline.decode("iso-8859-1").strip()
                self._refuse_unread(f"the request line '{line}' names no HTTP version: this server speaks HTTP/1.0 "
                                    "and HTTP/1.1", status=505)
                return False
            parsed = super().parse_request()
            if self.request_version == "HTTP/1.0":
                self.close_connection = True
            if not parsed:
                return False
            if _malformed_head(self.rfile.lines, self.headers):
                self.close_connection = True
                self.send_error(400, "a header line is not 'Name: value' (RFC 9112, section 5)")
                return False
            expect = self.headers.get_all("Expect") or []
            if {value.strip().lower() for value in expect} - {"100-continue"}:  # RFC 9110, section 10.1.1
                self.close_connection = True
                self.send_error(417, f"Expect '{', '.join(expect)}': this server meets only 'Expect: 100-continue'")
                return False
            return True

        def log_message(self, format: str, *args) -> None:  # keep the console for the operator's own output
            pass

        def _json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode()
            headers = {**({"Connection": "close"} if self.close_connection else {}), **(headers or {})}
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> None:
            """An OpenAI-style error; the connection closes after it (a refused body may still be unread). A 401
            names the scheme a client must use (RFC 9110, section 11.6.1)."""
            clients_mistake = status < 500 or status in CLIENTS_5XX
            kind = "invalid_request_error" if clients_mistake else "server_error"
            headers = {"Connection": "close", **({"Retry-After": "1"} if status == 503 else {}),
                       **({"WWW-Authenticate": "Bearer"} if status == 401 else {}), **(headers or {})}
            self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The standard library's errors (bad request line, unknown method, ...) as JSON, not HTML."""
            if self.request_version == "HTTP/0.9":  # what it assumes of an unparsable request line: no status line
                self.request_version = "HTTP/1.1"
            self._error(code, message or HTTPStatus(code).phrase)

        def _sse(self, payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
            self.wfile.write(f"data: {data}\n\n".encode())

        def _check_access(self) -> None:
            hosts = self.headers.get_all("Host") or []
            if len(hosts) > 1 or not hosts and self.request_version != "HTTP/1.0":  # RFC 9112, section 3.2
                raise RequestError(f"a request needs one Host header (HTTP/1.0: at most one), got {len(hosts)}")
            host = hosts[0] if hosts else None
            if host is not None and not _well_formed_host(host):
                raise RequestError(f"Host '{host}' is not a host name with an optional port (a number from 0 to "
                                   "65535)")
            if loopback and host is not None and not is_loopback_host(host):
                raise RequestError(f"Host '{host}' is not this machine's loopback name; the server answers local "
                                   "clients only (start it with --host and --api-key to serve others)", status=403)
            if api_key is not None and self.route != HEALTH_ROUTE:
                if len(self.headers.get_all("Authorization") or []) > 1:  # a proxy may check one, this server another
                    raise RequestError("a request may have one Authorization header, not several")
                scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
                if not (scheme.lower() == "bearer"  # a scheme's name is not case-sensitive (RFC 9110)
                        and hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), api_key.encode())):
                    raise RequestError("missing or wrong API key: send 'Authorization: Bearer KEY' with the server's "
                                       "--api-key", status=401, code="invalid_api_key")

        def _handle(self, route: Callable[[], None]) -> None:
            self.streaming = self.input_ended = self.head_sent = False
            self.route = urllib.parse.urlsplit(self.path).path  # a query string (?limit=1) names no other route
            try:
                self._check_access()
                route()
            except RequestError as exc:
                self._error(exc.status, str(exc), exc.param, exc.code)
            except UserError as exc:  # e.g. the chat template refused the messages
                self._error(400, str(exc), "messages")
            except (ConnectionError, TimeoutError):  # the client left or stalled: nothing to answer
                self.close_connection = True
            except Exception as exc:  # noqa: BLE001 - answer, keep serving
                self._fail(f"internal error: {type(exc).__name__}: {exc}")

        def _fail(self, message: str, status: int = 500) -> None:
            """An error where the reply may have begun: an SSE event in a stream, the body after a reply's head."""
            self.close_connection = True
            error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
            try:
                if self.streaming:
                    self._sse(error)
                elif self.head_sent:
                    self.wfile.write(json.dumps(error, ensure_ascii=False).encode())
                else:
                    self._error(status, message)
            except OSError:
                pass

        def _route(self) -> None:
            """404 for a path the server does not have, 405 naming the methods a route takes (RFC 9110, section
            15.5.6) for a method it does not, else the route's answer (HEAD's without its body)."""
            allowed = allowed_methods(self.route)
            if allowed is None:
                raise RequestError(f"no route {self.command} {self.path}", status=404)
            if self.command not in allowed.split(", "):
                self._error(405, f"method {self.command} is not allowed on {self.path}", headers={"Allow": allowed})
            else:
                (self._post if self.command == "POST" else self._get)()

        def do_GET(self) -> None:
            self._handle(self._route)

        do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

        def _get(self) -> None:
            lengths = self.headers.get_all("Content-Length") or []
            if self.headers.get("Transfer-Encoding") or any(length.strip() != "0" for length in lengths):
                # unread, the body would be taken for the next request on the connection (a proxy's desync); the
                # error closes the connection
                raise RequestError(f"a {self.command} request must not have a body (a Content-Length above 0 or a "
                                   "Transfer-Encoding)")
            model = {"id": self.service.model_name, "object": "model", "created": self.service.created,
                     "owned_by": "zerollm"}
            if self.route == HEALTH_ROUTE:
                self._json(200, {"status": "ok"})
            elif self.route == MODELS_ROUTE:
                self._json(200, {"object": "list", "data": [model]})
            else:  # under /v1/models/ (`allowed_methods`)
                name = urllib.parse.unquote(self.route.removeprefix(MODELS_ROUTE + "/"))  # escaped or not (: + @)
                if name != self.service.model_name:
                    raise model_not_found(name, self.service.model_name)
                self._json(200, model)

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding"):
                raise RequestError("send the body with a Content-Length (no Transfer-Encoding)", status=411)
            if self.headers.get_content_type() != "application/json":
                raise RequestError("Content-Type must be application/json", status=415)
            encoding = self.headers.get("Content-Encoding", "identity").strip()
            if encoding.lower() != "identity":  # a gzip body was read as JSON text: "not valid UTF-8"
                raise RequestError(f"Content-Encoding '{encoding}' is not supported; send the JSON body uncompressed",
                                   status=415)
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                raise RequestError("a Content-Length header is required", status=411)
            if len(lengths) > 1 or not CONTENT_LENGTH.fullmatch(lengths[0].strip()):
                raise RequestError("Content-Length must be one non-negative integer")
            length = int(lengths[0])
            if length > MAX_BODY_BYTES:
                raise RequestError(f"request body too large ({length} bytes; at most {MAX_BODY_BYTES})", status=413)
            if self.continue_expected:
                self.send_response_only(HTTPStatus.CONTINUE)
                self.end_headers()
            raw = self.rfile.read(length)
            if len(raw) < length:
                raise ConnectionAbortedError("the client closed the connection inside the body")
            return raw

        def _post(self) -> None:
            body, service = parse_json_body(self._read_body()), self.service
            messages, tools = parse_messages(body), parse_tools(body)
            check_model(body, service.model_name)
            parse_options(body, service.default_max_tokens, service.suggested)  # its cheap checks before the tokenizing
            prompt_ids = service.prompt_ids(messages, tools, _object(body, "chat_template_kwargs"))
            options = parse_options(body, service.default_max_tokens_after(prompt_ids), service.suggested)
            job = service.submit(prompt_ids, options.params)
            try:
                if options.stream:
                    self._stream(job, options.include_usage)
                else:
                    self._complete(job)
            except ServiceClosed as exc:  # said before the withdrawal, which tells the closing service it was
                self._fail(str(exc), 503)
            finally:
                self.service.withdraw(job)  # the client left (or is done): its generation must not go on

        def _client_gone(self) -> bool:
            """Whether the client has left: its connection was reset or closed both ways (POLLERR, POLLHUP). The end
            of its input alone is no sign: a client that half-closes (shutdown(SHUT_WR), as `nc -N` does) still waits
            for its answer, and Linux tells it from one that closed only once something is written, which a closed
            socket answers with a reset: once its input has ended, `_probe` writes at each check (a client that
            half-closed and left later was noticed at the reply's end, its generation run to the end meanwhile)."""
            try:
                poller = select.poll()
                poller.register(self.connection, select.POLLIN)
                events = poller.poll(0)
                flags = events[0][1] if events else 0
                if flags & (select.POLLERR | select.POLLHUP):
                    return True
                if flags & select.POLLIN and (self.input_ended or not self.connection.recv(1, socket.MSG_PEEK)):
                    self.input_ended = True
                    self._probe()
                return False
            except (OSError, ValueError):
                return True

        def _probe(self) -> None:
            """Write what the client skips, for a client that closed to answer it with a reset (seen at the next
            poll): in a stream, an SSE comment (a stream may be silent for long: special tokens, or text that may
            still become a stop string, are not sent); before a reply that is not streamed, an interim `100 Continue`
            to HTTP/1.1 (clients read any number of them, RFC 9110 section 15.2); to HTTP/1.0, which has no interim
            responses, the reply's head at once (`_begin_reply`), then a space, which the JSON body may begin with."""
            if self.streaming:
                self.wfile.write(b": waiting for the model\n\n")
            elif self.request_version != "HTTP/1.0":
                self.send_response_only(HTTPStatus.CONTINUE)
                self.end_headers()
            elif self.head_sent:
                self.wfile.write(b" ")
            else:
                self._begin_reply()

        def _begin_reply(self) -> None:
            """The head of a 200 JSON reply whose body ends where the connection does (its length is not known yet);
            an error after it is the body."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = self.head_sent = True

        def _pieces(self, job: Generation) -> Iterator[str]:
            """The generation's text pieces; a client that left is noticed every WAIT_POLL_S, also while pieces
            arrive faster than that (a reply that is not streamed writes nothing until its end)."""
            check_at = time.monotonic() + WAIT_POLL_S
            while True:
                try:
                    item = job.pieces.get(timeout=WAIT_POLL_S)
                except queue.Empty:
                    item = None
                if item is None or time.monotonic() >= check_at:
                    if self._client_gone():
                        raise ConnectionAbortedError("the client left while waiting")
                    check_at = time.monotonic() + WAIT_POLL_S
                if item is None:
                    continue
                if item is _DONE:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item

        def _complete(self, job: Generation) -> None:
            text = "".join(self._pieces(job))
            reply = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                     "model": self.service.model_name,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": job.stream.finish_reason}],
                     "usage": _usage(job)}
            if self.head_sent:
                self.wfile.write(json.dumps(reply, ensure_ascii=False).encode())
            else:
                self._json(200, reply)

        def _stream(self, job: Generation, include_usage: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.streaming = True
            base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": self.service.model_name,
                    **({"usage": None} if include_usage else {})}

            def chunk(delta: dict, finish: str | None = None) -> dict:
                return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

            self._sse(chunk({"role": "assistant", "content": ""}))
            for piece in self._pieces(job):
                self._sse(chunk({"content": piece}))
            self._sse(chunk({}, job.stream.finish_reason))
            if include_usage:
                self._sse({**base, "choices": [], "usage": _usage(job)})
            self._sse("[DONE]")

    return Handler


def _usage(job: Generation) -> dict[str, int]:
    """OpenAI's usage of a finished generation, counted on the ids the model saw."""
    prompt_tokens, completion_tokens = len(job.prompt_ids), job.stream.completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def client_key(host: str) -> str:
    """The address a client's connections are counted under: its IP address, an IPv4 one also when it comes as an
    IPv4-mapped IPv6 address (as on a dual-stack socket). A whole IPv6 address, as nginx's limit_conn counts: every
    machine of a LAN or a data centre subnet shares one /64."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # without an IPv6 zone (fe80::1%eth0)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


class ChatServer(ThreadingHTTPServer):
    """A threading HTTP server that caps open connections, overall and per client address (`client_key`), and reports
    no tracebacks for clients that leave; it answers with `service`, which must be set before serve_forever()."""

    daemon_threads = True
    request_queue_size = 128  # the default backlog (5) refuses bursts of concurrent clients

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int,
                 max_connections_per_client: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self._per_client_limit = max_connections_per_client
        self._per_client: dict[str, int] = {}  # open connections by client_key; only keys with some
        self._per_client_lock = threading.Lock()  # taken in the accepting thread, freed in the connections' threads
        self.service: ChatService | None = None
        if _is_ipv6_address(address[0]):
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if self.address_family == socket.AF_INET6 else f"http://{host}:{port}"

    def _take_client_slot(self, client: str) -> bool:
        with self._per_client_lock:
            count = self._per_client.get(client, 0)
            if count >= self._per_client_limit:
                return False
            self._per_client[client] = count + 1
            return True

    def _free_client_slot(self, client: str) -> None:
        with self._per_client_lock:
            count = self._per_client.pop(client) - 1
            if count:
                self._per_client[client] = count

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        client = client_key(client_address[0])
        # a full server answers 503 whoever asks (also the one address of loopback, whose share is every connection);
        # a client over its share while the server has room, 429
        if not self._slots.acquire(blocking=False):
            _refuse(request, 503, "Service Unavailable", "the server has too many open connections; retry later")
            self.shutdown_request(request)
            return
        if not self._take_client_slot(client):
            self._slots.release()  # before the next connection is accepted: it takes none of the others'
            _refuse(request, 429, "Too Many Requests", f"too many open connections from {client} (at most "
                    f"{self._per_client_limit} per client address); close one or retry later",
                    "requests", "rate_limit_exceeded")  # what OpenAI sends with a 429 for a rate limit
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it would have freed both
            self._slots.release()
            self._free_client_slot(client)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        """The connection's thread (ThreadingMixIn's, with the slots freed before the socket closes, so that a client
        reconnecting as soon as it sees the close finds its slot free); however the connection ends, they are freed."""
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            try:
                self._slots.release()
                self._free_client_slot(client_key(client_address[0]))
            finally:
                self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):  # a client that left or stalled is not worth a line
            print(f"zerollm serve: request from {client_address[0]} failed: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)


def _refuse(request: socket.socket, status: int, reason: str, message: str, kind: str = "server_error",
            code: str | None = None) -> None:
    """An OpenAI-style error to a connection over a cap, without a thread and without reading its request; never
    blocks for long."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        request.settimeout(1.0)
        request.sendall(head + body)
        request.setblocking(False)  # drop what the request sent so far: closing with unread bytes would reset the
        for _ in range(16):  # connection, and the client might lose the answer
            if not request.recv(1 << 16):
                break
    except OSError:  # BlockingIOError: nothing more to read now
        pass


def _is_ipv6_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse an API key that no client could send, and serving other machines without an API key."""
    if api_key == "":  # `--api-key "$KEY"` with KEY unset served every client, the key being off
        raise UserError("--api-key (or $ZEROLLM_API_KEY) is empty: give a key, or leave both unset to serve loopback "
                        "without one")
    if api_key is not None and not API_KEY.fullmatch(api_key):
        raise UserError("--api-key (or $ZEROLLM_API_KEY) must be printable ASCII without spaces: clients send it in "
                        "an HTTP header")
    if not is_loopback_host(host) and not api_key:
        shown = host or "'' (every address of this machine)"
        raise UserError(f"--host {shown} lets other machines reach the server: give --api-key KEY (clients send "
                        "'Authorization: Bearer KEY'), or bind 127.0.0.1")


def bind_server(host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, timeout_s: float = 30.0,
                max_connections: int = 64, max_connections_per_client: int | None = None) -> ChatServer:
    """The server, bound and listening but with no model yet: set its `service` before serve_forever(), so that a bad
    address is reported before the model loads. UserError: a port out of range, an address this machine cannot
    bind, or serving other machines without an `api_key`. `timeout_s`: a client that sends or reads nothing for this
    long, or whose request has not all arrived this long after the server began waiting for it, is dropped;
    `max_connections`: open connections at once (more get 503); `max_connections_per_client`: open connections at
    once from one client address (`client_key`; more get 429), by default a quarter of `max_connections` off
    loopback, so that one client cannot take them all, and all of them on loopback."""
    check_exposure(host, api_key)
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be between 0 and 65535 (0 picks a free one), got {port}")
    if max_connections < 1:
        raise UserError(f"max_connections must be at least 1, got {max_connections}")
    if max_connections_per_client is None:  # local clients all share one address, and are this machine's users
        max_connections_per_client = max_connections if is_loopback_host(host) else max(1, max_connections // 4)
    if not 1 <= max_connections_per_client <= max_connections:
        raise UserError(f"--max-connections-per-client must be between 1 and {max_connections}, the connections "
                        f"the server holds, got {max_connections_per_client}")
    handler = _make_handler(api_key, is_loopback_host(host), timeout_s)
    try:
        server = ChatServer((host, port), handler, max_connections, max_connections_per_client)
    except OSError as exc:  # in use, not this machine's address, unresolvable (socket.gaierror)
        raise UserError(f"cannot listen on --host {host!r} --port {port}: {exc.strerror or exc}") from None
    bound = server.server_address[0]
    if not api_key and not is_loopback(bound):  # a loopback name (app.localhost) that /etc/hosts maps elsewhere
        server.server_close()
        raise UserError(f"--host {host} is {bound} here, which lets other machines reach the server: give --api-key "
                        "KEY (clients send 'Authorization: Bearer KEY'), or bind 127.0.0.1")
    return server


def make_server(service: ChatService, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                timeout_s: float = 30.0, max_connections: int = 64,
                max_connections_per_client: int | None = None) -> ChatServer:
    """The server of `service`, bound (see bind_server)."""
    server = bind_server(host, port, api_key, timeout_s, max_connections, max_connections_per_client)
    server.service = service
    return server
