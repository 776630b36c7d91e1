"""`zerofit export --verify`: prove an export right against an independent reconstruction.

The reference is DeepSpeed's own: deepspeed.utils.zero_to_fp32.
get_fp32_state_dict_from_zero_checkpoint (for a universal checkpoint, its fp32.pt files as
DeepSpeed's universal load reads them), loaded into a model built from the same
config; for a LoRA run it is what trained: peft's unmerged forward of the same base
(from_pretrained of its directory, or the replayed random init) with the checkpoint's fp32
adapters, and for the same-rounding comparison peft's merge_and_unload of it with tied
embeddings untied first (peft merges a tied weight's delta into both sides: `untie`), itself
checked against the unmerged forward. The
export is loaded with from_pretrained (every key must load: no missing, unexpected or
mismatched ones; an adapter directory as chat loads it) and both run the same prompt in fp32:
  * against the reference with its weights rounded to the export dtype, the logits must
    agree to float32 noise (the same numbers went in);
  * against the unrounded fp32 reference, within that dtype's rounding tolerance.
This holds both models in RAM (2x the fp32 model): a check for models that fit, not
part of the capped export itself.
"""
from __future__ import annotations

from pathlib import Path

from zerofit.checkpoint import universalfiles, zerofiles
from zerofit.checkpoint.files import load_torch_file, refuse_unsafe
from zerofit.core.console import say, warn
from zerofit.core.errors import ConfigError
from zerofit.infer.load import load_adapter
from zerofit.lora import adapters, reinit
from zerofit.lora import base as basemodel
from zerofit.lora.base import adapter_base, tied_aliases
from zerofit.machine.accelerator import deepspeed_quietly

PROMPT = "zerofit export check: the quick brown fox jumps over the lazy dog. 0123456789"
# max |logits diff| / max(1, max |logits|) against the unrounded fp32 reference before a warning
ROUNDING_TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-5}
SAME_WEIGHTS_TOLERANCE = 1e-5


class VerifyError(ConfigError):
    """The export does not reproduce the checkpoint."""


def reference_state_dict(checkpoint_dir: Path) -> tuple[dict, str]:
    """The independent reference's weights, and what they were built from as the verdict
    names it: DeepSpeed's reconstruction (its progress output silenced), or for a checkpoint
    DeepSpeed's zero_to_fp32 cannot read (NVMe swap files) the files through torch.load."""

    if universalfiles.is_universal(checkpoint_dir):
        return universal_state_dict(checkpoint_dir), "DeepSpeed's reconstruction"
    if (checkpoint_dir / zerofiles.NVME_COPIES).is_dir():
        return nvme_state_dict(checkpoint_dir), "the optim and NVMe swap files read through torch.load"
    with deepspeed_quietly():  # its accelerator chosen before the import; its progress not shown
        refuse_unsafe(sorted(checkpoint_dir.glob("*.pt")))  # zero_to_fp32 loads with weights_only=False
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir.parent), tag=checkpoint_dir.name)
    return weights, "DeepSpeed's reconstruction"


def universal_state_dict(directory: Path) -> dict:
    """What DeepSpeed's universal load reads (load_hp_checkpoint_state in
    runtime/zero/stage3.py): each zero/<name>/fp32.pt through torch.load, a tensor or
    {"param": tensor}, shaped by param_shapes; with the model states' (with_model_states)."""
    states = [load_torch_file(path) for path in zerofiles.model_files(directory)]
    weights = {}
    for name, shape in ((n, s) for group in states[0]["param_shapes"] for n, s in group.items()):
        loaded = load_torch_file(directory / universalfiles.ZERO_DIR / name / universalfiles.FP32_FILE)
        weights[name] = (loaded[universalfiles.PARAM] if isinstance(loaded, dict) else loaded).view(shape)
    return with_model_states(weights, states)


def nvme_state_dict(directory: Path) -> dict:
    """An NVMe-offloaded optimizer's checkpoint, which DeepSpeed's zero_to_fp32 cannot read (its
    swapped sub groups are empty tensors in the optim files): each rank's optim file through
    torch.load, the swapped groups read whole from the swap files zerofit recorded, the flat
    groups end to end, each parameter the ranks' ceil(N / W) partitions end to end, cut to N
    (zero_to_fp32's _zero3_merge_trainable_params); with the model states' (with_model_states).
    Independent of the export's streaming reader, not of the record of which file is which."""
    import torch

    model_paths, optim_paths, _ = zerofiles.rank_files(directory)
    states = [load_torch_file(path) for path in model_paths]
    flats = []
    for rank, path in enumerate(optim_paths):
        groups = load_torch_file(path)["optimizer_state_dict"]["fp32_flat_groups"]
        swapped = zerofiles.swapped_sub_groups(directory, rank)
        flats.append(torch.cat([torch.from_file(str(swapped[i][0]), size=swapped[i][1], dtype=torch.float32)
                                if i in swapped else group.float() for i, group in enumerate(groups)]))
    world, offset, weights = len(flats), 0, {}
    for name, shape in ((n, s) for group in states[0]["param_shapes"] for n, s in group.items()):
        partition = -(-shape.numel() // world)
        whole = torch.cat([flat[offset:offset + partition] for flat in flats])
        weights[name] = whole[:shape.numel()].view(shape).clone()
        offset += partition
    return with_model_states(weights, states)


def with_model_states(weights: dict, states: list[dict]) -> dict:
    """`weights` (the trainable parameters) completed from every rank's model states: the
    buffers, the frozen parameters' fragments (every rank's, end to end, cut to size) and
    the shared parameters."""
    import torch

    for name in states[0].get("buffer_names") or []:
        weights[name] = states[0]["module"][name]
    for name, shape in (states[0].get("frozen_param_shapes") or {}).items():
        flat = torch.cat([state["frozen_param_fragments"][name].flatten() for state in states])
        weights[name] = flat[:shape.numel()].view(shape)
    for alias, owner in (states[0].get("shared_params") or {}).items():
        weights[alias] = weights[owner]
    return weights


def prompt_ids(model_dir: Path, vocab_size: int, trust_remote_code: bool = False):
    import torch
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    except (OSError, ValueError):
        ids = None
    if ids is None or ids.numel() < 4 or int(ids.max()) >= vocab_size:
        ids = torch.arange(1, 33).unsqueeze(0) % vocab_size
    return ids


def verify_export(out_dir: Path, checkpoint_dir: Path, trust_remote_code: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    exported, load_problems, stored_dtype = load_export(out_dir, trust_remote_code)
    reference = AutoModelForCausalLM.from_config(exported.config, dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    weights, source = reference_state_dict(checkpoint_dir)
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    tied = {name for name, _ in reference.named_parameters(remove_duplicate=False)} - \
        {name for name, _ in reference.named_parameters()}
    if set(missing) - tied or unexpected:
        raise VerifyError(f"{source} does not fit the config: missing {sorted(set(missing) - tied)}, "
                          f"unexpected {sorted(unexpected)}")
    return compare(exported, reference, rounded_copy(reference, stored_dtype), stored_dtype,
                   prompt_ids(out_dir, exported.config.vocab_size, trust_remote_code), load_problems, source)


def verify_lora_export(out_dir: Path, checkpoint_dir: Path, config_dir: Path, base_dir=None,
                       trust_remote_code: bool = False) -> dict:
    """A merged LoRA export against what trained: peft's unmerged forward of the same base and
    the checkpoint's fp32 adapters (its merged weights, rounded as the export stores them, for
    the same-rounding comparison)."""
    exported, load_problems, stored_dtype = load_export(out_dir, trust_remote_code)
    ids = prompt_ids(out_dir, exported.config.vocab_size, trust_remote_code)
    trained = peft_unmerged(checkpoint_dir, config_dir, base_dir, trust_remote_code=trust_remote_code)
    merged = merged_reference(trained, ids)
    return compare(exported, trained, rounded_copy(merged, stored_dtype), stored_dtype, ids, load_problems,
                   "peft's unmerged base + adapter")


def verify_adapter_export(out_dir: Path, checkpoint_dir: Path, config_dir: Path,
                          trust_remote_code: bool = False) -> dict:
    """An adapter directory as chat runs it (base checked, PeftModel on top, unmerged) against
    peft's merge of the directory's own adapters (same weights) and of the checkpoint's fp32
    ones (tied embeddings untied first: `untie`)."""

    loaded = load_adapter(out_dir, dtype="fp32", trust_remote_code=trust_remote_code)
    stored_dtype = next(iter(load_export_tensors(out_dir).values())).dtype
    base_dir = adapter_base(out_dir, trust_remote_code).path
    same = peft_merged(checkpoint_dir, config_dir, base_dir, adapter_dir=out_dir, trust_remote_code=trust_remote_code)
    reference = peft_merged(checkpoint_dir, config_dir, base_dir, trust_remote_code=trust_remote_code)
    ids = prompt_ids(out_dir, loaded.model.config.vocab_size, trust_remote_code)
    return compare(loaded.model, reference, same, stored_dtype, ids,
                   {}, "peft's merge_and_unload (tied embeddings untied)")


# ----------------------------------------------------------------- references
def load_export(out_dir: Path, trust_remote_code: bool = False):
    """(the export loaded in fp32, from_pretrained's load problems, the dtype it was saved in)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    exported, info = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True, dtype=torch.float32,
                                                          output_loading_info=True,
                                                          trust_remote_code=trust_remote_code)
    load_problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                                    "mismatched_keys") and v}
    stored_dtype = getattr(config, "dtype", None) or torch.float32
    stored_dtype = getattr(torch, stored_dtype) if isinstance(stored_dtype, str) else stored_dtype
    return exported, load_problems, stored_dtype


def load_export_tensors(out_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for path in sorted(Path(out_dir).glob("*.safetensors")) for k, v in load_file(path).items()}


def peft_merged(checkpoint_dir: Path, config_dir: Path, base_dir=None, adapter_dir: Path | None = None,
                trust_remote_code: bool = False):
    """peft's merge_and_unload in fp32 of `peft_unmerged`, tied embeddings untied first."""
    return merge_untied(peft_unmerged(checkpoint_dir, config_dir, base_dir, adapter_dir, trust_remote_code))


def merged_reference(trained, ids):
    """`merge_untied` of a copy of `trained`, refused (VerifyError) unless its logits are the
    unmerged forward's to float32 noise: a reference that is not what trained would pass an
    export that shares its mistake (peft's plain merge_and_unload of a tied, adapted
    embedding: logits 27 off at a scale of 1.1, eval loss 19.27 against 4.82 trained)."""
    import copy

    import torch

    merged = merge_untied(copy.deepcopy(trained))
    with torch.no_grad():
        want, got = trained(ids).logits, merged(ids).logits
    scale = max(1.0, float(want.abs().max()))
    diff = float((got - want).abs().max())
    if diff > SAME_WEIGHTS_TOLERANCE * scale:
        raise VerifyError(f"verify: peft's merge of the base and adapter moves the logits by {diff:.2e} (scale "
                          f"{scale:.2f}) from its unmerged forward, what trained: no reference to check the "
                          f"export against; export with --adapter-only and load it with peft")
    return merged


def untie(peft_model) -> None:
    """Give each tied alias (lm_head.weight sharing model.embed_tokens.weight) its own copy of
    the weight and untie the config. peft adapts only the module it wraps, so in training the
    other side kept the base's weight; merge_and_unload adds the delta into the shared tensor
    (peft tuners/lora/layer.py: base_layer.weight.data += delta), which moves both sides."""
    import torch


    for alias, owner in tied_aliases(peft_model).items():
        module_name, _, attr = alias.rpartition(".")
        module = peft_model.get_submodule(module_name)
        setattr(module, attr, torch.nn.Parameter(peft_model.get_parameter(owner).detach().clone(),
                                                 requires_grad=False))
    config = peft_model.get_base_model().config
    for part in (config, config.get_text_config()):  # a multimodal config ties in its text part
        part.tie_word_embeddings = False


def merge_untied(peft_model):
    untie(peft_model)
    return peft_model.merge_and_unload().eval()


def peft_unmerged(checkpoint_dir: Path, config_dir: Path, base_dir=None, adapter_dir: Path | None = None,
                  trust_remote_code: bool = False):
    """PeftModel in fp32, unmerged (the forward training ran): the run's base (its files, or
    the replayed random init) with the checkpoint's fp32 adapters (or those of `adapter_dir`)."""
    import tempfile

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM


    recipe = basemodel.read_recipe(checkpoint_dir)
    path = base_dir or recipe.path
    if path:
        base = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                    trust_remote_code=trust_remote_code)
    else:
        hf_config = basemodel.hf_config_of(config_dir, trust_remote_code)
        base = reinit.build_model(hf_config, recipe.torch_dtype, recipe.seed, recipe.init_device,
                                  trust_remote_code)[0].float()
    with tempfile.TemporaryDirectory() as scratch:
        if adapter_dir is None:
            adapter_dir = adapters.write_peft_dir(checkpoint_dir, Path(scratch) / "adapter", "fp32")
        with basemodel.quiet_peft():
            return PeftModel.from_pretrained(base, adapter_dir, autocast_adapter_dtype=False).eval()


def rounded_copy(model, dtype):
    """`model` with every parameter rounded to `dtype` (and back to fp32): what an export
    of exactly these weights holds."""
    import copy

    rounded = copy.deepcopy(model)
    for parameter in rounded.parameters():
        parameter.data = parameter.data.to(dtype).float()
    return rounded


def compare(model, reference, same_weights, stored_dtype, ids, load_problems: dict, against: str) -> dict:
    """Logits of `model` vs `same_weights` (float32 noise allowed: a VerifyError beyond it, or
    with load problems) and vs the fp32 `reference` (beyond the export dtype's usual rounding:
    a warning that names --dtype fp32)."""
    import torch

    for m in (model, reference, same_weights):
        m.eval()
    with torch.no_grad():
        fp32_logits = reference(ids).logits
        rounded_logits = same_weights(ids).logits
        logits = model(ids).logits
    scale = max(1.0, float(fp32_logits.abs().max()))
    result = {"prompt_tokens": int(ids.numel()), "logit_scale": scale, "dtype": str(stored_dtype),
              "max_abs_diff": float((logits - rounded_logits).abs().max()),
              "max_abs_diff_fp32": float((logits - fp32_logits).abs().max()), "load_problems": load_problems}
    tolerance = ROUNDING_TOLERANCE.get(str(stored_dtype).removeprefix("torch."), 5e-2)
    # the export is judged against the checkpoint's weights rounded as it stores them; what that
    # rounding itself costs against fp32 is the dtype's, not the export's: said, not refused (a
    # 4-step demo run's logits, all under 1, moved 5.05e-2 in bf16 with the export exact)
    result["ok"] = not load_problems and result["max_abs_diff"] <= SAME_WEIGHTS_TOLERANCE * scale
    result["rounding_ok"] = result["max_abs_diff_fp32"] <= tolerance * scale
    line = (f"verify: logits over {result['prompt_tokens']} tokens vs {against}: max |diff| "
            f"{result['max_abs_diff']:.2e} (same rounding), {result['max_abs_diff_fp32']:.2e} vs fp32 "
            f"(scale {scale:.2f})")
    if not result["ok"]:
        raise VerifyError(f"{line}; load problems: {load_problems or 'none'}: the export does not reproduce "
                          f"the checkpoint")
    say(line + ": ok")
    if not result["rounding_ok"]:
        dtype = str(stored_dtype).removeprefix("torch.")
        warn(f"the export reproduces the checkpoint in {dtype}, but {dtype} rounding moves this model's logits by "
             f"{result['max_abs_diff_fp32']:.2e}, more than {tolerance:.0e} of their scale ({scale:.2f}): "
             f"--dtype fp32 keeps them as trained")
    return result
