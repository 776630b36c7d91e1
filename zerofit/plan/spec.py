"""Parameter counts and layer shapes of a Hugging Face causal LM, read on the meta device.

The model is instantiated with `torch.device("meta")` (no bytes allocated, no weights
read), so a 70B config takes a second. What the planner needs comes out of it:
- every parameter in registration order (ZeRO-3's sub groups and partitions are built in
  that order: deepspeed/runtime/zero/stage3.py `_create_fp16_sub_groups`);
- every module with its *direct* parameters, in forward order: ZeRO-3 gathers parameters
  per module (partitioned_param_coordinator.py `fetch_sub_module`, recurse=False), so the
  largest module is the gather peak, as in DeepSpeed's own `model_to_params`;
- the shapes the activation formulas use (hidden, layers, heads, KV heads, vocab, MLP width).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace

from zerofit.config.schema import Config, ModelConfig
from zerofit.models import config_from_name, hf_config, zero3_init_parked


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    ndim: int
    module: str          # owning module's name
    trainable: bool = True   # requires_grad (LoRA freezes the base)


@dataclass(frozen=True)
class ModuleSize:
    name: str
    numel: int           # direct parameters only (what ZeRO-3 fetches for this module)
    layer: int | None    # decoder block index, None outside the blocks
    params: tuple[str, ...] = ()   # names of those parameters (a tied lm_head names the embedding)
    # Modules without parameters just before it (containers, activations): ZeRO-3 hooks them
    # too, and each of their fetch calls prefetches (zerotrace.gathered_numel).
    hooked_before: int = 0


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    total_params: int            # unique parameters (tied weights counted once) == numel of the real model
    params: tuple[Param, ...]    # unique parameters in registration order
    modules: tuple[ModuleSize, ...]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool              # SwiGLU-style MLP (gate, up, down) vs a 2-matrix MLP
    tied_embeddings: bool
    embedding_params: int
    lm_head_params: int          # 0 when tied to the embedding
    layer_params: int            # one decoder block (the largest)
    adapter_inputs_per_layer: int = 0   # LoRA: sum of the adapted projections' input widths in one block
    adapter_rank_per_layer: int = 0     # LoRA: sum of their ranks
    adapter_dropout: bool = False       # LoRA dropout > 0: each adapter keeps its own dropped input
    experts: int = 0                    # a mixture of experts' routed experts per layer (0: a dense MLP)
    # ZeRO-3's hook calls of one checkpointed step in order (hookorder), None where not taken
    hook_events: tuple[tuple[str, str], ...] | None = None

    @property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def largest_module(self) -> ModuleSize:
        return max(self.modules, key=lambda m: m.numel)

    @property
    def largest_trained_matrix(self) -> Param | None:
        """The largest 2-D parameter that gets a gradient (ZenFlow's reduce bucket must hold it:
        engine.zenflow_refusal)."""
        return max((p for p in self.params if p.ndim == 2 and p.trainable), key=lambda p: p.numel, default=None)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def summary(self) -> dict:
        """The JSON a plan carries (the per-parameter list is left out)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("params", "modules", "hook_events")}
        out["trainable_params"] = self.trainable_params
        largest = self.largest_module
        out["largest_module"] = {"name": largest.name, "numel": largest.numel}
        out["modules"] = len(self.modules)
        return out


def from_model_config(model: ModelConfig) -> ModelSpec:
    return from_hf_config(hf_config(model), model.trust_remote_code)


def from_config(config: Config) -> ModelSpec:
    """The model a run trains: with lora.enabled, the peft model zerofit/lora/attach.py attaches
    (built on the meta device here too), whose base is frozen."""
    if not config.lora.enabled:
        return from_model_config(config.model)
    import peft  # an optional dependency: only with LoRA
    import torch

    from zerofit.lora import attach as lora  # peft and the checkpoint readers (torch): only with LoRA
    from zerofit.lora.base import quiet_peft

    hf = hf_config(config.model)
    targets = lora.resolve(config, hf)
    peft_config = lora.peft_config(config.lora, targets, lora.resolve_modules_to_save(config, hf))

    with torch.device("meta"), zero3_init_parked(), quiet_peft():
        model = peft.get_peft_model(meta_model(hf, config.model.trust_remote_code), peft_config,
                                    autocast_adapter_dtype=False)
    spec = from_module(model, hf, peft_config)
    adapters = [m for m in spec.modules if m.name.endswith("lora_A.default") and m.layer == 0]
    return replace(spec, adapter_inputs_per_layer=sum(m.numel for m in adapters) // config.lora.r,
                   adapter_rank_per_layer=config.lora.r * len(adapters), adapter_dropout=config.lora.dropout > 0)


def from_name(name: str, trust_remote_code: bool = False) -> ModelSpec:
    """A preset, a config.json, or a model directory (only its config.json is read)."""
    return from_hf_config(config_from_name(name, trust_remote_code), trust_remote_code)


def from_hf_config(hf_config, trust_remote_code: bool = False) -> ModelSpec:
    return from_module(meta_model(hf_config, trust_remote_code), hf_config)


def meta_model(hf_config, trust_remote_code: bool = False):
    """The model built on the meta device: a copy of one build per config (a plan reads the model
    and its LoRA alternative; a copy takes milliseconds where a build of an 8B takes most of a second)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = (type(hf_config), hf_config.to_json_string(), trust_remote_code)
    if key not in _META_BUILDS:
        with torch.device("meta"), zero3_init_parked():
            _META_BUILDS[key] = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
        while len(_META_BUILDS) > META_BUILDS_KEPT:
            _META_BUILDS.pop(next(iter(_META_BUILDS)))
    return copy.deepcopy(_META_BUILDS[key])


META_BUILDS_KEPT = 8
_META_BUILDS: dict = {}


def from_module(model, hf_config, adapter=None) -> ModelSpec:
    """The spec of an instantiated (meta or real) model; `adapter`: the peft LoraConfig it
    carries (for the order of its hooks)."""
    from zerofit.plan import hookorder  # it imports torch: `zerofit plan --presets` starts without it

    names: dict[int, str] = {}
    params: list[Param] = []
    modules: list[ModuleSize] = []
    blocks = _decoder_blocks(model, hf_config)
    without_params = 0
    for module_name, module in model.named_modules(remove_duplicate=False):
        direct = [(param_name, p) for param_name, p in module.named_parameters(recurse=False, remove_duplicate=False)]
        for param_name, p in direct:
            if id(p) not in names:
                names[id(p)] = f"{module_name}.{param_name}".lstrip(".")
                params.append(Param(names[id(p)], p.numel(), p.dim(), module_name, p.requires_grad))
        if direct:
            modules.append(ModuleSize(module_name, sum(p.numel() for _, p in direct),
                                      _layer_index(module_name, blocks), tuple(names[id(p)] for _, p in direct),
                                      hooked_before=without_params))
            without_params = 0
        else:
            without_params += 1

    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    hidden = _first(hf_config, "hidden_size", "n_embd", "d_model")
    heads = _first(hf_config, "num_attention_heads", "n_head")
    kv_heads = _first(hf_config, "num_key_value_heads", default=heads) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    intermediate = _first(hf_config, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden
    layer_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks[1]] if blocks else [0]
    return ModelSpec(
        model_type=hf_config.model_type,
        total_params=sum(p.numel for p in params),
        params=tuple(params),
        modules=tuple(modules),
        hidden_size=hidden,
        num_layers=_first(hf_config, "num_hidden_layers", "n_layer"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=hf_config.vocab_size,
        gated_mlp=_is_gated(model),
        tied_embeddings=tied,
        embedding_params=embed.weight.numel(),
        lm_head_params=0 if tied or head is None else sum(p.numel() for p in head.parameters()),
        layer_params=max(layer_sizes),
        experts=_first(hf_config, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0,
        hook_events=hookorder.hook_events(hf_config, adapter),
    )


def _first(config, *names, default: object = ...) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is ...:
        raise ValueError(f"{type(config).__name__} has none of {names}; zerofit cannot size this model")
    return default


def _decoder_blocks(model, hf_config):
    """(prefix, ModuleList) of the decoder blocks: the ModuleList with one entry per layer."""
    import torch

    layers = _first(hf_config, "num_hidden_layers", "n_layer", default=None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            return name, module
    return None


def _layer_index(module_name: str, blocks) -> int | None:
    if not blocks:
        return None
    prefix = blocks[0] + "."
    if not module_name.startswith(prefix):
        return None
    return int(module_name[len(prefix):].split(".")[0])


def _is_gated(model) -> bool:
    """SwiGLU MLPs (Llama, Mistral, Qwen2, Gemma) have a gate projection."""
    return any(name.endswith(("gate_proj", "w1", "gate_up_proj")) for name, _ in model.named_modules())
