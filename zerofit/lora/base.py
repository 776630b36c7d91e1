"""The frozen base a LoRA run was trained on: how to get it back, and proof that it is the same.

LoRA checkpoints hold only the adapters (lora.py), so a resume, `zerofit export` and
`zerofit chat` on an adapter directory all need the base again:
- `model.path`: its safetensors files, read tensor by tensor (zerofiles.safetensors_tensors);
- `model.config`: random init, replayed module by module (reinit.py) with the training seed
  on the device type that drew it.
Every checkpoint's loop_state.json records how (BASE_RECIPE) and a fingerprint of the base
as training held it (BASE_FINGERPRINT, written by loraresume.check_and_record): per rank, xxh3-128 over each frozen parameter's
name and the xxh3-128 digest of that rank's ZeRO-3 share of it, in the training dtype, in
the PeftModel's parameter order. Digesting each parameter on its own lets an export compute
the fingerprint in whatever order the base arrives (a replayed init finishes the embedding
last) and combine in model order at the end.
"""
from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from zerofit.core.console import warn
from zerofit.core.errors import ConfigError
from zerofit.lora import adapters

BASE_RECIPE = "lora_base"             # key in LoopState.extra, written by loraresume.check_and_record
ADAPTER_BASE_FILE = "zerofit_base.json"  # in an `export --adapter-only` directory: recipe + HF config
BASE_FINGERPRINT = "lora_base_fingerprint"
FINGERPRINT_SCHEME = 2                # how the fingerprint hashes; a checkpoint of another is not compared
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class BaseMismatchError(ConfigError):
    """The base at hand is not the one the adapters were trained on."""


@dataclass(frozen=True)
class BaseRecipe:
    """How to rebuild a LoRA run's base, and its fingerprint (None when not recorded)."""
    path: str | None                  # model.path (absolute) or None for random init
    seed: int
    dtype: str                        # training precision: bf16 | fp16 | fp32
    init_device: str                  # cpu | cuda: whose RNG drew a random-init base
    zero_init: bool                   # built under deepspeed.zero.Init (zero.stage 3)
    trust_remote_code: bool           # the run's model.trust_remote_code, recorded only: never read to load
    world_size: int
    fingerprint: list[str] | None
    scheme: int | None
    versions: dict | None = None      # drawing_versions() of the build, None where not recorded

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def describe(self) -> str:
        return f"model.path {self.path}" if self.path else \
            f"random-init (seed {self.seed}, {self.dtype}, drawn on {self.init_device})"


def recipe_record(config, on_gpu: bool, zero_init: bool) -> dict:
    """What a LoRA checkpoint records about its base (LoopState.extra[BASE_RECIPE]); zero_init:
    whether it was built under deepspeed.zero.Init (engine.builds_under_zero_init)."""
    return {"path": str(Path(config.model.path).resolve()) if config.model.path else None,
            "config": config.model.config, "seed": config.train.seed, "dtype": config.train.precision,
            "init_device": "cuda" if on_gpu else "cpu", "zero_init": zero_init,
            "trust_remote_code": config.model.trust_remote_code, "fingerprint_scheme": FINGERPRINT_SCHEME,
            "versions": drawing_versions()}


def drawing_versions() -> dict:
    """The libraries whose code draws a random-init base: torch (its generators and init
    functions), transformers (the ZeRO-3 init walk and each model's _init_weights), DeepSpeed
    (zero.Init, under which it is built). With these and the device type unchanged, the same
    seed draws the same base; with any changed it may not (loraresume.base_refusal replays it then)."""
    import deepspeed
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__}


def redrawn_here(recorded, on_gpu: bool) -> str | None:
    """How the checkpoint's random-init base was drawn and how this machine draws it, where the
    device type (the CPU and CUDA generators differ) or drawing_versions differ (or were not
    recorded); None where all are as they were."""
    device, versions = "cuda" if on_gpu else "cpu", drawing_versions()
    if recorded.init_device == device and recorded.versions == versions:
        return None
    then = ", ".join(f"{name} {version}" for name, version in recorded.versions.items()) if recorded.versions \
        else "versions it did not record"
    now = ", ".join(f"{name} {version}" for name, version in versions.items())
    return f"It was drawn on {recorded.init_device} with {then}; this machine draws it on {device} with {now}"


def read_recipe(checkpoint_dir: Path) -> BaseRecipe:
    """The recipe a LoRA checkpoint recorded (loraresume.check_and_record)."""
    checkpoint_dir = Path(checkpoint_dir)
    extra = json.loads((checkpoint_dir / "loop_state.json").read_text()).get("extra", {})
    record = extra.get(BASE_RECIPE)
    if record is None:
        raise ConfigError(f"{checkpoint_dir} does not say how its base model was built (no {BASE_RECIPE} in "
                          f"loop_state.json)")
    prints = extra.get(BASE_FINGERPRINT)
    return BaseRecipe(record["path"], int(record["seed"]), record["dtype"], record["init_device"] or "cpu",
                      bool(record.get("zero_init", True)), bool(record.get("trust_remote_code", False)),
                      len(prints) if prints else 1, prints if prints and None not in prints else None,
                      record.get("fingerprint_scheme"), record.get("versions"))


# ------------------------------------------------------------------ fingerprint
def share_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """Elements of a parameter that ZeRO-3 rank `rank` holds: ceil(numel / world_size) per rank,
    the last cut at numel (DeepSpeed's _partition_param; the padding is not hashed)."""
    size = math.ceil(numel / world_size)
    return min(numel, rank * size), min(numel, (rank + 1) * size)


def digest(data: torch.Tensor) -> bytes:
    """xxh3-128 of a contiguous CPU tensor's bytes."""
    import xxhash

    return xxhash.xxh3_128(data.contiguous().view(torch.uint8).numpy()).digest()


class ShareDigests:
    """Per-rank digests of one parameter whose flat elements arrive in order, in blocks."""

    def __init__(self, numel: int, world_size: int):
        import xxhash

        self.numel = numel
        self.ranges = [share_range(numel, r, world_size) for r in range(world_size)]
        self._hashes = [xxhash.xxh3_128() for _ in range(world_size)]

    def update(self, start: int, values: torch.Tensor) -> None:
        """`values`: flat elements [start, start + len) in the training dtype, on the CPU."""
        raw = values.contiguous().view(torch.uint8).numpy()
        size = values.element_size()
        stop = start + values.numel()
        for (a, b), digest_ in zip(self.ranges, self._hashes):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                digest_.update(raw[(lo - start) * size:(hi - start) * size])

    def digests(self) -> list[bytes]:
        return [h.digest() for h in self._hashes]


def param_digests(value: torch.Tensor, world_size: int) -> list[bytes]:
    """Every rank's digest of one whole parameter (CPU, training dtype)."""
    shares = ShareDigests(value.numel(), world_size)
    shares.update(0, value.reshape(-1))
    return shares.digests()


def combine(named_digests: list[tuple[str, bytes]]) -> str:
    """One rank's fingerprint from (parameter name, digest of its share), in model order."""
    import xxhash

    total = xxhash.xxh3_128()
    for name, part in named_digests:
        total.update(name.encode())
        total.update(part)
    return total.hexdigest()


def fingerprints(frozen: list["BaseParam"], digests: dict[str, list[bytes]], world_size: int) -> list[str]:
    """Every rank's fingerprint from the per-parameter digests (keyed by the base name)."""
    missing = [p.name for p in frozen if p.name not in digests]
    if missing:
        raise ConfigError(f"the base model lacks {len(missing)} weight(s) the adapters were trained on, "
                          f"e.g. {missing[:3]}")
    return [combine([(p.peft_name, digests[p.name][rank]) for p in frozen]) for rank in range(world_size)]


def check(recipe: BaseRecipe, computed: list[str], base: str) -> bool:
    """Refuse a base whose fingerprint differs from the checkpoint's; False (and a warning)
    when the checkpoint's fingerprint cannot be compared."""

    if recipe.fingerprint is None or recipe.scheme != FINGERPRINT_SCHEME:
        warn(f"the checkpoint records no comparable base fingerprint (scheme {recipe.scheme}); "
             f"cannot prove {base} is the base the adapters were trained on")
        return False
    if computed != recipe.fingerprint:
        hint = ("point --base (export) or the adapter's base_model_name_or_path in adapter_config.json (chat, "
                "generate) at the model directory the run was trained on (its model.path)" if recipe.path else
                "rebuild on the same kind of device with the same zerofit, transformers and torch versions")
        raise BaseMismatchError(f"{base} is not the base model the adapters were trained on (fingerprint "
                                f"{computed[0][:12]}..., the checkpoint's {recipe.fingerprint[0][:12]}...): the "
                                f"adapters on it would be a model nobody trained; {hint}")
    return True


# ------------------------------------------------------------ a model's own code
def is_remote_code_refusal(error: BaseException) -> bool:
    """transformers refusing to run a model's own code (auto_map) without trust_remote_code=True."""
    return isinstance(error, ValueError) and "trust_remote_code=True" in str(error)


@contextlib.contextmanager
def remote_code_asked(source):
    """transformers' refusal of a model's own code, said as the flag that allows it. zerofit
    never takes trust_remote_code from a model's, adapter's or checkpoint's files (a downloaded
    adapter would run its Python): only from the person running the command."""
    try:
        yield
    except ValueError as e:
        if not is_remote_code_refusal(e):
            raise
        raise ConfigError(f"{source}: the model comes with its own Python code (auto_map in its config), which "
                          f"zerofit runs only when you pass --trust-remote-code; read that code first, then "
                          f"pass the flag if you trust it") from None


# -------------------------------------------------------------------- skeletons
@dataclass(frozen=True)
class BaseParam:
    """A frozen base parameter: its PeftModel name (fingerprint), HF name, shape, training dtype."""
    peft_name: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def hf_config_of(model_dir: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)


def meta_model(hf_config, dtype: torch.dtype, trust_remote_code: bool = False):
    """The HF model on the meta device, weights tied as from_config ties them (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code)


def peft_skeleton(hf_config, adapter_config: dict, dtype: torch.dtype, trust_remote_code: bool = False):
    """The PeftModel training wrapped, on the meta device: its parameter names, order and
    requires_grad flags are the ones the fingerprint was taken over (peft wraps the model
    in place: use meta_model for the HF names)."""
    import peft

    model = meta_model(hf_config, dtype, trust_remote_code)
    config = peft.get_peft_config({k: v for k, v in adapter_config.items() if k != "inference_mode"})
    with quiet_peft():
        return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


@contextlib.contextmanager
def quiet_peft():
    """peft asks transformers a deprecated question (is_gradient_checkpointing) and advises on
    tied layers when it wraps a model: nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*tie_word_embeddings.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=r".*base_model_name_or_path.*was renamed.*", category=UserWarning)
        yield


def frozen_params(peft_model) -> list[BaseParam]:
    """The frozen parameters in the order loraresume.base_fingerprint hashes them."""
    return [BaseParam(name, adapters.base_name(name), tuple(p.shape), p.dtype)
            for name, p in peft_model.named_parameters() if not p.requires_grad]


def tied_aliases(model) -> dict[str, str]:
    """{alias: owner} of parameters registered under two names (tied embeddings)."""
    owner = {}
    for name, p in model.named_parameters():
        owner[id(p)] = name
    return {name: owner[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if owner[id(p)] != name}


def files_fingerprint(params: list[BaseParam], stored: dict, world_size: int, block_elements: int) -> list[str]:
    """The fingerprint of a base read from its files: each frozen parameter in row blocks,
    rounded to its training dtype as from_pretrained(dtype=...) rounds it, then digested."""
    from zerofit.checkpoint import zerofiles  # it imports torch: the planner reads this module without it

    missing = [p.name for p in params if p.name not in stored]
    if missing:
        raise ConfigError(f"the base model's files lack {len(missing)} weight(s) the adapters were trained on, "
                          f"e.g. {missing[:3]}; is it the model the run was trained from?")
    reader = zerofiles.TensorReader()
    buffer = torch.empty(max(block_elements, 1), dtype=torch.float32)
    digests = {}
    try:
        for p in params:
            if tuple(stored[p.name].shape) != p.shape:
                raise BaseMismatchError(f"the base model's {p.name} is {list(stored[p.name].shape)}, the trained "
                                        f"model's {list(p.shape)}: not the model the adapters were trained on")
            shares = ShareDigests(p.numel, world_size)
            row = math.prod(p.shape[1:]) if p.shape else 1
            step = max(1, len(buffer) // row) * row
            for start in range(0, p.numel, step):
                stop = min(p.numel, start + step)
                block = buffer[:stop - start]
                reader.read(stored[p.name], start, stop, block)
                shares.update(start, block.to(p.dtype))
            digests[p.name] = shares.digests()
    finally:
        reader.close()
    return fingerprints(params, digests, world_size)


def replay_fingerprint(params: list[BaseParam], walk, world_size: int) -> list[str]:
    """The fingerprint of a random-init base replayed by `walk` (reinit.InitReplay): each frozen
    parameter digested as the walk finishes it, then dropped (the replay holds about one layer)."""
    wanted = {p.name for p in params}
    digests = {name: param_digests(value, world_size) for name, value in walk if name in wanted}
    return fingerprints(params, digests, world_size)


# ------------------------------------------------------- an adapter directory's base
@dataclass
class AdapterBase:
    """The base an adapter directory runs on."""
    recipe: BaseRecipe | None         # None: a peft directory zerofit did not write (nothing to check)
    hf_config: object
    path: Path | None                 # None: a random-init base, rebuilt from the recipe
    adapter_config: dict


def adapter_base(adapter_dir: Path, trust_remote_code: bool = False) -> AdapterBase:
    """What `zerofit export --adapter-only` recorded (ADAPTER_BASE_FILE), or for another
    peft directory its adapter_config.json's base_model_name_or_path (a local directory).
    The base's own code runs only with `trust_remote_code` (the person's flag), whatever the
    adapter's files say."""
    from transformers import CONFIG_MAPPING

    adapter_dir = Path(adapter_dir)
    adapter_config = json.loads((adapter_dir / adapters.ADAPTER_CONFIG_FILE).read_text())
    record_file = adapter_dir / ADAPTER_BASE_FILE
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        recipe = BaseRecipe(**record["recipe"])
        path = Path(recipe.path) if recipe.path else None
        named = adapter_config.get("base_model_name_or_path")
        if path is not None and named and Path(named) != path and (Path(named) / "config.json").is_file():
            path = Path(named)  # repointed after the base moved; its fingerprint is still checked
        fields = dict(record["config"])
        hf_config = CONFIG_MAPPING[fields.pop("model_type")].from_dict(fields)
    else:
        recipe, named = None, adapter_config.get("base_model_name_or_path")
        path = Path(named) if named else None
        if path is None:
            raise ConfigError(f"{adapter_dir}/adapter_config.json names no base model (base_model_name_or_path); "
                              f"set it to the local base model directory")
        hf_config = None
    if path is not None and not (path / "config.json").is_file():
        raise ConfigError(f"{adapter_dir} runs on the base model {path}, which is not a local model directory; "
                          f"put the base there or set base_model_name_or_path in its adapter_config.json")
    if hf_config is None:
        hf_config = hf_config_of(path, trust_remote_code)
    return AdapterBase(recipe, hf_config, path, adapter_config)


def verify_files(recipe: BaseRecipe, hf_config, adapter_config: dict, base_dir: Path,
                 block_elements: int = 1 << 22, trust_remote_code: bool = False) -> bool:
    """Check a base directory's weights against the recipe's fingerprint (streamed)."""
    from zerofit.checkpoint import zerofiles  # it imports torch: the planner reads this module without it

    frozen = frozen_params(peft_skeleton(hf_config, adapter_config, recipe.torch_dtype, trust_remote_code))
    computed = files_fingerprint(frozen, zerofiles.safetensors_tensors(base_dir), recipe.world_size, block_elements)
    return check(recipe, computed, f"the base at {base_dir}")


def verify_values(recipe: BaseRecipe, hf_config, adapter_config: dict, values: dict,
                  trust_remote_code: bool = False) -> bool:
    """Check a rebuilt base (name -> tensor in the training dtype) against the recipe."""
    frozen = frozen_params(peft_skeleton(hf_config, adapter_config, recipe.torch_dtype, trust_remote_code))
    digests = {p.name: param_digests(values[p.name], recipe.world_size) for p in frozen if p.name in values}
    return check(recipe, fingerprints(frozen, digests, recipe.world_size), f"the rebuilt {recipe.describe()} base")
