"""Run configuration: dataclasses documented field by field, YAML recipes, dotted overrides.

A run config has six sections, `model`, `data`, `train`, `grpo`, `lora` and `wandb`. Recipes in `llm/recipes/`
(or any YAML file) set some fields; `--set section.field=value` overrides them; `validate()` checks
the whole and raises `UserError` naming the key at fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from llm import durable
from llm.errors import UserError, read_user_text
from llm.wording import shown


@dataclass
class ModelConfig:
    vocab_size: int | None = None
    """Embedding rows, at least the tokenizer's vocabulary size; None (a recipe that does not pin it) takes the
    vocabulary size of the tokenizer the training data was prepared with."""
    dim: int = 512
    """Model (residual stream) width."""
    n_layers: int = 8
    n_heads: int = 8
    """Query heads."""
    head_dim: int | None = None
    """Width of each attention head; None derives it as dim / n_heads (Qwen3-0.6B sets 128 with dim 1024 and 16
    heads)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    hidden_dim: int | None = None
    """SwiGLU hidden size; None derives it as int(8 * dim / 3) rounded up to multiple_of."""
    multiple_of: int = 64
    norm_eps: float = 1e-5
    max_seq_len: int = 512
    """Length of the RoPE tables: the longest sequence the model accepts."""
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    """'none', 'yarn' or 'llama3' (context extension by `rope_factor` over `rope_original_max_seq_len`; 'llama3' is
    Llama 3.1's: frequencies whose wavelength exceeds the original length / `llama3_low_freq_factor` divided by
    `rope_factor`, those below the original length / `llama3_high_freq_factor` kept, a smooth blend between)."""
    rope_factor: float = 1.0
    rope_original_max_seq_len: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    llama3_low_freq_factor: float = 1.0
    """rope_scaling=llama3: the original length over the wavelength above which frequencies are divided in full."""
    llama3_high_freq_factor: float = 4.0
    """rope_scaling=llama3: the original length over the wavelength below which frequencies are kept; above
    `llama3_low_freq_factor`."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3, MiniMind-3); exported as Qwen3ForCausalLM."""
    qkv_bias: bool = False
    """A bias on the query, key and value projections (Qwen2, Qwen2.5); exported as Qwen2ForCausalLM."""
    dropout: float = 0.0
    tie_embeddings: bool = True
    moe: bool = False
    """Replace every FFN with a mixture of experts."""
    n_experts: int = 4
    n_experts_per_token: int = 2
    n_shared_experts: int = 0
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the language-model loss."""
    norm_topk_prob: bool = True
    init_std: float = 0.02
    kernels: str = "auto"
    """Hot ops: 'triton' (our fused kernels), 'torch' (PyTorch's ops, SDPA for attention) or 'auto' (Triton only on
    a GPU where our compiled kernels were verified, PyTorch's fused paths otherwise; see `kernels.VERIFIED`)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def parameter_count(self) -> int:
        """The parameters of the model this config builds, as `Transformer.num_parameters()` counts them (a tied
        embedding once), without building it; needs vocab_size."""
        shapes = self.linear_shapes
        attention = sum(math.prod(shapes[name]) for name in ("wq", "wk", "wv", "wo"))
        attention += 2 * self.attention_head_dim if self.qk_norm else 0
        attention += sum(shapes[name][1] for name in ("wq", "wk", "wv")) if self.qkv_bias else 0
        ffn = sum(math.prod(shapes[name]) for name in ("w1", "w2", "w3"))
        if self.moe:  # a router and the routed and shared experts
            ffn = self.dim * self.n_experts + ffn * (self.n_experts + self.n_shared_experts)
        block = attention + ffn + 2 * self.dim  # and the two norms
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * block + self.dim  # and the final norm

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer in a block (`LORA_TARGETS`; in an MoE model every expert's)."""
        queries, keys = self.n_heads * self.attention_head_dim, self.kv_heads * self.attention_head_dim
        hidden = self.ffn_hidden_dim
        return {"wq": (self.dim, queries), "wk": (self.dim, keys), "wv": (self.dim, keys), "wo": (queries, self.dim),
                "w1": (self.dim, hidden), "w2": (hidden, self.dim), "w3": (self.dim, hidden)}


@dataclass
class DataConfig:
    path: str | None = None
    """Directory written by `zerollm data prepare` (holds tokens.h5)."""
    seq_len: int = 512
    """Tokens per training window (each sample reads seq_len + 1 tokens)."""
    loader_workers: int | None = None
    """DataLoader worker processes per rank; None: 2 on a GPU (batches load while the device computes), 0 on the
    CPU (the cores are busy training)."""


DEFAULT_SAMPLE_PROMPTS = ("Once upon a time", "The capital of France is", "从前有座山，", "人工智能是")
DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(value: float | str, key: str) -> float:
    """Seconds of a duration given as a number of seconds or as text such as '10m', '1h30m', '90s', '2.5h'."""
    text = str(value).strip().lower()
    name = key if key.startswith("--") else f"config key '{key}'"  # an option, or a run-config key
    number = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"  # ASCII digits: \d and float() also read '３０'
    parts = re.fullmatch(rf"(?:({number})\s*h)?\s*(?:({number})\s*m)?\s*(?:({number})\s*s)?", text)
    if re.fullmatch(rf"{number}(e[+-]?[0-9]+)?", text):  # seconds, as YAML writes a float too (1e+99)
        seconds = float(text)
    elif text and parts:  # each unit once, largest first ('1m1m' was 120 s)
        seconds = sum(float(n) * DURATION_UNITS[u] for n, u in zip(parts.groups(), "hms", strict=True) if n)
    else:
        raise UserError(f"{name} expects seconds or a duration such as 10m, 1h30m, 90s; got {shown(value)}")
    if seconds == math.inf:
        raise UserError(f"{name} must be a finite number of seconds, got {value!r}")
    if seconds <= 0:
        raise UserError(f"{name} must be a positive duration, got {value!r}")
    return seconds


@dataclass
class TrainConfig:
    stage: str = "pretrain"
    """'pretrain', 'sft', 'dpo', 'grpo' or 'distill' (set by `zerollm train STAGE`)."""
    init_from: str | None = None
    """Run directory or export directory whose weights start this run (SFT from pretraining, DPO from SFT, GRPO
    from either)."""
    dpo_beta: float = 0.1
    """DPO temperature: rewards are beta * (log pi - log pi_ref) summed over reply tokens."""
    dpo_loss: str = "sigmoid"
    """'sigmoid' (DPO) or 'ipo'."""
    dpo_sft_weight: float = 0.0
    """Weight of an NLL term on the chosen replies added to the DPO loss (RPO); 0 = plain DPO."""
    teacher: str | None = None
    """Distillation: run directory or export directory of the frozen teacher (set by --teacher); its tokenizer must
    be the data's and its vocabulary size the student's."""
    distill_alpha: float = 0.5
    """Distillation: the loss is (1 - alpha) * cross-entropy + alpha * T^2 * KL(teacher_T || student_T), in [0, 1]."""
    distill_temperature: float = 1.0
    """Distillation: T, the temperature both distributions are softened by in the KL term (positive)."""
    max_steps: int = 1000
    """Optimizer steps to train for (the run ends at this global step)."""
    micro_batch_size: int = 8
    """Samples per rank per forward pass."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; global batch = micro_batch_size * grad_accum * world size."""
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of lr."""
    warmup_steps: int = 100
    weight_decay: float = 0.1
    """Applied to matrices only (not to norms)."""
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "auto"
    """'auto' (bf16 where the device has it, fp16 on GPUs without bf16, fp32 on CPUs that only emulate bf16),
    'bf16', 'fp16' (CUDA only; dynamic loss scaling) or 'fp32'. The run directory's config.yaml records what 'auto'
    became."""
    seed: int = 1337
    log_every: int = 1
    eval_every: int = 100
    """Evaluate on the val split every N steps (0 = never) and at the end."""
    eval_batches: int = 8
    """Micro-batches per rank in one evaluation."""
    save_every: int = 500
    """Checkpoint every N steps (0 = only at the end and on SIGTERM)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk (0 = keep all)."""
    peak_tflops: float | None = None
    """Device peak for MFU; None: known GPU table, or a measured matmul peak on CPU."""
    collective_timeout_s: float = 600.0
    """A rank that dies or hangs ends the whole job, naming that rank, within about this many seconds
    (the collective timeout; also bounds how long ranks wait for each other, e.g. while rank 0 saves)."""
    max_time: float | str | None = None
    """Time budget of the training loop: seconds, or a duration such as '10m', '1h30m', '90s'; None: steps only.
    The run stops before a step that would end past it, keeping time for the final evaluation and checkpoint;
    the learning-rate schedule follows time and completes inside it (`llm.train.time_budget`); max_steps still
    caps the run. Resumable: the elapsed time is part of every checkpoint."""
    sample_prompts: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLE_PROMPTS))
    """Prompts continued greedily at each evaluation, into RUN_DIR/samples.jsonl and a wandb table; [] = none."""
    sample_tokens: int = 32
    """Tokens generated for each sample prompt."""

    def max_time_seconds(self) -> float | None:
        return None if self.max_time is None else parse_duration(self.max_time, "train.max_time")


@dataclass
class GRPOConfig:
    """Online Group Relative Policy Optimization (`zerollm train grpo`; see docs/grpo.md). A step samples
    `group_size` completions for each of its prompts from the current policy, scores them, and trains
    `updates_per_batch` optimizer steps on them. Completions are the step's samples: train.micro_batch_size *
    train.grad_accum completions per rank, so that many / group_size prompts per rank. data.seq_len bounds
    prompt + completion; longer prompts are skipped and reported."""

    prompts: list[str] = field(default_factory=list)
    """Prompt files or directories (set by --prompts): MiniMind RL conversations (the prompt is every turn up to
    the final user turn) or {"prompt", "answer"} records; the record's other fields reach the rewards."""
    reward: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward terms (set by --reward, one term each), summed: [WEIGHT*]NAME with NAME one of exact_match,
    format[:REGEX], length, model:DIR (a local sequence-classification model) or module:function (see
    `llm.train.rewards`)."""
    group_size: int = 8
    """Completions per prompt (G); advantages are normalised within each group."""
    max_new_tokens: int = 64
    """Longest completion; a completion that reaches it without a stop token is cut there."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts; log-probabilities in the loss use the same temperature."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    updates_per_batch: int = 1
    """Optimizer steps on each batch of rollouts (mu); above 1 the clipped ratio to the rollout policy matters."""
    clip_low: float = 0.2
    """The policy ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.2
    """Above clip_low gives DAPO's asymmetric clipping ('clip-higher', e.g. 0.28)."""
    kl_coef: float = 0.04
    """Weight of the KL term to the frozen reference (the --init-from weights); 0 builds no reference model."""
    loss: str = "grpo"
    """'grpo' (clipped surrogate, PPO-style) or 'cispo' (the clipped ratio as a stopped weight on every token's
    log-probability, so no token loses its gradient; MiniMax-M1)."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward standard deviation; false keeps only the mean subtracted (Dr. GRPO)."""
    token_mean: bool = False
    """Average the loss over every completion token of the step (DAPO) instead of per completion first."""
    reward_timeout_s: float = 600.0
    """Seconds the rewards of one rollout may take on a rank, every term together; longer ends the run in one line
    (a reward that hangs held the run, which a stop signal lets finish its step first). 0: no limit."""
    rollout_batch_size: int = 0
    """Completions generated per call of the generator, in whole groups (a multiple of group_size); 0: at most
    train.micro_batch_size (one group where a group is larger). The generator's KV cache holds one call's rows x
    (longest prompt + max_new_tokens) positions; larger calls decode faster on a GPU where the memory allows."""
    rollout_model: str = "gathered"
    """What generates the rollouts under ZeRO-3 (under ZeRO 0-2 the engine's own module does, holding the full
    parameters): 'gathered' (the parameters are gathered once per rollout into a hook-free view of the model and
    released after it) or 'copy' (a full copy on each rank, kept and refreshed from the engine before every
    rollout). docs/grpo.md has the measurement."""


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
"""The linear layers of `llm.model.transformer` LoRA can adapt: attention projections and SwiGLU (in an MoE model,
every expert's)."""
LORA_STAGES = ("sft", "dpo", "grpo")
"""The stages LoRA adapts a model in (pretraining has no model to adapt; distillation trains a student whole)."""
LORA_SPEC_KEYS = ("r", "alpha", "targets", "dropout")


@dataclass
class LoRAConfig:
    """Low-rank adapters on a frozen --init-from model (SFT, DPO, GRPO; `llm.model.lora`, docs/lora.md)."""

    r: int = 0
    """Rank of the adapters; 0 = no LoRA (every parameter is trained)."""
    alpha: float | None = None
    """The update B A is scaled by alpha / r; None: alpha = 2 * r (a scale of 2)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers that get adapters, by name: any of wq, wk, wv, wo (attention), w1, w2, w3 (SwiGLU)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (training only)."""

    @property
    def scale(self) -> float:
        """alpha / r; 0 without LoRA."""
        return (2.0 * self.r if self.alpha is None else self.alpha) / self.r if self.r else 0.0


DERIVED_KEYS = {"model.kv_heads": "model.n_kv_heads", "model.ffn_hidden_dim": "model.hidden_dim",
                "model.attention_head_dim": "model.head_dim",
                "lora.scale": "lora.alpha / lora.r"}
"""Values derived from the run config, by the keys that set them (for messages that ask the user to set them)."""


def settable_key(key: str) -> str:
    """`key`, or for a derived value the key(s) that set it: 'model.kv_heads' -> 'model.n_kv_heads'."""
    return DERIVED_KEYS.get(key, key)


@dataclass
class WandbConfig:
    mode: str = "off"
    """'off', 'offline' or 'online'."""
    project: str | None = None
    """None: $WANDB_PROJECT where set (as Hugging Face's Trainer and TRL read it), else 'zerollm'."""
    name: str | None = None
    """None: $WANDB_NAME where set, else the run directory's name."""

    def run_project(self) -> str:
        return self.project or os.environ.get("WANDB_PROJECT") or "zerollm"

    def run_name(self, run_dir: Path) -> str:
        return self.name or os.environ.get("WANDB_NAME") or run_dir.resolve().name


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        """Write the config to `path` atomically (`llm.durable`: a full disk or a kill leaves the old file whole), and
        not at all when the file already holds it."""
        durable.update_text(path, dump_yaml(self.to_dict()))


SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
"""A run config's top-level keys: model, data, train, grpo, lora, wandb."""


class _UniqueKeysLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with a key given twice in one mapping an error, as YAML says (PyYAML kept the last
    silently: `lora: {r: 4, r: 8}` trained at rank 8)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`, expanded by PyYAML below; two
                    key = "<<"  # were taken, the later silently (several go in one: `<<: [*a, *b]`)
                else:
                    key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # refused by PyYAML's own construction below
                if key in seen:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found the key {key!r} twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


class _Yaml12Loader(_UniqueKeysLoader):
    """YAML with the 1.2 core schema's scalars, keys unique. YAML 1.1 (PyYAML's default) also reads on, off, yes, no,
    y and n as booleans (`--set wandb.mode=off` arrived as False), 010 as octal 8 (`--set lora.r=010` trained at
    rank 8), 1:30 as 90, 1_000 as 1000 and 2026-12-02 as a date, and needs a dot in a float (1e-3 was text)."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
        return sign * int(digits[2:] if base != 10 else digits, base)


_YAML11_ONLY = {f"tag:yaml.org,2002:{kind}" for kind in ("bool", "int", "float", "timestamp")}
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                    list("-+0123456789"))
YAML12_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
"""A float as YAML 1.2 writes one: not '1_000' or '0_1', nor digits of other scripts, which Python's float() reads."""
NON_FINITE_TEXT = re.compile(r"[-+]?(?:inf|infinity|nan)", re.IGNORECASE)
"""Python's spellings of the floats that are not finite, which a float key refuses as such."""
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+.0123456789"))
_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _Yaml12Loader.construct_yaml_int)


class _QuotingDumper(yaml.SafeDumper):
    """Quotes every string that YAML 1.1 or 1.2 would read as another type: a run named 1e5 or on reads back as
    text both here and in other YAML readers."""


_QuotingDumper.yaml_implicit_resolvers = {
    first: yaml.SafeDumper.yaml_implicit_resolvers.get(first, []) + _Yaml12Loader.yaml_implicit_resolvers.get(first, [])
    for first in {*yaml.SafeDumper.yaml_implicit_resolvers, *_Yaml12Loader.yaml_implicit_resolvers}}


def _parsed(text: str, loader: type) -> Any:
    """`text` read by `loader`, a SafeLoader subclass; what PyYAML raises other than YAMLError on a hostile file (an
    integer of more than 4300 digits, nesting deeper than Python's recursion limit: a traceback) as a YAMLError."""
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except ValueError as exc:  # int(): 'Exceeds the limit (4300 digits) for integer string conversion ...'
        raise yaml.YAMLError(str(exc).split(":")[0]) from None


def load_yaml(text: str):
    """Parse YAML text the way recipes, overrides and run configs are read (YAML 1.2 core schema)."""
    return _parsed(text, _Yaml12Loader)


def load_recorded_yaml(text: str):
    """Parse a config.yaml that zerollm wrote, as its writer meant it: YAML 1.1, which PyYAML's safe_dump spoke for
    earlier versions (it left text such as 08 or 1e5 unquoted, which YAML 1.2 reads as numbers: a run named 08
    could no longer be resumed or exported); `dump_yaml` quotes what either version would misread. A key given twice
    (a hand edit: the last one was used) is an error."""
    return _parsed(text, _UniqueKeysLoader)


def dump_yaml(data) -> str:
    """YAML text that `load_yaml` and `load_recorded_yaml` read back as `data`."""
    return yaml.dump(data, Dumper=_QuotingDumper, sort_keys=False, allow_unicode=True)


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("llm.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """The raw mapping of a packaged recipe name or a YAML file path. Only a packaged recipe's name reads the
    package's file: a path (`/abs/mine`, `../mine`) was joined to the package's folder with `.yaml` added, so that
    `/abs/mine.yaml` was read in place of the `/abs/mine` given, where both existed."""
    if name_or_path in recipe_names():
        text = (resources.files("llm.recipes") / f"{name_or_path}.yaml").read_text()
        source = f"recipe '{name_or_path}'"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise UserError(f"recipe '{name_or_path}' is neither a packaged recipe ({', '.join(recipe_names())}) "
                            "nor a YAML file")
        text = read_user_text(path, "the recipe as UTF-8 YAML")
        source = str(path)
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        if mark is not None and problem:  # where the parser stopped, not its '"<unicode string>", line 2' text
            raise UserError(f"{source}:{mark.line + 1}:{mark.column + 1}: invalid YAML ({problem})") from None
        raise UserError(f"{source}: invalid YAML ({exc})".replace("\n", " ")) from None
    if raw is None or raw == {}:  # an empty file (or comments only) trained every default without a word
        raise UserError(f"{source}: no settings (an empty recipe); give at least one section (model, data, train, "
                        f"...), or a packaged recipe ({', '.join(recipe_names())})")
    if not isinstance(raw, dict):
        raise UserError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)})")
    for section_name, values in raw.items():  # said with the file: the key errors read as a --set's
        if section_name not in SECTIONS:  # an empty one ('optimizer: {}') was taken without a word
            raise UserError(f"{source}: unknown section '{section_name}'; sections are {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise UserError(f"{source}: section '{section_name}' must be a mapping")
        for name in values:
            if (problem := unknown_key_problem(f"{section_name}.{name}")) is not None:
                raise UserError(f"{source}: {problem}")
    return raw


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Check `value` against the field's annotation, allowing int for float and null for optionals."""
    if value is None:
        if "None" in annotation:
            return None
        raise UserError(f"config key '{key}' cannot be null")
    if annotation == "list[str]":  # a list of paths; one string is a list of one
        value = [value] if isinstance(value, str) else value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise UserError(f"config key '{key}' expects a list of strings, got {shown(value)}")
    if ("float" in annotation and isinstance(value, str) and "str" not in annotation
            and (YAML12_FLOAT.fullmatch(value) or NON_FINITE_TEXT.fullmatch(value))):
        with contextlib.suppress(ValueError):  # '.inf': refused below as text
            value = float(value)  # a quoted number, "1e-3"; 'inf', to be refused as not finite
    if "float" in annotation and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # an int beyond float's range
            value = math.inf
    if isinstance(value, float) and not math.isfinite(value):  # inf passes every "positive" check; nan passes none
        raise UserError(f"config key '{key}' must be a finite number, got {value}")
    expected = [t for t in ("bool", "int", "float", "str") if t in annotation]
    ok = {"bool": bool, "int": int, "float": float, "str": str}
    if any(isinstance(value, ok[t]) and not (t == "int" and isinstance(value, bool)) for t in expected):
        return value
    raise UserError(f"config key '{key}' expects {annotation}, got {shown(value)}")


def unknown_key_problem(dotted: str) -> str | None:
    """What is wrong with config key `dotted` ('model.dimm'), or None for a key of the run config."""
    section_name, _, field_name = dotted.partition(".")
    if section_name not in SECTIONS or not field_name:
        return f"unknown config key '{dotted}': keys look like section.field with section one of {', '.join(SECTIONS)}"
    fields = [f.name for f in dataclasses.fields(getattr(RunConfig(), section_name))]
    if field_name not in fields:
        return f"unknown config key '{dotted}'; '{section_name}' has: {', '.join(fields)}"
    return None


def _apply(cfg: RunConfig, dotted: str, value: Any, text: str | None = None) -> None:
    """Set one key. `text` is the value as written after `--set key=`: a key that only takes text gets it as
    written where YAML reads a number or a boolean (`--set wandb.name=0123` names the run 0123, not 123; quotes
    and null are YAML's, `--set 'wandb.name="0123"'` is 0123 too)."""
    if (problem := unknown_key_problem(dotted)) is not None:
        raise UserError(problem)
    section_name, _, field_name = dotted.partition(".")
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    annotation = str(fields[field_name].type)
    if (text is not None and annotation in ("str", "str | None", "list[str]") and value is not None
            and not isinstance(value, (str, list))):
        value = text.strip()  # YAML read a number or a boolean there (0123, 1e5, true): the text as written (one
        # text of a list of them, as one string is: `--set train.sample_prompts=0123` was refused)
    setattr(section, field_name, _coerce(dotted, value, annotation))


def parse_override(text: str) -> tuple[str, Any, str]:
    """'train.lr=1e-3' -> ('train.lr', 0.001, '1e-3'): the key, the value parsed as YAML and the value as written."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UserError(f"--set expects key=value, got '{text}'")
    try:
        value = raw.strip() if _has_comment(raw) else load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or ""
        if "<stream end>" in problem:  # a list or mapping left open ('[a, b'): it became one text
            raise UserError(f"--set {key.strip()}: '{raw}' ends inside a YAML list or mapping ({problem}); close it, "
                            f"or quote text: --set '{key.strip()}=\"{raw}\"'") from None
        value = raw  # text that YAML reads otherwise ('a: b', '[INST] hi', '{date}-run')
    return key.strip(), value, raw


def _has_comment(raw: str) -> bool:
    """Whether YAML reads a comment in an override's value (a '#' at its start or after white space, outside quoted
    text), which it would drop: `--set 'wandb.name=run #2'` named the run 'run'. Such a value is taken as the text
    written (a number, list or mapping followed by a comment is then refused as not one)."""
    quoted = [(token.start_mark.index, token.end_mark.index) for token in yaml.scan(raw, Loader=_Yaml12Loader)
              if isinstance(token, yaml.ScalarToken)]
    return any(char == "#" and (i == 0 or raw[i - 1].isspace()) and not any(a <= i < b for a, b in quoted)
               for i, char in enumerate(raw))


def refuse_set_twice(overrides: list[str], given: dict[str, str]) -> None:
    """Refuse a `--set` of a key that the command also sets (`given`: key -> what sets it, such as '--init-from'):
    that one won, and the --set was dropped without a word."""
    for text in overrides:
        key = parse_override(text)[0]
        if key in given:
            raise UserError(f"--set {key}: {given[key]} sets it too; give it once")


def parse_lora_spec(spec: str) -> list[str]:
    """`--lora r=16,alpha=32,targets=wq,wk,wv,dropout=0.05` -> the equivalent `--set` overrides of the lora
    section. A piece without '=' continues the targets list before it; r must be a positive integer (r=0, no LoRA,
    is the default: leave --lora out)."""
    values: dict[str, list[str]] = {}
    key = None
    for piece in (p.strip() for p in spec.split(",")):
        name, sep, value = (part.strip() for part in piece.partition("="))  # 'targets = wq' as 'targets=wq'
        if sep:
            if name not in LORA_SPEC_KEYS:
                raise UserError(f"--lora: unknown key '{name}' in '{piece}'; keys are {', '.join(LORA_SPEC_KEYS)} "
                                "(e.g. --lora r=16,alpha=32,targets=wq,wv,dropout=0.05)")
            if name in values:
                raise UserError(f"--lora: '{name}' is given twice")
            key, values[name] = name, [value] if value or name != "targets" else []  # 'targets=': none, said so
        elif key == "targets" and piece:
            values[key].append(piece)
        else:
            raise UserError(f"--lora: '{piece}' is not key=value (e.g. --lora r=16,alpha=32,targets=wq,wv)")
    if "r" not in values:
        raise UserError(f"--lora {spec}: give the rank, e.g. r=16")
    for name, kind, check, what in (("r", int, lambda v: v > 0, "a positive integer"),
                                    ("alpha", float, lambda v: 0 < v < math.inf, "a positive number"),
                                    ("dropout", float, lambda v: 0 <= v < 1, "a number in [0, 1)")):
        if name in values:
            try:  # int() and float() also read '1_6', '٨' and ' 8'
                text = values[name][0]
                number = kind(text) if re.fullmatch(r"[0-9A-Za-z.+-]+", text) else None
            except ValueError:
                number = None
            if number is None or not check(number):
                raise UserError(f"--lora: {name} must be {what}, got '{values[name][0]}'")
            values[name] = [repr(number)]  # the number as checked
    return [f"lora.{name}={json.dumps(items) if name == 'targets' else items[0]}" for name, items in values.items()]


def build_config(recipe: str | dict[str, Any], overrides: list[str] | None = None,
                 paths: dict[str, str | None] | None = None) -> RunConfig:
    """Recipe (name, path or mapping) + `--set` overrides + command-line paths (a path or a list of paths, taken
    verbatim, never parsed as YAML; None leaves the key as it is) -> a validated RunConfig."""
    raw = load_recipe(recipe) if isinstance(recipe, str) else recipe
    cfg = RunConfig()
    for section_name, values in raw.items():
        if not isinstance(values, dict):
            raise UserError(f"recipe section '{section_name}' must be a mapping")
        for name, value in values.items():
            _apply(cfg, f"{section_name}.{name}", value)
    for text in overrides or []:
        _apply(cfg, *parse_override(text))
    for key, value in (paths or {}).items():
        if value is not None:
            _apply(cfg, key, [str(v) for v in value] if isinstance(value, list) else str(value))
    validate(cfg)
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


@dataclass(frozen=True)
class Bounds:
    """The values a numeric config key accepts: from `low` up to `high` (None: no upper bound), each end included
    unless its `*_open` flag excludes it."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above_low = value > self.low if self.low_open else value >= self.low
        below_high = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above_low and below_high

    def __str__(self) -> str:
        if self.high is None:
            return "positive" if self == POSITIVE else f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


POSITIVE = Bounds(0, low_open=True)
NON_NEGATIVE = Bounds(0)
UNIT_INTERVAL = Bounds(0, 1)
WEEK_S = 7 * 24 * 3600
"""The longest timeout a config takes, in seconds: torch's collective timeout and a reward's timer overflow not far
beyond it (1e10 s)."""
BELOW_ONE = Bounds(0, 1, high_open=True)
"""[0, 1): dropout probabilities, Adam's betas."""
LEARNING_RATES = Bounds(0, 1e30, low_open=True)
"""Far above any that trains, yet below what torch's Adam overflows on: at 1e38 its step size (the learning rate over
the bias correction) does not fit a float32, a RuntimeError traceback at the first step."""

TEMPERATURES = Bounds(0.01, 100)
"""Temperatures that divide the logits in a loss (distillation's T, GRPO's sampling temperature): distillation weighs
the KL by T^2, which overflowed at 1e300 (a traceback) and made the loss NaN at 1e23 and 1e-300, and GRPO's logits
over 1e-39 were infinite, its first loss NaN (each said as a learning rate too high); the usual ones are 0.3 to 20."""

NUMBER_RANGES: dict[str, Bounds] = {
    "model.vocab_size": POSITIVE, "model.dim": POSITIVE,
    "model.n_layers": Bounds(1, 1024),  # deeper than any published decoder (126 in Llama 3 405B); each is a module
    "model.n_heads": POSITIVE, "model.head_dim": POSITIVE,
    "model.n_kv_heads": POSITIVE, "model.hidden_dim": POSITIVE, "model.multiple_of": POSITIVE,
    "model.norm_eps": Bounds(0, 1, low_open=True), "model.max_seq_len": POSITIVE,
    "model.rope_theta": Bounds(1, low_open=True),  # the RoPE base: 1 gives every pair the same frequency
    "model.rope_factor": Bounds(1), "model.rope_original_max_seq_len": NON_NEGATIVE,
    "model.yarn_beta_fast": POSITIVE, "model.yarn_beta_slow": POSITIVE, "model.llama3_low_freq_factor": POSITIVE,
    "model.llama3_high_freq_factor": POSITIVE, "model.dropout": BELOW_ONE,
    "model.n_experts": Bounds(1, 1024), "model.n_experts_per_token": POSITIVE, "model.n_shared_experts": NON_NEGATIVE,
    "model.moe_aux_loss_coef": NON_NEGATIVE, "model.init_std": POSITIVE,
    "data.seq_len": POSITIVE, "data.loader_workers": Bounds(0, 64),  # per rank; each is a process
    "train.dpo_beta": POSITIVE, "train.dpo_sft_weight": NON_NEGATIVE, "train.distill_alpha": UNIT_INTERVAL,
    "train.distill_temperature": TEMPERATURES, "train.max_steps": POSITIVE, "train.micro_batch_size": POSITIVE,
    "train.grad_accum": POSITIVE, "train.lr": LEARNING_RATES, "train.min_lr_ratio": UNIT_INTERVAL,
    "train.warmup_steps": NON_NEGATIVE, "train.weight_decay": NON_NEGATIVE, "train.beta1": BELOW_ONE,
    "train.beta2": BELOW_ONE, "train.adam_eps": POSITIVE, "train.grad_clip": NON_NEGATIVE,
    "train.seed": Bounds(0, 2**64 - 1),  # what both torch.manual_seed and numpy's SeedSequence accept
    "train.log_every": POSITIVE, "train.eval_every": NON_NEGATIVE, "train.eval_batches": POSITIVE,
    "train.save_every": NON_NEGATIVE, "train.keep_checkpoints": NON_NEGATIVE, "train.peak_tflops": POSITIVE,
    "train.collective_timeout_s": Bounds(1, WEEK_S), "train.sample_tokens": POSITIVE,  # below 1 s no job meets
    "grpo.group_size": POSITIVE, "grpo.max_new_tokens": POSITIVE, "grpo.temperature": TEMPERATURES,
    "grpo.top_k": NON_NEGATIVE, "grpo.top_p": Bounds(0, 1, low_open=True), "grpo.updates_per_batch": POSITIVE,
    "grpo.clip_low": BELOW_ONE, "grpo.clip_high": NON_NEGATIVE, "grpo.kl_coef": NON_NEGATIVE,
    "grpo.reward_timeout_s": Bounds(0, WEEK_S), "grpo.rollout_batch_size": NON_NEGATIVE,
    "lora.r": NON_NEGATIVE, "lora.alpha": POSITIVE, "lora.dropout": BELOW_ONE,
}
"""The range of every int and float config key (None, where a key allows it, is not checked); train.max_time is a
duration (`parse_duration`). Relations between keys are checked by the validate_* functions."""


def validate_ranges(cfg: RunConfig) -> None:
    for key, bounds in NUMBER_RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _require(value is None or value in bounds, f"{key} must be {bounds}, got {value}")


def validate_model(m: ModelConfig) -> None:
    if m.head_dim is None:
        _require(m.dim % m.n_heads == 0, f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads}), or "
                 "set model.head_dim")
    _require(m.attention_head_dim % 2 == 0, f"head dim {_head_dim_text(m)} must be even for RoPE")
    _require(m.n_heads % m.kv_heads == 0,
             f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.kv_heads})")
    _require(m.rope_scaling in ("none", "yarn", "llama3"),
             f"model.rope_scaling must be 'none', 'yarn' or 'llama3', got '{m.rope_scaling}'")
    if m.rope_scaling == "yarn":
        _require(m.rope_factor > 1 and m.rope_original_max_seq_len > 0,
                 "model.rope_scaling=yarn needs model.rope_factor > 1 and model.rope_original_max_seq_len > 0")
    if m.rope_scaling == "llama3":  # factor 1 keeps every frequency, as in transformers
        _require(m.rope_factor >= 1 and m.rope_original_max_seq_len > 0
                 and 0 < m.llama3_low_freq_factor < m.llama3_high_freq_factor,
                 "model.rope_scaling=llama3 needs model.rope_factor >= 1, model.rope_original_max_seq_len > 0 and "
                 "0 < model.llama3_low_freq_factor < model.llama3_high_freq_factor, got "
                 f"{m.rope_factor}, {m.rope_original_max_seq_len}, {m.llama3_low_freq_factor} and "
                 f"{m.llama3_high_freq_factor}")
    if m.moe:
        _require(0 < m.n_experts_per_token <= m.n_experts,
                 f"model.n_experts_per_token ({m.n_experts_per_token}) must be in 1..model.n_experts ({m.n_experts})")
    _require(m.kernels in ("auto", "triton", "torch"),
             f"model.kernels must be auto, triton or torch, got '{m.kernels}'")
    if m.kernels == "triton":
        refusal = triton_head_dim_refusal(m)
        _require(refusal is None, f"model.kernels=triton: {refusal}; use model.kernels=auto or torch")


def triton_head_dim_refusal(m: ModelConfig) -> str | None:
    """Why the Triton attention kernel cannot run a model of `m`'s head dim, or None when it can."""
    from kernels.runtime import ATTENTION_HEAD_DIMS, HEAD_DIMS_TEXT  # noqa: PLC0415 - loads torch: only when asked

    if m.attention_head_dim in ATTENTION_HEAD_DIMS:
        return None
    return f"the attention kernel takes head dims {HEAD_DIMS_TEXT}, got {_head_dim_text(m)}"


def _head_dim_text(m: ModelConfig) -> str:
    if m.head_dim is None:
        return f"model.dim/model.n_heads = {m.dim}/{m.n_heads} = {m.attention_head_dim}"
    return f"model.head_dim = {m.head_dim}"


STAGES = ("pretrain", "sft", "dpo", "grpo", "distill")


def validate_grpo(cfg: RunConfig) -> None:
    g, t = cfg.grpo, cfg.train
    _require(bool(g.prompts), "GRPO needs prompt files: pass --prompts FILE...")
    _require(g.group_size >= 2, f"grpo.group_size must be at least 2 (advantages compare a group), got {g.group_size}")
    completions = t.micro_batch_size * t.grad_accum
    _require(completions % g.group_size == 0,
             f"train.micro_batch_size * train.grad_accum ({completions}) completions per rank must be a multiple of "
             f"grpo.group_size ({g.group_size})")
    _require(g.rollout_batch_size % g.group_size == 0,
             f"grpo.rollout_batch_size ({g.rollout_batch_size}) must be a multiple of grpo.group_size "
             f"({g.group_size}), or 0 for at most train.micro_batch_size completions per generation call")
    _require(0 < g.max_new_tokens < cfg.data.seq_len,
             f"grpo.max_new_tokens ({g.max_new_tokens}) must be positive and below data.seq_len ({cfg.data.seq_len}), "
             "which bounds prompt + completion")
    _require(g.loss in ("grpo", "cispo"), f"grpo.loss must be grpo or cispo, got '{g.loss}'")
    _require(g.rollout_model in ("gathered", "copy"),
             f"grpo.rollout_model must be gathered or copy, got '{g.rollout_model}'")


def validate_distill(t: TrainConfig) -> None:
    _require(bool(t.teacher), "distillation needs a teacher: pass --teacher RUN_DIR|EXPORT_DIR")


def validate_lora(cfg: RunConfig) -> None:
    lora = cfg.lora
    for name in lora.targets:  # also without LoRA (r 0): a name such as q_proj was accepted, to fail once r is set
        _require(name in LORA_TARGETS, f"lora.targets: unknown module '{name}'; the model's linear layers LoRA can "
                                       f"adapt are {', '.join(LORA_TARGETS)}")
    if lora.r == 0:
        return
    stage = cfg.train.stage
    _require(stage in LORA_STAGES, f"LoRA adapts a trained model: use it with train sft, dpo or grpo (--init-from the "
                                   f"model to adapt), not with {stage}")
    _require(bool(lora.targets), f"lora.targets is empty; name some of {', '.join(LORA_TARGETS)}")
    twice = sorted({name for name in lora.targets if lora.targets.count(name) > 1})
    _require(not twice, f"lora.targets names {', '.join(twice)} more than once")
    full_rank = min(min(cfg.model.linear_shapes[name]) for name in lora.targets)
    _require(lora.r <= full_rank, f"lora.r ({lora.r}) exceeds {full_rank}, the smallest dimension of the adapted "
                                  f"layers ({', '.join(lora.targets)}): their updates have at most that rank")
    _require(bool(cfg.train.init_from), f"LoRA on {stage} needs --init-from: the frozen base model comes from there")


def check_new_run(cfg: RunConfig) -> None:
    """What a run config may not start a run with, though a recorded one is read as it is (a run an earlier version
    trained so is still loaded, resumed and exported): model.dropout in DPO and GRPO, whose frozen reference runs
    without it (the noise was trained on: a first step off ln 2, a first KL above 0)."""
    stage = cfg.train.stage
    _require(stage not in ("dpo", "grpo") or cfg.model.dropout == 0,
             f"model.dropout is {cfg.model.dropout:g}, but {stage.upper()} scores the policy against its frozen "
             "reference, which runs without dropout (the noise was trained on: a first step off ln 2, a first KL "
             "above 0); set model.dropout=0, as TRL does for DPO and GRPO")


def validate(cfg: RunConfig) -> None:
    d, t = cfg.data, cfg.train
    validate_ranges(cfg)
    validate_model(cfg.model)
    source = f" (--init-from {t.init_from}'s context; --set model.max_seq_len={d.seq_len} trains it longer)" \
        if t.init_from else ""  # the user gave neither number
    _require(d.seq_len <= cfg.model.max_seq_len,
             f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({cfg.model.max_seq_len}){source}")
    _require(t.stage in STAGES, f"train.stage must be one of {', '.join(STAGES)}, got '{t.stage}'")
    _require(t.dpo_loss in ("sigmoid", "ipo"), f"train.dpo_loss must be sigmoid or ipo, got '{t.dpo_loss}'")
    _require(t.stage not in ("dpo", "grpo") or bool(t.init_from),
             f"{t.stage.upper()} needs --init-from (the policy and the frozen reference start there)")
    _require(t.precision in ("auto", "bf16", "fp16", "fp32"),
             f"train.precision must be auto, bf16, fp16 or fp32, got '{t.precision}'")
    t.max_time_seconds()  # a malformed or non-positive duration is refused here
    if t.stage == "grpo":
        validate_grpo(cfg)
    if t.stage == "distill":
        validate_distill(t)
    validate_lora(cfg)
    _require(cfg.wandb.mode in ("off", "offline", "online"),
             f"wandb.mode must be off, offline or online, got '{cfg.wandb.mode}'")
