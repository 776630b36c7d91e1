"""A rank's watch on its peers (peerwatch.py) and a killed rank's last word (lastword.py) under torchrun."""
import json
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from conftest import (
    ROOT,
    WIDE,
    agent_store_env,
    child_env,
    kill_tree,
    node_command,
    oom_config,
    read_jsonl,
    run_two_nodes,
    run_zerofit,
)

from zerofit.recovery import elastic, peerwatch
from zerofit.train import ranks

# What rank 0's watcher says: the failure counted in the store, found by its look every second or
# at torchrun's SIGTERM, or (at the SIGTERM, the failed rank on its node) the worker exited
LEFT_AFTER_A_FAILURE = (r"rank 0: (SIGTERM after )?(a rank of this job failed|1 of this node's 2 workers exited): "
                        r"no collective can finish, leaving now")


@pytest.mark.multirank
def test_a_rank_on_another_node_leaves_at_once_after_a_handover(tmp_path):
    """Two torchrun nodes, one rank each: rank 1 runs out of memory (on_oom stop) while rank 0
    stalls in the same step. Node 0's agent learns of it through the rendezvous and signals
    rank 0 with all its workers alive; rank 0's watcher finds rank 1's failure counted in the
    store (any error counts it on the way out) and leaves at once. Both restarted ranks then
    stop before training."""
    outputs, codes = run_two_nodes(tmp_path, oom_config(tmp_path), "oom@step:5/1,stall@step:5/0")
    out = "".join(outputs)
    assert codes != [0, 0]
    assert re.search(LEFT_AFTER_A_FAILURE, out), out[-4000:]
    assert "forcefully exiting" not in out
    assert "so this attempt stops before training" in out


@pytest.mark.multirank
def test_a_rank_on_another_node_leaves_at_once_when_its_peer_is_killed_outright(tmp_path):
    """Two torchrun nodes, one rank each: rank 1 is SIGKILLed in step 5 (as the kernel's OOM
    killer ends a process: no Python runs) while rank 0 stalls in that step. Rank 1's last word
    (zerofit/recovery/lastword.py) counts its failure in the store; rank 0's watcher finds it and leaves
    at once, in both attempts (rank 1 is killed again in the restart): torchrun never SIGKILLs
    rank 0 ("forcefully exiting"), and the run ends. With the last word off it hung until the
    test's 400 s limit (checked): after the second kill, the agent with no restarts left stopped
    without a word to rank 0's."""
    outputs, codes = run_two_nodes(tmp_path, oom_config(tmp_path), "kill@step:5/1,stall@step:5/0")
    out = "".join(outputs)
    assert codes != [0, 0]
    assert re.search(LEFT_AFTER_A_FAILURE, out), out[-4000:]
    assert "forcefully exiting" not in out
    assert "Signal 9 (SIGKILL) received by PID" in out  # rank 1's end, as its agent reports it


def test_a_peer_is_gone_when_a_failure_is_counted_or_the_agent_is_gone(monkeypatch):
    """What the watcher reads: a failure counted in the agent store since it began, its agent
    (the parent) gone; a store it cannot read is no news."""
    import os

    server = agent_store_env(monkeypatch, restart=0, max_restarts=1)
    server.add(peerwatch.FAILURES_KEY, 2)  # an earlier attempt's
    peers = peerwatch.Peers(os.getppid(), 1, peerwatch.Asking(elastic.agent_store()))
    assert peers.gone(at_sigterm=False) is None and peers.gone(at_sigterm=True) is None
    server.add(peerwatch.FAILURES_KEY, 1)
    assert peers.gone(at_sigterm=False) == "a rank of this job failed"
    assert peers.gone(at_sigterm=True) == "SIGTERM after a rank of this job failed"
    assert peerwatch.Peers(os.getppid() + 1, 1, peerwatch.Asking(None)).gone(at_sigterm=False) \
        == "torchrun's agent of this node is gone"
    del server  # the store's server gone: its count unreadable, no news
    assert peers.gone(at_sigterm=False) is None


# A watcher that reads a SIGTERM while a peer has failed (a count in the agent store): before the loop
# ended it leaves (exit 143); after, it stays (the byte waited in the pipe while the ranks stopped together).
WATCHER_VERDICT = """
import os, signal, sys, threading, torch.distributed as td
from zerofit.recovery import elastic, peerwatch
from zerofit.train import engine, ranks
port = ranks.free_port()
server = td.TCPStore("127.0.0.1", port, 1, is_master=True)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True",
                  TORCHELASTIC_RESTART_COUNT="0")
peers = peerwatch.Peers(os.getppid(), 1, peerwatch.Asking(elastic.agent_store()))
server.add(peerwatch.FAILURES_KEY, 1)
loop = peerwatch._LoopState()
if sys.argv[1] == "ended":
    loop.end()
read_end, write_end = os.pipe()
os.write(write_end, bytes([signal.SIGTERM]))
watcher = threading.Thread(target=peerwatch._watch, args=(read_end, peers, None, loop), daemon=True)
watcher.start()
watcher.join(timeout=30)
print("stayed" if not watcher.is_alive() else "still watching")
"""


@pytest.mark.e2e
@pytest.mark.parametrize("loop", ["running", "ended"])
def test_a_watcher_leaves_only_while_the_loop_runs(loop):
    done = subprocess.run([sys.executable, "-c", WATCHER_VERDICT, loop], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    if loop == "running":
        assert done.returncode == 143 and "SIGTERM after a rank of this job failed" in done.stderr, done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip() == "stayed" and "leaving now" not in done.stderr, \
            done.stderr


def test_a_node_is_lost_when_its_heartbeat_stops_or_the_store_stops_answering(monkeypatch):
    """Three nodes' heartbeats in a real TCP store, read by node 0 on a clock the test moves: a
    node is lost when its count stands still for lost_after_s, or has not moved once in that
    long since node 0 first looked, never when it left on purpose; a store that has answered
    nothing that long is the lost node that hosted it (here its server gone; a stopped one
    never answers)."""
    server = agent_store_env(monkeypatch, restart=0, max_restarts=0)
    now = [100.0]
    store = elastic.agent_store()
    beats = [peerwatch.Heartbeats(peerwatch.Asking(store, clock=lambda: now[0]), "zerofit/attempt-a", node, 3,
                                lost_after_s=30) for node in range(3)]

    def beat(*nodes):
        for node in nodes:
            assert beats[node].asking(beats[node].beat_once, wait_s=5) is not None

    assert beats[0].lost() is None  # nodes 1 and 2 have not beaten yet: their silence starts now
    now[0] += 29
    beat(1)  # node 1 starts; node 2 is still silent
    assert beats[0].lost() is None
    now[0] += 1
    assert beats[0].lost() == ("node 2 (torchrun's GROUP_RANK) has not beaten once in 30 s: lost whole "
                               "(its machine down or off the network)")
    now[0] += 70
    beat(1, 2)
    assert beats[0].lost() is None  # seen moving at 200
    now[0] += 29
    beat(1)  # node 1 keeps beating; node 2 falls silent
    assert beats[0].lost() is None
    now[0] += 1
    assert beats[0].lost() == ("node 2 (torchrun's GROUP_RANK) has not been heard from for 30 s: lost whole "
                               "(its machine down or off the network)")
    beats[2].leave()  # its ranks left the loop on purpose: silence is not loss
    assert beats[0].lost() is None
    assert beats[0].key(1) != peerwatch.Heartbeats(beats[0].asking, "zerofit/attempt-b", 0, 3, 30).key(1)

    del server  # the store's host gone: its first silent seconds are not yet a loss
    assert beats[0].lost() is None
    now[0] += 30
    assert "has not answered for 30 s: the node that hosts it is lost" in beats[0].lost()


@pytest.mark.e2e
def test_the_watcher_asks_a_store_that_never_answers_without_waiting_on_it(monkeypatch):
    """A TCPStore client waits for an answer without limit (an add to a SIGSTOPped server);
    Asking leaves the question in flight, answers None meanwhile, and counts the silence. A
    failing rank's count gives up after FAILING_TIMEOUT (its connect waits there too)."""
    import signal as signals

    import psutil
    import torch.distributed as td

    port = ranks.free_port()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as td; "
                               f"s = td.TCPStore('127.0.0.1', {port}, 1, is_master=True); time.sleep(300)"])
    try:
        store = td.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=60))
        asking = peerwatch.Asking(store)
        assert asking(peerwatch.failures, wait_s=5) == 0
        server.send_signal(signals.SIGSTOP)
        stopped_by = time.monotonic() + 10  # a signal is delivered when its process is next scheduled
        while psutil.Process(server.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < stopped_by:
            time.sleep(0.01)
        started = time.monotonic()
        assert asking(peerwatch.failures, wait_s=0.5) is None and asking(lambda s: s.add("x", 0)) is None
        assert time.monotonic() - started < 10 and asking.silent_s() >= 0.5  # not the 60 s its connect allows
        stuck = [t for t in threading.enumerate() if t.name == "zerofit-store-read"]
        assert stuck and all(t.daemon for t in stuck)  # still waiting there, never holding the exit
        started = time.monotonic()
        peerwatch.announce_failure()
        assert time.monotonic() - started < elastic.FAILING_TIMEOUT.total_seconds() + 10
    finally:
        server.kill()


def test_heartbeats_are_kept_by_each_nodes_local_rank_0_of_several(monkeypatch):
    server = agent_store_env(monkeypatch, restart=0, max_restarts=0)  # noqa: F841 (kept alive: the store)
    monkeypatch.setattr(elastic, "_attempt_prefix", "zerofit/attempt-x")
    for name, value in {"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    asking = peerwatch.Asking(elastic.agent_store())
    beats = peerwatch.Heartbeats.of_this_node(asking, 60)
    assert beats is not None and beats.node == 1 and beats.nodes == 2 and beats.lost_after_s == 60
    assert peerwatch.Heartbeats.of_this_node(asking, 0) is None  # off
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert peerwatch.Heartbeats.of_this_node(asking, 60) is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert peerwatch.Heartbeats.of_this_node(asking, 60) is None
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")

    # from the process group's start, on a thread of its own, once per attempt
    def beaters():
        return [t for t in threading.enumerate() if t.name == "zerofit-heartbeat"]

    monkeypatch.setattr(peerwatch, "_beating", None)
    peerwatch.keep_beating(0)
    assert not beaters()
    peerwatch.keep_beating(60)
    peerwatch.keep_beating(60)
    assert len(beaters()) == 1
    count = (lambda: asking(lambda store: store.add(beats.key(1), 0), wait_s=5))
    first = count()
    time.sleep(2.5 * peerwatch.POLL_S)
    assert count() >= first + 2
    monkeypatch.setattr(peerwatch, "_beating", "zerofit/attempt-y")  # another attempt's keys: this one stops
    time.sleep(2 * peerwatch.POLL_S)
    assert not beaters()


@pytest.mark.e2e
@pytest.mark.parametrize("frozen, said", [
    ("other", r"node \d \(torchrun's GROUP_RANK\) has not been heard from for \d+ s: lost whole \(its machine down "
              r"or off the network\)"),
    ("store_host", r"torchrun's store \(\S+:\d+\) has not answered for \d+ s: the node that hosts it is lost"),
])
def test_ranks_leave_when_a_whole_node_is_lost(tmp_path, frozen, said):
    """Two torchrun nodes of one rank each; in step 5 one node is frozen whole (SIGSTOP to its
    agent, worker and last word: a machine gone off the network sends no reset and says no
    word), either the one that does not host the workers' store or the one that does (GROUP_RANK
    0's agent: torch's RendezvousStoreInfo, not the rendezvous endpoint's). The other
    rank waits at step 5 (stall@step:5, as in a collective it would until NCCL's timeout) until
    its heartbeat watch finds the node silent, or the store, for elastic.lost_node_after_s
    (here 8 s), and leaves. Without the heartbeats it waited for good until the test's limit
    (checked); with store reads waited on in the watcher, the store's host frozen stopped the
    watcher too (an add to a SIGSTOPped TCPStore server never returns)."""
    import signal as signals

    import psutil

    config = oom_config(tmp_path, elastic={"lost_node_after_s": 8})
    port = ranks.free_port()
    env = child_env({"ZEROFIT_FAULT": "stall@step:5", **WIDE})
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [subprocess.Popen(node_command(port, "lost", config), cwd=ROOT, env=env, stdout=log.open("w"),
                              stderr=subprocess.STDOUT)
             for log in logs]
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and '"step": 4' in metrics.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metrics.exists() and '"step": 4' in metrics.read_text(), logs[0].read_text()[-3000:]
        time.sleep(2)  # both ranks on to step 5's start, where they stall

        def hosts_the_store(node) -> bool:  # the workers' store: GROUP_RANK 0's agent hosts it
            worker = psutil.Process(node.pid).children()[0]
            return worker.environ()["GROUP_RANK"] == "0"

        lost = next(node for node in nodes if hosts_the_store(node) == (frozen == "store_host"))
        survivor_log = logs[1 - nodes.index(lost)]
        for process in reversed([psutil.Process(lost.pid), *psutil.Process(lost.pid).children(recursive=True)]):
            process.send_signal(signals.SIGSTOP)  # the last word first: it must not see its worker go
        frozen_at = time.monotonic()
        while "leaving now" not in survivor_log.read_text() and time.monotonic() < frozen_at + 90:
            time.sleep(0.2)
        left_after = time.monotonic() - frozen_at
    finally:
        for node in nodes:
            kill_tree(node.pid)
    out = survivor_log.read_text()
    assert re.search(rf"rank \d: {said}: no collective can finish, leaving now", out), out[-3000:]
    assert 7 <= left_after < 30, left_after


LAST_WORD_SCRIPT = """
import os, signal, sys
from pathlib import Path
from zerofit.recovery import peerwatch
with peerwatch.failure_announced(Path(sys.argv[2]), 1):
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "error":
        raise RuntimeError("a failure Python sees")
"""


@pytest.mark.e2e
@pytest.mark.parametrize("end, counted", [("kill", 1), ("error", 1), ("normal", 0)])
def test_a_worker_counts_its_failure_however_it_ends_and_only_then(end, counted, monkeypatch, tmp_path):
    """A worker SIGKILLed inside failure_announced counts one failure in the agent store and
    leaves a record for the doctor (by its last word), one that raises counts one (by itself:
    the last word adds nothing), and one that ends well counts none."""
    import time

    server = agent_store_env(monkeypatch, restart=0, max_restarts=1)
    monkeypatch.setenv("RANK", "1")
    record = tmp_path / "postmortem" / "rank1" / "ended-without-a-word.json"
    started = time.time()
    done = subprocess.run([sys.executable, "-c", LAST_WORD_SCRIPT, end, str(record)], cwd=ROOT, env=child_env({}),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == {"kill": -9, "error": 1, "normal": 0}[end], done.stderr[-2000:]
    deadline = time.monotonic() + 30  # the last word imports torch before it speaks
    while (peerwatch.failures(server) < counted or (end == "kill" and not record.exists())) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2)  # a second count would come about as late
    assert peerwatch.failures(server) == counted
    assert record.exists() == (end == "kill")
    if end == "kill":
        said = json.loads(record.read_text())
        assert said["rank"] == 1 and started < said["time"] < time.time()


@pytest.mark.multirank
def test_a_rank_waiting_on_a_dead_peer_leaves_at_once_when_torchrun_signals(tmp_path):
    """Rank 1 runs out of memory in step 5 and exits; rank 0 stalls in that step, as a rank
    waiting in a collective for it does. torchrun's SIGTERM reaches rank 0's watcher thread,
    which sees the node's other worker gone and ends rank 0 at once: torchrun does not wait its
    30 s to SIGKILL it (it logs "forcefully exiting" when it does: checked with the watcher off)."""
    config = oom_config(tmp_path)
    done = run_zerofit(["train", "--config", str(config)], nproc=2, check=False,
                       env={"ZEROFIT_FAULT": "oom@step:5/1,stall@step:5/0", **WIDE},
                       torchrun_args=("--max-restarts", "1"))
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert re.search(LEFT_AFTER_A_FAILURE, out), out[-4000:]
    assert "forcefully exiting" not in out
    assert "so this attempt stops before training" in out  # the restart read rank 1's hand-over
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.multirank
def test_ranks_leave_at_once_when_their_torchrun_agent_is_gone(tmp_path):
    """torchrun's agent SIGKILLed while both its ranks stall in step 3, as ranks waiting in a
    collective would: orphans that no agent will restart or stop. Their watchers see their
    parent gone and end them at once (without that they stall until killed)."""
    import time

    import psutil
    from conftest import zerofit_command

    process = subprocess.Popen(zerofit_command(["train", "--config", str(oom_config(tmp_path))], nproc=2), cwd=ROOT,
                               env=child_env({"ZEROFIT_FAULT": "stall@step:3", **WIDE}), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while (not metrics.exists() or len(read_jsonl(metrics)) < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = psutil.Process(process.pid).children()
    try:
        assert len(workers) == 2 and len(read_jsonl(metrics)) == 2
        time.sleep(1)  # into step 3's stall
        process.kill()  # the agent; its workers live in sessions of their own
        out, _ = process.communicate(timeout=60)  # the pipe ends when the last worker does
        assert out.count("torchrun's agent of this node is gone: no collective can finish, leaving now") == 2, \
            out[-3000:]
        _, alive = psutil.wait_procs(workers, timeout=10)  # the pipe closes a moment before the exit ends
        assert not [w for w in alive if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    finally:
        for worker in workers:
            kill_tree(worker.pid)


def test_sigterm_outside_the_loop_is_not_swallowed_by_a_librarys_except_exception():
    """A library's `except Exception` around the code the signal lands in (transformers wraps
    its probes of installed tools so) swallowed it, and training went on until SIGKILL."""
    import os
    import signal

    with pytest.raises(peerwatch.TerminatedOutsideTheLoop):
        with peerwatch.sigterm_ends_by_way_of_python():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            except Exception:  # noqa: BLE001 (the library's)
                pytest.fail("swallowed")
