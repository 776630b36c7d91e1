"""The training loop, top to bottom: set up, then `while step < max_steps:` with the
once-in-a-while blocks (eval, checkpoint, memory watchdog) each a few lines calling their
module. An out-of-memory error anywhere in it goes to the post-mortem (postmortem.py)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerofit.lora import base, attach as lora, resume as loraresume
from zerofit.core import cgroup, faults, timeline as memory
from zerofit.data import chatlayout, pipeline as data, rows
from zerofit.checkpoint import files as checkpoint
from zerofit.train import checkpointer, datareport, engine, ranks, runfiles, watchdog
from zerofit.machine import procenv
from zerofit.core import runlock
from zerofit.plan import deepspeed, render
from zerofit.machine import hostalloc
from zerofit.recovery import elastic, lastword, peerwatch, postmortem
from zerofit import loss, models
from zerofit.nvme import preflight as nvme
from zerofit.recovery import oomreport
from zerofit.config.schema import Config
from zerofit.core.errors import ConfigError
from zerofit.core.console import CountProgress, Shown, StepProgress, say, warn
from zerofit.train.resume import (changed_on_resume, choose_resume, refuse_resume_without_checkpoint, resume_command,
                            where_to_go_on)
from zerofit.core.files import open_unlinked, read_jsonl, write_atomic


@dataclass
class RunResult:
    run_dir: Path
    step: int
    train_loss: float | None
    eval_loss: float | None
    resumed_from: str | None
    stopped_by_signal: bool = False
    interrupted: bool = False  # the signal was a first Ctrl-C (exit 130), not SIGTERM (143)


def train(config: Config, resume: bool | None = None) -> RunResult:
    """Train per `config`. resume: True = must resume, False = start over, None = resume
    when the run dir holds a valid checkpoint. An OOM writes RUN_DIR/postmortem/ and
    stops (exit 1), or retries with safer settings (memory.on_oom)."""
    rank = int(os.environ.get("RANK", "0"))  # the process group is not up yet
    last_word = oomreport.directory_of(Path(config.run_dir), rank) / lastword.RECORD
    with peerwatch.sigterm_ends_by_way_of_python(), \
            peerwatch.failure_announced(last_word, rank):  # the other ranks' watchers then leave at once
        return postmortem.run_with_oom_policy(run, config, resume)


def run(config: Config, resume: bool | None, session: postmortem.Session) -> RunResult:
    run_dir = Path(config.run_dir)
    if int(os.environ.get("RANK", "0")) == 0:  # made and locked before anything in it is read or rewritten
        refuse_resume_without_checkpoint(config, resume)
        runlock.hold(runfiles.usable_run_dir(run_dir))
    threads_note = procenv.apply_cpu_threads(config)
    dist = ranks.init_distributed()
    # the other ranks' after rank 0's (it joined the group first): one that made the directory while rank 0
    # looked whether it was there left it behind when the start failed (verbs.cmd_train removes what it made)
    runfiles.usable_run_dir(run_dir)
    engine.check_precision(config.train.precision, dist.on_gpu)
    peerwatch.keep_beating(config.elastic.lost_node_after_s)  # several nodes: heard through the build and the load
    config, resume = elastic.resume_after_oom(config, resume, dist)  # torchrun restarted the ranks after an OOM
    session.attach(config=config)
    procenv.use_expandable_segments(config, dist.on_gpu)
    session.begin(dist)
    if threads_note and dist.is_main:
        say(threads_note)
    seed_everything(config.train.seed)
    hf_config = models.hf_config(config.model)  # what model.path or model.config names, before its tokenizer
    models.check_weights(config.model)
    tokenizer = models.load_tokenizer(config.model, synthetic_data=config.data.path == "synthetic")
    models.check_attention(config.model, hf_config)
    models.check_neat_packing(config.data, hf_config)
    check_seq_len(config, hf_config)  # an absurd one was OOM-killed while tokenizing
    if (beyond := models.positions_beyond_trained(config.model, config.train.seq_len, hf_config)) and dist.is_main:
        warn(beyond)
    engine.check_base_files(config)
    # refused before loading where its peak would not fit the host: the process's RSS now, and what
    # the files' sizes and a sample of their rows say the rows will hold (loadpeak); rank 0's for all
    data_load = render.data_load_of(config, tokenizer, run_dir, memory.host_rss_bytes()) if dist.is_main else None
    data_loaded = render.check_data_load(config, dist, data_load)
    memory.reset_host_peak()  # an in-process OOM retry's earlier attempt peaked above the loading
    train_set, eval_set = data.load_splits(config.data, tokenizer, config.train.seq_len, config.train.seed,
                                           hf_config.vocab_size, Shown(dist.is_main, config.log.progress),
                                           run_dir=run_dir, node=ranks.machine_node(dist))
    hostalloc.return_freed_heap()  # the examples' lists, before the planner counts the packed arrays alone
    # tokenizing peaks above what stays (each example's Python lists): said in the start record, apart
    # from the peaks of what the plan predicts (VmHWM reset), which it would otherwise stand for
    data_load_host_peak = memory.proc_status()["VmHWM"]
    memory.reset_host_peak()
    config, decision = render.plan_run(config, dist, dataset_bytes=held_bytes(train_set, eval_set),
                                         data_loaded=data_loaded, resuming=resume is not False)
    session.attach(config=config)  # an OOM's safer settings start from what runs, the planner's choices in it
    total_steps = total_optimizer_steps(config, len(train_set), dist.world_size)
    # rank 0 alone writes loop_state.json and compares on resume: the other ranks need not hash the data
    fresh = fresh_state(config, dist, hf_config, epoch_sequences=len(train_set),
                        data_fingerprint=data.fingerprint(train_set) if dist.is_main else "")
    resume_point = choose_resume(config, dist, resume, fresh, session.retry)  # before any run file is rewritten
    if resume_point.directory is not None and resume_point.step >= total_steps:  # nothing to train: the run's files
        if dist.is_main:  # (config.yaml, model/) stay those of its checkpoints, and no engine is built
            say(f"{run_dir} is complete at step {resume_point.step}; raise train.max_steps to go on, or use "
                f"--no-resume")
            runlock.give_back(run_dir)  # nor the lock: the pid there stays that of the run that trained
        return RunResult(run_dir, resume_point.step, None, None, Path(resume_point.directory).name, False)
    if dist.is_main and resume_point.directory is not None and \
            (changed := changed_on_resume(config, resume_point, fresh)):
        warn(changed)  # before the run's config.yaml, which it compares with, is rewritten
    ds_config = deepspeed.build(config, dist.world_size, dist.on_gpu, load_universal=resume_point.universal)
    if dist.is_main:
        runlock.keep(run_dir)  # the start changes the run from here: a later error leaves the lock as the run's
        runfiles.write_run_files(run_dir, config, ds_config, tokenizer, hf_config, decision.record,
                        chatlayout.trained_chat_template(train_set.formats, tokenizer, config.data.alpaca_template))
        runfiles.write_generation_config(run_dir, config, tokenizer, hf_config, train_set.formats)
        datareport.report_data(train_set, eval_set, config, tokenizer)
        say(render.plan_line(decision))

    nvme.clear_swap(config, dist.local_rank)  # stale swap files of an earlier process
    model = engine.build_model(config, ds_config)
    if config.lora.enabled and dist.is_main:
        say(lora.trainable_summary(model))
        if (frozen := lora.unadaptable_warning(model)) is not None:
            warn(frozen)
    ds_engine = engine.build_engine(model, config, ds_config, total_steps)
    timeline = memory.Timeline(run_dir, dist.rank, dist.on_gpu,
                               nvme_path=nvme.swap_root(config) if nvme.uses_nvme(config) else None,
                               predictions=render.phase_predictions(decision))
    saver = checkpointer.Checkpointer(ds_engine, config, dist, timeline,
                                      host_budget_bytes=decision.record["hardware"]["host_budget_bytes"])
    swap_guard = nvme.SwapGuard(ds_engine)
    state = saver.load(resume_point, fresh)
    if config.lora.enabled:  # checkpoints hold adapters only: the rebuilt base must be the same
        loraresume.check_and_record(ds_engine.module, state, dist.rank, dist.world_size,
                                    base.recipe_record(config, dist.on_gpu, engine.builds_under_zero_init(ds_config)),
                                    base_checked=resume_point.base_checked)
    if dist.is_main and resume_point.directory is not None:  # once nothing can refuse it any more
        say(f"resumed from {resume_point.directory} at step {state.step}")
    batches = data.Batches(train_set, config.train.micro_batch_size, dist.rank, dist.world_size,
                           config.train.seed, position=state.micro_batches)
    dog = watchdog.arm(timeline, state.step, dist.on_gpu, config.memory.watchdog_threshold,
                       config.memory.watchdog_action, config.plan.gpu_mem, config.plan.host_mem, dist.world_size,
                       settings=postmortem.memory_settings(config), data_load_host_peak=data_load_host_peak)
    metrics = MetricsLog(run_dir, dist.is_main, config.log.tensorboard, keep_upto=state.step)
    progress = StepProgress(total_steps, state.step, dist.is_main, config.log.progress)
    train_loss = eval_loss = stop_reason = signalled = None
    session.attach(engine=ds_engine, saver=saver, state=state, timeline=timeline, progress=progress)

    # metrics closed however the loop ends: an error's exit skips the interpreter's teardown (end_after_error)
    with metrics, end_recorded(timeline, state), \
            peerwatch.leave_at_once_when_a_peer_is_gone(config.elastic.lost_node_after_s):  # no step can finish
        while state.step < total_steps:
            started, lr = time.perf_counter(), ds_engine.get_lr()[0]  # the LR this step applies
            saver.step_in_progress = state.step + 1  # what a Ctrl-C says it finishes and saves
            position = batches.position
            train_loss = train_step(ds_engine, batches, config.train.grad_accum_steps, timeline, dist, state.step + 1,
                                    config.train.chunked_loss, config.train.heap_step_temporaries)
            faults.shorten_swap_if_armed(state.step + 1, swap_guard.swapper)
            swap_guard.check()  # a failed NVMe write: stop before DeepSpeed reads it back
            refuse_non_finite(train_loss, state.step + 1, saver)  # before it is logged, saved or rotates one out
            nvme.release_swapped_views(swap_guard.swapper)  # before a checkpoint saves them as state
            state.step += 1
            state.micro_batches = batches.position
            tokens = batches.tokens_between(position, batches.position)  # every rank's, padding left out
            state.tokens_seen += tokens
            seconds = time.perf_counter() - started
            record = {"step": state.step, "loss": train_loss, "lr": lr,
                      "tokens_per_s": tokens / seconds, "step_seconds": seconds, "epoch": batches.epoch}
            step_records = timeline.flush(state.step)
            last = state.step == total_steps

            if state.step % config.log.every_steps == 0 or last:  # before its eval's and its save's lines
                progress.update(state.step, progress_info(record, step_records, dist.on_gpu, dog.facts.gpu_budget))
            if every(config.eval.every_steps, state.step) or (last and config.eval.at_end):
                # its progress as plain lines above the training bar: a second bar stayed drawn after it ended
                record["eval_loss"] = eval_loss = evaluate(ds_engine, eval_set, config, dist, timeline, state.step,
                                                           Shown(dist.is_main, bar=False))

            # the step's line before its checkpoint: a kill after the publish left it unwritten for good
            # (a resume keeps the lines up to the checkpoint's step), one before it is rolled back
            metrics.write(record)
            if record.get("eval_loss") is not None:  # every eval in the log, not only one a progress line shows
                progress.note(state.step, f"eval loss {record['eval_loss']:.4f}")
            saver.poll(state.step)  # an async save whose writers all finished gets published
            if saver.due(state.step, last):  # checkpoint.every_steps or every_minutes, or the end
                saver.save(state)
            faults.hold_memory_if_armed(state.step, ds_engine.device)

            stop_reason = watch_memory(dog, step_records, saver, config, state, dist, timeline)
            signalled = saver.stop_requested()  # SIGTERM or a first Ctrl-C (every rank agrees): save, then stop
            if signalled == "ctrl-c" or (signalled and config.checkpoint.save_on_sigterm):
                saver.drain(state.step)  # a save of this step in flight that then fails is made again
                if saver.saved_step != state.step:
                    saver.save(state)
            if stop_reason or signalled:
                break

    saver.close(state.step)  # drains the save in flight
    nvme.remove_rank_swap(config, dist.rank)
    progress.close()
    timeline.end(state.step, "memory stop" if stop_reason else signalled or "completed")
    timeline.close()
    if stop_reason:
        raise watchdog.MemoryStop(stop_reason)
    if dist.is_main and signalled:
        say(f"stopped by {'Ctrl-C' if signalled == 'ctrl-c' else 'SIGTERM'} at step {state.step}, "
            f"{where_to_go_on(config)}")
    elif dist.is_main and train_loss is not None:  # a finished run started again said it was complete
        say(f"done: step {state.step}, {memory.human_count(state.tokens_seen)} tokens trained (padding left out), "
            f"train loss {fmt(train_loss)}, eval loss {fmt(eval_loss)} -> {run_dir}")
    resumed_from = Path(resume_point.directory).name if resume_point.directory else None
    return RunResult(run_dir, state.step, train_loss, eval_loss, resumed_from, signalled is not None,
                     signalled == "ctrl-c")


class NonFiniteLoss(ConfigError):
    """The loss became NaN or Inf: nothing of that step is logged or saved."""


def refuse_non_finite(loss: float, step: int, saver: checkpointer.Checkpointer) -> None:
    """A NaN or Inf loss (mean over ranks: every rank stops alike) ends the run before the step
    is logged or saved: training on would publish NaN checkpoints and rotate out the last good
    one (seen after a resume from damaged masters under checkpoint.verify sizes)."""
    if math.isfinite(loss):
        return
    newest = saver.newest()
    kept = f"the newest checkpoint, {newest}, is as it was" if newest else "no checkpoint was saved"
    raise NonFiniteLoss(f"the loss is {loss} at step {step}: training diverged, or the checkpoint it resumed from "
                        f"is damaged; nothing of this step was saved, {kept}. Resume with a lower train.lr, or "
                        f"check the checkpoints' bytes first (`--verify full`)")


# ------------------------------------------------------------------------ one step
def train_step(ds_engine, batches: data.Batches, accum: int, timeline: memory.Timeline, dist: ranks.Dist,
               step: int, chunked_loss: bool = True, heap_step_temporaries: bool = False) -> float:
    """One optimizer step of `accum` micro batches; returns its loss, the mean over every token
    the step trained on, on every rank.

    The gradient is that mean's too, whatever the split into micro batches and ranks: each
    micro batch's mean loss is weighted by its share of the step's tokens. DeepSpeed divides
    each backward by accum (scale_wrt_gas) and averages gradients over ranks, so the weight is
    tokens / step_tokens x accum x ranks. A plain mean of micro-batch means (what DeepSpeed alone
    gives) over-weights the tokens of micro batches with few answer tokens: the gradient
    accumulation bug transformers fixed with num_items_in_batch (v4.46). An OOM retry that
    changes micro batch x accumulation so keeps the same objective."""
    import torch

    mine, step_tokens = batches.step_targets(accum)
    weight = accum * dist.world_size / step_tokens
    summed = []
    for tokens in mine:
        batch = batches.next()
        postmortem.inject_oom_if_armed(step)
        faults.stall_or_kill_if_armed(step)
        micro_loss = forward_loss(ds_engine, batch, chunked_loss)
        timeline.observe("forward")
        ds_engine.backward(micro_loss * (tokens * weight))
        timeline.observe("backward")
        with hostalloc.heap_temporaries(heap_step_temporaries):
            ds_engine.step()
        timeline.observe("optimizer_step")
        summed.append(micro_loss.detach().float() * tokens)
    return sum_over_ranks(torch.stack(summed).sum(), dist) / step_tokens


def forward_loss(ds_engine, batch: data.MicroBatch, chunked: bool):
    """The micro batch's mean next-token loss: zerofit.loss on the model's logits, or HF's."""
    import torch

    on_device = {name: torch.from_numpy(array).to(ds_engine.device)
                 for name, array in batch._asdict().items() if array is not None}
    labels = on_device.pop("labels")
    if not chunked:
        return ds_engine(**on_device, labels=labels).loss
    return loss.causal_lm_loss(ds_engine(**on_device).logits, labels)


def sum_over_ranks(value, dist: ranks.Dist) -> float:
    import torch.distributed as torch_dist

    if dist.world_size > 1:
        torch_dist.all_reduce(value)
    return float(value)


def watch_memory(dog: watchdog.Watchdog, step_records: list[dict], saver: checkpointer.Checkpointer, config: Config,
                 state: checkpoint.LoopState, dist: ranks.Dist, timeline: memory.Timeline) -> str | None:
    """The watchdog's turn: warn, save pre-emptively, or save and stop (returns why).
    A save is collective, so with watchdog_action save/stop the ranks agree first: one
    rank over the threshold acts for all."""
    crossing = dog.check(state.step, step_records)
    if crossing:
        warn(("" if dist.world_size == 1 else f"rank {dist.rank}: ") + crossing.message())
        timeline.mark(state.step, "watchdog", **crossing.record())
    action = config.memory.watchdog_action
    if action == "warn" or not watchdog.any_rank(crossing is not None, dist.on_gpu, dist.world_size):
        return None
    if saver.saved_step != state.step:
        saver.save(state)
    if action != "stop":
        return None
    saver.drain(state.step)  # an async save's outcome known before the stop names it
    why = crossing.message() if crossing else "watchdog: another rank crossed memory.watchdog_threshold"
    saved = saver.root / checkpoint.step_name(state.step) if saver.saved_step == state.step else \
        f"none of step {state.step} (its save failed, above); the newest is {saver.newest() or 'none'}"
    return (f"{why}\n  checkpoint: {saved}\n  resume after lowering memory use (`zerofit doctor "
            f"{shlex.quote(str(config.run_dir))}` names the phase and the fix): "
            f"{resume_command(config, resume=False)}")


def eval_sequences(config: Config, world_size: int, held: int) -> int:
    """How many of the eval set's sequences an evaluation covers: eval.max_sequences, else an
    older config's eval.max_batches x micro batch x ranks, else all of them."""
    if config.eval.max_sequences is not None:
        return min(config.eval.max_sequences, held)
    if config.eval.max_batches is not None:
        return min(config.eval.max_batches * config.train.micro_batch_size * world_size, held)
    return held


def evaluate(ds_engine, eval_set: data.Sequences, config: Config, dist: ranks.Dist,
             timeline: memory.Timeline, step: int, shown: Shown) -> float | None:
    import torch

    batches = list(data.eval_batches(eval_set, config.train.micro_batch_size, dist.rank, dist.world_size,
                                     eval_sequences(config, dist.world_size, len(eval_set))))
    if not batches:
        return None
    ds_engine.eval()
    learned_counts = [data.targets(batch.labels) for batch in batches]
    summed = []
    with torch.no_grad(), CountProgress(f"step {step} eval", len(batches), "micro batches", *shown) as progress:
        for batch, n in zip(batches, learned_counts):  # the mean over every token evaluated, as the training loss is
            loss_value = forward_loss(ds_engine, batch, config.train.chunked_loss).float()
            engine.release_gathered(ds_engine)  # else the next forward gathers on top of this one's leftovers
            summed.append(loss_value * n if n else torch.zeros((), device=ds_engine.device))  # a stand-in row: 0/0
            progress.advance()
    ds_engine.train()
    timeline.mark(step, "eval", released_gathered=True)  # read by detectors.after_eval_spike
    tokens = torch.tensor(float(sum(learned_counts)), device=ds_engine.device)
    return sum_over_ranks(torch.stack(summed).sum(), dist) / sum_over_ranks(tokens, dist)


# -------------------------------------------------------------------------- set-up
def check_seq_len(config: Config, hf_config) -> None:
    """Refuse a train.seq_len no row can be made of, before any row is read: past a learned
    position table, or more than the host's RAM (plan.host_mem, else the machine's or its
    cgroup's) can build the first rows of (rowlayout.rows_host_problem)."""
    models.check_position_table(config.train.seq_len, hf_config)
    budget = memory.parse_bytes(config.plan.host_mem, "plan.host_mem")
    where = f"plan.host_mem={config.plan.host_mem}"
    if budget is None:
        host = cgroup.host_memory()
        budget, where = host.total, f"this host ({host.limit})" if host.limit else "this host's RAM"
    neat = config.data.packing and config.data.neat_packing
    context = getattr(hf_config, "max_position_embeddings", None)
    if problem := rows.rows_host_problem(config.train.seq_len, neat, budget, where,
                                              context if isinstance(context, int) else None):
        raise ConfigError(problem)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def total_optimizer_steps(config: Config, sequences: int, world_size: int) -> int:
    """train.max_steps, or the fewest steps that take train.epochs passes over the data. An epoch
    is counted in micro batches, as data.Batches serves them (sequences // (micro x ranks)), and
    a step may straddle two: counted in whole steps (sequences // step's sequences), 57
    sequences at 4 x 3 made 4 steps an epoch where the loader's epoch is 4.67, so `epochs: 2`
    ended at 1.71 epochs."""
    if config.train.max_steps:
        return config.train.max_steps
    per_step = config.train.micro_batch_size * config.train.grad_accum_steps * world_size
    if sequences < per_step:
        raise ConfigError(f"{sequences} training sequences make no full optimizer step of {per_step}; "
                          f"add data or lower train.micro_batch_size / grad_accum_steps")
    micro_batches = config.train.epochs * (sequences // (config.train.micro_batch_size * world_size))
    return max(1, math.ceil(micro_batches / config.train.grad_accum_steps))


def held_bytes(*sets: data.Sequences) -> int:
    """Host bytes of the tokenized data every rank keeps (ids, labels, neat packing's positions)."""
    return sum(s.input_ids.nbytes + s.labels.nbytes + (s.positions.nbytes if s.positions is not None else 0)
               for s in sets)


def fresh_state(config: Config, dist: ranks.Dist, hf_config=None, epoch_sequences: int = 0,
                data_fingerprint: str = "") -> checkpoint.LoopState:
    shape = models.shape_of(hf_config) if hf_config is not None else {}
    if shape and config.lora.enabled:  # the modules adapted, however lora.target_modules names them
        shape["lora_targets"] = lora.resolve(config, hf_config)
    return checkpoint.LoopState(world_size=dist.world_size, micro_batch_size=config.train.micro_batch_size,
                                epoch_sequences=epoch_sequences, data_fingerprint=data_fingerprint,
                                config_fingerprint=config.fingerprint(), config_values=config.fingerprinted(),
                                model_shape=shape)


# ------------------------------------------------------------------------- logging
class MetricsLog:
    """metrics.jsonl: one JSON object per optimizer step (rank 0). On resume the lines
    after the checkpoint's step are dropped so the file is one clean curve."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, keep_upto: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._file = self._writer = None
        if not enabled:
            return
        # a line torn by a crash (or a full disk) is dropped with the steps after the checkpoint
        kept = [record for record in read_jsonl(self.path) if record.get("step", 0) <= keep_upto] \
            if keep_upto else []
        write_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))
        self._file = open_unlinked(self.path, append=True)  # a link planted there is refused
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("log.tensorboard needs the tensorboard package: pip install tensorboard") from None

            # a resume drops the events past the checkpoint's step, as metrics.jsonl drops its lines
            self._writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=keep_upto + 1 if keep_upto else None)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._writer:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._writer.add_scalar(key, value, record["step"])

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        if self._file:
            self._file.close()
        if self._writer:
            self._writer.close()


@contextlib.contextmanager
def end_recorded(timeline: memory.Timeline, state: checkpoint.LoopState):
    """Around the loop: an exception that ends it leaves an `end` record saying how (the
    doctor reads how a run ended from it; a run that ends normally marks its own). Not an
    OOM: its post-mortem records it, with the readings of the step it cut short."""
    try:
        yield
    except BaseException as error:
        if not postmortem.is_oom(error):
            try:
                timeline.end(state.step, ending_of(error))
            except (OSError, ValueError, MemoryError):  # a full disk, a closed file: the error itself matters more
                pass
        raise


def ending_of(error: BaseException) -> str:
    """How an exception ended the loop, as the doctor says it."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, peerwatch.TerminatedOutsideTheLoop):
        return "sigterm"
    first = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}" + (f": {first[:200]}" if first else "")


def every(interval: int, step: int) -> bool:
    return interval > 0 and step % interval == 0


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def progress_info(record: dict, step_records: list[dict], on_gpu: bool, gpu_budget: int) -> str:
    info = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s " \
           f"{memory.budget_summary(step_records, on_gpu, gpu_budget)}"
    return info
