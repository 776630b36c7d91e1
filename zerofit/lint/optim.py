"""`zerofit lint`'s checks of the optimizer and scheduler sections, as DeepSpeed 0.19.8 builds
them: the keys it reads there, the Adam it picks (torch's, DeepSpeedCPUAdam or FusedAdam) and
the keyword arguments that one takes, the scheduler's arguments, numbers written as text.
"""
from __future__ import annotations

import difflib
import json

from zerofit.lint.result import Finding, LintResult, is_number, parses_as_number

# The optimizer and scheduler sections: config.py get_optimizer_name/params and
# get_scheduler_name/params read "type" and "params" (and the optimizer's legacy_fusion);
# any other key there is ignored without a word.
OPTIMIZER_SECTION_KEYS = ("type", "params", "legacy_fusion")
SCHEDULER_SECTION_KEYS = ("type", "params")
# Keys engine._configure_basic_optimizer / get_optimizer_configuration pop before it builds
# Adam or AdamW; the rest go as keyword arguments to the Adam it builds (built_adam).
ADAM_POPPED_KEYS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states", "foreach")
ADAM_NUMBERS = ("lr", "eps", "weight_decay")
TORCH_ADAM = "torch's Adam"
ADAM_BOOLEANS = ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "bias_correction", "amsgrad", "set_grad_none",
                 "foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def section_params(ds: dict, name: str, known: tuple, example: str, result: LintResult) -> tuple[dict, dict] | None:
    """The optimizer's or scheduler's section and its params, their keys checked; None when
    either is not an object (absent, or named as such here or by check_section_objects)."""
    section = ds.get(name)
    if not isinstance(section, dict):
        return None
    check_section_keys(name, section, known, result)
    params = section.get("params", {})
    if not isinstance(params, dict):
        result.findings.append(Finding("error", f"{name}.params", f"must be an object, not {json.dumps(params)}",
                                       f'"params": {example}'))
        return None
    return section, params


def check_optimizer(ds: dict, result: LintResult) -> None:
    found = section_params(ds, "optimizer", OPTIMIZER_SECTION_KEYS, '{"lr": 1e-5}', result)
    if found is None:
        return
    section, params = found
    if "type" not in section:  # config.py get_optimizer_params: no type, no params read
        result.findings.append(Finding("error", "optimizer.type", "missing: DeepSpeed ignores the optimizer "
                                       "section without it", '"type": "AdamW"'))
    kind = str(section.get("type", "")).lower()
    if kind in ("adam", "adamw"):  # DeepSpeed lower-cases its own optimizer names (config.py)
        check_adam_params(ds, params, result)
    check_numeric_strings("optimizer.params", params, result)


def check_adam_params(ds: dict, params: dict, result: LintResult) -> None:
    if "max_grad_norm" in params:  # engine._configure_basic_optimizer raises ValueError on it
        result.findings.append(Finding("error", "optimizer.params.max_grad_norm", "DeepSpeed refuses it in the "
                                       "optimizer (ValueError)", 'remove it; set top-level "gradient_clipping"'))
    for key in ADAM_BOOLEANS:
        if isinstance(params.get(key), str):  # the engine tests it with `if`: "false" is a true value
            result.findings.append(Finding("error", f"optimizer.params.{key}", f"is the text {params[key]!r}, which "
                                           "DeepSpeed reads as true (any non-empty text is)",
                                           f"write {params[key].strip().lower()} without quotes"))
    built, valid = built_adam(ds, params)
    torch_only = torch_adam_keys() - valid
    for key in params:
        if key in valid or key == "max_grad_norm":
            continue
        if key in torch_only:
            fix = f'only torch\'s Adam takes it: add "torch_adam": true (slower than {built}) or remove it'
        else:
            near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
            fix = f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(sorted(valid))}"
        result.findings.append(Finding("error", f"optimizer.params.{key}",
                                       f"not an argument of {built}, the Adam DeepSpeed builds for this config: "
                                       "it fails building it", fix))
    if params.get("amsgrad") is True and built != TORCH_ADAM:
        result.findings.append(Finding("error", "optimizer.params.amsgrad", f"{built} raises on it (no AMSGrad "
                                       "variant)", 'remove it, or add "torch_adam": true for torch\'s AMSGrad'))
    for key in ADAM_NUMBERS:
        if key in params and not is_number(params[key]):
            result.findings.append(number_finding(f"optimizer.params.{key}", params[key]))
    betas = params.get("betas")
    if "betas" in params and not (isinstance(betas, list) and len(betas) == 2 and all(map(is_number, betas))):
        result.findings.append(Finding("error", "optimizer.params.betas", f"must be two numbers (got {betas!r})",
                                       '"betas": [0.9, 0.999]'))


def built_adam(ds: dict, params: dict) -> tuple[str, set[str]]:
    """The Adam DeepSpeed builds for type Adam/AdamW and the keys its params may hold
    (engine.get_optimizer_configuration, 0.19.8): torch's with "torch_adam" (tested for truth),
    else DeepSpeedCPUAdam when the optimizer is offloaded to cpu or nvme (ZenFlow's wraps it),
    else FusedAdam. The engine pops ADAM_POPPED_KEYS first and passes the mode itself:
    adamw_mode set by the user is a duplicate argument of the CPU Adam."""
    import inspect

    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    if params.get("torch_adam"):
        return TORCH_ADAM, torch_adam_keys()
    section = ds.get("zero_optimization")
    section = section if isinstance(section, dict) else {}
    offload = section.get("offload_optimizer")
    offloaded = section.get("cpu_offload") is True or (isinstance(offload, dict)
                                                        and offload.get("device") in ("cpu", "nvme"))
    cls, own = (DeepSpeedCPUAdam, {"self", "model_params", "adamw_mode"}) if offloaded else \
        (FusedAdam, {"self", "params", "adam_w_mode"})
    keys = set(inspect.signature(cls.__init__).parameters) - own
    return cls.__name__, keys | set(ADAM_POPPED_KEYS) - {"foreach"}  # foreach is popped for torch's Adam alone


def torch_adam_keys() -> set[str]:
    """What torch's Adam and AdamW take, with the keys the engine pops (foreach among them)."""
    import inspect

    import torch

    keys = {name for cls in (torch.optim.Adam, torch.optim.AdamW)
            for name in inspect.signature(cls.__init__).parameters}
    return (keys - {"self", "params"}) | set(ADAM_POPPED_KEYS)


def check_scheduler(ds: dict, result: LintResult, autos: list[str] = ()) -> None:
    """The scheduler's params are keyword arguments of lr_schedules.<type> (or torch's
    lr_scheduler.<type>): engine._scheduler_from_config calls it as scheduler(optimizer, **params)."""
    found = section_params(ds, "scheduler", SCHEDULER_SECTION_KEYS, '{"warmup_num_steps": 100}', result)
    if found is None:
        return
    section, params = found
    arguments = scheduler_arguments(str(section.get("type", "")))
    if arguments is not None:
        check_scheduler_params(str(section["type"]), params, arguments, result, autos)
    check_numeric_strings("scheduler.params", params, result)


def scheduler_arguments(name: str) -> dict | None:
    """The scheduler's keyword arguments (inspect.Parameter by name), without self and the
    optimizer the engine passes; None for a type DeepSpeed looks up nowhere we can read."""
    import inspect

    import torch
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, name, None) if name else None
    if cls is None and name:
        cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        return None
    parameters = inspect.signature(cls.__init__).parameters
    return {n: p for n, p in parameters.items()
            if n not in ("self", "optimizer") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def check_scheduler_params(name: str, params: dict, arguments: dict, result: LintResult, autos) -> None:
    meant = set()
    for key in params:
        if key in arguments:
            continue
        near = difflib.get_close_matches(key, sorted(arguments), n=1, cutoff=0.6)
        meant.update(near)
        result.findings.append(Finding("error", f"scheduler.params.{key}",
                                       f"{name} takes no {key}: DeepSpeed fails building the scheduler",
                                       f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(sorted(arguments))}"))
    for key, argument in arguments.items():
        required = argument.default is argument.empty
        filled = key in params or f"scheduler.params.{key}" in autos  # HF Trainer fills "auto"
        if required and not filled and key not in meant:  # a misspelt one is named above
            result.findings.append(Finding("error", f"scheduler.params.{key}", f"{name} requires it: DeepSpeed "
                                           "fails building the scheduler", f'add "{key}" to scheduler.params'))
        numeric = argument.annotation in (int, float) or (is_number(argument.default) and argument.default is not None)
        if key in params and numeric and not is_number(params[key]):
            result.findings.append(number_finding(f"scheduler.params.{key}", params[key]))


def check_section_keys(section: str, node: dict, known: tuple, result: LintResult) -> None:
    for key in node:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            result.findings.append(Finding("error", f"{section}.{key}", f"DeepSpeed never reads it in {section} "
                                           "and ignores it silently", f"did you mean {near[0]}?" if near
                                           else f"{section} takes only {', '.join(known)}"))


def check_numeric_strings(section: str, params: dict, result: LintResult) -> None:
    """Any optimizer: a number written as a string ("1e-5") reaches the optimizer as text and
    fails its first comparison, at the latest in the first step. Keys already named are skipped."""
    named = {f.key for f in result.findings}
    for key, value in params.items():
        if f"{section}.{key}" not in named and isinstance(value, str) and parses_as_number(value):
            result.findings.append(number_finding(f"{section}.{key}", value))


def number_finding(key: str, value) -> Finding:
    fix = f"write the number ({key.rsplit('.', 1)[-1]}: {value})" if parses_as_number(value) else "write a number"
    return Finding("error", key, f"must be a number (got {value!r}): DeepSpeed passes it on as it is and fails "
                   "when it is first used", fix)
