"""`zerofit lint ds_config.json`: check a DeepSpeed JSON the way DeepSpeed reads it, then
flag what it would silently ignore and the values that cost memory at the worst moment.

- zero_optimization is validated with DeepSpeed's own pydantic model
  (deepspeed.runtime.zero.config.DeepSpeedZeroConfig): unknown keys there, such as
  `"stage3_offload_optimizer": true`, are errors, named with the nearest valid key.
- The whole dict goes through DeepSpeedConfig with every key lookup recorded: a top-level
  key DeepSpeed never looks at is one it silently ignores.
- "auto" values are filled only by HF Trainer / Accelerate; DeepSpeed itself does not.
- Risky values get the reason and the fix, with numbers when a model is given (lintrisk).
With a model (and hardware: probed or --gpu-mem/--host-mem), the config is also planned
(lintrisk.plan_ds_config).
"""
from __future__ import annotations

import copy
import difflib
import json
import os
import sys
from pathlib import Path

from zerofit.core.errors import ConfigError
from zerofit.core.timeline import human_bytes
from zerofit.lint import optim, risk
from zerofit.lint.result import DS_DEFAULT_SUB_GROUP_SIZE, Finding, LintResult, TrainerArgs, is_number, parses_as_number  # noqa: F401
from zerofit.machine.hardware import Hardware


def read(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"{path} {what}; pass the DeepSpeed JSON file to lint")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw



def lint(ds: dict, path: str = "ds_config.json", spec=None, hw: Hardware | None = None, world_size: int = 1,
         trainer: TrainerArgs = TrainerArgs(), model_ref: str = "") -> LintResult:

    result = LintResult(path)
    autos = auto_paths(ds)
    if autos:
        result.findings.append(Finding(
            "warning", ", ".join(autos),
            '"auto" is filled in only by HF Trainer / Accelerate from TrainingArguments; DeepSpeed '
            "itself (deepspeed.initialize, zerofit) does not resolve it and drops or rejects it",
            "fine under HF Trainer / LLaMA-Factory; elsewhere write numbers (`zerofit plan --model M --json` "
            "prints a fully resolved deepspeed_config)"))
    ds = without_autos(ds)
    check_section_objects(ds, result)
    check_nvme_paths(ds, result)
    zero = check_zero(ds, result)
    check_stage_keys(ds, result)
    check_numbers(ds, result)
    optim.check_optimizer(ds, result)
    optim.check_scheduler(ds, result, autos)
    check_precision(ds, result)  # before DeepSpeed's own parse: its refusal of what this names is not repeated
    check_top_level(ds, zero is not None, result)
    check_batch(ds, world_size, result, autos)
    if zero is not None:
        check_deprecated_zero_keys(ds, result)
        risk.check_risky(ds, zero, spec, hw, result, autos)
        risk.check_step_overlap(ds, zero, spec, result, autos)
        risk.check_partial_offload(zero, result)
        risk.check_offload_stage(zero, result)
        risk.check_deepcompile(ds, zero, spec, hw, world_size, result)
        if spec is not None and hw is not None and not result.errors:
            result.plan = risk.plan_ds_config(ds, zero, spec, hw, world_size, trainer, model_ref, autos)
            if not result.plan["fits"]:  # the run would die of memory: as much an error as a bad key
                result.findings.append(Finding(
                    "error", "plan", f"{model_ref or 'the model'} does not fit this config on this hardware "
                    f"(the breakdown below)", f"`zerofit plan --model {model_ref or 'M'}` with the same "
                    f"--gpu-mem/--host-mem chooses one that fits, or says what would"))
    return result


# -------------------------------------------------------------------- the checks
def auto_paths(node, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in auto_paths(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")]
    return [prefix] if node == "auto" else []


def without_autos(node):
    if isinstance(node, dict):
        return {k: without_autos(v) for k, v in node.items() if v != "auto"}
    return copy.deepcopy(node)


# Sections DeepSpeed unpacks with ** or reads with .keys(): anything but an object there raises
# before training ("argument after ** must be a mapping, not bool": precision_config.py
# get_bfloat16_config; config.py get_optimizer_name).
OBJECT_SECTIONS = {"fp16": '{"enabled": true}', "bf16": '{"enabled": true}', "bfloat16": '{"enabled": true}',
                   "optimizer": '{"type": "AdamW", "params": {"lr": 1e-5}}',
                   "scheduler": '{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}'}


def check_section_objects(ds: dict, result: LintResult) -> None:
    for key, example in OBJECT_SECTIONS.items():
        if key in ds and not isinstance(ds[key], dict):
            fix = f'"{key}": {example}'
            if key in ("fp16", "bf16", "bfloat16") and isinstance(ds[key], bool):
                fix = f'"{key}": {{"enabled": {json.dumps(ds[key])}}}'
            result.findings.append(Finding("error", key, f"must be an object, not {json.dumps(ds[key])}: "
                                           "DeepSpeed fails reading it", fix))


def check_zero(ds: dict, result: LintResult):
    """DeepSpeed's DeepSpeedZeroConfig: extra keys forbidden, types checked."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    section = ds.get("zero_optimization", {})
    if not isinstance(section, dict):
        result.findings.append(Finding("error", "zero_optimization", "must be an object", '{"stage": 3, ...}'))
        return None
    try:
        zero = DeepSpeedZeroConfig(**section)
    except ValidationError as e:
        result.findings += schema_findings("zero_optimization", e, "not a DeepSpeed ZeRO key",
                                           lambda loc: _nearest(loc, DeepSpeedZeroConfig))
        return None
    except AssertionError as e:  # its deprecated-field rules assert, e.g. cpu_offload beside offload_optimizer
        result.findings.append(Finding("error", "zero_optimization", f"DeepSpeed refuses it: {e}",
                                       'drop the deprecated key (cpu_offload: write "offload_optimizer": '
                                       '{"device": "cpu"} alone)'))
        return None
    return zero


# Keys one ZeRO stage reads and another ignores (DeepSpeed 0.19.8: engine._configure_zero_optimizer
# hands allgather_* to stages 1-2 only; stage3_* and offload_param are read by stage 3 alone).
STAGE_12_ONLY = ("allgather_partitions", "allgather_bucket_size")


def check_stage_keys(ds: dict, result: LintResult) -> None:
    """A key the configured stage does not read: set, and silently without effect."""
    section = ds.get("zero_optimization")
    stage = zero_stage(section)
    if stage is None:
        return
    ignored = [k for k in section if (stage == 3 and k in STAGE_12_ONLY) or (stage < 3 and k.startswith("stage3_"))]
    for key in ignored:
        result.findings.append(Finding("warning", f"zero_optimization.{key}", f"ZeRO stage {stage} does not read it",
                                       "remove it" + (" (stage 3 gathers with stage3_prefetch_bucket_size)"
                                                      if stage == 3 else "")))


def zero_stage(section) -> int | None:
    """The stage as DeepSpeed's pydantic model reads it: "3" and 3.0 coerce to 3 (ZeroStageEnum);
    None when absent or not a stage at all (check_zero reports that)."""
    stage = section.get("stage") if isinstance(section, dict) else None
    if isinstance(stage, bool):
        return None
    if isinstance(stage, str) and stage.strip().isdigit():
        return int(stage)
    if isinstance(stage, float) and stage.is_integer():
        return int(stage)
    return stage if isinstance(stage, int) else None


def check_deprecated_zero_keys(ds: dict, result: LintResult) -> None:
    """Deprecated ZeRO keys DeepSpeed still maps with only a log line (zero/config.py: cpu_offload,
    cpu_offload_param, ...; json_schema_extra "deprecated"). Beside their replacement it asserts:
    check_zero reports that one as an error."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    section = ds.get("zero_optimization", {})
    for name, info in DeepSpeedZeroConfig.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        key = next((k for k in (name, info.alias) if k and k in section), None)
        if key is None or not extra.get("deprecated"):
            continue
        replacement = extra.get("new_param", "")
        fix = DEPRECATED_ZERO_FIXES.get(key, f"use {replacement}") if section[key] else "remove it"
        result.findings.append(Finding("warning", f"zero_optimization.{key}",
                                       f"deprecated: DeepSpeed maps it to {replacement} with only a log line, "
                                       "and asserts if both are set", fix))


DEPRECATED_ZERO_FIXES = {"cpu_offload": 'use "offload_optimizer": {"device": "cpu"}',
                         "cpu_offload_param": 'use "offload_param": {"device": "cpu"}',
                         "cpu_offload_use_pin_memory": 'use "pin_memory": true inside offload_optimizer / offload_param'}


# Top-level numbers DeepSpeed reads without a type check: a string there ("1.0") fails later,
# e.g. gradient_clipping in the engine's `> 0.0` comparison.
NUMERIC_KEYS = ("gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "steps_per_print")


def check_numbers(ds: dict, result: LintResult) -> None:
    for key in NUMERIC_KEYS:
        value = ds.get(key)
        if isinstance(value, str):  # "auto" was taken out before the checks
            fix = f'write the number ("{key}": {value})' if parses_as_number(value) else "write a number"
            result.findings.append(Finding("error", key, f"is the string {value!r}: DeepSpeed keeps it as text and "
                                           f"fails when it first compares it", fix))



def schema_findings(section: str, error, unknown: str, fix_unknown=lambda loc: "remove it") -> list[Finding]:
    """One finding per key a DeepSpeed config model (pydantic) refused: a key it does not have
    (`unknown`, with `fix_unknown(loc)`), or a value it cannot take (`value_finding`)."""
    findings = []
    for item in error.errors():
        key = ".".join([section, *(str(p) for p in item["loc"])])
        if item["type"] == "extra_forbidden":
            findings.append(Finding("error", key, f"{unknown}: DeepSpeed refuses this config",
                                    fix_unknown(item["loc"])))
        else:
            findings.append(value_finding(key, item))
    return findings


def value_finding(key: str, item: dict) -> Finding:
    """A pydantic error about a value: what it must be, and what it got."""
    expected = item.get("ctx", {}).get("expected")
    if item["type"] == "enum" and expected:  # "0, 1, 2, 3 or 3": DeepSpeed's stage enum has an alias
        allowed = list(dict.fromkeys(v.strip(" '") for v in expected.replace(" or ", ", ").split(",")))
        return Finding("error", key, f"must be one of {', '.join(allowed)} (got {item.get('input')!r})",
                       f"set it to one of {', '.join(allowed)}")
    bound = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
             "less_than": ("lt", "<")}.get(item["type"])
    if bound and bound[0] in item.get("ctx", {}):  # a range: say the range, not "see the docs"
        return Finding("error", key, f"{item['msg']} (got {item.get('input')!r})",
                       f"set it {bound[1]} {item['ctx'][bound[0]]}")
    return Finding("error", key, f"{item['msg']} (got {item.get('input')!r})",
                   "see DeepSpeed's docs for this key's type")


def check_nvme_paths(ds: dict, result: LintResult) -> None:
    section = ds.get("zero_optimization", {})
    for name in ("offload_optimizer", "offload_param"):
        offload = section.get(name) if isinstance(section, dict) else None
        if isinstance(offload, dict) and offload.get("device") == "nvme" and not offload.get("nvme_path"):
            result.findings.append(Finding("error", f"zero_optimization.{name}.nvme_path",
                                           "NVMe offload without nvme_path: DeepSpeed fails when it creates the swap files",
                                           f'add "nvme_path": "/local_nvme/ds" to {name}'))


def _nearest(loc: tuple, model) -> str:
    *parents, name = [str(p) for p in loc]
    for parent in parents:
        model = model.model_fields[parent].annotation
        model = next((a for a in getattr(model, "__args__", (model,)) if hasattr(a, "model_fields")), model)
    valid = [a for n, f in model.model_fields.items() for a in (n, f.alias) if a]
    # in the spelling given: stage3_prefetch_bucket -> stage3_prefetch_bucket_size (the JSON alias)
    near = difflib.get_close_matches(name, valid, n=1, cutoff=0.8) \
        or difflib.get_close_matches(name.removeprefix("stage3_"), valid, n=1, cutoff=0.5) \
        or difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    if name.startswith("stage3_offload"):
        return f'remove it; offload is configured as {{"{name.removeprefix("stage3_")}": {{"device": "cpu"}}}}'
    return f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(sorted(valid))}"


class _RecordingDict(dict):
    """A dict that remembers which keys were looked up (DeepSpeedConfig's reads)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: set = set()

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        parent = self

        class Keys(list):
            def __contains__(self, key):
                parent.seen.add(key)
                return list.__contains__(self, key)

        return Keys(super().keys())


def check_top_level(ds: dict, zero_ok: bool, result: LintResult) -> None:
    """Run DeepSpeedConfig over the dict, recording the keys it reads. Problems reported
    elsewhere (the zero section, the batch arithmetic, "auto" batch keys HF fills) are
    neutralised first so the parse runs to the end and every read is seen."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = {k: v for k, v in ds.items() if k not in OBJECT_SECTIONS or isinstance(v, dict)}  # named already
    if not zero_ok:
        probe["zero_optimization"] = {}
    # check_batch judges train_batch_size against the world size when the micro batch is set;
    # with only gradient_accumulation_steps beside it, DeepSpeed derives the micro batch from it
    if isinstance(ds.get("train_micro_batch_size_per_gpu"), int):
        probe.pop("train_batch_size", None)
    elif "train_batch_size" not in probe:
        probe["train_micro_batch_size_per_gpu"] = 1
    recorder = _RecordingDict(probe)
    try:
        DeepSpeedConfig(recorder)
    except Exception as e:  # DeepSpeed raises assertion and value errors of many kinds
        named = {f.key for f in result.findings}
        result.findings += [f for f in rejection_findings(e)
                            if not any(text in f.message and key in named for text, key in NAMED_REJECTIONS)]
        recorder = _RecordingDict({"train_micro_batch_size_per_gpu": 1})  # the keys it reads, from a parse
        DeepSpeedConfig(recorder)  # that runs to its end: the unknown keys are still named below
    known = sorted(recorder.seen | {"scheduler", "optimizer"})
    for key in ds:
        if key not in recorder.seen and key not in ("scheduler", "optimizer"):
            near = difflib.get_close_matches(key, [str(k) for k in known], n=1, cutoff=0.6)
            fix = f"did you mean {near[0]}?" if near else "remove it, or move it where it belongs"
            if key.startswith("stage3_") or key in ("offload_optimizer", "offload_param", "stage", "sub_group_size"):
                fix = 'move it into "zero_optimization"'
            result.findings.append(Finding("error", key, "DeepSpeed never reads this top-level key and ignores it silently",
                                           fix))


# DeepSpeed's refusals a check here already names with its own fix: (its words, the finding's key).
NAMED_REJECTIONS = (("bfloat16 and fp16 modes cannot be simultaneously enabled", "fp16.enabled, bf16.enabled"),)


def rejection_findings(error: Exception) -> list[Finding]:
    """DeepSpeed's refusal of a section, one finding per key it names (its sections are
    pydantic models titled DeepSpeed<Section>Config), or its own words for other errors."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        text = " ".join(str(error).split())
        return [Finding("error", "(config)", f"DeepSpeed rejects the config: {text}",
                        "fix the setting it names")]
    section = error.title.removeprefix("DeepSpeed").removesuffix("Config").lower()
    return schema_findings(section, error, f"not a key of DeepSpeed's {section} section")


def check_batch(ds: dict, world_size: int, result: LintResult, autos: list[str] = ()) -> None:
    micro, accum, total = (ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                               "train_batch_size"))
    if micro is None and total is None and not {"train_micro_batch_size_per_gpu", "train_batch_size"} & set(autos):
        result.findings.append(Finding(
            "error", "train_micro_batch_size_per_gpu", "neither it nor train_batch_size is set; DeepSpeed asserts at "
            "start (\"Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided\")",
            'set "train_micro_batch_size_per_gpu" (HF Trainer / LLaMA-Factory: "auto")'))
    if all(isinstance(v, int) for v in (micro, accum, total)) and micro * accum * world_size != total:
        result.findings.append(Finding(
            "error", "train_batch_size",
            f"{total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accum} x "
            f"{world_size} ranks; DeepSpeed asserts at start", f"set train_batch_size to {micro * accum * world_size}"))


def check_precision(ds: dict, result: LintResult) -> None:
    # a section that is not an object was named by check_section_objects: nothing more to say of it
    fp16, bf16 = ({} if not isinstance(ds.get(k), dict) else ds[k] for k in ("fp16", "bf16"))
    if fp16.get("enabled") is True:
        if bf16.get("enabled") is True:
            result.findings.append(Finding("error", "fp16.enabled, bf16.enabled", "both enabled; DeepSpeed refuses",
                                           "enable one (bf16 on Ampere and newer)"))
        if not any(k in fp16 for k in ("loss_scale", "initial_scale_power", "loss_scale_window")):
            result.findings.append(Finding(
                "warning", "fp16", "fp16 without loss-scale settings: DeepSpeed starts at 2^16 and halves on "
                "overflow, skipping steps silently; the settings are not visible in the config",
                'set "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, '
                '"min_loss_scale": 1 explicitly, or use bf16'))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ---------------------------------------------------------------------- report
def render(result: LintResult, console=None) -> None:
    from rich.console import Console

    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    for f in result.findings:
        colour = "red" if f.level == "error" else "yellow"
        console.print(f"[{colour}]{f.level}[/] {f.key}: {f.message}" + (f"\n  fix: {f.fix}" if f.fix else ""))
    if result.plan is not None:
        plan = result.plan
        verdict = "fits" if plan["fits"] else "does NOT fit"
        console.print(f"plan: {verdict}: GPU {human_bytes(plan['devices']['gpu']['total_bytes'])} of "
                      f"{human_bytes(plan['devices']['gpu']['usable_bytes'])} usable, host "
                      f"{human_bytes(plan['devices']['host']['total_bytes'])} of "
                      f"{human_bytes(plan['devices']['host']['usable_bytes'])} usable; "
                      f"save peak host {human_bytes(plan['save_peak']['host']['total_bytes'])}")
        shape, rank = plan["shape"], plan["trainer"]["lora_rank"]
        tuning = f"LoRA rank {rank}, {plan['model']['trainable_params']:,} parameters trained (--lora-rank)" \
            if rank else "full fine-tuning (--lora-rank R: a LoRA run)"
        console.print(f"  [dim]planned as: seq {shape['seq_len']} (--seq-len), micro batch {shape['micro_batch']} "
                      f"(--micro-batch, else the config's, else 1), {'' if shape['gradient_checkpointing'] else 'no '}"
                      f"activation checkpointing (--\\[no-]gradient-checkpointing), {tuning}, HF Trainer's loss[/]")
    errors, warnings = len(result.errors), len(result.findings) - len(result.errors)
    console.print(f"{result.path}: {errors} error(s), {warnings} warning(s)")
