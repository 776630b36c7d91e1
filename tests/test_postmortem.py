"""The OOM post-mortem on an injected OOM (ZEROFIT_FAULT=oom@step:K, a torch.OutOfMemoryError
with PyTorch's CUDA message, raised in the forward pass) in a real tiny run."""
import dataclasses
import json
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from conftest import ROOT, child_env, read_jsonl, run_zerofit, tiny_config, write_config

from zerofit import elastic, peerwatch, ranks
from zerofit.configfile import load, validate
from zerofit.doctor import diagnose
from zerofit.findings import RunFacts
from zerofit.oomreport import retry_line
from zerofit.postmortem import OomEvent, parse_requested_bytes, would_fit

WIDE = {"COLUMNS": "400"}  # rich wraps at 80 columns off a terminal; these tests read whole lines
OOM_AT_5 = {"ZEROFIT_FAULT": "oom@step:5", **WIDE}


def oom_config(base, **sections):
    return write_config(base / "c.yaml", tiny_config(base / "run", train={"max_steps": 8},
                                                     checkpoint={"every_steps": 3}, **sections))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("oom")
    config = oom_config(base)
    done = run_zerofit(["train", "--config", str(config)], env=OOM_AT_5, check=False)
    return base / "run", config, done


def test_oom_exits_1_with_one_screen_explanation(stopped_run):
    run, _, done = stopped_run
    assert done.returncode == 1, done.stderr[-3000:]
    explanation = done.stderr[done.stderr.index("zerofit: error:"):].strip().splitlines()
    assert explanation[0] == ("zerofit: error: GPU out of memory in the forward pass of step 5, "
                              "tried to allocate 2.00 GiB")
    assert len(explanation) <= 20
    text = "\n".join(explanation)
    assert f"emergency checkpoint: {run / 'checkpoints' / 'step-000004'}" in text
    assert "would fit: train.micro_batch_size=2 train.grad_accum_steps=2" in text
    assert f"zerofit train --config {run / 'postmortem' / 'retry-config.yaml'}" in text
    assert "Traceback" not in done.stderr


def test_postmortem_report(stopped_run):
    run, _, _ = stopped_run
    report = (run / "postmortem" / "report.md").read_text()
    assert report.startswith("# Out of memory: GPU out of memory in the forward pass of step 5")
    for part in ("## Memory when it failed", "| requested | 2,147,483,648 | 2.00 |", "## Plan vs measured",
                 "| host | ", "## Findings", "halve train.micro_batch_size (4 -> 2)", "## What would fit",
                 "`train.micro_batch_size=2`", "## Emergency checkpoint", "written after the OOM",
                 "no allocator snapshot: the run was on CPU", "| 5 | oom |"):
        assert part in report, part
    data = json.loads((run / "postmortem" / "report.json").read_text())
    assert data["event"]["phase"] == "forward" and data["event"]["requested_bytes"] == 2 * 2**30
    retry = load(run / "postmortem" / "retry-config.yaml")
    assert (retry.train.micro_batch_size, retry.train.grad_accum_steps) == (2, 2)
    oom = [r for r in read_jsonl(run / "memory.jsonl") if r["phase"] == "oom"]
    assert len(oom) == 1 and oom[0]["step"] == 5 and oom[0]["failed_phase"] == "forward"


def test_emergency_checkpoint_is_published_and_loadable(stopped_run, tmp_path):
    run, config, _ = stopped_run
    emergency = run / "checkpoints" / "step-000004"
    assert (emergency / "MANIFEST.json").is_file()
    assert (run / "checkpoints" / "latest").read_text() == "step-000004"
    assert json.loads((emergency / "loop_state.json").read_text())["extra"]["emergency"] == "oom in forward of step 5"
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    done = run_zerofit(["train", "--config", str(config), "--resume"], env=WIDE)
    assert f"resumed from {emergency} at step 4" in done.stderr
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 9))
    assert "emergency" not in json.loads((run / "checkpoints" / "step-000008" / "loop_state.json").read_text())["extra"]


def test_on_oom_retry_finishes_with_safer_settings(tmp_path):
    config = oom_config(tmp_path)
    done = run_zerofit(["train", "--config", str(config), "--on-oom", "retry"], env=OOM_AT_5)
    err = " ".join(done.stderr.split())
    assert "GPU out of memory in the forward pass of step 5, tried to allocate 2.00 GiB (post-mortem: " in err
    assert ("memory.on_oom=retry: restarting from the newest checkpoint (step-000004) with train.micro_batch_size=2, "
            "train.grad_accum_steps=2 (1 more retry allowed)") in err
    assert "still referenced" not in err  # the failed attempt's engine and its memory were let go
    assert "done: step 8" in err
    run = tmp_path / "run"
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 9))
    state = json.loads((run / "checkpoints" / "step-000008" / "loop_state.json").read_text())
    assert state["micro_batch_size"] == 2
    assert state["micro_batches"] == 4 * 2 + 4 * 2  # 4 steps of 1 x 4, then 4 steps of 2 x 2, in 2-sequence units
    phases = [(r["step"], r["phase"]) for r in read_jsonl(run / "memory.jsonl")]
    assert (5, "oom") in phases and phases.count((4, "start")) == 1
    assert (run / "postmortem" / "report.md").is_file()
    # the doctor advises from the settings that ran out of memory, and says what the retry changed
    oom = next(f for f in diagnose(run).findings if f.kind == "oom")
    assert oom.severity == "warning" and oom.title.endswith(
        "the run resumed afterwards with train.micro_batch_size 4 -> 2, train.grad_accum_steps 1 -> 2")
    assert oom.fix[0].startswith("halve train.micro_batch_size (4 -> 2)")
    # and its post-mortem no longer asks for the retry that has run
    from zerofit.oomreport import explanation

    said = explanation(diagnose(run).postmortem)
    assert "retry: the run started again after this OOM" in said and "retry-config.yaml" not in said


def test_an_oom_retry_before_any_checkpoint_keeps_the_runs_records_in_place(tmp_path):
    """An OOM in step 1 leaves no checkpoint: the retry starts from step 0 in the same run
    directory. A new run there sets an earlier run's records aside (checkpoints/earlier-TIME/);
    the retry is the same run, so its OOM record and post-mortem stay where the doctor reads them."""
    config = oom_config(tmp_path)
    done = run_zerofit(["train", "--config", str(config), "--on-oom", "retry"],
                       env={"ZEROFIT_FAULT": "oom@step:1", **WIDE})
    err = " ".join(done.stderr.split())
    assert "restarting from step 0 (no checkpoint was saved)" in err and "done: step 8" in err
    run = tmp_path / "run"
    assert not list((run / "checkpoints").glob("earlier-*")) and "are kept in" not in err
    phases = [(r["step"], r["phase"]) for r in read_jsonl(run / "memory.jsonl")]
    assert (1, "oom") in phases and phases.count((0, "start")) == 2
    assert (run / "postmortem" / "report.md").is_file()
    oom = next(f for f in diagnose(run).findings if f.kind == "oom")
    assert "the run resumed afterwards with train.micro_batch_size 4 -> 2" in oom.title


def test_on_oom_retry_with_two_ranks_rides_torchrun_restarts(tmp_path):
    """Rank 1 of 2 runs out of memory in step 5 (checkpoints every 3 steps): no rank can retry
    alone, so it hands its safer settings over and exits; torchrun (--max-restarts 1) restarts
    both ranks, which take the hand-over from rank 0, resume from step 3 with it and finish."""
    config = oom_config(tmp_path)
    done = run_zerofit(["train", "--config", str(config), "--on-oom", "retry"], nproc=2,
                       env={**OOM_AT_5, "ZEROFIT_FAULT_RANKS": "1"}, torchrun_args=("--max-restarts", "1"))
    out = done.stdout + done.stderr
    assert "retry: torchrun restarts every rank (1 restart left)" in out
    assert ("memory.on_oom=retry: rank 1 ran out of GPU memory in step 5 (forward); torchrun restarted every rank; "
            "resuming from the newest checkpoint with train.micro_batch_size=2, train.grad_accum_steps=2") in out
    run = tmp_path / "run"
    assert f"resumed from {run / 'checkpoints' / 'step-000003'} at step 3" in out and "done: step 8" in out
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 9))
    assert json.loads((run / "checkpoints" / "step-000008" / "loop_state.json").read_text())["micro_batch_size"] == 2
    assert json.loads((run / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"] == 2
    handover = json.loads((run / "postmortem" / "rank1" / elastic.HANDOVER).read_text())
    assert (handover["rank"], handover["restart"], handover["step"]) == (1, 0, 5)
    assert not (run / "postmortem" / elastic.HANDOVER).exists()  # rank 0 did not run out of memory
    assert f"details: {run / 'postmortem' / 'rank1' / 'report.md'}" in out
    doctor = run_zerofit(["doctor", str(run)], env=WIDE).stdout  # rank 1's post-mortem, not none
    assert "out-of-memory post-mortem" in doctor and "GPU out of memory in the forward pass of step 5" in doctor


def test_a_torchrun_restart_before_any_checkpoint_keeps_the_runs_records_in_place(tmp_path):
    """Rank 1 of 2 runs out of memory in step 2, before the first save: torchrun's restart starts
    the ranks from step 0 in the same run directory. That is the same run (rank 0 counts the
    job's attempts in torchrun's store), not a new one: its records, rank 1's OOM among them,
    are not set aside."""
    config = oom_config(tmp_path)
    done = run_zerofit(["train", "--config", str(config), "--on-oom", "retry"], nproc=2,
                       env={"ZEROFIT_FAULT": "oom@step:2", "ZEROFIT_FAULT_RANKS": "1", **WIDE},
                       torchrun_args=("--max-restarts", "1"))
    out = " ".join((done.stdout + done.stderr).split())
    assert "torchrun restarted every rank" in out and "new run in" in out and "done: step 8" in out
    run = tmp_path / "run"
    assert not list((run / "checkpoints").glob("earlier-*")) and "are kept in" not in out
    assert (2, "oom") in [(r["step"], r["phase"]) for r in read_jsonl(run / "memory-rank1.jsonl")]
    assert (run / "postmortem" / "rank1" / "report.md").is_file()


# What rank 0's watcher says: the failure counted in the store, found by its look every second or
# at torchrun's SIGTERM, or (at the SIGTERM, the failed rank on its node) the worker exited
LEFT_AFTER_A_FAILURE = (r"rank 0: (SIGTERM after )?(a rank of this job failed|1 of this node's 2 workers exited): "
                        r"no collective can finish, leaving now")


def node_command(port: int, rdzv_id: str, config, *args: str, max_restarts: int = 0) -> list[str]:
    """One of two torchrun agents of one rank each (rendezvous c10d at 127.0.0.1:port): a node
    of two on one machine, running `zerofit train --config CONFIG ARGS`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            "--max-restarts", str(max_restarts), "-m", "zerofit", "train", "--config", str(config), *args]


def run_two_nodes(tmp_path, config, fault: str, *args: str) -> tuple[list[str], list[int]]:
    """`zerofit train` under two torchrun agents of one rank each (rendezvous c10d, --max-restarts 1):
    two nodes on one machine. Their outputs and exit codes."""
    port = ranks.free_port()
    env = child_env({"ZEROFIT_FAULT": fault, **WIDE})
    nodes = [subprocess.Popen(node_command(port, "two-nodes", config, *args, max_restarts=1),
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=400)[0] for node in nodes]
    finally:  # a hung run's workers live in sessions of their own (torchrun starts them so)
        for node in nodes:
            kill_tree(node.pid)
    return outputs, [node.returncode for node in nodes]


def kill_tree(pid: int) -> None:
    import psutil

    try:
        processes = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.Error:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass


def test_on_oom_retry_across_two_torchrun_nodes(tmp_path):
    """Two torchrun agents, one rank each, rendezvous c10d (two nodes on one machine): rank 1's
    OOM restarts both. The first node's agent restarts its worker for the other node's
    re-rendezvous without counting a restart (its TORCHELASTIC_RESTART_COUNT stays 0, the
    other's is 1), so the ranks agree on the attempt's keys through the store, and rank 0 finds
    the hand-over there, not in a file of another node's agent."""
    outputs, codes = run_two_nodes(tmp_path, oom_config(tmp_path), "oom@step:5/1", "--on-oom", "retry")
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    out = "".join(outputs)
    assert "memory.on_oom=retry: rank 1 ran out of GPU memory in step 5 (forward); torchrun restarted every rank" in out
    run = tmp_path / "run"
    assert f"resumed from {run / 'checkpoints' / 'step-000003'} at step 3" in out and "done: step 8" in out
    assert json.loads((run / "checkpoints" / "step-000008" / "loop_state.json").read_text())["micro_batch_size"] == 2


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


def test_a_rank_on_another_node_leaves_at_once_when_its_peer_is_killed_outright(tmp_path):
    """Two torchrun nodes, one rank each: rank 1 is SIGKILLed in step 5 (as the kernel's OOM
    killer ends a process: no Python runs) while rank 0 stalls in that step. Rank 1's last word
    (zerofit/lastword.py) counts its failure in the store; rank 0's watcher finds it and leaves
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
from zerofit import elastic, engine, peerwatch, ranks
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
from zerofit import peerwatch
with peerwatch.failure_announced(Path(sys.argv[2]), 1):
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "error":
        raise RuntimeError("a failure Python sees")
"""


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


def test_two_ranks_with_on_oom_stop_do_not_train_again_after_torchrun_restarts(tmp_path):
    """memory.on_oom=stop under torchrun --max-restarts 1: the restart would repeat steps 4-5 and
    run out of memory again with the same settings; the restarted ranks stop before training."""
    config = oom_config(tmp_path)
    done = run_zerofit(["train", "--config", str(config)], nproc=2, check=False,
                       env={**OOM_AT_5, "ZEROFIT_FAULT_RANKS": "1"}, torchrun_args=("--max-restarts", "1"))
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert ("zerofit: error: rank 1 ran out of GPU memory in step 5 (forward), and memory.on_oom is "
            "stop (--on-oom retry") in out
    assert "so this attempt stops before training" in out and "resumed from" not in out
    run = tmp_path / "run"
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert json.loads((run / "postmortem" / "rank1" / elastic.HANDOVER).read_text())["config"] is None


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
        assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    finally:
        for worker in workers:
            kill_tree(worker.pid)


def agent_store_env(monkeypatch, restart: int, max_restarts: int):
    """What torchrun gives a worker, with a TCP store of this test's as the agent's."""
    import torch.distributed as td

    port = ranks.free_port()
    server = td.TCPStore("127.0.0.1", port, 1, is_master=True)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(restart),
                        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}.items():
        monkeypatch.setenv(name, value)
    return server


def test_handover_needs_a_restart_left_and_stays_with_its_torchrun(tmp_path, monkeypatch):
    """A hand-over is left only while torchrun has a restart left; it goes into the agent's
    store (every node's rank 0 reads it there) with a copy beside the post-mortem; the newest
    is taken (a restart after another failure keeps the safer config); another torchrun, with
    a store of its own, never takes it."""
    safer_config = validate(tiny_config(tmp_path / "run"))
    event = OomEvent(step=5, phase="forward", device="gpu", message="", requested_bytes=None, rank=1, world_size=2)
    directory = tmp_path / "run" / "postmortem" / "rank1"
    directory.mkdir(parents=True)
    server = agent_store_env(monkeypatch, restart=0, max_restarts=0)
    assert elastic.hand_over(directory, event, safer_config, ["x=1"]) is None
    assert not (directory / elastic.HANDOVER).exists() and elastic.take_over(elastic.agent_store()) is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert "2 restarts left" in elastic.hand_over(directory, event, safer_config, ["x=1"])
    assert json.loads((directory / elastic.HANDOVER).read_text())["changes"] == ["x=1"]
    assert elastic.take_over(elastic.agent_store())["changes"] == ["x=1"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # attempt 1 ran out of memory too, on rank 0
    elastic.hand_over(tmp_path / "run" / "postmortem", dataclasses.replace(event, rank=0), safer_config, ["y=2"])
    assert elastic.take_over(elastic.agent_store())["changes"] == ["y=2"]
    other_torchrun = agent_store_env(monkeypatch, restart=1, max_restarts=2)
    assert elastic.take_over(elastic.agent_store()) is None
    report = {"event": {"world_size": 2}, "retry_config": "r.yaml"}
    assert "under torchrun --max-restarts 1 or more" in retry_line(report)
    assert "retry: torchrun --nproc_per_node 2 -m zerofit train --config r.yaml" in retry_line(report)
    del server, other_torchrun


def test_ranks_agree_on_a_new_attempt_name_whatever_an_earlier_attempt_left(monkeypatch):
    """Three ranks (threads) start while the store holds an earlier attempt's questions and
    answers: each start's ranks agree on one name, and a new start gets a new one."""
    import threading

    server = agent_store_env(monkeypatch, restart=0, max_restarts=1)

    def start() -> list[str]:
        names = [None] * 3

        def rank(r):
            names[r] = elastic.agree_on_attempt(elastic.agent_store(), r, 3)

        threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]  # rank 0 last: old answers wait
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return names

    first, second = start(), start()
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]
    del server


def test_would_fit_starts_from_the_planned_config(tmp_path):
    """The planner chose the micro batch (train.global_batch_size set, micro batch unset):
    the post-mortem halves the micro batch that ran, not the config file's default of 1,
    and its retry config keeps the rest of what the planner chose."""
    train = {"seq_len": 64, "global_batch_size": 8, "max_steps": 4, "lr": 3e-3, "warmup_steps": 2, "seed": 7}
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train=train,
                                                             checkpoint={"every_steps": 3}))
    done = run_zerofit(["train", "--config", str(config)], env={"ZEROFIT_FAULT": "oom@step:2", **WIDE}, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    chosen = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    micro = chosen["train_micro_batch_size_per_gpu"]
    assert micro > 1  # else this test cannot tell the planned config from the file's
    assert f"would fit: train.micro_batch_size={micro // 2} train.grad_accum_steps={2 * 8 // micro}" in done.stderr
    retry = load(tmp_path / "run" / "postmortem" / "retry-config.yaml")
    assert (retry.train.micro_batch_size, retry.train.grad_accum_steps) == (micro // 2, 2 * 8 // micro)
    offload_param = chosen["zero_optimization"].get("offload_param", {}).get("device", "none")
    assert retry.zero.offload_param == offload_param


RELEASE_SCRIPT = """
import gc, sys, weakref
sys.path.insert(0, "tests")
from conftest import tiny_config
from zerofit import dsconfig, engine, ranks
from zerofit.configfile import validate

config = validate(tiny_config("{run}"))
dist = ranks.init_distributed()
ds_config = dsconfig.build(config, 1, dist.on_gpu)

def collected(release):
    built = engine.build_engine(engine.build_model(config, ds_config), config, ds_config, total_steps=4)
    ref = weakref.ref(built)
    if release:
        engine.release(built)
    del built
    gc.collect()
    return ref() is None

print("dropped:", collected(False), "released:", collected(True))
"""


def test_engine_release_lets_the_engine_go(tmp_path):
    """A ZeRO-3 engine dropped by its last reference stays alive (DeepSpeed keeps its model on
    a module-level stack); engine.release frees it, and with it the memory it holds."""
    import subprocess
    import sys

    from conftest import ROOT

    done = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT.format(run=tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert "dropped: False released: True" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_requested_bytes_are_parsed():
    assert parse_requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has") == 2 * 2**30
    assert parse_requested_bytes("Tried to allocate 512.00 MiB (GPU 0; 23.69 GiB total)") == 512 * 2**20
    assert parse_requested_bytes("DefaultCPUAllocator: not enough memory: you tried to allocate 1073741824 "
                                 "bytes.") == 2**30
    assert parse_requested_bytes("Unable to allocate 3.5 GiB for an array with shape") == int(3.5 * 2**30)
    assert parse_requested_bytes("out of memory") is None


def safer(phase, device="gpu", **sections):
    config = load(None, [f"{k}={v}" for k, v in sections.items()])
    return would_fit(config, OomEvent(5, phase, device, "", None), RunFacts())


def test_would_fit_steps_along_the_phase():
    assert safer("forward", **{"train.micro_batch_size": 8})[1] == ["train.micro_batch_size=4",
                                                                    "train.grad_accum_steps=2"]
    assert safer("backward", **{"train.micro_batch_size": 1, "model.gradient_checkpointing": False})[1] == \
        ["model.gradient_checkpointing=True"]
    assert safer("backward", **{"train.micro_batch_size": 1, "model.gradient_checkpointing": True})[1] == \
        ["zero.offload_param=cpu"]
    assert safer("optimizer_step", **{"zero.sub_group_size": 1_000_000_000})[1] == ["zero.sub_group_size=100000000"]
    assert safer("optimizer_step", **{"zero.offload_optimizer": "none"})[1] == ["zero.offload_optimizer=cpu"]
    assert safer("save", **{"zero.gather_16bit_weights_on_save": True})[1] == ["zero.gather_16bit_weights_on_save=False"]
    assert safer("forward", device="host")[1] == ["zero.pin_memory=False"]
    config, changes = safer("save")
    assert config is None and changes == []


def test_fragmentation_oom_turns_expandable_segments_on(monkeypatch):
    """The H200's headline without expandable segments (bench/results/oom_retry-*.json): 1.86 GiB
    asked with 1.87 GiB allocated, 3.72 reserved, under a 5.03 GiB budget. The memory was there
    in pieces: expandable segments alone, not a smaller micro batch (three attempts at 4, 2 and 1
    all failed on the same request)."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    config = load(None, ["train.micro_batch_size=4", "memory.expandable_segments=false"])
    held = {"gpu_alloc": int(1.87 * 2**30), "gpu_reserved": int(3.72 * 2**30)}
    event = OomEvent(1, "backward", "gpu", "", int(1.86 * 2**30), gpu=held)
    budget = RunFacts(gpu_budget=int(5.03 * 2**30))
    assert would_fit(config, event, budget)[1] == ["memory.expandable_segments=True"]
    # the request larger than the budget beside what is held: no fragmentation, the micro batch halves
    assert would_fit(config, event, RunFacts(gpu_budget=int(3.5 * 2**30)))[1][0] == "train.micro_batch_size=2"
    # nothing cached beyond what is allocated: the memory was not there either
    bare = OomEvent(1, "backward", "gpu", "", int(1.86 * 2**30), gpu={**held, "gpu_reserved": held["gpu_alloc"]})
    assert would_fit(config, bare, budget)[1][0] == "train.micro_batch_size=2"
    # already on, or the user's allocator variable says otherwise: the next fix along the phase
    on = load(None, ["train.micro_batch_size=4", "memory.expandable_segments=true"])
    assert would_fit(on, event, budget)[1][0] == "train.micro_batch_size=2"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert would_fit(config, event, budget)[1][0] == "train.micro_batch_size=2"


def raised_in(function):
    try:
        function()
    except RuntimeError as error:
        return error


def save_checkpoint():
    raise RuntimeError("CUDA out of memory")


def evaluate():
    raise RuntimeError("CUDA out of memory")


def test_failed_phase_and_device():
    import torch

    from zerofit.postmortem import failed_phase, is_oom, oom_device

    def train_step():
        raise RuntimeError("CUDA out of memory")

    assert failed_phase(raised_in(save_checkpoint), "optimizer_step") == "save"
    assert failed_phase(raised_in(evaluate), "optimizer_step") == "eval"
    assert [failed_phase(raised_in(train_step), last) for last in (None, "forward", "backward", "optimizer_step")] \
        == ["forward", "backward", "optimizer_step", "forward"]
    assert oom_device(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), on_gpu=False) == "gpu"
    assert oom_device(MemoryError(), on_gpu=True) == "host"
    assert oom_device(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"),
                      on_gpu=True) == "host"
    assert is_oom(MemoryError()) and is_oom(RuntimeError("CUDA error: out of memory"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


def test_allocator_history_is_skipped_where_torch_breaks_checkpointing():
    from zerofit.postmortem import history_breaks_checkpointing

    assert history_breaks_checkpointing("2.11.0+cu130") and history_breaks_checkpointing("2.13.0+cpu")
    assert not history_breaks_checkpointing("2.10.1") and not history_breaks_checkpointing("2.4.0")


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
