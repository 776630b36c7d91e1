"""The training loop, top to bottom: `setup` (train/setup.py) builds the Run, then
`while step < total_steps:` trains a step and runs the once-in-a-while blocks (progress, eval,
metrics, checkpoint, memory watchdog, a stop asked by a signal), each a few lines calling its
module. The OOM policy (recovery/postmortem.py) wraps each attempt from outside."""
from __future__ import annotations

import contextlib
import math
import os
import shlex
import time
from pathlib import Path

from zerofit import loss
from zerofit.checkpoint import files as checkpoint
from zerofit.config.schema import Config
from zerofit.core import faults
from zerofit.core import timeline as memory
from zerofit.core.console import CountProgress, Shown, say, warn
from zerofit.core.errors import ConfigError
from zerofit.data import pipeline as data
from zerofit.machine import hostalloc
from zerofit.nvme import preflight as nvme
from zerofit.recovery import oomreport, peerwatch, postmortem
from zerofit.train import checkpointer, engine, ranks, watchdog
from zerofit.train.metrics import RunResult, fmt, progress_info
from zerofit.train.resume import resume_command, where_to_go_on
from zerofit.train.setup import Run, setup


def train(config: Config, resume: bool | None = None) -> RunResult:
    """Train per `config`. resume: True = must resume, False = start over, None = resume
    when the run dir holds a valid checkpoint. An OOM writes RUN_DIR/postmortem/ and
    stops (exit 1), or retries with safer settings (memory.on_oom)."""
    rank = int(os.environ.get("RANK", "0"))  # the process group is not up yet
    last_word = oomreport.directory_of(Path(config.run_dir), rank) / peerwatch.RECORD
    with peerwatch.sigterm_ends_by_way_of_python(), \
            peerwatch.failure_announced(last_word, rank):  # the other ranks' watchers then leave at once
        return postmortem.run_with_oom_policy(attempt, config, resume)


def attempt(config: Config, resume: bool | None, session: postmortem.Session) -> RunResult:
    """One attempt of the run: set up, then the loop (a run already complete has nothing to loop)."""
    run = setup(config, resume, session)
    return run if isinstance(run, RunResult) else loop(run)


def loop(run: Run) -> RunResult:
    config, dist, state, saver, timeline = run.config, run.dist, run.state, run.saver, run.timeline
    train_loss = eval_loss = stop_reason = signalled = None
    # metrics closed however the loop ends: an error's exit skips the interpreter's teardown (end_after_error)
    with run.metrics, end_recorded(timeline, state), \
            peerwatch.leave_at_once_when_a_peer_is_gone(config.elastic.lost_node_after_s):  # no step can finish
        while state.step < run.total_steps:
            started, lr = time.perf_counter(), run.engine.get_lr()[0]  # the LR this step applies
            saver.step_in_progress = state.step + 1  # what a Ctrl-C says it finishes and saves
            position = run.batches.position
            train_loss = train_step(run.engine, run.batches, config.train.grad_accum_steps, timeline, dist,
                                    state.step + 1, config.train.chunked_loss, config.train.heap_step_temporaries)
            faults.strike("after_step", state.step + 1, swapper=run.swap_guard.swapper)
            run.swap_guard.check()  # a failed NVMe write: stop before DeepSpeed reads it back
            refuse_non_finite(train_loss, state.step + 1, saver)  # before it is logged, saved or rotates one out
            nvme.release_swapped_views(run.swap_guard.swapper)  # before a checkpoint saves them as state
            state.step += 1
            state.micro_batches = run.batches.position
            tokens = run.batches.tokens_between(position, run.batches.position)  # every rank's, padding left out
            state.tokens_seen += tokens
            seconds = time.perf_counter() - started
            record = {"step": state.step, "loss": train_loss, "lr": lr,
                      "tokens_per_s": tokens / seconds, "step_seconds": seconds, "epoch": run.batches.epoch}
            step_records = timeline.flush(state.step)
            last = state.step == run.total_steps

            if state.step % config.log.every_steps == 0 or last:  # before its eval's and its save's lines
                run.progress.update(state.step, progress_info(record, step_records, dist.on_gpu,
                                                              run.watchdog.facts.gpu_budget))
            if every(config.eval.every_steps, state.step) or (last and config.eval.at_end):
                # its progress as plain lines above the training bar: a second bar stayed drawn after it ended
                record["eval_loss"] = eval_loss = evaluate(run.engine, run.eval_set, config, dist, timeline,
                                                           state.step, Shown(dist.is_main, bar=False))

            # the step's line before its checkpoint: a kill after the publish left it unwritten for good
            # (a resume keeps the lines up to the checkpoint's step), one before it is rolled back
            run.metrics.write(record)
            if record.get("eval_loss") is not None:  # every eval in the log, not only one a progress line shows
                run.progress.note(state.step, f"eval loss {record['eval_loss']:.4f}")
            saver.poll(state.step)  # an async save whose writers all finished gets published
            if saver.due(state.step, last):  # checkpoint.every_steps or every_minutes, or the end
                saver.save(state)
            faults.strike("after_save", state.step, device=run.engine.device)

            stop_reason = watch_memory(run.watchdog, step_records, saver, config, state, dist, timeline)
            signalled = saver.stop_requested()  # SIGTERM or a first Ctrl-C (every rank agrees): save, then stop
            if signalled == "ctrl-c" or (signalled and config.checkpoint.save_on_sigterm):
                saver.drain(state.step)  # a save of this step in flight that then fails is made again
                if saver.saved_step != state.step:
                    saver.save(state)
            if stop_reason or signalled:
                break
    return finish(run, train_loss, eval_loss, stop_reason, signalled)


def finish(run: Run, train_loss: float | None, eval_loss: float | None, stop_reason: str | None,
           signalled: str | None) -> RunResult:
    """After the loop: the save in flight published, the records closed, the end said."""
    config, dist, state = run.config, run.dist, run.state
    run.saver.close(state.step)  # drains the save in flight
    nvme.remove_rank_swap(config, dist.rank)
    run.progress.close()
    run.timeline.end(state.step, "memory stop" if stop_reason else signalled or "completed")
    run.timeline.close()
    if stop_reason:
        raise watchdog.MemoryStop(stop_reason)
    if dist.is_main and signalled:
        say(f"stopped by {'Ctrl-C' if signalled == 'ctrl-c' else 'SIGTERM'} at step {state.step}, "
            f"{where_to_go_on(config)}")
    elif dist.is_main and train_loss is not None:  # a finished run started again said it was complete
        say(f"done: step {state.step}, {memory.human_count(state.tokens_seen)} tokens trained (padding left out), "
            f"train loss {fmt(train_loss)}, eval loss {fmt(eval_loss)} -> {run.run_dir}")
    point = run.resume_point
    resumed_from = Path(point.directory).name if point.directory else None
    return RunResult(run.run_dir, state.step, train_loss, eval_loss, resumed_from, signalled is not None,
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
        faults.strike("forward", step)
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
    """How many of the eval set's sequences an evaluation covers: eval.max_sequences, else all of
    them; the same sequences however the run is split into micro batches and ranks."""
    if config.eval.max_sequences is not None:
        return min(config.eval.max_sequences, held)
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
