"""The training run's set-up, top to bottom: everything before the first step, returned as a Run
(the engine, the data, the loop's state and what it records with) for train/loop.py."""
from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerofit import models
from zerofit.checkpoint import files as checkpoint
from zerofit.config.schema import Config
from zerofit.core import cgroup, runlock
from zerofit.core import timeline as memory
from zerofit.core.console import Shown, StepProgress, say, warn
from zerofit.core.errors import ConfigError
from zerofit.data import chatlayout, rows
from zerofit.data import pipeline as data
from zerofit.lora import attach as lora
from zerofit.lora import base
from zerofit.lora import resume as loraresume
from zerofit.machine import hostalloc, procenv
from zerofit.nvme import preflight as nvme
from zerofit.plan import deepspeed, render
from zerofit.recovery import elastic, peerwatch, postmortem
from zerofit.train import checkpointer, datareport, engine, ranks, runfiles, watchdog
from zerofit.train.metrics import MetricsLog, RunResult
from zerofit.train.resume import ResumePoint, changed_on_resume, choose_resume, refuse_resume_without_checkpoint


@dataclass
class Run:
    """What the loop runs with, built by setup()."""
    config: Config
    dist: ranks.Dist
    run_dir: Path
    total_steps: int
    engine: object  # the DeepSpeed engine
    saver: checkpointer.Checkpointer
    swap_guard: nvme.SwapGuard
    state: checkpoint.LoopState
    batches: data.Batches
    eval_set: data.Sequences
    timeline: memory.Timeline
    watchdog: watchdog.Watchdog
    metrics: MetricsLog
    progress: StepProgress
    resume_point: ResumePoint


def setup(config: Config, resume: bool | None, session: postmortem.Session) -> Run | RunResult:
    """Everything before the first step: the run directory and its lock, the process group, the
    model's checks, the data, the plan, the engine, the checkpoint it resumes from and what the
    loop records with. A run already at its last step comes back as its RunResult."""
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
    session.attach(engine=ds_engine, saver=saver, state=state, timeline=timeline, progress=progress)
    return Run(config, dist, run_dir, total_steps, ds_engine, saver, swap_guard, state, batches, eval_set, timeline,
               dog, metrics, progress, resume_point)


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
