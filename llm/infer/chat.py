"""`zerollm chat`: a multi-turn REPL over ChatML with streamed replies.

Commands: /reset (forget the conversation), /system TEXT (set the system prompt and reset), /quit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from llm.infer.generate import TextGenerator
from llm.infer.sampling import SamplingParams
from llm.tokenizer import Tokenizer

HELP = "commands: /reset  /system TEXT  /quit"


def fit_history(messages: list[dict[str, str]], tokenizer: Tokenizer, budget: int) -> list[dict[str, str]]:
    """Drop the oldest turns (never the system prompt or the newest message) until the prompt fits `budget` tokens."""
    system = [m for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    while len(turns) > 1 and len(tokenizer.encode(Tokenizer.render_chat(system + turns, True))) > budget:
        turns = turns[1:]
    return system + turns


def chat_repl(generator: TextGenerator, params: SamplingParams, system: str | None = None,
              read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> None:
    def fresh() -> list[dict[str, str]]:
        return [{"role": "system", "content": system}] if system else []

    messages = fresh()
    budget = generator.model.cfg.max_seq_len - params.max_new_tokens
    print(HELP, file=out, flush=True)
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            break
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            messages = fresh()
            print("(conversation reset)", file=out, flush=True)
            continue
        if line.startswith("/system"):
            system = line.removeprefix("/system").strip() or None
            messages = fresh()
            print(f"(system prompt {'set' if system else 'cleared'}; conversation reset)", file=out, flush=True)
            continue
        if line.startswith("/"):
            print(HELP, file=out, flush=True)
            continue
        messages = fit_history(messages + [{"role": "user", "content": line}], generator.tokenizer, budget)
        print("assistant> ", end="", file=out, flush=True)
        reply = []
        for piece in generator.stream(Tokenizer.render_chat(messages, add_generation_prompt=True), params):
            reply.append(piece)
            print(piece, end="", file=out, flush=True)
        print(file=out, flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
