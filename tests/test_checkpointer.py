"""The loop's side of checkpoints (checkpointer.py): CPU Adam's step replay, async snapshots, the save
schedule, SIGTERM, Ctrl-C."""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    SHAPE,
    child_env,
    config_for,
    read_jsonl,
    run_zerofit,
    tiny_config,
    trained_run,
    valid_steps,
    wait_for,
    zerofit_command,
)

from zerofit.checkpoint import files as checkpoint
from zerofit.core import faults
from zerofit.doctor.run import diagnose
from zerofit.train import checkpointer


def _cpu_adam_after(steps_before: int, steps_after: int, replay: bool):
    """A parameter after DeepSpeedCPUAdam steps on fixed gradients; with steps_after, the
    optimizer is rebuilt from its state dict in between (a resume), replayed or not."""
    from types import SimpleNamespace

    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    grads = torch.randn(steps_before + steps_after, 4096, generator=torch.Generator().manual_seed(0)) * 0.01
    param = torch.nn.Parameter(torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.1)
    optimizer = DeepSpeedCPUAdam([param], lr=5e-2, betas=(0.9, 0.95))
    for grad in grads[:steps_before]:
        param.grad = grad.clone()
        optimizer.step()
    if steps_after:
        state = optimizer.state_dict()
        optimizer = DeepSpeedCPUAdam([param], lr=5e-2, betas=(0.9, 0.95))
        optimizer.load_state_dict(state)
        if replay:
            assert checkpointer.replay_cpu_adam_steps(SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))) \
                == steps_before
        for grad in grads[steps_before:]:
            param.grad = grad.clone()
            optimizer.step()
    return param.detach().clone()


@pytest.mark.e2e
def test_cpu_adam_resumes_bit_exactly_after_the_step_replay():
    """DeepSpeedCPUAdam's C++ bias-correction powers: a resumed optimizer drifts from the
    uninterrupted one unless its step state is replayed (checkpointer.replay_cpu_adam_steps)."""
    import torch

    straight = _cpu_adam_after(12, 0, replay=False)
    assert not torch.equal(_cpu_adam_after(6, 6, replay=False), straight)  # DeepSpeed's own resume drifts
    assert torch.equal(_cpu_adam_after(6, 6, replay=True), straight)


@pytest.mark.e2e
def test_async_snapshot_cap_is_half_the_plans_host_budget(tmp_path):
    """The run caps its snapshot buffer as the planner did: half of plan.host_mem (it took half
    the RAM available, so a plan made for a 100 MiB budget reserved gigabytes at run time)."""
    config = tiny_config(tmp_path / "run", train={"max_steps": 2}, checkpoint={"every_steps": 2, "async_save": True},
                         plan={"host_mem": "100MiB", "enabled": False}, **SHAPE)
    run, _, done = trained_run(tmp_path, config)
    assert "snapshots (at most 50.0MiB: checkpoint.async_host_max_gib" in done.stderr.replace("\n", " ")
    assert valid_steps(run) == [2]
    # the rate is the bytes over the writer's own time (a tiny checkpoint's read "0.00 GB/s")
    written = next(r for r in read_jsonl(run / "memory.jsonl") if r.get("phase") == "checkpoint_written")
    said = re.search(r"checkpoint step-000002: \S+ written in the background in ([0-9.]+) s \(([0-9.]+) (GB|MB|kB)/s\)",
                     done.stderr.replace("\n", " "))
    assert said, done.stderr[-2000:]
    rate = float(said[2]) * {"GB": 1e9, "MB": 1e6, "kB": 1e3}[said[3]]
    assert rate > 0 and abs(float(said[1]) - written["write_seconds"]) < 0.01
    seconds = written["write_seconds"]  # the record keeps milliseconds: a 7 ms write is 0.0065-0.0075 s
    assert written["bytes"] / (seconds + 5e-4) * 0.95 <= rate <= written["bytes"] / max(seconds - 5e-4, 1e-6) * 1.05
    # run_dir is read from the working directory: a fresh start says where it trains, so that a resume
    # started from another directory is not mistaken for one
    assert f"new run in {run.resolve()}: no checkpoint there to resume from" in done.stderr.replace("\n", "")


@pytest.mark.e2e
def test_a_run_saves_on_a_schedule_by_default_and_by_the_clock(tmp_path):
    """checkpoint.every_steps was 0 by default: nothing was saved before the end, and a run
    stopped at step 52 kept nothing. Now every 500 steps (HF Trainer's save_steps) or every 30
    minutes, whichever comes first; the clock's schedule here at 0.3 s with no step schedule."""
    from zerofit.config.schema import CheckpointConfig

    assert (CheckpointConfig().every_steps, CheckpointConfig().every_minutes) == (500, 30.0)
    config = tiny_config(tmp_path / "run", train={"max_steps": 40}, **SHAPE,
                         checkpoint={"every_steps": 0, "every_minutes": 0.005, "save_final": False, "keep_last": 40})
    run, _, done = trained_run(tmp_path, config)
    saved = [r for r in read_jsonl(run / "memory.jsonl") if r.get("phase") == "save"]
    assert len(saved) >= 2 and valid_steps(run) == [r["step"] for r in saved], done.stderr[-2000:]


def sigterm_once_there(args: list[str], path: Path, env: dict, nproc: int = 1) -> tuple[int, str, str]:
    """Start zerofit ARGS on `nproc` ranks, SIGTERM it (torchrun, for several) once `path` exists
    (or it ended, or 300 s passed); its exit code, stdout and stderr."""
    process = subprocess.Popen(zerofit_command(args, nproc), cwd=ROOT, env=child_env(env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for(path, process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


@pytest.mark.e2e
def test_sigterm_drains_the_save_in_flight(tmp_path):
    """SIGTERM while an async save is being written (the writer is slowed by 2 s): the
    loop stops at the next step boundary, the save is finished and published, exit 143.
    Saves are 20 steps apart: the signal lands well before another save is due, however
    late this poll sees the first one start (tiny steps take a few ms)."""
    config = config_for(tmp_path, "run", max_steps=60, async_save=True, every_steps=20)
    code, _, stderr = sigterm_once_there(["train", "--config", str(config)],
                                         tmp_path / "run" / "checkpoints" / ".tmp-step-000020",
                                         {faults.VARIABLE: "slow@save:1"})
    assert code == 143, stderr[-3000:]
    run = tmp_path / "run"
    stopped_at = read_jsonl(run / "metrics.jsonl")[-1]["step"]
    assert 20 <= stopped_at < 40
    # and the step it stopped at saved (checkpoint.save_on_sigterm), the hint naming the run's config
    assert valid_steps(run) == sorted({20, stopped_at}) and not list((run / "checkpoints").glob(".tmp-*"))
    assert (f"stopped by SIGTERM at step {stopped_at}, the newest checkpoint is {checkpoint.step_name(stopped_at)}; "
            f"`zerofit train --config {run / 'config.yaml'} --resume` continues from it") in stderr.replace("\n", "")
    # the doctor tells how the run ended too (it said nothing: no findings, "N steps")
    assert diagnose(run).ending == f"stopped by SIGTERM at step {stopped_at}; newest intact checkpoint " \
                                   f"{checkpoint.step_name(stopped_at)}"


@pytest.mark.e2e
def test_sigterm_while_starting_ends_by_way_of_python(tmp_path):
    """SIGTERM during start-up (the run's files written, the engine being built): exit 143 with
    a message, not a silent death that the last word then records as unexplained."""
    config = config_for(tmp_path, "run", max_steps=60)
    code, _, stderr = sigterm_once_there(["train", "--config", str(config)], tmp_path / "run" / "config.yaml", {})
    run = tmp_path / "run"
    assert not (run / "metrics.jsonl").exists(), "the SIGTERM came after step 1: the test's premise failed"
    assert code == 143, stderr[-3000:]
    assert "zerofit: stopped by SIGTERM outside the training loop (start-up or wind-down)" in stderr
    time.sleep(1)  # a last word would have written by now
    assert not list(run.glob("postmortem/**/*.json"))


@pytest.mark.multirank
def test_a_rank_killed_in_a_save_leaves_its_peer_a_message_not_a_traceback(tmp_path):
    """Rank 1 killed outright in the save of step 4: rank 0, inside the save's collective, got
    gloo's "Connection closed by peer" as a 60-line traceback. Now one line: a peer is gone,
    the published checkpoints stand, and the command that resumes on both ranks."""
    config = config_for(tmp_path, "run", max_steps=8)
    done = run_zerofit(["train", "--config", str(config)], nproc=2, check=False,
                       env={faults.VARIABLE: "kill@save:2", "ZEROFIT_FAULT_RANKS": "1", "COLUMNS": "400"})
    assert done.returncode != 0
    said = " ".join((done.stdout + done.stderr).split())
    assert "[rank0]: Traceback" not in said and "[rank0]:" not in said, said[-3000:]
    # gloo says closed or reset, as the kill lands; the peer watcher may see it first and say so
    assert re.search(r'zerofit: error: rank 0: another rank of this run is gone \("Connection (closed|reset) by peer" '
                     r'in a collective\)', said) or "leaving now" in said, said[-3000:]
    assert valid_steps(tmp_path / "run") == [2]


@pytest.mark.multirank
def test_sigterm_to_torchrun_stops_both_ranks_at_a_step_boundary(tmp_path):
    """Preemption under torchrun: the agent passes SIGTERM on to both ranks, both alive, so
    neither leaves early (that is for a rank whose peer has exited): they stop together at a
    step boundary and the newest checkpoint is whole."""
    config = config_for(tmp_path, "run", max_steps=400, every_steps=5)
    _, stdout, stderr = sigterm_once_there(["train", "--config", str(config)],
                                           tmp_path / "run" / "checkpoints" / "step-000005", {"COLUMNS": "400"}, nproc=2)
    out = stdout + stderr
    assert "stopped by SIGTERM at step" in out, out[-3000:]
    assert "leaving now" not in out and "forcefully exiting" not in out
    # the command it names resumes on the same two ranks (one process would halve the batch)
    assert f"`torchrun --nproc_per_node 2 -m zerofit train --config {tmp_path / 'run' / 'config.yaml'} --resume`" in out
    stopped_at = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["step"]
    assert 5 <= stopped_at < 400
    assert valid_steps(tmp_path / "run")[-1] == stopped_at  # saved where both stopped


@pytest.mark.e2e
def test_a_first_ctrl_c_finishes_the_step_saves_it_and_resumes_from_there(tmp_path):
    """Ctrl-C lost every step since the last save (a long run interrupted at step 52 kept
    nothing): now the first one finishes the step, saves it and exits 130, as SIGTERM does,
    and a resume goes on from that step."""
    config = config_for(tmp_path, "run", max_steps=400, every_steps=5)
    process = subprocess.Popen(zerofit_command(["train", "--config", str(config)]), cwd=ROOT, env=child_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "run" / "checkpoints" / "step-000005", process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    said = " ".join(stderr.split())
    assert process.returncode == 130, stderr[-2000:]
    run = tmp_path / "run"
    stopped_at = read_jsonl(run / "metrics.jsonl")[-1]["step"]
    assert 5 <= stopped_at < 400
    assert f"Ctrl-C: finishing step {stopped_at} and saving; press again to abort" in said
    assert valid_steps(run)[-1] == stopped_at and not list((run / "checkpoints").glob(".tmp-*"))
    assert (f"stopped by Ctrl-C at step {stopped_at}, the newest checkpoint is {checkpoint.step_name(stopped_at)}; "
            f"`zerofit train --config {run / 'config.yaml'} --resume` continues from it") in said
    assert diagnose(run).ending == f"stopped by Ctrl-C at step {stopped_at}; newest intact checkpoint " \
                                   f"{checkpoint.step_name(stopped_at)}"
    resumed = run_zerofit(["train", "--config", str(run / "config.yaml"), "--resume",
                           "--set", f"train.max_steps={stopped_at + 2}"])
    assert f"resumed from {run / 'checkpoints' / checkpoint.step_name(stopped_at)} at step {stopped_at}" \
        in " ".join(resumed.stderr.split())
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, stopped_at + 3))


@pytest.mark.e2e
def test_a_second_ctrl_c_aborts_at_once_and_names_the_checkpoint_to_go_on_from(tmp_path):
    """A step that does not end (stall@step:3): the first Ctrl-C waits for it, the second aborts
    there, naming the newest checkpoint and the command that continues from it."""
    config = config_for(tmp_path, "run", max_steps=400)
    process = subprocess.Popen(zerofit_command(["train", "--config", str(config)]), cwd=ROOT,
                               env=child_env({faults.VARIABLE: "stall@step:3"}), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "run" / "checkpoints" / "step-000002", process)
    time.sleep(3)  # into step 3, which stalls
    process.send_signal(signal.SIGINT)
    time.sleep(1)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    said = " ".join(stderr.split())
    assert process.returncode == 130, stderr[-2000:]
    assert "Ctrl-C: finishing step 3 and saving; press again to abort" in said
    assert "zerofit: interrupted; the newest checkpoint is step-000002" in said
    assert f"`zerofit train --config {tmp_path / 'run' / 'config.yaml'} --resume` continues from it" in said
    run = tmp_path / "run"
    assert valid_steps(run) == [2]
    assert diagnose(run).ending == "interrupted (Ctrl-C) at step 2; newest intact checkpoint step-000002"


@pytest.mark.multirank
def test_ctrl_c_under_torchrun_says_it_once(tmp_path):
    """A terminal's Ctrl-C reaches every rank (the foreground process group): each printed the
    "interrupted" line, so two ranks said the same thing twice."""
    config = config_for(tmp_path, "run", max_steps=400)
    process = subprocess.Popen(zerofit_command(["train", "--config", str(config)], nproc=2), cwd=ROOT,
                               env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    wait_for(tmp_path / "run" / "checkpoints" / "step-000002", process)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal sends it: torchrun and both ranks
    _, stderr = process.communicate(timeout=300)
    # torchrun passes its Ctrl-C on to the ranks, which got the terminal's: one Ctrl-C, not an abort
    said = [line for line in stderr.splitlines() if "stopped by Ctrl-C at step" in line]
    assert process.returncode != 0, stderr[-2000:]
    assert len(said) == 1 and "the newest checkpoint is step-0000" in said[0], stderr[-3000:]
    assert stderr.count("press again to abort") == 1 and "zerofit: interrupted" not in stderr, stderr[-3000:]
    stopped_at = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["step"]
    assert valid_steps(tmp_path / "run")[-1] == stopped_at  # saved where both stopped
