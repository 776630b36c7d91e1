"""`zerofit generate` / `zerofit chat`: run an exported model within a GPU budget.

Placement: the model's layers fill `--gpu-mem` (minus room for the KV cache, the layer
being streamed in and the kernels' workspace) through accelerate's infer_auto_device_map;
the rest stays in host RAM and accelerate's hooks copy each offloaded layer to the GPU
when it runs. The budget is enforced with torch.cuda.set_per_process_memory_fraction, so
"12GiB" on an 80 GiB card behaves like a 12 GiB card. Without a GPU everything runs on the CPU.

A LoRA adapter directory (`zerofit export --adapter-only`, or any peft directory whose
base is local) runs on its base: the base is loaded and placed the same way, checked
against the fingerprint its run recorded, and peft's PeftModel wraps it.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from zerofit.core import cgroup
from zerofit.core.console import counted, say, warn
from zerofit.core.errors import ConfigError
from zerofit.core.timeline import human_bytes, parse_bytes
from zerofit.lora.adapters import ADAPTER_CONFIG_FILE

RUNTIME_RESERVE = 512 << 20  # CUDA kernels' workspace, logits, sampling temporaries
DEFAULT_CONTEXT = 4096       # tokens the KV-cache reserve is sized for
TORCH_DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass
class Sampling:
    """Greedy unless temperature, top_p or top_k is set; temperature 0 is greedy whatever else is."""
    max_new_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_new_tokens: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or (self.temperature is None and self.top_p is None and self.top_k is None)

    def generate_kwargs(self) -> dict:
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": not self.greedy}
        if self.min_new_tokens:
            kwargs["min_new_tokens"] = self.min_new_tokens
        if not self.greedy:
            kwargs.update({k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                             ("top_k", self.top_k)) if v is not None})
        else:  # a generation_config.json with sampling defaults must not make greedy sample
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs


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


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    seconds: float
    ended_at_eos: bool = False      # the model ended the sequence (else max_new_tokens did)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


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


# ------------------------------------------------------------------------ generating
CACHE_BUCKET = 256  # static cache lengths are rounded up to this: one compiled graph serves many prompts


def run(loaded: Loaded, input_ids, sampling: Sampling, streamer=None, attention_mask=None) -> tuple[object, float]:
    """Generate after `input_ids` (left-padded where `attention_mask` says so); (output ids, seconds).
    A shape's first decode on a GPU compiles it: that warm-up is said and not timed."""
    import torch

    input_ids = input_ids.to(loaded.device)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(loaded.device)
    warm_up(loaded, input_ids, attention_mask, sampling)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    started = time.perf_counter()
    with torch.no_grad():
        output = decode(loaded, input_ids, attention_mask, sampling, streamer)
    if loaded.device.startswith("cuda"):
        torch.cuda.synchronize()
    return output, time.perf_counter() - started


def decode(loaded: Loaded, input_ids, attention_mask, sampling: Sampling, streamer=None):
    """Greedy decoding of a whole model: fastdecode's loop (a static cache, compiled on a GPU);
    sampling, streamed layers and models that loop cannot serve: transformers' generate."""
    from zerofit.infer import fastdecode

    pad = loaded.tokenizer.pad_token_id
    pad = loaded.tokenizer.eos_token_id if pad is None else pad
    length = input_ids.shape[1] + sampling.max_new_tokens
    model = loaded.model.get_base_model() if hasattr(loaded.model, "get_base_model") else loaded.model
    if loaded.static_cache and loaded.fast_decode and sampling.greedy and fastdecode.unsupported(model) is None:
        shape = (int(input_ids.shape[0]), cache_length(loaded, length))
        if shape not in loaded.decoders:
            loaded.decoders.clear()  # one cache at a time: the KV reserve holds one
            loaded.decoders[shape] = fastdecode.GreedyDecoder(loaded.model, *shape,
                                                              compile_step=loaded.device.startswith("cuda"))
        return loaded.decoders[shape].run(input_ids, attention_mask, sampling.max_new_tokens,
                                          sampling.min_new_tokens, sorted(eos_ids(loaded)), pad, streamer)
    kwargs = {**sampling.generate_kwargs(), "disable_compile": True}
    if loaded.static_cache:  # transformers compiles its decode step on a GPU
        kwargs.update(disable_compile=False, cache_implementation="static", max_cache_len=cache_length(loaded, length))
    return loaded.model.generate(input_ids=input_ids, attention_mask=attention_mask, pad_token_id=pad,
                                 streamer=streamer, **kwargs)


def cache_length(loaded: Loaded, length: int) -> int:
    """`length` rounded up to CACHE_BUCKET (at most the model's context): one compiled graph
    serves every prompt of a bucket."""
    limit = getattr(loaded.model.config, "max_position_embeddings", None) or length
    return min(max(limit, length), -(-length // CACHE_BUCKET) * CACHE_BUCKET)


def warm_up(loaded: Loaded, input_ids, attention_mask, sampling: Sampling) -> None:
    """On a GPU, the first decode of a shape compiles it: do that once per shape, said and
    timed, before the timed run. Where compiling zerofit's loop fails, say why in one line and
    try transformers' compiled generate; where that fails too, decode eagerly from then on."""
    import torch

    shape = (int(input_ids.shape[0]), cache_length(loaded, input_ids.shape[1] + sampling.max_new_tokens))
    if not (loaded.static_cache and loaded.device.startswith("cuda")) or shape in loaded.warmed:
        return
    say(f"compiling the decode step for batch {shape[0]}, cache {shape[1]} tokens (once per shape)...")
    started = time.perf_counter()
    short = Sampling(**{**sampling.__dict__, "max_new_tokens": 4, "min_new_tokens": 4})
    try:
        with torch.no_grad():
            for _ in range(2):  # the second run captures the CUDA graph
                decode(loaded, input_ids, attention_mask, short)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any compiler failure: eager still works
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        torch._dynamo.reset()
        loaded.decoders.clear()
        if loaded.fast_decode:
            warn(f"compiling the decode loop failed ({type(e).__name__}: {reason}); trying transformers' generate")
            loaded.fast_decode = False
            return warm_up(loaded, input_ids, attention_mask, sampling)
        warn(f"compiling the decode step failed ({type(e).__name__}: {reason}); decoding eagerly")
        loaded.static_cache = False
        return
    loaded.warmed.add(shape)
    loaded.placement.setdefault("warm_up_seconds", {})[f"{shape[0]}x{shape[1]}"] = round(
        time.perf_counter() - started, 1)
    say(f"compiled in {time.perf_counter() - started:.1f} s")


def generate(model: str | Path | Loaded, prompt: str, sampling: Sampling = Sampling(),
             gpu_mem: str | int | None = None, dtype: str = "auto", trust_remote_code: bool = False) -> Generation:
    """Complete `prompt` (as raw text: no chat template; BOS first, as training began every example)."""
    loaded = model if isinstance(model, Loaded) else load(model, gpu_mem, dtype, trust_remote_code=trust_remote_code)
    return generate_many(loaded, [prompt], sampling, batch_size=1)[0][0]


def prompt_ids(loaded: Loaded, prompt: str) -> list[int]:
    from zerofit.data.tokenize import text_ids

    ids = text_ids(loaded.tokenizer, prompt)
    if ids == text_ids(loaded.tokenizer, ""):  # nothing but the BOS (the check saw the BOS as text)
        raise ConfigError("--prompt is empty after tokenization; give some text")
    return ids


def generate_many(loaded: Loaded, prompts: list[str], sampling: Sampling = Sampling(),
                  batch_size: int = 8) -> tuple[list[Generation], float]:
    """Complete every prompt, `batch_size` at a time: prompts of similar length batched together
    (longest first), left-padded. ([Generation per prompt, in order], seconds of generating)."""
    import torch

    ids = [prompt_ids(loaded, p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    pad = loaded.tokenizer.pad_token_id
    pad = loaded.tokenizer.eos_token_id if pad is None else pad
    ends, results, total = eos_ids(loaded), [None] * len(ids), 0.0
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(ids[i]) for i in chunk)
        input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk])
        mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk])
        output, seconds = run(loaded, input_ids, sampling, attention_mask=mask)
        total += seconds
        for row, i in enumerate(chunk):
            new = output[row, width:].tolist()
            cut = next((k + 1 for k, t in enumerate(new) if t in ends and k + 1 >= sampling.min_new_tokens), len(new))
            new = new[:cut]
            results[i] = Generation(loaded.tokenizer.decode(new, skip_special_tokens=True), new, len(ids[i]), seconds,
                                    ended_at_eos=bool(new) and new[-1] in ends)
    return results, total


def eos_ids(loaded: Loaded) -> set[int]:
    """The token ids that end generation: the generation config's (one or a list), else the tokenizer's."""
    eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


# ------------------------------------------------------------------------------ chat
def chat_input_ids(tokenizer, history: list[dict], limit: int):
    """The conversation as model input: the tokenizer's chat template (a zerofit export's is
    the layout its data trained), else the layout messages rows train on without one
    (chatlayout.PLAIN_CHAT_TEMPLATE); the oldest turns go first when it outgrows `limit` tokens. A
    last message that alone outgrows it is refused: cut to fit, it lost the template's opening
    (the model saw the middle of a message, not a prompt)."""
    from zerofit.data.chatlayout import PLAIN_CHAT_TEMPLATE

    while True:
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True,
                                            chat_template=getattr(tokenizer, "chat_template", None)
                                            or PLAIN_CHAT_TEMPLATE)["input_ids"]
        if ids.shape[1] <= limit:
            return ids
        if len(history) <= 1:
            raise ConfigError(f"the message is {ids.shape[1]} tokens with its template, and the model takes {limit} "
                              f"(its context less --max-new-tokens): shorten it, or lower --max-new-tokens")
        del history[:2]


def chat(model: str | Path | Loaded, sampling: Sampling = Sampling(), gpu_mem: str | int | None = None,
         dtype: str = "auto", stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
         trust_remote_code: bool = False) -> list[dict]:
    """Read a line, stream the answer, keep the history; /exit or end of input quits,
    /reset forgets the conversation. Returns the history."""
    from transformers import TextIteratorStreamer

    loaded = model if isinstance(model, Loaded) else load(model, gpu_mem, dtype, trust_remote_code=trust_remote_code)
    limit = max(16, getattr(loaded.model.config, "max_position_embeddings", 4096) - sampling.max_new_tokens)
    interactive = stdin.isatty()
    say(f"chat: {describe(loaded)}; /exit or Ctrl-D quits, /reset clears the history")
    history: list[dict] = []
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            break
        text = line.strip()
        if text == "/reset":
            history.clear()
            say("(history cleared)")
            continue
        if not text:
            continue
        kept = history + [{"role": "user", "content": text}]
        try:
            input_ids = chat_input_ids(loaded.tokenizer, kept, limit)
        except ConfigError as e:  # the conversation so far is kept, without the message
            say(f"({e})")
            continue
        if len(kept) <= len(history):
            say(f"(the oldest {len(history) + 1 - len(kept)} turns were dropped: the conversation outgrew the "
                f"{limit} tokens the model takes)")
        history[:] = kept
        streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
        done: dict = {}

        def work():
            try:
                done["output"], done["seconds"] = run(loaded, input_ids, sampling, streamer)
            except BaseException as e:  # surfaced in the main thread
                done["error"] = e
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        pieces = []
        for piece in streamer:
            stdout.write(piece)
            stdout.flush()
            pieces.append(piece)
        thread.join()
        if "error" in done:
            raise done["error"]
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": "".join(pieces)})
        new_tokens = int(done["output"].shape[1] - input_ids.shape[1])
        say(f"[{counted(new_tokens, 'token')}, {new_tokens / done['seconds']:.1f} tokens/s]")
    return history


# ------------------------------------------------------------------- prompts files
def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; JSONL rows ({"prompt": ...}) where the file is JSON lines."""
    import json

    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts-file {path} holds no prompts")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--prompts-file {path} line {number} is not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f"--prompts-file {path} line {number} has no \"prompt\" string")
        prompts.append(row["prompt"])
    return prompts


def cmd_generate_prompts(args) -> int:
    """`zerofit generate --prompts-file F`: every prompt completed, in batches; a JSONL row per
    prompt, in the file's order (to --out or stdout); the aggregate tokens/s said."""
    import json

    prompts = read_prompts(args.prompts_file)
    loaded = load(args.model_dir, args.gpu_mem, args.dtype, trust_remote_code=args.trust_remote_code)
    say(f"generate: {len(prompts)} prompts, batch {args.batch_size}; {describe(loaded)}")
    results, seconds = generate_many(loaded, prompts, sampling_from(args), args.batch_size)
    rows = [json.dumps({"prompt": p, "completion": r.text, "prompt_tokens": r.prompt_tokens,
                        "new_tokens": r.new_tokens, "ended_at_eos": r.ended_at_eos}, ensure_ascii=False)
            for p, r in zip(prompts, results)]
    if args.out:
        Path(args.out).write_text("".join(row + "\n" for row in rows))
    else:
        print("\n".join(rows))
    tokens = sum(r.new_tokens for r in results)
    say(f"{counted(len(prompts), 'prompt')}, {counted(tokens, 'new token')} in {seconds:.2f} s: "
        f"{tokens / seconds if seconds else 0:.1f} tokens/s (batch {args.batch_size})"
        + (f" -> {args.out}" if args.out else ""))
    return 0


def sampling_from(args) -> Sampling:
    """The sampling the generate and chat flags ask for."""
    return Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, min_new_tokens=args.min_new_tokens, seed=args.seed)
