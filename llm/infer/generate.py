"""Generation: prefill, then one-token decode steps over a KV cache; batched, streamed, or uncached.

`TextGenerator.token_steps` is the core (token ids in, token ids out); `generate` (a batch of
prompts of any lengths) and `stream` (text pieces as they are produced, never splitting a UTF-8
character or leaking part of a stop string) are built on it. Prompts are token ids (a chat prompt
comes from `Tokenizer.encode_chat`, never from re-encoding rendered text) or plain text to continue.
`use_cache=False` recomputes the whole sequence for every token, for comparison and benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from llm.infer.sampling import SamplingParams, choose_next
from llm.model import Transformer
from llm.model.kv_cache import KVCache
from llm.tokenizer import Tokenizer

Prompt = str | list[int]
"""Text to continue (encoded with special-token strings kept as text), or token ids (e.g. from
`Tokenizer.encode_chat(messages, add_generation_prompt=True)`)."""


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
        return self.model(ids, cache=cache, last_only=True).logits[:, -1]

    @torch.inference_mode()
    def token_steps(self, prompts: list[list[int]], params: SamplingParams,
                    use_cache: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per decode step: (next token `[batch]`, finished `[batch]`); a row is finished once it emitted a stop id."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("the prompt is empty: there is nothing to continue (a prompt needs at least one token)")
        ids, valid = self._left_pad(prompts)
        batch, total = ids.shape[0], ids.shape[1] + params.max_new_tokens
        if total > self.model.cfg.max_seq_len:
            raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"model.max_seq_len {self.model.cfg.max_seq_len}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seen = torch.zeros(batch, self.model.cfg.vocab_size, dtype=torch.bool, device=self.device)
        seen.scatter_(1, ids, valid)
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

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Ids of a prompt: token ids as they are, or text to continue (special-token strings in it stay text)."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: list[Prompt], params: SamplingParams, use_cache: bool = True) -> list[str]:
        """Completions of several prompts at once."""
        outputs: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        stop_ids = set(self.stop_ids.tolist())
        for next_ids, _ in self.token_steps([self.prompt_ids(p) for p in prompts], params, use_cache):
            for row, token in enumerate(next_ids.tolist()):
                if done[row]:
                    continue
                if token in stop_ids:
                    done[row] = True
                    continue
                outputs[row].append(token)
                if params.stop:
                    done[row] = cut_at_stop(self.tokenizer.decode(outputs[row]), params.stop)[1]
            if all(done):
                break
        return [cut_at_stop(self.tokenizer.decode(out), params.stop)[0] for out in outputs]

    def stream(self, prompt: Prompt, params: SamplingParams) -> TextStream:
        """Text pieces of one completion as they are produced; their concatenation equals `generate`'s text."""
        return TextStream(self, self.prompt_ids(prompt), params)


class TextStream:
    """Iterate it for the text pieces of one completion, never splitting a UTF-8 character or leaking part of a stop
    string. Once it has ended: `finish_reason` ('stop': a stop token or string; 'length': max_new_tokens reached)
    and `completion_tokens` (tokens sampled). Leaving the loop early ends the generation."""

    def __init__(self, generator: TextGenerator, prompt_ids: list[int], params: SamplingParams) -> None:
        self.generator, self.prompt_ids, self.params = generator, prompt_ids, params
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[str]:
        tokenizer, params = self.generator.tokenizer, self.params
        ids: list[int] = []
        emitted = 0
        hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may still be forming
        stop_ids = set(self.generator.stop_ids.tolist())
        self.finish_reason = "length"
        for next_ids, _ in self.generator.token_steps([self.prompt_ids], params):
            token = int(next_ids[0])
            self.completion_tokens += 1
            if token in stop_ids:
                self.finish_reason = "stop"
                break
            ids.append(token)
            text, stopped = cut_at_stop(tokenizer.decode(ids), params.stop)
            if stopped:
                self.finish_reason = "stop"
                yield text[emitted:]
                return
            safe = len(text) - hold
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence decodes as U+FFFD: wait for its rest
                safe = min(safe, len(text.rstrip("\ufffd")))
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        text, _ = cut_at_stop(tokenizer.decode(ids), params.stop)
        if len(text) > emitted:
            yield text[emitted:]


def complete(model: Transformer, tokenizer: Tokenizer, prompt: Prompt, max_new_tokens: int = 32) -> str:
    """Greedy completion of one prompt."""
    return TextGenerator(model, tokenizer).generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]
