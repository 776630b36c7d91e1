"""The fixes a finding or an OOM names, in the run's own terms: zerofit's keys for its runs,
TrainingArguments, the DeepSpeed JSON and the environment for an HF Trainer run read by
`zerofit doctor` (HF_NAMES); and per phase and device the likely cause and the fixes, most
effective first, tailored to what the run's DeepSpeed config already does. Pure: no I/O."""
from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit.findings.facts import gib

if TYPE_CHECKING:
    from zerofit.findings.facts import RunFacts


# zerofit's keys as an HF Trainer run sets them (TrainingArguments, the DeepSpeed JSON, the environment)
HF_NAMES = {
    "train.micro_batch_size": "per_device_train_batch_size",
    "grad_accum_steps": "gradient_accumulation_steps",
    "model.gradient_checkpointing: true": "gradient_checkpointing=True (TrainingArguments)",
    "zero.offload_param: cpu": 'zero_optimization.offload_param: {"device": "cpu"}',
    "zero.offload_optimizer: cpu": 'zero_optimization.offload_optimizer: {"device": "cpu"}',
    "zero.offload_optimizer: nvme, zero.nvme_path: /fast/disk":
        'zero_optimization.offload_optimizer: {"device": "nvme", "nvme_path": "/fast/disk"}',
    "zero.pin_memory: false": "pin_memory: false in zero_optimization.offload_optimizer / offload_param",
    "zero.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero.sub_group_size: 100000000": "zero_optimization.sub_group_size: 100000000",
    "zero.gather_16bit_weights_on_save: false": "zero_optimization.stage3_gather_16bit_weights_on_model_save: false",
    "memory.expandable_segments: true": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
}


def setting(facts: RunFacts, key: str) -> str:
    """`key` (zerofit's name of a setting) as the run's user sets it."""
    return HF_NAMES.get(key, key) if facts.source == "hf-trainer" else key


def expandable_segments_setting(facts: RunFacts) -> str:
    """How to turn expandable segments on: zerofit's key for its runs (on by default), the
    allocator's variable for others (HF Trainer through `zerofit doctor`)."""
    return setting(facts, "memory.expandable_segments: true")


def phase_advice(phase: str, device: str, facts: RunFacts) -> tuple[str, list[str]]:
    """The likely cause of a peak (or an OOM) in `phase` and the fixes, most effective
    first, tailored to what the run's DeepSpeed config already does."""
    micro = facts.ds_config.get("train_micro_batch_size_per_gpu")
    if device == "host":
        fix = []
        if facts.zero.get("offload_optimizer", {}).get("pin_memory") or facts.zero.get("offload_param", {}).get(
                "pin_memory"):
            fix.append(f"{setting(facts, 'zero.pin_memory: false')} (pinned offload buffers can never be swapped out)")
        if facts.gathers_on_save():
            fix.append("turn off stage3_gather_16bit_weights_on_model_save (it builds the whole 16-bit model "
                       "in host RAM at each save) and export at the end")
        fix += [f"offload to NVMe instead of RAM ({setting(facts, 'zero.offload_optimizer: nvme, zero.nvme_path: /fast/disk')})",
                "fewer ranks per node, or more host RAM"]
        return "host RAM holds the offloaded optimizer states and parameters, pinned buffers and save copies", fix
    if phase in ("forward", "backward", "forward_backward", "eval"):
        fix = []
        if micro and micro > 1:
            fix.append(f"halve {setting(facts, 'train.micro_batch_size')} ({micro} -> {micro // 2}) and double "
                       f"{setting(facts, 'grad_accum_steps')} (same global batch)")
        if facts.gradient_checkpointing() is False:
            fix.append(f"{setting(facts, 'model.gradient_checkpointing: true')} (recompute activations in backward)")
        if facts.offloaded("param") == "none" and facts.zero.get("stage") == 3:
            fix.append(f"{setting(facts, 'zero.offload_param: cpu')} (parameters live in host RAM between uses)")
        fix.append(f"lower {setting(facts, 'zero.prefetch_bucket_size')} and {setting(facts, 'zero.max_live_parameters')}"
                   f" (fewer gathered parameters at once)")
        return ("activations (micro batch x sequence length x hidden, and the logits at vocabulary size) "
                "plus the ZeRO-3 parameters gathered for the current layers"), fix
    if phase == "optimizer_step":
        fix = []
        if facts.sub_group_size() >= 500_000_000:
            fix.append(f"zero_optimization.sub_group_size {facts.sub_group_size():.0e} -> 1e8 "
                       f"({setting(facts, 'zero.sub_group_size: 100000000')})")
        if facts.offloaded("optimizer") == "none":
            fix.append(f"{setting(facts, 'zero.offload_optimizer: cpu')} (fp32 master weights and Adam moments in host RAM)")
        if not facts.expandable_segments_on:
            fix.append(expandable_segments_setting(facts))
        return "the optimizer step's fp32 temporaries (per sub group) on top of the held gradients", fix
    if phase == "save":
        fix = ["turn off stage3_gather_16bit_weights_on_model_save and export at the end (`zerofit export`)"] \
            if facts.gathers_on_save() else []
        fix.append("torch.cuda.empty_cache() before saving, so the save's buffers find room")
        return "the checkpoint save gathers parameters and builds state-dict copies", fix
    return "memory use reached the budget", ["see the timeline for the phase that peaks"]


def others_memory_advice(run_rss: int, others: int, budget: int, facts: RunFacts) -> tuple[str, list[str]]:
    """The cause and fixes when other processes, not the run, hold most of the machine's RAM
    (the watchdog counts machine-wide use against the machine: what the OOM killer sees)."""
    cause = (f"other processes use {gib(others)} of the {gib(budget)} {host_budget_name(facts)}; this run's own "
             f"RSS peaked at {gib(run_rss)}, so the machine, not the run, is short of RAM")
    fix = ["stop or move the other jobs on this machine (`ps aux --sort=-rss | head` names the largest), or run "
           "where the RAM is free: the kernel's OOM killer may pick this run when the machine runs out",
           f"give the run a budget of its own, {setting(facts, 'plan.host_mem: <what it may take>')}: the watchdog "
           f"then counts this run's RSS instead of the whole machine's use"]
    return cause, fix


def host_budget_name(facts: RunFacts) -> str:
    """What the host budget the watchdog measures against is: plan.host_mem, a cgroup's limit
    or the machine's RAM."""
    if not facts.host_budget_is_machine:
        return "plan.host_mem budget"
    return "cgroup memory limit" if facts.host_limit else "machine RAM"
