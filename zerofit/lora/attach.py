"""LoRA on a ZeRO-3 model: which modules get adapters, attaching them with peft, and what
keeps a resume exact when checkpoints hold only the adapters.

How peft meets ZeRO-3 here (DeepSpeed 0.19.8, peft 0.21; tests/test_lora.py checks it):
- The base is built under zero.Init (engine.build_model): its weights are partitioned, and
  offloaded with offload_param, before peft sees them. peft reads in/out features from the
  Linear's attributes, not from its (empty) weight, so it wraps partitioned layers as is.
- Adapters are created after zero.Init has exited, as ordinary tensors on every rank, and
  initialised from the torch RNG (kaiming-uniform A, zero B). Creating them inside zero.Init
  would not work: peft initialises them after construction, i.e. into empty partitions
  (peft issue #803). deepspeed.initialize then makes every parameter that is not yet a ZeRO
  parameter one (DeepSpeedZeRoOffload._convert_to_zero_parameters): it broadcasts rank 0's
  values and partitions them, offloaded like the base. They are ordinary submodule
  parameters used in their own forward, so no external-parameter registration is needed.
- That conversion casts no dtype, so adapters must already be in the training dtype: peft's
  default autocast_adapter_dtype would leave fp32 adapters in a bf16 model. DeepSpeed's
  optimizer keeps their fp32 master copy, as for any ZeRO parameter.
- Only requires_grad parameters go to deepspeed.initialize (engine.param_groups), so the
  optimizer (CPU-Adam when offloaded) holds master weights and moments for adapters only.

Checkpoints (checkpointer.Checkpointer.save): DeepSpeed's save_checkpoint with
exclude_frozen_parameters=True, as HF Trainer does for peft models, drops the frozen base
from model_states (else every save writes its 16-bit partitions as frozen_param_fragments).
A resume therefore rebuilds the base from model.path / model.config + train.seed, and
loraresume.py refuses to continue if it differs from the one the adapters were trained on
(fingerprint and recipe: basemodel.py; `zerofit export` and chat check the same).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from zerofit.config.schema import LoraConfig
from zerofit.core.errors import ConfigError
from zerofit.core.timeline import human_count
from zerofit.lora.base import quiet_peft
from zerofit.models import zero3_init_parked

# Projection names per architecture (model_type of the HF config), after the modules the
# LoRA paper and peft's own defaults adapt: all attention and MLP projections.
_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"), _LLAMA_LIKE),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}
# Layer kinds peft's LoRA can wrap (peft/tuners/lora/model.py _create_new_module).
WRAPPABLE = ("Linear", "Embedding", "Conv1D", "Conv1d", "Conv2d", "Conv3d")


@dataclass(frozen=True)
class ModuleTable:
    """Every named module of a model (name -> class name) and the output head's name."""
    kinds: dict[str, str]
    output_name: str | None


# ------------------------------------------------------------------ which modules
def module_table(hf_config, trust_remote_code: bool = False) -> ModuleTable:
    """The model's modules, built on the meta device (no memory, about a second for 8B),
    so a bad target pattern fails before the real, partitioned build."""
    import torch
    from transformers import AutoModelForCausalLM


    with torch.device("meta"), zero3_init_parked():
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    output = model.get_output_embeddings()
    kinds = {name: type(module).__name__ for name, module in model.named_modules() if name}
    output_name = next((name for name, module in model.named_modules() if module is output), None)
    return ModuleTable(kinds, output_name)


def is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def matches(pattern: str, name: str) -> bool:
    """peft's rule for a plain name (the module's name is it or ends with `.it`); a glob
    (* ? [ ]) is matched against the full dotted name."""
    if is_glob(pattern):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def resolve_targets(lora: LoraConfig, table: ModuleTable, model_type: str) -> list[str]:
    """Full names of the modules that get adapters; a ConfigError naming what exists when a
    pattern matches nothing LoRA can wrap."""
    wrappable = [n for n, kind in table.kinds.items() if kind in WRAPPABLE]
    linears = [n for n in wrappable if table.kinds[n] in ("Linear", "Conv1D") and n != table.output_name]
    if lora.target_modules is None:
        default = DEFAULT_TARGETS.get(model_type, ())
        names = [n for n in wrappable if any(matches(p, n) for p in default)]
        if names:
            return names
        if not linears:
            raise ConfigError(f"this {model_type} model has no Linear layers for LoRA; set lora.target_modules "
                              f"(its modules: {_leaf_summary(table.kinds)})")
        return linears
    keywords = [p for p in lora.target_modules if p.lower() in ("all", "all-linear")]  # LLaMA-Factory's, peft's
    if keywords and len(lora.target_modules) == 1:
        return linears
    if keywords:  # (peft too takes "all-linear" only as the whole value)
        others = ", ".join(repr(p) for p in lora.target_modules if p not in keywords)
        raise ConfigError(f"lora.target_modules: {keywords[0]!r} (every Linear layer but the output head) must be "
                          f"the only entry, here with {others}; write [{keywords[0]}] alone, or name every module "
                          f"to adapt")
    names, problems = [], []
    for pattern in lora.target_modules:
        hits = [n for n in table.kinds if matches(pattern, n)]
        usable = [n for n in hits if n in wrappable]
        if not hits:
            problems.append(f"{pattern!r} matches no module")
        elif not usable:
            problems.append(f"{pattern!r} matches only {_leaf_summary({n: table.kinds[n] for n in hits})}, "
                            f"which LoRA cannot wrap (it wraps {', '.join(WRAPPABLE)})")
        names += [n for n in usable if n not in names]
    if problems:
        raise ConfigError(f"lora.target_modules: {'; '.join(problems)}. This {model_type} model's layers LoRA "
                          f"can wrap: {_leaf_summary({n: table.kinds[n] for n in wrappable})} "
                          f"(a plain name matches every module ending with it; globs match full names "
                          f"such as {wrappable[0] if wrappable else 'model.layers.0.mlp.up_proj'})")
    return [n for n in table.kinds if n in names]


def check_modules_to_save(lora: LoraConfig, table: ModuleTable) -> None:
    missing = [p for p in lora.modules_to_save if not any(matches(p, n) for n in table.kinds)]
    if missing:
        raise ConfigError(f"lora.modules_to_save: {', '.join(map(repr, missing))} matches no module; "
                          f"the model's modules: {_leaf_summary(table.kinds)}")


def expand_modules_to_save(patterns: list[str], module_names) -> list[str]:
    """What peft's modules_to_save gets: plain names as written, each glob replaced by the full
    names of the modules it matches, the outermost only (a module's children train with it).
    peft matches these names by their ending alone (peft/utils/other.py _set_trainable:
    key.endswith(target_key)), so a glob given to it matched nothing and nothing trained fully
    (`lm_*`: 1.02K trainable parameters, 9.22K with `lm_head`)."""
    names: list[str] = []
    for pattern in patterns:
        hits = [n for n in module_names if n and fnmatch.fnmatchcase(n, pattern)] if is_glob(pattern) else [pattern]
        names += [n for n in hits if n not in names and not any(n.startswith(h + ".") for h in hits)]
    return names


def resolve_modules_to_save(config, hf_config) -> list[str]:
    """peft's modules_to_save for a run's config (expand_modules_to_save over the model's modules)."""
    if not any(is_glob(p) for p in config.lora.modules_to_save):
        return list(config.lora.modules_to_save)
    return expand_modules_to_save(config.lora.modules_to_save,
                                  module_table(hf_config, config.model.trust_remote_code).kinds)


def _leaf_summary(kinds: dict[str, str], limit: int = 20) -> str:
    """`q_proj (Linear) x32, lm_head (Linear)`: distinct last name parts, counted."""
    counts: dict[tuple[str, str], int] = {}
    for name, kind in kinds.items():
        key = (name.rsplit(".", 1)[-1], kind)
        counts[key] = counts.get(key, 0) + 1
    items = [f"{leaf} ({kind})" + (f" x{n}" if n > 1 else "") for (leaf, kind), n in counts.items()
             if not leaf.isdigit()]
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def compact_names(targets: list[str], table: ModuleTable) -> list[str]:
    """What peft's adapter_config.json gets: the distinct last name parts (`q_proj`, ...)
    when those select exactly the same modules, else the full names."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in targets})
    wrappable = [n for n, kind in table.kinds.items() if kind in WRAPPABLE]
    same = {n for n in wrappable if any(matches(leaf, n) for leaf in leaves)} == set(targets)
    return leaves if same else list(targets)


def resolve(config, hf_config) -> list[str]:
    """peft's target_modules for a run's config; errors before any real build."""
    table = module_table(hf_config, config.model.trust_remote_code)
    targets = resolve_targets(config.lora, table, hf_config.model_type)
    check_modules_to_save(config.lora, table)
    return compact_names(targets, table)



def peft_config(lora: LoraConfig, target_modules: list[str], modules_to_save: list[str],
                base_path: str | None = None):
    """`target_modules` from `resolve`, `modules_to_save` from expand_modules_to_save."""
    try:
        import peft
    except ImportError:
        raise ConfigError("lora.enabled needs peft: pip install 'zerofit[lora]'") from None
    return peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias=lora.bias,
                           target_modules=target_modules, modules_to_save=modules_to_save or None,
                           task_type="CAUSAL_LM", base_model_name_or_path=base_path)


def attach(model, config, target_modules: list[str]):
    """Wrap `model` (built, maybe partitioned) with LoRA adapters; returns the PeftModel.

    The RNG is re-seeded first so the adapters' initial values depend on train.seed alone,
    not on how much randomness building the base consumed: a resume recreates them exactly
    (and DeepSpeed then loads the trained values over them)."""
    import peft
    import torch

    modules_to_save = expand_modules_to_save(config.lora.modules_to_save, [n for n, _ in model.named_modules()])
    lora_config = peft_config(config.lora, target_modules, modules_to_save, config.model.path)
    torch.manual_seed(config.train.seed)
    with quiet_peft():
        return peft.get_peft_model(model, lora_config, autocast_adapter_dtype=False)


def trainable_summary(model) -> str:
    """`LoRA on 224 modules: 21M trainable of 8.03B parameters (0.26%)`, counting the full
    sizes of partitioned parameters (ds_numel)."""
    adapted = sum(1 for _, module in model.named_modules() if hasattr(module, "lora_A"))
    trainable = total = 0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())
        total += numel
        trainable += numel if p.requires_grad else 0
    return (f"LoRA on {adapted} modules: {human_count(trainable)} trainable of {human_count(total)} parameters "
            f"({100 * trainable / total:.2f}%)")


def unadaptable_warning(model) -> str | None:
    """Name the weights that stay frozen because they sit outside any layer LoRA can wrap: an
    MoE model's experts under transformers 5 are one fused parameter per layer
    (`mlp.experts.gate_up_proj`, shape experts x out x in, in MixtralExperts), not Linear
    layers, so the default targets adapt attention alone and most of the model never trains.
    Norms and other 1-D weights are left out: LoRA never adapts them."""
    groups: dict[str, int] = {}
    total = 0
    for name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            numel = getattr(p, "ds_numel", p.numel())
            total += numel
            shape = getattr(p, "ds_shape", p.shape)
            if type(module).__name__ in WRAPPABLE or len(shape) < 2 or p.requires_grad:
                continue
            key = f"{name.rsplit('.', 1)[-1]}.{param_name}"
            groups[key] = groups.get(key, 0) + numel
    frozen = sum(groups.values())
    if not frozen:
        return None
    names = ", ".join(sorted(groups, key=groups.get, reverse=True))
    return (f"LoRA leaves {human_count(frozen)} of the {human_count(total)} parameters "
            f"({100 * frozen / total:.0f}%) frozen and without adapters: {names} are weights outside any "
            f"layer LoRA can wrap (it wraps {', '.join(WRAPPABLE)}; an MoE model's experts are fused "
            f"parameters under transformers 5). To train them, fine-tune fully (lora.enabled: false)")


def adapter_config(model) -> dict:
    """peft's adapter_config.json content for the model's adapter, as plain JSON values."""
    import json

    as_json = json.dumps(model.peft_config["default"].to_dict(),
                         default=lambda value: sorted(value) if isinstance(value, (set, frozenset)) else str(value))
    return json.loads(as_json)


# ------------------------------------------------------------------ exact resume
