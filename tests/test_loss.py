"""zerofit.loss against HF's ForCausalLMLoss: the same value and gradients, through a real
lm_head, in fp32 and bf16, over several chunks, with ignored labels."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from zerofit import loss


def _batch(dtype, vocab=96, hidden=24, batch=3, seq=17, seed=0):
    """Hidden states, an lm_head and labels with masked prompt tokens (-100)."""
    gen = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float32).to(dtype)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 0.3)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[:, :5] = loss.IGNORE_INDEX  # a prompt
    labels[1, 9:] = loss.IGNORE_INDEX  # padding
    return hidden_states, head, labels


def _loss_and_grads(fn, hidden_states, head, labels):
    hidden_states = hidden_states.clone().requires_grad_(True)
    head.zero_grad()
    value = fn(head(hidden_states), labels)
    value.backward()
    return value.detach(), hidden_states.grad.clone(), head.weight.grad.clone()


def _hf(logits, labels):
    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_bytes", [loss.CHUNK_BYTES, 4 * 96 * 7])  # one chunk; chunks of 7 rows (51 = 7 x 7 + 2)
def test_value_and_gradients_equal_hf(monkeypatch, dtype, tolerance, chunk_bytes):
    monkeypatch.setattr(loss, "CHUNK_BYTES", chunk_bytes)
    hidden_states, head, labels = _batch(dtype)
    expected = _loss_and_grads(_hf, hidden_states, head, labels)
    got = _loss_and_grads(loss.causal_lm_loss, hidden_states, head, labels)
    assert got[0].dtype == torch.float32
    assert abs(float(got[0]) - float(expected[0])) < 1e-5
    for name, g, e in zip(("hidden", "lm_head"), got[1:], expected[1:]):
        assert g.dtype == e.dtype
        scale = float(e.float().abs().max())
        assert float((g.float() - e.float()).abs().max()) <= tolerance * scale, name


def test_value_equals_the_definition():
    """Mean of -log softmax(logits_t)[label_{t+1}] over the unmasked next tokens, in float64."""
    hidden_states, head, labels = _batch(torch.float32)
    logits = head(hidden_states).detach()
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    terms = [-log_probs[b, t, labels[b, t + 1]] for b in range(labels.shape[0]) for t in range(labels.shape[1] - 1)
             if labels[b, t + 1] != loss.IGNORE_INDEX]
    assert math.isclose(float(loss.causal_lm_loss(logits, labels)), float(sum(terms) / len(terms)), rel_tol=1e-6)


def test_all_labels_ignored_is_nan_like_hf():
    hidden_states, head, labels = _batch(torch.float32)
    labels[:] = loss.IGNORE_INDEX
    logits = head(hidden_states)
    assert math.isnan(float(loss.causal_lm_loss(logits, labels).detach()))
    assert math.isnan(float(_hf(logits, labels).detach()))


def test_logits_another_node_saved_are_not_silently_overwritten():
    """A model whose other ops saved the logits for their own backward (here a product)
    gets autograd's error in backward instead of a gradient computed from overwritten
    logits."""
    hidden_states, head, labels = _batch(torch.float32)
    logits = head(hidden_states)
    kept = logits * logits  # mul saves the logits for its own backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss.causal_lm_loss(logits, labels) + kept.sum()).backward()


def test_working_memory_is_bounded_by_the_chunk():
    """fp32 working bytes do not grow with the tokens beyond 16 per token, where HF's loss
    holds 12 bytes per vocab entry per token."""
    vocab = 128_256
    rows = loss.chunk_rows(vocab)
    assert rows * 4 * vocab <= loss.CHUNK_BYTES < (rows + 1) * 4 * vocab
    small, large = loss.working_bytes(vocab, 1024), loss.working_bytes(vocab, 8192)
    assert large - small == 16 * (8192 - 1024)
    assert large < 8192 * 12 * vocab / 50
