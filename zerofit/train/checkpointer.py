"""The loop's side of checkpoints: load what start-up chose (zerofit/train/resume.py), save (sync or
async), publish, retention, failures per `checkpoint.on_error`, post-save hygiene, the save
schedule (steps or minutes), SIGTERM and Ctrl-C.

The loop calls one method per once-in-a-while block: `poll` every step (publishes an
async save whose writers all finished), `due` and `save` at checkpoint steps, `stop_requested`
(SIGTERM, a first Ctrl-C), `close` at the end (drains the save in flight). Every rank calls every
method at the same step; the collectives here are small (a flag or a few file records).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint import writer, zerofiles
from zerofit.checkpoint.files import CheckpointError, LoopState
from zerofit.config.schema import Config
from zerofit.core import cgroup, faults
from zerofit.core import timeline as memory
from zerofit.core.console import say, warn
from zerofit.data import pipeline as data
from zerofit.lora import resume
from zerofit.nvme import preflight as nvme
from zerofit.plan import choose, estimate
from zerofit.train import engine
from zerofit.train.resume import (
    ResumePoint,
    batch_shape,
    checkpoints_root,
    damaged_file_error,
    global_batch_change,
    keep_batch_advice,
    resume_command,
)

RESIDUE_WARN_BYTES = 1 << 20  # GPU memory still allocated after a save beyond its pre-save level
FORWARDED_WITHIN_S = 1.0  # a Ctrl-C torchrun passes on reaches a rank this soon after the terminal's
MODEL_16BIT_FILE = "pytorch_model.bin"  # zero.gather_16bit_weights_on_save, in each checkpoint: save_16bit_model's name


class Checkpointer:
    """Saves of one run: installs zerofit's checkpoint engine on the DeepSpeed engine,
    holds the save in flight (at most one) and the SIGTERM flag. `host_budget_bytes` is the
    host budget the plan used (0: the RAM available now), which caps async snapshots as the
    planner capped them."""

    def __init__(self, ds_engine, config: Config, dist, timeline: memory.Timeline, host_budget_bytes: int = 0):
        self.ds_engine, self.config, self.dist, self.timeline = ds_engine, config, dist, timeline
        self.root = checkpoints_root(config)
        self.settings = config.checkpoint
        self.zero_stage = config.zero.stage
        self.n_params = sum(getattr(p, "ds_numel", p.numel()) for p in ds_engine.module.parameters()
                            if p.requires_grad)
        self.total_params = sum(getattr(p, "ds_numel", p.numel()) for p in ds_engine.module.parameters())
        host_max = estimate.async_snapshot_cap(choose.async_snapshot_max(config),
                                              host_budget_bytes or cgroup.host_memory().available)
        self.io = writer.install(ds_engine, self.settings.async_save, host_max, self.settings.direct_io,
                                           self.settings.zip_crc32)
        self._pending: dict | None = None
        self.saved_step: int | None = None  # the newest save's step: published or in flight, not failed
        self.step_in_progress = 0  # the step the loop is in (the one a stop saves): set by the loop
        self._last_save_at = time.monotonic()  # checkpoint.every_minutes counts from here
        self._terminated = self._interrupted = False
        self._interrupted_at = 0.0
        self._previous_handlers: dict = {}
        if threading.current_thread() is threading.main_thread():
            self._previous_handlers = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_sigterm),
                                       signal.SIGINT: signal.signal(signal.SIGINT, self._on_sigint)}
        if self.settings.async_save:
            self._reserve_host_buffer()

    # ------------------------------------------------------------------ resume
    def load(self, point: ResumePoint, fresh: LoopState) -> LoopState:
        """Load the chosen checkpoint on every rank; `fresh` when there is none."""
        self.step_in_progress = (point.step if point.directory is not None else fresh.step) + 1  # a Ctrl-C's step
        if point.directory is None:
            return fresh
        directory, load_dir = Path(point.directory), Path(point.load_dir)
        custom_load_fn = None
        if self.config.lora.enabled:  # LoRA checkpoints hold the adapters, not the frozen base
            resume.check_adapter_shapes(self.ds_engine.module, directory)
            custom_load_fn = resume.load_trainable_only
        try:
            path, _ = self.ds_engine.load_checkpoint(str(load_dir.parent), tag=load_dir.name,
                                                     load_optimizer_states=True, load_lr_scheduler_states=True,
                                                     custom_load_fn=custom_load_fn)
        except Exception as e:
            if not damaged_file_error(e):
                raise
            raise CheckpointError(f"{load_dir} cannot be read on rank {self.dist.rank} ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200]}): one of its files is damaged. Resume with "
                                  f"--verify full: the hash check sets a damaged checkpoint aside and resumes from the "
                                  f"one before it") from None
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {load_dir}")
        engine.apply_hyperparameters(self.ds_engine, self.config)  # the saved ones are restored over them
        if self.config.zero.offload_optimizer == "nvme":  # DeepSpeed leaves the optimizer file unread
            nvme.restore_optimizer_state(self.ds_engine, load_dir)
        replay_cpu_adam_steps(self.ds_engine)
        state = checkpoint.read_loop_state(directory)
        rng_file = directory / f"rng_state_rank{self.dist.rank % state.world_size}.pt"
        if rng_file.is_file():
            checkpoint.set_rng_state(checkpoint.load_torch_file(rng_file))
        state.extra.pop("emergency", None)  # the note an OOM's emergency save carries stays with it
        change = global_batch_change(state, fresh)
        if change and self.dist.is_main:
            warn(f"{directory.name} trained {change}; the learning-rate schedule counts optimizer steps, not "
                 f"sequences. {keep_batch_advice(state, fresh)}")
        comparable = state.data_fingerprint.startswith(data.FINGERPRINT_SCHEME)  # another scheme's hash is not compared
        if self.dist.is_main and comparable and state.data_fingerprint != fresh.data_fingerprint \
                and state.epoch_sequences == fresh.epoch_sequences:  # another count is named with the position
            warn(f"the training data's tokens differ from those {directory.name} trained on (the files under "
                 f"data.path, the tokenizer, the data settings or train.seed, which draws the rows held out for "
                 f"eval, changed; the same number of sequences): the position carries over, but the rows before it "
                 f"are not the ones trained, and the eval split may hold rows trained on. Start afresh "
                 f"(--no-resume) to train on the new data from its beginning")
        state = dataclasses.replace(state, data_fingerprint=fresh.data_fingerprint)  # what its saves train on now
        state = self._data_position_carried(state, fresh, directory.name)
        if state.config_fingerprint != fresh.config_fingerprint:  # the changes were said at start (changed_on_resume)
            # what this run saves from here on is the current config's
            state = dataclasses.replace(state, config_fingerprint=fresh.config_fingerprint,
                                        config_values=fresh.config_values)
        return state  # train.run says "resumed from" once LoRA's base check passed

    def _data_position_carried(self, state: LoopState, fresh: LoopState, name: str) -> LoopState:
        """The same data position counted in this run's micro batches: after a change of rank
        count, of micro batch (an OOM retry's) or of the training set's sequences."""
        old, new = batch_shape(state), batch_shape(fresh)
        if old == new:
            return state
        position = data.carried_position(state.micro_batches, old, new)
        if self.dist.is_main:
            say(f"data position: {state.micro_batches} micro batches of {old.micro_batch} on {old.world} rank(s) "
                f"-> {position} of {new.micro_batch} on {new.world}")
            if old.sequences != new.sequences:
                epoch, index = divmod(state.micro_batches, old.per_epoch)
                warn(f"the training set holds {new.sequences} sequences where {name} counted {old.sequences} "
                     f"(train.seq_len, data.packing or the data changed): the position carries over as the same "
                     f"share of epoch {epoch + 1} ({index / old.per_epoch:.1%}), but this epoch's order is a new "
                     f"one, so some of its rows may be seen again and others not at all")
        return dataclasses.replace(state, micro_batches=position, world_size=new.world,
                                   micro_batch_size=new.micro_batch, epoch_sequences=new.sequences)

    # -------------------------------------------------------------------- save
    def save(self, state: LoopState) -> None:
        """Write a checkpoint of `state`. Sync: written and published before returning.
        Async: the training stalls only for the snapshot; `poll` publishes it later."""
        self._finish_in_flight()  # at most one save in flight: this one waits for the last
        self.saved_step = state.step
        self._last_save_at = time.monotonic()
        faults.tick("save")
        name = checkpoint.step_name(state.step)
        problem = self._agree(self._space_problem() if self.dist.is_main else None)
        if problem:
            self._failed(state.step, name, None, problem)
            return
        tmp = self.root / f"{checkpoint.TMP_PREFIX}{name}"
        baseline = memory.gpu_bytes(self.dist.on_gpu)["gpu_alloc"]
        started = time.perf_counter()
        mode = self._write_files(tmp, name)
        self._pending = {"state": dataclasses.replace(state), "tmp": tmp, "name": name, "started": started,
                         "mode": mode}
        if mode == "sync":
            self._finish_in_flight()
        stall = time.perf_counter() - started
        residue = self._release_temporaries(baseline, name)
        self.timeline.mark(state.step, "save", seconds=round(stall, 3), checkpoint=name, mode=mode,
                           residue_bytes=residue, host_buffer_bytes=self.io.arena.capacity)

    def _write_files(self, tmp: Path, name: str) -> str:
        """DeepSpeed's files and this rank's RNG state into tmp, through zerofit's checkpoint
        engine: written now ("sync"), or snapshotted and handed to the writer ("async")."""
        if self.dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        try:
            self.ds_engine.save_checkpoint(str(self.root), tag=tmp.name, save_latest=False,
                                           exclude_frozen_parameters=self.config.lora.enabled)
        except OSError as e:  # a write outside the checkpoint engine (DeepSpeed's recovery scripts)
            if self.dist.world_size > 1:
                raise  # the other ranks wait inside DeepSpeed's barrier: only a restart helps
            self.io.error = self.io.error or f"DeepSpeed's save_checkpoint: {e}"
        if self.config.zero.gather_16bit_weights_on_save:
            self._write_16bit_model(tmp)
        copies = zerofiles.nvme_copies(tmp, self.dist.rank)
        if self.config.zero.offload_optimizer == "nvme" and copies.is_dir():
            nvme.record_sub_groups(self.ds_engine.optimizer, copies)
        self.io.save(checkpoint.rng_state(), str(tmp / f"rng_state_rank{self.dist.rank}.pt"))
        # every rank must take the same road (the sync road publishes through collectives now)
        mode = "async" if self.settings.async_save and self._all(self.io.snapshot_fits()) else "sync"
        if self.settings.async_save and mode == "sync" and self.dist.is_main:
            warn(f"checkpoint {name} written synchronously: "
                 f"{self.io.fallback_reason or 'another rank is over its host RAM budget'}")
        self.io.launch(background=mode == "async")
        return mode

    def _write_16bit_model(self, tmp: Path) -> None:
        """zero.gather_16bit_weights_on_save: the consolidated 16-bit state dict (the module's key
        names: HF's, or peft's under LoRA) as tmp/pytorch_model.bin, what DeepSpeed's
        save_16bit_model writes, through zerofit's engine (its own call would open a second
        checkpoint in it). Under ZeRO-3 every rank gathers module by module (the call
        accelerate's get_state_dict makes); rank 0 holds and writes it."""
        if self.ds_engine.zero_optimization_partition_weights():
            state = self.ds_engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.ds_engine.module_state_dict() if self.dist.is_main else None
        if self.dist.is_main:
            self.io.save(state, str(tmp / MODEL_16BIT_FILE))

    @property
    def in_flight(self) -> bool:
        """A save was started and is not yet published (or failed)."""
        return self._pending is not None

    def poll(self, step: int) -> None:
        """Every step: publish the async save in flight once every rank's writer is done.
        One small collective per step while a save is in flight; never waits for I/O."""
        if self._pending is None:
            return
        if self._all(not self.io.writing):
            self._finish_in_flight(step)

    def drain(self, step: int) -> None:
        """Wait for the save in flight and publish it (or say it failed): afterwards saved_step
        is a checkpoint that exists."""
        self._finish_in_flight(step)

    def close(self, step: int) -> None:
        """Drain, and give SIGTERM and SIGINT back to their earlier handlers (normal end and signals)."""
        self.drain(step)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)

    def due(self, step: int, last: bool) -> bool:
        """Whether this step saves: every checkpoint.every_steps, at the end (save_final), or once
        checkpoint.every_minutes have passed since the last save (any rank's clock: all agree)."""
        if checkpoint_step(self.settings.every_steps, step) or (last and self.settings.save_final):
            return True
        if not self.settings.every_minutes:
            return False
        return self._any(time.monotonic() - self._last_save_at >= self.settings.every_minutes * 60)[0]

    def stop_requested(self) -> str | None:
        """`ctrl-c` or `sigterm` on every rank once any rank got a first Ctrl-C or SIGTERM (checked at
        step boundaries, so a save is never cut short by it); None while neither came."""
        interrupted, terminated = self._any(self._interrupted, self._terminated)
        return "ctrl-c" if interrupted else "sigterm" if terminated else None

    def _on_sigterm(self, signum, frame) -> None:
        self._terminated = True

    def _on_sigint(self, signum, frame) -> None:
        """A first Ctrl-C finishes the step and saves it (as SIGTERM does); a second aborts at once.
        Under torchrun a terminal's Ctrl-C comes twice, at once: to every rank and passed on by the
        agent (its shutdown signals the workers with the signal it got); that is one Ctrl-C."""
        now = time.monotonic()
        if self._interrupted:
            if os.environ.get("TORCHELASTIC_RUN_ID") and now - self._interrupted_at < FORWARDED_WITHIN_S:
                return
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self._interrupted, self._interrupted_at = True, now
        if self.dist.is_main:  # a terminal's Ctrl-C reaches every rank: one says it
            say(f"Ctrl-C: finishing step {self.step_in_progress} and saving; press again to abort")

    # ---------------------------------------------------------------- publish
    def _finish_in_flight(self, step: int | None = None) -> None:
        pending = self._pending
        if pending is None:
            return
        waited = time.perf_counter()
        self.io.wait()
        outcomes = self._gather((self.io.error, self.io.written, self.io.write_seconds))
        self._pending = None
        errors = [f"rank {rank}: {error}" for rank, (error, _, _) in enumerate(outcomes) if error]
        if errors:
            self._failed(step or pending["state"].step, pending["name"], pending["tmp"], "; ".join(errors))
            return
        if self.dist.is_main:
            written = {name: entry for _, files, _ in outcomes for name, entry in files.items()}
            write_seconds = max(seconds for _, _, seconds in outcomes)  # the ranks write side by side
            milestone = checkpoint.is_milestone(pending["state"].step, self.settings.keep_every)
            final = checkpoint.publish(pending["tmp"], pending["state"], written, self.zero_stage, milestone)
            faults.kill_if_armed("latest")
            removed = checkpoint.apply_retention(self.root, self.settings.keep_last, self.settings.keep_every)
            self._report(final, pending, written, removed, step, time.perf_counter() - waited, write_seconds)

    def _report(self, final: Path, pending: dict, written: dict, removed: list[str], step: int | None,
                drain_seconds: float, write_seconds: float) -> None:
        total = sum(e["bytes"] for e in written.values())
        seconds = time.perf_counter() - pending["started"]
        extra = f", removed {', '.join(removed)}" if removed else ""
        if pending["mode"] == "async":  # the rate over the writer's time, not until the loop next looked
            say(f"checkpoint {final.name}: {memory.human_bytes(total)} written in the background in "
                f"{write_seconds:.2f} s ({write_rate(total, write_seconds)}){extra}")
            self.timeline.mark(step or pending["state"].step, "checkpoint_written", checkpoint=final.name,
                               bytes=total, snapshot_seconds=round(self.io.snapshot_seconds, 3),
                               write_seconds=round(self.io.write_seconds, 3),
                               write_gbps=round(total / 1e9 / max(self.io.write_seconds, 1e-9), 3),
                               commit_wait_seconds=round(self.io.commit_wait_seconds, 3),
                               drain_seconds=round(drain_seconds, 3))
        else:
            say(f"checkpoint {final.name}: {memory.human_bytes(total)} in {seconds:.1f} s{extra}")

    def newest(self) -> str | None:
        """The newest published checkpoint's name, as messages about what is kept name it."""
        published = checkpoint.published(self.root)
        return published[0].name if published else None

    def _failed(self, step: int, name: str, tmp: Path | None, reason: str) -> None:
        if self.saved_step == checkpoint.step_of(Path(name)):  # not saved: a later save of it tries again
            self.saved_step = None
        if self.dist.is_main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = self.newest()
        kept = f"the previous checkpoint {newest} is intact" if newest else "no earlier checkpoint exists"
        message = f"checkpoint {name} was not saved: {reason}; {kept}"
        self.timeline.mark(step, "checkpoint_failed", checkpoint=name, error=reason)
        if self.settings.on_error == "stop":
            then = (f"{resume_command(self.config)} continues from the newest valid checkpoint" if newest else
                    f"{resume_command(self.config, resume=False)} starts again (nothing was saved to resume from)")
            raise CheckpointError(f"{message}. Stopped (checkpoint.on_error=stop): fix the cause, then {then}")
        if self.dist.is_main:
            warn(f"{message}; training continues (checkpoint.on_error=continue)")

    # ---------------------------------------------------------------- helpers
    def _predicted_save_bytes(self) -> int:
        """The newest manifest's size, else the formula and, under gather_16bit_weights_on_save,
        the whole 16-bit model (frozen base too: rank 0 writes every parameter)."""
        gathered = 2 * self.total_params if self.config.zero.gather_16bit_weights_on_save else 0
        return checkpoint.predicted_save_bytes(self.root, self.n_params, self.zero_stage, gathered)

    def _space_problem(self) -> str | None:
        needed = self._predicted_save_bytes()
        self.root.mkdir(parents=True, exist_ok=True)
        free = 0 if faults.armed("nospace", "save", faults.count("save")) else None
        return checkpoint.free_space_problem(self.root, needed, free)

    def _reserve_host_buffer(self) -> None:
        """Fault the snapshot buffer's pages in now, in the background, so the first async
        save copies into warm memory. Sized from the last manifest or the formula, with
        slack for partition padding: a buffer found too small is reallocated at the save."""
        per_rank = self._predicted_save_bytes() // self.dist.world_size
        if self.config.zero.gather_16bit_weights_on_save and self.dist.is_main and self.dist.world_size > 1:
            per_rank += 2 * self.total_params  # rank 0 writes the whole gathered model
        nbytes = min(estimate.snapshot_buffer_bytes(per_rank), self.io.arena.max_bytes)
        if self.dist.is_main:
            say(f"async checkpoints: {memory.human_bytes(nbytes)} of host RAM per rank for snapshots (at most "
                f"{memory.human_bytes(self.io.arena.max_bytes)}: checkpoint.async_host_max_gib, by default half "
                f"the plan's host budget)")
        threading.Thread(target=self.io.arena.reserve, args=(nbytes,), daemon=True,
                         name="zerofit-host-buffer").start()

    def _release_temporaries(self, baseline: int, name: str) -> int:
        """Free what the save left behind and report GPU memory still held beyond the
        pre-save level (a residue makes the next step's peak higher than planned). The
        save's temporaries are young objects: collecting generations 0-1 is enough and
        cheap; a full collection (0.1-0.3 s with transformers loaded) only if GPU memory
        is still held after it."""
        residue = self._collect(generation=1) - baseline
        if residue > RESIDUE_WARN_BYTES:
            residue = self._collect(generation=2) - baseline
        if residue > RESIDUE_WARN_BYTES:
            warn(f"rank {self.dist.rank}: {memory.gib(residue)} of GPU memory still allocated after saving {name} "
                 f"(before: {memory.gib(baseline)}); the next steps have that much less room")
        return residue

    def _collect(self, generation: int) -> int:
        gc.collect(generation)
        if self.dist.on_gpu:
            import torch

            torch.cuda.empty_cache()
        return memory.gpu_bytes(self.dist.on_gpu)["gpu_alloc"]

    def _barrier(self) -> None:
        if self.dist.world_size > 1:
            import torch.distributed as torch_dist

            torch_dist.barrier()

    def _agree(self, value):
        """Rank 0's value on every rank."""
        if self.dist.world_size == 1:
            return value
        import torch.distributed as torch_dist

        box = [value]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, value) -> list:
        if self.dist.world_size == 1:
            return [value]
        import torch.distributed as torch_dist

        out = [None] * self.dist.world_size
        torch_dist.all_gather_object(out, value)
        return out

    def _any(self, *flags: bool) -> list[bool]:
        """Each flag: whether it holds on any rank (one small collective for all of them)."""
        if self.dist.world_size == 1:
            return list(flags)
        import torch
        import torch.distributed as torch_dist

        values = torch.tensor([int(flag) for flag in flags], device=self.ds_engine.device)
        torch_dist.all_reduce(values, op=torch_dist.ReduceOp.MAX)
        return [bool(value) for value in values.tolist()]

    def _all(self, flag: bool, every: bool = True) -> bool:
        """every=True: flag holds on all ranks; False: on any rank."""
        if self.dist.world_size == 1:
            return flag
        import torch
        import torch.distributed as torch_dist

        value = torch.tensor([int(flag)], device=self.ds_engine.device)
        torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MIN if every else torch_dist.ReduceOp.MAX)
        return bool(value.item())


def checkpoint_step(interval: int, step: int) -> bool:
    return interval > 0 and step % interval == 0


def write_rate(nbytes: int, seconds: float) -> str:
    """Bytes a second as a person reads it: GB/s for a large model's checkpoint, MB/s or kB/s for a
    small one (a tiny model's save read "0.00 GB/s")."""
    rate = nbytes / max(seconds, 1e-9)
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6)):
        if rate >= scale:
            return f"{rate / scale:.2f} {unit}"
    return f"{rate / 1e3:.1f} kB/s"


def replay_cpu_adam_steps(ds_engine) -> int:
    """Bring DeepSpeedCPUAdam's C++ step state to where the uninterrupted run had it; the
    step count replayed (0: not that optimizer, or no step taken yet).

    The op keeps Adam's bias-correction powers beta^t as floats in C++ (csrc/includes/
    cpu_adam.h, IncrementStep): multiplied by beta once per step in a run, but computed
    with std::pow when the step it is given is not the next one, as on the first step after
    a resume. The two round differently, so a resumed run's updates drift from the
    uninterrupted run's (1.2e-7 after 6 steps on 4096 parameters; tests/test_checkpointer.py).
    Calling the op's update with the step numbers 1..N and no tensors repeats those
    multiplications and nothing else (a zero-length update)."""
    import torch

    basic = getattr(getattr(ds_engine, "optimizer", None), "optimizer", None)
    if not (hasattr(basic, "ds_opt_adam") and hasattr(basic, "opt_id")):
        return 0
    steps = max((int(state["step"]) for state in basic.state.values() if "step" in state), default=0)
    group, empty = basic.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]
    for step in range(1, steps + 1):
        basic.ds_opt_adam.adam_update(basic.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                      group["weight_decay"], group["bias_correction"], empty, empty, empty, empty)
    return steps
