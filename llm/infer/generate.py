"""Generation: prefill, then one-token decode steps over a KV cache; batched, streamed, or uncached.

`TextGenerator.token_steps` is the core (token ids in, token ids out); `generate` (a batch of
prompts of any lengths) and `stream` (text pieces as they are produced, never splitting a UTF-8
character or leaking part of a stop string) are built on it. Prompts are token ids (a chat prompt
comes from `Tokenizer.encode_chat`, never from re-encoding rendered text) or plain text to continue.
`use_cache=False` recomputes the whole sequence for every token, for comparison and benchmarks.

The text of a completion leaves special tokens out (`TextGenerator.text`), as OpenAI-compatible servers (vLLM,
TGI) do by default: a model that emits `<|im_start|>` or padding mid-reply shows no markup to its reader. Added
tokens that are not special (Qwen's `<think>`, `<tool_call>`) are text and stay. A text prompt begins as a document
does (`text_prompt_ids`): behind the tokenizer's document start, the BOS a Llama-style tokenizer puts before every
text. An empty text prompt asks for an unconditional sample: it starts from that document start, else the
tokenizer's BOS, or else its end-of-text token, which closes every pretraining document (what follows it begins a
new one), as GPT-2's unconditional samples do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from llm.infer.sampling import SamplingParams, choose_next
from llm.model import Transformer
from llm.model.kv_cache import KVCache, memory_problem
from llm.tokenizer import Tokenizer

Prompt = str | list[int]
"""Text to continue (`text_prompt_ids`), or token ids (e.g. from
`Tokenizer.encode_chat(messages, add_generation_prompt=True)`)."""


def text_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of text to continue, as a document starts (`Tokenizer.document_start_ids`, then the text, whose
    special-token strings stay text); the empty text is an unconditional sample's prompt: the document start, else
    BOS, else end of text."""
    if text:
        return tokenizer.encode_document(text)
    return tokenizer.document_start_ids or [tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id]


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """(text before the first stop string, whether one was found)."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


class TextGenerator:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, stop_token_ids: list[int] | None = None) -> None:
        """`stop_token_ids` end a row (default: the tokenizer's stop ids, end of text and end of turn; [] never stops
        early)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        if stop_token_ids is None:
            stop_token_ids = tokenizer.stop_ids
        self.stop_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        roles = {tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id, tokenizer.im_start_id, tokenizer.im_end_id,
                 *tokenizer.stop_ids}
        self.special_ids = frozenset(roles - {None}) | tokenizer.special_token_ids
        """Tokens left out of the text (`text`): the tokenizer's special tokens, and role tokens even where the
        tokenizer does not flag them special."""
        self.vocab_size = min(model.cfg.vocab_size, tokenizer.vocab_size)
        """The ids sampled from: a model's embedding rows past its tokenizer's ids (a vocabulary padded, as
        model.vocab_size may be) were sampled too, and decoded to no text at all while they took up the reply's
        tokens."""
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.tokenizer.pad_id, dtype=torch.long)
        valid = torch.zeros((len(prompts), longest), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            valid[row, longest - len(prompt):] = True
        return ids.to(self.device), valid.to(self.device)

    def _logits(self, ids: torch.Tensor, valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.start_step(valid)
        return self.model(ids, cache=cache, last_only=True).logits[:, -1, :self.vocab_size]

    @torch.inference_mode()
    def token_steps(self, prompts: list[list[int]], params: SamplingParams,
                    use_cache: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per decode step: (next token `[batch]`, finished `[batch]`); a row is finished once it emitted a stop id."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("the prompt is empty: there is nothing to continue (a prompt needs at least one token)")
        ids, valid = self._left_pad(prompts)
        batch, total = ids.shape[0], ids.shape[1] + params.max_new_tokens
        if (problem := self.room_problem(ids.shape[1], params.max_new_tokens, batch=batch)) is not None:
            raise ValueError(problem)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seen = torch.zeros(batch, self.vocab_size, dtype=torch.bool, device=self.device)
        # every prompt token is seen; padding points at the row's last token (always a prompt's) so that no column
        # gets both a True and a False write: the pad id may be in a prompt, and on CUDA a scatter with duplicate
        # indices writes in no defined order
        seen.scatter_(1, torch.where(valid, ids, ids[:, -1:]), True)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stop_ids = self.stop_ids.to(self.device)

        def new_cache() -> KVCache:
            return KVCache(self.model.cfg, batch, total, self.dtype, self.device)

        cache = new_cache()
        logits = self._logits(ids, valid, cache)
        for _ in range(params.max_new_tokens):
            next_ids = choose_next(logits, params, seen, generator)
            next_ids = torch.where(finished, self.tokenizer.pad_id, next_ids)
            finished = finished | torch.isin(next_ids, stop_ids)
            yield next_ids, finished
            if bool(finished.all()):
                return
            seen[torch.arange(batch, device=self.device), next_ids] = True
            step_valid = torch.ones(batch, 1, dtype=torch.bool, device=self.device)
            if use_cache:
                logits = self._logits(next_ids[:, None], step_valid, cache)
            else:  # recompute the whole sequence
                ids, valid = torch.cat([ids, next_ids[:, None]], 1), torch.cat([valid, step_valid], 1)
                cache = new_cache()
                logits = self._logits(ids, valid, cache)

    def text(self, ids: Iterable[int]) -> str:
        """The text of generated ids, without special tokens (`special_ids`)."""
        return self.tokenizer.decode([i for i in ids if i not in self.special_ids], skip_special_tokens=True)

    def stops_at(self, token: int, stop: list[str]) -> bool:
        """Whether `token` is a special token (left out of the text, where no stop string can match it) that a stop
        string names: `stop=["<|im_start|>"]` ends a reply where the model would open a turn."""
        return bool(stop) and self.tokenizer.token(token) in stop and not self.text([token])

    def room_problem(self, prompt_tokens: int, max_new_tokens: int, limit_name: str = "max_new_tokens",
                     batch: int = 1) -> str | None:
        """Why `batch` prompts of `prompt_tokens` and `max_new_tokens` (called `limit_name` in the message: the
        caller's name for it) do not fit in the model's context, or their KV cache in memory; None when they do."""
        context = self.model.cfg.max_seq_len
        said = f"the prompt ({prompt_tokens} tokens) and {limit_name} {max_new_tokens}" if batch == 1 else \
            f"{batch} prompts (padded to {prompt_tokens} tokens) and {limit_name} {max_new_tokens}"
        if prompt_tokens + max_new_tokens > context:
            return f"{said} do not fit in the model's context ({context} tokens)"
        memory = memory_problem(self.model.cfg, batch, prompt_tokens + max_new_tokens, self.dtype, self.device)
        return None if memory is None else f"{said} {memory}"

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Ids of a prompt: token ids as they are, or text to continue (`text_prompt_ids`). Empty ids stay empty
        (`token_steps` refuses them)."""
        return text_prompt_ids(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: list[Prompt], params: SamplingParams, use_cache: bool = True) -> list[str]:
        """Completions of several prompts at once."""
        outputs: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        stop_ids = set(self.stop_ids.tolist())
        # with stop strings, each row's text is followed as it grows (`IncrementalText`: a few tokens decoded per
        # step, not the whole output); a stop string is looked for where it could newly end: in the new text and
        # the `hold` characters before it (`tails`), which hold none
        texts = [IncrementalText(self) for _ in prompts]
        tails = [""] * len(prompts)
        hold = _stop_hold(params.stop)
        for next_ids, _ in self.token_steps([self.prompt_ids(p) for p in prompts], params, use_cache):
            for row, token in enumerate(next_ids.tolist()):
                if done[row]:
                    continue
                if token in stop_ids or self.stops_at(token, params.stop):
                    done[row] = True
                    continue
                outputs[row].append(token)
                if params.stop:
                    searched = tails[row] + texts[row].add(token)
                    done[row] = cut_at_stop(searched, params.stop)[1]
                    tails[row] = searched[max(len(searched) - hold, 0):]
            if all(done):
                break
        return [cut_at_stop(self.text(out), params.stop)[0] for out in outputs]

    def stream(self, prompt: Prompt, params: SamplingParams, cancelled: Callable[[], bool] | None = None) -> TextStream:
        """Text pieces of one completion as they are produced; their concatenation equals `generate`'s text.
        `cancelled`, asked before each token, ends the generation when it answers true (also while no text comes:
        special tokens, a character or a stop string still forming)."""
        return TextStream(self, self.prompt_ids(prompt), params, cancelled)


FORMING = "\ufffd"
"""What an incomplete UTF-8 sequence decodes as (and an invalid one, for good)."""


def _stop_hold(stop: list[str]) -> int:
    """How many characters at the end of a text may be the start of a stop string still forming."""
    return max((len(s) for s in stop), default=1) - 1


class IncrementalText:
    """The text of generated ids (`TextGenerator.text`) as they come, one token at a time, decoding only the last
    few: the cost of a token does not grow with the length of the output (decoding the whole output for every
    token made a long generation's host time grow with the square of its length).

    `add` returns what the *complete* text grew by: the text less the U+FFFD at its end (`forming` of them), where
    the bytes of a character may still be coming, unless `_SETTLE_LAG` tokens followed them: then they are bytes of no
    character, and a model writing nothing else streams them as they come (and stops at a stop string holding them)
    rather than at its end. As in Hugging Face's `DecodeStream` (and vLLM's incremental
    detokenizer), the ids before `_settled` have text that no later token changes; each step decodes the window
    `ids[_start:]`, where `ids[_start:_settled]` is context whose own text (`_context`) it begins with: the new text
    is the window's text after it. Context keeps the window's start on a character and makes what a decoder does
    to a text's first token (SentencePiece's leading space) the same on both. The ids settle where the text ends
    in no U+FFFD; a text that keeps ending in U+FFFD (stray bytes) settles `_SETTLE_LAG` tokens back, where the
    text is already followed by what came after it, so the window stays short. The text equals the whole decode
    wherever the text of the first ids, less the U+FFFD at its end, begins the text of more: always with byte-level
    BPE (ours, GPT-2, Qwen, Llama 3), and with SentencePiece's byte fallback while its bytes make valid UTF-8 (a
    stray byte turns a whole run of byte tokens into U+FFFD, changing text already shown)."""

    _MAX_UNSETTLED = 8
    _SETTLE_LAG = 4
    """A UTF-8 character has at most 4 bytes, a token at least one: 4 tokens on, what the end held is settled."""

    def __init__(self, generator: TextGenerator) -> None:
        self._decode, self._special_ids = generator.text, generator.special_ids
        self.ids: list[int] = []
        """The ids added, less special and role tokens (`TextGenerator.special_ids`), which have no text (so each id
        here has at least a byte, as settling back assumes)."""
        self._start = self._settled = 0
        self._context = ""
        self._settled_len = 0
        """Length of the text of `ids[:_settled]`."""
        self.length = 0
        """Length of the complete text so far."""
        self.forming = 0
        """How many U+FFFD the whole text has after its complete text."""

    def add(self, token: int) -> str:
        """Add a token; the characters the complete text grew by."""
        if token in self._special_ids:
            return ""
        self.ids.append(token)
        new = self._decode(self.ids[self._start:])[len(self._context):]
        final = len(new.rstrip(FORMING))  # how much of `new` no later token changes
        lagged = None  # the text `_SETTLE_LAG` tokens back, where `new` begins with it
        if (not new or new.endswith(FORMING)) and len(self.ids) - self._settled > self._SETTLE_LAG:
            before = self._decode(self.ids[self._start:len(self.ids) - self._SETTLE_LAG])[len(self._context):]
            if new.startswith(before):  # its U+FFFD, which that many bytes followed, are bytes of no character
                lagged, final = before, max(final, len(before))
        grown = new[self.length - self._settled_len:final]  # the settled text is all emitted
        self.length += len(grown)
        if lagged is not None and len(self.ids) - self._settled > self._MAX_UNSETTLED:  # keep the window short
            self._settled_len += len(lagged)
            self._start, self._settled = self._settled, len(self.ids) - self._SETTLE_LAG
            self._context = self._decode(self.ids[self._start:self._settled])
            new = new[len(lagged):]
        raw = self._settled_len + len(new)
        self.forming = max(raw - self.length, 0)
        if new and not new.endswith(FORMING):
            self._start, self._settled = self._settled, len(self.ids)
            self._settled_len = raw
            self._context = self._decode(self.ids[self._start:self._settled])
        return grown


class TextStream:
    """Iterate it for the text pieces of one completion, never splitting a UTF-8 character or leaking part of a stop
    string. Once it has ended: `finish_reason` ('stop': a stop token or string; 'length': max_new_tokens reached;
    None: it did not finish, `cancelled` or the loop left early) and `completion_tokens` (tokens sampled). Leaving
    the loop early ends the generation."""

    def __init__(self, generator: TextGenerator, prompt_ids: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool] | None = None) -> None:
        self.generator, self.prompt_ids, self.params, self.cancelled = generator, prompt_ids, params, cancelled
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[str]:
        params = self.params
        text = IncrementalText(self.generator)
        # the complete text not yet emitted: never more than `hold` characters (a stop string may still be forming)
        # between tokens, and holding no stop string, so a stop string is looked for in it and the new text alone
        pending = ""
        hold = _stop_hold(params.stop)
        stop_ids = set(self.generator.stop_ids.tolist())
        self.finish_reason = None
        for next_ids, _ in self.generator.token_steps([self.prompt_ids], params):
            token = int(next_ids[0])
            self.completion_tokens += 1
            if token in stop_ids or self.generator.stops_at(token, params.stop):
                self.finish_reason = "stop"
                break
            # an incomplete UTF-8 sequence decodes as U+FFFD: `text` waits for its rest, to emit it and to match a
            # stop string
            new = text.add(token)
            if new:
                pending, stopped = cut_at_stop(pending + new, params.stop)
                if stopped:
                    self.finish_reason = "stop"
                    yield pending
                    return
                if len(pending) > hold:
                    yield pending[:len(pending) - hold]
                    pending = pending[len(pending) - hold:]
            if self.cancelled is not None and self.cancelled():
                return
        else:
            self.finish_reason = "length"
        # the end: what is held back, and the U+FFFD of bytes that never made a character
        pending, stopped = cut_at_stop(pending + FORMING * text.forming, params.stop)
        if stopped:
            self.finish_reason = "stop"
        if pending:
            yield pending


def complete(model: Transformer, tokenizer: Tokenizer, prompt: Prompt, max_new_tokens: int = 32) -> str:
    """Greedy completion of one prompt."""
    return TextGenerator(model, tokenizer).generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]
