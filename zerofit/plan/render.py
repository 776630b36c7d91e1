"""`zerofit plan`: plan a model or a run config and show it (rich table or JSON).

Also what `train` calls: `plan_run(config, dist)` plans, broadcasts the decision from rank 0
(every rank must build the same engine) with plan.json's content (train writes it with the
run's other files), and refuses when nothing fits.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zerofit import models
from zerofit.checkpoint.files import rotated_out_credit
from zerofit.config.load import load, parse_override, set_dotted, validate
from zerofit.config.schema import Config
from zerofit.core.console import warn
from zerofit.core.errors import ConfigError
from zerofit.core.files import write_atomic
from zerofit.core.timeline import human_bytes, human_count, parse_bytes
from zerofit.machine import hardware
from zerofit.machine.hardware import Hardware, ranks_on_this_node
from zerofit.nvme import preflight as nvme
from zerofit.nvme.swaplayout import bandwidth_to_hide
from zerofit.plan import choose, deepspeed, loadpeak
from zerofit.plan import spec as modelspec
from zerofit.plan.choose import Decision
from zerofit.plan.estimate import DATASETS_LIBRARY_BYTES, Device, data_load_devices
from zerofit.plan.loadpeak import LOADING
from zerofit.plan.spec import ModelSpec
from zerofit.plan.states import swap_layout
from zerofit.plan.steptime import nvme_rates, step_seconds, step_time_terms


def probe_for(config: Config, accelerator: str | None = None, cpu_cores: int | None = None,
              disk_free: str | None = None, nvme_free: str | None = None) -> Hardware:
    """This machine as the config describes it; `cpu_cores`, `disk_free` (free space for
    checkpoints, e.g. 2TB) and `nvme_free` (free space at zero.nvme_path) stand in for what is
    measured here when planning another machine."""
    if nvme_free and not config.zero.nvme_path:
        raise ConfigError("--nvme-free is the free space at zero.nvme_path: give --nvme-path (or zero.nvme_path "
                          "in the config) too")
    hw = hardware.probe(disk_path=config.run_dir, nvme_path=config.zero.nvme_path, gpu_mem=config.plan.gpu_mem,
                        host_mem=config.plan.host_mem, accelerator=accelerator)
    overrides = {"cpu_cores": cpu_cores, "disk_free_bytes": parse_bytes(disk_free, "--disk-free")}
    if nvme_free:  # another machine's NVMe: a disk of its own, apart from the checkpoints'
        overrides.update(nvme_free_bytes=parse_bytes(nvme_free, "--nvme-free"), nvme_shares_disk=False)
    overrides = {key: value for key, value in overrides.items() if value is not None}
    return hardware.with_overrides(hw, **overrides) if overrides else hw


def plan_config(config: Config, world_size: int = 1, hw: Hardware | None = None, spec: ModelSpec | None = None,
                dataset_bytes: int = 0, data_load: dict[str, int] | None = None,
                resuming: bool = True) -> tuple[Decision, ModelSpec, Hardware]:
    """Plan `config` for `world_size` ranks on `hw` (probed when not given); `data_load`: the host
    peak of loading its data (loadpeak), None when there are no files to load. `resuming`: the
    run's checkpoints already on disk are rotated out as it saves (not set aside, --no-resume)."""
    spec = spec or modelspec.from_config(config)
    hw = hw or probe_for(config)
    hw, rotated = with_rotated_out(config, hw) if resuming else (hw, None)
    config, notes, problems = nvme.resolve_aio(config, spec, world_size)
    decision = choose.decide(config, spec, hw, world_size, data_bytes(config, dataset_bytes), data_load)
    if rotated:
        decision.plan.notes.append(rotated)
    if nvme.uses_nvme(decision.config):
        decision.plan.notes.extend(notes)
    if decision.config.zero.offload_optimizer == "nvme":  # the problems are the optimizer's transfers
        decision.nvme_problems = problems
    if not decision.plan.fits and (lora := lora_instead(config, spec, world_size, hw, dataset_bytes, data_load)):
        decision.advice.append(lora)
    return decision, spec, hw


def lora_instead(config: Config, full: ModelSpec, world_size: int, hw: Hardware, dataset_bytes: int = 0,
                 data_load: dict[str, int] | None = None) -> str | None:
    """Where a full fine-tune fits no candidate: whether LoRA would, its section as the config
    has it (rank, targets, dropout) but enabled, planned the same way; None where it would not,
    the run is LoRA already, or peft is missing (the planner builds the peft model to count it)."""
    if config.lora.enabled:
        return None
    lora_config = config.model_copy(update={"lora": config.lora.model_copy(update={"enabled": True})})
    try:
        spec = modelspec.from_config(lora_config)
    except (ImportError, ConfigError, ValueError):  # no peft; no module to adapt (ours, or peft's ValueError)
        return None
    decision = choose.decide(lora_config, spec, hw, world_size, data_bytes(lora_config, dataset_bytes), data_load)
    plan = decision.plan
    if not plan.fits:
        return None
    devices = ", ".join(f"{name} {human_bytes(device.total_bytes)} of {human_bytes(device.usable_bytes)}"
                        for name, device in plan.devices.items())
    return (f"lora.enabled=true (rank {config.lora.r} adapters on the frozen base, {human_count(spec.trainable_params)} "
            f"parameters trained instead of {human_count(full.trainable_params)}): fits as {choose.describe(plan)}; "
            f"{devices}; ~{plan.step_seconds:.2f} s a step")


def data_bytes(config: Config, held: int = 0) -> int:
    """Host bytes for the data: the tokenized sequences (`held`, or int64 ids and labels
    of the synthetic set), plus HF datasets itself when data comes from files."""
    if config.data.path == "synthetic":
        return held or 16 * config.data.synthetic_samples * config.train.seq_len
    return held + DATASETS_LIBRARY_BYTES


def plan_json(decision: Decision, spec: ModelSpec, hw: Hardware) -> dict:
    plan = decision.plan
    world = plan.shape.world_size
    return {**plan.to_json(), "model": spec.summary(), "hardware": hw.to_json(),
            "chosen": choose.describe(plan), "chosen_fields": decision.chosen_fields,
            "deepspeed_config": deepspeed.build(decision.config, world, hw.on_gpu),
            "advice": decision.advice, "candidates_considered": len(decision.considered),
            "nvme": nvme_summary(decision, spec, hw)}


def nvme_summary(decision: Decision, spec: ModelSpec, hw: Hardware) -> dict | None:
    """What an NVMe plan asks of the disk: bytes, per-step traffic, the bandwidth that keeps
    the swap from dominating the step, and the aio settings DeepSpeed gets."""
    plan, config = decision.plan, decision.config
    if plan.candidate.offload_optimizer != "nvme":
        return None

    swap = swap_layout(spec, plan.shape, plan.candidate)
    other = plan.step_seconds - plan.step_terms.get("nvme", 0)
    read_rate, write_rate = nvme_rates(hw)
    return {"path": config.zero.nvme_path, "swap_dir": nvme.swap_root(config), "free_bytes": hw.nvme_free_bytes,
            "swap_bytes": swap.nvme_bytes, "swapped_sub_groups": len(swap.swapped),
            "kept_in_ram_sub_groups": len(swap.resident), "locked_buffer_bytes": swap.pinned_buffer_bytes,
            "read_bytes_per_step": swap.read_bytes_per_step, "write_bytes_per_step": swap.write_bytes_per_step,
            "read_bytes_per_s": read_rate, "write_bytes_per_s": write_rate,
            "rates_measured": hw.nvme_read_bytes_per_s is not None, "pipelined": swap.pipelined,
            "swap_seconds_per_step": plan.step_terms.get("nvme", 0.0), "other_seconds_per_step": other,
            "bandwidth_to_hide_io": bandwidth_to_hide(swap, other), "aio": nvme.aio_of(config).to_json()}


def phase_predictions(decision: Decision) -> dict[str, dict[str, int]]:
    """What memory.Timeline writes next to each phase's measurement."""
    plan = decision.plan
    out = {name: {"predicted_gpu_peak": p["gpu"], "predicted_host_rss": p["host"]} for name, p in plan.phases.items()}
    out["start"] = {"predicted_host_rss": plan.start_peak["host"].total_bytes}
    out["save"] = {"predicted_gpu_peak": plan.save_peak["gpu"].total_bytes - _outside_allocator(plan.save_peak["gpu"]),
                   "predicted_host_rss": plan.save_peak["host"].total_bytes}
    return out


def limit_note(hw: Hardware) -> str:
    """` (cgroup memory limit 3.0GiB)` where the group's limit, not plan.host_mem, set the budget."""
    return f" ({hw.host_limit})" if hw.host_limit and "host_mem" not in hw.overridden else ""


def _outside_allocator(device: Device) -> int:
    return sum(v for k, v in device.components.items() if k in ("fragmentation", "cuda_context"))


# ---------------------------------------------------------------------- rendering
def render(decision: Decision, spec: ModelSpec, hw: Hardware, explain: bool = False,
           console: Console | None = None) -> None:
    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    plan = decision.plan
    verdict = "[green]fits[/]" if plan.fits else "[red]does not fit[/]"
    where = f"{hw.device_name}, {human_bytes(hw.gpu_budget_bytes)} per GPU" if hw.on_gpu else "CPU accelerator"
    console.print(f"[bold]{spec.model_type}[/] {human_count(spec.total_params)} parameters on {where}, "
                  f"host {human_bytes(hw.host_budget_bytes)}{limit_note(hw)}, "
                  f"{plan.shape.world_size} rank(s): {verdict}")
    console.print(f"configuration: {choose.describe(plan)}")
    if decision.chosen_fields:
        console.print("chosen by the planner: " + ", ".join(f"{k}={v}" for k, v in decision.chosen_fields.items()))
    table = Table(title="predicted peak per device (training)", show_lines=False)
    for column in ("device", "component", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for name, device in plan.devices.items():
        if not device.budget_bytes and not device.total_bytes:
            continue  # no GPU: the CPU accelerator's tensors are in the host rows
        for i, (comp, nbytes) in enumerate(sorted(device.components.items(), key=lambda kv: -kv[1])):
            table.add_row(name if i == 0 else "", comp, human_bytes(nbytes))
        mark = "[green]ok[/]" if device.fits else "[red]over[/]"
        table.add_row("", f"[bold]total[/] (usable {human_bytes(device.usable_bytes)} of {human_bytes(device.budget_bytes)})",
                      f"[bold]{human_bytes(device.total_bytes)}[/] {mark}", end_section=True)
    console.print(table)
    peaks = Table(title="other peaks")
    for column in ("when", "gpu", "host", "disk"):
        peaks.add_column(column)
    moments = ((LOADING, plan.data_load_peak),) if plan.data_load_peak else ()
    for label, devices in moments + (("engine start", plan.start_peak), ("checkpoint save", plan.save_peak),
                                     ("first step after a save", plan.first_step_after_save_peak),
                                     ("export", plan.export_peak)):
        peaks.add_row(label, *(human_bytes(devices[d].total_bytes) + ("" if devices[d].fits else " [red]over[/]")
                               if d in devices else "-" for d in ("gpu", "host", "disk")))
    console.print(peaks)
    console.print(f"checkpoint size on disk: {human_bytes(plan.checkpoint_bytes)}; per rank: allocator peak "
                  f"{human_bytes(plan.gpu_allocated_peak)} (torch.cuda.max_memory_allocated), host RSS "
                  f"{human_bytes(plan.host_rss_peak)}")
    terms = ", ".join(f"{k} {v:.3f}s" for k, v in plan.step_terms.items())
    console.print(f"estimated step: {plan.step_seconds:.3f} s ({terms})")
    swap = nvme_summary(decision, spec, hw)
    if swap:
        rates = "measured" if swap["rates_measured"] else "assumed; `zerofit doctor --system --nvme-path` measures"
        console.print(f"NVMe: {human_bytes(swap['swap_bytes'])} of swap files under {swap['path']} "
                      f"({human_bytes(swap['free_bytes'] or 0)} free), {human_bytes(swap['locked_buffer_bytes'])} of "
                      f"locked RAM for the swap buffers; per step it reads {human_bytes(swap['read_bytes_per_step'])} "
                      f"and writes {human_bytes(swap['write_bytes_per_step'])} at {swap['read_bytes_per_s'] / 1e9:.1f}/"
                      f"{swap['write_bytes_per_s'] / 1e9:.1f} GB/s ({rates}): ~{swap['swap_seconds_per_step']:.1f} s "
                      f"of swap per step beside ~{swap['other_seconds_per_step']:.1f} s of the rest (more micro batches "
                      f"per step amortise it); {swap['bandwidth_to_hide_io'] / 1e9:.1f} GB/s would keep it within the "
                      "rest of the step"
                      + ("; pipelined (zero.nvme_pipeline): reads overlap writes and the step, three sub groups of "
                         "buffers, the first step's moments held until it ends" if swap["pipelined"] else ""))
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/]")
    if not plan.fits:
        console.print("[bold]what would fit:[/]")
        for item in decision.advice or ["nothing zerofit can change; more memory is needed"]:
            console.print(f"  - {item}")
    if explain:
        render_explain(decision, console)


def render_explain(decision: Decision, console: Console) -> None:
    for function in (step_time_terms, step_seconds):
        console.print(f"[bold]{function.__name__}[/] (steptime.{function.__name__}):")
        for line in (function.__doc__ or "").splitlines():
            if line.strip():
                console.print(f"  {line.strip()}")
    table = Table(title=f"candidates ({len(decision.considered)}; fastest fitting first)",
                  caption="buckets: reduce / prefetch / persistence threshold, in elements")
    for column in ("configuration", "buckets", "fits", "step s", "gpu", "host"):
        table.add_column(column)
    ranked = sorted(decision.considered, key=lambda p: (not p.fits, p.step_seconds))
    for p in ranked[:15]:
        table.add_row(choose.describe(p), buckets(p.candidate), "yes" if p.fits else "no", f"{p.step_seconds:.3f}",
                      human_bytes(p.devices["gpu"].total_bytes), human_bytes(p.devices["host"].total_bytes))
    console.print(table)


def plan_line(decision: Decision) -> str:
    """What train says it runs, before the build: the configuration, what the planner chose of
    it, and the predicted training peaks against their budgets (`zerofit plan` shows the rest;
    plan.json holds it all)."""
    plan = decision.plan
    peaks = ", ".join(f"{name} {human_bytes(device.total_bytes)} of {human_bytes(device.usable_bytes)}"
                      for name, device in plan.devices.items() if name in ("gpu", "host") and device.budget_bytes)
    peaks += f" usable (the budgets less plan.headroom {decision.config.plan.headroom:.0%})"
    tuning = ("bucket_size", "persistence_threshold", "max_live_parameters", "max_reuse_distance")
    chosen = [key for key in decision.chosen_fields if not key.endswith(tuning)]
    chosen += ["bucket and window sizes"] * any(key.endswith(tuning) for key in decision.chosen_fields)
    source = f"the planner chose {', '.join(chosen)}" if chosen else "all set in the config" \
        if decision.config.plan.enabled else "plan.enabled false: as configured"
    idle = " on idle cores" if plan.accelerator == "cpu" else ""  # other processes' load slows a CPU step most
    return (f"plan: {choose.describe(plan)} ({source}); predicted peak {peaks}; ~{plan.step_seconds:.2f} s a step"
            f"{idle} (plan.json; `zerofit doctor` compares)")


def buckets(cand) -> str:
    """The element counts that tell candidates of one configuration apart: DeepSpeed's
    reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold."""
    return " / ".join(human_count(n) for n in (cand.reduce_bucket_size, cand.prefetch_bucket_size,
                                             cand.param_persistence_threshold))


# ------------------------------------------------------------------ train's call
def write_plan(run_dir: Path, record: dict) -> None:
    """plan.json: the prediction a run is measured against (`zerofit doctor`)."""
    write_atomic(Path(run_dir) / "plan.json", json.dumps(record, indent=2))


def check_data_load(config: Config, dist, data_load: dict[str, int] | None) -> dict[str, Device]:
    """Before train loads its data: its predicted peak on this host (plan.json's data_load_peak,
    {} without data files), rank 0's for every rank; refused (plan.enabled) when over the host
    budget (loadpeak.over_budget), as plan_run refuses a plan."""
    import torch.distributed as torch_dist

    box: list = [{}, None]
    if dist.is_main and data_load:
        hw = probe_for(config, accelerator="cuda" if dist.on_gpu else "cpu")
        ranks = ranks_on_this_node(hw, dist.world_size)
        box[0] = data_load_devices(data_load, hw, config.plan.headroom, ranks)
        box[1] = loadpeak.over_budget(box[0]["host"], config.plan.headroom, ranks) if config.plan.enabled else None
    if dist.world_size > 1:
        torch_dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise choose.PlanError(box[1])
    return box[0]


def data_load_of(config: Config, tokenizer=None, run_dir: Path | None = None,
                 process_bytes: int = loadpeak.LOAD_BASE_BYTES) -> dict[str, int] | None:
    """The host peak of loading `config`'s data files by component (loadpeak), None for the
    built-in sources; the model's own tokenizer when none is given."""

    if config.data.path in loadpeak.BUILT_IN:
        return None
    tokenizer = tokenizer or models.load_tokenizer(config.model)
    shape = loadpeak.load_facts(config.data, tokenizer, run_dir, process_bytes)
    return loadpeak.load_peak(shape) if shape else None


def plan_run(config: Config, dist, dataset_bytes: int = 0, data_loaded: dict[str, Device] | None = None,
             resuming: bool = True) -> tuple[Config, Decision]:
    """Plan on rank 0, share the decision with every rank (plan.json's content in
    `decision.record`, written with the run's other files once a resume is known to be
    possible), refuse when nothing fits (plan.enabled) or just record the prediction
    (plan.enabled false). `data_loaded`: check_data_load's prediction, recorded (the
    loading it predicted is over: the plan's fit no longer depends on it)."""
    import torch.distributed as torch_dist

    box: list = [None, None]
    if dist.is_main:
        hw = probe_for(config, accelerator="cuda" if dist.on_gpu else "cpu")
        if beyond := hardware.host_mem_beyond_reach(hw):
            warn(beyond)
        decision, spec, hw = plan_config(config, dist.world_size, hw=hw, dataset_bytes=dataset_bytes,
                                         resuming=resuming)
        decision.plan.data_load_peak = data_loaded or {}
        decision.record = plan_json(decision, spec, hw)
        box = [decision, nvme.preflight(decision.config, decision.plan, dist.on_gpu, decision.nvme_problems)]
    if dist.world_size > 1:
        torch_dist.broadcast_object_list(box, src=0)
    decision, nvme_problem = box
    if nvme_problem:
        raise nvme.NvmeError(nvme_problem)
    if config.plan.enabled and not decision.plan.fits:
        # a fresh run's, to read; never over an earlier start's
        if dist.is_main and not (Path(config.run_dir) / "plan.json").exists():
            write_plan(config.run_dir, decision.record)
        raise choose.refuse(decision)
    return decision.config, decision


def with_rotated_out(config: Config, hw: Hardware) -> tuple[Hardware, str | None]:
    """`hw` with the run's own checkpoints that retention deletes while it saves counted as free
    disk (checkpoint.rotated_out_credit), and the note that says so; `hw` as it is without any."""
    root, ckpt = Path(config.run_dir) / "checkpoints", config.checkpoint
    credit = rotated_out_credit(root, ckpt.keep_last, ckpt.keep_every, choose.checkpoints_on_disk(config))
    if not credit:
        return hw, None
    return (hardware.with_overrides(hw, disk_free_bytes=hw.disk_free_bytes + credit),
            f"disk: {human_bytes(hw.disk_free_bytes)} free and {human_bytes(credit)} of the checkpoints in {root} "
            f"that retention deletes as this run saves (checkpoint.keep_last={ckpt.keep_last})")


# ----------------------------------------------------------- the verb as a function
def plan(model: str | None = None, config_path: str | None = None, overrides: list[str] = (),
         world_size: int = 1, accelerator: str | None = None, cpu_cores: int | None = None,
         disk_free: str | None = None, nvme_free: str | None = None) -> tuple[Decision, ModelSpec, Hardware]:
    """`zerofit plan`: a model (preset, config.json, directory) with a default run around
    it, or a run config; `overrides` are `section.key=value` as for train's --set."""

    if config_path:
        config = load(config_path, list(overrides))
    else:
        if not model:
            raise ConfigError("zerofit plan needs --model (a preset, config.json or model directory) or --config FILE")
        raw = {"model": {"config": model}, "train": {"epochs": 1}}
        for item in overrides:
            set_dotted(raw, *parse_override(item))
        config = validate(raw)
    hw = probe_for(config, accelerator, cpu_cores, disk_free, nvme_free)
    data_load, unplanned = None, None
    try:  # the data may live on the machine planned for, not this one: then the rest is planned
        data_load = data_load_of(config, run_dir=Path(config.run_dir))
    except ConfigError as e:
        unplanned = f"{loadpeak.LOADING} is not planned: {e}"
    decision, spec, hw = plan_config(config, world_size, hw=hw, data_load=data_load)
    if unplanned:
        decision.plan.notes.append(unplanned)
    return decision, spec, hw
