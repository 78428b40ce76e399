"""LoRA (Hu et al., 2021): low-rank adapters on a frozen model's linear layers, for SFT, DPO and GRPO.

`apply_lora` replaces each targeted `nn.Linear` (`lora.targets`, names from `llm.config.LORA_TARGETS`) by a
`LoRALinear`: the same frozen weight W (the same parameter, under the same state_dict key `...wq.weight`) plus
trainable `lora_a` [r, in] (Kaiming-uniform, as `nn.Linear` initialises its own weight) and `lora_b` [out, r]
(zeros), computing

    y = W x + (alpha / r) * B A dropout(x)

B = 0 makes the adapted model equal the base at step 0, exactly. Every other parameter (embeddings, norms, the
output and router layers) is frozen, so only the adapters have gradients, sit in the optimizer and are saved in
checkpoints (`llm.train.checkpoint` excludes frozen parameters); the base weights come from `--init-from`.

`merge` folds (alpha / r) B A into W and returns a plain `Transformer` whose state_dict has the base's keys: what
`export`, `generate`, `chat` and `eval` load (`llm.loading`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from llm.config import LoRAConfig
from llm.model.from_weights import model_from_weights
from llm.model.transformer import Transformer

ADAPTER_NAMES = ("lora_a", "lora_b")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, r: int, scale: float, dropout: float, generator: torch.Generator) -> None:
        """`scale`: alpha / r; `generator`: draws A."""
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)
        self.bias = None if base.bias is None else base.bias.requires_grad_(False)
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_a = nn.Parameter(torch.empty(r, base.in_features, **like))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5), generator=generator)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r, **like))
        self.scale = scale
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + update * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A, computed in fp32 and stored in W's dtype."""
        delta = self.lora_b.detach().float() @ self.lora_a.detach().float()
        return (self.weight.detach().float() + self.scale * delta).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, r={self.lora_a.shape[0]}, scale={self.scale:g}"


def apply_lora(model: Transformer, cfg: LoRAConfig, seed: int) -> Transformer:
    """Freeze `model` and wrap its `cfg.targets` linear layers in place (every layer, every expert); the adapters'
    A matrices are drawn from `seed`, so every rank builds the same ones. Returns `model`."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in cfg.targets and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, cfg.r, cfg.scale, cfg.dropout, generator))
    return model


def is_adapter_key(name: str) -> bool:
    """Whether a state_dict key or parameter name is a LoRA adapter's."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def merge(model: Transformer) -> Transformer:
    """A plain `Transformer` computing what the LoRA `model` computes: each adapted weight replaced by
    W + (alpha / r) B A, every other weight as it is, the original state_dict keys; in `model`'s train/eval mode."""
    state = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{name}.weight"] = module.merged_weight()
    dtype = next(model.parameters()).dtype
    return model_from_weights(model.cfg, {k: v.to(dtype, copy=True) for k, v in state.items()}).train(model.training)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `model`, each counted once (a tied embedding too), at their full size
    also where ZeRO-3 has partitioned them."""
    def size(param: nn.Parameter) -> int:
        return getattr(param, "ds_numel", param.numel())

    params = list(model.parameters())
    return sum(size(p) for p in params if p.requires_grad), sum(size(p) for p in params)


def trainable_summary(model: nn.Module, cfg: LoRAConfig) -> str:
    """'LoRA r=16 on wq,wv: 0.131 M of 3.331 M parameters trainable (3.93 %)' (the total counts the adapters), or
    'no LoRA: ...'."""
    trainable, total = parameter_counts(model)
    what = f"LoRA r={cfg.r} on {','.join(cfg.targets)}" if cfg.r else "no LoRA"
    return (f"{what}: {trainable / 1e6:.3f} M of {total / 1e6:.3f} M parameters trainable "
            f"({100 * trainable / max(total, 1):.2f} %)")
