import itertools

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm.config import ModelConfig
from llm.export import WEIGHTS_FILE, export_model
from llm.loading import load_model_dir, load_trained_model
from llm.model import Transformer
from llm.model.from_weights import model_from_weights

SHAPES = {
    "untied": {},
    "tied": {"tie_embeddings": True},
    "moe": {"moe": True, "n_experts": 4, "n_shared_experts": 1},
    "qk_norm": {"qk_norm": True},
}


def _cfg(**overrides) -> ModelConfig:
    return ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, **overrides)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_model_from_weights_computes_what_the_loaded_model_computes(shape):
    torch.manual_seed(0)
    source = Transformer(_cfg(**SHAPES[shape])).eval()
    weights = source.state_dict()
    model = model_from_weights(source.cfg, weights).eval()
    tokens = torch.randint(0, 97, (2, 11))
    assert torch.equal(model(tokens).logits, source(tokens).logits)
    assert torch.equal(model.rope_cos, source.rope_cos) and torch.equal(model.rope_sin, source.rope_sin)
    named = dict(model.named_parameters())
    for name, param in named.items():  # the given tensors themselves, trainable, on no meta device
        assert param.data_ptr() == weights[name].data_ptr() and param.requires_grad, name
    assert not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if source.cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight and "output.weight" not in named
    model.train()(tokens, tokens).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_weights_that_do_not_fit_are_refused_by_name():
    weights = Transformer(_cfg()).state_dict()
    with pytest.raises(RuntimeError, match="size mismatch for layers.0.attention.wq.weight"):
        model_from_weights(_cfg(), {**weights, "layers.0.attention.wq.weight": torch.zeros(3, 3)})
    del weights["norm.weight"]
    with pytest.raises(RuntimeError, match=r"missing \['norm.weight'\], unexpected \['extra'\]"):
        model_from_weights(_cfg(), {**weights, "extra": torch.zeros(1)})


def test_loading_an_export_makes_no_random_model(tmp_path):
    """An import used to build a randomly initialised model first and copy the weights over it: minutes and twice
    the memory for a large model. Loading draws no random numbers now, and a bf16 export comes back in fp32."""
    torch.manual_seed(0)
    source = Transformer(_cfg())
    export_model(source, None, tmp_path / "export")
    weights = load_file(tmp_path / "export" / WEIGHTS_FILE)
    save_file({k: v.bfloat16() for k, v in weights.items()}, tmp_path / "export" / WEIGHTS_FILE)
    before = torch.random.get_rng_state()
    model, _ = load_model_dir(tmp_path / "export")
    assert torch.equal(torch.random.get_rng_state(), before)
    assert next(model.parameters()).dtype == torch.float32
    assert torch.equal(model.layers[0].attention.wq.weight, source.layers[0].attention.wq.weight.bfloat16().float())


def test_loading_a_run_makes_no_random_model(zero_runs):
    before = torch.random.get_rng_state()
    model, cfg = load_trained_model(zero_runs[3])
    assert torch.equal(torch.random.get_rng_state(), before)
    assert model.num_parameters() == Transformer(cfg.model).num_parameters()
