"""Chat templates rendered so that message text can never become a special token.

A chat template (ours, or a tokenizer's own Jinja `chat_template`) turns canonical messages into
text. Encoding that whole text with special tokens parsed would let a user's message open a fake
system turn by containing `<|im_end|>\\n<|im_start|>system`. So before rendering, every special
token string inside the messages (and the escape character itself) is replaced by a placeholder
`\\ue000<k>\\ue001`; the template's own text keeps its real special tokens. `split` then cuts the
rendered text into template text (encode with special tokens parsed) and escaped literals (encode
as plain text). The template's string operations (strip, split on `</think>`, ...) still see the
real text, so the result equals what `transformers.apply_chat_template` renders.

Loss masks need each assistant reply's place in the rendered text, whatever the template: a reply
starts where the conversation up to it, rendered with a generation prompt, stops matching the whole
conversation; its turn ends where the conversation rendered up to and including it ends. A template that
cannot render zero messages (it reads `messages[0]`) is asked about a conversation that opens with a reply
behind one user turn instead: the reply starts as far from the end of the text as it does there. Where that
start is wrong, the reply is found by its text, the template rendered with a probe in its place: a generation
prompt that matches into the reply by chance (DeepSeek-R1's ends `<think>\n`), and renderings that part inside an
earlier turn (Qwen3's hides an earlier reply's reasoning once a later user turn follows), where the reply starts
after the header the generation prompt writes. A conversation whose tool calls or tool turns the template leaves
out is refused (its tool-calling turn would be learnt as an empty reply).

Our own template is ChatML extended per the canonical-message contract: an assistant turn renders
`<think>\\n{reasoning}\\n</think>\\n\\n{content}`, then each tool call `<tool_call>\\n{json}\\n</tool_call>`
on its own line; a tool turn is role `tool`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llm.errors import UserError

_CHATML_MESSAGE = (
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if message['reasoning_content'] -%}"
    "{{- '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<tool_call>\n' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) + '\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{- content -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
)
_CHATML_GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
_CHATML_TOOLS = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' -}}"
    "{%- endif -%}"
)

CHAT_TEMPLATE = (_CHATML_TOOLS + "{%- for message in messages -%}"
                 "{%- if not (tools and loop.first and message['role'] == 'system') -%}" + _CHATML_MESSAGE
                 + "{%- endif -%}{%- endfor -%}" + _CHATML_GENERATION_PROMPT)
"""ChatML with reasoning, tool calls and tool turns, and tool definitions (`tools`) in a system turn of their own
as Qwen's and MiniMind's templates write them (the conversation's own system text first); the same text in
transformers' `apply_chat_template`."""

LEGACY_CHAT_TEMPLATES = (
    ("{% for message in messages %}"
     "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
     "{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "{%- for message in messages -%}" + _CHATML_MESSAGE + "{%- endfor -%}" + _CHATML_GENERATION_PROMPT,
)
"""Templates earlier versions of zerollm wrote; they render messages without tool definitions as CHAT_TEMPLATE does,
which replaces them so that reasoning, tool calls and tool definitions are not dropped."""

ROLE_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")
"""tokenizer_config.json's special-token fields zerollm reads, and gives templates where they are set: their names are
not further variables (`ChatTemplate.variables_refusal`) even where unset."""

ESCAPE, ESCAPE_END = "\ue000", "\ue001"
PLACEHOLDER = re.compile(f"{ESCAPE}(\\d+){ESCAPE_END}")
CONTINUE_TAG = f"{ESCAPE}continue{ESCAPE_END} "
"""Appended to a final message to find where its text ends once rendered (`render_continuing`): message text
cannot hold it (its ESCAPE characters are escaped), and its blank shows whether the template trims the text."""


class ChatTemplateError(UserError):
    """The chat template refused the messages (e.g. roles that do not alternate) or is missing or broken."""


class MessagesRefused(ChatTemplateError):
    """The chat template refused or failed on these messages (others may render): in a file of records, that record
    is skipped."""


class ToolsNotRendered(MessagesRefused):
    """Tool definitions were given to a chat template that leaves them out."""


class NestedTooDeeply(MessagesRefused):
    """A value of `part` ('messages', 'tools' or 'variables': the further template variables) is nested deeper than
    Python's recursion limit (lists or objects inside one another, from a client)."""

    NAMES = {"messages": "the messages", "tools": "the tool definitions", "variables": "the further template variables"}

    def __init__(self, part: str) -> None:
        super().__init__(f"{self.NAMES[part]} hold a value nested too deeply to render (lists or objects inside one "
                         "another, as in a tool call's arguments or a tool's parameters)")
        self.part = part


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` filter (Jinja's own escapes HTML characters, which chat templates must not)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


RENDER_SECONDS = 5.0
"""The longest a chat template may take to render (they take milliseconds; a hostile one loops for hours)."""
MAX_ITEMS = 1 << 20
"""The longest string or list a template's `*` may make, and the most bits of an integer its `*` or `**` may make."""


RENDERED_PER_CHARACTER, RENDERED_BEYOND = 4, 8 * MAX_ITEMS
"""The most characters a rendering may hold: so many per character of the messages' text, and so many more (the
template's own text, tool definitions)."""


def _characters(value: Any) -> int:
    """The characters of the strings in `value` (messages: dicts and lists of them), any other item counted as one:
    [[0] * 1000000] * 1000000 counted none, and printing it asked for terabytes."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(map(_characters, value.keys())) + sum(map(_characters, value.values()))
    if isinstance(value, list | tuple):
        return sum(map(_characters, value))
    return 1


def _text_size(value: Any, limit: int) -> int:
    """About the characters str(value) makes (a container's brackets, separators and every item each time it is
    printed), counted no further than past `limit`: a list holding one list a million times over, printed in one C
    call the deadline cannot stop, took gigabytes."""
    if isinstance(value, str):
        return len(value)
    size, stack = 0, [value]
    while stack and size <= limit:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, dict):
            size += 2 + 4 * len(item)
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset):
            size += 2 + 2 * len(item)
            stack += item
        else:
            size += len(str(item)) if isinstance(item, int | float) else 8
    return size


class TemplateTooCostly(TemplateError):
    """A template asked for a result above MAX_ITEMS, or larger than the render may hold."""


class _FailedOnAType(Exception):  # noqa: N818 - not an error the user sees: its refusal is
    def __init__(self, refusal: MessagesRefused) -> None:
        self.refusal = refusal


class _RenderDeadline(BaseException):  # noqa: N818 - not an error: a stop
    """Raised in a render's thread once it runs past RENDER_SECONDS (`_RenderDeadlines`). Not an Exception: Jinja's
    own `except Exception` (its `sequence` test around len(), which a template can make take minutes) swallowed
    it, and the render ran on for hours."""


def _result_size(operator: str, left: Any, right: Any) -> int:
    """Items (or, for integers, bits) the result of `left * right` or `left ** right` would hold, a list's items
    counted by their characters ([s] * n holds n times s's text); 0 where it is small anyway."""
    if operator == "*":
        for count, sequence in ((left, right), (right, left)):
            if isinstance(count, int) and isinstance(sequence, (str, list, tuple)):
                return count * max(len(sequence), _characters(sequence))
        if isinstance(left, int) and isinstance(right, int):
            return left.bit_length() + right.bit_length()
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return left.bit_length() * right
    return 0


_RENDER_LIMIT: ContextVar[int] = ContextVar("render_limit", default=RENDERED_BEYOND)
"""The most characters the render in progress may hold (`ChatTemplate._render`): what an operation that may make a
result far larger than its operands (GROWING_FILTERS, GROWING_METHODS, `+`, `~`, `%`, str.format) may make."""


def _refuse_larger(size: int, what: str) -> None:
    """TemplateTooCostly where `what` would make a result larger than the render may hold (`_RENDER_LIMIT`): a
    string doubled in a loop, or grown by one call, took gigabytes in a second."""
    if size > (limit := _RENDER_LIMIT.get()):
        raise TemplateTooCostly(f"{what} would make a result of more than {limit:,} characters, far more than the "
                                "messages hold")


def _replaced_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    """Characters of text.replace(old, new, count) (Jinja's filter takes any values as text)."""
    text, old, new = str(text), str(old), str(new)
    found = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(0, len(new) - len(old))


def _joined(separator: Any, items: Any, part: Callable[[Any], Any] = lambda item: item) -> tuple[list, int]:
    """The items of a join (taken once: a generator is consumed) and the characters of their join, each item's
    `part` joined (the join filter's attribute)."""
    items, limit = list(items), _RENDER_LIMIT.get()
    return items, sum(_text_size(part(item), limit) for item in items) + len(str(separator)) * max(0, len(items) - 1)


def _translated_size(text: str, table: Any) -> int:
    """The most characters text.translate(table) makes: each character may become the longest text the table
    (a mapping or a sequence) holds."""
    values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else []
    return len(text) * max(1, max((len(v) for v in values if isinstance(v, str)), default=1))


def _formatted_size(form: str, values: list[Any]) -> int:
    """The most characters a %-format or str.format string makes of `values` (each field the longest value as
    text; their widths are bounded apart, `_refuse_wide_fields`): '%s%s' % (s, s) doubled s in a loop."""
    fields = len(_PERCENT_SPEC.findall(form)) + form.count("{")
    values = [v for value in values for v in (value.values() if isinstance(value, dict) else [value])]
    return len(form) + fields * max((len(str(v)) for v in values), default=0)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d*)(?:\.(\*|\d+))?")  # '%(name)9s' too
_BRACE_SPEC = re.compile(r"\{[^{}:]*:((?:[^{}]|\{[^{}]*\})*)\}")
SIZED_FILTERS = frozenset({"center", "indent", "batch", "slice", "tojson", "format"})
"""Jinja's filters (and zerollm's tojson) that take a size: a width, an indent, a count of items or slices."""
GROWING_FILTERS = frozenset({"replace", "join", "wordwrap", "indent", "sum", "string", "tojson"})
"""Jinja's filters whose result may be far larger than what they are given, each bounded by its result's size
(`_growing_filter_size`)."""
PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
"""The string methods whose number is a size: 'x'.ljust(1500000000) is 1.5 GB."""
GROWING_METHODS = frozenset({"replace", "join", "translate"})
"""The string methods whose result may be far larger than the string and their arguments, each bounded by its
result's size (`_refuse_larger`)."""


def _too_large(values: Any) -> bool:
    """Whether an integer above MAX_ITEMS is among `values` (or the values of a mapping among them)."""
    return any(isinstance(v, int) and not isinstance(v, bool) and v > MAX_ITEMS
               for value in values for v in (value.values() if isinstance(value, dict) else [value]))


def _field_sizes(form: str) -> tuple[bool, bool]:
    """(whether a %-format or str.format string asks for a field wider or more precise than MAX_ITEMS, whether it
    takes a width or precision from its arguments: '%*s', '{:{w}}')."""
    sizes = [n for match in _PERCENT_SPEC.finditer(form) for n in match.groups() if n]
    sizes += [n for spec in _BRACE_SPEC.findall(form) for n in re.findall(r"\d+|\{", spec)]
    given = [n for n in sizes if n not in ("*", "{")]
    return any(len(n) > 7 or int(n) > MAX_ITEMS for n in given), len(given) < len(sizes)  # int() of 5,000 digits fails


def _refuse_wide_fields(form: Any, arguments: list[Any], what: str) -> None:
    """TemplateTooCostly where the format string `form` asks for a field wider than MAX_ITEMS, itself or through
    its `arguments` (only then are they looked at: a number put into the text is no size), or would make a result
    larger than the render may hold (`_formatted_size`)."""
    if not isinstance(form, str):
        return
    too_wide, takes_width = _field_sizes(form)
    if too_wide or (takes_width and _too_large(arguments)):
        raise TemplateTooCostly(f"{what} was given a field wider than {MAX_ITEMS}")
    _refuse_larger(_formatted_size(form, arguments), what)


def _growing_filter_size(name: str, value: Any, args: list[Any], kwargs: dict[str, Any],
                         environment: Any) -> tuple[Any, int]:
    """For one of GROWING_FILTERS: the value it filters (a join's items taken once: a generator is consumed) and
    the size of its result."""
    if name == "replace":
        count = args[2] if len(args) > 2 else kwargs.get("count")
        return value, _replaced_size(value, *args[:2], -1 if count is None else count) if len(args) >= 2 else 0
    if name == "join":
        attribute = args[1] if len(args) > 1 else kwargs.get("attribute")
        part = make_attrgetter(environment, attribute) if attribute is not None else (lambda item: item)
        return _joined(args[0] if args else kwargs.get("d", ""), value, part)
    if name in ("string", "tojson"):  # the text of a list holding itself many times over
        return value, _text_size(value, _RENDER_LIMIT.get())
    length = len(value) if isinstance(value, str) else 0
    if name == "wordwrap":
        width = args[0] if args else kwargs.get("width", 79)
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring")
        lines = length // width + 1 if isinstance(width, int) and width > 0 else length
        return value, length + lines * len(wrap if isinstance(wrap, str) else "\n")
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        indentation = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return value, length + (value.count("\n") + 1 if isinstance(value, str) else 0) * indentation
    start = args[1] if len(args) > 1 else kwargs.get("start", 0)
    if not isinstance(start, int | float):
        raise TemplateTooCostly("the filter sum was given a start that is no number (a sum of lists or strings takes "
                                "time quadratic in their number, in one call the deadline cannot stop)")
    return value, 0


def _bounded_filter(name: str, function: Callable) -> Callable:
    """`function`, one of SIZED_FILTERS, refusing a size above MAX_ITEMS among its arguments but the value it
    filters ('x'|center(1500000000) is 1.5 GB), and, as `format`, a format string asking for such a field; and, one
    of GROWING_FILTERS, refusing a result larger than the render may hold (`_refuse_larger`)."""
    taken = 2 if getattr(function, "jinja_pass_arg", None) else 1  # the context or environment, then the value

    @functools.wraps(function)  # keeps Jinja's pass_context/pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        sizes = [*args[taken:], *kwargs.values()]
        if name == "format":
            _refuse_wide_fields(args[taken - 1] if len(args) >= taken else None, sizes, "the filter format")
        elif name in SIZED_FILTERS and _too_large(sizes):
            raise TemplateTooCostly(f"the filter {name} was given a number above {MAX_ITEMS}")
        if name in GROWING_FILTERS and len(args) >= taken:
            environment = getattr(args[0], "environment", args[0]) if taken == 2 else None  # eval context or env
            value, size = _growing_filter_size(name, args[taken - 1], list(args[taken:]), kwargs, environment)
            _refuse_larger(size, f"the filter {name}")
            args = (*args[:taken - 1], value, *args[taken:])
        return function(*args, **kwargs)

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with `~` (which no sandbox hook sees: it compiles to a join of its parts) made a call
    of `_BoundedSandbox.bounded_concat`: a string doubled by `~` in a loop reached gigabytes in a second."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with what one expression may ask for bounded, so that it cannot take gigabytes, nor
    compute for minutes between two checks of the deadline: `*` and `**` (their results' size, above MAX_ITEMS),
    `%` and str.format (their fields' widths), the string methods and filters that take a size (PADDING_METHODS,
    SIZED_FILTERS: a size above MAX_ITEMS, 'x'.center(1500000000)), and what may make a result far larger than its
    operands, up to what the render may hold (`+`, `~`, `%`, str.format, GROWING_FILTERS, GROWING_METHODS, and the
    text of a value `{{ ... }}` prints: `_printed`)."""

    intercepted_binops = frozenset(["*", "**", "%", "+"])
    code_generator_class = _BoundedCodeGenerator

    def bound_filters(self) -> None:
        """Wrap the SIZED_FILTERS and GROWING_FILTERS, once every filter is in place."""
        self.filters = {name: _bounded_filter(name, f) if name in SIZED_FILTERS | GROWING_FILTERS else f
                        for name, f in self.filters.items()}

    @staticmethod
    def bounded_concat(parts: tuple) -> str:
        """Jinja's `~` (`_BoundedCodeGenerator`), refusing a result larger than the render may hold."""
        texts = [str(part) for part in parts]
        _refuse_larger(sum(map(len, texts)), "'~'")
        return "".join(texts)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if _result_size(operator, left, right) > MAX_ITEMS:
            raise TemplateTooCostly(f"'{operator}' would make a result of more than {MAX_ITEMS} items")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _refuse_larger(_characters(left) + _characters(right), "'+'")
        if operator == "%":
            _refuse_wide_fields(left, list(right) if isinstance(right, tuple) else [right], "'%'")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's own names
        text = getattr(__obj, "__self__", None)
        method = getattr(__obj, "__name__", None) if isinstance(text, str) else None
        if method in PADDING_METHODS and _too_large([*args, *kwargs.values()]):
            raise TemplateTooCostly(f"str.{method} was given a number above {MAX_ITEMS}")
        if method == "expandtabs":  # a width per tab: 30000 tabs of 100000 were 3 GB
            tabsize = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tabsize, int):
                _refuse_larger(len(text) + text.count("\t") * tabsize, "str.expandtabs")
        if method in GROWING_METHODS and args:
            if method == "join":
                items, size = _joined(text, args[0])
                args = (items, *args[1:])
            else:
                size = _replaced_size(text, *args[:3]) if method == "replace" else _translated_size(text, args[0])
            _refuse_larger(size, f"str.{method}")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def bounded(*args: Any, **kwargs: Any) -> str:
            _refuse_wide_fields(value.__self__, [*args, *kwargs.values()], "str.format")
            return wrapped(*args, **kwargs)

        return bounded


class _RenderDeadlines:
    """Stops a render that runs past its deadline: one daemon thread checks the renders in progress twice a second
    and raises _RenderDeadline in the thread of a late one (`PyThreadState_SetAsyncExc`: the exception surfaces
    at that thread's next bytecode, where a template's loops run). A render pays two dictionary operations, where
    a trace function slowed every render twofold."""

    POLL_S = 0.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[int, float | None] = {}  # thread id -> deadline; None once the exception is sent
        self._watcher: threading.Thread | None = None

    @contextlib.contextmanager
    def limit(self, seconds: float) -> Iterator[None]:
        thread = threading.get_ident()
        with self._lock:
            self._deadlines[thread] = time.monotonic() + seconds
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="chat-template-deadlines", daemon=True)
                self._watcher.start()
        try:
            yield
        finally:
            with self._lock:
                if self._deadlines.pop(thread, 0.0) is None:  # sent, maybe not yet raised: take it back
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)

    def _watch(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            with self._lock:
                now = time.monotonic()
                for thread, deadline in self._deadlines.items():
                    if deadline is not None and now > deadline:
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                                   ctypes.py_object(_RenderDeadline))
                        self._deadlines[thread] = None


_DEADLINES = _RenderDeadlines()


def _printed(value: Any) -> Any:
    """What `{{ ... }}` prints, refused where its text would be larger than the render may hold (`_text_size`)."""
    if isinstance(value, list | tuple | dict | set | frozenset):
        _refuse_larger(_text_size(value, _RENDER_LIMIT.get()), "printing a value")
    return value


class _GenerationBlocks(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (what `apply_chat_template(...,
    return_assistant_tokens_mask=True)` masks by, in SmolLM3's and TRL's training templates): its body is rendered as
    it is; zerollm places the loss itself (`ChatTemplate.replies`). Such a template did not compile."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    """A sandbox like transformers' (templates come with downloaded files: untrusted code), with its cost bounded
    (`_BoundedSandbox`, `_render_within_deadline`); Jinja's `lipsum` global, which no chat template uses, is
    removed (it writes as many paragraphs as asked)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlocks],
                          finalize=_printed)
    env.globals.pop("lipsum", None)
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _template_message(message: dict) -> dict:
    """A canonical message as chat templates expect it: tool calls also in OpenAI's nested `function` form."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    nested = [{**call, "type": "function", "function": {"name": call.get("name"), "arguments": call.get("arguments")}}
              for call in calls]
    return {**message, "tool_calls": nested}


def _text_arguments(call: dict) -> dict:
    """`call` with object arguments as their JSON text (text as it is: quoted again, `print(1)` became `"print(1)"`)."""
    function = call["function"]
    if not isinstance(function["arguments"], dict):
        return call
    return {**call, "function": {**function, "arguments": json.dumps(function["arguments"], ensure_ascii=False)}}


def _arguments_as_text(escaped: list[dict]) -> list[dict] | None:
    """The messages with each tool call's object arguments as their JSON text, as DeepSeek's templates (R1, V3) take
    them (they join `'```json\\n' + arguments`, which an object fails); None where no call has object arguments."""
    calls = [call for m in escaped for call in m.get("tool_calls") or []]
    if not any(isinstance(call["function"]["arguments"], dict) for call in calls):
        return None
    return [{**m, "tool_calls": [_text_arguments(call) for call in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in escaped]


TOOL_NAMES_CHECKED = 32
"""`_renders_tools` looks for at most the first and the last this many of the tools' distinct names: a template
renders its tools in one loop, and a count over the whole text for each tool made a request of 80,000 tools (under a
server's 1 MiB) cost 30 s, growing with the square of their number."""


def _renders_tools(given: str, bare: str, tools: list) -> bool:
    """Whether text rendered with `tools` (`given`) names each tool (of the first and last TOOL_NAMES_CHECKED
    distinct names) more often than the same messages rendered without them (`bare`)."""
    functions = (tool.get("function", tool) if isinstance(tool, dict) else None for tool in tools)
    names = list(dict.fromkeys(function["name"] for function in functions if isinstance(function, dict)
                               and isinstance(function.get("name"), str)))
    if len(names) > 2 * TOOL_NAMES_CHECKED:
        names = names[:TOOL_NAMES_CHECKED] + names[-TOOL_NAMES_CHECKED:]
    return given != bare and all(given.count(name) > bare.count(name) for name in names)


REPLY_PROBE = "zerollm reply probe"
"""Text put in place of a message's text (or a tool call's name) to see where the template renders it."""


def common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


class ChatTemplate:
    """One tokenizer's chat template, rendered with message text escaped (see the module docstring)."""

    def __init__(self, template: str, source: str, variables: dict[str, str | None], protected: list[str],
                 end_of_turn: list[str]) -> None:
        """`variables`: bos_token, eos_token, ... as the template sees them; `protected`: special token strings that
        message text must never produce; `end_of_turn`: strings that close a turn (found after a reply)."""
        self.source, self.variables, self.end_of_turn = source, variables, end_of_turn
        try:
            self._template = _environment().from_string(template)
        except TemplateError as exc:
            raise ChatTemplateError(f"{source}: the chat template does not compile ({exc})") from None
        except RecursionError:  # Jinja's parser recurses once a nesting level: '(' * 5000 was a traceback
            raise ChatTemplateError(f"{source}: the chat template does not compile (nested too deeply)") from None
        self.literals = [ESCAPE, *sorted(set(protected) - {ESCAPE}, key=len, reverse=True)]
        self._placeholders = {s: f"{ESCAPE}{i}{ESCAPE_END}" for i, s in enumerate(self.literals)}
        self._protected = re.compile("|".join(re.escape(s) for s in self.literals))

    def _escape(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._protected.sub(lambda m: self._placeholders[m.group()], value)
        if isinstance(value, dict):
            return {self._escape(k): self._escape(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escape(v) for v in value]
        return value

    def _escaped(self, messages: list[dict], tools: list[dict] | None,
                 variables: dict | None = None) -> tuple[list[dict], list[dict] | None, dict]:
        """The messages, tool definitions and further variables as the template sees them, their text escaped;
        NestedTooDeeply for a value nested deeper than Python's recursion limit (e.g. a tool call's arguments from a
        client). Tool definitions are refused where the template does not render each tool's name more often with
        them than without: they would be left out (a template that writes a blank for them renders other text, still
        without them)."""
        escaped = []
        for part, given in (("messages", [_template_message(m) for m in messages]), ("tools", tools or None),
                            ("variables", variables or {})):
            try:
                escaped.append(self._escape(given))
            except RecursionError:
                raise NestedTooDeeply(part) from None
        if escaped[1] and not _renders_tools(self._render(escaped[0], False, escaped[1], escaped[2]),
                                             self._render(escaped[0], False, None, escaped[2]), escaped[1]):
            raise ToolsNotRendered(f"{self.source}: the chat template does not render tool definitions ('tools'), "
                                  "so they would be left out; use a template that renders them (zerollm's own, "
                                  "Qwen's or MiniMind's do)")
        return escaped[0], escaped[1], escaped[2]

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """Rendered text with message text escaped; cut it with `split`. `tools`: the tool definitions the
        template is given (OpenAI's JSON schemas), None for none; `variables`: further ones, as transformers'
        `apply_chat_template(**kwargs)` and vLLM's `chat_template_kwargs` give them (Qwen3's `enable_thinking`):
        names that are not the template's own (`variables_refusal`)."""
        if variables and (refusal := self.variables_refusal(variables)):
            raise MessagesRefused(refusal)
        escaped, tools, variables = self._escaped(messages, tools, variables)
        return self._render(escaped, add_generation_prompt, tools, variables)

    def variables_refusal(self, variables: dict) -> str | None:
        """Why further template variables cannot be given (a name that is not an identifier, or one the template
        is given already: the messages, the tools, bos_token, ...), or None."""
        for name in variables:
            if not (isinstance(name, str) and name.isidentifier()):
                return f"{name!r} is not a template variable's name"
            if name in ("messages", "tools", "add_generation_prompt", *ROLE_FIELDS, *self.variables,
                        *self._template.globals):
                return f"'{name}' is given to the template by zerollm itself"  # globals: raise_exception, range, ...
        return None

    def _render(self, escaped: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                variables: dict | None = None) -> str:
        """The template's text; where it fails on a type (a TypeError) and a tool call's arguments are an object
        (zerollm's canonical form, transformers' advice), rendered again with them as JSON text (OpenAI's form)."""
        try:
            return self._generate(escaped, add_generation_prompt, tools, variables)
        except _FailedOnAType as failure:
            if (as_text := _arguments_as_text(escaped)) is None:
                raise failure.refusal from None
            try:
                return self._generate(as_text, add_generation_prompt, tools, variables, retry=True)
            except MessagesRefused:  # not for want of text arguments: the failure on the messages as they are
                raise failure.refusal from None

    def _generate(self, escaped: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                  variables: dict | None, retry: bool = False) -> str:
        limit = RENDERED_PER_CHARACTER * (_characters(escaped) + (_characters(tools) if tools else 0)
                                          + (_characters(variables) if variables else 0)) + RENDERED_BEYOND
        bound = _RENDER_LIMIT.set(limit)
        try:
            with _DEADLINES.limit(RENDER_SECONDS):
                pieces, size = [], 0
                for piece in self._template.generate(messages=escaped, add_generation_prompt=add_generation_prompt,
                                                     tools=tools, **self.variables, **(variables or {})):
                    size += len(piece)
                    if size > limit:  # a loop writing megabytes a turn took gigabytes before its deadline
                        raise TemplateTooCostly(f"it rendered more than {limit:,} characters, far more than the "
                                                "messages hold")
                    pieces.append(piece)
                return "".join(pieces)
        except _RenderDeadline:
            raise ChatTemplateError(f"{self.source}: the chat template is refused: rendering took longer than "
                                    f"{RENDER_SECONDS:g} s") from None
        except TemplateTooCostly as exc:
            raise ChatTemplateError(f"{self.source}: the chat template is refused: {exc.message}") from None
        except TemplateError as exc:
            raise MessagesRefused(f"{self.source}: the chat template refused the messages: {exc}") from None
        except Exception as exc:  # a template is code from elsewhere: whatever it raises is its error, in one line
            refusal = MessagesRefused(f"{self.source}: the chat template failed on the messages "
                                      f"({type(exc).__name__}: {exc})")
            if isinstance(exc, TypeError) and not retry:
                raise _FailedOnAType(refusal) from None
            raise refusal from None
        finally:
            _RENDER_LIMIT.reset(bound)

    def render_continuing(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Rendered text (message text escaped) that ends inside the final message, for its text to be continued,
        cut as transformers' `continue_final_message` cuts it: a tag is appended to that message's text, the
        conversation rendered, and the text cut where the tag is (and its blanks trimmed where the template trimmed
        the tag's own): not where the message's text last occurs, which may be inside the template's end of turn."""
        escaped, tools, _ = self._escaped(messages, tools)
        final = escaped[-1].get("content")
        tagged = [*escaped[:-1], {**escaped[-1], "content": (final if isinstance(final, str) else "") + CONTINUE_TAG}]
        rendered = self._render(tagged, False, tools)
        if CONTINUE_TAG.strip() not in rendered:
            raise MessagesRefused(f"{self.source}: the chat template does not render the final message's text, so "
                                  "it cannot be continued")
        where = rendered.rindex(CONTINUE_TAG.strip())
        return rendered[:where] if rendered.startswith(CONTINUE_TAG, where) else rendered[:where].rstrip()

    def split(self, rendered: str) -> Iterator[tuple[str, bool]]:
        """(piece, is_literal) in order: template text, or an escaped string to encode as plain text."""
        position = 0
        for match in PLACEHOLDER.finditer(rendered):
            if match.start() > position:
                yield rendered[position:match.start()], False
            index = int(match.group(1))
            if index < len(self.literals):
                yield self.literals[index], True
            else:  # not one of ours (a template cut through it): its characters are plain text
                yield match.group(), True
            position = match.end()
        if position < len(rendered):
            yield rendered[position:], False

    def unescape(self, rendered: str) -> str:
        return "".join(piece for piece, _ in self.split(rendered))

    def replies(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, per assistant message (reply start, turn end) as character offsets in it)."""
        escaped, tools, _ = self._escaped(messages, tools)
        full = self._render(escaped, False, tools)
        self._check_tool_turns_rendered(full, escaped, tools)
        bounds, previous_end = [], 0
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            try:
                start, end = self._reply_bounds(full, escaped, tools, index, previous_end)
            except MessagesRefused as refused:
                try:
                    found = self._reply_after_its_header(full, escaped, tools, index, previous_end)
                except MessagesRefused:
                    found = None
                if found is None:
                    raise refused from None
                start, end = found
            bounds.append((start, end))
            previous_end = end
        return full, bounds

    def reasoning_left_out(self, messages: list[dict], rendered: str, bounds: list[tuple[int, int]]) -> list[int]:
        """Numbers (from 1) of the assistant messages learnt (not of weight 0) whose reasoning (`reasoning_content`)
        the template does not render inside their reply, given `replies`' text and bounds: it is not learnt
        (DeepSeek-R1's template renders none; Qwen3's none before the last user turn)."""
        replies = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
        return [index + 1 for index, (start, end) in zip(replies, bounds, strict=True)
                if messages[index].get("weight", 1) and isinstance(reasoning := messages[index].get(
                    "reasoning_content"), str) and reasoning.strip()
                and self._escape(reasoning.strip()) not in rendered[start:end]]

    def _reply_bounds(self, full: str, escaped: list[dict], tools: list[dict] | None, index: int,
                      previous_end: int) -> tuple[int, int]:
        """(start, end) of the reply of assistant message `index` in `full`: from where the conversation before it,
        rendered for it, parts from `full`, to its end of turn; MessagesRefused where its loss cannot be placed."""
        start, prompt = self._reply_start(full, escaped, tools, index)
        start = self._outside_special_tokens(full, self._before_the_text(full, escaped, tools, index, start))
        if start < previous_end:  # the renderings part inside an earlier turn (Qwen3's hides an earlier reply's
            raise self._turns_rendered_otherwise(index)  # reasoning once a later user turn follows)
        answered = self._render(escaped[:index + 1], False, tools)
        end = len(answered) if full.startswith(answered) and len(answered) > start else self._turn_end(full, start)
        self._check_reply_within(full, escaped, tools, index, start, end)
        self._check_starts_after_the_turn_before(prompt, escaped, tools, index, start)
        return start, end

    def _outside_special_tokens(self, full: str, start: int) -> int:
        """`start`, or the start of the special token it falls inside: where the generation prompt matched the first
        characters of one that opens the reply (DeepSeek-R1's `<think>` against `<｜tool▁calls▁begin｜>`), the token
        was cut in two, and its characters learnt as text."""
        longest = len(self.literals[1]) if len(self.literals) > 1 else 0
        for match in self._protected.finditer(full, max(0, start - longest + 1), start + longest):
            if match.start() < start < match.end():
                return match.start()
        return start

    def _reply_after_its_header(self, full: str, escaped: list[dict], tools: list[dict] | None, index: int,
                                previous_end: int) -> tuple[int, int] | None:
        """Where `_reply_bounds` refused because the renderings part inside an earlier turn (Qwen3's leaves out an
        earlier reply's reasoning once a later user turn follows, which the conversation before this reply still
        shows, and its tool-calling conversations were refused): the reply found by its text (or, for a turn of tool
        calls alone, its first call's name), from just after the last header the generation prompt writes
        (`<|im_start|>assistant\n`) before that text, to its end of turn. None where the generation prompt writes no
        header (Mistral's: the refusal stands), or the text is not found alone in that turn."""
        message = escaped[index]
        content, calls = message.get("content"), message.get("tool_calls") or []
        if isinstance(content, str) and content.strip():
            text, probed = content, {**message, "content": REPLY_PROBE}
        elif calls and isinstance(text := calls[0]["function"].get("name"), str) and text.strip():
            probed = {**message, "tool_calls": [{**calls[0], "name": REPLY_PROBE,
                                                 "function": {**calls[0]["function"], "name": REPLY_PROBE}},
                                                *calls[1:]]}
        else:
            return None
        before = self._render(escaped[:index], False, tools)
        prompt = self._render(escaped[:index], True, tools)
        header = prompt[common_prefix_length(prompt, before):]
        at = self._probed_at(full, escaped, tools, index, probed)
        found = full.rfind(header, previous_end, at) if header.strip() and full.startswith(text, at) else -1
        if found < 0:
            return None
        start = found + len(header)
        end = self._turn_end(full, start)
        return (start, end) if at + len(text) <= end and not any(s in full[start:at] for s in self.end_of_turn) \
            else None

    def _check_tool_turns_rendered(self, full: str, escaped: list[dict], tools: list[dict] | None) -> None:
        """Refuse a conversation whose tool calls or tool results the template leaves out (Phi-3's and Gemma's render
        neither): SFT learnt a tool-calling turn as an empty reply, its end-of-turn token alone. One rendering tells:
        each call's name and each tool turn's text replaced by a mark of its own, every mark must be in it."""
        marked, marks = [], {}
        for index, message in enumerate(escaped):
            if message.get("tool_calls"):
                calls = []
                for number, call in enumerate(message["tool_calls"]):
                    marks[mark := f"zerollm call {index} {number}"] = f"the tool calls of assistant message {index + 1}"
                    calls.append({**call, "name": mark, "function": {**call.get("function", {}), "name": mark}})
                message = {**message, "tool_calls": calls}
            elif message.get("role") == "tool":
                marks[mark := f"zerollm tool {index}"] = f"tool message {index + 1}"
                message = {**message, "content": mark}
            marked.append(message)
        if not marks:
            return
        try:
            rendered = self._render(marked, False, tools)
        except MessagesRefused:  # the template checks what it renders (a call's name among the tools): it renders it
            return
        if missing := next((what for mark, what in marks.items() if mark not in rendered), None):
            raise MessagesRefused(f"{self.source}: the chat template does not render {missing}, so it would be left "
                                  "out (a tool call learnt as an empty reply); use a template that renders tool calls "
                                  "and tool turns")

    def _probed_at(self, full: str, escaped: list[dict], tools: list[dict] | None, index: int, probed: dict) -> int:
        """Where `full` parts from the conversation rendered with message `index` replaced by `probed` (its text, or
        a tool call's name, replaced by REPLY_PROBE): where the template renders what was replaced."""
        return common_prefix_length(full, self._render([*escaped[:index], probed, *escaped[index + 1:]], False, tools))

    def _before_the_text(self, full: str, escaped: list[dict], tools: list[dict] | None, index: int,
                         start: int) -> int:
        """`start`, or where the text of assistant message `index` begins in `full` where the generation prompt
        matched into that text by chance: DeepSeek-R1's ends `<think>\n`, which its rendering of a reply leaves out,
        and a reply opening with `<` (or `<think>\n`) matched it (taken to start a character late, or after the
        tag, the record was refused). Where the text is found across `start`, its place is confirmed as where
        `full` parts from the rendering with a probe in its place."""
        content = escaped[index].get("content")
        if not isinstance(content, str) or not content:
            return start
        found = full.rfind(content, 0, start + len(content) - 1)
        if found < 0 or found + len(content) < start:  # a reply the prompt's end matched whole ('<') ends at start
            return start
        at = self._probed_at(full, escaped, tools, index, {**escaped[index], "content": REPLY_PROBE})
        turn_begins = common_prefix_length(full, self._render(escaped[:index], False, tools))
        return at if turn_begins <= at < start and full.startswith(content, at) else start

    def _check_reply_within(self, full: str, escaped: list[dict], tools: list[dict] | None, index: int, start: int,
                            end: int) -> None:
        """Refuse a template that does not render assistant message `index`'s text between `start` and `end` (one
        that leaves assistant turns out put the loss on the next user turn), or that ends the reply before its text
        (the loss stops at the first end-of-turn token: only that token was learnt). Text found there as it is
        passes; text the template changes (trims, or cuts a reasoning part from) passes where another text in its
        place changes the rendering there first."""
        content = escaped[index].get("content")
        if escaped[index].get("tool_calls") or not isinstance(content, str) or not content.strip():
            return  # Llama 3's and Mistral's templates render a tool call's turn without its text
        at = full.find(content, start, end)
        if at < 0:
            at = self._probed_at(full, escaped, tools, index, {**escaped[index], "content": REPLY_PROBE})
            if not start <= at < end:
                raise MessagesRefused(f"{self.source}: the chat template does not render the text of assistant "
                                      f"message {index + 1} where its reply is (it leaves the turn out, or puts it "
                                      "elsewhere), so its loss cannot be placed; use a template that renders every "
                                      "assistant turn")
        if ended := next((s for s in self.end_of_turn if s in full[start:at]), None):
            raise MessagesRefused(f"{self.source}: the chat template ends the reply of assistant message {index + 1} "
                                  f"with {ended} before its text, which would not be learnt; use a template that "
                                  "renders the reply's text before its end-of-turn token")

    def _check_starts_after_the_turn_before(self, prompt: str, escaped: list[dict], tools: list[dict] | None,
                                            index: int, start: int) -> None:
        """Refuse where the reply of assistant message `index` would start before the text of the message just before
        it ends in `prompt`, the conversation before the reply rendered for it (with the generation prompt), whose
        first `start` characters the whole conversation's rendering shares: a template that renders the
        conversation before a reply otherwise once more turns follow (Mistral's put the tool definitions, or the
        system text, into the last user turn only) made the renderings part inside an earlier turn, and the loss
        took in that turn's text. Where the text is found beyond `start`, the message is rendered with a probe in its
        place to tell its own place from the text found again in what the template writes after it (the `</think>`
        of MiniMind's generation prompt after a user's "think"); searched in the whole rendering, it was found in the
        reply itself too (a tool call repeating the user's words), and such records were refused."""
        text = escaped[index - 1].get("content") if index else None
        if not isinstance(text, str) or not text.strip():
            return
        found = prompt.rfind(text)
        if found >= 0 and found + len(text) > start:
            probe = [*escaped[:index - 1], {**escaped[index - 1], "content": REPLY_PROBE}]
            found = self._render(probe, True, tools).find(REPLY_PROBE)
        if found >= 0 and found + len(text) > start:
            raise self._turns_rendered_otherwise(index, " (as Mistral's put tools or the system text into the last "
                                                        "user turn)")

    def _turns_rendered_otherwise(self, index: int, example: str = "") -> MessagesRefused:
        """The refusal of a template whose rendering of the turns before assistant message `index` changes once later
        turns follow, so that its reply's start is unknown."""
        return MessagesRefused(f"{self.source}: the chat template renders the turns before assistant message "
                               f"{index + 1} otherwise once later turns follow{example}, so where its reply starts is "
                               "unknown; use a template that renders each turn alike whatever follows")

    def _reply_start(self, full: str, escaped: list[dict], tools: list[dict] | None, index: int) -> tuple[int, str]:
        """Where the reply of message `index` starts in `full`: where the conversation before it, rendered with a
        generation prompt (returned too: "" where there is none), stops matching. A template that cannot render zero
        messages (it reads `messages[0]`) is asked, for an opening reply, about the conversation behind one user
        turn: the reply starts as far from the end as there."""
        try:
            prompt = self._render(escaped[:index], True, tools)
            return common_prefix_length(full, prompt), prompt
        except MessagesRefused:
            if index:
                raise
        probe = [{"role": "user", "content": "?"}]
        behind = self._render(probe + escaped, False, tools)
        rest = behind[common_prefix_length(behind, self._render(probe, True, tools)):]
        if not full.endswith(rest):
            raise MessagesRefused(f"{self.source}: the chat template renders a conversation that opens with an "
                                  "assistant turn unlike one behind a user turn, so the reply's start is unknown; "
                                  "open the conversation with a user (or system) turn")
        return len(full) - len(rest), ""

    def _turn_end(self, rendered: str, start: int) -> int:
        """Just after the first end-of-turn string from `start` (message text holds none: it is escaped)."""
        found = [i + len(s) for s in self.end_of_turn if (i := rendered.find(s, start)) >= 0]
        return min(found) if found else len(rendered)

