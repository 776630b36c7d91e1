"""Where a model and its tokenizer come from: a local HF directory, a config.json, or a
built-in preset. Never the network: every load passes local_files_only."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from zerofit.config.data import DataConfig
from zerofit.config.schema import ModelConfig
from zerofit.config.section import read_from
from zerofit.core.errors import ConfigError
from zerofit.demo import build_tokenizer

# Llama-architecture shapes. The 1.5B and 3.6B presets are Llama-3.2-1B/3B with untied
# embeddings (1.50e9 and 3.61e9 parameters): the sizes the GPU benchmarks use.
_LLAMA3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000,
               eos_token_id=128001)
PRESETS: dict[str, dict] = {
    # The embedded demo: learns the synthetic tasks in a couple of minutes on 2 CPU cores.
    "demo": dict(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=384,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0),
    # What the tests build: LlamaConfig(num_hidden_layers=2, hidden_size=64).
    "tiny": dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0),
    # The smallest model DeepSpeed really swaps to NVMe (tests of NVMe offload): its 2-D
    # weights form one optimizer sub group of 1.3M elements, over the swapper's 1 MiB minimum.
    "mini": dict(model_type="llama", vocab_size=4096, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0),
    "llama-0.5b": dict(_LLAMA3, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=8),
    "llama-1.5b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3.6b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                       num_attention_heads=24, num_key_value_heads=8),
    "llama-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8),
    # TinyLlama-1.1B's shape: a 32K vocabulary, so lm_head's gradient (65.5M elements) shares
    # the reduce bucket with block gradients (the planner's lm_head_reduce moment inside a block).
    "tinyllama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
                           eos_token_id=2),
    "llama-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                      num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                      max_position_embeddings=4096, tie_word_embeddings=False),
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32768, tie_word_embeddings=True),
}


def preset_params(name: str) -> int:
    """A preset's parameter count from its shape (Llama blocks; Qwen2's with q/k/v biases), so
    that `zerofit plan --presets` builds no model (tests/test_zerostates.py checks every preset
    against the count of its built model)."""
    fields = PRESETS[name]
    hidden, layers, vocab = fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"]
    head_dim = hidden // fields["num_attention_heads"]
    q_dim, kv_dim = fields["num_attention_heads"] * head_dim, fields["num_key_value_heads"] * head_dim
    attention = hidden * (2 * q_dim + 2 * kv_dim) + (q_dim + 2 * kv_dim) * (fields["model_type"] == "qwen2")
    block = attention + 3 * hidden * fields["intermediate_size"] + 2 * hidden  # gate, up, down; two norms
    return vocab * hidden * (1 + (not fields["tie_word_embeddings"])) + layers * block + hidden  # + the final norm


def hf_config(model: ModelConfig):
    """The transformers PretrainedConfig a model section describes (no weights touched)."""
    if model.path:
        return _auto_config(hf_config_file(model).parent, model.trust_remote_code)
    return config_from_name(model.config, model.trust_remote_code)


def _auto_config(source: Path, trust_remote_code: bool):
    """AutoConfig of a model directory or a config file; one transformers refuses named."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 (transformers raises ValueError, KeyError, OSError or its validators' own)
        file, said = source / "config.json" if source.is_dir() else source, str(e).strip().splitlines()[-1]
        raise ConfigError(f"transformers refuses {file}: {said.strip().rstrip('.')}; fix the file") from None


def check_weights(model: ModelConfig) -> None:
    """Refuse, before the run's files are touched, a model.path whose weights transformers
    could not load: none there, or a safetensors file damaged or cut short (each failed inside
    the build with a traceback, after a --no-resume had moved the checkpoints aside). Only the
    files' headers are read."""
    if not model.path:
        return
    from zerofit.checkpoint import zerofiles  # it imports torch: `zerofit plan --presets` starts without it

    directory = Path(model.path)
    if not any(directory.glob("*.safetensors")) and not (directory / zerofiles.SAFETENSORS_INDEX).is_file():
        if any(directory.glob("pytorch_model*.bin")):
            return  # torch.load's files: nothing to read ahead of it
        raise ConfigError(f"model.path={model.path!r} holds no weights (*.safetensors or pytorch_model.bin); "
                          f"copy the model's weight files there, or set model.config: {model.path} to train from a "
                          f"random init of its config")
    try:
        zerofiles.safetensors_tensors(directory)
    except zerofiles.ZeroCheckpointError as e:
        raise ConfigError(f"model.path: {e}; copy the model's files again") from None


def check_attention(model: ModelConfig, hf_config) -> None:
    """Refuse, before anything is built, an attention kernel the architecture's transformers
    class does not support (Gemma-2 has no SDPA path: the build failed after planning with a
    traceback)."""
    if model.attn_implementation != "sdpa":
        return
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    if cls is not None and not getattr(cls, "_supports_sdpa", True):
        raise ConfigError(f"{cls.__name__} has no SDPA attention in this transformers: set "
                          f"model.attn_implementation: eager (which also keeps each layer's attention weights, "
                          f"sequence x sequence per head, for the backward: the planner counts them)")


def positions_beyond_trained(model: ModelConfig, seq_len: int, hf_config) -> str | None:
    """A warning when a pretrained model's rows are longer than the positions it was made for
    (max_position_embeddings): transformers builds RoPE for any length without a word, and a
    model trained past that range without rope_scaling in its config.json learns from
    positions it never saw, which LLaMA-Factory leaves to the user too (its rope_scaling key).
    A model built from a config (random init) has seen no position yet: nothing to say."""
    if not model.path:
        return None
    limit = getattr(hf_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or seq_len <= limit:
        return None
    scaling = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        return None  # a scaled RoPE reaches past it by design
    return (f"train.seq_len {seq_len} is above the model's max_position_embeddings {limit}: positions past {limit} "
            f"are ones the model never trained on; lower train.seq_len to {limit}, or give the model's config.json "
            f"a rope_scaling for the longer context")


# Architectures with a learned table of absolute positions (max_position_embeddings rows, n_positions for
# GPT-2): a position past it has no row, and the first forward fails with an index error. RoPE and ALiBi
# models compute positions for any length (positions_beyond_trained warns of those never trained on).
LEARNED_POSITIONS = ("gpt2", "gpt_neo", "gpt_bigcode", "opt", "biogpt")


def check_position_table(seq_len: int, hf_config) -> None:
    """Refuse rows longer than a learned position table, before any row is read."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if getattr(hf_config, "model_type", None) not in LEARNED_POSITIONS or not isinstance(limit, int) \
            or seq_len <= limit:
        return
    raise ConfigError(f"train.seq_len {seq_len:,} is past the {limit:,} positions of {hf_config.model_type}'s "
                      f"learned position table (max_position_embeddings): its rows hold no position beyond it. "
                      f"Lower train.seq_len to {limit} or less")


def check_neat_packing(data: DataConfig, hf_config) -> None:
    """Refuse data.neat_packing for an architecture whose transformers class does not build its
    attention mask with transformers' masking_utils, which reads restarting position ids as
    separate sequences (find_packed_sequence_indices): 155 of the 172 causal-LM modules of
    transformers 5.24 import create_causal_mask; the 17 that do not (Mamba, RWKV, XLNet...)
    and remote code, which cannot be told, would attend across the examples unmasked."""
    if not (data.packing and data.neat_packing):
        return
    import sys

    import transformers
    from transformers import AutoModelForCausalLM

    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        raise ConfigError(f"data.neat_packing needs a transformers that masks packed sequences by their position "
                          f"ids (masking_utils.find_packed_sequence_indices); transformers {transformers.__version__} "
                          f"has none: upgrade it, or drop data.neat_packing") from None

    cls = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    if cls is None or not hasattr(sys.modules[cls.__module__], "create_causal_mask"):
        name = cls.__name__ if cls is not None else f"{type(hf_config).__name__}'s model (remote code)"
        raise ConfigError(f"data.neat_packing: {name} does not build its attention mask from position ids "
                          f"(transformers' masking_utils), so packed examples would attend to each other; drop "
                          f"data.neat_packing, or set data.packing: false (one example per row)")


# The HF config fields a checkpoint's tensors take their shapes from.
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


# HF config keys that do not change what the weights compute: bookkeeping, the generation ids,
# initialisation, dropout, what the forward returns, the cache, the attention kernel (a config
# setting of its own) and the maximum length (rope reads it only under a scaling that says so
# in rope_scaling / rope_parameters, compared).
NOT_ARCHITECTURE = {"transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict",
                    "dtype", "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
                    "problem_type", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "initializer_range",
                    "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop", "tokenizer_class",
                    "max_position_embeddings", "task_specific_params", "auto_map", "quantization_config"}


def shape_of(hf_config) -> dict:
    """The architecture a checkpoint's tensors are of and the function they compute: SHAPE_FIELDS,
    and the config's other keys but NOT_ARCHITECTURE (an activation, rope_theta or norm epsilon
    edited in the model's config.json resumed the run under another function, and rewrote the
    model/config.json exports of its earlier checkpoints read)."""
    fields = {name: getattr(hf_config, name, None) for name in SHAPE_FIELDS}
    fields.update({key: value for key, value in hf_config.to_dict().items()
                   if key not in NOT_ARCHITECTURE and key not in fields and not key.startswith("_")})
    return fields


def config_from_name(name: str, trust_remote_code: bool = False):
    """A config.json, a directory holding one, or a preset name. A directory that holds a
    config.json wins over a preset of the same name (a user's `llama-8b/` folder is theirs)."""
    from transformers import CONFIG_MAPPING

    path = named_config_file(name)
    if path is None:
        fields = dict(PRESETS[name])
        return CONFIG_MAPPING[fields.pop("model_type")](**fields)
    return _auto_config(path.parent if path.name == "config.json" else path, trust_remote_code)


def named_config_file(name: str) -> Path | None:
    """The config.json model.config names, checked to be one (None: a preset); no transformers."""
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if name in PRESETS and not path.is_file():
        return None
    if not path.is_file():
        raise ConfigError(f"model.config={name!r} is neither a preset ({', '.join(PRESETS)}) "
                          f"nor an existing config.json or directory{read_from(name)}")
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix the file or pick a preset") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(f"{path} has no model_type; it is not a transformers config.json")
    return path


def model_file_problems(model: ModelConfig) -> list[str]:
    """What of the model section's files is not there, each said with its fix: model.path a
    directory with a config.json, the config.json or preset of model.config, the tokenizer
    directory, the chat template. Only files are looked at (no transformers import), so a typo
    is said in a second, not after the process group, the op build and the model."""
    checks = [(hf_config_file, model) if model.path else (named_config_file, model.config)]
    checks += [(_existing_dir, model.tokenizer, "model.tokenizer")] if model.tokenizer else []
    checks += [(read_chat_template, model.chat_template)] if model.chat_template else []
    return [problem for check, *args in checks if (problem := problem_of(check, *args))]


def problem_of(check, *args) -> str | None:
    """The ConfigError `check(*args)` raises, as text; None where it raises none."""
    try:
        check(*args)
    except ConfigError as e:
        return str(e)
    return None


def hf_config_file(model: ModelConfig) -> Path:
    """model.path's config.json, refused where the directory or the file is not there."""
    directory = Path(_existing_dir(model.path, "model.path"))
    if not (directory / "config.json").is_file():
        raise ConfigError(f"model.path={model.path!r} holds no config.json: it is not a transformers model "
                          f"directory; point it at what save_pretrained wrote (or set model.config to train "
                          f"from a random init)")
    return directory / "config.json"


def generation_eos(model: ModelConfig) -> set[int]:
    """The end tokens model.path's generation_config.json lists (one id or a list); none without one."""
    path = Path(model.path) / "generation_config.json" if model.path else None
    if path is None or not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    return set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])


def load_tokenizer(model: ModelConfig, synthetic_data: bool = False):
    """The model's tokenizer; the demo's character tokenizer for presets without one, and for
    any model trained on `synthetic_data` (random ids from the model's vocabulary: no text)."""
    from transformers import AutoTokenizer

    source = model.tokenizer or model.path
    if source:
        try:
            directory = _existing_dir(source, "model.tokenizer" if model.tokenizer else "model.path")
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True,
                                                      trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load a tokenizer from {source}: {e}; point model.tokenizer "
                              f"at a directory with tokenizer.json or tokenizer_config.json") from None
    elif model.config in PRESETS or synthetic_data:

        tokenizer = build_tokenizer()
    else:
        raise ConfigError(f"model.config={model.config} comes without a tokenizer; set model.tokenizer "
                          f"to a local tokenizer directory")
    return with_chat_template(tokenizer, model.chat_template)


def with_chat_template(tokenizer, path: str | None):
    """The tokenizer, rendering with model.chat_template's text where one is given, tried on a
    user and an assistant turn first (probe_chat_template)."""
    if path is None:
        return tokenizer
    tokenizer.chat_template = read_chat_template(path)
    probe_chat_template(tokenizer, path)
    return tokenizer


# LLaMA-Factory's templates for the models most often fine-tuned from a base checkpoint, as Jinja
# files (their layouts: register_template's slots in LLaMA-Factory's src/llamafactory/data/template.py)
BUNDLED_TEMPLATES = Path(__file__).parent / "chat_templates"
# Each renders tool calls, tool answers and the tools offered as LLaMA-Factory 0.9.5 does (data/tool_utils.py):
# llama3, mistral, qwen and qwen3_nothink in their own tool formats, the other eight in its `default` one.


def bundled_chat_templates() -> list[str]:
    """The names model.chat_template takes for a bundled template."""
    return sorted(file.stem for file in BUNDLED_TEMPLATES.glob("*.jinja"))


def read_chat_template(path: str) -> str:
    """model.chat_template's Jinja text: a .jinja file, a chat_template.json as transformers
    saves one ({"chat_template": "..."}), or a bundled template's name (a file of that name wins)."""
    file = Path(path)
    if not file.is_file() and path in bundled_chat_templates():
        file = BUNDLED_TEMPLATES / f"{path}.jinja"
    if not file.is_file():
        raise ConfigError(f"model.chat_template={path!r} is neither a file{read_from(path)} nor a bundled "
                          f"template's name; give a "
                          f"Jinja template file (.jinja), such as a model directory's chat_template.jinja, or one of "
                          f"{', '.join(bundled_chat_templates())} (LLaMA-Factory's templates of those names)")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"model.chat_template {path} is not UTF-8 text; save it as UTF-8") from None
    if file.suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            text = None
        if not isinstance(text, str):
            raise ConfigError(f"model.chat_template {path}: a .json template holds {{\"chat_template\": \"...\"}} "
                              f"(transformers' chat_template.json); give that, or the .jinja file")
    if not text.strip():
        raise ConfigError(f"model.chat_template {path} is empty; give the template's text (unset the key for the "
                          f"tokenizer's own)")
    return text


# the conversation a chat template is tried on: each message's content must come out of it
PROBE = [{"role": "user", "content": "zerofit probe question"}, {"role": "assistant", "content": "zerofit probe answer"}]


def probe_chat_template(tokenizer, path: str) -> None:
    """Render PROBE with the tokenizer's (new) template as training will: a syntax error, a
    failure at render time, or a template that leaves a message's content out (then nothing of
    the answers is learned) is said now, naming the file, and not as a fault of every row."""
    import jinja2

    try:
        rendered = tokenizer.apply_chat_template(PROBE, tokenize=False)  # compiled as transformers compiles it
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"model.chat_template {path}, line {e.lineno}: {e.message}; fix the template") from None
    except Exception as e:  # a template is code: whatever it raises is its own fault
        raise ConfigError(f"model.chat_template {path} fails on a user and an assistant turn "
                          f"({type(e).__name__}: {e}); fix the template") from None
    left_out = [message["role"] for message in PROBE if message["content"] not in rendered]
    if left_out:
        raise ConfigError(f"model.chat_template {path} renders a user and an assistant turn without the "
                          f"{' and '.join(left_out)}'s content, so nothing of it would be learned; render each "
                          f"message's content (`{{{{ message['content'] }}}}`)")


def _existing_dir(path: str, key: str) -> str:
    if not Path(path).is_dir():
        raise ConfigError(f"{key}={path!r} is not a directory{read_from(path)}; models load from local files only "
                          f"(download once with `hf download REPO_ID --local-dir DIR`, then point here)")
    return path


def enable_checkpointing(model) -> None:
    """HF's activation checkpointing per decoder layer, non-reentrant: transformers 5.x renamed
    gradient_checkpointing_enable (whose every call now warns that it goes in v6)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextmanager
def zero3_init_parked():
    """A meta build while a ZeRO-3 engine lives in this process (an OOM retry re-plans):
    transformers would run its ZeRO-3 weight init on meta tensors, so its weak reference
    to the live HfDeepSpeedConfig is parked for the build."""
    from transformers.integrations import deepspeed as hf_deepspeed

    parked = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = parked
