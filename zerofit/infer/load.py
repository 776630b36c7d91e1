"""An exported model (or a LoRA adapter on its local base) loaded within a GPU budget.

Placement: the head, norms and as many decoder layers as fit go on the GPU, with room kept for
the KV cache, two layer-sized stream buffers and the kernels' workspace; the other layers stay
in pinned host memory and are streamed in ahead of their turn (streaming.py), or run on the CPU
where a decode step measured at load says that is faster. The budget is enforced with
torch.cuda.set_per_process_memory_fraction, so "12GiB" on an 80 GiB card behaves like a 12 GiB
card. Without a GPU everything runs on the CPU. A LoRA adapter directory runs on its base,
checked against the fingerprint its run recorded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zerofit.core import cgroup
from zerofit.core.console import counted, warn
from zerofit.core.errors import ConfigError
from zerofit.core.timeline import human_bytes, parse_bytes
from zerofit.lora.adapters import ADAPTER_CONFIG_FILE

RUNTIME_RESERVE = 512 << 20  # CUDA kernels' workspace, logits, sampling temporaries


DEFAULT_CONTEXT = 4096       # tokens the KV-cache reserve is sized for


TORCH_DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass
class Loaded:
    model: object
    tokenizer: object
    device: str                     # where inputs go
    dtype: str
    placement: dict = field(default_factory=dict)  # bytes on gpu / cpu, layers per device
    offload: object = None          # streaming.LayerStream or CpuLayers: the layers in host RAM
    static_cache: bool = False      # whole model on one device: a static KV cache (compiled on a GPU)
    warmed: set = field(default_factory=set)  # (batch, cache length) shapes decoded once already
    decoders: dict = field(default_factory=dict)  # (batch, cache length): fastdecode.GreedyDecoder
    fast_decode: bool = True        # greedy through fastdecode's loop (else transformers' generate)


# --------------------------------------------------------------------------- loading
def load(model_dir: str | Path, gpu_mem: str | int | None = None, dtype: str = "auto",
         context_tokens: int = DEFAULT_CONTEXT, trust_remote_code: bool = False) -> Loaded:
    """A model directory, or a peft adapter directory (load_adapter). A model's own Python code
    (auto_map) runs only with `trust_remote_code`, the person's --trust-remote-code: never
    because a file of the model, adapter or run says so."""
    from zerofit.lora.base import remote_code_asked

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir} is not a directory; give a model directory (`zerofit export` writes one) "
                          f"or an adapter directory (`zerofit export --adapter-only`)")
    with remote_code_asked(model_dir):
        if (model_dir / ADAPTER_CONFIG_FILE).is_file():
            return load_adapter(model_dir, gpu_mem, dtype, context_tokens, trust_remote_code)
        check_model_dir(model_dir)
        return load_model(model_dir, gpu_mem, dtype, context_tokens, trust_remote_code)


def check_model_dir(model_dir: Path) -> None:
    """Refuse a directory without config.json; a training run's directory names the export that makes one."""
    if (model_dir / "config.json").is_file():
        return
    if (model_dir / "checkpoints").is_dir() or (model_dir / "config.yaml").is_file():
        import shlex

        run = shlex.quote(str(model_dir))
        out = shlex.quote(str(model_dir.parent / f"{model_dir.name}-model"))
        raise ConfigError(f"{model_dir} is a training run directory, not a model: export it first "
                          f"(`zerofit export {run} --out {out}`), then run that directory")
    raise ConfigError(f"{model_dir} holds no config.json; give a model directory (`zerofit export` writes one) "
                      f"or an adapter directory (`zerofit export --adapter-only`)")


def load_model(model_dir: Path, gpu_mem, dtype: str, context_tokens: int, trust_remote_code: bool) -> Loaded:
    from transformers import AutoConfig

    from zerofit.lora.base import is_remote_code_refusal

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as e:  # no model_type, an architecture this transformers lacks, bad JSON
        if is_remote_code_refusal(e):
            raise
        raise ConfigError(f"{model_dir / 'config.json'} is not a model config transformers can read "
                          f"({str(e).splitlines()[0]}); give a model directory (`zerofit export` writes one)") from None
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    model, device, torch_dtype, placement = place(config, gpu_mem, dtype, context_tokens, model_dir=model_dir,
                                                  trust_remote_code=trust_remote_code)
    return finish(Loaded(model.eval(), tokenizer, device, str(torch_dtype), placement))


def finish(loaded: Loaded) -> Loaded:
    """Start streaming the layers in host RAM, or choose the static cache for a whole model."""
    loaded.offload = start_offload(loaded.model, loaded.placement, loaded.device)
    # a static cache pays where the decode step compiles: one device, all of it (an eager CPU gains nothing)
    loaded.static_cache = loaded.offload is None and loaded.device.startswith("cuda") and \
        not loaded.placement.get("host_embedding_bytes")
    return loaded


def load_adapter(adapter_dir: Path, gpu_mem: str | int | None = None, dtype: str = "auto",
                 context_tokens: int = DEFAULT_CONTEXT, trust_remote_code: bool = False) -> Loaded:
    """The base an adapter directory names (basemodel.adapter_base), checked against the
    fingerprint its LoRA run recorded, placed like a model directory, with peft's
    PeftModel.from_pretrained on top. A random-init base is rebuilt (reinit.py)."""
    from peft import PeftModel

    from zerofit.lora import base as basemodel

    base = basemodel.adapter_base(adapter_dir, trust_remote_code)
    has_tokenizer = any((adapter_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = load_tokenizer(adapter_dir if has_tokenizer or base.path is None else base.path, trust_remote_code)
    if base.path is not None:
        if base.recipe is not None:
            basemodel.verify_files(base.recipe, base.hf_config, base.adapter_config, base.path,
                                   trust_remote_code=trust_remote_code)
        model, device, torch_dtype, placement = place(base.hf_config, gpu_mem, dtype, context_tokens,
                                                      model_dir=base.path, trust_remote_code=trust_remote_code)
    else:
        from zerofit.lora import reinit

        recipe = base.recipe
        built, values = reinit.build_model(base.hf_config, recipe.torch_dtype, recipe.seed, recipe.init_device,
                                           trust_remote_code)
        basemodel.verify_values(recipe, base.hf_config, base.adapter_config, values, trust_remote_code)
        del values
        model, device, torch_dtype, placement = place(base.hf_config, gpu_mem, dtype, context_tokens, model=built,
                                                      trust_remote_code=trust_remote_code)
    with basemodel.quiet_peft():
        model = PeftModel.from_pretrained(model, adapter_dir, autocast_adapter_dtype=False)
    if (adapter_dir / "generation_config.json").is_file():  # the run's: its template's turn end among the ends
        from transformers import GenerationConfig

        ends = GenerationConfig.from_pretrained(adapter_dir).eos_token_id
        model.get_base_model().generation_config.eos_token_id = ends
    placement["adapter"] = str(adapter_dir)
    return finish(Loaded(model.eval(), tokenizer, device, str(torch_dtype), placement))


def load_tokenizer(directory: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    from zerofit.lora.base import is_remote_code_refusal

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if is_remote_code_refusal(e):
            raise
        raise ConfigError(f"{directory} has no usable tokenizer ({e}); copy the tokenizer files next to "
                          f"config.json") from None


def place(config, gpu_mem, dtype: str, context_tokens: int, model_dir: Path | None = None, model=None,
          trust_remote_code: bool = False):
    """(model, input device, dtype, placement) for the weights in `model_dir` or the model
    already in memory: on the CPU without a GPU; else whole on the GPU when it fits `gpu_mem`,
    or its first layers there and the rest in host RAM, streamed (start_offload, once any
    adapter is on)."""
    import torch

    on_gpu = torch.cuda.is_available()
    if gpu_mem is not None and not on_gpu:
        warn("no GPU visible: --gpu-mem ignored, running on the CPU")
    torch_dtype = resolve_dtype(dtype, config, on_gpu)
    if not on_gpu:
        model = model.to(torch_dtype) if model is not None else \
            read_weights(model_dir, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        return model, "cpu", torch_dtype, {"cpu_bytes": model_bytes(model)}
    total = torch.cuda.get_device_properties(0).total_memory
    budget = parse_bytes(gpu_mem, "--gpu-mem") if gpu_mem is not None else total
    if budget > total:
        raise ConfigError(f"--gpu-mem {human_bytes(budget)} is more than the GPU's {human_bytes(total)}")
    torch.cuda.set_per_process_memory_fraction(budget / total)  # the budget is the allocator's cap
    _, placement = plan_placement(config, torch_dtype, budget, context_tokens, trust_remote_code=trust_remote_code)
    streamed = placement.get("streamed_layer_names") or []
    if model is not None:
        model = model.to(torch_dtype)
    elif not streamed:
        model = read_weights(model_dir, dtype=torch_dtype, device_map={"": 0}, trust_remote_code=trust_remote_code)
    else:
        model = read_weights(model_dir, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    spread(model, placement, "cuda:0")
    return model, "cuda:0", torch_dtype, placement


def spread(model, placement: dict, device: str) -> None:
    """Everything to `device` but the layers the plan streams (still in host RAM) and, where
    the plan says so, the input embedding (looked up on the CPU: streaming.HostEmbedding)."""
    import torch

    from zerofit.infer import streaming  # imports torch

    kept = [model.get_submodule(name) for name in placement.get("streamed_layer_names") or []]
    if placement.get("host_embedding_bytes"):
        kept.append(model.get_input_embeddings())
    streaming.move_except(model, kept, torch.device(device))
    if placement.get("host_embedding_bytes"):
        model.set_input_embeddings(streaming.HostEmbedding(model.get_input_embeddings(), device))


def start_offload(model, placement: dict, device: str):
    """Stream the layers the plan left in host RAM (LayerStream), or run them on the CPU
    (CpuLayers) where a decode step measured faster that way (streaming.cpu_or_stream)."""
    from zerofit.infer import streaming  # imports torch

    names = placement.get("streamed_layer_names") or []
    if not names:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel's names start deeper
    layers = [base.get_submodule(name) for name in names]
    offload, seconds = streaming.cpu_or_stream(model, layers, device)
    placement["offload"] = {"mode": "cpu" if isinstance(offload, streaming.CpuLayers) else "stream",
                            "step_seconds": {mode: {str(b): round(t, 4) for b, t in by_batch.items()}
                                             for mode, by_batch in seconds.items()}}
    return offload


def read_weights(model_dir: Path, **options):
    """AutoModelForCausalLM from `model_dir`; a truncated or damaged weights file (a copy cut
    short, a full disk) is named with the fix, not safetensors' traceback."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, **options)
    except (SafetensorError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"the weights in {model_dir} cannot be read ({first}): a file is truncated or damaged; "
                          f"export the model again (`zerofit export RUN_DIR --out {model_dir} --overwrite`)") from None


def resolve_dtype(dtype: str, config, on_gpu: bool):
    """auto: the dtype the model was saved in on a GPU, fp32 on a CPU (fast everywhere)."""
    import torch

    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(TORCH_DTYPES)}")
    if dtype != "auto":
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if not on_gpu:
        return torch.float32
    saved = getattr(config, "dtype", None) or torch.bfloat16
    return getattr(torch, saved) if isinstance(saved, str) else saved


def plan_placement(config, torch_dtype, budget: int, context_tokens: int = DEFAULT_CONTEXT,
                   host_bytes: int | None = None, trust_remote_code: bool = False) -> tuple[dict, dict]:
    """Which decoder layers stay in host RAM for `budget` bytes of GPU 0, from a skeleton with no
    weights (meta tensors): everything but the layers (embeddings, head, norms) and room for
    the KV cache and the runtime go first, then the first layers that fit beside two buffers
    for the streamed ones; the rest are streamed. (device_map, placement summary)."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    from zerofit.infer import streaming

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    sizes = compute_module_sizes(skeleton, dtype=torch_dtype)
    reserve = kv_cache_bytes(config, torch_dtype, context_tokens) + RUNTIME_RESERVE
    if budget <= reserve:
        raise ConfigError(f"--gpu-mem {human_bytes(budget)} leaves no room for weights: the KV cache for "
                          f"{context_tokens} tokens and the runtime need {human_bytes(reserve)}")
    stack = streaming.decoder_layers_name(skeleton)
    layer_names = [f"{stack}.{i}" for i in range(len(skeleton.get_submodule(stack)))] if stack else []
    layer_bytes = [sizes[n] for n in layer_names]
    host_embedding = 0
    if sizes[""] > budget - reserve and streaming.embedding_on_host(skeleton):
        host_embedding = sum(t.numel() * torch_dtype.itemsize for t in skeleton.get_input_embeddings().parameters())
    plan = streaming.plan_stream(sizes[""] - host_embedding, layer_bytes, budget - reserve)
    if plan is None:
        raise ConfigError(f"--gpu-mem {human_bytes(budget)} is too small for this model: beside the KV cache and "
                          f"the runtime ({human_bytes(reserve)}), its head, norms and two layer buffers need "
                          f"{human_bytes(streaming.fixed_bytes(sizes[''] - host_embedding, layer_bytes))}")
    resident, slot_bytes = plan
    streamed = layer_names[resident:]
    streamed_bytes = sum(sizes[n] for n in streamed)
    host = host_bytes if host_bytes is not None else int(cgroup.host_memory().available * 0.9)
    if streamed_bytes > host:
        raise ConfigError(f"the {len(streamed)} layers beyond the GPU budget ({human_bytes(streamed_bytes)}) do not "
                          f"fit the host's {human_bytes(host)} of free RAM; raise --gpu-mem or free RAM")
    device_map = {"": 0, **{name: "cpu" for name in streamed}}
    layers = {"0": resident, "cpu": len(streamed)} if streamed else {"0": len(layer_names)}
    placement = {"gpu_budget_bytes": budget, "gpu_weight_bytes": sizes[""] - streamed_bytes - host_embedding,
                 "cpu_weight_bytes": streamed_bytes + host_embedding, "streamed_bytes": streamed_bytes,
                 "host_embedding_bytes": host_embedding, "reserve_bytes": reserve,
                 "stream_buffer_bytes": slot_bytes, "modules_per_device": layers, "layers": len(layer_names),
                 "streamed_layer_names": streamed}
    return device_map, placement


def kv_cache_bytes(config, torch_dtype, tokens: int) -> int:
    """Keys and values of every layer for `tokens` positions (batch 1)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * tokens * torch_dtype.itemsize


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def describe(loaded: Loaded) -> str:
    """The placement in one line: what is on the GPU, what stays in host RAM and how it runs."""
    p = loaded.placement
    adapter = f" + the LoRA adapter {p['adapter']}" if "adapter" in p else ""
    if "gpu_weight_bytes" not in p:
        return f"{human_bytes(p.get('cpu_bytes', 0))} of {loaded.dtype} weights on the CPU{adapter}"
    offload = p.get("offload") or {}
    if not p.get("streamed_bytes", p["cpu_weight_bytes"]):
        how = "0B offloaded to CPU"
    else:
        layers = f"{counted(p['modules_per_device']['cpu'], 'layer')} of {p['layers']}"
        how = (f"{human_bytes(p['streamed_bytes'])} offloaded to CPU ({layers} run on the CPU" if offload.get("mode") ==
               "cpu" else f"{human_bytes(p['streamed_bytes'])} offloaded to CPU ({layers} streamed from pinned RAM "
               f"through 2 GPU buffers of {human_bytes(p['stream_buffer_bytes'] // 2)}")
        steps = offload.get("step_seconds") or {}
        if steps:
            how += ": a decode step " + ", ".join(
                f"{mode} {' / '.join(f'{t * 1e3:.0f}' for t in by_batch.values())} ms" for mode, by_batch in
                steps.items()) + f" at batch {' / '.join(next(iter(steps.values())))}"
        how += ")"
    if p.get("host_embedding_bytes"):
        how += f", the input embedding ({human_bytes(p['host_embedding_bytes'])}) looked up in CPU RAM"
    return (f"{human_bytes(p['gpu_weight_bytes'])} of weights on the GPU, {how} "
            f"(budget {human_bytes(p['gpu_budget_bytes'])}, {loaded.dtype}){adapter}")
