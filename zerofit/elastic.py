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

When a worker exits, the agent sends SIGTERM to the others and waits 30 s before SIGKILL
(torch 2.13: elastic/multiprocessing/api.py, `close(death_sig, timeout=30)`). A rank waiting in
a collective for the one that died does not run zerofit's SIGTERM handler (Python runs handlers
between bytecodes, on the main thread), so every restart waited out those 30 s.
`leave_at_once_when_a_peer_is_gone` watches on a thread of its own, every second and at every
signal: for a failure any rank counted in the store (another node's agent learns of a failure
only through the rendezvous, and signals its workers with all of them alive; one with no
restarts left does not even do that), for its own agent gone, and at a SIGTERM for a worker of
its node exited. A rank counts its own failure (`failure_announced`): on its way out of an
exception, or, killed outright, by its last word (zerofit/lastword.py), a process of its own
that outlives it. A node lost whole says nothing at all: each node's local rank 0 keeps a
heartbeat in the store, and a node silent for `elastic.lost_node_after_s` (or the store itself,
when the lost node hosted it) counts as failed (`Heartbeats`). The watcher's store reads run on
a thread of their own (`Asking`): a TCPStore client waits for an answer without limit.
"""
from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from zerofit import faults
from zerofit.checkpoint import write_atomic
from zerofit.config import Config, ConfigError
from zerofit.configfile import validate
from zerofit.progress import say

HANDOVER = "retry-handover.json"  # the copy beside the failed rank's post-mortem
HANDOVER_KEY = "zerofit/retry-handover"
FAILURES_KEY = "zerofit/failed-ranks"  # a count: it moves when a rank of this torchrun job fails
STORE_TIMEOUT = timedelta(minutes=10)  # as long as NCCL's default process-group timeout
FAILING_TIMEOUT = timedelta(seconds=10)  # a failing rank's last word must not delay its exit long
WATCH_WAIT_S = 0.5  # how long the watcher waits for a store read's answer before looking again (`Asking`)


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
    """`resume_command`: checkpointer.resume_command's, as every message names it."""
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


# ------------------------------------------------------------------ a peer gone
@contextmanager
def failure_announced(record_path: Path, rank: int):
    """Around a training process's whole run: its failure is counted in the agent store however
    it ends, for its peers' watchers (`leave_at_once_when_a_peer_is_gone`). An exception counts
    it here on its way out; a death no Python code sees (SIGKILL, a crash in native code), its
    last word does, and leaves `record_path` for the doctor (with one process too)."""
    global _last_word
    _last_word = start_last_word(record_path, rank)
    try:
        yield
    except BaseException:
        announce_failure()
        raise
    finally:
        say_done()


_last_word: subprocess.Popen | None = None  # this worker's, while failure_announced runs


class TerminatedOutsideTheLoop(BaseException):
    """SIGTERM while no training loop holds it (start-up, wind-down): no step to save. A
    BaseException, as KeyboardInterrupt is: a library's `except Exception` around the code it
    lands in (transformers' probes of installed tools) swallowed it, and training went on."""


@contextmanager
def sigterm_ends_by_way_of_python():
    """Around `train`: a SIGTERM the loop's handler (Checkpointer) does not hold raises, so the
    process ends through Python, its failure counted and its last word told (it was killed
    outright before: exit 143 with no message, and a last-word record of a death unexplained)."""
    def terminated(signum, frame):
        raise TerminatedOutsideTheLoop("stopped by SIGTERM outside the training loop (start-up or wind-down): "
                                       "no step was interrupted and the checkpoints are as they were")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def start_last_word(record_path: Path, rank: int) -> subprocess.Popen:
    """In a session of its own: torchrun ends a worker that ignores SIGTERM with SIGKILL to its
    whole process group (a hung rank, 30 s on), which killed the last word with it and left
    a run that ended nowhere said. It ends on its own when the worker's pipe closes."""
    return subprocess.Popen([sys.executable, "-m", "zerofit.lastword", str(record_path), str(rank)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def say_done() -> None:
    """This worker ends by way of Python, its failure (if any) already counted: the last word
    has nothing to add."""
    global _last_word
    from zerofit.lastword import DONE

    last_word, _last_word = _last_word, None  # the watcher thread may leave through here too
    if last_word is not None:
        try:
            last_word.stdin.write(DONE)
            last_word.stdin.close()
        except (OSError, ValueError):  # gone (killed with the process group), or closed already
            pass


def announce_failure() -> None:
    """A rank that fails (an OOM, any error) counts itself in the agent store on its way out:
    a peer on another node, signalled by its agent with its own workers alive, learns there
    that no collective can finish. Best effort, and bounded: the failure itself is what is
    reported, and a store whose host is lost never answers (a client's connect then waits in
    its ping without limit), so the count is asked on a daemon thread (`_Question`) and given
    up after FAILING_TIMEOUT."""
    def count(_no_store) -> None:
        store = agent_store(FAILING_TIMEOUT)
        if store is not None:
            count_a_failure(store)

    _Question(count, None).done.wait(FAILING_TIMEOUT.total_seconds())


@contextmanager
def leave_at_once_when_a_peer_is_gone(lost_node_after_s: float = 0.0):
    """Around the training loop, under torchrun with several ranks: once a peer is known gone,
    this process ends at once. The ranks left cannot finish a collective (or a checkpoint: a
    save needs every rank); waiting in one is waiting for torchrun's SIGKILL 30 s after its
    SIGTERM, or, where no agent of theirs learns of the failure (another node's agent with no
    restarts left stops without a word to theirs), for NCCL's timeout. A thread looks every
    POLL_S and at every signal. A peer is gone when a rank of any node has counted its failure
    in the store (`failure_announced`: an exception, or a death Python never saw), or when this
    node's agent is gone (its workers are orphans: nobody restarts or stops them). At a SIGTERM,
    and only then, it is also gone when a worker of this node has exited (the agent signals the
    others after one fails; at other times the one that exited may have finished cleanly). A
    SIGTERM with none of these (preemption) is left to the loop: it saves at the step boundary
    and stops. With several nodes, a node lost whole (`Heartbeats`, after `lost_node_after_s`;
    0: not watched) is counted as a failure here, and every rank leaves on it."""
    attempt, world_size = current(), int(os.environ.get("WORLD_SIZE", "1"))
    if attempt is None or world_size < 2 or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
        yield  # SIGTERM without a Python handler ends the process already
        return
    asking = Asking(agent_store())
    peers = Peers(attempt.agent_pid, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), asking)
    heartbeats = Heartbeats.of_this_node(asking, lost_node_after_s)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    # Python's C-level handler writes each signal's number here at once, whatever the main thread does
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    loop = _LoopState()
    watcher = threading.Thread(target=_watch, args=(read_end, peers, heartbeats, loop), name="zerofit-peer-gone",
                               daemon=True)
    if previous == -1:
        watcher.start()
    else:
        signal.set_wakeup_fd(previous)  # someone else listens there: theirs stays
    try:
        yield
    finally:
        if watcher.is_alive():
            loop.end()
            signal.set_wakeup_fd(-1)
            os.write(write_end, bytes([STOP_WATCHING]))
            watcher.join()
            if heartbeats is not None:
                heartbeats.leave()
        os.close(read_end)
        os.close(write_end)


STOP_WATCHING = 0  # no signal has number 0
# A store read a second per rank: a killed rank's last word is seen a second after it is said,
# and a thousand ranks ask torchrun's store a thousand times a second, well within what it serves.
POLL_S = 1.0


class Asking:
    """The watcher's reads of the agent store, each on a daemon thread of its own. A TCPStore
    client waits for an answer without limit (its timeout bounds connecting and waiting for
    keys: an `add` to a SIGSTOPped server was still waiting after 60 s), and the watcher must
    go on looking at its agent and its signals meanwhile; so it asks here and takes what came
    back within `wait_s`. One question at a time: while one is unanswered, the others get None.
    (Daemon threads: one stuck in a read never holds the process at its exit, as an executor's
    worker would.)"""

    def __init__(self, store, clock=time.monotonic):
        self.store, self.clock = store, clock
        self.pending: _Question | None = None
        self.answered_at = clock()  # when the store last answered a question

    def __call__(self, question, wait_s: float = 0.0):
        """question(store)'s answer, or None: none within wait_s, or it raised."""
        if self.store is None:
            return None
        if self.pending is not None and self.pending.question != question:  # bound methods: equal, not identical
            if not self.pending.done.is_set():
                return None
            self.pending = None  # another's answer, come too late for it
        if self.pending is None:
            self.pending = _Question(question, self.store)
        if not self.pending.done.wait(wait_s):
            return None
        asked, self.pending = self.pending, None
        if asked.failed:
            return None
        self.answered_at = self.clock()
        return asked.answer

    def silent_s(self) -> float:
        """How long the store has answered nothing (its host stopped: a question waits; its
        server gone: each one fails at once)."""
        return self.clock() - self.answered_at


class _Question:
    def __init__(self, question, store):
        self.question, self.answer, self.failed, self.done = question, None, False, threading.Event()
        threading.Thread(target=self._ask, args=(store,), name="zerofit-store-read", daemon=True).start()

    def _ask(self, store) -> None:
        try:
            self.answer = self.question(store)
        except Exception:  # noqa: BLE001 (torch raises DistStoreError, RuntimeError or OSError here)
            self.failed = True
        self.done.set()


class Peers:
    """What this rank can see of its peers: its agent, this node's workers (the agent's
    children) and the failures counted in the agent's store since the loop began."""

    def __init__(self, agent_pid: int, local_workers: int, asking: Asking):
        self.agent_pid, self.local_workers, self.asking = agent_pid, local_workers, asking
        self.failures_before = asking(failures, wait_s=WATCH_WAIT_S)

    def gone(self, at_sigterm: bool) -> str | None:
        """Why a peer is known to be gone, or None."""
        if os.getppid() != self.agent_pid:
            return "torchrun's agent of this node is gone"
        alive = workers_alive(self.agent_pid) if at_sigterm and self.local_workers > 1 else None
        if alive is not None and alive < self.local_workers:
            return f"SIGTERM after {self.local_workers - alive} of this node's {self.local_workers} workers exited"
        counted = self.asking(failures, wait_s=WATCH_WAIT_S)
        if self.failures_before is None:  # not read at the start: from the first count read
            self.failures_before = counted
        elif counted is not None and counted > self.failures_before:
            return ("SIGTERM after " if at_sigterm else "") + "a rank of this job failed"
        return None


def count_a_failure(store) -> int:
    return store.add(FAILURES_KEY, 1)


def failures(store) -> int:
    """The failures counted in the agent store (read through `Asking`: None when it cannot be
    read; its agent gone with it: this rank's agent then crashes, and `Peers.gone` sees that)."""
    return store.add(FAILURES_KEY, 0)


class Heartbeats:
    """Nodes lost whole. When a machine goes down or off the network, no process of its node
    says a word: no last word, no agent to tell the rendezvous, no TCP reset; the ranks of the
    other nodes wait in their next collective until NCCL's timeout (10 min). So each node's
    local rank 0 counts a key of its node up in this attempt's keys of torchrun's store every
    POLL_S, on a thread of its own from the process group's start (`keep_beating`: a node slow
    to reach the loop, in a long checkpoint load, is still heard), and its watcher reads the
    other nodes' counts during the loop. A count that has not moved for `lost_after_s` by this
    process's own clock (no clocks compared across machines) is a node lost, a count still 0
    that long after the watcher first looked too (every node beats from before the collectives
    that precede the loop); so is the store not answering that long (the node that hosts it
    lost). A node whose ranks left the loop on purpose says so (`leave`). A false
    alarm needs a node's heartbeat thread kept from the interpreter for `lost_after_s` (a native
    call holding the GIL that long): it would restart a healthy job, hence a default of
    minutes, not seconds."""

    LEFT = 1 << 40  # added to a node's count when its ranks leave the loop on purpose

    def __init__(self, asking: Asking, prefix: str, node: int, nodes: int, lost_after_s: float):
        self.asking, self.prefix, self.node, self.nodes, self.lost_after_s = asking, prefix, node, nodes, lost_after_s
        self.seen: dict[int, tuple[int, float]] = {}  # node -> (its count, when this process saw it move)

    @staticmethod
    def kept_here(lost_after_s: float) -> bool:
        """On local rank 0, with several nodes, after this attempt's keys were agreed."""
        return lost_after_s > 0 and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 \
            and os.environ.get("LOCAL_RANK") == "0" and _attempt_prefix is not None

    @classmethod
    def of_this_node(cls, asking: Asking, lost_after_s: float) -> Heartbeats | None:
        """The heartbeats this process keeps (`kept_here`, and the agent's store), else None."""
        if not cls.kept_here(lost_after_s) or asking.store is None:
            return None
        return cls(asking, _attempt_prefix, int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"]),
                   lost_after_s)

    def key(self, node: int) -> str:
        return f"{self.prefix}/alive/{node}"

    def beat_once(self, store) -> int:
        return store.add(self.key(self.node), 1)

    def counts(self, store) -> dict[int, int]:
        """The other nodes' counts."""
        return {n: store.add(self.key(n), 0) for n in range(self.nodes) if n != self.node}

    def lost(self) -> str | None:
        """Why a node is lost, or None."""
        counts = self.asking(self.counts, wait_s=WATCH_WAIT_S)
        now = self.asking.clock()
        if counts is None:
            silent = self.asking.silent_s()
            if silent >= self.lost_after_s:
                return (f"torchrun's store ({os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}) has "
                        f"not answered for {silent:.0f} s: the node that hosts it is lost")
            return None
        for node, count in counts.items():
            if count >= self.LEFT:  # left on purpose
                continue
            last = self.seen.get(node)
            if last is None or last[0] != count:
                self.seen[node] = (count, now)
            elif now - last[1] >= self.lost_after_s:
                silence = "has not beaten once in" if count == 0 else "has not been heard from for"
                return (f"node {node} (torchrun's GROUP_RANK) {silence} {now - last[1]:.0f} s: "
                        f"lost whole (its machine down or off the network)")
        return None

    def leave(self) -> None:
        self.asking(lambda store: store.add(self.key(self.node), self.LEFT), wait_s=WATCH_WAIT_S)


def keep_beating(lost_node_after_s: float) -> None:
    """This node's heartbeat (`Heartbeats`), from now (the process group is up) to the
    process's end, on a daemon thread with its own store client: beats go on through the
    model's build and a checkpoint's load, whatever the main thread waits in. Once per attempt."""
    global _beating
    if not Heartbeats.kept_here(lost_node_after_s) or _beating == _attempt_prefix:
        return
    _beating = _attempt_prefix
    threading.Thread(target=_beat, args=(_attempt_prefix, lost_node_after_s), name="zerofit-heartbeat",
                     daemon=True).start()


def _beat(attempt_prefix: str, lost_node_after_s: float) -> None:
    # the store connected here: a store host lost meanwhile holds this thread only
    heartbeats = Heartbeats.of_this_node(Asking(agent_store()), lost_node_after_s)
    while heartbeats is not None and _beating == attempt_prefix:
        heartbeats.asking(heartbeats.beat_once, wait_s=WATCH_WAIT_S)  # one question in flight at most
        time.sleep(POLL_S)


_beating: str | None = None  # the attempt whose keys this process beats in (keep_beating)


class _LoopState:
    """Whether the loop the watcher guards still runs. A SIGTERM's byte can wait in the pipe
    while the ranks stop together at a step boundary (the watcher thread starved on a loaded
    host): looked at after the loop, a peer that has exited since is no failure but a peer
    that finished, and leaving then would throw away this rank's own clean stop. The lock
    makes the watcher's verdict and the loop's end exclusive: a watcher already leaving keeps
    the main thread out for good."""

    def __init__(self):
        self.lock, self.ended = threading.Lock(), False

    def end(self) -> None:
        with self.lock:
            self.ended = True


def _watch(read_end: int, peers: Peers, heartbeats: Heartbeats | None, loop: _LoopState) -> None:
    signalled = False
    while True:
        readable, _, _ = select.select([read_end], [], [], POLL_S)
        signal_number = os.read(read_end, 1)[0] if readable else None
        if signal_number == STOP_WATCHING:
            return
        signalled = signalled or signal_number == signal.SIGTERM
        why = peers.gone(at_sigterm=signal_number == signal.SIGTERM)
        if why is None and heartbeats is not None:
            why = heartbeats.lost()
            if why:  # the lost node's ranks' failure, for this node's other ranks and the rest (a silent store: none)
                peers.asking(count_a_failure, wait_s=WATCH_WAIT_S)
        if why:
            with loop.lock:
                if loop.ended:
                    return
                say(f"rank {os.environ.get('RANK', '?')}: {why}: no collective can finish, leaving now; "
                    f"torchrun restarts or stops every rank")
                say_done()  # leaving on purpose: not a failure of this rank's
                sys.stdout.flush()
                sys.stderr.flush()
                # as killed by SIGTERM when it came; no exit handlers: they would wait on the dead peer
                os._exit(128 + signal.SIGTERM if signalled else 1)


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
