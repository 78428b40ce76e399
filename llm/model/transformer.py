"""LLaMA-style decoder: RMSNorm, RoPE (rotate-half), grouped-query attention, SwiGLU or MoE FFN.

Reads top to bottom: norm, attention, feed-forward, block, transformer. The hot ops (RMSNorm,
RoPE, attention, SwiGLU) go through the `kernels` package, which `model.kernels` (auto, triton, torch)
steers; packed samples (`segment_ids`) and cached decoding are routes inside those ops, not here.
Parameter names follow happy-llm / Meta LLaMA (tok_embeddings, wq, w1, ...).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from llm.config import ModelConfig
from llm.model.kv_cache import KVCache
from llm.model.moe import MoEFeedForward
from llm.model.rope import rope_tables, segment_positions
from llm.model.token_losses import (
    Distillation,
    chunk_positions,
    distillation_loss,
    linear_cross_entropy,
    linear_distillation,
    linear_token_logps,
    masked_cross_entropy,
    token_logps,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels_choice: str = "auto") -> None:
        super().__init__()
        self.eps, self.kernels_choice = eps, kernels_choice
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, backend=self.kernels_choice)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.attention_head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.attention_head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.attention_head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.attention_head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.attention_head_dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attn_dropout = cfg.dropout
        self.kernels_choice = cfg.kernels
        if cfg.qk_norm:  # one weight of head_dim each, shared by the heads (Qwen3)
            self.q_norm = RMSNorm(cfg.attention_head_dim, cfg.norm_eps, cfg.kernels)
            self.k_norm = RMSNorm(cfg.attention_head_dim, cfg.norm_eps, cfg.kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, packed: Packed | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = kernels.apply_rope(q, k, cos, sin, position_offset=cache.length if cache else 0,
                                  positions=packed.positions if packed else None, backend=self.kernels_choice)
        mask = None
        if cache is not None:  # attend to every cached position; the causal mask aligns bottom-right
            k, v = cache.append(layer, k, v)
            mask = cache.attention_mask(seq)
        # dropout on the attention weights only for unpacked rows: the packed-sample paths (per-segment SDPA,
        # FlexAttention, our flash kernel) have none; residual, FFN and embedding dropout apply to packed rows too
        dropout = self.attn_dropout if self.training and packed is None else 0.0
        y = kernels.attention(q, k, v, causal=True, segment_ids=packed.segment_ids if packed else None,
                              attn_mask=mask, dropout_p=dropout, backend=self.kernels_choice)
        y = y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float, kernels_choice: str = "auto") -> None:
        super().__init__()
        self.kernels_choice = kernels_choice
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = kernels.swiglu(self.w1(x), self.w3(x), backend=self.kernels_choice)
        return self.dropout(self.w2(gate))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)

        def make_ffn() -> FeedForward:
            return FeedForward(cfg.dim, cfg.ffn_hidden_dim, cfg.dropout, cfg.kernels)

        self.feed_forward = MoEFeedForward(cfg, make_ffn) if cfg.moe else make_ffn()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, packed: Packed | None = None, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, packed)
        if isinstance(self.feed_forward, MoEFeedForward):
            return x + self.feed_forward(self.ffn_norm(x), token_mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Packed(NamedTuple):
    """Samples packed into one row: which sample each token belongs to, and its position inside that sample."""

    segment_ids: torch.Tensor  # [batch, seq]; equal ids are contiguous
    positions: torch.Tensor  # [batch, seq]; restart at 0 with each sample

    @classmethod
    def of(cls, segment_ids: torch.Tensor) -> Packed:
        return cls(segment_ids, segment_positions(segment_ids))


class OutputHead(nn.Linear):
    """The output projection `[..., dim] -> [..., vocab]` (an `nn.Linear`: its weight is `output.weight`, tied to the
    embedding or not). Given targets, its forward returns their loss, or their log-probabilities, as well: computed
    inside the head's forward because that is where ZeRO-3 gathers the weight (DeepSpeed's hooks around a module's
    forward)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                temperature: float | None = None, distill: Distillation | None = None):
        """The logits; given `targets`, (mean cross-entropy over the targets whose `loss_mask` is 1, the logits or
        None); or with a `temperature`, (log p(target) at every position at that temperature, in fp32, the logits or
        None); or with `distill`, ((distillation loss, cross-entropy, KL) over the targets whose `loss_mask` is 1,
        the logits or None). Logits that fit in one chunk (`llm.model.token_losses.CHUNK_ELEMENTS`, as the demo's
        and most CPU runs' do) are made as ever and returned with their loss; more are never made whole
        (`linear_cross_entropy`, `linear_token_logps`, `linear_distillation`), so training holds one chunk of them
        at a time, and None stands in their place."""
        if targets is None:
            return super().forward(x)
        if x.shape[:-1].numel() <= chunk_positions(self.out_features):
            logits = super().forward(x)
            if temperature is not None:
                return token_logps(logits, targets, temperature), logits
            if distill is not None:
                teacher_logits = F.linear(distill.teacher_hidden, distill.teacher_weight)
                return distillation_loss(logits, teacher_logits, targets, loss_mask, distill.alpha,
                                         distill.temperature), logits
            return masked_cross_entropy(logits, targets, loss_mask), logits
        if temperature is not None:
            return linear_token_logps(x, self.weight, targets, temperature), None
        if distill is not None:
            return linear_distillation(x, self.weight, distill, targets, loss_mask), None
        return linear_cross_entropy(x, self.weight, targets, loss_mask), None


class ModelOutput(NamedTuple):
    """A named tuple, so DeepSpeed ZeRO-3 sees the tensors inside it."""

    logits: torch.Tensor | None  # None given targets whose logits would exceed one chunk (`OutputHead`)
    loss: torch.Tensor | None = None  # mean cross-entropy over targets whose loss mask is 1, plus aux_loss
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss (already weighted); None for a dense model
    ce_loss: torch.Tensor | None = None  # the mean cross-entropy alone: loss without aux_loss
    token_logps: torch.Tensor | None = None  # given targets and logps_temperature: log p(target) per position, fp32
    distill_loss: torch.Tensor | None = None  # given targets and distill: the distillation loss alone (ce_loss: its CE)
    distill_kl: torch.Tensor | None = None  # given targets and distill: the mean KL to the teacher at its temperature
    hidden: torch.Tensor | None = None  # with hidden_only: the final hidden states, normalised (the head's input)


ROPE_EAGER_POSITIONS = 32768
"""RoPE table rows built with the model; longer tables grow on demand, so a config claiming a huge context (an
export's max_position_embeddings) costs memory only for the positions actually used."""


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.kernels)
        self.output = OutputHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg, min(cfg.max_seq_len, ROPE_EAGER_POSITIONS))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # residual projections scaled down with depth (GPT-2 / nanoGPT)
        for name, param in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(param, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:  # Qwen2's q, k and v biases start at zero
            nn.init.zeros_(module.bias)

    def use_kernels(self, choice: str) -> Transformer:
        """Run the hot ops the `choice` way (model.kernels: auto, triton, torch) from now on: how they run, not what
        they compute."""
        self.cfg.kernels = choice
        for module in self.modules():
            if hasattr(module, "kernels_choice"):
                module.kernels_choice = choice
        return self

    def num_parameters(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def _extend_rope(self, positions: int) -> None:
        """Grow the RoPE tables to cover `positions` (at least doubling, at most max_seq_len)."""
        length = min(self.cfg.max_seq_len, max(positions, 2 * self.rope_cos.shape[0]))
        cos, sin = rope_tables(self.cfg, length)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos), sin.to(self.rope_sin)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                last_only: bool = False, segment_ids: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None, logps_temperature: float | None = None,
                distill: Distillation | None = None, hidden_only: bool = False) -> ModelOutput:
        """Logits; given targets, the loss too, computed inside the output layer so that training never holds all
        the logits (which are then None unless they fit in one chunk: `OutputHead`). With a `cache`, `tokens`
        continue the cached sequence; `last_only` computes the logits of the last position only (generation);
        `segment_ids` `[batch, seq]` marks samples packed into one row (each sees only itself, with positions from 0;
        0 is padding).
        `token_mask` `[batch, seq]` is 1 on real tokens and 0 on padding (default: segment id > 0, else every
        position); only an MoE model's load-balancing loss reads it. Given targets and `logps_temperature`, the
        output is the targets' log-probabilities at that temperature (`token_logps`, for DPO and GRPO) instead of
        their loss, made as the loss is (`OutputHead`); given targets and `distill` (the teacher's side), the loss
        is distillation's (`distill_loss`, with `ce_loss` and `distill_kl`). `hidden_only` stops before the output
        layer (a distillation teacher's part: `hidden`)."""
        end = tokens.shape[1] + (cache.length if cache else 0)
        if end > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {end} tokens exceeds model.max_seq_len {self.cfg.max_seq_len}")
        if end > self.rope_cos.shape[0]:
            self._extend_rope(end)
        packed = Packed.of(segment_ids) if segment_ids is not None else None
        if token_mask is None and segment_ids is not None:
            token_mask = segment_ids > 0
        h = self.dropout(self.tok_embeddings(tokens))
        for i, layer in enumerate(self.layers):
            h = layer(h, self.rope_cos, self.rope_sin, cache, i, packed, token_mask)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if last_only:
            h = h[:, -1:]
        aux_loss = sum(layer.feed_forward.aux_loss for layer in self.layers) if self.cfg.moe else None
        if hidden_only:
            return ModelOutput(logits=None, aux_loss=aux_loss, hidden=self.norm(h))
        if targets is None:
            return ModelOutput(logits=self.output(self.norm(h)), aux_loss=aux_loss)
        if distill is not None:
            (distill_loss, ce_loss, kl), logits = self.output(self.norm(h), targets, loss_mask, distill=distill)
            loss = distill_loss if aux_loss is None else distill_loss + aux_loss
            return ModelOutput(logits=logits, loss=loss, aux_loss=aux_loss, ce_loss=ce_loss, distill_loss=distill_loss,
                               distill_kl=kl)
        if logps_temperature is not None:
            logps, logits = self.output(self.norm(h), targets, temperature=logps_temperature)
            return ModelOutput(logits=logits, aux_loss=aux_loss, token_logps=logps)
        ce_loss, logits = self.output(self.norm(h), targets, loss_mask)
        loss = ce_loss if aux_loss is None else ce_loss + aux_loss
        return ModelOutput(logits=logits, loss=loss, aux_loss=aux_loss, ce_loss=ce_loss)
