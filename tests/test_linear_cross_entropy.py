"""Training's cross-entropy, DPO's and GRPO's log-probabilities and distillation's loss fused with the output
projection (`llm.model.token_losses.linear_cross_entropy`, `linear_token_logps` and `linear_distillation`, run by the
model's `OutputHead`): logits that fit in one chunk are computed as they always were, bit for bit; more are made a
chunk at a time and never kept, with the whole computation's values and gradients (to rounding)."""

import pytest
import torch
import torch.nn.functional as F
from saved_tensors import storages_kept_for_the_backward

from llm.config import GRPOConfig, LoRAConfig, ModelConfig
from llm.model import token_losses
from llm.model.lora import apply_lora
from llm.model.token_losses import (
    Distillation,
    distillation_loss,
    linear_cross_entropy,
    linear_distillation,
    linear_token_logps,
    masked_cross_entropy,
    token_logps,
)
from llm.model.transformer import Transformer
from llm.train.objectives import CausalLMObjective, DPOObjective, GRPOObjective, MicroStep, loss_bearing_tokens

VOCAB = 97
TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-3}}
"""Loss and gradients of the chunks against the whole computation: fp32 rounding, or bf16's (the logits' gradient
is rounded to bf16 before its matmuls in both, the weight's gradient summed in fp32 across the chunks)."""


def _model(dtype=torch.float32, **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, **overrides)
    return Transformer(cfg).to(dtype)


def _batch(rows=3, seq=13, masked=True):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    mask = (torch.rand(rows, seq, generator=generator) > 0.3).long() if masked else None
    return tokens, torch.roll(tokens, -1, 1), mask


def _as_before(model, tokens, targets, mask):
    """The model's loss as it was computed before the fused head: the logits whole, then their loss."""
    out = model(tokens)
    loss = masked_cross_entropy(out.logits, targets, mask)
    return loss if out.aux_loss is None else loss + out.aux_loss


def _loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


MODELS = {"dense": {}, "untied": {"tie_embeddings": False},
          "moe": {"moe": True, "n_experts": 4, "n_experts_per_token": 2, "moe_aux_loss_coef": 0.1}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODELS)
def test_logits_within_one_chunk_give_the_loss_and_gradients_as_before_bit_for_bit(kind, dtype):
    """The demo's and most CPU runs' logits fit in one chunk: their numbers do not move."""
    model = _model(dtype, **MODELS[kind]).train()
    tokens, targets, mask = _batch()
    assert tokens.numel() * VOCAB <= token_losses.CHUNK_ELEMENTS
    got, got_grads = _loss_and_grads(model, lambda: model(tokens, targets, mask).loss)
    expected, expected_grads = _loss_and_grads(model, lambda: _as_before(model, tokens, targets, mask))
    assert torch.equal(got, expected)
    assert got_grads.keys() == expected_grads.keys()
    assert all(torch.equal(got_grads[name], expected_grads[name]) for name in got_grads), \
        [name for name in got_grads if not torch.equal(got_grads[name], expected_grads[name])]
    out = model(tokens, targets, mask)
    assert torch.equal(out.logits, model(tokens).logits)  # computed anyway, so returned
    assert out.aux_loss is None or torch.equal(out.loss, out.ce_loss + out.aux_loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False], ids=["loss mask", "no mask"])
@pytest.mark.parametrize("kind", MODELS)
def test_logits_over_chunks_give_the_whole_computations_loss_and_gradients(monkeypatch, kind, masked, dtype):
    model = _model(dtype, **MODELS[kind]).train()
    tokens, targets, mask = _batch(masked=masked)
    expected, expected_grads = _loss_and_grads(model, lambda: _as_before(model, tokens, targets, mask))
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 5 * VOCAB)  # 5 positions a chunk; 3 x 13 = 39 positions
    out = model(tokens, targets, mask)
    assert out.logits is None  # never made whole
    if out.aux_loss is not None:
        assert torch.equal(out.loss, out.ce_loss + out.aux_loss)
    got, got_grads = _loss_and_grads(model, lambda: model(tokens, targets, mask).loss)
    assert torch.allclose(got, expected, **TOLERANCES[dtype]), (got, expected)
    for name, grad in expected_grads.items():
        assert torch.allclose(got_grads[name].float(), grad.float(), **TOLERANCES[dtype]), name
    with torch.no_grad():  # evaluation: the loss without gradients
        assert torch.allclose(model(tokens, targets, mask).loss, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_function_against_the_whole_computation(monkeypatch, dtype):
    """`linear_cross_entropy` on hidden states of any leading shape, with a chunk that does not divide the positions,
    a row left out by the mask in every chunk, a loss scaled afterwards (the trainer's token weight, DeepSpeed's
    1/grad_accum) and a second backward of the same graph."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 4 * VOCAB)
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 3, 7, 32).to(dtype), (torch.randn(VOCAB, 32) * 0.3).to(dtype)
    targets, mask = torch.randint(0, VOCAB, (2, 3, 7)), (torch.rand(2, 3, 7) > 0.4).float()
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, targets, mask) if fused else masked_cross_entropy(F.linear(h, w), targets,
                                                                                             mask)
        (0.37 * loss).backward(retain_graph=True)
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
        (0.37 * loss).backward()
        assert torch.equal(h.grad, 2 * results[-1][1]) and torch.equal(w.grad, 2 * results[-1][2])
    for got, expected in zip(*results, strict=True):
        assert got.dtype == expected.dtype and torch.allclose(got.float(), expected.float(), **TOLERANCES[dtype])
    nothing = torch.zeros_like(mask)  # no loss-bearing target: a zero loss and zero gradients, not a division by 0
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, targets, nothing)
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any()


def test_fp16_gradients_meet_the_loss_scale_before_they_are_rounded_to_fp16(monkeypatch):
    """fp16 training scales the loss (DeepSpeed's loss scale) so that gradients survive fp16: the logits' gradient
    of a mean over many positions, (softmax - one_hot) / positions, is below fp16's smallest number for most logits
    and flushed to zero if rounded to fp16 before it meets the scale."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 1 << 20)
    torch.manual_seed(0)
    vocab, positions = 4096, 8192
    hidden, weight = torch.randn(positions, 16).half(), (torch.randn(vocab, 16) * 0.1).half()
    targets = torch.randint(0, vocab, (positions,))
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, targets) if fused else masked_cross_entropy(F.linear(h, w), targets, None)
        (loss * 65536).backward()
        results.append((h.grad.float(), w.grad.float()))
    for got, expected in zip(*results, strict=True):
        assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())



def test_the_backward_keeps_gradients_of_the_inputs_and_no_logits(monkeypatch):
    """What the loss keeps for its backward is a gradient the size of the hidden states and one the size of the weight;
    the whole computation kept the bf16 logits (the gradient of the hidden states is the same size as they are)."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 256 * 1000)
    hidden = torch.randn(4, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 1024))
    kept = sum(storages_kept_for_the_backward(lambda: linear_cross_entropy(hidden, weight, targets, None)))
    gradients = (hidden.numel() + weight.numel()) * hidden.element_size()
    number = 4  # and the token count, one fp32 number
    assert kept <= gradients + number and gradients < 0.1 * hidden.shape[:-1].numel() * 1000 * hidden.element_size()
    frozen = weight.detach()  # the head frozen (LoRA): no gradient of the weight is made or kept
    kept = sum(storages_kept_for_the_backward(lambda: linear_cross_entropy(hidden, frozen, targets, None)))
    assert kept <= hidden.numel() * hidden.element_size() + number


def test_the_training_objective_keeps_no_logits_for_the_backward(monkeypatch):
    """Pretraining's and SFT's objective computes its loss inside the model's output layer: no tensor autograd keeps
    is as large as the micro-batch's logits (each layer's activations and the weights are far smaller here)."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 8 * 997)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=997, dim=32, n_layers=1, n_heads=2, max_seq_len=64)).train()
    tokens = torch.randint(0, 997, (2, 64))
    batch = {"tokens": tokens, "targets": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(2, 64)}
    steps = []
    largest = max(storages_kept_for_the_backward(lambda: steps.append(CausalLMObjective()(model, batch))))
    assert largest < tokens.numel() * 997 * 4 / 2  # fp32 logits
    step = steps[0]
    assert isinstance(step, MicroStep) and torch.equal(step.loss_tokens, loss_bearing_tokens(batch))
    step.loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_lora_leaves_the_output_head_alone_and_trains_through_it(monkeypatch):
    """LoRA adapts its named layers and freezes the rest: the head stays the fused head (its weight frozen, so only
    the hidden states' gradient is made), and the adapters get the whole computation's gradients."""
    model = apply_lora(_model(), LoRAConfig(r=4, alpha=8), seed=0).train()
    assert type(model.output).__name__ == "OutputHead" and not model.output.weight.requires_grad
    for module in model.modules():  # the adapters start at B = 0: move them, so A's gradients are not all zero
        if hasattr(module, "lora_b"):
            torch.nn.init.normal_(module.lora_b, std=0.02)
    tokens, targets, mask = _batch()
    expected, expected_grads = _loss_and_grads(model, lambda: _as_before(model, tokens, targets, mask))
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 5 * VOCAB)
    got, got_grads = _loss_and_grads(model, lambda: model(tokens, targets, mask).loss)
    assert torch.allclose(got, expected, **TOLERANCES[torch.float32])
    assert got_grads.keys() == expected_grads.keys() and all(name.endswith(("lora_a", "lora_b")) for name in got_grads)
    for name, grad in expected_grads.items():
        assert torch.allclose(got_grads[name], grad, **TOLERANCES[torch.float32]), name


def test_generation_and_state_dict_are_unchanged():
    """The head is still an `nn.Linear` under the key `output.weight`, tied to the embedding; without targets the model
    returns logits as ever (last_only too)."""
    model = _model().eval()
    assert isinstance(model.output, torch.nn.Linear) and model.output.weight is model.tok_embeddings.weight
    assert "output.weight" in model.state_dict()
    tokens, _, _ = _batch()
    out, hidden = model(tokens), _hidden(model, tokens)
    assert out.loss is None and out.ce_loss is None
    assert torch.equal(out.logits, F.linear(model.norm(hidden), model.output.weight))
    last = F.linear(model.norm(hidden[:, -1:]), model.output.weight)
    assert torch.equal(model(tokens, last_only=True).logits, last)


def _hidden(model, tokens):
    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers):
        h = layer(h, model.rope_cos, model.rope_sin, None, i, None, None)
    return h


def _logps_as_before(model, tokens, targets, temperature):
    """The targets' log-probabilities as DPO and GRPO computed them before the fused head: the logits whole."""
    return token_logps(model(tokens).logits, targets, temperature)


def _weighted(logps):
    """A loss that gives every position a gradient of its own, as DPO's and GRPO's do, of a mean's size."""
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(2))
    return (logps * weights).sum() / logps.numel()


def _weighted_logps(model, tokens, targets):
    return _weighted(model(tokens, targets, logps_temperature=0.7).token_logps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODELS)
def test_token_logps_within_one_chunk_are_as_before_bit_for_bit(kind, dtype):
    model = _model(dtype, **MODELS[kind]).train()
    tokens, targets, _ = _batch()
    got_logps = model(tokens, targets, logps_temperature=0.7).token_logps
    assert torch.equal(got_logps, _logps_as_before(model, tokens, targets, 0.7))
    got, got_grads = _loss_and_grads(model, lambda: _weighted_logps(model, tokens, targets))
    expected, expected_grads = _loss_and_grads(model, lambda: _weighted(_logps_as_before(model, tokens, targets, 0.7)))
    assert torch.equal(got, expected)
    assert all(torch.equal(got_grads[name], expected_grads[name]) for name in expected_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODELS)
def test_token_logps_over_chunks_give_the_whole_computations_values_and_gradients(monkeypatch, kind, dtype):
    model = _model(dtype, **MODELS[kind]).train()
    tokens, targets, _ = _batch()
    expected_logps = _logps_as_before(model, tokens, targets, 0.7).detach()
    expected, expected_grads = _loss_and_grads(model, lambda: _weighted(_logps_as_before(model, tokens, targets, 0.7)))
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 5 * VOCAB)  # 5 positions a chunk; 3 x 13 = 39 positions
    out = model(tokens, targets, logps_temperature=0.7)
    assert out.logits is None and out.loss is None  # never made whole; no loss asked for
    assert torch.allclose(out.token_logps, expected_logps, **TOLERANCES[dtype])
    got, got_grads = _loss_and_grads(model, lambda: _weighted_logps(model, tokens, targets))
    assert torch.allclose(got, expected, **TOLERANCES[dtype]), (got, expected)
    for name, grad in expected_grads.items():
        assert torch.allclose(got_grads[name].float(), grad.float(), **TOLERANCES[dtype]), name
    with torch.no_grad():  # the reference model: values alone
        assert torch.allclose(model(tokens, targets, logps_temperature=0.7).token_logps, expected_logps,
                              **TOLERANCES[dtype])


def test_the_token_logps_backward_keeps_no_logits(monkeypatch):
    """What the log-probabilities keep for their backward is their inputs (the hidden states, which the head's matmul
    keeps anyway, and the weight) and the targets; the whole computation kept the logits too."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 256 * 1000)
    hidden = torch.randn(4, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 1024))
    kept = sum(storages_kept_for_the_backward(lambda: linear_token_logps(hidden, weight, targets, 1.0)))
    inputs = (hidden.numel() + weight.numel()) * hidden.element_size() + targets.numel() * targets.element_size()
    assert kept <= inputs and inputs < 0.1 * hidden.shape[:-1].numel() * 1000 * hidden.element_size()


def test_token_logps_train_a_frozen_head_and_pass_gradients_twice(monkeypatch):
    """LoRA's frozen head: only the hidden states' gradient is made; a second backward of the same graph gives the
    same gradient again."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 4 * VOCAB)
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 7, 32), torch.randn(VOCAB, 32) * 0.3
    targets = torch.randint(0, VOCAB, (2, 7))
    grads = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_()
        logps = linear_token_logps(h, weight, targets, 1.3) if fused else token_logps(F.linear(h, weight), targets,
                                                                                        1.3)
        _weighted(logps).backward(retain_graph=True)
        grads.append(h.grad.clone())
        _weighted(logps).backward()
        assert torch.equal(h.grad, 2 * grads[-1])
    assert torch.allclose(*grads, **TOLERANCES[torch.float32])


def _dpo_batch(tokens, targets):
    rows = tokens.shape[0] // 2 * 2
    mask = torch.zeros(tokens.shape)
    mask[:, 4:] = 1
    return {f"{side}_{key}": value[half] for side, half in (("chosen", slice(0, rows // 2)),
                                                             ("rejected", slice(rows // 2, rows)))
            for key, value in (("tokens", tokens), ("targets", targets), ("mask", mask))}


def _grpo_batch(tokens, targets):
    mask = torch.zeros(tokens.shape)
    mask[:, 5:] = 1
    advantages = torch.linspace(-1, 1, tokens.shape[0])
    return {"tokens": tokens, "targets": targets, "mask": mask, "advantages": advantages,
            "ref_logps": torch.full(tokens.shape, -4.0)}


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_dpo_and_grpo_over_chunks_give_the_whole_computations_loss_and_gradients(monkeypatch, objective):
    model = _model().train()
    reference = _model().eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.01 * torch.randn_like(param))
    tokens, targets, _ = _batch(rows=4)
    if objective == "dpo":
        make, batch = DPOObjective(reference, beta=0.1), _dpo_batch(tokens, targets)
    else:
        make, batch = GRPOObjective(GRPOConfig(temperature=0.8)), _grpo_batch(tokens, targets)
    steps = []

    def loss():
        steps.append(make(model, dict(batch)))
        return steps[-1].loss

    expected, expected_grads = _loss_and_grads(model, loss)
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 3 * VOCAB)
    got, got_grads = _loss_and_grads(model, loss)
    expected_metrics, got_metrics = (step.metrics for step in steps)
    assert torch.allclose(got, expected, **TOLERANCES[torch.float32]), (got, expected)
    for name, grad in expected_grads.items():
        assert torch.allclose(got_grads[name], grad, **TOLERANCES[torch.float32]), name
    for name, value in expected_metrics.items():
        assert torch.allclose(got_metrics[name], value, **TOLERANCES[torch.float32]), name


def _teacher(dtype=torch.float32) -> Transformer:
    """A teacher of another width and depth than `_model`'s student, with the same vocabulary."""
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64, init_std=0.1)
    return Transformer(cfg).to(dtype).eval()


def _distill(model, teacher, tokens, targets, mask):
    """The student's (loss, ce, kl) as the distillation objective computes them: the teacher's hidden states and
    output weight given to the student's output layer."""
    with torch.no_grad():
        hidden = teacher(tokens, hidden_only=True).hidden
    out = model(tokens, targets, mask, distill=Distillation(hidden, teacher.output.weight.detach(), 0.3, 2.0))
    assert out.loss is out.distill_loss or torch.equal(out.loss, out.distill_loss + out.aux_loss)
    return out.distill_loss, out.ce_loss, out.distill_kl


def _distill_as_before(model, teacher, tokens, targets, mask):
    """As it was computed before the fused head: both models' logits whole."""
    with torch.no_grad():
        teacher_logits = teacher(tokens).logits
    return distillation_loss(model(tokens).logits, teacher_logits, targets, mask, 0.3, 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODELS)
def test_distillation_within_one_chunk_is_as_before_bit_for_bit(kind, dtype):
    model, teacher = _model(dtype, **MODELS[kind]).train(), _teacher(dtype)
    tokens, targets, mask = _batch()
    got, got_grads = _loss_and_grads(model, lambda: _distill(model, teacher, tokens, targets, mask)[0])
    expected, expected_grads = _loss_and_grads(model, lambda: _distill_as_before(model, teacher, tokens, targets,
                                                                                   mask)[0])
    assert torch.equal(got, expected)
    assert all(torch.equal(got_grads[name], expected_grads[name]) for name in expected_grads)
    for value, before in zip(_distill(model, teacher, tokens, targets, mask)[1:],
                             _distill_as_before(model, teacher, tokens, targets, mask)[1:], strict=True):
        assert torch.equal(value, before)  # ce and kl, the logged metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False], ids=["loss mask", "no mask"])
@pytest.mark.parametrize("kind", MODELS)
def test_distillation_over_chunks_gives_the_whole_computations_loss_and_gradients(monkeypatch, kind, masked, dtype):
    model, teacher = _model(dtype, **MODELS[kind]).train(), _teacher(dtype)
    tokens, targets, mask = _batch(masked=masked)
    expected, expected_grads = _loss_and_grads(model, lambda: _distill_as_before(model, teacher, tokens, targets,
                                                                                   mask)[0])
    expected_metrics = [value.detach() for value in _distill_as_before(model, teacher, tokens, targets, mask)[1:]]
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 5 * VOCAB)  # 5 positions a chunk; 3 x 13 = 39 positions
    with torch.no_grad():
        hidden = teacher(tokens, hidden_only=True).hidden
    assert model(tokens, targets, mask, distill=Distillation(hidden, teacher.output.weight, 0.3, 2.0)).logits is None
    got, got_grads = _loss_and_grads(model, lambda: _distill(model, teacher, tokens, targets, mask)[0])
    assert torch.allclose(got, expected, **TOLERANCES[dtype]), (got, expected)
    for name, grad in expected_grads.items():
        assert torch.allclose(got_grads[name].float(), grad.float(), **TOLERANCES[dtype]), name
    for value, before in zip(_distill(model, teacher, tokens, targets, mask)[1:], expected_metrics, strict=True):
        assert not value.requires_grad and torch.allclose(value, before, **TOLERANCES[dtype])


def test_the_distillation_backward_keeps_gradients_of_the_inputs_and_no_logits(monkeypatch):
    """As the cross-entropy's: a gradient the size of the hidden states and one the size of the weight; the whole
    computation kept the student's logits and the teacher's."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 256 * 1000)
    hidden = torch.randn(4, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    teacher = Distillation(torch.randn(4, 1024, 96, dtype=torch.bfloat16), torch.randn(1000, 96, dtype=torch.bfloat16),
                           0.5, 2.0)
    targets = torch.randint(0, 1000, (4, 1024))
    kept = sum(storages_kept_for_the_backward(lambda: linear_distillation(hidden, weight, teacher, targets, None)))
    gradients = (hidden.numel() + weight.numel()) * hidden.element_size()
    assert kept <= gradients + 4 and gradients < 0.1 * hidden.shape[:-1].numel() * 1000 * hidden.element_size()
