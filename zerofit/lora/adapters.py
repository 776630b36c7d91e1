"""Adapter tensors of a LoRA run: which tensors are adapters, the names peft gives them, and
reading them out of a ZeRO checkpoint into a peft adapter directory.

The naming is pure string logic, so `zerofit export` (merge, `--adapter-only`) can use it
without torch. It mirrors peft 0.21's get_peft_model_state_dict for LoRA, which
tests/test_lora.py checks against peft itself:
- training parameter names are the PeftModel's: `base_model.model.<hf name>`;
- `X.lora_A.<adapter>.weight` is saved as `X.lora_A.weight` (lora_B, lora_embedding_A/B alike);
- `X.modules_to_save.<adapter>.Y` (a fully trained copy of module X) is saved as `X.Y`;
- trainable biases keep their names (`X.base_layer.bias` for a wrapped layer, `X.bias` else).
"""
from __future__ import annotations

import json
from pathlib import Path

from zerofit.checkpoint.zerofiles import LORA_LAYERS
from zerofit.machine.accelerator import deepspeed_quietly

ADAPTER = "default"                 # peft's adapter name; zerofit trains one adapter
PEFT_PREFIX = "base_model.model."   # PeftModel -> LoraModel -> the HF model
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG_KEY = "lora_adapter_config"  # in LoopState.extra, written by loraresume.check_and_record


def is_adapter(name: str, bias: str = "none", adapter: str = ADAPTER) -> bool:
    """True for a parameter a LoRA run trains and saves (peft's `bias` mode decides biases)."""
    parts = name.split(".")
    pairs = list(zip(parts, parts[1:]))
    if any(a in LORA_LAYERS and b == adapter for a, b in pairs) or ("modules_to_save", adapter) in pairs:
        return True
    if bias == "all":
        return name.endswith(".bias")
    if bias == "lora_only":
        return name.endswith(".base_layer.bias")
    return False


def peft_key(name: str, adapter: str = ADAPTER) -> str:
    """The key peft's adapter_model.safetensors uses for a training parameter name."""
    parts, out, i = name.split("."), [], 0
    while i < len(parts):
        part = parts[i]
        following = parts[i + 1] if i + 1 < len(parts) else None
        if part in LORA_LAYERS and following == adapter:
            out.append(part)
            i += 2
        elif part == "modules_to_save" and following == adapter:
            i += 2
        else:
            out.append(part)
            i += 1
    return ".".join(out)


def hf_target(key: str) -> tuple[str, str]:
    """(HF model parameter the adapter tensor acts on, role) for a peft key; role is
    lora_A / lora_B (merge: W += alpha/r * B @ A), lora_embedding_A / lora_embedding_B
    (W += alpha/r * (B @ A).T) or `replace` (a trained copy or a bias).
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ->
    (`model.layers.0.self_attn.q_proj.weight`, `lora_A`)."""
    name = key.removeprefix(PEFT_PREFIX)
    parts = name.split(".")
    for layer in LORA_LAYERS:
        if layer in parts:
            at = parts.index(layer)
            return ".".join(parts[:at] + ["weight"]), layer
    return name.replace(".base_layer.", "."), "replace"


def base_name(name: str) -> str:
    """The HF name of a frozen PeftModel parameter of the base:
    `base_model.model.X.base_layer.weight` (a wrapped layer) and `X.original_module.weight`
    (the frozen original of a modules_to_save module) -> `X.weight`."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(".original_module.", ".")


def scaling(r: int, alpha: float, rslora: bool = False) -> float:
    """The factor on B @ A (peft LoraLayer.update_layer: alpha / r; rsLoRA alpha / sqrt(r))."""
    return alpha / (r ** 0.5 if rslora else r)


# ------------------------------------------------------------- from a checkpoint
def read_adapter(checkpoint: Path, bias: str = "none") -> dict:
    """{peft key: fp32 tensor} of a zerofit LoRA checkpoint directory (`.../step-N`).

    The values are DeepSpeed's fp32 master weights, reassembled from every rank's optimizer
    partitions by its own zero_to_fp32 (trainable parameters only, so a few MB for LoRA)."""

    checkpoint = Path(checkpoint)
    with deepspeed_quietly():  # zero_to_fp32 prints progress on stdout and tqdm bars on stderr
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name,
                                                         exclude_frozen_parameters=True, lazy_mode=True)
    tensors = {peft_key(name): lazy.contiguous().detach() for name, lazy in state.items() if is_adapter(name, bias)}
    if not tensors:
        raise ValueError(f"{checkpoint} holds no LoRA adapter tensors (a full fine-tuning checkpoint?)")
    return tensors


def adapter_config(checkpoint: Path) -> dict:
    """peft's adapter config a LoRA checkpoint was trained with (its loop_state.json, written
    by loraresume.check_and_record at every save)."""
    loop_state = json.loads((Path(checkpoint) / "loop_state.json").read_text())
    config = loop_state.get("extra", {}).get(ADAPTER_CONFIG_KEY)
    if config is None:
        raise ValueError(f"{checkpoint} is not a LoRA checkpoint (its loop_state.json has no {ADAPTER_CONFIG_KEY})")
    return config


def write_peft_dir(checkpoint: Path, out: Path, dtype: str = "fp32") -> Path:
    """A peft adapter directory (adapter_config.json + adapter_model.safetensors) that
    `PeftModel.from_pretrained(base, out)` loads, from one LoRA checkpoint directory."""
    import torch
    from safetensors.torch import save_file

    config = {**adapter_config(checkpoint), "inference_mode": True}  # as PeftModel.save_pretrained writes it
    cast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tensors = {k: v.to(cast).contiguous() for k, v in read_adapter(checkpoint, config.get("bias", "none")).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out
