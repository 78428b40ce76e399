"""Mixture-of-experts feed-forward: routed top-k SwiGLU experts, optional shared experts, load-balancing loss."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm.config import ModelConfig


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, make_expert) -> None:
        super().__init__()
        self.top_k = cfg.n_experts_per_token
        self.n_experts = cfg.n_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.aux_loss_coef = cfg.moe_aux_loss_coef
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(cfg.n_experts))
        self.shared_experts = nn.ModuleList(make_expert() for _ in range(cfg.n_shared_experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`token_mask` (1 on real tokens, 0 on padding; all real without one) limits the load-balancing loss to the
        real tokens: padding is routed like any token, but balancing the experts over it would train the router on
        positions no loss reads (Mixtral's implementation takes the attention mask for this)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # Route with one stable sort: the (token, slot) pairs grouped by expert, each group in token order (what
        # `(chosen == e).nonzero()` gave per expert, one host sync each). The groups' sizes are read on the host
        # once per layer, the one sync of an MoE layer: an expert module runs on its own number of tokens.
        assigned = F.one_hot(chosen, self.n_experts)  # [tokens, top_k, n_experts]; no sync with num_classes on CUDA
        order = chosen.reshape(-1).argsort(stable=True)  # position token * top_k + slot, grouped by expert
        sizes = assigned.sum((0, 1)).tolist()
        out = torch.zeros_like(tokens)
        flat_weights = weights.reshape(-1)
        for expert, pairs in zip(self.experts, order.split(sizes)):
            token_idx = pairs // self.top_k
            # every expert runs (possibly on zero tokens) so all parameters get gradients under ZeRO
            y = expert(tokens[token_idx]) * flat_weights[pairs].unsqueeze(-1).to(tokens.dtype)
            out.index_add_(0, token_idx, y)
        for expert in self.shared_experts:
            out = out + expert(tokens)
        # Switch-Transformer balance loss over the real tokens:
        # n_experts * sum_e (fraction routed to e) * (mean prob of e)
        real = (torch.ones(tokens.shape[0], 1, device=x.device) if token_mask is None
                else token_mask.reshape(-1, 1).float())
        n_real = real.sum().clamp(min=1.0)
        routed_fraction = (assigned.float().sum(1) * real).sum(0) / (n_real * self.top_k)
        mean_prob = (probs * real).sum(0) / n_real
        self.aux_loss = self.aux_loss_coef * self.n_experts * (routed_fraction * mean_prob).sum()
        return out.reshape(shape)
