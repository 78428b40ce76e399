"""Preallocated key/value cache for incremental decoding.

Per layer, keys and values live in `[batch, n_kv_heads, max_len, head_dim]` buffers. Prompts of
different lengths are left-padded so every row's newest token sits at the same position;
`key_valid` marks the real (non-padding) positions, and RoPE's relative nature makes a row's
left shift invisible to attention.
"""

from __future__ import annotations

import torch

from llm.config import ModelConfig
from llm.model.host_memory import GIB, free_memory


def memory_problem(cfg: ModelConfig, batch: int, positions: int, dtype: torch.dtype,
                   device: torch.device) -> str | None:
    """Why a cache of `positions` for `batch` rows cannot fit in the memory of `device`, as the end of a sentence, or
    None: on a GPU, its free memory with what PyTorch holds unused (a finished generation's cache stays reserved for
    the next); on the CPU, this host's free memory or its cgroup's limit. A --max-new-tokens of 10**8 on a model of
    a long context ended in the allocator's traceback."""
    needed = 2 * cfg.n_layers * batch * cfg.kv_heads * positions * cfg.attention_head_dim * dtype.itemsize
    if device.type == "cuda":
        available = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                     - torch.cuda.memory_allocated(device))
        where = f"the {available / GIB:,.1f} GiB {device} has free"
    elif device.type == "cpu":
        available, where = free_memory()
    else:
        return None
    return None if needed <= available else f"need a KV cache of {needed / GIB:,.1f} GiB, more than {where}"


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        if max_len > cfg.max_seq_len:
            raise ValueError(f"cache of {max_len} positions exceeds model.max_seq_len {cfg.max_seq_len}")
        shape = (cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.attention_head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.padded = False
        """Whether any position so far is padding (then attention needs an explicit mask)."""
        self.length = 0
        self.max_len = max_len

    def start_step(self, valid: torch.Tensor) -> None:
        """Mark which of the next `valid.shape[1]` positions hold real tokens (False for left padding)."""
        end = self.length + valid.shape[1]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; this step needs {end}")
        self.key_valid[:, self.length:end] = valid
        self.padded = self.padded or not bool(valid.all())

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v for `layer`; return every cached k, v of that layer so far."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attention_mask(self, seq_q: int) -> torch.Tensor | None:
        """Boolean `[batch, 1, seq_q, kv_len]`: causal (bottom-right), real keys only, and always the query's own
        position (so a padding query stays finite); None when nothing is padded (plain causal attention)."""
        if not self.padded:
            return None
        kv_len = self.length + seq_q
        valid = self.key_valid[:, :kv_len]
        positions = torch.arange(kv_len, device=valid.device)
        query_pos = positions[self.length:].unsqueeze(1)
        causal = positions.unsqueeze(0) <= query_pos
        own = positions.unsqueeze(0) == query_pos
        return ((causal & valid[:, None, :]) | own).unsqueeze(1)

    def advance(self, n: int) -> None:
        self.length += n
