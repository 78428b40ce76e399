"""`ResumableDistributedSampler`: one global sample order per epoch, resumable on any world size.

The order of epoch e is a permutation drawn from (seed, e). The state is just (epoch, consumed):
`consumed` counts samples taken globally in this epoch, by all ranks together. The remaining order
`order[consumed:]` is dealt to ranks round-robin (rank r takes positions r, r + W, r + 2W, ...), so
after any whole number of rounds the samples taken are exactly a prefix of the global order, and a
resume on a different number of ranks W' continues the same global order from `consumed`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside world size {num_replicas}")
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.consumed = 0

    def global_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def __iter__(self) -> Iterator[int]:
        remaining = self.global_order(self.epoch)[self.consumed:]
        return iter(remaining[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        remaining = self.num_samples - self.consumed
        return max(0, (remaining - self.rank + self.num_replicas - 1) // self.num_replicas)

    def advance(self, global_samples: int) -> None:
        """Record that `global_samples` more samples were taken by all ranks together."""
        self.consumed += global_samples
        if self.consumed > self.num_samples:
            raise ValueError(f"consumed {self.consumed} of {self.num_samples} samples in epoch {self.epoch}")

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(f"sampler state is for {state['num_samples']} samples / seed {state['seed']}, "
                             f"not {self.num_samples} / {self.seed}")
        self.epoch, self.consumed = state["epoch"], state["consumed"]
