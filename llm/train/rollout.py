"""GRPO's rollouts, the step source of `zerollm train grpo` (see `llm.train.steps`).

Each step, every rank draws its prompts, samples `grpo.group_size` completions of each from the *current* policy
with our KV-cache generator (batched, left-padded), scores them with the rewards, normalises the rewards within
each group into advantages, and cuts prompt + completion sequences into the step's micro-batches, with the frozen
reference's log-probabilities when the KL term is on. The completions are generated in chunks of whole groups, at
most train.micro_batch_size completions each (one group where a group is larger) unless grpo.rollout_batch_size
says otherwise, one generation call per chunk: the KV cache holds one chunk, so its size follows the micro-batch,
not train.grad_accum. A group never spans ranks, so advantages need no collective.

What generates (`RolloutPolicy`): under ZeRO 0-2 the engine's own module, which holds the full parameters. Under
ZeRO-3 the parameters are gathered once per rollout, and generation runs on a model without DeepSpeed's hooks
(which would gather every layer again at every decoded token): a view of the gathered parameters, released after
the rollout ('gathered'), or a full copy kept on each rank and refreshed from them ('copy'); docs/grpo.md has the
measurement.

Sampling is seeded from (train.seed, rank, step), so a run resumed on the same number of ranks samples exactly
what the uninterrupted run did (on another number of ranks it continues correctly, with other samples): a step's
chunks take the first words of that seed sequence in turn (`sampling_seeds`; a step of one chunk samples as when a
step was always one generation call). This module is the one place that renders prompts and calls the generator
(`encode_prompt`, `_sample`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch

from llm import rundir
from llm.config import RunConfig
from llm.errors import StepInputError, UserError
from llm.infer.generate import TextGenerator
from llm.infer.sampling import SamplingParams
from llm.infer.suggested_sampling import declared_stop_ids
from llm.model import Transformer
from llm.model.from_weights import model_to_fill, shapes_only
from llm.model.lora import apply_lora
from llm.runtime.distributed import DistInfo, agreed
from llm.tokenizer import TOKENIZER_FILE, Tokenizer, no_tokenizer_json_advice
from llm.train.checkpoint import rng_state, set_rng_state
from llm.train.engine import full_parameters
from llm.train.prompts import Prompt, PromptSet, read_prompts
from llm.train.rewards import Completions, Reward, reward_metrics
from llm.train.steps import Batch, StepBatches


def encode_prompt(tokenizer: Tokenizer, messages: list[dict[str, str]], tools: list[dict] | None) -> list[int]:
    """Token ids of a prompt (given its tool definitions) in the tokenizer's chat template with the assistant's turn
    opened (the messages' text is encoded with special tokens disabled: a prompt cannot open a turn of its own)."""
    return tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)


def cut_completions(rows: list[list[int]], generator: TextGenerator) -> tuple[list[list[int]], list[str]]:
    """Each sampled row cut after its first stop token (the ids the loss is on keep it), and its text for the
    rewards as `generate` and `serve` give a reply's: without that token or any other special token. The rewards saw
    those: an exact match failed on '4<|im_start|>', whose reply reads '4' (as TRL's rewards read it too)."""
    stop_ids = set(generator.stop_ids.tolist())
    completions, texts = [], []
    for row in rows:
        end = next((i for i, token in enumerate(row) if token in stop_ids), None)
        completions.append(row if end is None else row[:end + 1])
        texts.append(generator.text(row if end is None else row[:end]))
    return completions, texts


def tokenizer_dir(cfg: RunConfig) -> Path:
    """GRPO tokenizes raw prompts with the tokenizer of its --init-from model (a run or an export directory)."""
    init = Path(cfg.train.init_from)
    directory = rundir.tokenizer_dir(init) if rundir.is_run_dir(init) else init
    if not (directory / TOKENIZER_FILE).is_file():
        raise UserError(f"--init-from {init}: no tokenizer files ({TOKENIZER_FILE}) beside the model"
                        f"{no_tokenizer_json_advice(directory) or ''}; GRPO tokenizes its prompts with the model's "
                        "tokenizer")
    return directory


def grpo_inputs(cfg: RunConfig, device: torch.device | None = None) -> tuple[Tokenizer, Reward, PromptSet]:
    """The tokenizer, the reward (a reward model runs on `device`, default the CPU) and the prompt set of a GRPO
    run, every mistake in them a `UserError`."""
    g = cfg.grpo
    tokenizer = Tokenizer.load(tokenizer_dir(cfg)).stop_also(declared_stop_ids(cfg.train.init_from))
    reward = Reward(g.reward, g.max_new_tokens, device or torch.device("cpu"), g.reward_timeout_s)
    prompts = read_prompts(g.prompts, partial(encode_prompt, tokenizer), cfg.data.seq_len - g.max_new_tokens,
                           reward.required_fields)
    reward.check_fields({key for prompt in prompts.prompts for key in prompt.fields})
    return tokenizer, reward, prompts


def sampling_seeds(seed: int, rank: int, step: int, n: int = 1) -> list[int]:
    """The seeds of a step's `n` generation calls on a rank: the first `n` words of one seed sequence, so the first
    is the same whatever `n` is."""
    return [int(word) for word in np.random.SeedSequence([seed, rank, step]).generate_state(n)]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool, eps: float = 1e-4) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the group's standard deviation (+ eps) when `scale`."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    return (centred / (grouped.std(1, keepdim=True) + eps) if scale else centred).flatten()


class RolloutPolicy:
    """The current policy as a plain `Transformer` to generate with (see the module docstring)."""

    def __init__(self, cfg: RunConfig, engine, device: torch.device) -> None:
        self.engine = engine
        self.mode = "engine" if engine.zero_optimization_stage() != 3 else cfg.grpo.rollout_model
        self.model = None
        if self.mode != "engine":
            with shapes_only():  # no random weights: the engine's replace them at every rollout
                model = Transformer(cfg.model)
                if cfg.lora.r:  # the policy's structure, so that its parameters match the engine's by name
                    apply_lora(model, cfg.lora, cfg.train.seed)
            dtype = next(engine.module.parameters()).dtype  # parameters only, as the engine casts them: the RoPE
            model = model_to_fill(model, dtype, device, sized=self.mode == "copy")  # tables stay fp32
            self.model = model.requires_grad_(False).eval()

    def _release(self) -> None:
        for param in self.model.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @contextmanager
    def generating(self) -> Iterator[Transformer]:
        """The policy, with the engine's current weights, for the duration of the block."""
        if self.model is None:
            yield self.engine.module
            return
        views = dict(self.model.named_parameters())
        with full_parameters(self.engine), torch.no_grad():
            for name, param in self.engine.module.named_parameters():
                if self.mode == "copy":
                    views[name].copy_(param)
                else:
                    views[name].data = param.data
            try:
                yield self.model
            finally:
                if self.mode == "gathered":
                    self._release()


class Rollouts:
    """Completions sampled, scored and batched for one GRPO step (see the module docstring)."""

    draws_per_step = 1
    collate = staticmethod(list)

    def __init__(self, cfg: RunConfig, info: DistInfo, engine, tokenizer: Tokenizer, reward: Reward,
                 reference=None) -> None:
        """`engine`: the policy's DeepSpeed engine; `reference`: the frozen reference engine (None: no KL term)."""
        t, g = cfg.train, cfg.grpo
        self.cfg, self.info, self.engine, self.tokenizer = cfg, info, engine, tokenizer
        self.reward, self.reference = reward, reference
        self.group_size, self.micro_batch_size = g.group_size, t.micro_batch_size
        self.draw_size = t.micro_batch_size * t.grad_accum // g.group_size
        self.generation_rows = g.rollout_batch_size or max(1, t.micro_batch_size // g.group_size) * g.group_size
        """Completions per generation call: whole groups, grpo.rollout_batch_size or at most
        max(train.micro_batch_size, grpo.group_size)."""
        self.inputs = ", ".join(g.prompts)
        self.updates_per_step = g.updates_per_batch
        self.policy = RolloutPolicy(cfg, engine, info.device)

    def too_few(self, n_prompts: int, needed: int) -> str:
        return (f"{self.inputs}: {n_prompts} usable prompts, fewer than one step takes ({needed} over all ranks: "
                "train.micro_batch_size * train.grad_accum / grpo.group_size on each); add prompts or lower "
                "train.micro_batch_size")

    # ---- sampling ------------------------------------------------------------------------------

    def _sample(self, prompts: list[list[int]], step: int) -> tuple[list[list[int]], list[str]]:
        """Each prompt's completion (token ids up to and including the stop token, if one came) and its text, in the
        prompts' order: one generation call per chunk of `generation_rows` prompts (`prompts` holds whole groups)."""
        g = self.cfg.grpo
        size = self.generation_rows
        chunks = [prompts[i:i + size] for i in range(0, len(prompts), size)]
        seeds = sampling_seeds(self.cfg.train.seed, self.info.rank, step, len(chunks))
        rows: list[list[int]] = []
        with self.policy.generating() as model:  # under ZeRO-3, the parameters are gathered once for every chunk
            generator = TextGenerator(model, self.tokenizer)
            for chunk, seed in zip(chunks, seeds, strict=True):
                params = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                                        top_p=g.top_p, seed=seed)
                rows += torch.stack([next_ids for next_ids, _ in generator.token_steps(chunk, params)], 1).tolist()
        return cut_completions(rows, generator)

    # ---- batching ------------------------------------------------------------------------------

    def _micro_batch(self, prompts: list[list[int]], completions: list[list[int]],
                     advantages: torch.Tensor) -> Batch:
        """Right-padded prompt + completion rows; `mask` is 1 on the targets that are completion tokens."""
        width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
        pad = self.tokenizer.pad_id
        tokens = torch.full((len(prompts), width), pad, dtype=torch.long)
        targets, mask = tokens.clone(), torch.zeros_like(tokens)
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            sequence = torch.tensor(prompt + completion, dtype=torch.long)
            n = len(sequence) - 1
            tokens[row, :n], targets[row, :n] = sequence[:-1], sequence[1:]
            mask[row, len(prompt) - 1:n] = 1
        device = self.info.device
        batch = {"tokens": tokens.to(device), "targets": targets.to(device), "mask": mask.to(device),
                 "advantages": advantages.to(device)}
        if self.reference is not None:
            with torch.no_grad():
                batch["ref_logps"] = self.reference(batch["tokens"], batch["targets"],
                                                    logps_temperature=self.cfg.grpo.temperature).token_logps
        return batch

    def step_batches(self, draw: Callable[[], list[Prompt]], step: int) -> StepBatches:
        start = time.perf_counter()
        rngs = rng_state()  # put back where a reward fails: the step saved then is the one before, RNGs and all
        drawn = draw()
        group = self.group_size
        prompts = [p for p in drawn for _ in range(group)]
        completions, texts = self._sample([p.ids for p in prompts], step)
        lengths = [len(c) for c in completions]
        batch = Completions([p.messages for p in prompts], texts, lengths, [p.fields for p in prompts])
        # each rank scores its own completions: a reward that fails on one ends every rank (alone, it left the others
        # in their next collective until the watchdog called the node failed), saying so once the last complete step
        # is saved
        try:
            rewards, components = agreed(lambda: self.reward(batch), announce=False)
        except UserError as exc:  # a reward of the user's may have drawn from the global RNGs
            set_rng_state(rngs)
            raise StepInputError(str(exc), announce=False) from None
        seconds = time.perf_counter() - start
        advantages = group_advantages(rewards, group, self.cfg.grpo.scale_rewards)
        size = self.micro_batch_size
        micro_batches = [self._micro_batch([p.ids for p in prompts[i:i + size]], completions[i:i + size],
                                           advantages[i:i + size]) for i in range(0, len(prompts), size)]
        metrics = {**reward_metrics(rewards, components, group),
                   "completion_length": torch.tensor(lengths, dtype=torch.float32).mean()}
        return StepBatches(micro_batches, sum(b["tokens"].numel() for b in micro_batches),
                           {k: v.to(self.info.device) for k, v in metrics.items()}, sum(lengths), seconds)
