"""The OOM retry with several ranks (elastic.py): hand-overs through torchrun's restarts and store, one node or two."""
import dataclasses
import json

import pytest
from conftest import OOM_AT_5, WIDE, agent_store_env, oom_config, read_jsonl, run_two_nodes, run_zerofit, tiny_config

from zerofit.config.load import validate
from zerofit.recovery import elastic
from zerofit.recovery.oomreport import retry_line
from zerofit.recovery.postmortem import OomEvent


@pytest.mark.multirank
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


@pytest.mark.multirank
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


@pytest.mark.multirank
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


@pytest.mark.multirank
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
