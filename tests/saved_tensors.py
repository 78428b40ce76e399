"""What autograd keeps for a backward, measured: the tests of the chunked losses assert on it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def storages_kept_for_the_backward(fn: Callable[[], object]) -> list[int]:
    """The byte sizes of the distinct storages autograd keeps for the backward of `fn()`."""
    kept = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return list(kept.values())
