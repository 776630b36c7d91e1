"""The watchdog stopping a real tiny run (a tiny threshold trips it on the host), and its
pure decisions. Its save action on a real run: test_doctor's near-budget run."""
import json

import pytest
from conftest import read_jsonl, run_zerofit, tiny_config, write_config
from timelines import GiB, synthetic_run

from zerofit.findings.facts import RunFacts
from zerofit.train.watchdog import Watchdog, crossings, usage

WIDE = {"COLUMNS": "400"}


def watched_run(base, action, threshold=0.01, check=True, env=None):
    config = write_config(base / "c.yaml", tiny_config(base / "run", train={"max_steps": 5},
                                                         checkpoint={"every_steps": 0},
                                                         memory={"watchdog_threshold": threshold,
                                                                 "watchdog_action": action}))
    return base / "run", run_zerofit(["train", "--config", str(config)], env={**WIDE, **(env or {})}, check=check)


@pytest.mark.e2e
def test_stop_action_saves_and_stops_with_exit_1(tmp_path):
    # the allocator's newer variable name is what the run started with: the doctor's advice reads it
    run, done = watched_run(tmp_path, "stop", check=False, env={"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    start = next(r for r in read_jsonl(run / "memory.jsonl") if r["phase"] == "start")
    assert RunFacts(alloc_conf=start["alloc_conf"]).expandable_segments_on
    assert done.returncode == 1
    assert "zerofit: error: watchdog: host memory" in done.stderr
    assert f"checkpoint: {run / 'checkpoints' / 'step-000001'}" in done.stderr
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1]
    assert json.loads((run / "checkpoints" / "step-000001" / "loop_state.json").read_text())["step"] == 1
    assert (run / "checkpoints" / "latest").read_text() == "step-000001"


@pytest.mark.e2e
@pytest.mark.parametrize("async_save, fault", [(False, "nospace@save:1"), (True, "enospc@save:1")])
def test_stop_after_a_failed_save_names_no_checkpoint_of_that_step(tmp_path, async_save, fault):
    """The watchdog's save fails (a full disk before it, or the background writer's ENOSPC;
    checkpoint.on_error continue): the stop names the checkpoint that exists, not the step's
    that does not."""
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", train={"max_steps": 5},
                                                             checkpoint={"every_steps": 0, "on_error": "continue",
                                                                         "async_save": async_save},
                                                             memory={"watchdog_threshold": 0.01,
                                                                     "watchdog_action": "stop"}))
    done = run_zerofit(["train", "--config", str(config)], env={**WIDE, "ZEROFIT_FAULT": fault}, check=False)
    assert done.returncode == 1 and "checkpoint step-000001 was not saved" in done.stderr
    assert "checkpoint: none of step 1 (its save failed, above); the newest is none" in done.stderr
    assert not (tmp_path / "run" / "checkpoints" / "step-000001").exists()


def test_usage_and_crossings_are_pure():
    records = [r for r in synthetic_run(steps=3, base=18 * GiB) if r["step"] == 3]
    facts = RunFacts(gpu_budget=24 * GiB, host_budget=128 * GiB, host_total=128 * GiB)
    use = usage(records, facts, gpu_outside_torch=GiB)
    assert use["gpu"] == (18 * GiB + 5 * GiB + 256 * 2**20 + GiB, 24 * GiB)  # peak reserved + outside torch
    assert use["host"] == (34 * GiB, 128 * GiB)  # machine-wide: total - available
    found = crossings(3, use, 0.9, "save")
    assert [c.device for c in found] == ["gpu"] and found[0].fraction > 1
    assert "saving a checkpoint now" in found[0].message()
    own = usage(records, RunFacts(host_budget=32 * GiB, host_budget_is_machine=False))
    assert own["host"] == (30 * GiB + 512 * 2**20, 32 * GiB) and "gpu" not in own  # this process's peak RSS


def test_watchdog_rearms_after_falling_below():
    facts = RunFacts(host_budget=100, host_total=100, host_budget_is_machine=False)
    dog = Watchdog(facts, 0.9, "warn", on_gpu=False)
    high, low = [{"host_peak": 95}], [{"host_peak": 50}]
    assert dog.check(1, high) is not None
    assert dog.check(2, high) is None  # still over: no second action
    assert dog.check(3, low) is None
    assert dog.check(4, high).step == 4  # re-armed
