"""Samples at each evaluation: greedy continuations of fixed prompts (`train.sample_prompts`, `train.sample_tokens`),
which rank 0 writes to RUN_DIR/samples.jsonl and to a wandb table (`llm.train.metrics`). In pretraining a prompt is
text to continue, begun as a document is (`llm.infer.generate.text_prompt_ids`: BOS first for Llama-style
tokenizers); after it (SFT, DPO) a prompt is a user message and the sample is the assistant's reply (ChatML).

Under ZeRO 0-2 rank 0 generates alone with the engine's module, which holds every parameter. Under ZeRO-3 the
parameters are partitioned and each forward gathers them from every rank, so every rank runs the same generation
in lockstep, always for exactly `sample_tokens` tokens (rows are cut at their stop token afterwards): the ranks
issue the same collectives whatever the model writes. Greedy decoding draws no random numbers, so samples leave
the training's RNG streams (and an exact resume) untouched.
"""

from __future__ import annotations

from typing import Any

from llm.errors import UserError
from llm.infer.generate import TextGenerator, text_prompt_ids
from llm.infer.sampling import SamplingParams
from llm.runtime.distributed import DistInfo
from llm.tokenizer import Tokenizer


class SampleGenerator:
    def __init__(self, prompts: list[str], max_new_tokens: int, tokenizer: Tokenizer, engine, info: DistInfo,
                 chat: bool = False) -> None:
        """`chat`: prompts are user messages, rendered by the tokenizer's chat template with the assistant's turn
        opened."""
        self.prompts, self.tokenizer, self.engine, self.info = prompts, tokenizer, engine, info
        self.prompt_ids = [(tokenizer.encode_chat([{"role": "user", "content": p}], True) if chat
                            else text_prompt_ids(tokenizer, p)) for p in prompts]
        max_len = engine.module.cfg.max_seq_len
        longest = max((len(ids) for ids in self.prompt_ids), default=0)
        if prompts and longest + max_new_tokens > max_len:
            raise UserError(f"train.sample_prompts: the longest prompt ({longest} tokens) plus train.sample_tokens "
                            f"({max_new_tokens}) exceeds model.max_seq_len {max_len}; shorten them")
        self.params = SamplingParams(max_new_tokens=max_new_tokens)
        self.lockstep = engine.zero_optimization_stage() == 3
        self.stop_ids = set(tokenizer.stop_ids)

    def generate(self, step: int) -> list[dict[str, Any]] | None:
        """Rows {step, prompt, completion} on rank 0; None on the other ranks (and without prompts)."""
        if not self.prompts or not (self.lockstep or self.info.is_main):
            return None
        module = self.engine.module
        was_training = module.training
        generator = TextGenerator(module, self.tokenizer, stop_token_ids=[])  # a fixed length: see the docstring
        generated: list[list[int]] = [[] for _ in self.prompts]
        for next_ids, _ in generator.token_steps(self.prompt_ids, self.params):
            for row, token in enumerate(next_ids.tolist()):
                generated[row].append(token)
        module.train(was_training)
        if not self.info.is_main:
            return None
        return [{"step": step, "prompt": prompt, "completion": self.tokenizer.decode(self._until_stop(ids))}
                for prompt, ids in zip(self.prompts, generated, strict=True)]

    def _until_stop(self, ids: list[int]) -> list[int]:
        for index, token in enumerate(ids):
            if token in self.stop_ids:
                return ids[:index]
        return ids
