"""Models made without random weights: around weights already in memory, or with room for weights that come later.

`Transformer(cfg)` fills every parameter with random values before a checkpoint's or an export's weights are copied
over them: for an 8B model that is 32 GB of fp32 beside the 32 GB being loaded, and minutes of random number
generation on the host. Here the model is built on the meta device (shapes, no memory), its parameters become the
given tensors (or uninitialised storage, or none, to be filled later), and the RoPE tables are computed for real.

On the meta device the initialisers (`torch.nn.init`) compute nothing, yet torch runs them through its Python
reference implementations, the first of which imports torch._dynamo (2 CPU-s): `shapes_only` skips them, so that a
command that loads a model to generate, evaluate or export never imports it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from llm.config import ModelConfig
from llm.model.rope import rope_tables
from llm.model.transformer import Transformer


class _SkipInitialisers(TorchFunctionMode):
    """Returns the tensor a `torch.nn.init` function was given, untouched; every other call runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == torch.nn.init.__name__:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device (shapes, no memory), their initialisers
    skipped; a tensor made on a device named explicitly is real there (the RoPE tables, on the CPU)."""
    with torch.device("meta"), _SkipInitialisers():
        yield


def model_from_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Transformer:
    """The model `cfg` describes whose parameters ARE `weights` (our state-dict names; the tensors are used as they
    are, in their dtype and device, not copied). A tied model's output matrix is its embedding: an `output.weight`
    among `weights` is ignored (check beforehand that it is a copy). RuntimeError when shapes differ (torch's
    message, one 'size mismatch' line per tensor) or names are missing or unexpected ('missing [...], unexpected
    [...]')."""
    with shapes_only():
        model = Transformer(cfg)
    tied = {"output.weight"} if cfg.tie_embeddings else set()
    given = {name: tensor for name, tensor in weights.items() if name not in tied}
    missing, unexpected = model.load_state_dict(given, strict=False, assign=True)
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    _tie_and_tabulate(model, model.tok_embeddings.weight.device, model.rope_cos.shape[0])
    left = [name for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()) if tensor.is_meta]
    if left:  # a tensor the model makes in __init__ that neither the weights nor the RoPE tables replace
        raise RuntimeError(f"no values for {left}")
    return model


def model_to_fill(model: Transformer, dtype: torch.dtype, device: torch.device, sized: bool) -> Transformer:
    """`model`, built on the meta device (LoRA adapters and all), with parameters whose values come later: each
    uninitialised `dtype` storage of its size on `device` (`sized`), or an empty tensor there, for one swapped in
    later (`param.data = ...`); its RoPE tables computed."""
    positions = model.rope_cos.shape[0]
    model._apply(lambda t: torch.empty(t.shape if sized else 0, device=device,
                                       dtype=dtype if t.is_floating_point() else t.dtype))
    _tie_and_tabulate(model, device, positions)
    return model


def _tie_and_tabulate(model: Transformer, device: torch.device, positions: int) -> None:
    """Tie the output matrix to the embedding again (a tied model whose parameters were replaced has two), and
    compute the model's first `positions` RoPE rows in fp32 on `device`."""
    if model.cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    cos, sin = rope_tables(model.cfg, positions)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
