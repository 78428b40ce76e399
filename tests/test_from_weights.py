import itertools
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm.config import ModelConfig, build_config
from llm.export import WEIGHTS_FILE, export_model
from llm.loading import load_model_dir, load_trained_model
from llm.model import Transformer
from llm.model.from_weights import model_from_weights, model_to_fill, shapes_only
from llm.train.rollout import RolloutPolicy

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


@pytest.mark.parametrize("shape", ["untied", "tied"])
def test_a_model_to_fill_has_room_for_the_weights_or_none(shape):
    torch.manual_seed(0)
    source = Transformer(_cfg(**SHAPES[shape])).eval()
    with torch.device("meta"):
        sized = Transformer(source.cfg)
        unsized = Transformer(source.cfg)
    sized = model_to_fill(sized, torch.bfloat16, torch.device("cpu"), sized=True)
    unsized = model_to_fill(unsized, torch.bfloat16, torch.device("cpu"), sized=False)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in sized.parameters())
    assert all(p.numel() == 0 for p in unsized.parameters())
    for model in (sized, unsized):
        assert model.rope_cos.dtype == torch.float32 and torch.equal(model.rope_cos, source.rope_cos)
        assert (model.output.weight is model.tok_embeddings.weight) == source.cfg.tie_embeddings
    with torch.no_grad():
        for name, param in sized.named_parameters():
            param.copy_(source.get_parameter(name))
        for param in source.parameters():  # parameters only, as a DeepSpeed engine casts them
            param.data = param.data.to(torch.bfloat16)
    tokens = torch.randint(0, 97, (2, 11))
    assert torch.equal(sized(tokens).logits, source(tokens).logits)


@pytest.mark.parametrize("mode", ["copy", "gathered"])
def test_the_zero3_rollout_model_is_made_without_random_weights(mode):
    """GRPO's inference copy of a ZeRO-3 policy used to be a randomly initialised fp32 model on every rank (32 GB and
    minutes for an 8B policy), its values replaced at the first rollout anyway."""
    cfg = build_config("demo", [f"grpo.rollout_model={mode}", "model.vocab_size=97", "model.dim=48",
                                "model.n_layers=2", "model.n_heads=4"])

    class ZeRO3Engine:
        module = torch.nn.Linear(1, 1).to(torch.bfloat16)

        @staticmethod
        def zero_optimization_stage() -> int:
            return 3

    before = torch.random.get_rng_state()
    policy = RolloutPolicy(cfg, ZeRO3Engine(), torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before)
    sizes = {p.numel() for p in policy.model.parameters()}
    assert (sizes == {0}) == (mode == "gathered")
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}


LOAD_A_MODEL = """
import sys
from pathlib import Path
from llm.loading import load_model_dir
model, _ = load_model_dir(Path(sys.argv[1]))
print('torch._dynamo' in sys.modules, model.tok_embeddings.weight.device)
"""


@pytest.mark.parametrize("source", ["export", "run"])
def test_loading_a_model_leaves_torch_dynamo_unimported(source, zero_runs, tmp_path):
    """The meta-device model that names and shapes an export's weights ran torch's initialisers and built its RoPE
    tables through torch's Python reference implementations, whose first call imports torch._dynamo: 2 CPU-s of
    every command that loads a model to generate, chat, serve, evaluate or export. A run's checkpoint did too, in
    the meta-device model its shapes are checked against (`checkpoint.mismatch_reason`): `generate` of a run took
    4.7 s instead of 2.9."""
    if source == "export":
        export_model(Transformer(_cfg()), None, tmp_path / "export")
    directory = tmp_path / "export" if source == "export" else zero_runs[3]
    result = subprocess.run([sys.executable, "-c", LOAD_A_MODEL, str(directory)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.stdout.split() == ["False", "cpu"], result.stderr[-3000:]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_model_of_shapes_only_has_every_parameter_on_the_meta_device(shape):
    with shapes_only():
        model = Transformer(_cfg(**SHAPES[shape]))
    reference = Transformer(_cfg(**SHAPES[shape]))
    assert all(p.is_meta for p in model.parameters())
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}
    assert torch.empty(2).device.type == "cpu" and torch.nn.init.normal_(torch.zeros(3)).abs().sum() > 0  # left
