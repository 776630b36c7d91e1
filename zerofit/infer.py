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
from zerofit.lora.adapters import ADAPTER_CONFIG_FILE
from zerofit.core.errors import ConfigError
from zerofit.core.timeline import human_bytes, parse_bytes
from zerofit.core.console import counted, say, warn
from zerofit.data.chatlayout import PLAIN_CHAT_TEMPLATE
from zerofit.data.tokenize import text_ids
from zerofit.lora import base as basemodel
from zerofit.lora import reinit
from zerofit.lora.base import is_remote_code_refusal
from zerofit.lora.base import remote_code_asked

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
    return Loaded(model.eval(), tokenizer, device, str(torch_dtype), placement)


def load_adapter(adapter_dir: Path, gpu_mem: str | int | None = None, dtype: str = "auto",
                 context_tokens: int = DEFAULT_CONTEXT, trust_remote_code: bool = False) -> Loaded:
    """The base an adapter directory names (basemodel.adapter_base), checked against the
    fingerprint its LoRA run recorded, placed like a model directory, with peft's
    PeftModel.from_pretrained on top. A random-init base is rebuilt (reinit.py)."""
    from peft import PeftModel


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
    return Loaded(model.eval(), tokenizer, device, str(torch_dtype), placement)


def load_tokenizer(directory: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer


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
    already in memory: on the CPU without a GPU, else filling `gpu_mem` and offloading the rest."""
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
    device_map, placement = plan_placement(config, torch_dtype, budget, context_tokens,
                                           trust_remote_code=trust_remote_code)
    if model is not None:
        from accelerate import dispatch_model

        model = dispatch_model(model.to(torch_dtype), device_map=device_map)
    else:
        model = read_weights(model_dir, dtype=torch_dtype, device_map=device_map, trust_remote_code=trust_remote_code)
    return model, "cuda:0", torch_dtype, placement


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
    """accelerate's device map of the model's layers for `budget` bytes of GPU 0, on a
    skeleton with no weights (meta tensors): (device_map, placement summary)."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    no_split = list(getattr(skeleton, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(skeleton, dtype=torch_dtype)
    # The room an offloaded layer needs while it runs on the GPU is kept free by
    # infer_auto_device_map itself (it subtracts the largest layer on the main device).
    reserve = kv_cache_bytes(config, torch_dtype, context_tokens) + RUNTIME_RESERVE
    if budget <= reserve:
        raise ConfigError(f"--gpu-mem {human_bytes(budget)} leaves no room for weights: the KV cache for "
                          f"{context_tokens} tokens and the runtime need {human_bytes(reserve)}")
    host = host_bytes if host_bytes is not None else int(cgroup.host_memory().available * 0.9)
    device_map = infer_auto_device_map(skeleton, max_memory={0: budget - reserve, "cpu": host},
                                       no_split_module_classes=no_split, dtype=torch_dtype)
    if "disk" in device_map.values():
        raise ConfigError(f"the model ({human_bytes(sizes[''])}) does not fit the GPU budget plus the host's "
                          f"{human_bytes(host)} of free RAM")
    on_gpu_bytes = sum(sizes[name] for name, device in device_map.items() if device != "cpu")
    layers = {str(d): sum(1 for v in device_map.values() if v == d) for d in set(device_map.values())}
    placement = {"gpu_budget_bytes": budget, "gpu_weight_bytes": on_gpu_bytes,
                 "cpu_weight_bytes": sizes[""] - on_gpu_bytes, "reserve_bytes": reserve, "modules_per_device": layers}
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
    p = loaded.placement
    adapter = f" + the LoRA adapter {p['adapter']}" if "adapter" in p else ""
    if "gpu_weight_bytes" not in p:
        return f"{human_bytes(p.get('cpu_bytes', 0))} of {loaded.dtype} weights on the CPU{adapter}"
    return (f"{human_bytes(p['gpu_weight_bytes'])} of weights on the GPU, {human_bytes(p['cpu_weight_bytes'])} "
            f"offloaded to CPU (budget {human_bytes(p['gpu_budget_bytes'])}, {loaded.dtype}){adapter}")


# ------------------------------------------------------------------------ generating
def run(loaded: Loaded, input_ids, sampling: Sampling, streamer=None) -> tuple[object, float]:
    """model.generate on `input_ids`; (output ids, seconds)."""
    import torch

    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    input_ids = input_ids.to(loaded.device)
    pad = loaded.tokenizer.pad_token_id
    pad = loaded.tokenizer.eos_token_id if pad is None else pad
    started = time.perf_counter()
    with torch.no_grad():
        output = loaded.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                       pad_token_id=pad, streamer=streamer, **sampling.generate_kwargs())
    if loaded.device.startswith("cuda"):
        torch.cuda.synchronize()
    return output, time.perf_counter() - started


def generate(model: str | Path | Loaded, prompt: str, sampling: Sampling = Sampling(),
             gpu_mem: str | int | None = None, dtype: str = "auto", trust_remote_code: bool = False) -> Generation:
    """Complete `prompt` (as raw text: no chat template; BOS first, as training began every example)."""
    import torch


    loaded = model if isinstance(model, Loaded) else load(model, gpu_mem, dtype, trust_remote_code=trust_remote_code)
    ids = text_ids(loaded.tokenizer, prompt)
    if ids == text_ids(loaded.tokenizer, ""):  # nothing but the BOS (the check saw the BOS as text)
        raise ConfigError("--prompt is empty after tokenization; give some text")
    input_ids = torch.tensor([ids])
    output, seconds = run(loaded, input_ids, sampling)
    new = output[0, input_ids.shape[1]:].tolist()
    return Generation(loaded.tokenizer.decode(new, skip_special_tokens=True), new, int(input_ids.shape[1]), seconds,
                      ended_at_eos=bool(new) and new[-1] in eos_ids(loaded))


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
