"""Per-token losses a chunk of positions at a time (`llm.model.token_losses`): the same values and gradients as the
whole computation, bit for bit, without the fp32 copy of every logit kept for the backward."""

import pytest
import torch
import torch.nn.functional as F
from saved_tensors import storages_kept_for_the_backward

from llm.model import token_losses
from llm.model.token_losses import distillation_loss, masked_cross_entropy, token_logps


def _whole_cross_entropy(logits, targets, mask, teacher=None):
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    mask = mask.reshape(-1).float()
    return (per_token * mask).sum() / mask.sum()


def _whole_logps(logits, targets, mask, teacher=None):
    logps = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (logps * mask).sum()


def _whole_distillation(logits, targets, mask, teacher):
    ce = _whole_cross_entropy(logits, targets, mask)
    per_token = F.kl_div(torch.log_softmax(logits.float() / 2, -1), torch.log_softmax(teacher.float() / 2, -1),
                         log_target=True, reduction="none").sum(-1)
    return 0.5 * ce + 0.5 * 4 * (per_token * mask).sum() / mask.sum()


CASES = {
    "cross-entropy": (lambda logits, targets, mask, teacher: masked_cross_entropy(logits, targets, mask),
                      _whole_cross_entropy),
    "target log-probabilities": (lambda logits, targets, mask, teacher:
                                 (token_logps(logits, targets, 0.7) * mask).sum(), _whole_logps),
    "distillation": (lambda logits, targets, mask, teacher:
                     distillation_loss(logits, teacher, targets, mask, 0.5, 2.0)[0], _whole_distillation),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_chunks_give_the_whole_computations_values_and_gradients_bit_for_bit(monkeypatch, case, dtype):
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 7 * 97)  # 7 positions a chunk; 3 x 13 = 39 positions
    chunked, whole = CASES[case]
    torch.manual_seed(0)
    logits, teacher = torch.randn(3, 13, 97, dtype=dtype) * 4, torch.randn(3, 13, 97, dtype=dtype) * 4
    targets, mask = torch.randint(0, 97, (3, 13)), (torch.rand(3, 13) > 0.3).float()
    results = []
    for fn in (chunked, whole):
        leaf = logits.clone().requires_grad_()
        loss = fn(leaf, targets, mask, teacher)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    (got, got_grad), (expected, expected_grad) = results
    assert torch.equal(got, expected) and torch.equal(got_grad, expected_grad)
    with torch.no_grad():  # evaluation and the frozen reference: no recomputation, the same values
        assert torch.equal(chunked(logits, targets, mask, teacher), expected)



def test_the_backward_keeps_the_logits_not_an_fp32_copy(monkeypatch):
    """Computed whole, the loss kept an fp32 log-softmax of every logit for its backward, twice the bf16 logits (and
    built fp32 copies and gradients of each): at a 152 k vocabulary and 32 k positions, 70 GB for the loss alone."""
    monkeypatch.setattr(token_losses, "CHUNK_ELEMENTS", 256 * 1000)
    logits = torch.randn(4, 1024, 1000, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 1024))
    kept = sum(storages_kept_for_the_backward(lambda: masked_cross_entropy(logits, targets, None)))
    assert kept < 1.05 * logits.numel() * logits.element_size()
