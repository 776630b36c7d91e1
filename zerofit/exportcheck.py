"""`zerofit export --verify`: prove an export right against an independent reconstruction.

The reference is DeepSpeed's own: deepspeed.utils.zero_to_fp32.
get_fp32_state_dict_from_zero_checkpoint, loaded into a model built from the same
config. The export is loaded with from_pretrained (every key must load: no missing,
unexpected or mismatched ones) and both run the same prompt in fp32:
  * against the reference with its weights rounded to the export dtype, the logits must
    agree to float32 noise (the same numbers went in);
  * against the unrounded fp32 reference, within that dtype's rounding tolerance.
This holds both models in RAM (2x the fp32 model): a check for models that fit, not
part of the capped export itself.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from zerofit.config import ConfigError
from zerofit.progress import say

PROMPT = "zerofit export check: the quick brown fox jumps over the lazy dog. 0123456789"
# max |logits diff| / max(1, max |logits|) allowed against the unrounded fp32 reference
ROUNDING_TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-5}
SAME_WEIGHTS_TOLERANCE = 1e-5


class VerifyError(ConfigError):
    """The export does not reproduce the checkpoint."""


def reference_state_dict(checkpoint_dir: Path) -> dict:
    """DeepSpeed's reconstruction (its progress output silenced)."""
    from zerofit.engine import select_accelerator

    select_accelerator()  # DeepSpeed picks its accelerator at import time
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir.parent), tag=checkpoint_dir.name)


def prompt_ids(model_dir: Path, vocab_size: int):
    import torch
    from transformers import AutoTokenizer

    try:
        ids = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)(PROMPT, return_tensors="pt").input_ids
    except (OSError, ValueError):
        ids = None
    if ids is None or ids.numel() < 4 or int(ids.max()) >= vocab_size:
        ids = torch.arange(1, 33).unsqueeze(0) % vocab_size
    return ids


def verify_export(out_dir: Path, checkpoint_dir: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out_dir, local_files_only=True)
    exported, info = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True, dtype=torch.float32,
                                                          output_loading_info=True)
    load_problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                                    "mismatched_keys") and v}
    stored_dtype = getattr(config, "dtype", None) or torch.float32
    stored_dtype = getattr(torch, stored_dtype) if isinstance(stored_dtype, str) else stored_dtype

    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(reference_state_dict(checkpoint_dir), strict=False)
    tied = {name for name, _ in reference.named_parameters(remove_duplicate=False)} - \
        {name for name, _ in reference.named_parameters()}
    if set(missing) - tied or unexpected:
        raise VerifyError(f"DeepSpeed's reconstruction does not fit the config: missing {sorted(set(missing) - tied)}, "
                          f"unexpected {sorted(unexpected)}")
    ids = prompt_ids(out_dir, config.vocab_size)
    exported.eval()
    reference.eval()
    with torch.no_grad():
        fp32_logits = reference(ids).logits
        for parameter in reference.parameters():
            parameter.data = parameter.data.to(stored_dtype).float()
        rounded_logits = reference(ids).logits
        logits = exported(ids).logits
    scale = max(1.0, float(fp32_logits.abs().max()))
    result = {"prompt_tokens": int(ids.numel()), "logit_scale": scale, "dtype": str(stored_dtype),
              "max_abs_diff": float((logits - rounded_logits).abs().max()),
              "max_abs_diff_fp32": float((logits - fp32_logits).abs().max()), "load_problems": load_problems}
    tolerance = ROUNDING_TOLERANCE.get(str(stored_dtype).removeprefix("torch."), 5e-2)
    result["ok"] = not load_problems and result["max_abs_diff"] <= SAME_WEIGHTS_TOLERANCE * scale \
        and result["max_abs_diff_fp32"] <= tolerance * scale
    line = (f"verify: logits over {result['prompt_tokens']} tokens vs DeepSpeed's reconstruction: max |diff| "
            f"{result['max_abs_diff']:.2e} (same rounding), {result['max_abs_diff_fp32']:.2e} vs fp32 "
            f"(scale {scale:.2f})")
    if not result["ok"]:
        raise VerifyError(f"{line}; load problems: {load_problems or 'none'}: the export does not reproduce "
                          f"the checkpoint")
    say(line + ": ok")
    return result
