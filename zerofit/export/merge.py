"""`zerofit export` of a LoRA checkpoint: the adapters merged into the base, streamed under
the RAM cap, or (`--adapter-only`) a peft adapter directory that names its base.

Merged, every base tensor goes through export.py's writer in blocks of whole rows:
- a LoRA target gets peft's own merge, the same operations in fp32 on the block's rows
  (peft tuners/lora/layer.py, Linear.get_delta_weight and merge): W += (B @ A) * scaling,
  (B @ A)^T for embeddings (lora_embedding_A/B) and fan_in_fan_out layers (GPT-2's Conv1D);
  scaling = alpha / r (alpha / sqrt(r) with rsLoRA);
- a modules_to_save copy, a trained bias or a buffer replaces the base tensor, streamed from
  the checkpoint's fp32 master weights;
- everything else is the base's, cast to the export dtype.
The base is read from model.path's safetensors files (never loaded whole) or replayed from
the random init (reinit.py), and its fingerprint must equal the checkpoint's (basemodel.py):
for files it is checked before anything is written, for a replay once it has streamed
(the staging directory is then removed, nothing published).
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from zerofit.checkpoint import zerofiles
from zerofit.core.console import warn
from zerofit.core.errors import ConfigError
from zerofit.export.shards import OutputTensor
from zerofit.lora import adapters
from zerofit.lora import base as basemodel
from zerofit.lora.reinit import InitReplay

# A product of fewer rows can take BLAS's small-matrix path and round differently from the
# whole-matrix B @ A peft computes (measured with MKL: fewer than 12 rows or columns);
# blocks are widened to this many rows so the merge stays bit-equal to peft's.
MIN_PRODUCT_ROWS = 16
MERGEABLE = ("Linear", "Embedding", "Conv1D")
UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "lora_bias", "trainable_token_indices": "trainable tokens",
               "target_parameters": "target_parameters", "layer_replication": "layer replication",
               "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern"}


def is_lora_checkpoint(checkpoint_dir: Path) -> bool:
    loop_state = Path(checkpoint_dir) / "loop_state.json"
    return loop_state.is_file() and adapters.ADAPTER_CONFIG_KEY in json.loads(loop_state.read_text()).get("extra", {})


# -------------------------------------------------------------------- the deltas
class Scratch:
    """One fp32 buffer for the delta rows of a block, grown to the largest block once."""

    def __init__(self):
        self.buffer = torch.empty(0)

    def get(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel)
        return self.buffer[:numel]


@dataclass
class Delta:
    """(B @ A) * scaling on the rows of one base weight; A and B are read when first needed
    and dropped after the last rows."""
    a: zerofiles.StoredTensor
    b: zerofiles.StoredTensor
    scaling: float
    transposed: bool                  # W += ((B @ A) * s)^T: embeddings, fan_in_fan_out layers
    _ab: tuple | None = None

    def add_to(self, first: int, end: int, rows: torch.Tensor, reader: zerofiles.TensorReader,
               scratch: Scratch) -> None:
        if self._ab is None:
            self._ab = tuple(_read_whole(t, reader) for t in (self.a, self.b))
        a, b = self._ab
        total = a.shape[1] if self.transposed else b.shape[0]
        lo = max(0, min(first, total - MIN_PRODUCT_ROWS))
        hi = max(end, min(total, lo + MIN_PRODUCT_ROWS))
        n = hi - lo
        if self.transposed:  # rows of W are columns of B @ A
            product = torch.matmul(b, a[:, lo:hi], out=scratch.get(b.shape[0] * n).view(b.shape[0], n)).T
        else:
            product = torch.matmul(b[lo:hi], a, out=scratch.get(n * a.shape[1]).view(n, a.shape[1]))
        rows.add_(product[first - lo:end - lo].mul_(self.scaling).view_as(rows))

    def release(self) -> None:
        self._ab = None

    @property
    def nbytes(self) -> int:
        return 4 * (self.a.numel + self.b.numel)


def _read_whole(stored: zerofiles.StoredTensor, reader: zerofiles.TensorReader) -> torch.Tensor:
    out = torch.empty(stored.numel, dtype=torch.float32)
    reader.read(stored, 0, stored.numel, out)
    return out.view(stored.shape)


@dataclass
class MergeRows:
    """An OutputTensor transform: the deltas of one base tensor added to each row block."""
    deltas: list[Delta]
    rows_total: int
    reader: zerofiles.TensorReader
    scratch: Scratch

    def __call__(self, first: int, end: int, rows: torch.Tensor) -> torch.Tensor:
        for delta in self.deltas:
            delta.add_to(first, end, rows, self.reader, self.scratch)
            if end == self.rows_total:
                delta.release()
        return rows


def adapter_scaling(config: dict) -> float:
    unsupported = [label for key, label in UNSUPPORTED.items() if config.get(key)]
    if unsupported:
        raise ConfigError(f"this adapter uses {', '.join(unsupported)}, which zerofit export does not merge; "
                          f"export it with --adapter-only and load it with peft")
    return adapters.scaling(int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora")))


def deltas_and_replacements(zero: zerofiles.ZeroCheckpoint, adapter_config: dict, module_kinds: dict[str, str]
                            ) -> tuple[dict[str, list[Delta]], dict[str, zerofiles.StoredTensor]]:
    """({base tensor: its deltas}, {base tensor: the checkpoint tensor replacing it}) from the
    checkpoint's trainable tensors and buffers, named as in the HF model: each under the name of
    the module it was trained on, a tied alias (lm_head.weight) too, never under its owner's
    (peft adapts only the module it wraps; `untied_aliases` keeps the other side the base's)."""
    scaling = adapter_scaling(adapter_config)
    pairs: dict[str, dict[str, zerofiles.StoredTensor]] = {}
    replacements = {}
    for stored in zero.tensors:
        if stored.kind == "buffer":
            replacements[adapters.base_name(stored.name)] = stored
            continue
        target, role = adapters.hf_target(adapters.peft_key(stored.name))
        if role == "replace":
            replacements[target] = stored
        else:
            pairs.setdefault(target, {})[role.removeprefix("lora_embedding_").removeprefix("lora_")] = stored
    deltas: dict[str, list[Delta]] = {}
    for target, pair in pairs.items():
        module = target.rsplit(".", 1)[0]
        kind = module_kinds.get(module)
        if kind not in MERGEABLE or set(pair) != {"A", "B"}:
            raise ConfigError(f"cannot merge the adapter on {module} ({kind}, parts {sorted(pair)}): zerofit "
                              f"export merges LoRA on {', '.join(MERGEABLE)} layers; use --adapter-only")
        transposed = kind == "Embedding" or bool(adapter_config.get("fan_in_fan_out"))
        deltas.setdefault(target, []).append(Delta(pair["A"], pair["B"], scaling, transposed))
    return deltas, replacements


# ---------------------------------------------------------------------- the plan
@dataclass
class MergePlan:
    """What export.py writes for a LoRA checkpoint, and the checks around it."""
    tensors: list[OutputTensor]       # in write order
    model_config: dict                # config.json of the merged model
    recipe: basemodel.BaseRecipe
    base: str                         # where the base came from, in words
    frozen: list[basemodel.BaseParam]
    adapters_merged: int
    held_bytes: int                   # beside the write blocks: replayed init, A and B of one target
    extra_bytes_per_element: int = 4  # the delta rows (Scratch)
    replay: "ReplayedBase | None" = None
    base_files: dict | None = None
    verified: bool = False
    reader: zerofiles.TensorReader | None = None

    def check_base_files(self, block_elements: int) -> None:
        """A file base: its fingerprint, before anything is written."""
        if self.base_files is not None:
            computed = basemodel.files_fingerprint(self.frozen, self.base_files, self.recipe.world_size,
                                                   block_elements)
            self.verified = basemodel.check(self.recipe, computed, self.base)

    def check_replayed_base(self) -> None:
        """A replayed base: the fingerprint of what streamed (the rest of the walk drawn first)."""
        if self.replay is not None:
            computed = self.replay.finish(self.frozen)
            self.verified = basemodel.check(self.recipe, computed, self.base)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.replay is not None:
            self.replay.close()


def plan(zero: zerofiles.ZeroCheckpoint, checkpoint_dir: Path, config_dir: Path, model_config: dict,
         dtype: torch.dtype, base_dir: Path | None = None, trust_remote_code: bool = False) -> MergePlan:
    """The merged model's tensors, in write order, for a LoRA checkpoint; `base_dir`
    overrides the recorded model.path. The model's own code runs only with `trust_remote_code`
    (the person's --trust-remote-code), never because the run recorded it."""
    recipe = basemodel.read_recipe(checkpoint_dir)
    adapter_config = adapters.adapter_config(checkpoint_dir)
    hf_config = basemodel.hf_config_of(config_dir, trust_remote_code)
    frozen = basemodel.frozen_params(basemodel.peft_skeleton(hf_config, adapter_config, recipe.torch_dtype,
                                                             trust_remote_code))
    skeleton = basemodel.meta_model(hf_config, recipe.torch_dtype, trust_remote_code)
    aliases = basemodel.tied_aliases(skeleton)
    kinds = {name: type(module).__name__ for name, module in skeleton.named_modules()}
    deltas, replacements = deltas_and_replacements(zero, adapter_config, kinds)
    untied = untied_aliases(aliases, set(deltas) | set(replacements))

    replay = base_files = None
    if base_dir is not None or recipe.path:
        base_path = Path(base_dir or recipe.path)
        sources = base_files = zerofiles.safetensors_tensors(base_path)
        rank = {name: i for i, name in enumerate(skeleton.state_dict())}
        names = sorted(sources, key=lambda n: (rank.get(n, len(rank)), n))  # model order
        description = f"the base at {base_path}"
    else:
        replay = replayed_base(hf_config, recipe, frozen, skeleton, replacements, trust_remote_code)
        sources = replay.sources
        names = [n for n in replay.walk.order if n in sources]  # the order the walk finishes them
        description = f"the {recipe.describe()} base"
    names, sources = with_untied_aliases(names, sources, {a: o for a, o in untied.items() if a not in replacements})

    reader, scratch = zerofiles.TensorReader(), Scratch()
    tensors = output_tensors(names + [n for n in replacements if n not in sources], sources, replacements, deltas,
                             dtype, reader, scratch)
    if deltas:
        raise ConfigError(f"the base model has no {sorted(deltas)[0]} for the adapter trained on it")
    # both sides written apart must stay apart on load (from_pretrained re-ties a tied config)
    merged_config = dict(model_config, tie_word_embeddings=False) if untied else model_config
    held = (replay.walk.host_peak_bytes() if replay else 0) + max(
        (sum(d.nbytes for d in t.transform.deltas) for t in tensors if t.transform), default=0)
    return MergePlan(tensors, merged_config, recipe, description, frozen,
                     sum(len(t.transform.deltas) for t in tensors if t.transform), held,
                     replay=replay, base_files=base_files, reader=reader)


def untied_aliases(aliases: dict[str, str], adapted: set[str]) -> dict[str, str]:
    """{alias: owner} of the tied weights (input and output embeddings) to write apart: those of
    which either side is adapted (a LoRA delta) or replaced (modules_to_save). Training changed
    only the side peft wrapped: LoRA on embed_tokens moves the input lookup while lm_head still
    reads the base's tied weight, and the other way round (peft tuners/lora/layer.py Embedding
    and Linear forward the base layer plus their own delta; a ModulesToSaveWrapper runs its
    trained copy). One tied tensor would carry the change into both (eval loss 4.82 trained,
    19.27 exported, LoRA on embed_tokens of a tied tiny Llama)."""
    return {alias: owner for alias, owner in aliases.items() if alias in adapted or owner in adapted}


def with_untied_aliases(names: list[str], sources: dict, untied: dict[str, str]) -> tuple[list[str], dict]:
    """Write order and sources with each untied alias that keeps the base's weight right after
    its owner, read from the owner's source where the base holds it once (save_pretrained drops
    a tied alias; a replayed init draws it once: ReplayedBase.share keeps it for the second read)."""
    if not untied:
        return names, sources
    sources = dict(sources)
    for alias, owner in untied.items():
        if alias not in sources and owner in sources:
            sources[alias] = sources[owner]
            if isinstance(sources[owner], ReplayedTensor):
                sources[owner].base.share(sources[owner].name)
    after = {owner: alias for alias, owner in untied.items() if alias in sources}
    ordered = []
    for name in names:
        if name not in untied:
            ordered += [name] + ([after[name]] if name in after else [])
    return ordered + [n for n in after.values() if n not in ordered], sources


def output_tensors(names: list[str], sources: dict, replacements: dict, deltas: dict[str, list[Delta]],
                   dtype: torch.dtype, reader: zerofiles.TensorReader, scratch: Scratch) -> list[OutputTensor]:
    """An OutputTensor per name: the checkpoint's tensor where it replaces the base's,
    else the base's with its deltas as the transform (popped from `deltas`)."""
    tensors = []
    for name in names:
        source = replacements[name] if name in replacements else sources[name]
        out_dtype = dtype if source.dtype.is_floating_point else source.dtype
        tensor = OutputTensor(name, tuple(source.shape), out_dtype, source)
        if name in deltas and name not in replacements:
            tensor.transform = MergeRows(deltas.pop(name), source.shape[0], reader, scratch)
        tensors.append(tensor)
    return tensors


def replayed_base(hf_config, recipe: basemodel.BaseRecipe, frozen: list[basemodel.BaseParam], skeleton,
                  replacements: dict, trust_remote_code: bool = False) -> "ReplayedBase":
    if not recipe.zero_init:
        raise ConfigError("this run's random-init base was built without ZeRO-3 (zero.stage < 3); zerofit "
                          "export rebuilds only ZeRO-3 builds; use --adapter-only")

    params = {name for name, _ in skeleton.named_parameters(remove_duplicate=False)}
    buffers = [n for n in skeleton.state_dict() if n not in params and n not in replacements]
    if buffers:  # persistent buffers come from the checkpoint (DeepSpeed saves them whole)
        raise ConfigError(f"the checkpoint lacks the model's buffers {buffers[:3]}; cannot rebuild the base")
    walk = InitReplay(hf_config, recipe.torch_dtype, recipe.seed, recipe.init_device, trust_remote_code)
    kept = {name for name, _ in skeleton.named_parameters()}  # tied aliases drawn, then dropped by the tie
    return ReplayedBase(walk, {p.name for p in frozen}, recipe.world_size,
                        {name: tuple(p.shape) for name, p in walk.model.named_parameters() if name in kept})


# ------------------------------------------------------------- a replayed base
class ReplayedBase:
    """The replayed init as a source of whole tensors, in the order the walk finishes them;
    every frozen parameter is digested as it passes (basemodel.ShareDigests)."""

    def __init__(self, walk, frozen_names: set[str], world_size: int, shapes: dict[str, tuple[int, ...]]):
        self.walk = walk
        self.frozen_names = frozen_names
        self.world_size = world_size
        self.sources = {name: ReplayedTensor(name, shape, walk.dtype, self) for name, shape in shapes.items()}
        self._stream = iter(walk)
        self._values: dict[str, torch.Tensor] = {}
        self._reads_left: dict[str, int] = {}   # a tensor written twice (an untied alias): dropped after both
        self.digests: dict[str, list[bytes]] = {}

    def share(self, name: str) -> None:
        self._reads_left[name] = self._reads_left.get(name, 1) + 1

    def value(self, name: str) -> torch.Tensor:
        while name not in self._values:
            try:
                passed, value = next(self._stream)
            except StopIteration:
                raise ConfigError(f"the replayed init never produced {name}") from None
            self._digest(passed, value)
            self._values = {passed: value}  # whatever passed before is not written
        return self._values[name]

    def drop(self, name: str) -> None:
        self._reads_left[name] = self._reads_left.get(name, 1) - 1
        if self._reads_left[name] <= 0:
            self._values.pop(name, None)

    def _digest(self, name: str, value: torch.Tensor) -> None:
        if name in self.frozen_names:
            self.digests[name] = basemodel.param_digests(value, self.world_size)

    def close(self) -> None:
        self._stream.close()
        self._values = {}

    def finish(self, frozen: list[basemodel.BaseParam]) -> list[str]:
        for name, value in self._stream:
            self._digest(name, value)
        return basemodel.fingerprints(frozen, self.digests, self.world_size)


@dataclass
class ReplayedTensor:
    """A source for export.py's reader (zerofiles.TensorReader.read): elements of a replayed tensor."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    base: ReplayedBase

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(self.base.value(self.name).reshape(-1)[start:stop])
        if stop == self.numel:
            self.base.drop(self.name)


# ------------------------------------------------------------- --adapter-only
def write_adapter_dir(checkpoint_dir: Path, config_dir: Path, directory: Path, dtype: str,
                      base_dir: Path | None = None, trust_remote_code: bool = False) -> dict:
    """A peft adapter directory (adapters.write_peft_dir) that zerofit chat can run alone: its
    adapter_config.json names the base directory, basemodel.ADAPTER_BASE_FILE holds the recipe and
    fingerprint (and the HF config a random-init base is rebuilt from), and the tokenizer
    files sit beside it. Returns the base record."""
    recipe = basemodel.read_recipe(checkpoint_dir)
    if base_dir is not None:
        recipe = basemodel.BaseRecipe(**{**asdict(recipe), "path": str(Path(base_dir).resolve())})
    adapters.write_peft_dir(checkpoint_dir, directory, dtype)
    config_file = directory / adapters.ADAPTER_CONFIG_FILE
    adapter_config = json.loads(config_file.read_text())
    adapter_config["base_model_name_or_path"] = recipe.path
    config_file.write_text(json.dumps(adapter_config, indent=2))
    record = {"recipe": asdict(recipe), "config": json.loads((config_dir / "config.json").read_text())}
    if recipe.path and (Path(recipe.path) / "config.json").is_file():  # the base it will name: the trained one?
        basemodel.verify_files(recipe, basemodel.hf_config_of(config_dir, trust_remote_code), adapter_config,
                               Path(recipe.path), trust_remote_code=trust_remote_code)
    elif recipe.path:
        warn(f"the base {recipe.path} is not there to check: chat and generate need it there, or the adapter's "
             f"base_model_name_or_path pointed at it")
    (directory / basemodel.ADAPTER_BASE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    for path in config_dir.iterdir():
        if path.is_file() and path.name != "config.json" and path.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy2(path, directory / path.name)  # tokenizer, chat template
    return record
