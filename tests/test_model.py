import math

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as kernels
from llm.config import ModelConfig, build_config
from llm.model import Transformer, masked_cross_entropy
from llm.model.rope import rope_tables


def _count(recipe: str) -> int:
    with torch.device("meta"):
        return Transformer(build_config(recipe).model).num_parameters()


def test_parameter_counts_match_the_seeds():
    assert _count("tiny-k-82m") == 82_594_560  # happy-llm defaults
    assert round(_count("tiny-k-215m") / 1e6, 3) == 215.127  # happy-llm dim 1024, 18 layers
    assert _count("tiny-k-215m") == 215_127_040
    assert _count("minimind-26m") == 25_829_888  # MiniMind2-small, 25.83 M
    assert _count("minimind3-64m") == 63_912_192  # MiniMind-3: head dim 96, FFN 2432, QK-norm


def test_qk_norm_normalises_each_heads_queries_and_keys():
    model = _tiny(qk_norm=True)
    attention = model.layers[0].attention
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (12,)
    tokens = torch.randint(0, 97, (2, 10))
    before = model(tokens).logits
    with torch.no_grad():
        attention.wq.weight.mul_(7.0)  # a query scale that the per-head RMSNorm removes
    assert torch.allclose(model(tokens).logits, before, atol=1e-4)
    assert not hasattr(_tiny().layers[0].attention, "q_norm")


def _tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, **overrides)
    return Transformer(cfg).eval()


def test_forward_returns_logits_and_loss():
    model = _tiny()
    tokens, targets = torch.randint(0, 97, (3, 17)), torch.randint(0, 97, (3, 17))
    out = model(tokens, targets)
    assert out.logits.shape == (3, 17, 97) and out.aux_loss is None
    expected = F.cross_entropy(out.logits.reshape(-1, 97), targets.reshape(-1)).item()
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.loss.item() == pytest.approx(math.log(97), rel=0.05)  # small init: near uniform


def test_loss_mask_selects_positions():
    model = _tiny()
    tokens, targets = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 9))
    mask = torch.zeros(2, 9, dtype=torch.long)
    mask[0, 3:6] = 1
    mask[1, 8] = 1
    out = model(tokens, targets, mask)
    picked = out.logits[mask.bool()]
    assert out.loss.item() == pytest.approx(F.cross_entropy(picked, targets[mask.bool()]).item(), rel=1e-6)
    assert masked_cross_entropy(out.logits, targets, torch.zeros_like(mask)).item() == 0.0


def test_causal_future_tokens_do_not_change_past_logits():
    model = _tiny()
    a = torch.randint(0, 97, (1, 12))
    b = a.clone()
    b[0, 7:] = torch.randint(0, 97, (5,))
    assert torch.allclose(model(a).logits[0, :7], model(b).logits[0, :7], atol=1e-6)


def test_grouped_query_attention_equals_repeated_kv_heads():
    q, k, v = torch.randn(2, 8, 11, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    assert torch.allclose(kernels.attention(q, k, v), expected, atol=1e-6)


def test_attention_with_short_query_is_aligned_bottom_right():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    q_full = torch.randn(1, 2, 10, 8)
    q_full[:, :, -3:] = q
    full = kernels.attention(q_full, k, v)
    assert torch.allclose(kernels.attention(q, k, v), full[:, :, -3:], atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    cfg = ModelConfig(dim=64, n_heads=2, max_seq_len=40)
    cos, sin = rope_tables(cfg)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(i, j):
        qi, _ = kernels.apply_rope(q, q, cos, sin, position_offset=i)
        kj, _ = kernels.apply_rope(k, k, cos, sin, position_offset=j)
        return (qi * kj).sum().item()

    assert score(5, 2) == pytest.approx(score(25, 22), rel=1e-4, abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_rope_is_rotate_half_layout():
    cfg = ModelConfig(dim=8, n_heads=1, max_seq_len=4)
    cos, sin = rope_tables(cfg)
    x = torch.arange(8.0).view(1, 1, 1, 8).expand(1, 1, 4, 8).contiguous()
    rotated, _ = kernels.apply_rope(x, x, cos, sin)
    x1, x2 = x[..., :4], x[..., 4:]
    assert torch.allclose(rotated, torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))


def test_yarn_keeps_high_frequencies_and_stretches_low_ones():
    plain = ModelConfig(dim=64, n_heads=1, max_seq_len=64)
    yarn = ModelConfig(dim=64, n_heads=1, max_seq_len=64, rope_scaling="yarn", rope_factor=4.0,
                       rope_original_max_seq_len=16)
    (cos_p, sin_p), (cos_y, sin_y) = rope_tables(plain), rope_tables(yarn)
    mscale = 0.1 * math.log(4.0) + 1
    angle_p, angle_y = torch.atan2(sin_p, cos_p), torch.atan2(sin_y / mscale, cos_y / mscale)
    assert torch.allclose(angle_y[1, 0], angle_p[1, 0], atol=1e-6)  # highest frequency unchanged
    assert angle_y[1, -1].item() == pytest.approx(angle_p[1, -1].item() / 4, rel=1e-4)  # lowest interpolated by 4
    assert torch.allclose(cos_y[0], torch.full_like(cos_y[0], mscale))


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("theta, original", [(10.0, 65536), (10.0, 8192), (1000.0, 8192), (10000.0, 32),
                                             (10000.0, 4096), (10000.0, 65536), (500000.0, 8192), (1e6, 32768)])
def test_yarn_tables_equal_transformers(theta, original, head_dim):
    """The ramp's correction range was clamped at head_dim // 2 - 1 where transformers (and YaRN's own code) clamp at
    head_dim - 1: wherever beta_slow's correction dimension passed head_dim // 2 - 1 the tables differed (an import
    of a theta-1000, 8192-position YaRN Llama was 3.6 logits away). The grid includes original lengths above
    2 pi theta (the upper clamp applies) and above 201 theta^2 (the range is empty: all interpolated)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    factor, positions = 4.0, 512
    cfg = ModelConfig(dim=head_dim * 2, n_heads=2, max_seq_len=int(original * factor), rope_theta=theta,
                      rope_scaling="yarn", rope_factor=factor, rope_original_max_seq_len=original)
    cos, sin = rope_tables(cfg, positions)
    hf_config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=cfg.max_seq_len,
                            rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                             "original_max_position_embeddings": original})
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, 1), torch.arange(positions)[None])
    # transformers' frequencies are float32, ours float64: their rounding, times a position up to 512
    assert torch.allclose(cos, hf_cos[0, :, :head_dim // 2], atol=5e-5)
    assert torch.allclose(sin, hf_sin[0, :, :head_dim // 2], atol=5e-5)


def test_moe_routes_balances_and_trains_every_expert():
    model = _tiny(moe=True, n_experts=4, n_experts_per_token=2, n_shared_experts=1).train()
    tokens = torch.randint(0, 97, (4, 16))
    out = model(tokens, tokens)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    dense = masked_cross_entropy(out.logits, tokens, None)
    assert out.loss.item() == pytest.approx(dense.item() + out.aux_loss.item(), rel=1e-6)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.layers[0].feed_forward.router.weight.grad.abs().sum() > 0


def test_moe_load_balancing_loss_leaves_padding_out():
    """A padded batch balances the experts over its real tokens only: its loss is the one of the same rows without
    the padding, whether the padding is marked by a token mask (DPO's and GRPO's right-padded rows, whose real
    tokens `real_tokens` finds from the reply mask) or by segment id 0 (packed SFT rows)."""
    from llm.train.objectives import real_tokens

    model = _tiny(moe=True, n_experts=4, n_experts_per_token=2, moe_aux_loss_coef=1.0).eval()
    real = torch.randint(1, 97, (1, 10))
    padded = torch.cat([real, torch.zeros(1, 6, dtype=torch.long)], dim=1)  # 6 padding tokens after the row
    alone = model(real).aux_loss.item()
    assert model(padded).aux_loss.item() != pytest.approx(alone)  # padding is routed too: it must be left out
    reply = torch.zeros(1, 16)
    reply[0, 4:10] = 1  # targets 4..9 are the reply: inputs 0..9 are the real tokens
    assert real_tokens(reply).tolist() == [[1.0] * 10 + [0.0] * 6]
    assert model(padded, token_mask=real_tokens(reply)).aux_loss.item() == pytest.approx(alone, rel=1e-6)
    segments = torch.tensor([[1] * 10 + [0] * 6])  # one sample, then padding
    assert model(padded, segment_ids=segments).aux_loss.item() == pytest.approx(alone, rel=1e-6)


def _moe_per_expert(moe, x):
    """MoE routing written the plain way, one expert at a time: its (token, slot) pairs found by `nonzero` (a host
    sync per expert on a GPU), the experts' outputs added in expert order."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.softmax(moe.router(tokens).float(), dim=-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for e, expert in enumerate(moe.experts):
        token_idx, slot = (chosen == e).nonzero(as_tuple=True)
        out.index_add_(0, token_idx, expert(tokens[token_idx]) * weights[token_idx, slot].unsqueeze(-1))
    for expert in moe.shared_experts:
        out = out + expert(tokens)
    return out.reshape(x.shape)


@pytest.mark.parametrize("n_experts, top_k, shared, norm, n_tokens", [
    (4, 2, 1, True, 37), (8, 3, 0, False, 50), (8, 1, 0, True, 3), (5, 5, 2, True, 16), (16, 2, 0, True, 2),
])
def test_moe_routing_gives_exactly_what_routing_one_expert_at_a_time_gives(n_experts, top_k, shared, norm, n_tokens):
    """Routing by one sort per layer (one host sync) gives the per-expert routing's output bitwise (same tokens in the
    same order for each expert, added in the same order), and its gradients bitwise too on the CPU; experts that get
    no token included."""
    model = _tiny(moe=True, n_experts=n_experts, n_experts_per_token=top_k, n_shared_experts=shared,
                  norm_topk_prob=norm)
    moe = model.layers[0].feed_forward
    results = []
    for forward in (moe, lambda x: _moe_per_expert(moe, x)):
        x = torch.randn(1, n_tokens, 48, generator=torch.Generator().manual_seed(n_tokens)).requires_grad_()
        out = forward(x)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad, [p.grad.clone() for p in moe.parameters()]))
        moe.zero_grad(set_to_none=False)
    (out, x_grad, grads), (expected, expected_x_grad, expected_grads) = results
    assert torch.equal(out, expected)
    assert torch.equal(x_grad, expected_x_grad)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))
    if n_tokens * top_k < n_experts:  # some expert had no token: it ran on none, and its parameters got zero grads
        assert any(torch.count_nonzero(expert.w1.weight.grad) == 0 for expert in moe.experts)


def test_untied_and_explicit_hidden_dim():
    model = _tiny(tie_embeddings=False, hidden_dim=100)
    assert model.output.weight is not model.tok_embeddings.weight
    assert model.layers[0].feed_forward.w1.weight.shape == (100, 48)
    tied = _tiny()
    assert tied.output.weight is tied.tok_embeddings.weight


def test_sequence_longer_than_tables_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        _tiny()(torch.zeros(1, 65, dtype=torch.long))


def test_qkv_biases_start_at_zero_and_are_counted():
    model = _tiny(qkv_bias=True)
    attention = model.layers[0].attention
    assert all(torch.equal(layer.bias, torch.zeros_like(layer.bias)) for layer in (attention.wq, attention.wk,
                                                                                   attention.wv))
    assert attention.wo.bias is None and model.layers[0].feed_forward.w1.bias is None
    assert model.num_parameters() == model.cfg.parameter_count == _tiny().num_parameters() + 2 * (48 + 2 * 24)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_a_perfectly_balanced_router_has_a_load_balancing_loss_of_its_coefficient(top_k):
    """n_experts x sum_e f_e P_e, f the share of (token, slot) assignments (summing to 1) and P_e = 1/n_experts for a
    uniform router: exactly moe_aux_loss_coef, whatever top_k (no test pinned its value)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, dim=48, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    moe=True, n_experts=4, n_experts_per_token=top_k, moe_aux_loss_coef=0.01))
    with torch.no_grad():
        model.layers[0].feed_forward.router.weight.zero_()
        aux = model(torch.randint(0, 97, (2, 16))).aux_loss
    assert aux.item() == pytest.approx(0.01, rel=1e-5)
