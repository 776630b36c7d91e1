"""What would fit when nothing does: for each device over its budget, the changes to the
closest plan that bring it under (each planned again with the same plan.headroom, with what it
still leaves over elsewhere), then the memory it would take as it is. choice.decide asks for it
and choice.refuse prints it. Pure, as the planner is.
"""
from __future__ import annotations

from dataclasses import replace

from zerofit.core.timeline import human_bytes
from zerofit.machine.hardware import Hardware
from zerofit.nvme.swaplayout import bandwidth_to_hide
from zerofit.plan.estimate import Candidate, Plan, Shape, all_persistent, auto_buckets, predict
from zerofit.plan.loadpeak import LOADING, load_fix
from zerofit.plan.spec import ModelSpec
from zerofit.plan.states import swap_layout

WORLD_SIZES_TO_SUGGEST = (2, 4, 8, 16, 32, 64)


def what_would_fit(plan: Plan, spec: ModelSpec, hw: Hardware, headroom: float) -> list[str]:
    """For each device over budget, the changes that bring it under (planned with the same
    plan.headroom), each with the number it needs; then the memory it would take without changes."""
    shape, cand = plan.shape, plan.candidate
    over = [name for name in ("gpu", "host", "disk", "nvme") if name in plan.devices and not plan.devices[name].fits]

    def fixes(device: str, s: Shape = shape, c: Candidate = cand, h: Hardware = hw) -> Plan | None:
        p = predict(spec, h, s, c, headroom)
        return p if p.devices[device].fits else None

    # every parameter persistent is the planner's pick for one rank holding its parameters
    # (all_persistent); with them offloaded or partitioned over ranks it would keep them all on
    # each GPU, so an alternative that changes either has the threshold it would be planned with
    partitioned = replace(cand, param_persistence_threshold=auto_buckets(spec)["param_persistence_threshold"]) \
        if cand.param_persistence_threshold == all_persistent(spec) else cand

    advice = []
    if "gpu" in over:
        if not shape.gradient_checkpointing and (p := fixes("gpu", replace(shape, gradient_checkpointing=True))):
            advice.append("gpu: model.gradient_checkpointing=true" + still_over(p, "gpu"))
        if shape.micro_batch > 1:
            one = replace(shape, micro_batch=1, grad_accum=shape.grad_accum * shape.micro_batch)
            if p := fixes("gpu", one):
                advice.append(f"gpu: train.micro_batch_size=1 with train.grad_accum_steps={one.grad_accum} "
                              f"(same global batch)" + still_over(p, "gpu"))
        seq = _largest_fitting_seq(shape, lambda n: fixes("gpu", replace(shape, seq_len=n)) is not None)
        if seq:
            advice.append(f"gpu: train.seq_len={seq} (the longest multiple of 64 that fits)"
                          + still_over(fixes("gpu", replace(shape, seq_len=seq)), "gpu"))
        if cand.stage == 3 and hw.on_gpu:
            for opt, par in (("cpu", "none"), ("cpu", "cpu")):
                other = replace(cand if par == "none" else partitioned, offload_optimizer=opt, offload_param=par,
                                offload_optimizer_ratio=1.0)
                for s in (shape, replace(shape, gradient_checkpointing=True)):
                    p = fixes("gpu", s, other)
                    if (opt, par, s) != (cand.offload_optimizer, cand.offload_param, shape) and p:
                        ckpt = " model.gradient_checkpointing=true" if s is not shape else ""
                        advice.append(f"gpu: zero.offload_optimizer={opt} zero.offload_param={par}{ckpt} "
                                      f"(GPU {human_bytes(p.devices['gpu'].total_bytes)}, host "
                                      f"{human_bytes(p.devices['host'].total_bytes)})" + still_over(p, "gpu"))
                        break
                else:
                    continue
                break
        for world in WORLD_SIZES_TO_SUGGEST if cand.stage == 3 else ():
            if world > shape.world_size and (p := fixes("gpu", replace(shape, world_size=world), partitioned)):
                advice.append(f"gpu: {world} GPUs (ZeRO-3 partitions the model states over ranks)" + still_over(p, "gpu"))
                break
    if "host" in over and cand.stage == 3 and hw.on_gpu:
        if cand.offload_param == "cpu" and (p := fixes("host", c=replace(cand, offload_param="none"))):
            advice.append("host: zero.offload_param=none (if the GPU holds the 16-bit parameters)" + still_over(p, "host"))
        nvme = replace(cand, offload_optimizer="nvme", offload_optimizer_ratio=1.0,
                       offload_param="nvme" if cand.offload_param != "none" else "none")
        p = fixes("host", c=nvme, h=replace(hw, nvme_free_bytes=10**18))
        if p:
            swap = swap_layout(spec, p.shape, p.candidate)
            other = p.step_seconds - p.step_terms.get("nvme", 0)
            advice.append(f"host: zero.offload_optimizer=nvme with zero.nvme_path on a fast local disk with "
                          f">= {human_bytes(p.devices['nvme'].total_bytes / (1 - headroom))} free (host "
                          f"{human_bytes(p.devices['host'].total_bytes)}); each step reads "
                          f"{human_bytes(swap.read_bytes_per_step)} and writes {human_bytes(swap.write_bytes_per_step)} "
                          f"there, >= {bandwidth_to_hide(swap, other) / 1e9:.1f} GB/s keeps that within the rest of "
                          f"the step ({other:.2f} s)")
    if "disk" in over and shape.checkpoints_on_disk > 1:
        one = replace(shape, checkpoints_on_disk=2)
        if fixes("disk", one):
            advice.append("disk: checkpoint.keep_last=1 (two checkpoints on disk while the newer one is written)")
    labels = {"gpu": "GPU memory per rank", "host": "host RAM", "disk": "free disk for checkpoints",
              "nvme": "free NVMe space"}
    # the machine may have the RAM: then the group's limit is what to raise (unless plan.host_mem set the budget)
    limited = hw.host_limit and "host_mem" not in hw.overridden
    raise_limit = f" under the {hw.host_limit}: raise it with docker --memory, a pod's limits.memory or Slurm --mem"
    for name in over:
        device = plan.devices[name]
        need, have = need_and_have(device.total_bytes / (1 - headroom), device.budget_bytes)
        advice.append(f"{name}: {need} of {labels[name]} (have {have}{raise_limit if name == 'host' and limited else ''})")
    # the training phases fit, a moment outside them does not: say how much that moment needs
    for when, peak in (("engine start", plan.start_peak), ("checkpoint save", plan.save_peak),
                       ("first step after a save", plan.first_step_after_save_peak), (LOADING, plan.data_load_peak)):
        for name, device in peak.items():
            if not device.fits and (name not in over or when == LOADING):  # loading: a fix of its own
                need, have = need_and_have(device.total_bytes / (1 - headroom), device.budget_bytes)
                fix = f": {load_fix(device.components)}" if when == LOADING else ""
                advice.append(f"{name} ({when}): {need} of {labels[name]} (have {have}){fix}")
    return advice


def still_over(plan: Plan | None, fixed: str) -> str:
    """What a change that brings `fixed` under budget leaves over it elsewhere (`; host still over:
    22.0GiB of 20.7GiB usable`), so that a user who follows one line knows it is not enough alone."""
    if plan is None:
        return ""
    short = [f"{name} still over: {human_bytes(d.total_bytes)} of {human_bytes(d.usable_bytes)} usable"
             for name, d in plan.devices.items() if name != fixed and not d.fits]
    return "; " + "; ".join(short) if short else ""


def need_and_have(need: float, have: float) -> tuple[str, str]:
    """Both sizes, with the precision that tells them apart (24.04GiB of 24.00, not 24.0 of 24.0)."""
    shown = human_bytes(need), human_bytes(have)
    if shown[0] == shown[1] and have >= 2**30:
        return f"{need / 2**30:.2f}GiB", f"{have / 2**30:.2f}GiB"
    return shown


def _largest_fitting_seq(shape: Shape, fits_at) -> int | None:
    """Binary search over multiples of 64 below the current length."""
    lo, hi = 0, shape.seq_len // 64 - (1 if shape.seq_len % 64 == 0 else 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_at(mid * 64):
            lo = mid
        else:
            hi = mid - 1
    return lo * 64 if lo else None
