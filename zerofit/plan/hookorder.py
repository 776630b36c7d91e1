"""The order ZeRO-3's module hooks fire in over one training step.

DeepSpeed fetches a module's parameters, and prefetches the next ones, at every module's
forward pre-hook and at every module's pre-backward, parameterless modules included
(runtime/zero/parameter_offload.py: `_pre_forward_module_hook`; `_pre_backward_module_hook`
wraps each output tensor in an autograd function whose backward fetches, counted per module
by `applied_pre_backward_ref_cnt`). How many such calls fall between two fetches decides how
far the prefetch window runs ahead (zerotrace.gathered_timeline).

The order is the architecture's own: a Llama decoder layer registers self_attn before
input_layernorm and runs it after; its MLP runs act_fn between gate_proj and up_proj; the
rotary embedding runs before the first layer and has no backward. So it is taken from a run,
not from the module tree: a copy of the model with the same modules and layers, a few dozen
elements wide, forward and backward on the CPU with zerofit's checkpointing and loss, the same
wrapping as DeepSpeed's on every module. Checked call by call against DeepSpeed's own
coordinator on the CPU (tests/test_gathered_replay.py).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json

from zerofit import loss
from zerofit.lora.base import quiet_peft
from zerofit.models import enable_checkpointing, zero3_init_parked

# The narrowed copy: widths small enough for a forward and backward of any depth in milliseconds,
# shaped so attention's head arithmetic stays whole.
NARROW = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128,
          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_attention_heads": 4,
          "n_head": 4, "head_dim": 16, "vocab_size": 128}
TOKENS = 8

Event = tuple[str, str]  # ("forward" | "recompute" | "backward", module name)


def hook_events(hf_config, adapter=None) -> tuple[Event, ...] | None:
    """The hook calls of one checkpointed training step, in order: a forward pre-hook in the
    forward pass ("forward") or in a block's recompute during the backward ("recompute"), or a
    pre-backward ("backward"). None where the narrowed copy cannot be built or run (the
    planner then counts calls by the module tree). `adapter`: the peft LoraConfig lora.py
    attaches (its modules are hooked too)."""
    try:
        adapter_json = None if adapter is None else json.dumps(adapter.to_dict(), sort_keys=True, default=_plain)
        config_json = hf_config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - a config (remote code's) that does not serialise: the tree's count stands
        return None
    return _cached_events(config_json, adapter_json)


@functools.lru_cache(maxsize=32)
def _cached_events(config_json: str, adapter_json: str | None) -> tuple[Event, ...] | None:
    from transformers import AutoConfig

    try:
        narrowed = AutoConfig.for_model(**narrow(json.loads(config_json)))
        return tuple(_run(narrowed, adapter_json))
    except Exception:  # noqa: BLE001 - an architecture whose copy cannot be narrowed or run: the tree's count stands
        return None


def _plain(value):
    """LoraConfig.to_dict's values JSON has no type for: target_modules is a set."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def narrow(raw: dict) -> dict:
    """The config's widths cut down (NARROW), its depth, module kinds and expert counts kept."""
    out = copy.deepcopy(raw)
    grouped = out.get("num_key_value_heads") not in (None, out.get("num_attention_heads"))
    out.update({key: value for key, value in NARROW.items() if key in out})
    if "num_key_value_heads" in out:
        out["num_key_value_heads"] = 2 if grouped else out.get("num_attention_heads", 4)
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(out.get(token), int) and out[token] >= NARROW["vocab_size"]:
            out[token] = None
    out.pop("quantization_config", None)
    out.update(torch_dtype="float32", use_cache=False)
    return out


def _run(config, adapter_json: str | None) -> list[Event]:
    import torch
    from transformers import AutoModelForCausalLM


    # a real model on the CPU whatever the caller's default device, without a live ZeRO-3
    # engine's partitioned init (an OOM retry re-plans in the training process), and the run's
    # own random state untouched; on one thread: ops this small ran several times slower on
    # two, and many times slower where the cores are busy (intra-op threads waiting on each other)
    with torch.device("cpu"), zero3_init_parked(), torch.random.fork_rng(devices=[]), one_thread():
        torch.manual_seed(0)
        return _hooked_step(AutoModelForCausalLM.from_config(config), adapter_json, config.vocab_size)


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads set to one for the block, as they were after it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _hooked_step(model, adapter_json: str | None, vocab_size: int) -> list[Event]:
    import torch


    if adapter_json is not None:
        import peft


        with quiet_peft():
            model = peft.get_peft_model(model, peft.LoraConfig(**json.loads(adapter_json)),
                                        autocast_adapter_dtype=False)
    model = model.float().train()
    enable_checkpointing(model)
    events: list[Event] = []
    names = {id(module): name for name, module in model.named_modules()}
    for module in model.modules():
        _hook(module, names[id(module)], events)
    ids = torch.randint(0, vocab_size, (1, TOKENS))
    loss.causal_lm_loss(model(input_ids=ids).logits, ids).backward()
    return events


def _hook(module, name: str, events: list[Event]) -> None:
    """DeepSpeed's forward pre-hook and its pre-backward wrapping of every output tensor."""
    import torch

    hooked = _Hooked(name, events)
    pre_backward = _pre_backward_function()

    def before(mod, args):
        events.append(("recompute" if torch._C._current_graph_task_id() != -1 else "forward", name))

    def after(mod, args, output):
        return _apply_to_tensors(lambda tensor: pre_backward.apply(tensor, hooked), output)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


class _Hooked:
    """One module's name and its pending pre-backward count (applied_pre_backward_ref_cnt)."""

    def __init__(self, name: str, events: list[Event]):
        self.name, self.events, self.pending = name, events, 0


@functools.cache
def _pre_backward_function():
    """DeepSpeed's PreBackwardFunctionForModule, one class for every module (a class per module
    cost a second of a 7B plan)."""
    import torch

    class PreBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor, hooked):
            ctx.hooked = hooked
            hooked.pending += 1
            return tensor.detach()

        @staticmethod
        def backward(ctx, grad):
            hooked = ctx.hooked
            if hooked.pending > 0:
                hooked.events.append(("backward", hooked.name))
                hooked.pending -= 1
            return grad, None

    return PreBackward


def _apply_to_tensors(function, value):
    """deepspeed/runtime/zero/utils.py `apply_to_tensors_only`: tuples, lists, dicts (a
    ModelOutput in place) and tensors."""
    import torch

    if isinstance(value, (tuple, list)):
        touched = [_apply_to_tensors(function, item) for item in value]
        return value.__class__(*touched) if hasattr(value, "_fields") else value.__class__(touched)
    if isinstance(value, dict):
        for key in value.keys():
            value[key] = _apply_to_tensors(function, value[key])
        return value
    if isinstance(value, torch.Tensor):
        return function(value)
    return value
