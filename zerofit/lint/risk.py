"""`zerofit lint`'s second half: the values a DeepSpeed config runs with until the worst
moment (a save, the first step after it, a step overlapped with the CPU optimizer), with
the reason and the fix, in numbers when a model is given; and the config planned on that
model (what it would hold on this hardware), by translating it to zerofit's own config.
lint.py checks what DeepSpeed reads and ignores, and calls these."""
from __future__ import annotations

from zerofit.config.load import validate
from zerofit.core.timeline import human_bytes
from zerofit.lint.result import DS_DEFAULT_SUB_GROUP_SIZE, Finding, LintResult, TrainerArgs, is_number, parses_as_number
from zerofit.machine.hardware import GIB, Hardware
from zerofit.plan import choose, estimate, render
from zerofit.plan import spec as modelspec

LARGE_BUCKET_BYTES = 512 * 2**20        # without a budget: a bucket this big is worth a look
BUCKET_SHARE_OF_BUDGET = 0.05
LARGE_MODEL_PARAMS = 1_000_000_000      # where a 16-bit consolidation at save starts to hurt


def check_risky(ds: dict, zero, spec, hw: Hardware | None, result: LintResult, autos: list[str] = ()) -> None:
    """Values that work until the worst moment: a save, the first step after it."""
    section = ds.get("zero_optimization", {})
    a = weight_bytes(ds)
    N = spec.total_params if spec is not None else None
    offload_opt = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    if zero.stage == 3 and zero.gather_16bit_weights_on_model_save and (N is None or N >= LARGE_MODEL_PARAMS):
        size = f" ({human_bytes(a * N)} for this model)" if N else ""
        result.findings.append(Finding(
            "warning", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            f"every save gathers the whole 16-bit model into rank 0's host RAM{size} and stalls training "
            "while it is written", "set it false and export after training (`zerofit export`, or DeepSpeed's "
            "zero_to_fp32.py)"))
    if zero.stage == 3 and not offload_opt:
        groups = min(zero.sub_group_size, N) if N else zero.sub_group_size
        temporaries = (a + 4) * groups
        if temporaries >= 2 * GIB:
            implicit = "" if "sub_group_size" in section else f" (absent: DeepSpeed's default {DS_DEFAULT_SUB_GROUP_SIZE:.0e})"
            result.findings.append(Finding(
                "warning", "zero_optimization.sub_group_size",
                f"sub_group_size {zero.sub_group_size:.0e}{implicit} without optimizer offload: each optimizer "
                f"step allocates up to {human_bytes(temporaries)} of fp32 gradient temporaries on the GPU "
                "(stage3.py _prepare_fp32_grad_for_sub_group), on top of the training peak and most often "
                "fatal in the first step after a save", 'set "sub_group_size": 1e8'))
    budget = hw.gpu_budget_bytes if hw is not None and hw.on_gpu else None
    # engine._configure_zero_optimizer hands reduce_bucket_size to the stage 1-3 optimizers only:
    # stage 0 never allocates the bucket.
    for key, numel in (("reduce_bucket_size", zero.reduce_bucket_size if zero.stage >= 1 else 0),
                       ("stage3_prefetch_bucket_size", zero.prefetch_bucket_size if zero.stage == 3 else 0)):
        nbytes = a * numel
        limit = BUCKET_SHARE_OF_BUDGET * budget if budget else LARGE_BUCKET_BYTES
        if nbytes >= limit and f"zero_optimization.{key}" not in autos:
            implicit = "" if key in section or key.removeprefix("stage3_") in section else " (DeepSpeed's default)"
            share = f", {nbytes / budget:.0%} of the {human_bytes(budget)} GPU budget" if budget else ""
            h = spec.hidden_size if spec is not None else None
            fix = f"set {key} to hidden^2 = {h * h:.2e} (HF's auto value)" if h else "set it to hidden_size^2 (HF's auto value)"
            result.findings.append(Finding("warning", f"zero_optimization.{key}",
                                           f"{numel:.2e} elements = {human_bytes(nbytes)} resident{implicit}{share}", fix))
    if zero.stage < 3 and zero.offload_param is not None and zero.offload_param.device != "none":
        result.findings.append(Finding("warning", "zero_optimization.offload_param",
                                       f"parameter offload needs stage 3; stage {zero.stage} ignores it", "use stage 3"))


def check_step_overlap(ds: dict, zero, spec, result: LintResult, autos: list[str] = ()) -> None:
    """DeepSpeed 0.19.8's two ways to overlap the CPU optimizer step with the GPU, and what
    each cost where it was measured (bench/results/README.md)."""
    clip = ds.get("gradient_clipping")  # text that is no number was named by check_numbers
    clipping = "gradient_clipping" in autos or (parses_as_number(clip) or is_number(clip)) and float(clip) > 0
    offload = zero.offload_optimizer
    if zero.stage == 3 and offload is not None and getattr(offload, "super_offload", False):
        speed = ("with gradient_clipping > 0 (here) it steps every sub group after the backward, one by one: 0.48x"
                 if clipping else "without clipping its Adam overlapped the backward but ran 0.69x")
        result.findings.append(Finding(
            "warning", "zero_optimization.offload_optimizer.super_offload",
            "SuperOffload keeps Adam's moments in a worker process (superoffload_utils.py) that DeepSpeed's "
            "checkpoints do not read: its checkpoint held no exp_avg / exp_avg_sq where the same run without it "
            "held 16 tensors (bench/results/overlap_loss.json), so a resume restarts Adam from zero; and "
            f"{speed} the tokens/s of the same config without it (llama-3.6b under 24 GiB, "
            "bench/results/speed-3.6b-levers-run2.json)",
            "leave super_offload off unless you have measured it on your machine and never resume its checkpoints"))
    if zero.stage == 3 and getattr(zero, "zenflow", None) is not None:
        result.findings.append(zenflow_finding(zero, spec))


def zenflow_finding(zero, spec) -> Finding:
    """What DeepSpeed 0.19.8's ZenFlow needs under ZeRO-3 and what it bought
    (engine.zenflow_refusal; bench/results/README.md)."""
    largest = spec.largest_trained_matrix if spec is not None else None
    bucket = ("" if largest is None else
              f"; here {largest.name} has {largest.numel:,} elements against a reduce_bucket_size of "
              f"{int(zero.reduce_bucket_size):,}" + (": it would fail" if largest.numel > zero.reduce_bucket_size else ""))
    return Finding(
        "warning", "zero_optimization.zenflow",
        "ZenFlow with ZeRO-3 transposes the 2-D weights at engine start only if they are not partitioned yet: "
        "a model built under deepspeed.zero.Init (as HF Trainer builds it with ZeRO-3) fails in its first forward "
        "('mat1 and mat2 shapes cannot be multiplied'); activation checkpointing fails in the recompute (the "
        "weights transposed again); a 2-D weight larger than reduce_bucket_size is reduced transposed and the first "
        f"backward fails ('view size is not compatible'){bucket}. Where it ran (llama-1.5b, micro 4 x 4, no "
        "checkpointing, 24 GiB) it was 0.61x the same step without it and 0.37x zerofit's plan "
        "(bench/results/speed-1.5b-24-zenflow.json); llama-3.6b was killed at 101.3 GiB of host RSS on a 125 GiB "
        "host. It is also another optimizer: each step updates only the top-k gradient columns on the GPU, the "
        "rest every update_interval steps, and its checkpoints hold no Adam moments",
        "remove zenflow; to try it, build the model outside deepspeed.zero.Init (zerofit does when zenflow is set), "
        "turn activation checkpointing off and set reduce_bucket_size to at least "
        + (f"{largest.numel}" if largest is not None else "the largest weight's elements"))


def check_deepcompile(ds: dict, zero, spec, hw: Hardware | None, world_size: int, result: LintResult) -> None:
    """DeepSpeed 0.19.8's DeepCompile (the `compile` section, read when the training script
    calls engine.compile()): the offload combinations its engine refuses there (compile/
    init_z3.py, engine.get_deepcompile_backend), and what `offload_opt_states` holds on the GPU:
    offload_opt_states_inc (compile/passes/offload_adam_states.py) reloads every state it moved
    out before the backward ends, and the optimizer then steps on the GPU over all of them.
    Read from DeepSpeed's source, then run with bench/deepcompile_probe.py (bench/results/README.md)."""
    from deepspeed.compile.config import CompileConfig

    section = ds.get("compile")
    if not isinstance(section, dict):  # absent, or not an object (check_section_objects names that)
        return
    try:
        dc = CompileConfig(**section)
    except ValueError:  # an unknown key or a wrong type (pydantic's ValidationError): the schema check names it
        return
    if not dc.deepcompile or zero.stage == 0:  # stage 0 falls back to torch.compile
        return
    if zero.stage < 3:
        if dc.offload_opt_states:
            result.findings.append(Finding(
                "warning", "compile.offload_opt_states",
                f"stage {zero.stage}'s DeepCompile (compile/init_z1_and_2.py) does not read it: the optimizer states "
                "stay on the GPU", "use stage 3, or remove it"))
        return
    optimizer_device = _device(zero.offload_optimizer)
    # the engine turns offload_parameters on itself where ZeRO offloads both to the CPU
    implied = optimizer_device == "cpu" and _device(zero.offload_param) == "cpu" and not dc.offload_parameters
    if dc.offload_activation and (dc.offload_opt_states or dc.offload_parameters or implied):
        result.findings.append(Finding(
            "error", "compile.offload_activation",
            "DeepSpeed refuses offload_activation beside offload_opt_states or offload_parameters at engine.compile()"
            + (" (offload_parameters: the engine turns it on when zero_optimization offloads both the optimizer "
               "and the parameters to the CPU)" if implied else ""),
            "keep one offloading target: remove offload_activation, or the other"))
    if not dc.offload_opt_states:
        return
    if optimizer_device != "none":
        result.findings.append(Finding(
            "error", "compile.offload_opt_states",
            f"DeepSpeed refuses it at engine.compile() beside zero_optimization.offload_optimizer on {optimizer_device}: "
            "both manage the optimizer states", "remove compile.offload_opt_states (ZeRO's offload keeps the states on "
            "the host through the step), or set offload_optimizer's device to none"))
        return
    if dc.offload_parameters:
        result.findings.append(Finding(
            "error", "compile.offload_opt_states", "DeepSpeed refuses it beside compile.offload_parameters",
            "keep one of the two"))
        return
    _deepcompile_step_finding(ds, spec, hw, world_size, result)


# DeepCompile's schedule starts the offload at step 1 (compile/init_z3.py), so step 0 holds every
# state on the GPU as well (an OOM under a cap below them; bench/deepcompile_probe.py).
DEEPCOMPILE_STEP = ("DeepCompile offloads the optimizer states during the forward and backward only, from its second "
                    "step on, and steps on the GPU with all of them back")


def _deepcompile_step_finding(ds: dict, spec, hw: Hardware | None, world_size: int, result: LintResult) -> None:
    """offload_opt_states moves states out for the forward and backward only: the step holds
    the 16-bit weights and gradients, the fp32 masters and both Adam moments of each rank's
    partition, (2a + 12) bytes a parameter over the ranks."""
    a = weight_bytes(ds)
    holds = f"{2 * a + 12} bytes per parameter of each rank's partition"
    budget = hw.gpu_budget_bytes if hw is not None and hw.on_gpu else None
    accumulation = ds.get("gradient_accumulation_steps")
    cycles = (f"; with gradient_accumulation_steps {accumulation} the offload and reload run every micro batch "
              "(DeepSpeed: designed for accumulation 1)" if is_number(accumulation) and accumulation > 1 else "")
    if spec is not None:
        step_bytes = (2 * a + 12) * spec.total_params / world_size
        holds = f"{human_bytes(step_bytes)} a rank for this model"
        if budget is not None and step_bytes > budget:
            result.findings.append(Finding(
                "error", "compile.offload_opt_states",
                f"{DEEPCOMPILE_STEP}: {holds}, more than the {human_bytes(budget)} GPU budget", "offload the "
                "optimizer with ZeRO (zero_optimization.offload_optimizer cpu) and remove compile.offload_opt_states, "
                "or add ranks"))
            return
        if not cycles:
            return
    result.findings.append(Finding(
        "warning", "compile.offload_opt_states",
        f"{DEEPCOMPILE_STEP} ({holds}); it sizes what stays resident by the device's whole memory, not a process's memory "
        f"fraction (DS_DC_OFFLOAD_OPT_BUDGET_GB overrides it){cycles}",
        "lint with --model and --gpu-mem to see whether the step fits" if spec is None else
        "use gradient_accumulation_steps 1 with a larger micro batch"))


def check_partial_offload(zero, result: LintResult) -> None:
    """A partial optimizer offload beside offloaded parameters: the GPU-stepped sub-groups'
    fp32 masters go to the host's 16-bit parameters by a blocking pageable copy
    (hardware.COPY_OUT_BYTES_PER_S)."""
    offload = zero.offload_optimizer
    ratio = getattr(offload, "ratio", 1.0) if offload is not None else 1.0
    if zero.stage == 3 and ratio < 1.0 and _device(offload) == "cpu" and _device(zero.offload_param) != "none":
        result.findings.append(Finding(
            "warning", "zero_optimization.offload_optimizer.ratio",
            f"ratio {ratio} with offload_param on {_device(zero.offload_param)}: after each step the sub-groups "
            "stepped on the GPU copy their fp32 masters into the host's 16-bit parameters through a pageable "
            "temporary (stage3.py _reassign_or_swap_out_partitioned_parameters), ~1.1 GB/s; llama-3.6b at ratio "
            "0.75 ran 6.07 s a step against 2.66 s with the whole optimizer on the CPU "
            "(bench/results/speed-3.6b-40-run1.json)",
            "remove ratio (the whole optimizer on the CPU), or keep the parameters on the GPU (offload_param none)"))


def check_offload_stage(zero, result: LintResult) -> None:
    """Offload devices the stage does not honour, without a word from DeepSpeed: stages 1 and
    2 offload the optimizer to the CPU for any device but none (stage_1_and_2.py: cpu_offload =
    device != none), so nvme swaps nothing; stage 0 has no ZeRO optimizer to offload."""
    device = _device(zero.offload_optimizer)
    if zero.stage in (1, 2) and device == "nvme":
        result.findings.append(Finding(
            "warning", "zero_optimization.offload_optimizer.device",
            f"nvme under stage {zero.stage}: DeepSpeed's stage 1/2 optimizer keeps its states in CPU memory for any "
            "offload device (stage_1_and_2.py), so nothing goes to NVMe and host RAM must hold them all",
            'use stage 3 for NVMe offload, or write "cpu" to say what happens'))
    elif zero.stage == 0 and device != "none":
        result.findings.append(Finding(
            "warning", "zero_optimization.offload_optimizer",
            f"{device} under stage 0: there is no ZeRO optimizer to offload, so DeepSpeed ignores it and the optimizer "
            "states stay on the GPU", "use stage 1 or higher to offload the optimizer, or remove offload_optimizer"))


# -------------------------------------------------------------------- planning
def to_zerofit(ds: dict, zero, trainer: TrainerArgs, model_ref: str, auto_values: dict[str, int] | None = None) -> dict:
    """The zerofit config (raw dict) that reproduces what this DeepSpeed JSON sets; keys
    it leaves out take DeepSpeed's defaults (read from DeepSpeed's own config model);
    bucket keys set to "auto" take what HF Trainer would fill in (`auto_values`). The run is
    HF Trainer's: its own loss (vocab-sized fp32 logits, not zerofit.loss) and the allocator's
    fixed segments, unless its user sets PYTORCH_CUDA_ALLOC_CONF as zerofit does."""
    auto_values = auto_values or {}
    opt, par = zero.offload_optimizer, zero.offload_param
    nvme = (opt.nvme_path if opt is not None and opt.nvme_path else None) or (par.nvme_path if par is not None else None)
    lora = {"enabled": True, "r": trainer.lora_rank, "alpha": 2 * trainer.lora_rank,
            "target_modules": trainer.lora_targets} if trainer.lora_rank else {}
    return {
        "model": {"config": model_ref, "gradient_checkpointing": trainer.gradient_checkpointing},
        "lora": lora,
        "train": {"seq_len": trainer.seq_len, "max_steps": 1, "precision": precision(ds),
                  "micro_batch_size": trainer.micro_batch or ds.get("train_micro_batch_size_per_gpu") or 1,
                  "grad_accum_steps": ds.get("gradient_accumulation_steps") or 1, "chunked_loss": False},
        "memory": {"expandable_segments": False},
        "zero": {"stage": int(zero.stage), "offload_optimizer": _device(opt),
                 "offload_optimizer_ratio": float(opt.ratio) if opt else 1.0,
                 "offload_param": _device(par),
                 "nvme_path": str(nvme) if nvme else None,
                 "pin_memory": bool(opt.pin_memory) if opt else True,
                 "reduce_bucket_size": auto_values.get("reduce_bucket_size", int(zero.reduce_bucket_size)),
                 "prefetch_bucket_size": auto_values.get("prefetch_bucket_size", int(zero.prefetch_bucket_size)),
                 "param_persistence_threshold": auto_values.get("param_persistence_threshold",
                                                                int(zero.param_persistence_threshold)),
                 "max_live_parameters": int(zero.max_live_parameters),
                 "max_reuse_distance": int(zero.max_reuse_distance), "sub_group_size": int(zero.sub_group_size),
                 "gather_16bit_weights_on_save": bool(zero.gather_16bit_weights_on_model_save)},
        "checkpoint": {"save_final": False},
        "plan": {"enabled": False},
    }


def weight_bytes(ds: dict) -> int:
    """Bytes of one training-precision weight or gradient: 4 in fp32, else 2."""
    return 4 if precision(ds) == "fp32" else 2


def precision(ds: dict) -> str:
    """bf16 when its section is there and not disabled ("auto" counts: HF turns it on with
    --bf16), fp16 when enabled, fp32 otherwise."""
    if _section(ds, "bf16").get("enabled", "bf16" in ds):
        return "bf16"
    return "fp16" if _section(ds, "fp16").get("enabled") else "fp32"


def _section(ds: dict, key: str) -> dict:
    """A section as an object; one that is not (`"bf16": true`, an error check_section_objects
    reports) reads as its value for "enabled", the way its writer meant it."""
    value = ds.get(key, {})
    return value if isinstance(value, dict) else {"enabled": value}


def _device(offload) -> str:
    if offload is None:
        return "none"
    return str(getattr(offload.device, "value", offload.device))


def plan_ds_config(ds: dict, zero, spec, hw: Hardware, world_size: int, trainer: TrainerArgs, model_ref: str,
                   autos: list[str] = ()) -> dict:

    names = {"reduce_bucket_size": "reduce_bucket_size", "stage3_prefetch_bucket_size": "prefetch_bucket_size",
             "stage3_param_persistence_threshold": "param_persistence_threshold"}
    hf_auto = estimate.auto_buckets(spec)
    auto_values = {ours: hf_auto[ours] for theirs, ours in names.items() if f"zero_optimization.{theirs}" in autos}
    config = validate(to_zerofit(ds, zero, trainer, model_ref or "tiny", auto_values))
    if config.lora.enabled:  # the peft model: adapters trained, the base frozen
        spec = modelspec.from_config(config)
    decision = choose.decide(config, spec, hw, world_size)
    return render.plan_json(decision, spec, hw) | {"fits": decision.plan.fits, "trainer": trainer._asdict()}
