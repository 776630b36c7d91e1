"""The OOM retry with several ranks, carried by torchrun's restarts.

One process retries in place (postmortem.run_with_oom_policy). Several ranks cannot: the others
wait inside a collective the failed rank will never join, and no rank can leave one alone.
torchrun can restart them all: with `--max-restarts N` its agent stops every worker when one
exits non-zero and starts the group again. So the rank that ran out of memory hands the safer
config over and exits 1; in the next attempt rank 0 takes it, every rank receives it from rank
0, and the run resumes from the newest checkpoint with it.

The hand-over goes through torchrun's agent store: one TCP store for all attempts (torch 2.13:
elastic/rendezvous/static_tcp_rendezvous.py and dynamic_rendezvous.py create it once), which
the workers of every node reach at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE) and
which ends with the torchrun job: so a hand-over reaches rank 0 on another node, and never one
of a later torchrun of the same run directory. A copy beside the post-mortem is the record for
people and the doctor.

The same persistence broke restarts: a worker joining the default group through env:// read
the keys the attempt before left there, and gloo's connectFullMesh dialled the killed rank's old
address ("timed out connecting"; NCCL: "socketPollConnect ... Connection refused"; sometimes a
hang). `process_group_store` gives each attempt keys of its own under a name its ranks agree on
through the store (`agree_on_attempt`): not TORCHELASTIC_RESTART_COUNT, which differs between
nodes (an agent whose workers did not fail restarts them for the other node's re-rendezvous
without counting: seen with two c10d nodes, the first node's workers at 0, the second's at 1).

What a rank does while a peer fails or is lost is zerofit/recovery/peerwatch.py.
"""
from __future__ import annotations

import json
import os
import shlex
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from zerofit.config.load import validate
from zerofit.config.schema import Config
from zerofit.core import faults
from zerofit.core.console import say
from zerofit.core.errors import ConfigError
from zerofit.core.files import write_atomic

HANDOVER = "retry-handover.json"  # the copy beside the failed rank's post-mortem
HANDOVER_KEY = "zerofit/retry-handover"
STORE_TIMEOUT = timedelta(minutes=10)  # as long as NCCL's default process-group timeout
FAILING_TIMEOUT = timedelta(seconds=10)  # a failing rank's last word must not delay its exit long


@dataclass(frozen=True)
class Attempt:
    """One start of this node's workers by a torchrun agent."""
    agent_pid: int      # the agent is every worker's parent, the same across its restarts
    restart: int        # TORCHELASTIC_RESTART_COUNT: this node's agent's count, 0 on the first start
    max_restarts: int   # torchrun --max-restarts

    @property
    def restarts_left(self) -> int:
        return self.max_restarts - self.restart


# What a collective raises on a rank whose peer is gone (killed outright between the watcher's
# looks: gloo's tcp pair.cc, NCCL's abort), as against a rank's own failure.
PEER_GONE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
                   "remote process exited or there was a network error")


def peer_gone(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_GONE_SIGNS)


def peer_gone_message(error: BaseException, resume_command: str, run_dir: str, environ=os.environ) -> str:
    """`resume_command`: resume.resume_command's, as every message names it."""
    sign = next(sign for sign in PEER_GONE_SIGNS if sign in str(error))
    return (f"rank {environ.get('RANK', '0')}: another rank of this run is gone (\"{sign}\" in a collective); "
            f"the checkpoints published before are intact: {resume_command} continues from the newest (torchrun "
            f"--max-restarts N does it by itself); why the other rank ended is in its own output and "
            f"`zerofit doctor {shlex.quote(str(run_dir))}`")


def launcher(world_size: int, per_node: int | None = None) -> str:
    """How the commands zerofit prints start it: `zerofit` for one rank, torchrun with the
    run's rank count for several (a one-process resume of a 2-rank run changes its batch)."""
    per_node = per_node or world_size
    if world_size <= 1:
        return "zerofit"
    nodes = f"--nnodes {world_size // per_node} <rendezvous flags> " if per_node < world_size else ""
    return f"torchrun {nodes}--nproc_per_node {per_node} -m zerofit"


def running_launcher(environ=os.environ) -> str:
    """`launcher` for this process's own run (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE)."""
    world = int(environ.get("WORLD_SIZE", "1"))
    return launcher(world, int(environ.get("LOCAL_WORLD_SIZE", world)))


def current(environ=os.environ) -> Attempt | None:
    """The torchrun attempt this process belongs to; None without a torchrun agent."""
    if "TORCHELASTIC_RESTART_COUNT" not in environ:
        return None
    return Attempt(os.getppid(), int(environ["TORCHELASTIC_RESTART_COUNT"]),
                   int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


STARTS_KEY = "zerofit/starts"


def restarted() -> bool:
    """Whether an earlier attempt of this torchrun job got as far as this one (rank 0 counts each
    attempt's start in the agent store, which ends with the job): the same run goes on, its records
    with it. Not TORCHELASTIC_RESTART_COUNT, which differs between nodes. False without torchrun."""
    store = agent_store()
    return store is not None and store.add(STARTS_KEY, 1) > 1


def agent_store(timeout: timedelta = STORE_TIMEOUT):
    """torchrun's agent store, or None (no torchrun, or workers that do not share its store)."""
    if current() is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as td

    return td.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                       is_master=False, timeout=timeout)


def process_group_store():
    """The store for the default process group under torchrun: the agent's, under the name of
    this attempt. None (the default env:// rendezvous) without the agent's store."""
    store = agent_store()
    if store is None:
        return None
    import torch.distributed as td

    global _attempt_prefix
    attempt = agree_on_attempt(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    _attempt_prefix = f"zerofit/attempt-{attempt}"
    return td.PrefixStore(_attempt_prefix, store)


_attempt_prefix: str | None = None  # this attempt's keys in the agent store, once its ranks agreed on them


def attempt_prefix() -> str | None:
    """This attempt's keys in the agent store (`process_group_store`), None before its ranks agreed."""
    return _attempt_prefix


def agree_on_attempt(store, rank: int, world_size: int, poll_s: float = 0.02) -> str:
    """A name for this start of the worker group, the same on every rank, new on every start.
    Rank 0 makes it up; every other rank asks under a nonce of its own and takes the answer
    to that nonce, which no earlier start can have written (a key an earlier start left, as
    the name itself would be, cannot be told from this start's). Rank 0 answers what is
    asked until every rank has acknowledged this name; answering an earlier start's leftover
    question costs one key."""
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"zerofit/ask/{rank}", nonce)
        store.wait([f"zerofit/answer/{nonce}"], STORE_TIMEOUT)
        name = store.get(f"zerofit/answer/{nonce}").decode()
        store.add(f"zerofit/acks/{name}", 1)
        return name
    name, answered = uuid.uuid4().hex, {}
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while store.add(f"zerofit/acks/{name}", 0) < world_size - 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchrun's workers did not all join within {STORE_TIMEOUT}")
        for peer in range(1, world_size):
            key = f"zerofit/ask/{peer}"
            if store.check([key]) and (nonce := store.get(key).decode()) != answered.get(peer):
                store.set(f"zerofit/answer/{nonce}", name)
                answered[peer] = nonce
        time.sleep(poll_s)
    return name


# ------------------------------------------------------------------ the failed attempt
def hand_over(directory: Path, event, safer: Config | None, changes: list[str], why_not: str = "") -> str | None:
    """After an OOM with several ranks: leave `safer` for the next attempt (memory.on_oom=retry),
    or, with `safer` None, word that it must not train (`why_not`: memory.on_oom is stop, or
    nothing safer is known): with the settings that ran out of memory a restart would run out
    again, after repeating every step since the newest checkpoint. The explanation's retry
    line, or None."""
    attempt, store = current(), agent_store(FAILING_TIMEOUT)
    if attempt is None or store is None or attempt.restarts_left <= 0:
        return None
    record = {"restart": attempt.restart, "rank": event.rank, "step": event.step,
              "phase": event.phase, "device": event.device, "changes": changes,
              "config": safer.model_dump(mode="json") if safer else None, "why_not": why_not}
    text = json.dumps(record, indent=1)
    write_atomic(directory / HANDOVER, text)
    # The newest wins: after an OOM retry that then failed for another reason, the next restart
    # keeps the safer config rather than going back to the command line's.
    store.set(HANDOVER_KEY, text)
    if safer is None:
        return None
    left = attempt.restarts_left
    return (f"torchrun restarts every rank ({left} restart{'s' if left > 1 else ''} left); they resume from "
            f"the newest checkpoint with these settings")


def take_over(store) -> dict | None:
    """The newest hand-over of this torchrun's earlier attempts, or None."""
    if store is None or not store.check([HANDOVER_KEY]):
        return None
    return json.loads(store.get(HANDOVER_KEY))


# ------------------------------------------------------------------ the next attempt
def resume_after_oom(config: Config, resume: bool | None, dist) -> tuple[Config, bool | None]:
    """In an attempt torchrun restarted after an OOM (in this attempt's predecessor or an
    earlier one): the safer config a failed rank handed over, on every rank (rank 0 reads it,
    then broadcasts: all ranks must run the same one), and resume from the newest checkpoint;
    a ConfigError on every rank when the hand-over says not to train (memory.on_oom=stop).
    Anything else: `config` and `resume` unchanged."""
    if current() is None or dist.world_size == 1:
        return config, resume
    record, problem = None, None
    if dist.is_main:
        record = take_over(agent_store())
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
           f"{record['step']} ({record['phase']})")
    if record["config"] is None:
        raise ConfigError(f"{oom}, and {record['why_not']}: torchrun restarted the ranks, but the settings that ran "
                          f"out of memory would run out again, so this attempt stops before training. Post-mortem: "
                          f"{Path(config.run_dir) / 'postmortem'}")
    faults.disarm("oom", "step", record["step"])  # an injected OOM stands for the old settings
    if dist.is_main:
        say(f"[bold]memory.on_oom=retry[/]: {oom}; torchrun restarted every rank; resuming from the newest "
            f"checkpoint with {', '.join(record['changes'])}")
    return record["config"], None


def broadcast_from_main(value):
    import torch.distributed as td

    box = [value]
    td.broadcast_object_list(box, src=0)
    return box[0]
