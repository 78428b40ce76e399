"""Text continuation with a trained model (full forward per token; the KV-cached path builds on this API)."""

from __future__ import annotations

import torch

from llm.model import Transformer
from llm.tokenizer import Tokenizer


@torch.no_grad()
def complete(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 32,
             temperature: float = 0.0, stop_ids: tuple[int, ...] = (), seed: int = 0) -> str:
    """The text generated after `prompt`: greedy at temperature 0, else sampled with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt)], dtype=torch.long)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len:]).logits[0, -1].float()
        if temperature > 0:
            next_id = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        else:
            next_id = int(logits.argmax())
        if next_id in stop_ids:
            break
        new.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return tokenizer.decode(new)
