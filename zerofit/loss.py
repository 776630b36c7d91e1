"""The causal-LM loss, computed without vocab-sized fp32 tensors.

HF's ForCausalLMLoss (transformers/loss/loss_utils.py) upcasts the whole 16-bit logits to
fp32 and cross_entropy keeps an fp32 log_softmax for backward, whose gradient is fp32 too:
about 5x the 16-bit logits at once. At a 128k vocabulary that is 12 bytes x 128k = 1.5 MB
per token, 12 GiB for 8 sequences of 1024 tokens, which is what keeps micro batches small
under a GPU cap, and every micro batch costs ZeRO-3 a round of gradient partition copies.

`causal_lm_loss` gives the same value and gradient (the same arithmetic: fp32 softmax,
mean over the tokens whose label is not -100, labels shifted by one) holding only the
16-bit logits plus a fixed fp32 working chunk (`CHUNK_BYTES`, twice in the forward's
logsumexp): the forward keeps one fp32 logsumexp per token; the backward writes the
gradient, converted to the logits' dtype as HF's `.float()` backward does, over the
logits themselves, which nothing else reads afterwards (lm_head's backward needs its
input and weight, not its output). Should another autograd node have saved the logits
(a model that post-processes them), autograd's version check raises at that node's
backward instead of computing with overwritten values: the overwrite cannot go unnoticed.
"""
from __future__ import annotations

import functools

IGNORE_INDEX = -100           # HF's label for tokens that are not trained on (prompt, padding)
CHUNK_BYTES = 64 << 20        # fp32 bytes of logits rows processed at once


def chunk_rows(vocab_size: int) -> int:
    """Rows (tokens) of the logits per fp32 working chunk."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def working_bytes(vocab_size: int, tokens: int) -> int:
    """fp32 bytes the loss allocates besides the logits: two chunks (the fp32 rows and
    logsumexp's exp temporary) and the per-token logsumexp, target logit and labels."""
    rows = min(tokens, chunk_rows(vocab_size))
    return 2 * 4 * rows * vocab_size + 4 * 4 * tokens


def shifted_labels(labels):
    """Token t predicts token t+1: the label of position t is labels[t+1], the last is ignored
    (HF pads the labels instead of slicing the logits, so the logits stay contiguous)."""
    import torch

    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits, labels):
    """Mean cross entropy of next-token prediction, fp32, as HF's loss with labels=labels."""
    vocab = logits.shape[-1]
    return _chunked_cross_entropy().apply(logits.reshape(-1, vocab), shifted_labels(labels).reshape(-1))


@functools.cache
def _chunked_cross_entropy():
    """The autograd Function, built on first use (the planner imports this module for its
    arithmetic and need not load torch)."""
    import torch

    class ChunkedCrossEntropy(torch.autograd.Function):
        forward = staticmethod(_forward)
        backward = staticmethod(_backward)

    return ChunkedCrossEntropy


def _forward(ctx, logits, targets):
    """Loss summed in fp32 chunk by chunk; keeps the logits and one logsumexp per token."""
    import torch

    rows = chunk_rows(logits.shape[1])
    valid = targets != IGNORE_INDEX
    safe_targets = targets.clamp(min=0).unsqueeze(1)
    logsumexp = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], rows):
        part = slice(start, start + rows)
        chunk = logits[part].float()
        logsumexp[part] = torch.logsumexp(chunk, dim=1)
        picked = chunk.gather(1, safe_targets[part]).squeeze(1)
        total += ((logsumexp[part] - picked) * valid[part]).sum()
    count = valid.sum()
    ctx.save_for_backward(logits, safe_targets, valid, logsumexp, count)
    return total / count  # nan when every label is ignored, as HF's mean


def _backward(ctx, grad_loss):
    """The gradient, chunk by chunk, written over the logits (see the module docstring)."""
    import torch

    logits, safe_targets, valid, logsumexp, count = ctx.saved_tensors
    rows = chunk_rows(logits.shape[1])
    # d loss / d logit = (softmax - onehot(target)) / count for the valid rows, else 0
    scale = (grad_loss.float() / count) * valid
    for start in range(0, logits.shape[0], rows):
        part = slice(start, start + rows)
        chunk = logits[part].float()
        chunk.sub_(logsumexp[part].unsqueeze(1)).exp_()
        chunk.scatter_add_(1, safe_targets[part], torch.full_like(logsumexp[part], -1.0).unsqueeze(1))
        chunk.mul_(scale[part].unsqueeze(1))
        logits[part].copy_(chunk)
    return logits, None
