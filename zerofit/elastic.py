"""The OOM retry with several ranks, carried by torchrun's restarts.

One process retries in place (postmortem.run_with_oom_policy). Several ranks cannot: the others
wait inside a collective the failed rank will never join, and no rank can leave one alone.
torchrun can restart them all: with `--max-restarts N` its agent stops every worker when one
exits non-zero and starts the group again, counting in TORCHELASTIC_RESTART_COUNT. So the rank
that ran out of memory leaves a hand-over beside its post-mortem (the safer config, and which
attempt it belongs to) and exits 1; in the next attempt rank 0 reads the newest hand-over of
this torchrun, every rank receives it from rank 0, and the run resumes from the newest
checkpoint with it.

torchrun's agent keeps one TCP store for all attempts (torch 2.13:
elastic/rendezvous/static_tcp_rendezvous.py and dynamic_rendezvous.py create it once), and a
worker joining the default group through env:// reads the keys the attempt before left there:
gloo's connectFullMesh dialled the killed rank's old address and failed ("timed out connecting",
seen with `torchrun --max-restarts 1` and with `--standalone`). `process_group_store` gives each
restarted attempt keys of its own.

When a worker exits, the agent sends SIGTERM to the others and waits 30 s before SIGKILL
(torch 2.13: elastic/multiprocessing/api.py, `close(death_sig, timeout=30)`). A rank waiting in
a collective for the one that died does not run zerofit's SIGTERM handler (Python runs handlers
between bytecodes, on the main thread), so every restart waited out those 30 s.
`leave_at_once_when_a_peer_is_gone` watches for SIGTERM on a thread of its own.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from zerofit import faults
from zerofit.checkpoint import write_atomic
from zerofit.config import Config, ConfigError, validate
from zerofit.progress import say

HANDOVER = "retry-handover.json"


@dataclass(frozen=True)
class Attempt:
    """One start of the worker group by a torchrun agent."""
    agent_pid: int      # the agent is every worker's parent, the same across its restarts
    run_id: str         # TORCHELASTIC_RUN_ID ("none" unless --rdzv-id or --standalone)
    restart: int        # TORCHELASTIC_RESTART_COUNT: 0 on the first start
    max_restarts: int   # torchrun --max-restarts

    @property
    def restarts_left(self) -> int:
        return self.max_restarts - self.restart

    def follows(self, record: dict) -> bool:
        """`record` was handed over by an earlier attempt of this agent: not by another torchrun
        that used the run directory before."""
        return (record.get("agent_pid"), record.get("run_id")) == (self.agent_pid, self.run_id) and \
            isinstance(record.get("restart"), int) and record["restart"] < self.restart


def current(environ=os.environ) -> Attempt | None:
    """The torchrun attempt this process belongs to; None without a torchrun agent."""
    if "TORCHELASTIC_RESTART_COUNT" not in environ:
        return None
    return Attempt(os.getppid(), environ.get("TORCHELASTIC_RUN_ID", ""), int(environ["TORCHELASTIC_RESTART_COUNT"]),
                   int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def process_group_store():
    """The store for the default process group of a restarted attempt: the agent's, under a
    prefix of this attempt. None (the default env:// rendezvous) on a first start, or where
    the workers do not share the agent's store."""
    attempt = current()
    if attempt is None or attempt.restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as td

    agent_store = td.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=False)
    return td.PrefixStore(f"zerofit/restart-{attempt.restart}", agent_store)


# ------------------------------------------------------------------ the failed attempt
def hand_over(directory: Path, event, safer: Config | None, changes: list[str], why_not: str = "") -> str | None:
    """After an OOM with several ranks: leave `safer` for the next attempt (memory.on_oom=retry),
    or, with `safer` None, word that it must not train (`why_not`: memory.on_oom is stop, or
    nothing safer is known): with the settings that ran out of memory a restart would run out
    again, after repeating every step since the newest checkpoint. The explanation's retry
    line, or None."""
    attempt = current()
    if attempt is None or attempt.restarts_left <= 0:
        return None
    record = {"agent_pid": attempt.agent_pid, "run_id": attempt.run_id, "restart": attempt.restart,
              "rank": event.rank, "step": event.step, "phase": event.phase, "device": event.device,
              "changes": changes, "config": safer.model_dump(mode="json") if safer else None, "why_not": why_not}
    write_atomic(directory / HANDOVER, json.dumps(record, indent=1))
    if safer is None:
        return None
    left = attempt.restarts_left
    return (f"torchrun restarts every rank ({left} restart{'s' if left > 1 else ''} left); they resume from "
            f"the newest checkpoint with these settings")


def take_over(run_dir: Path, attempt: Attempt) -> dict | None:
    """The newest hand-over of an earlier attempt (the lowest failed rank's of that attempt).
    The newest, not only the last attempt's: each is the config that ran made safer, so after
    an OOM retry that then failed for another reason the next restart keeps the safer config
    rather than going back to the command line's."""
    from zerofit.postmortem import rank_files  # postmortem imports this module

    newest = None
    for path in rank_files(run_dir, HANDOVER):  # rank order: the first of an attempt wins
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not ours to judge: a later rank's may be whole
        if attempt.follows(record) and (newest is None or record["restart"] > newest["restart"]):
            newest = record
    return newest


# ------------------------------------------------------------------ the next attempt
def resume_after_oom(config: Config, resume: bool | None, dist) -> tuple[Config, bool | None]:
    """In an attempt torchrun restarted after an OOM (in this attempt's predecessor or an
    earlier one): the safer config a failed rank handed over, on every rank (rank 0 reads it,
    then broadcasts: all ranks must run the same one), and resume from the newest checkpoint;
    a ConfigError on every rank when the hand-over says not to train (memory.on_oom=stop).
    Anything else: `config` and `resume` unchanged."""
    attempt = current()
    if attempt is None or attempt.restart == 0 or dist.world_size == 1:
        return config, resume
    record, problem = None, None
    if dist.is_main:
        record = take_over(Path(config.run_dir), attempt)
        if record is not None and record["config"] is not None:
            try:
                record["config"] = validate(record["config"])  # once, here: the other ranks receive the Config
            except ConfigError as e:
                problem = f"the OOM retry's hand-over from rank {record['rank']} is not a valid config: {e}"
                record = None
    record, problem = broadcast_from_main((record, problem))
    if problem:
        raise ConfigError(problem)
    if record is None:
        return config, resume
    oom = (f"rank {record['rank']} ran out of {'GPU' if record['device'] == 'gpu' else 'host'} memory in step "
           f"{record['step']} ({record['phase']}) of attempt {record['restart'] + 1}")
    if record["config"] is None:
        raise ConfigError(f"{oom}, and {record['why_not']}: torchrun restarted the ranks, but the settings that ran "
                          f"out of memory would run out again, so this attempt stops before training. Post-mortem: "
                          f"{Path(config.run_dir) / 'postmortem'}")
    faults.disarm("oom", "step", record["step"])  # an injected OOM stands for the old settings
    if dist.is_main:
        say(f"[bold]memory.on_oom=retry[/]: {oom}; torchrun restarted every rank (restart {attempt.restart} of "
            f"{attempt.max_restarts}); resuming from the newest checkpoint with {', '.join(record['changes'])}")
    return record["config"], None


def broadcast_from_main(value):
    import torch.distributed as td

    box = [value]
    td.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------ a peer gone
@contextmanager
def leave_at_once_when_a_peer_is_gone():
    """Around the training loop, under torchrun with several workers on this node: SIGTERM
    while a worker of this node has already exited ends this process at once. The agent sends
    SIGTERM to the workers left after one exits; they cannot finish a collective (or a
    checkpoint: a save needs every rank), and waiting for the step boundary is waiting for
    SIGKILL. A SIGTERM with every worker alive (preemption) is left to the loop: it saves at
    the step boundary and stops. Several nodes: only a peer of this node is seen."""
    attempt, local_workers = current(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if attempt is None or local_workers < 2 or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
        yield  # SIGTERM without a Python handler ends the process already
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    # Python's C-level handler writes each signal's number here at once, whatever the main thread does
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_end, attempt.agent_pid, local_workers),
                               name="zerofit-peer-gone", daemon=True)
    if previous == -1:
        watcher.start()
    else:
        signal.set_wakeup_fd(previous)  # someone else listens there: theirs stays
    try:
        yield
    finally:
        if watcher.is_alive():
            signal.set_wakeup_fd(-1)
            os.write(write_end, bytes([STOP_WATCHING]))
            watcher.join()
        os.close(read_end)
        os.close(write_end)


STOP_WATCHING = 0  # no signal has number 0


def _watch(read_end: int, agent_pid: int, local_workers: int) -> None:
    while (signal_number := os.read(read_end, 1)[0]) != STOP_WATCHING:
        alive = workers_alive(agent_pid) if signal_number == signal.SIGTERM else None
        if alive is not None and alive < local_workers:
            say(f"rank {os.environ.get('RANK', '?')}: SIGTERM after {local_workers - alive} of this node's "
                f"{local_workers} workers exited: no collective can finish, leaving now; torchrun restarts or "
                f"stops every rank")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)  # as killed by it; no exit handlers: they would wait on the dead peer


def workers_alive(agent_pid: int) -> int | None:
    """The agent's children still running: the node's workers (torchrun starts them as its
    children and reaps one that exits before it signals the others). None: not known."""
    import psutil

    try:
        children = psutil.Process(agent_pid).children()
    except psutil.Error:
        return None
    alive = 0
    for child in children:
        try:
            alive += child.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            pass  # gone meanwhile
    return alive
