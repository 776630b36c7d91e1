"""A rank's watch on its peers under torchrun: it leaves at once when one is gone, and it says
so when it is the one that fails.

When a worker exits, the agent sends SIGTERM to the others and waits 30 s before SIGKILL
(torch 2.13: elastic/multiprocessing/api.py, `close(death_sig, timeout=30)`). A rank waiting in
a collective for the one that died does not run zerofit's SIGTERM handler (Python runs handlers
between bytecodes, on the main thread), so every restart waited out those 30 s.
`leave_at_once_when_a_peer_is_gone` watches on a thread of its own, every second and at every
signal: for a failure any rank counted in the store (another node's agent learns of a failure
only through the rendezvous, and signals its workers with all of them alive; one with no
restarts left does not even do that), for its own agent gone, and at a SIGTERM for a worker of
its node exited. A rank counts its own failure (`failure_announced`): on its way out of an
exception, or, killed outright, by its last word (zerofit/recovery/lastword.py), a process of its own
that outlives it. A node lost whole says nothing at all: each node's local rank 0 keeps a
heartbeat in the store, and a node silent for `elastic.lost_node_after_s` (or the store itself,
when the lost node hosted it) counts as failed (`Heartbeats`). The watcher's store reads run on
a thread of their own (`Asking`): a TCPStore client waits for an answer without limit.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from zerofit.core.console import say
from zerofit.recovery import elastic

FAILURES_KEY = "zerofit/failed-ranks"  # a count: it moves when a rank of this torchrun job fails
WATCH_WAIT_S = 0.5  # how long the watcher waits for a store read's answer before looking again (`Asking`)


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
    return subprocess.Popen([sys.executable, "-m", "zerofit.recovery.lastword", str(record_path), str(rank)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def say_done() -> None:
    """This worker ends by way of Python, its failure (if any) already counted: the last word
    has nothing to add."""
    global _last_word

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
    up after elastic.FAILING_TIMEOUT."""
    def count(_no_store) -> None:
        store = elastic.agent_store(elastic.FAILING_TIMEOUT)
        if store is not None:
            count_a_failure(store)

    _Question(count, None).done.wait(elastic.FAILING_TIMEOUT.total_seconds())


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
    attempt, world_size = elastic.current(), int(os.environ.get("WORLD_SIZE", "1"))
    if attempt is None or world_size < 2 or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
        yield  # SIGTERM without a Python handler ends the process already
        return
    asking = Asking(elastic.agent_store())
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
            and os.environ.get("LOCAL_RANK") == "0" and elastic.attempt_prefix() is not None

    @classmethod
    def of_this_node(cls, asking: Asking, lost_after_s: float) -> Heartbeats | None:
        """The heartbeats this process keeps (`kept_here`, and the agent's store), else None."""
        if not cls.kept_here(lost_after_s) or asking.store is None:
            return None
        return cls(asking, elastic.attempt_prefix(), int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"]),
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
    prefix = elastic.attempt_prefix()
    if not Heartbeats.kept_here(lost_node_after_s) or _beating == prefix:
        return
    _beating = prefix
    threading.Thread(target=_beat, args=(prefix, lost_node_after_s), name="zerofit-heartbeat",
                     daemon=True).start()


def _beat(attempt_prefix: str, lost_node_after_s: float) -> None:
    # the store connected here: a store host lost meanwhile holds this thread only
    heartbeats = Heartbeats.of_this_node(Asking(elastic.agent_store()), lost_node_after_s)
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


DONE = b"done"


RECORD = "ended-without-a-word.json"  # in the rank's post-mortem directory
