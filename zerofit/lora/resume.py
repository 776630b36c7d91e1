"""What keeps a LoRA resume exact when checkpoints hold only the adapters (lora.py's docstring:
DeepSpeed's save_checkpoint with exclude_frozen_parameters drops the frozen base).

Before the engine is built (resume._pick): `base_refusal` compares a model.path base's files,
or a random-init base's recipe (replayed where this machine draws it otherwise), with what the
checkpoint recorded. At the load (checkpointer): `check_adapter_shapes` and the
`load_trainable_only` load function, so that other lora settings fail with a fix rather than a
bare size mismatch inside ZeRO. After the build (train): `check_and_record` fingerprints the
rebuilt base on every rank, refuses another, and records the fingerprint, the recipe and
peft's adapter config in the loop state for the next resume and for `zerofit export`.
"""
from __future__ import annotations

from pathlib import Path

from zerofit.checkpoint import zerofiles
from zerofit.checkpoint.files import load_torch_file
from zerofit.core.console import say, warn
from zerofit.core.errors import ConfigError
from zerofit.lora import adapters, base, reinit
from zerofit.lora.adapters import ADAPTER_CONFIG_KEY
from zerofit.lora.attach import adapter_config
from zerofit.lora.base import BASE_FINGERPRINT, BASE_RECIPE, FINGERPRINT_SCHEME, combine, digest, param_digests
from zerofit.models import hf_config


def load_trainable_only(src: dict, dst) -> None:
    """custom_load_fn for DeepSpeed's load_checkpoint: the module state of a checkpoint saved
    with exclude_frozen_parameters lacks the frozen base, and only that may be missing."""
    result = dst.load_state_dict(src, strict=False)
    frozen = {name for name, p in dst.named_parameters() if not p.requires_grad}
    missing = [k for k in result.missing_keys if k not in frozen]
    if missing or result.unexpected_keys:
        raise ConfigError(f"the checkpoint's adapters do not fit this model's lora section (missing "
                          f"{missing[:4]}, unexpected {result.unexpected_keys[:4]}); resume with the lora "
                          f"settings it was trained with, or start over with --no-resume")


def check_adapter_shapes(model, checkpoint: Path) -> None:
    """Before DeepSpeed loads a checkpoint: its trainable parameters (param_shapes of the
    model_states file, written by engine._save_checkpoint) must be this model's, else the
    load dies deep inside ZeRO with a bare size mismatch."""

    states_file = sorted(Path(checkpoint).glob("*model_states.pt"))[0]
    states = load_torch_file(states_file)
    saved = {name: tuple(shape) for group in states["param_shapes"] for name, shape in group.items()}
    live = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters() if p.requires_grad}
    if saved == live:
        return
    differ = [f"{n}: saved {list(saved.get(n, ()))}, now {list(live.get(n, ()))}"
              for n in sorted(set(saved) | set(live)) if saved.get(n) != live.get(n)]
    raise ConfigError(f"{Path(checkpoint).name} holds other trainable parameters than this lora section makes "
                      f"({len(differ)} differ, e.g. {'; '.join(differ[:2])}); resume with the lora settings it "
                      f"was trained with (its loop_state.json: extra.{ADAPTER_CONFIG_KEY}), or start over with "
                      f"--no-resume")


def base_fingerprint(model, rank: int) -> str | None:
    """This rank's fingerprint of the frozen base (basemodel.py: xxh3-128 of each frozen
    parameter's local share, combined in order): cheap (local data, no collective) and
    identical when the base was rebuilt bit for bit. None when the partitions sit on NVMe,
    where reading them back would cost a full swap-in."""

    named = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        local = _local_share(p, rank)
        if local is None:
            return None
        named.append((name, digest(local.detach().cpu())))
    return combine(named)


def _local_share(p, rank: int):
    """The elements of a parameter this rank holds: its ZeRO-3 partition without the
    padding of the last one (DeepSpeed pads it with uninitialised memory), or all of it."""
    if not hasattr(p, "ds_tensor"):
        return p.data.reshape(-1)
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    if p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE:
        return None
    size = p.ds_tensor.ds_numel
    valid = max(0, min(size, p.ds_numel - rank * size))
    return p.ds_tensor.reshape(-1).narrow(0, 0, valid)


def fingerprints_as_split_by(model, world_size: int, rank: int) -> list[str] | None:
    """Every rank's fingerprint of the frozen base as `world_size` ranks would hold it: each
    frozen parameter gathered whole in turn (deepspeed.zero.GatheredParameters, a collective
    every rank joins) and digested on rank 0 with the shares of that split
    (basemodel.param_digests), as `zerofit export` digests a base read from its files. It moves
    the whole 16-bit base once (as a save's 16-bit gather does), so it runs only when a resume
    meets a checkpoint written on another number of ranks. The list on rank 0, None elsewhere."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters


    named = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        partitioned = hasattr(p, "ds_tensor")  # else every rank holds it whole (_local_share)
        with GatheredParameters([p], modifier_rank=None, enabled=partitioned):
            if rank == 0:
                whole = p.data.detach().reshape(-1).cpu()
                named.append((name, param_digests(whole, world_size) if partitioned else [digest(whole)] * world_size))
        dist.barrier()  # the next gather only once rank 0 has hashed this one
    return [combine([(n, d[r]) for n, d in named]) for r in range(world_size)] if rank == 0 else None


def base_differs(step: int, drawn: str = "") -> str:
    """The refusal of a resume onto another frozen base; `drawn`: how the checkpoint's random-init
    base was drawn and how this machine draws it, where they differ (basemodel.redrawn_here)."""
    return (f"the frozen base model differs from the one this run's adapters were trained on (checkpoint at step "
            f"{step}): checkpoints hold only the adapters, so the base must be rebuilt exactly.{drawn} Point "
            f"model.path at the same weights (or keep model.config, train.seed and train.precision as they were, on "
            f"the same kind of device), or start over with --no-resume")


def base_refusal(config, checkpoint_dir: Path, step: int, on_gpu: bool) -> tuple[str | None, bool]:
    """(why a resume from `checkpoint_dir` is refused, whether the base was checked), before
    the run's files are rewritten or the engine is built (resume._pick, rank 0): a model.path
    base's files are fingerprinted for the recorded split as `zerofit export` fingerprints them
    (basemodel.files_fingerprint, one streamed read of the base), a random-init base's recipe
    is compared (another train.seed draws another base) and, where this machine draws it
    otherwise (random_init_refusal), replayed. Whatever else differs in a rebuilt random init
    `check_and_record` finds after the build."""

    if not config.lora.enabled or not (Path(checkpoint_dir) / "loop_state.json").is_file():
        return None, False
    recorded = base.read_recipe(checkpoint_dir)
    if recorded.fingerprint is None or recorded.scheme != FINGERPRINT_SCHEME:
        return None, False  # check_and_record warns
    if not config.model.path:
        return random_init_refusal(config, checkpoint_dir, recorded, step, on_gpu)
    frozen = base.frozen_params(base.peft_skeleton(
        hf_config(config.model), adapters.adapter_config(checkpoint_dir), recorded.torch_dtype,
        config.model.trust_remote_code))
    computed = base.files_fingerprint(frozen, zerofiles.safetensors_tensors(Path(config.model.path)),
                                           recorded.world_size, 1 << 22)
    return (base_differs(step) if computed != recorded.fingerprint else None), True


def random_init_refusal(config, checkpoint_dir: Path, recorded, step: int, on_gpu: bool) -> tuple[str | None, bool]:
    """base_refusal for a random-init base: another train.seed draws another base. Where this
    machine draws it otherwise than the checkpoint's build did (basemodel.redrawn_here: another
    device type, other torch / transformers / DeepSpeed versions), the base is replayed here as the
    build would draw it (reinit.InitReplay, as `zerofit export` rebuilds it) and its fingerprint
    compared: a refusal then comes before anything is rewritten, not after the build. Where
    nothing differs, or the replay does not mirror this build (built without zero.Init, or a
    transformers without its ZeRO-3 init walk), the check after the build decides alone."""

    if recorded.path is not None:
        return None, False
    if recorded.seed != config.train.seed:
        return base_differs(step), False
    drawn = base.redrawn_here(recorded, on_gpu)
    if drawn is None or not recorded.zero_init or not reinit.can_replay():
        return None, False
    say(f"{drawn}: replaying the random-init base to compare it with the checkpoint's before anything is rewritten")
    model_config = hf_config(config.model)
    frozen = base.frozen_params(base.peft_skeleton(
        model_config, adapters.adapter_config(checkpoint_dir), recorded.torch_dtype, config.model.trust_remote_code))
    walk = reinit.InitReplay(model_config, recorded.torch_dtype, recorded.seed, "cuda" if on_gpu else "cpu",
                             config.model.trust_remote_code)
    computed = base.replay_fingerprint(frozen, walk, recorded.world_size)
    return (base_differs(step, f" {drawn}: replayed here, it is another base.") if computed != recorded.fingerprint
            else None), True


def check_and_record(model, state, rank: int, world_size: int, recipe: dict, base_checked: bool = False) -> None:
    """Compare the rebuilt base with the one a resumed checkpoint's adapters were trained on;
    then record its fingerprint, how to rebuild it (basemodel.recipe_record) and peft's
    adapter config in the loop state, so that every checkpoint says which base it needs and
    how to read its adapters (adapters.write_peft_dir, zerofit export).

    A checkpoint of another number of ranks split the base otherwise: its fingerprint is
    recomputed for that split (fingerprints_as_split_by). Where the base cannot be compared
    (its partitions on NVMe now or then, or a checkpoint of another fingerprint scheme) a
    warning says so, and a recorded fingerprint is kept rather than overwritten with none.
    `base_checked`: base_refusal compared the model.path files or the replayed random init with
    the recorded fingerprint before the build (no second pass over the base for another split,
    and nothing to warn of where its partitions are on NVMe now)."""
    import torch.distributed as dist


    prints = [None] * world_size
    dist.all_gather_object(prints, base_fingerprint(model, rank))
    saved = state.extra.get(BASE_FINGERPRINT)
    same_scheme = (state.extra.get(BASE_RECIPE) or {}).get("fingerprint_scheme") == FINGERPRINT_SCHEME
    readable = bool(saved) and same_scheme and None not in saved
    unchecked = None
    if saved is None and not state.extra.get(BASE_RECIPE):
        pass  # a fresh start: nothing to compare with
    elif not readable:
        unchecked = ("the checkpoint records no fingerprint of it " + ("(its partitions were on NVMe)" if saved and
                     None in saved else "in this zerofit's fingerprint scheme"))
    elif None in prints:  # unless compared before the build, from the files or the replay it was built as
        unchecked = None if base_checked else \
            "its partitions are on NVMe now, where reading them back would cost a full swap-in"
    else:
        if len(saved) == world_size:
            expected = prints
        else:
            expected = saved if base_checked else fingerprints_as_split_by(model, len(saved), rank)
        differs = [expected != saved if rank == 0 else None]
        dist.broadcast_object_list(differs, src=0)
        if differs[0]:
            raise ConfigError(base_differs(state.step))
    if unchecked and rank == 0:
        warn(f"cannot check that the frozen base is the one this run's adapters were trained on (checkpoint at step "
             f"{state.step}): {unchecked}; make sure model.path (or model.config, train.seed and train.precision) "
             f"is what it was")
    if None not in prints or not readable:  # a fingerprint that cannot be taken now leaves the recorded one
        state.extra[BASE_FINGERPRINT] = prints
    state.extra[BASE_RECIPE] = recipe
    state.extra[ADAPTER_CONFIG_KEY] = adapter_config(model)
