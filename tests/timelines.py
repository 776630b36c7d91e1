"""Synthetic memory timelines in memory.jsonl's format, for the detectors' unit tests and
the report's rendering: a ZeRO-3 run on a 24 GiB card, with knobs for each pathology."""
from __future__ import annotations

GiB, MiB = 2**30, 2**20
PHASE_EXTRA = {"forward": 3 * GiB, "backward": 5 * GiB, "optimizer_step": 2 * GiB}


def synthetic_run(steps: int = 20, save_every: int = 5, eval_every: int = 0, gpu_budget: int = 24 * GiB,
                  host_total: int = 128 * GiB, base: int = 10 * GiB, residue_per_save: int = 0,
                  leak_per_step: int = 0, spike_after_save: int = 0, spike_after_eval: int = 0,
                  eval_released: bool = False, frag: int = 256 * MiB,
                  inactive_split: int = 64 * MiB, host_rss: int = 30 * GiB, host_leak_per_step: int = 0,
                  oom_at: int | None = None, sub_group_size: int | None = None, alloc_conf: str = "") -> list[dict]:
    records = [{"step": 0, "phase": "start", "gpu_alloc": 0, "gpu_reserved": 0, "gpu_peak": 0, "gpu_peak_reserved": 0,
                "host_rss": host_rss, "host_peak": host_rss, "host_avail": host_total - host_rss - 4 * GiB,
                "gpu_total": gpu_budget, "gpu_budget": gpu_budget, "host_total": host_total, "host_budget": host_total,
                "host_budget_is_machine": True, "alloc_conf": alloc_conf, "world_size": 1}]
    saves = 0
    after_save = after_eval = False
    for step in range(1, steps + 1):
        held = base + leak_per_step * step + residue_per_save * saves
        rss = host_rss + host_leak_per_step * step
        for phase, extra in PHASE_EXTRA.items():
            if oom_at == step and phase == "backward":
                records.append({"step": step, "phase": "oom", "failed_phase": "backward", "device": "gpu",
                                "requested_bytes": 2 * GiB, "gpu_alloc": held + extra, "gpu_reserved": gpu_budget,
                                "gpu_peak": held + extra, "gpu_peak_reserved": gpu_budget, "host_rss": rss,
                                "host_peak": rss})
                return records
            peak = held + extra + (spike_after_save if after_save and phase == "optimizer_step" else 0)
            peak += spike_after_eval if after_eval and phase != "optimizer_step" else 0
            record = {"step": step, "phase": phase, "gpu_alloc": held, "gpu_peak": peak, "gpu_reserved": peak + frag,
                      "gpu_peak_reserved": peak + frag, "gpu_frag": peak + frag - held,
                      "gpu_inactive_split": inactive_split, "host_rss": rss, "host_peak": rss + 512 * MiB,
                      "host_avail": host_total - rss - 4 * GiB, "pinned": 8 * GiB, "nvme_swap": 0}
            if after_save:
                record["after_save"] = True
            records.append(record)
        after_save = after_eval = False
        if eval_every and step % eval_every == 0:
            records.append({**records[-1], "phase": "eval", "gpu_peak": held + 2 * GiB,
                            "released_gathered": eval_released})
            after_eval = True
            records[-1].pop("after_save", None)
        if save_every and step % save_every == 0:
            saves += 1
            records.append({**records[-1], "phase": "save", "gpu_alloc": held + residue_per_save,
                            "gpu_peak": held + 1 * GiB})
            records[-1].pop("after_save", None)
            after_save = True
    return records


def ds_config(sub_group_size: int = 100_000_000, gather: bool = False, micro_batch: int = 4,
              offload_param: str = "none") -> dict:
    zero = {"stage": 3, "sub_group_size": sub_group_size, "stage3_gather_16bit_weights_on_model_save": gather,
            "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param, "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 4,
            "zero_optimization": zero, "bf16": {"enabled": True}}
