"""Where a run goes on from (resume.py): the command, batch and data position, changed configs, damaged checkpoints."""
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import config_for, read_jsonl, run_zerofit, tiny_config, valid_steps, write_config, write_jsonl

from zerofit.checkpoint import files as checkpoint
from zerofit.core import faults
from zerofit.data import pipeline as data
from zerofit.doctor.run import diagnose
from zerofit.train.resume import resume_command


def test_the_resume_command_says_where_relative_paths_hold(monkeypatch, tmp_path):
    from zerofit.config.load import validate

    monkeypatch.chdir(tmp_path)
    relative = validate(tiny_config(Path("runs/x")))
    assert resume_command(relative) == f"`zerofit train --config runs/x/config.yaml --resume` (from {tmp_path})"
    absolute = validate(tiny_config(tmp_path / "x"))
    assert resume_command(absolute, resume=False) == f"`zerofit train --config {tmp_path / 'x' / 'config.yaml'}`"
    spaced = validate(tiny_config(Path("runs/my run ü")))  # pasted unquoted: "unrecognized arguments: run ü/..."
    assert resume_command(spaced).startswith("`zerofit train --config 'runs/my run ü/config.yaml' --resume`")


def test_printed_commands_start_the_run_as_it_ran():
    from zerofit.recovery.elastic import launcher, running_launcher

    assert launcher(1) == "zerofit" and launcher(2) == "torchrun --nproc_per_node 2 -m zerofit"
    assert launcher(16, 8) == "torchrun --nnodes 2 <rendezvous flags> --nproc_per_node 8 -m zerofit"
    assert running_launcher({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == launcher(4)
    assert running_launcher({}) == "zerofit"


def test_a_resume_that_changes_the_global_batch_is_named():
    from zerofit.train.resume import global_batch_change, keep_batch_advice

    def state(world, micro, accum):
        return checkpoint.LoopState(world_size=world, micro_batch_size=micro,
                                    config_values={"train": {"grad_accum_steps": accum}})

    assert global_batch_change(state(1, 4, 2), state(2, 4, 2)).startswith("8 sequences per optimizer step, this run 16")
    assert global_batch_change(state(1, 4, 1), state(1, 2, 2)) is None  # an OOM retry's split keeps it
    assert global_batch_change(state(2, 4, 1), state(1, 4, 2)) is None  # the planner's split of global_batch_size
    # advice a run's own config.yaml can follow (it pins micro batch and accumulation: "leave them to the
    # planner" ended in "global_batch_size=4 cannot be split as micro_batch_size=2 x grad_accum_steps=1 x 1")
    assert keep_batch_advice(state(2, 2, 1), state(1, 2, 1)).endswith("--set train.grad_accum_steps=2")
    assert keep_batch_advice(state(1, 3, 1), state(2, 2, 1)).startswith("No whole number of micro batches of 2 on 2 rank(s) makes the checkpoint's 3")


def test_data_position_on_another_number_of_ranks():
    # 4 steps on 2 ranks of 4 sequences = 32 sequences = 8 micro batches of 4 on one rank
    two_ranks, one_rank = data.BatchShape(2, 4, 4035), data.BatchShape(1, 4, 4035)
    assert data.carried_position(4, two_ranks, one_rank) == 8
    assert data.carried_position(8, one_rank, two_ranks) == 4
    assert data.carried_position(3, one_rank, two_ranks) == 2  # rounded up: nothing twice
    # a whole first epoch on 2 ranks is a whole first epoch on one
    assert data.carried_position(two_ranks.per_epoch, two_ranks, one_rank) == one_rank.per_epoch
    assert data.carried_position(1, one_rank, data.BatchShape(1, 2, 4035)) == 2  # an OOM retry's halved micro batch


def test_data_position_when_the_training_set_changed():
    """seq_len doubled: half the sequences; the same share of the same epoch carries over."""
    short, long = data.BatchShape(1, 4, 4000), data.BatchShape(1, 4, 2000)  # 1000 and 500 micro batches an epoch
    assert data.carried_position(400, short, long) == 200     # 40% of epoch 1 is 40% of epoch 1
    assert data.carried_position(1401, short, long) == 701    # 40.1% of epoch 2, rounded up to a micro batch
    assert data.carried_position(999, short, long) == 500     # the epoch's last micro batch: the next epoch begins
    assert data.carried_position(250, long, short) == 500


@pytest.mark.e2e
def test_a_latest_that_is_a_directory_is_named_not_a_traceback(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").mkdir()
    refused = run_zerofit(["train", "--config", str(config_for(tmp_path, "run", max_steps=8))], check=False)
    said = refused.stderr.replace("\n", "")
    assert refused.returncode == 1 and "Traceback" not in said, said[-2000:]
    assert f"{run / 'checkpoints' / 'latest'} is a directory where zerofit keeps the name of the newest checkpoint" in said
    assert valid_steps(run) == [4, 6]


@pytest.mark.e2e
def test_every_start_makes_latest_name_the_newest_checkpoint(reference, tmp_path):
    """A crash between a save's rename and its `latest` write left `latest` naming the checkpoint
    before it, and it stayed so (repaired only when missing or skipped): DeepSpeed's own
    zero_to_fp32.py then read the older checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    latest = run / "checkpoints" / "latest"
    latest.write_text("step-000004")  # published 4 and 6; the write of `latest` for 6 never happened
    done = run_zerofit(["train", "--config", str(config_for(tmp_path, "run", max_steps=6))])
    assert "complete at step 6" in " ".join(done.stderr.split())
    assert latest.read_text() == "step-000006" and valid_steps(run) == [4, 6]


@pytest.mark.e2e
def test_resume_with_another_config_names_what_changed(tmp_path):
    """A resume under changed settings names each one, old -> new, in one list said first: what
    the checkpoint records against it, how the run saves, evaluates and logs against the run's
    config.yaml. They were two messages, the checkpoint's after the load: a changed train.seed
    came after the warning about the training tokens it had changed (another eval split), apart
    from checkpoint.keep_last. The checkpoints it saves then carry the settings they were trained
    with, so the next resume compares with those."""
    config = config_for(tmp_path, "run", max_steps=4)
    run_zerofit(["train", "--config", str(config)])
    for before, after, changed in ((4, 6, "checkpoint.keep_last 2 -> 3, train.max_steps 4 -> 6, train.seed 7 -> 8"),
                                   (6, 8, "train.max_steps 6 -> 8")):
        done = run_zerofit(["train", "--config", str(config), "--set", f"train.max_steps={after}", "--resume",
                            "--set", "checkpoint.keep_last=3", "--set", "train.seed=8"], env={"COLUMNS": "400"})
        said = done.stderr.splitlines()
        listed = [i for i, line in enumerate(said) if "under a different config" in line]
        assert len(listed) == 1 and said[listed[0]] == (f"warning: resuming step-{before:06d} under a different config "
                                                        f"({changed}); continuing with the current one"), done.stderr
        assert "settings changed since" not in done.stderr and done.stderr.count("train.seed 7 -> 8") == (before == 4)
        tokens = [i for i, line in enumerate(said) if "the training data's tokens differ" in line]
        assert tokens == [] if before == 6 else listed[0] < tokens[0]  # the seed drew another eval split
    unchanged = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=8", "--resume",
                             "--set", "checkpoint.keep_last=3", "--set", "train.seed=8"])
    assert "different config" not in unchanged.stderr and "is complete at step 8" in unchanged.stderr.replace("\n", " ")


@pytest.mark.e2e
def test_a_resume_on_data_changed_under_the_same_path_is_named(tmp_path):
    """The same file, rows reordered and rewritten, the same number of sequences: the
    position carried over no longer means the rows trained (and the eval split may hold
    trained rows). Named once; the checkpoints then carry the new data's fingerprint.
    Another eval set leaves the training position as it was: nothing to say."""
    rows = [{"instruction": f"spell {i}", "output": "x" * (i % 5 + 3)} for i in range(64)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    held = [write_jsonl(tmp_path / f"e{n}.jsonl", rows[n::9]) for n in (1, 2)]
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", data_path=str(path),
                                                           train={"max_steps": 2}, checkpoint={"every_steps": 2},
                                                           data={"packing": False, "eval_path": str(held[0]),
                                                                 "alpaca_template": "alpaca"}))
    first = run_zerofit(["train", "--config", str(config)], env={"COLUMNS": "400"})
    assert "model/: the tokenizer's chat template is now the layout the data trains (alpaca)" in first.stderr
    write_jsonl(path, [{"instruction": r["instruction"].upper(), "output": r["output"]} for r in reversed(rows)])
    changed = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=4", "--resume"],
                          env={"COLUMNS": "400"})
    assert "the training data's tokens differ from those step-000002 trained on" in changed.stderr
    assert "chat template is now" not in changed.stderr  # model/ holds it already: said once
    again = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=6", "--resume",
                         "--set", f"data.eval_path={held[1]}"])
    assert "tokens differ" not in again.stderr and "resumed from" in again.stderr


@pytest.mark.e2e
def test_a_resume_the_checkpoint_cannot_take_is_refused_before_anything_is_rewritten(reference, tmp_path):
    """Another architecture or precision cannot load the run's checkpoint (DeepSpeed fails with
    missing keys or another optimizer file, after the run's config.yaml and model/ had been
    rewritten for the new config, which an export then used): refused first, naming the
    change and the fix, the run dir as it was. So are checkpoints none of which verifies:
    starting over would publish over them."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    config = config_for(tmp_path, "run", max_steps=8)
    kept = [run / "config.yaml", run / "plan.json", run / "model" / "config.json",
            *sorted((run / "checkpoints").rglob("*.*"))]
    before = [path.read_bytes() for path in kept]
    deeper, relu = tmp_path / "deeper.json", tmp_path / "relu.json"
    deeper.write_text(json.dumps({**json.loads((run / "model" / "config.json").read_text()), "num_hidden_layers": 3}))
    relu.write_text(json.dumps({**json.loads((run / "model" / "config.json").read_text()), "hidden_act": "relu"}))
    for changes, said in (([f"model.config={deeper}", f"model.tokenizer={run / 'model'}"],
                           "model num_hidden_layers 2 -> 3"),
                          ([f"model.config={relu}", f"model.tokenizer={run / 'model'}"],  # same shapes, other function
                           "model hidden_act silu -> relu"),
                          (["train.precision=fp32"], "train.precision bf16 -> fp32")):
        settings = [arg for change in changes for arg in ("--set", change)]
        refused = run_zerofit(["train", "--config", str(config), *settings], check=False, env={"COLUMNS": "400"})
        message = refused.stderr.replace("\n", "")
        assert refused.returncode == 1 and "Traceback" not in message, message[-3000:]
        assert f"step-000006 cannot be loaded under this config ({said})" in message
        assert f"`zerofit train --config {run / 'config.yaml'}`" in message and "--no-resume" in message
    assert [path.read_bytes() for path in kept] == before

    for manifest in (run / "checkpoints").glob("step-*/MANIFEST.json"):
        os.truncate(manifest, 100)
    refused = run_zerofit(["train", "--config", str(config)], check=False, env={"COLUMNS": "400"})
    message = refused.stderr.replace("\n", "")
    assert refused.returncode == 1 and "none of the 2 checkpoint(s) under" in message, message[-3000:]
    assert "MANIFEST.json is corrupt" in message and "--no-resume" in message
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000004", "step-000006"]
    assert not (run / "metrics.jsonl").read_text().count('"step": 7')

    # starting over moves them aside with the records that go with them: nothing is written over
    run_zerofit(["train", "--config", str(config), "--no-resume", "--set", "train.max_steps=2"])
    earlier = next((run / "checkpoints").glob("earlier-*"))
    assert {"step-000004", "step-000006", "metrics.jsonl", "model", "config.yaml"} <= {p.name for p in earlier.iterdir()}
    from zerofit.export.checkpoint import run_model_dir  # the new run rewrites model/: the earlier one's is its copy
    assert run_model_dir(earlier) == earlier / "model" and (earlier / "model" / "config.json").is_file()
    assert max(r["step"] for r in read_jsonl(earlier / "metrics.jsonl")) == 6
    assert max(r["step"] for r in read_jsonl(run / "metrics.jsonl")) == 2
    # the doctor reads the directory as that run, its checkpoints too (it looked for earlier-*/checkpoints/)
    assert {f.step for f in diagnose(earlier).findings if f.kind == "checkpoint_damaged"} == {4, 6}


@pytest.mark.e2e
def test_a_new_run_keeps_the_records_of_an_earlier_one_that_saved_no_checkpoint(tmp_path):
    """A run killed in step 2, before its first save (every 2 steps, kill before step 2's forward),
    leaves metrics.jsonl, memory.jsonl and its last word, no checkpoint. The next start rewrote
    metrics.jsonl, appended its timeline to the old one (the doctor counted a resume) and the
    kill stayed in postmortem/ as this run's history: the evidence of what ended the earlier run
    was gone. Now they are set aside in checkpoints/earlier-TIME/ as --no-resume sets a run aside,
    the start's line says where, and the doctor reads each run on its own."""
    from zerofit.recovery.peerwatch import RECORD

    config = config_for(tmp_path, "run", max_steps=4)
    killed = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: "kill@step:2"}, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run = tmp_path / "run"
    deadline = time.monotonic() + 30  # the last word imports zerofit before it writes
    while not (run / "postmortem" / RECORD).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    written = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "memory.jsonl", f"postmortem/{RECORD}")}
    assert not (run / "checkpoints").exists() and [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]

    done = run_zerofit(["train", "--config", str(config)])
    earlier = next((run / "checkpoints").glob("earlier-*"))
    assert (f"new run in {run.resolve()}: no checkpoint there to resume from; the earlier run's records "
            f"(metrics.jsonl, memory.jsonl, postmortem) are kept in {earlier} (`zerofit doctor` reads them "
            f"there)") in " ".join(done.stderr.split())
    assert {name: (earlier / name).read_bytes() for name in written} == written  # as the killed run left them
    assert (earlier / "config.yaml").is_file() and (earlier / "plan.json").is_file()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["phase"] for r in read_jsonl(run / "memory.jsonl")].count("start") == 1
    assert not (run / "postmortem").exists()
    before = diagnose(earlier)
    assert before.ending == ("killed outright after step 1 (no end record; see the finding); no intact checkpoint "
                             "(step 1 in no intact checkpoint)")
    assert [f.severity for f in before.findings if f.kind == "killed"] == ["error"]
    after = diagnose(run)
    assert after.ending == "completed at step 4; newest intact checkpoint step-000004"
    assert after.summary["resumes"] == 0 and not [f for f in after.findings if f.kind == "killed"]
    again = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=6"])  # a resume: nothing moved
    assert "resumed from" in again.stderr and len(list((run / "checkpoints").glob("earlier-*"))) == 1


@pytest.mark.e2e
def test_a_resume_trains_with_the_current_lr_schedule_and_weight_decay(tmp_path):
    """DeepSpeed's load restores the saved param groups and scheduler base LRs over the current
    config's: a resume with a new train.lr, weight_decay or a raised max_steps trains with
    them (the warning says "continuing with the current one"), from the schedule's position."""
    import torch

    from zerofit.config.load import load
    from zerofit.train.engine import lr_lambda

    config = config_for(tmp_path, "run", max_steps=4)
    run_zerofit(["train", "--config", str(config)])
    changes = ["train.max_steps=8", "train.lr=0.01", "train.weight_decay=0.1"]
    run_zerofit(["train", "--config", str(config), *[arg for change in changes for arg in ("--set", change)]])
    factor = lr_lambda(load(config, changes), 8)
    logged = {record["step"]: record["lr"] for record in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert [logged[step] for step in range(5, 9)] == pytest.approx([0.01 * factor(step - 1) for step in range(5, 9)])
    saved = torch.load(next((tmp_path / "run" / "checkpoints" / "step-000008").glob("*optim_states.pt")),
                       weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
    assert [group["weight_decay"] for group in saved] == [0.1, 0.0]
    assert [group["lr"] for group in saved] == pytest.approx([0.01 * factor(8)] * 2)


@pytest.mark.multirank
def test_resume_on_fewer_ranks(tmp_path):
    """A 2-rank run (async saves) dies in its last save; the run resumes on 1 rank through
    a universal checkpoint: same data position, the loss goes on from where it was."""
    config = config_for(tmp_path, "run", async_save=True)
    killed = run_zerofit(["train", "--config", str(config)], nproc=2, env={faults.VARIABLE: "kill@save:3"},
                         check=False)
    assert killed.returncode != 0
    run = tmp_path / "run"
    assert valid_steps(run) == [2, 4]
    assert json.loads((run / "checkpoints" / "step-000004" / "MANIFEST.json").read_text())["world_size"] == 2
    before = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}
    done = run_zerofit(["train", "--config", str(config), "--resume"])
    stderr = done.stderr.replace("\n", "")
    assert "converting it to a universal checkpoint" in stderr
    assert "data position: 4 micro batches of 4 on 2 rank(s) -> 8 of 4 on 1" in stderr
    # micro batch and accumulation fixed: one rank trains half the batch per step, and says so
    assert "step-000004 trained 8 sequences per optimizer step, this run 4 (ranks 2 -> 1" in stderr
    assert "--set train.grad_accum_steps=2" in stderr
    universal = run / "checkpoints" / "universal-step-000004"
    assert checkpoint.verify(universal, hashes=True) is None
    assert json.loads((universal / "MANIFEST.json").read_text())["source_world_size"] == 2
    after = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}
    assert [after[s] for s in (1, 2, 3, 4)] == [before[s] for s in (1, 2, 3, 4)]
    assert after[5] < before[1] - 0.15 and abs(after[5] - before[4]) < 0.4, after  # continues, not restarted
    state = checkpoint.read_loop_state(run / "checkpoints" / "step-000006")
    assert state.world_size == 1 and state.micro_batches == 8 + 2  # 32 sequences on 2 ranks, then 2 x 4


@pytest.mark.e2e
def test_a_corrupt_newer_checkpoint_is_set_aside_not_kept_by_retention(tmp_path):
    """step-000008 has a flipped byte (its size unchanged); the resume from step 6 with
    keep_last 1 saved 7 and 8, and retention once kept the corrupt 8 (it judged by sizes) and
    deleted every good checkpoint. Now the resume sets it aside and the good ones stay."""
    config = config_for(tmp_path, "run", max_steps=8)
    run_zerofit(["train", "--config", str(config)])
    run = tmp_path / "run"
    target = run / "checkpoints" / "step-000008" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    done = run_zerofit(["train", "--config", str(config), "--resume", "--set", "checkpoint.every_steps=1",
                        "--set", "checkpoint.keep_last=1"])
    said = " ".join(done.stderr.split())
    assert "resumed from" in said and "step 6" in said and "set aside unusable-step-000008" in said
    assert valid_steps(run) == [8] and (run / "checkpoints" / "latest").read_text() == "step-000008"
    assert (run / "checkpoints" / "unusable-step-000008").is_dir()
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 9))


@pytest.mark.e2e
def test_a_damaged_file_read_without_hashes_is_named_with_the_fix(tmp_path):
    """--verify sizes cannot see a changed byte: DeepSpeed's load then failed with a traceback
    ("Expected hasRecord(version)"). Now the error names the checkpoint and --verify full, which
    sets it aside and resumes from the one before."""
    config = config_for(tmp_path, "run", max_steps=4)
    run_zerofit(["train", "--config", str(config)])
    target = tmp_path / "run" / "checkpoints" / "step-000004" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    raw = target.read_bytes()
    name_at = raw.rindex(b"data.pkl")  # in the archive's directory, where torch.load looks first
    target.write_bytes(raw[:name_at - 3] + bytes([raw[name_at - 3] ^ 0xFF]) + raw[name_at - 2:])
    more = ["--set", "train.max_steps=5", "--resume"]
    failed = run_zerofit(["train", "--config", str(config), "--verify", "sizes", *more], check=False)
    said = " ".join(failed.stderr.split())
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert "step-000004 cannot be read on rank 0" in said and "Resume with --verify full" in said
    done = run_zerofit(["train", "--config", str(config), "--verify", "full", *more])
    assert "set aside unusable-step-000004" in " ".join(done.stderr.split())


@pytest.mark.e2e
def test_metrics_stay_one_curve_after_a_kill_at_publish_and_a_torn_line(tmp_path):
    """A kill after step 4's checkpoint was published but before its metrics line was written
    left step 4 out for good; a torn last line (a crash mid-write, a full disk) made every
    resume fail parsing metrics.jsonl."""
    config = config_for(tmp_path, "run", max_steps=6)
    killed = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: "kill@latest:2"}, check=False)
    assert killed.returncode != 0
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 5, "loss": 4.')  # a torn line after the kill
    run_zerofit(["train", "--config", str(config), "--resume"])
    assert [m["step"] for m in read_jsonl(metrics)] == [1, 2, 3, 4, 5, 6]
    assert all(line.startswith("{") and line.endswith("}") for line in metrics.read_text().splitlines())
