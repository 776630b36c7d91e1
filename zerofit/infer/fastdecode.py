"""Greedy decoding of a model held whole on one GPU, at the memory bound: a static KV cache,
one compiled decode step (torch.compile's reduce-overhead mode: CUDA graphs), and no wait
for the GPU between tokens.

transformers' generate with a static cache compiles the same forward, but waits for the GPU
at every token (its stopping criteria) and prepares the next inputs in Python meanwhile, so
the GPU idles for part of each step. Here a step's inputs are fixed-shape tensors updated on
the GPU, and the host looks for the end of every sequence only every CHECK_EVERY tokens.
The tokens are generate's greedy tokens, one for one (tests/test_generate_stream.py).
"""
from __future__ import annotations

import inspect

import torch

CHECK_EVERY = 16  # tokens between two looks for "every sequence has ended" (the only host waits)

# generation_config fields that change greedy scores; a model that sets one decodes through generate
NEUTRAL = {"repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,),
           "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,),
           "forced_eos_token_id": (None,), "sequence_bias": (None,), "encoder_repetition_penalty": (None, 1.0),
           "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False),
           "max_length": None, "stop_strings": (None,), "guidance_scale": (None, 1.0)}


def unsupported(model) -> str | None:
    """Why this loop cannot stand in for generate on `model` (None: it can)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention {getattr(config, '_attn_implementation', None)!r}, not sdpa"
    generation = model.generation_config
    for name, neutral in NEUTRAL.items():
        if neutral is not None and getattr(generation, name, None) not in neutral:
            return f"its generation_config sets {name}"
    return None


def cache_argument(model) -> str:
    """The name forward takes the KV cache by (transformers renamed past_key_values to cache);
    a PeftModel passes it on to its base."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class GreedyDecoder:
    """A static cache and a compiled decode step for one (batch, cache length) shape; kept and
    reused so the captured CUDA graph finds its tensors where it left them."""

    def __init__(self, model, batch: int, cache_len: int, compile_step: bool):
        from transformers import StaticCache

        self.model, self.batch, self.cache_len = model, batch, cache_len
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self.cache_arg = cache_argument(model)
        self.step = torch.compile(self.forward, mode="reduce-overhead") if compile_step else self.forward
        self.compiled = compile_step

    def forward(self, tokens, positions, keys):
        """Logits (float32, as generate scores them) of the next token after `tokens` (batch, 1)."""
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=keys, use_cache=True,
                         logits_to_keep=1, **{self.cache_arg: self.cache})
        return out.logits[:, -1].float()

    def prefill(self, input_ids, attention_mask):
        """The prompt through the uncompiled forward, as generate's first step: positions count
        the real tokens (left padding takes position 1, as generate gives it)."""
        positions = attention_mask.long().cumsum(-1) - 1
        positions.masked_fill_(attention_mask == 0, 1)
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask, use_cache=True,
                         logits_to_keep=1, **{self.cache_arg: self.cache})
        return out.logits[:, -1].float()

    def run(self, input_ids, attention_mask, new_tokens: int, min_new_tokens: int, eos: list[int], pad: int,
            streamer=None):
        """(batch, prompt + new) token ids: the prompt, then greedy tokens, `pad` after a row's EOS."""
        batch, width = input_ids.shape
        device = input_ids.device
        self.cache.reset()
        eos_ids = torch.tensor(eos or [-1], device=device)
        keys = torch.zeros(batch, 1, 1, self.cache_len, dtype=torch.bool, device=device)
        keys[:, 0, 0, :width] = attention_mask.bool()
        positions = attention_mask.long().sum(-1, keepdim=True)  # where the first new token goes
        ended = torch.zeros(batch, dtype=torch.bool, device=device)
        out = torch.full((batch, new_tokens), pad, dtype=torch.long, device=device)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        scores = self.prefill(input_ids, attention_mask)
        shown = 0
        for k in range(new_tokens):
            if k < min_new_tokens and eos:  # as generate's MinNewTokensLengthLogitsProcessor
                scores = scores.index_fill(1, eos_ids, -float("inf"))
            token = torch.where(ended, pad, scores.argmax(-1))
            out[:, k] = token
            ended |= torch.isin(token, eos_ids)
            last = k == new_tokens - 1
            if (k + 1) % CHECK_EVERY == 0 or last:
                if streamer is not None:
                    streamer.put(out[0, shown:k + 1].cpu())
                    shown = k + 1
                if last or bool(ended.all()):
                    break
            keys[:, 0, 0, width + k] = True
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            scores = self.step(token[:, None], positions + k, keys)
        if streamer is not None:
            streamer.end()
        return torch.cat([input_ids, out[:, :k + 1]], dim=1)
