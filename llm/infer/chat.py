"""`zerollm chat`: a multi-turn conversation in the terminal, with streamed replies.

Commands: /reset (forget the conversation), /system TEXT (set the system prompt and reset), /quit (or /exit). Only these
exact lines are commands: any other line is a message, also one starting with `/` (`/etc/hosts: what is it?`), and `//`
sends a line less its first `/` (`//reset` sends `/reset`). A message of several lines (pasted text, code) goes
between lines of three double quotes (`BLOCK`), ollama's way but closed only by a line of its own: the lines
between are sent as typed, as one message.
The history goes through the tokenizer's chat template to ids (what the user types stays text, even
`<|im_start|>`); the oldest exchanges are dropped when the context is full, and a message that cannot
fit at all is refused with a message while the conversation carries on. Ctrl-C during a reply stops it (the reply
joins the history as far as it got); at a terminal's prompt it clears the line. Ctrl-D quits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TextIO

from llm.errors import UserError
from llm.infer.generate import TextGenerator
from llm.infer.sampling import SamplingParams
from llm.wording import for_terminal_stream

HELP = 'commands: /reset  /system TEXT  /quit or /exit  (//text sends /text; """ begins and ends several lines)'
BLOCK = '"""'
"""Begins a message of several lines, and ends it on a line of its own."""


def _read_block(first: str, read: Callable[[str], str]) -> str:
    """The message of a block whose first line (stripped) is `first`, which begins with `BLOCK`: the text between
    where it also ends with one (a message of one line); else the text after it, then each line read, as typed,
    until a line that is `BLOCK` alone, unindented (pasted code keeps its own docstrings, whose closing `BLOCK` is
    indented: it ended the block, and the code after it went out as a message of its own)."""
    if len(first) >= 2 * len(BLOCK) and first.endswith(BLOCK):
        return first[len(BLOCK):-len(BLOCK)]
    lines = [first[len(BLOCK):]]
    while (line := read("... ").rstrip("\r\n")).rstrip() != BLOCK:
        lines.append(line)
    return "\n".join(lines).strip("\n")


class ChatSession:
    """A conversation with a model: its messages, fitted into the context before each reply."""

    def __init__(self, generator: TextGenerator, params: SamplingParams, system: str | None = None) -> None:
        self.generator, self.params = generator, params
        self.reset(system)

    def reset(self, system: str | None = None, named: str = "--system") -> None:
        """Forget the conversation; start again with `system` as the system prompt (none if None). With nothing
        changed: ValueError when `system` is not valid Unicode (the caller names where it came from), UserError when
        beside it and max_new_tokens not even an empty message would fit (the advice calls the system prompt
        `named`)."""
        messages = [{"role": "system", "content": system}] if system else []
        smallest = self.generator.tokenizer.encode_chat([*messages, {"role": "user", "content": ""}],
                                                        add_generation_prompt=True)
        if len(smallest) > self.budget:
            taken = f"{named} and the chat template take" if system else "the chat template takes"
            fixes = [*(["lower --max-new-tokens"] if len(smallest) < self.generator.model.cfg.max_seq_len else []),
                     *([f"shorten {named}"] if system else [])]
            raise UserError(f"no message can be sent: the model's context ({self.generator.model.cfg.max_seq_len}) "
                            f"holds {max(self.budget, 0)} prompt tokens beside --max-new-tokens "
                            f"{self.params.max_new_tokens}, and {taken} {len(smallest)}; {' or '.join(fixes)}")
        if (problem := self._memory_problem(smallest)) is not None:
            raise UserError(f"no message can be sent: {problem}: lower --max-new-tokens")
        self.system, self.messages = system, messages

    def _memory_problem(self, ids: list[int]) -> str | None:
        """Why a reply to `ids` (which fit in the context beside max_new_tokens) cannot have its KV cache in
        memory, or None."""
        return self.generator.room_problem(len(ids), self.params.max_new_tokens, "--max-new-tokens")

    @property
    def budget(self) -> int:
        """Prompt tokens that fit beside max_new_tokens in the model's context."""
        return self.generator.model.cfg.max_seq_len - self.params.max_new_tokens

    def fit(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[int]]:
        """(messages, prompt ids) with the oldest exchanges dropped until the prompt fits in the context, and the KV
        cache of its reply in memory; never drops the system prompt or the newest message. ValueError when even those
        do not fit."""
        system = [m for m in messages[:1] if m["role"] == "system"]
        turns = messages[len(system):]
        while True:
            ids = self.generator.tokenizer.encode_chat(system + turns, add_generation_prompt=True)
            fits = len(ids) <= self.budget
            memory = self._memory_problem(ids) if fits else None
            if fits and memory is None:
                return system + turns, ids
            if len(turns) <= 1 and fits:  # its KV cache, beside the reply's, exceeds the memory
                raise ValueError(f"{memory}: shorten the message, or /reset with a shorter system prompt")
            if len(turns) <= 1:
                raise ValueError(f"this message makes a prompt of {len(ids)} tokens, but the model's context "
                                 f"({self.generator.model.cfg.max_seq_len}) holds {max(self.budget, 0)} beside "
                                 f"--max-new-tokens {self.params.max_new_tokens}; shorten it")
            turns = turns[1:]
            while len(turns) > 1 and turns[0]["role"] != "user":  # keep exchanges whole
                turns = turns[1:]

    def reply(self, text: str) -> Iterator[str]:
        """The assistant's reply to `text` as streamed pieces; the exchange joins the history (as far as it got,
        if interrupted). Raises ValueError or UserError before any piece when the message cannot be sent; the
        conversation is then unchanged."""
        messages, ids = self.fit(self.messages + [{"role": "user", "content": text}])
        return self._stream(messages, ids)

    def _stream(self, messages: list[dict[str, str]], ids: list[int]) -> Iterator[str]:
        pieces: list[str] = []
        try:
            for piece in self.generator.stream(ids, self.params):
                pieces.append(piece)
                yield piece
        finally:
            self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]


def chat_repl(session: ChatSession, read: Callable[[str], str] = input, out: TextIO | None = None,
              interactive: bool = False) -> None:
    """Read lines with `read` and answer them on `out` (default: sys.stdout as it is when called, which `zerollm`
    guards) until Ctrl-D or /quit. `interactive` (a person at a terminal): Ctrl-C at the prompt clears the line;
    otherwise it ends the chat, as for any command reading a pipe."""
    def say(text: str, end: str = "\n") -> None:
        print(text, end=end, file=out or sys.stdout, flush=True)

    terminal = (out or sys.stdout).isatty()

    def attempted(action: Callable[[], Any], refused: str) -> tuple[Any, bool]:
        """(what `action` gives, True), or (None, False) with why it was refused said: a message that cannot be
        sent, or a Ctrl-C while it was prepared (a long message's encoding; it ended the chat, the conversation
        lost). The conversation is unchanged either way."""
        try:
            return action(), True
        except (UserError, ValueError) as exc:  # ValueError: text that is not valid Unicode
            say(f"({refused}: {exc})")
        except KeyboardInterrupt:
            if not interactive:
                raise
            say(f"\n({refused}: stopped)")
        return None, False

    say(HELP)
    while True:
        try:
            line = read("you> ").strip()
            block = line.startswith(BLOCK)
            if block:
                line = _read_block(line, read)
        except EOFError:  # Ctrl-D: the shell's prompt goes on a line of its own
            say("")
            break
        except KeyboardInterrupt:
            if not interactive:
                raise
            say("\n(Ctrl-D or /quit ends the chat)")  # the line is cleared; the conversation goes on
            continue
        if not line.strip():
            continue
        command = None if block else line  # a block is a message, whatever its lines are
        if command in ("/quit", "/exit"):
            break
        if command == "/reset":  # the system prompt's reply may no longer fit in a GPU's memory
            if attempted(partial(session.reset, session.system), "not reset")[1]:
                say("(conversation reset)")
        elif command is not None and command.partition(" ")[0] == "/system":  # the word alone, not /systemctl
            system = line.removeprefix("/system").strip() or None
            if attempted(partial(session.reset, system, named="the system prompt"), "not set")[1]:
                say(f"(system prompt {'set' if session.system else 'cleared'}; conversation reset)")
        else:
            line = line.removeprefix("/") if command is not None and command.startswith("//") else line
            pieces, sent = attempted(partial(session.reply, line), "not sent")
            if not sent:
                continue
            say("assistant> ", end="")
            try:
                for piece in for_terminal_stream(pieces) if terminal else pieces:
                    say(piece, end="")
            except KeyboardInterrupt:
                say(" (stopped)", end="")
            finally:  # the exchange joins the history now, also when Ctrl-C came while a piece was being printed
                pieces.close()
            say("")
