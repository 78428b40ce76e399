"""Our model behind lm-evaluation-harness's `LM` interface (imported only once `lm-eval` is known installed;
`llm.eval.harness` runs the suites).

    loglikelihood          log p(continuation | context), and whether greedy decoding would produce it
    loglikelihood_rolling  log p(text) over windows of the model's context (`llm.eval.perplexity.windows`)
    generate_until         greedy continuation, cut at the first stop string

Every score goes through `llm.eval.scoring.score_sequences`, the same code `zerollm eval --input` uses. Texts are
encoded as lm-eval's own Hugging Face model encodes them: behind the tokenizer's document start (BOS for Llama-style
tokenizers, nothing for ours) unless the harness asks for no special tokens or the text already starts with it, and
a text without context (rolling, an empty context) follows `prefix_token_id`: that BOS, else the end-of-text token.

With `chat` (--apply-chat-template) the harness renders each context through the tokenizer's chat template
(`apply_chat_template`), as transformers renders it; the template's special tokens are tokens, the messages' text
(questions, few-shot answers) stays text, as `zerollm chat` and the server encode a conversation.
"""

from __future__ import annotations

import sys

import numpy as np
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from llm.errors import UserError
from llm.eval.perplexity import windows
from llm.eval.scoring import score_sequences
from llm.infer.generate import TextGenerator, cut_at_stop
from llm.infer.sampling import SamplingParams
from llm.model import Transformer
from llm.tokenizer import Tokenizer

DEFAULT_MAX_GEN_TOKENS = 256


def generation_settings(gen_kwargs: dict) -> tuple[list[str], int]:
    """(`until` strings, `max_gen_toks`) of a generate_until request, as a task's YAML gives them, checked: a
    mistake there is one line (it was a traceback from our sampling code)."""
    until = gen_kwargs.get("until", [])
    until = [until] if isinstance(until, str) else until
    if not (isinstance(until, (list, tuple)) and all(isinstance(u, str) and u for u in until)):
        raise UserError(f"a generate_until task's until is {until!r}, not a string or a list of non-empty strings; "
                        "check the tasks' YAML")
    asked = gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKENS)
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise UserError(f"a generate_until task's max_gen_toks is {asked!r}, not a positive integer; check the "
                        "tasks' YAML")
    return list(until), asked


class ZeroLLMHarnessModel(TemplateLM):
    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch_size: int, max_length: int,
                 chat: bool = False) -> None:
        """`model` placed on its device; `max_length`: the longest token sequence it reads; `chat`: the harness
        applies the chat template (texts are then `render_for_encoding`'s)."""
        super().__init__()
        self.model, self.tokenizer_ours = model.eval(), tokenizer
        self.batch_size, self.max_length, self.chat = batch_size, max_length, chat
        self.generator = TextGenerator(model, tokenizer)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_ours.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The context of a text that has none: the token a document starts with where the tokenizer puts one
        before every text (BOS), as lm-eval's HFLM uses the BOS; else the end-of-text token."""
        start = self.tokenizer_ours.document_start_ids
        return start[-1] if start else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return f"zerollm-{self.tokenizer_ours.hash}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template where one is applied (lm-eval records it), else None."""
        return self.tokenizer_ours.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation through the tokenizer's chat template, ready for the reply, or (not
        `add_generation_prompt`: a task's `gen_prefix` opens the reply) ending inside its final assistant message."""
        return self.tokenizer_ours.render_for_encoding(chat_history, add_generation_prompt=add_generation_prompt,
                                                       continue_final=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Ids of `string` behind the tokenizer's document start, as `tokenizer(string)` gives them, unless
        `add_special_tokens` is False or a chat template put it there already. Special-token strings in it stay
        text, except the chat template's own (`chat`)."""
        tokenizer = self.tokenizer_ours
        ids = tokenizer.encode_rendered(string) if self.chat else tokenizer.encode(string)
        start = tokenizer.document_start_ids
        if add_special_tokens is False or (self.chat and ids[:len(start)] == start):
            return ids
        return start + ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True, **kwargs) -> str:
        """Text without special tokens unless asked, as lm-eval's Hugging Face model decodes it."""
        return self.tokenizer_ours.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _scores(self, sequences: list[np.ndarray], scored: list[int], desc: str, disable_tqdm: bool) -> list:
        """Scores of `sequences` in their order, computed longest first (batches of similar lengths)."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        results = [None] * len(sequences)
        bar = tqdm(total=len(order), desc=desc, disable=disable_tqdm)
        for first in range(0, len(order), self.batch_size):
            chunk = order[first:first + self.batch_size]
            for i, score in zip(chunk, score_sequences(self.model, [sequences[i] for i in chunk],
                                                       [scored[i] for i in chunk], self.batch_size,
                                                       self.tokenizer_ours.pad_id), strict=True):
                results[i] = score
            bar.update(len(chunk))
        bar.close()
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """`requests`: ((context, continuation), context ids, continuation ids); the context is cut from the left
        to fit max_length. A continuation longer than that is scored on its last max_length tokens, with a note
        saying how many were (it favours long answers; lm-eval's HFLM fails on one with an AssertionError)."""
        sequences, scored = [], []
        for _, context_ids, continuation_ids in requests:
            whole = np.asarray([*context_ids, *continuation_ids][-(self.max_length + 1):], dtype=np.int64)
            sequences.append(whole)
            scored.append(min(len(continuation_ids), len(whole) - 1))
        if cut := sum(len(ids) > self.max_length for _, _, ids in requests):
            print(f"note: {cut} of {len(requests)} loglikelihood continuations are longer than the model's context of "
                  f"{self.max_length} tokens: each is scored on its last {self.max_length} tokens only, which favours "
                  "long answers; give a longer --context where the model has one", file=sys.stderr)
        scores = self._scores(sequences, scored, "loglikelihood", disable_tqdm)
        out = []
        for (key, _, _), score in zip(requests, scores, strict=True):
            answer = (-score.nats, score.greedy)
            self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        sequences, scored, owner = [], [], []
        for index, (text,) in enumerate(request.args for request in requests):
            stream = np.asarray([self.prefix_token_id, *self.tokenizer_ours.encode(text)],  # a document: no template
                                dtype=np.int64)
            for window in windows(len(stream), self.max_length, self.max_length):
                sequences.append(stream[window.start:window.end])
                scored.append(window.scored)
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, score in zip(owner, self._scores(sequences, scored, "loglikelihood_rolling", disable_tqdm),
                                strict=True):
            totals[index] -= score.nats
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (the harness's sampling options other than `until` and `max_gen_toks` are not
        used), cut at the first `until` string, at most `max_gen_toks` tokens. The answer is sure of
        `max_gen_toks` or half the context, whichever is less: the prompt is cut from the left only to leave that,
        and the answer may take whatever else the context has left (a note says how many answers had less room than
        `max_gen_toks`). Reserving all of `max_gen_toks` (256 unless the task says) cut a question to its last
        token in a context of 256 or less; reserving nothing would leave a long few-shot prompt no room to answer."""
        out, short = [], 0
        for context, gen_kwargs in tqdm([r.args for r in requests], desc="generate_until", disable=disable_tqdm):
            until, asked = generation_settings(gen_kwargs)
            reserved = min(asked, max(1, self.max_length // 2))
            ids, room = self.tok_encode(context), self.max_length - reserved  # room: 0 in a context of 1
            prompt = (ids[max(0, len(ids) - room):] if room else []) or [self.prefix_token_id]
            max_new = min(asked, self.max_length - len(prompt))
            short += max_new < asked
            text = self._greedy(prompt, SamplingParams(max_new_tokens=max_new, stop=until))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        if short:
            print(f"note: {short} of {len(requests)} generate_until answers had less room than the task's "
                  f"max_gen_toks: the prompt and the answer share the model's context of {self.max_length} tokens",
                  file=sys.stderr)
        return out

    def _greedy(self, prompt: list[int], params: SamplingParams) -> str:
        generated: list[int] = []
        stop_ids = set(self.generator.stop_ids.tolist())
        for next_ids, _ in self.generator.token_steps([prompt], params):
            token = int(next_ids[0])
            if token in stop_ids:
                break
            generated.append(token)
            if params.stop and cut_at_stop(self.tok_decode(generated, skip_special_tokens=False), params.stop)[1]:
                break  # an `until` naming a special token stops there, as in lm-eval's stopping criteria
        return cut_at_stop(self.tok_decode(generated), params.stop)[0]  # the answer's text without special tokens
