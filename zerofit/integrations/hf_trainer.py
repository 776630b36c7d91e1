"""zerofit's memory guard for HF Trainer and LLaMA-Factory runs: the same memory.jsonl
timeline, a post-save residue check, cache release after each save, and the watchdog,
so that `zerofit doctor OUTPUT_DIR` explains the run; under ZeRO-3 it also partitions the
parameters each eval batch leaves gathered (HF Trainer does not: the first training step after
an eval gathers its window on top of them; detectors.after_eval_spike).

    from zerofit.integrations.hf_trainer import MemoryGuardCallback
    trainer = Trainer(..., callbacks=[MemoryGuardCallback()])

Phases: a TrainerCallback sees the end of each micro batch (on_substep_end, and
on_pre_optimizer_step for the last one) and of the optimizer step (on_optimizer_step),
so the timeline has `forward_backward` and `optimizer_step` records. Under DeepSpeed the
engine steps inside `backward`, so `forward_backward` holds its optimizer step too and
`optimizer_step` is DeepSpeed's no-op wrapper.

Peaks are reset at every phase (torch.cuda.reset_peak_memory_stats): other tools that
read max_memory_allocated over the whole run (Trainer's skip_memory_metrics=False) see
per-phase peaks instead.
"""
from __future__ import annotations

import gc
import json
import shlex
from pathlib import Path

from transformers import TrainerCallback

from zerofit.core.console import warn
from zerofit.core.files import write_atomic
from zerofit.core.timeline import Timeline, gib
from zerofit.doctor.run import HF_RUN_FILE
from zerofit.findings.facts import RunFacts, significant_bytes
from zerofit.train import watchdog
from zerofit.train.engine import release_gathered

ARGS_KEPT = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "bf16", "fp16",
             "save_steps", "eval_steps", "max_steps", "num_train_epochs", "learning_rate", "deepspeed",
             "save_only_model", "world_size")


class MemoryGuardCallback(TrainerCallback):
    """Memory timeline, post-save residue check, cache release and watchdog for Trainer.

    output_dir: where memory.jsonl goes (default: the Trainer's output_dir).
    watchdog_threshold / watchdog_action: as memory.watchdog_threshold / watchdog_action
      in zerofit: warn, save (a checkpoint now) or stop (save, then stop training).
    gpu_mem / host_mem: budgets such as "24GiB" (default: the device, the machine's RAM).
    release_cache_after_save: gc.collect() and torch.cuda.empty_cache() after each save.
    release_after_eval: under ZeRO-3, partition every parameter an eval batch left gathered
      (DeepSpeed's empty_partition_cache), as zerofit's own loop does.
    """

    def __init__(self, output_dir: str | None = None, watchdog_threshold: float = 0.9,
                 watchdog_action: str = "warn", gpu_mem: str | None = None, host_mem: str | None = None,
                 release_cache_after_save: bool = True, release_after_eval: bool = True):
        if watchdog_action not in ("warn", "save", "stop"):
            raise ValueError(f"watchdog_action={watchdog_action!r}: choose warn, save or stop")
        if not 0 < watchdog_threshold <= 1:
            raise ValueError(f"watchdog_threshold={watchdog_threshold}: a fraction of the budget in (0, 1]")
        self.output_dir, self.threshold, self.action = output_dir, watchdog_threshold, watchdog_action
        self.gpu_mem, self.host_mem, self.release = gpu_mem, host_mem, release_cache_after_save
        self.release_after_eval = release_after_eval
        self.timeline: Timeline | None = None
        self.dog: watchdog.Watchdog | None = None
        self.on_gpu, self.world_size, self.held_before_save = False, 1, 0

    # ------------------------------------------------------------------ set-up
    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.on_gpu, self.world_size = on_gpu(args), args.world_size
        out = Path(self.output_dir or args.output_dir)
        self.timeline = Timeline(out, args.process_index, self.on_gpu)
        self.dog = watchdog.arm(self.timeline, state.global_step, self.on_gpu, self.threshold, self.action,
                                self.gpu_mem, self.host_mem, self.world_size)
        if state.is_world_process_zero:
            description = {**run_description(args, model), "seq_len": longest_row(train_dataloader)}
            write_atomic(out / HF_RUN_FILE, json.dumps(description, indent=1, default=str))

    # ------------------------------------------------------------------ phases
    def on_substep_end(self, args, state, control, **kwargs):
        self.timeline.observe("forward_backward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timeline.observe("forward_backward")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timeline.observe("optimizer_step")

    def on_step_end(self, args, state, control, **kwargs):
        records = self.timeline.flush(state.global_step)
        if records:
            self.held_before_save = held(records[-1], self.on_gpu)
        crossing = self.dog.check(state.global_step, records)
        if crossing:
            warn(crossing.message())
            self.timeline.mark(state.global_step, "watchdog", **crossing.record())
        if self.action != "warn" and watchdog.any_rank(crossing is not None, self.on_gpu, self.world_size):
            control.should_save = True  # Trainer saves right after on_step_end
            control.should_training_stop = control.should_training_stop or self.action == "stop"
        return control

    def on_prediction_step(self, args, state, control, optimizer=None, **kwargs):
        if self.release_after_eval and optimizer is not None:  # None before train() built the engine
            release_gathered(optimizer)

    def on_evaluate(self, args, state, control, optimizer=None, **kwargs):
        released = self.release_after_eval and optimizer is not None
        if self.timeline is not None:
            self.timeline.mark(state.global_step, "eval", released_gathered=released)
            return
        # trainer.evaluate() outside train(): a baseline before it, LLaMA-Factory's do_eval after it
        timeline = Timeline(Path(self.output_dir or args.output_dir), args.process_index, on_gpu(args))
        timeline.mark(state.global_step, "eval", released_gathered=released)
        timeline.close()

    def on_save(self, args, state, control, **kwargs):
        if self.release:
            release_cache(self.on_gpu)
        after = self.timeline.observe("save")
        residue = held(after, self.on_gpu) - self.held_before_save
        self.timeline.flush(state.global_step, residue_bytes=residue, released_cache=self.release)
        device = "gpu" if self.on_gpu else "host"
        floor = significant_bytes(RunFacts(gpu_budget=self.dog.facts.gpu_budget,
                                           host_budget=self.dog.facts.host_budget), device)
        if residue > floor:
            warn(f"{gib(residue)} of {device} memory is still held after the save at step {state.global_step} "
                 f"(above the pre-save baseline{', after emptying the cache' if self.release else ''}); "
                 f"`zerofit doctor {shlex.quote(str(self.output_dir or args.output_dir))}` shows where")

    def on_train_end(self, args, state, control, **kwargs):
        if self.timeline:
            self.timeline.close()
            self.timeline = None


def on_gpu(args) -> bool:
    import torch

    return torch.cuda.is_available() and args.device.type == "cuda"


def held(record: dict, on_gpu: bool) -> int:
    return record["gpu_alloc"] if on_gpu else record["host_rss"]


def release_cache(on_gpu: bool) -> None:
    gc.collect()
    if on_gpu:
        import torch

        torch.cuda.empty_cache()


def longest_row(dataloader, rows: int = 256) -> int | None:
    """The most input_ids among the training set's first `rows` rows: the sequence length a
    reproduction uses. Read by index, so the Trainer's shuffling is untouched; None for an
    iterable dataset or rows without input_ids."""
    dataset = getattr(dataloader, "dataset", None)
    try:
        lengths = [len(dataset[i]["input_ids"]) for i in range(min(rows, len(dataset)))]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None
    return max(lengths, default=None)


def run_description(args, model) -> dict:
    """What `zerofit doctor` and `--repro` need to know about the Trainer run."""
    ds_config = None
    holder = getattr(args, "hf_deepspeed_config", None)
    if holder is not None:
        ds_config = holder.config
    config = getattr(model, "config", None)
    return {"source": "hf-trainer", "args": {key: getattr(args, key, None) for key in ARGS_KEPT},
            "ds_config": ds_config, "model_config": config.to_dict() if config is not None else None}
