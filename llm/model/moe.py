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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token_idx, slot = (chosen == e).nonzero(as_tuple=True)
            # every expert runs (possibly on zero tokens) so all parameters get gradients under ZeRO
            y = expert(tokens[token_idx]) * weights[token_idx, slot].unsqueeze(-1).to(tokens.dtype)
            out.index_add_(0, token_idx, y)
        for expert in self.shared_experts:
            out = out + expert(tokens)
        # Switch-Transformer balance loss: n_experts * sum_e (fraction routed to e) * (mean prob of e)
        routed_fraction = F.one_hot(chosen, self.n_experts).float().sum(1).mean(0) / self.top_k
        self.aux_loss = self.aux_loss_coef * self.n_experts * (routed_fraction * probs.mean(0)).sum()
        return out.reshape(shape)
